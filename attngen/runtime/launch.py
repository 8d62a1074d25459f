"""Kernel launches without Triton's JIT dispatch, for the generated modules of both generators.

`fn[grid](*args, **kwargs)` re-derives on every call what the kernel is specialized on: it binds every argument,
computes the cache key and checks the globals the kernel read. On the H100's host that cost about 60 us per
launch (cProfile, 2026-11-25), more than the GPU needs for a 1024-token forward. The
kernel compiled for a specialization does not change, so a `Launcher` lets the first call of each specialization
go through the JIT (which compiles, or finds the binary: a cached or bundled one), keeps the kernel it launched,
and launches that kernel directly for later calls whose arguments specialize the same way.

The key holds everything Triton 3.6's binder specializes on (`specialization` of each positional argument, and
the keyword arguments: constexprs and launch options, by value), so no call reaches a kernel compiled for other
arguments; tests/test_launch.py checks this against Triton's own binder. Calls go through the JIT while a launch
hook is set (a profiler: the JIT calls it) and where the kernel is not a JITFunction (Triton's CPU interpreter;
the recorders attngen.bundle swaps in while it builds a bundle).

A generated module may go further for calls like ones made before: a `Recipe` replays a launch's arguments from
the call's tensors, and `Launcher.launch_as` takes the module's call signature in place of the key.
"""
from __future__ import annotations

import inspect
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
        self.known: dict[tuple, tuple] = {}  # (device, launch_as's known, keyword arguments) -> the same
        self.direct: dict[tuple, Any] = {}  # the same key -> its _DirectLaunch, or False where there is none

    def __call__(self, grid, *args, **kwargs):
        return self.launch_as(None, grid, *args, **kwargs)

    def launch_as(self, known, grid, *args, **kwargs):
        """As a call, where `known` (hashable; None: not known) stands for the arguments' specialization: the
        caller guarantees that calls with equal `known` and keyword arguments specialize alike (a generated
        module's Recipe, keyed by every shape, stride, element type and alignment its arguments follow from), so
        a known call skips the key of every argument (10 us a launch on the H100's host)."""
        fn = self.namespace[self.name]
        if _through_jit(fn):
            return fn[grid](*args, **self.options, **kwargs)
        device = driver.active.get_current_device()
        found = None if known is None else self.known.get(_known_key(device, known, kwargs))
        if found is None:
            key = (device, tuple(kwargs.items()), *_specializations(args))
            found = self.kernels.get(key)
            if found is None:
                kernel = fn[grid](*args, **self.options, **kwargs)
                # what the JIT passes after the positional arguments: the keyword ones and the defaults, in the
                # kernel's parameter order (constexprs among them: the compiled launcher skips those)
                rest = tuple(kwargs[p.name] if p.name in kwargs else p.default for p in fn.params[len(args):])
                found = self.kernels[key] = (kernel, rest)
                if known is not None:
                    self._know(_known_key(device, known, kwargs), found)
                return kernel
            if known is not None:
                self._know(_known_key(device, known, kwargs), found)
        kernel, rest = found
        grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
        kernel.run(grid_x, grid_y, grid_z, driver.active.get_current_stream(device), kernel.function,
                   kernel.packed_metadata, None, None, None, *args, *rest)
        return kernel

    def launch_recipe(self, known, grid, recipe: Recipe, tensors: tuple, **kwargs):
        """launch_as(known, grid, *recipe.args(tensors), **kwargs), the arguments made straight into the form
        Triton's compiled launcher takes (_DirectLaunch): no descriptor objects, no pass of Triton's Python over
        the arguments. Where that form cannot be made (see _DirectLaunch.of), as launch_as."""
        fn = self.namespace[self.name]
        if _through_jit(fn):
            return fn[grid](*recipe.args(tensors), **self.options, **kwargs)
        device = driver.active.get_current_device()
        key = _known_key(device, known, kwargs)
        direct = self.direct.get(key)
        if not direct:
            kernel = self.launch_as(known, grid, *recipe.args(tensors), **kwargs)
            if direct is None and key in self.known:
                if len(self.direct) >= KEPT_CALLS:
                    self.direct.clear()
                self.direct[key] = _DirectLaunch.of(*self.known[key], recipe) or False
            return kernel
        direct(grid, tensors, driver.active.get_current_stream(device))
        return direct.kernel

    def bind(self, known, grid, recipe: Recipe, **kwargs) -> BoundLaunch:
        """launch_recipe(known, grid, recipe, tensors, **kwargs) as a function of the tensors alone, for a generated
        module to keep beside a call signature's recipe (BoundLaunch)."""
        return BoundLaunch(self, known, grid, recipe, kwargs)

    def _know(self, key: tuple, found: tuple) -> None:
        if len(self.known) >= KEPT_CALLS:  # many signatures (lengths varying call by call): start again
            self.known.clear()
        self.known[key] = found


