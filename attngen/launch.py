"""Kernel launches without Triton's JIT dispatch, for the generated modules of both generators.

`fn[grid](*args, **kwargs)` re-derives on every call what the kernel is specialized on: it binds every argument,
computes the cache key and checks the globals the kernel read. On the H100's host that cost about 60 us per
launch (cProfile, BENCHMARKS.md, 2026-11-25 session 5), more than the GPU needs for a 1024-token forward. The
kernel compiled for a specialization does not change, so a `Launcher` lets the first call of each specialization
go through the JIT (which compiles, or finds the binary: a cached or bundled one), keeps the kernel it launched,
and launches that kernel directly for later calls whose arguments specialize the same way.

The key holds everything Triton 3.6's binder specializes on (`specialization` of each positional argument, and
the keyword arguments: constexprs and launch options, by value), so no call reaches a kernel compiled for other
arguments; tests/test_launch.py checks this against Triton's own binder. Calls go through the JIT while a launch
hook is set (a profiler: the JIT calls it) and where the kernel is not a JITFunction (Triton's CPU interpreter;
the recorders attngen.bundle swaps in while it builds a bundle).
"""
from __future__ import annotations

from typing import Any

import torch
import triton
from triton.runtime import driver


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launchers' host code (triton.cdiv is a constexpr function: about 4 us per call from
    Python, against a fraction of one for this)."""
    return -(-a // b)


class Launcher:
    """`Launcher(globals(), "_attn_fwd", num_warps=4)(grid, *args, **kwargs)` launches the module's kernel
    `_attn_fwd` as `_attn_fwd[grid](*args, num_warps=4, **kwargs)` would. The kernel is looked up in `namespace`
    on every call, so a stand-in put there (attngen.bundle's recorders) is what runs."""

    def __init__(self, namespace: dict, name: str, **options: Any):
        self.namespace, self.name, self.options = namespace, name, options
        self.kernels: dict[tuple, tuple] = {}  # key -> (the compiled kernel, the values of the parameters after args)

    def __call__(self, grid, *args, **kwargs):
        fn = self.namespace[self.name]
        hooks = triton.knobs.runtime
        if not isinstance(fn, triton.runtime.JITFunction) or hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls:
            return fn[grid](*args, **self.options, **kwargs)
        device = driver.active.get_current_device()
        key = (device, tuple(kwargs.items()), *_specializations(args))
        found = self.kernels.get(key)
        if found is None:
            kernel = fn[grid](*args, **self.options, **kwargs)
            # what the JIT passes after the positional arguments: the keyword ones and the defaults, in the
            # kernel's parameter order (constexprs among them: the compiled launcher skips those)
            rest = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in fn.params[len(args):])
            self.kernels[key] = (kernel, rest)
            return kernel
        kernel, rest = found
        grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
        kernel.run(grid_x, grid_y, grid_z, driver.active.get_current_stream(device), kernel.function,
                   kernel.packed_metadata, None, None, None, *args, *rest)
        return kernel


def _specializations(args: tuple) -> list:
    """[specialization(a) for a in args], with the cases most arguments are (plain ints: strides and sizes;
    tensors) written out in place: a Python call per argument was half of a launch's host time for kernels of ~35
    arguments (20 us against 8 for 36 arguments on the 2-core CPU machine)."""
    tensor = torch.Tensor
    return [(a == 1, a % 16 == 0, -2**31 <= a < 2**31, a < 2**63) if type(a) is int
            else (a.dtype, a.data_ptr() % 16 == 0) if type(a) is tensor else specialization(a) for a in args]


def specialization(arg) -> Any:
    """What Triton 3.6's binder specializes a kernel argument on: a tensor's dtype and 16-byte alignment; an
    integer's equality to 1, divisibility by 16 and width; a TMA descriptor's element type, block and layout;
    the value of a flag or None (constexprs); the type of anything else (a float is an fp32 argument)."""
    if isinstance(arg, torch.Tensor):
        return arg.dtype, arg.data_ptr() % 16 == 0
    if arg is None or isinstance(arg, bool):
        return arg
    if isinstance(arg, triton.language.constexpr):  # the JIT compiles its value in, so the value is part of the key
        return "constexpr", arg.value
    if isinstance(arg, int):
        return arg == 1, arg % 16 == 0, -2**31 <= arg < 2**31, arg < 2**63
    block = getattr(arg, "block_shape", None)
    if block is not None and hasattr(arg, "base"):  # a host TensorDescriptor (Triton's or Gluon's)
        return type(arg), arg.base.dtype, tuple(block), getattr(arg, "layout", None)
    return type(arg)
