"""Generated modules: written to the disk cache (atomically, digest-checked), imported once per process; the
device check every kernel call makes first (CPU tensors need Triton's interpreter, set before Triton), which
generator's kernels a GPU runs, and the state every interpreter run holds."""
from __future__ import annotations

import contextlib
import functools
import importlib.util
import os
import sys
import threading
from pathlib import Path
from types import ModuleType
from typing import TYPE_CHECKING

import numpy as np

from .. import cache
from ..errors import InputError

if TYPE_CHECKING:
    import torch

_modules: dict[str, ModuleType] = {}
lock = threading.Lock()  # held while a module is imported, and by bundle loading while it installs binaries


def _import(path: Path) -> ModuleType:
    name = f"attngen_generated_{path.stem}"
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # Triton resolves a kernel's globals and source through its module
    spec.loader.exec_module(module)
    return module


def load_module(name: str, key: str, source: str, cache_dir: Path | None = None) -> ModuleType:
    """The generated module of `key`: imported once per process, from the disk cache; written into `cache_dir`
    (default: cache.cache_dir()) whichever directory it was first imported from."""
    with lock:
        module = _modules.get(key)
        if module is not None and Path(module.__file__) == cache.module_path(name, key, cache_dir):
            return module  # imported from this very file: no disk access (dropout_mask asks on every call)
        path = cache.store(name, key, source, cache_dir)
        if module is None:
            module = _import(path)
            _modules[key] = module
    return module


def check_device(device: torch.device, module: ModuleType | None = None) -> None:
    if device.type == "cpu":
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise InputError("CPU tensors run through Triton's interpreter: set TRITON_INTERPRET=1 before importing triton, or use CUDA tensors")
        _check_interpreted(module)
    elif device.type != "cuda":
        raise InputError(f"unsupported device {device}")


_INTERPRET_LATE = ("TRITON_INTERPRET=1 was set after {what} was imported, so its kernels were made for the GPU and cannot "
                   "run in the interpreter (Triton reads the variable when it defines a kernel). Set it before anything "
                   "imports triton or attngen compiles a spec: `TRITON_INTERPRET=1 python script.py`, or os.environ at "
                   "the very top of the script")


def _check_interpreted(module: ModuleType | None) -> None:
    """CPU calls need Triton's own library functions and the generated kernels defined in interpreter mode;
    otherwise Triton fails deep inside with 'Cannot call @triton.jit'd outside of the scope of a kernel'."""
    import triton.language.standard as standard
    from triton.runtime.jit import JITFunction

    if isinstance(standard.sigmoid, JITFunction):
        raise InputError(_INTERPRET_LATE.format(what="triton"))
    if module is not None and any(isinstance(f, JITFunction) for f in vars(module).values()):
        raise InputError(_INTERPRET_LATE.format(what=f"the generated module {Path(module.__file__).name}"))


_interpreter_lock = threading.RLock()


@contextlib.contextmanager
def interpreted():
    """Held around every run of generated kernels on CPU tensors: one run at a time per process, since Triton's
    interpreter patches module-wide state while a kernel runs (concurrent runs from several threads failed with
    "Did you forget to add @triton.jit?"); and numpy's division warnings off, since a row that keeps no key has
    lse = m + log2(0) = -inf by design."""
    with _interpreter_lock, np.errstate(divide="ignore"):
        yield


def interpreted_if_cpu(device: torch.device):
    """interpreted() for CPU tensors, nothing for a GPU's."""
    return interpreted() if device.type == "cpu" else contextlib.nullcontext()


@functools.lru_cache(maxsize=None)
def is_sm90(device: torch.device) -> bool:
    """Gluon's kernels are Hopper's: a kernel planned for the H100 but called on another GPU (or the CPU) runs
    the Triton generator's forward, which Triton compiles for the device at hand."""
    import torch

    return device.type == "cuda" and _capability(torch.cuda.current_device() if device.index is None else device.index) == (9, 0)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    """A GPU's compute capability, asked once (every call of a kernel asks which generator's kernels can run)."""
    import torch

    return torch.cuda.get_device_capability(index)