class BoundLaunch:
    """One call signature's launch (Launcher.bind): `bound(tensors)` is `launcher.launch_recipe(known, grid, recipe,
    tensors, **kwargs)`. Once that has made the direct form (_DirectLaunch) it is kept here and called with no key
    built or looked up per call, for as long as the module's kernel is the one it was made from, no launch hook
    is set and the current device is the one it was made on; otherwise the call goes through launch_recipe. (A
    launch of a training layer's backward spent a few microseconds of the H100 host's time building and hashing
    the signature's key, twice per call.)"""

    __slots__ = ("launcher", "known", "grid", "recipe", "kwargs", "direct", "fn", "device")

    def __init__(self, launcher: Launcher, known, grid, recipe: Recipe, kwargs: dict):
        self.launcher, self.known, self.grid, self.recipe, self.kwargs = launcher, known, grid, recipe, kwargs
        self.direct = self.fn = self.device = None

    def __call__(self, tensors: tuple) -> None:
        launcher = self.launcher
        fn = launcher.namespace[launcher.name]
        if self.direct is not None and fn is self.fn and not _hooked():
            device = _current_device()
            if device == self.device:
                self.direct(self.grid, tensors, _current_stream(device))
                return
        launcher.launch_recipe(self.known, self.grid, self.recipe, tensors, **self.kwargs)
        self.direct = None
        if not _through_jit(fn):
            device = driver.active.get_current_device()
            direct = launcher.direct.get(_known_key(device, self.known, self.kwargs))
            if direct:
                self.direct, self.fn, self.device = direct, fn, device


# The current CUDA device and stream as a direct launch asks for them: what Triton's CUDA driver asks torch, without
# the Python around it (a direct launch is a CUDA one; a CPU build of torch has neither function).
_current_device = getattr(torch._C, "_cuda_getDevice", None)
_current_stream = getattr(torch._C, "_cuda_getCurrentRawStream", None)


def _known_key(device, known, kwargs: dict) -> tuple:
    """The key of a known call (launch_as's `known` and keyword arguments, on a device) in Launcher.known and
    Launcher.direct."""
    return (device, known, *kwargs.items())


def _hooked() -> bool:
    """Whether a launch hook is set (a profiler: launches then go through the JIT, which calls it)."""
    hooks = triton.knobs.runtime
    return bool(hooks.launch_enter_hook.calls or hooks.launch_exit_hook.calls)


def _through_jit(fn) -> bool:
    """Whether a launch of `fn` goes through `fn[grid](...)`: where it is not a JITFunction (Triton's interpreter, a
    bundle's recorder) or a launch hook is set (a profiler: the JIT calls it)."""
    return not isinstance(fn, triton.runtime.JITFunction) or _hooked()


# how many call signatures a Launcher's `known` and a module's recipes keep before starting again
KEPT_CALLS = 4096
# how many tensor maps a direct launch keeps (by descriptor slot and address) before starting again: a training
# loop's activations come back at the same addresses step after step (PyTorch's caching allocator), and encoding a
# map is a driver call per descriptor per launch (cuTensorMapEncodeTiled: eight in a backward launch)
KEPT_MAPS = 256


class Recipe:
    """A launch's arguments as a function of the call's tensors, recorded from one call's arguments: each argument
    that is one of `tensors` (by identity) is that tensor's place, a TMA descriptor over one of them is its place
    and everything else the descriptor holds, and any other argument (a size, a stride, a flag, None) a constant.
    `args(tensors)` makes the arguments for another call's tensors. A generated module keeps a recipe per call
    signature (every shape, stride, element type and alignment its arguments follow from), so a call like one made
    before skips the layout decisions and descriptor checks that made its arguments (on the H100's host they took
    250-340 us of a training layer's forward and backward, 2026-11-26). Raises
    NotRecordable if an argument is a tensor not among `tensors` (it would be replayed stale). The caller gives
    distinct tensors in every role that a later call may fill with distinct ones (else a role would be replayed as
    the other's)."""

    __slots__ = ("parts",)

    def __init__(self, args: tuple, tensors: tuple):
        place = {}
        for i, t in enumerate(tensors):  # an object given twice (the same buffer in two roles) is its first place
            place.setdefault(id(t), i)
        parts = []
        for a in args:
            if isinstance(a, torch.Tensor):
                if id(a) not in place:
                    raise NotRecordable("a tensor argument that is not one of the call's tensors")
                parts.append((0, place[id(a)]))
            elif getattr(a, "block_shape", None) is not None and isinstance(getattr(a, "base", None), torch.Tensor):
                if id(a.base) not in place:
                    raise NotRecordable("a descriptor over a tensor that is not one of the call's tensors")
                parts.append((1, place[id(a.base)], type(a), a.shape, a.strides, a.block_shape, a.layout, a.padding))
            else:
                parts.append((2, a))
        self.parts = tuple(parts)

    def args(self, tensors: tuple) -> list:
        return [tensors[p[1]] if p[0] == 0 else p[1] if p[0] == 2 else p[2](tensors[p[1]], *p[3:]) for p in self.parts]


