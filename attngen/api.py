"""attngen.compile: a kernel from a spec, just in time (runtime) or from an ahead-of-time bundle (bundle)."""
from __future__ import annotations

import os

from .errors import InputError
from .lang.spec import Spec


def compile(spec: Spec | str | os.PathLike, target: str | None = None, *, cache_dir: str | os.PathLike | None = None,
            classify: bool = True, bundle: str | os.PathLike | None = None, strict: bool = False, backend: str | None = None,
            deterministic: bool | None = None):
    """Parse, check, plan, render, cache and load a spec. `spec` is a path, spec text, or a Spec;
    `target` overrides the spec's target (a name from `attngen targets`, or "auto"). `classify=False`
    builds kernels that visit and mask every tile (a baseline to measure tile classification against).
    `bundle`: a directory from `attngen build -o DIR`; its prebuilt binaries of this spec for the live GPU are
    used (no compilation), else a BundleWarning says why and the spec is compiled just in time (with
    strict=True: BundleError). See attngen.load. `backend`: auto, triton or gluon, overriding the spec's
    `backend` setting (the generator of the forward on sm_90: auto takes Gluon where it supports the spec).
    `deterministic`: overrides the spec's setting (False: the backward may add dQ in no fixed order, faster where
    measured so; its last bits may then differ between runs)."""
    if bundle is not None:
        if not classify:
            raise InputError("classify=False builds a measurement baseline, which bundles do not hold; drop bundle= or classify=")
        from .aot import load
        from .lang.check import read_spec

        if backend is not None or deterministic is not None:
            raise InputError("a bundle holds the kernels of the generators its build chose from the spec's own backend and "
                             "deterministic settings; set them in the spec and rebuild, or drop bundle=")
        return load(bundle, spec=read_spec(spec), strict=strict, target=target, cache_dir=cache_dir)
    from . import runtime

    return runtime.compile(spec, target, cache_dir=cache_dir, classify=classify, backend=backend, deterministic=deterministic)
