"""Just-in-time compilation: a spec parsed, checked, planned, given its generators, rendered, cached and loaded
into a Kernel (attngen.compile without bundle=; attngen/aot loads prebuilt binaries instead)."""
from __future__ import annotations

import dataclasses
import os
from pathlib import Path

from ..cache import module_path
from ..codegen.gluon import build_source as build_gluon_source
from ..codegen.gluon import choose as choose_generator
from ..codegen.triton import build_source
from ..errors import InputError
from ..lang.check import read_spec
from ..lang.spec import Backend, Spec
from ..plan.planner import plan as make_plan
from .kernel import Kernel
from .loader import load_module


def compile(spec: Spec | str | os.PathLike, target: str | None = None, *, cache_dir: str | os.PathLike | None = None,
            classify: bool = True, backend: str | None = None, deterministic: bool | None = None) -> Kernel:
    """Parse, check, plan, render, cache and load a spec just in time (attngen.compile, with bundle=, takes
    prebuilt binaries instead). `spec` is a path, spec text, or a Spec; `target` overrides the spec's target (a
    name from `attngen targets`, or "auto"). `classify=False` builds kernels that visit and mask every tile (a
    baseline to measure tile classification against). `backend` overrides the spec's: auto, triton or gluon
    (the generator of each pass on sm_90; attngen/codegen/gluon/choice.py). `deterministic` overrides the spec's
    setting (False lets the backward add dQ in no fixed order where that is faster)."""
    spec_obj = read_spec(spec)
    if deterministic is not None:
        if not isinstance(deterministic, bool):
            raise InputError(f"deterministic must be True or False; got {deterministic!r}")
        spec_obj = dataclasses.replace(spec_obj, deterministic=deterministic)
    kernel_plan = make_plan(spec_obj, target, classify=classify)
    choice = choose_generator(spec_obj, kernel_plan, _backend(backend))
    key, source = build_source(kernel_plan)
    cache_path = Path(cache_dir) if cache_dir else None
    module = load_module(spec_obj.name, key, source, cache_path)
    kern = Kernel(spec_obj, kernel_plan, source, module_path(spec_obj.name, key, cache_path), module)
    kern.generator = choice
    if choice.gluon is not None:
        key, kern.gluon_source = build_gluon_source(choice.gluon)
        kern.gluon = load_module(f"{spec_obj.name}_gluon", key, kern.gluon_source, cache_path)
    return kern


def _backend(backend: str | Backend | None) -> Backend | None:
    if backend is None or isinstance(backend, Backend):
        return backend
    try:
        return Backend(backend)
    except ValueError:
        raise InputError(f"backend must be one of {', '.join(b.value for b in Backend)}; got {backend!r}") from None