class _DirectLaunch:
    """A kept kernel's launch for a Recipe's calls, in the form Triton 3.6's compiled launcher (the C function
    behind CudaLauncher) takes: its base arguments, then each kernel argument, a TMA descriptor expanded to its
    encoded tensor map, shape and strides (what triton.backends.nvidia.driver's wrap_handle_tensordesc and
    make_tensordesc_arg do per call). Everything but the call's tensors and their tensor maps is made once: the
    call fills a copy of that list. A tensor map is encoded once per descriptor slot and address: the rest of
    what it encodes is the recipe's, so the bytes are the same for every call at that address, and a training
    loop's tensors come back at the same addresses step after step. (On the H100's host Triton's Python around
    the C launch, descriptors included, took about 30 us a launch.) tests/test_launch.py checks the list against
    Triton's own path."""

    __slots__ = ("kernel", "raw", "template", "tensor_slots", "desc_slots", "fill", "coop", "pdl", "maps")

    @classmethod
    def of(cls, kernel, rest: tuple, recipe: Recipe) -> "_DirectLaunch | None":
        """The direct launch of `kernel` (with `rest`, the values after the positional arguments) for `recipe`'s
        calls; None where its launcher is not Triton 3.6's CudaLauncher as read here, or needs what the direct form
        leaves out (scratch memory, tensor maps without metadata, FP4 padding)."""
        run = getattr(kernel, "run", None)
        if type(run).__name__ != "CudaLauncher" or run.global_scratch_size or run.profile_scratch_size or getattr(run, "num_ctas", 1) != 1:
            return None
        launch = run.launch
        indices, metas = set(), []
        if getattr(launch, "__name__", None) == "inner":  # wrap_handle_tensordesc's wrapper: the arguments with descriptors
            found = inspect.getclosurevars(launch).nonlocals
            launch, indices, metas = found.get("launcher"), found.get("tensordesc_indices"), list(found.get("tensordesc_meta") or ())
            if launch is None or indices is None or len(metas) != len(indices) or any(m is None or m.get("fp4_padded") for m in metas):
                return None
        from triton.backends.nvidia.driver import TMA_DTYPE_DEVICE_TO_HOST

        self = cls()
        self.kernel, self.raw, self.coop, self.pdl = kernel, launch, run.launch_cooperative_grid, run.launch_pdl
        self.fill = driver.active.utils.fill_tma_descriptor
        template, tensor_slots, desc_slots = [], [], []
        metas = iter(metas)
        for i, part in enumerate(recipe.parts + tuple((2, value) for value in rest)):
            if i in indices:
                if part[0] != 1:
                    return None
                meta = next(metas)
                _, place, _, shape, strides, _, _, padding = part
                desc_slots.append((len(template), place, (meta["swizzle"], meta["elem_size"], TMA_DTYPE_DEVICE_TO_HOST[meta["elem_type"]],
                                                          meta["block_size"], shape, strides, 1 if padding == "nan" else 0)))
                template += [None, *shape, *strides]
            elif part[0] == 0:
                tensor_slots.append((len(template), part[1]))
                template.append(None)
            elif part[0] == 2:
                template.append(part[1])
            else:  # a descriptor where the kernel takes none
                return None
        self.template, self.tensor_slots, self.desc_slots = template, tuple(tensor_slots), tuple(desc_slots)
        self.maps = {}
        return self

    def __call__(self, grid, tensors: tuple, stream: int) -> None:
        args = self.template.copy()
        for at, place in self.tensor_slots:
            args[at] = tensors[place]
        maps = self.maps  # a descriptor slot's tensor map by address: everything else it encodes is the slot's
        for at, place, encoding in self.desc_slots:
            address = tensors[place].data_ptr()
            found = maps.get((at, address))
            if found is None:
                if len(maps) >= KEPT_MAPS:
                    maps.clear()
                found = maps[at, address] = self.fill(address, *encoding)
            args[at] = found
        grid_x, grid_y, grid_z = (*grid, 1, 1)[:3]
        kernel = self.kernel
        self.raw(grid_x, grid_y, grid_z, stream, kernel.function, self.coop, self.pdl, None, None, kernel.packed_metadata, None, None, None,
                 *args)


class NotRecordable(Exception):
    """Recipe: a call whose arguments are not all functions of its tensors and signature."""


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
