"""attngen.launch: the generated modules' launches without Triton's JIT dispatch. After a specialization's first
call, a Launcher launches the kernel it kept for the call's key. That is right only if equal keys mean equal
specializations, which Triton's own binder for sm_90 decides here (no GPU needed), for a kernel of each
generator; and the Launcher itself, with the JIT function, the kernel and the driver stood in for."""
import os
import subprocess
import sys

import pytest
import torch
import triton

import attngen.runtime.launch as launch
from attngen.codegen import triton as triton_generator
from attngen.codegen.gluon import plan_gluon, render
from attngen.plan.planner import plan
from tests.test_gluon import _spec

# Runs in a process of its own without TRITON_INTERPRET: the interpreter has no binder. argv: the Gluon module,
# the Triton generator's module. Prints the number of distinct keys of each kernel.
_KEY_CHECK = r'''
import importlib.util, itertools, sys
import torch
from attngen.aot.gluon_binaries import specialize
from attngen.runtime.launch import _specializations


def load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def check(by_key, name):
    assert all(len(s) == 1 for s in by_key.values()), (name, [s for s in by_key.values() if len(s) > 1])
    print(name, len(by_key))


def record(fn, args, kwargs, by_key):
    signature, constexprs, attrs, _ = specialize(fn, args, kwargs)
    key = (tuple(kwargs.items()), *_specializations(args))  # as Launcher keys a call
    by_key.setdefault(key, set()).add(repr((signature, constexprs, attrs)))


def shapes():
    """Calls that differ in sizes equal to 1 or multiples of 16 or neither, and in an input's 16-byte alignment."""
    return itertools.product([(1, 1, 16), (2, 4, 17), (1, 16, 100), (3, 2, 1)], (0, 1), (128, 129))


def bias(heads, row, offset):
    return torch.zeros(heads * row + 1)[offset:offset + heads * row].view(heads, row)[:, :128]  # fp32[H, 128], rows `row` apart


# 1. the Gluon module's forward: its arguments as its launcher gets them
m = load(sys.argv[1], "gluon_module")
d = m.HEAD_DIM.value
by_key = {}
for dtype, ((batch, heads, n), offset, row) in itertools.product((torch.bfloat16, torch.float16), shapes()):
    q, k, v, o = (torch.zeros(batch, heads, n, d, dtype=dtype) for _ in range(4))
    lse = torch.zeros(batch * heads * n + 1)[offset:offset + batch * heads * n].view(batch, heads, n)  # offset 1: not aligned
    record(m._attn_fwd, m.launch_args(q, k, v, o, lse, bias(heads, row, offset)), {"num_warps": 4, "maxnreg": m.MAXNREG}, by_key)
check(by_key, "gluon _attn_fwd")

# 2. the Triton generator's kernels: what attention_forward and attention_backward pass them (positional
# arguments, constexprs and launch options by keyword), caught by stand-ins, with the plan's tiles and others
t = load(sys.argv[2], "triton_module")
names = ("_attn_fwd", "_attn_bwd_delta", "_attn_bwd_dq", "_attn_bwd_dkdv", "_attn_decode")
real = {name: getattr(t, name) for name in names}
calls = []


class Catch:
    def __init__(self, name):
        self.name = name

    def __getitem__(self, grid):
        return lambda *args, **kwargs: calls.append((self.name, args, kwargs))


for name in names:
    setattr(t, name, Catch(name))
other = {kernel: dict(config, num_stages=1) for kernel, config in t.TILES.items()}
for tiles, ((batch, heads, n), offset, row) in itertools.product((t.TILES, other), shapes()):
    q, k, v = (torch.zeros(batch, heads, n, d, dtype=torch.bfloat16) for _ in range(3))
    o, lse = t.attention_forward(q, k, v, bias(heads, row, offset), tiles=tiles)
    t.attention_backward(q, k, v, o, lse, torch.zeros_like(o), None if offset else torch.zeros_like(lse), bias(heads, row, offset), tiles=tiles)
    for splits, lens in itertools.product((1, 3), (None, torch.full((batch,), n, dtype=torch.int32))):  # decoding
        t.attention_decode(q, k, v, bias(heads, row, offset), kv_lens=lens, block_r=16, num_splits=splits, tiles=tiles)
for name in names:
    by_key = {}
    for _, args, kwargs in (c for c in calls if c[0] == name):
        record(real[name], args, kwargs, by_key)
    check(by_key, "triton " + name)
'''


@pytest.mark.slow  # Triton's binder in a process of its own: about 10 s
def test_equal_keys_mean_equal_specializations(tmp_path):
    """The key (each positional argument's `specialization`, the keyword arguments by value) never joins calls
    Triton's binder specializes differently, for the Gluon forward and the Triton generator's five kernels; and
    the calls above reach several keys each, so the check is not vacuous."""
    gluon_path = tmp_path / "relative_bias_gluon.py"
    gluon_path.write_text(render(plan_gluon(plan(_spec("relative_bias"), "h100"))))
    triton_path = tmp_path / "relative_bias_triton.py"
    triton_path.write_text(triton_generator.build_source(plan(_spec("relative_bias"), "h100"))[1])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", _KEY_CHECK, str(gluon_path), str(triton_path)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    counts = dict(line.rsplit(" ", 1) for line in run.stdout.splitlines())
    assert set(counts) == {"gluon _attn_fwd", "triton _attn_fwd", "triton _attn_bwd_delta", "triton _attn_bwd_dq", "triton _attn_bwd_dkdv",
                           "triton _attn_decode"}
    assert int(counts["gluon _attn_fwd"]) >= 8 and all(int(n) >= 4 for n in counts.values()), counts


def test_the_launch_key_specializes_each_argument_as_specialization_does():
    """Launcher's key writes the common cases of `specialization` out in place (plain ints, plain tensors): the
    same values for ints around every boundary Triton's binder looks at, bools (ints to Python), tensors at
    aligned and unaligned addresses, a Parameter (a Tensor subclass), None, a float and a constexpr."""
    base = torch.zeros(64)
    args = [0, 1, 2, 15, 16, 17, -1, -16, 2**31 - 1, 2**31, -2**31, -2**31 - 1, 2**63 - 1, 2**63, 2**64, True, False,
            base, base[1:], base.to(torch.float16)[4:], torch.nn.Parameter(torch.zeros(3)), None, 0.5, triton.language.constexpr(16)]
    assert launch._specializations(tuple(args)) == [launch.specialization(a) for a in args]
    assert len({repr(s) for s in launch._specializations(tuple(args[:15]))}) >= 5  # the ints fall in several classes


class _Kernel:
    function, packed_metadata = "function", "metadata"

    def __init__(self):
        self.runs = []

    def run(self, *args):
        self.runs.append(args)


class _Jit(triton.runtime.JITFunction):
    """A JIT function's stand-in: records its calls, returns one kernel; its parameters are (x, n, BLOCK, FLAG=7)."""

    def __init__(self):
        self.calls, self.kernel = [], _Kernel()
        self.params = [type("Param", (), {"name": name, "default": default})() for name, default in
                       (("x", None), ("n", None), ("BLOCK", None), ("FLAG", 7))]

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.calls.append((grid, args, kwargs)) or self.kernel


class _Driver:
    class active:
        get_current_device = staticmethod(lambda: 0)
        get_current_stream = staticmethod(lambda device: 1234)


def test_the_launcher_launches_a_kept_kernel_for_an_equal_key(monkeypatch):
    """The JIT on a key's first call, with a launch hook set, or where the kernel is not a JITFunction (the
    interpreter, a bundle's recorder); else the kept kernel, launched on the current stream with the JIT's
    arguments: the positional ones, then the keyword ones and the defaults in parameter order."""
    monkeypatch.setattr(launch, "driver", _Driver)
    namespace = {"_k": _Jit()}
    jit = namespace["_k"]
    launcher = launch.Launcher(namespace, "_k", num_warps=4)
    x = torch.zeros(64)
    launcher((3, 2), x, 100, BLOCK=64)
    assert jit.calls == [((3, 2), (x, 100), {"num_warps": 4, "BLOCK": 64})] and not jit.kernel.runs
    launcher((5,), x, 200, BLOCK=64)  # sizes not specialized on: the kept kernel
    assert len(jit.calls) == 1 and jit.kernel.runs == [(5, 1, 1, 1234, "function", "metadata", None, None, None, x, 200, 64, 7)]
    launcher((5,), x, 200, BLOCK=128)  # another constexpr: the JIT
    launcher((5,), x, 1, BLOCK=64)  # n == 1 is specialized on: the JIT
    launcher((5,), x[1:], 200, BLOCK=64)  # a pointer not 16-byte aligned: the JIT
    launcher((5,), x.half(), 200, BLOCK=64)  # another element type: the JIT
    assert len(jit.calls) == 5 and len(jit.kernel.runs) == 1
    launcher((5,), x, 208, BLOCK=64)  # 208 % 16 == 0 is specialized on: the JIT
    assert len(jit.calls) == 6
    hooks = triton.knobs.runtime.launch_enter_hook
    hooks.add(print)  # a profiler's hook: every call through the JIT, which calls it
    try:
        launcher((5,), x, 200, BLOCK=64)
    finally:
        hooks.remove(print)
    assert len(jit.calls) == 7 and len(jit.kernel.runs) == 1
    launcher((5,), x, 200, BLOCK=64)
    assert len(jit.kernel.runs) == 2
    recorded = []
    namespace["_k"] = type("Recorder", (), {"__getitem__": lambda self, grid: lambda *a, **k: recorded.append((grid, a, k))})()
    launcher((5,), x, 200, BLOCK=64)  # a stand-in put in the module (attngen.bundle's recorders) is what runs
    assert recorded == [((5,), (x, 200), {"num_warps": 4, "BLOCK": 64})] and len(jit.kernel.runs) == 2
    namespace["_k"] = jit
    runs = len(jit.kernel.runs)
    launcher.launch_as("signature", (5,), x, 200, BLOCK=64)  # a known call's first launch: its key, the kept kernel
    launcher.launch_as("signature", (5,), x, 208, BLOCK=64)  # then the known stands for the key (the caller's promise)
    assert len(jit.calls) == 7 and len(jit.kernel.runs) == runs + 2 and jit.kernel.runs[-1][-3] == 208
    launcher.launch_as("signature", (5,), x, 200, BLOCK=32)  # other keyword arguments: not that known call (the JIT)
    assert len(jit.calls) == 8
    launcher.launch_as("other", (5,), x, 208, BLOCK=64)  # another known: its own key (208's kernel, kept above)
    assert len(jit.calls) == 8 and len(jit.kernel.runs) == runs + 3 and launcher.known[(0, "other", ("BLOCK", 64))][0] is jit.kernel
    calls = len(jit.calls)
    launcher((5,), x, triton.language.constexpr(300), BLOCK=64)
    launcher((5,), x, triton.language.constexpr(301), BLOCK=64)  # a constexpr object's value is compiled in: a key per value
    assert len(jit.calls) == calls + 2
    runs, y = len(jit.kernel.runs), torch.zeros(64)
    recipe = launch.Recipe((x, 200), (x,))
    launcher.launch_recipe("recipe", (5,), recipe, (x,), BLOCK=64)  # the kept kernel, through launch_as
    launcher.launch_recipe("recipe", (5,), recipe, (y,), BLOCK=64)  # no direct form for this stand-in's launcher: launch_as again
    assert launcher.direct[(0, "recipe", ("BLOCK", 64))] is False and len(jit.kernel.runs) == runs + 2
    assert jit.kernel.runs[-1][9:11] == (y, 200)  # the recipe replayed with the call's tensor


def test_a_direct_launch_passes_what_triton_s_launcher_would(monkeypatch):
    """_DirectLaunch against Triton 3.6's own path, run for real on the CPU: CudaLauncher.__call__ and
    wrap_handle_tensordesc with make_tensordesc_arg, around a stand-in for the compiled C launch (it records its
    arguments) and a stand-in tensor-map encoder. For a recipe of descriptors, tensors and constants, replayed with
    other tensors, and the values after the positional ones: the same arguments in the same order. None where the
    launcher needs scratch memory or a tensor map has no metadata."""
    from types import SimpleNamespace

    from triton.backends.nvidia import driver as nv
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.nvidia.hopper import TensorDescriptor

    encoded = []  # the addresses the stand-in encoder was asked for

    def encode(ptr, swizzle, size, dtype, block, shape, strides, padding):
        encoded.append(ptr)
        return ("map", ptr, swizzle, size, dtype, tuple(block), tuple(shape), tuple(strides), padding)
    monkeypatch.setattr(triton.runtime.driver, "_active", SimpleNamespace(utils=SimpleNamespace(fill_tma_descriptor=encode)))
    received = []
    signature = {0: "tensordesc<bf16[1,64,128]>", 1: "*bf16", 2: "i32", 3: "tensordesc<fp32[64,32]>", 4: "*fp32", 5: "constexpr", 6: "i1",
                 7: "i32"}
    metas = [{"swizzle": 128, "elem_size": 2, "elem_type": 9, "block_size": [1, 64, 128], "fp4_padded": False},
             {"swizzle": 0, "elem_size": 4, "elem_type": 8, "block_size": [64, 32], "fp4_padded": False}]
    run = object.__new__(nv.CudaLauncher)
    run.num_ctas, run.launch_cooperative_grid, run.launch_pdl = 1, False, True
    run.global_scratch_size = run.profile_scratch_size = 0
    run.global_scratch_align = run.profile_scratch_align = 1
    run.launch = nv.wrap_handle_tensordesc(lambda *args: received.append(args), signature, metas)
    kernel = SimpleNamespace(run=run, function=4321, packed_metadata=("metadata",))

    def tensors():
        return torch.zeros(2, 64, 256, dtype=torch.bfloat16), torch.zeros(64, 64), torch.zeros(8)

    def args(q, s, _):
        q_desc = TensorDescriptor(q, [2, 64, 256], [64 * 256, 256, 1], [1, 64, 128], gl.NVMMASharedLayout.get_default_for([1, 64, 128], gl.bfloat16))
        s_desc = TensorDescriptor(s, [64, 64], [64, 1], [64, 32], gl.NVMMASharedLayout.get_default_for([64, 32], gl.float32))
        return (q_desc, q, 33, s_desc, s)

    first = tensors()
    recipe = launch.Recipe(args(*first), first)
    rest = (16, True, 5)  # a constexpr's value, a flag, a default
    direct = launch._DirectLaunch.of(kernel, rest, recipe)
    second = tensors()
    for call in (first, second, first, second):  # the maps of a call's addresses encoded once: the same arguments again
        kernel.run(3, 2, 1, 77, kernel.function, kernel.packed_metadata, None, None, None, *recipe.args(call), *rest)
        direct((3, 2), call, 77)
        triton_args, direct_args = received[-2:]
        assert len(triton_args) == len(direct_args) == 13 + 7 + 1 + 1 + 5 + 1 + 3  # base, q's map shape strides, q, 33, s's, s, rest
        assert all(a is b if isinstance(b, torch.Tensor) else a == b for a, b in zip(direct_args, triton_args)), (direct_args, triton_args)
        assert direct_args[13][:2] == ("map", call[0].data_ptr()) and direct_args[20] is call[0]  # the map of this call's q, then q
    # Triton's path encoded both maps at each of the four calls, the direct launch at the first two only
    assert encoded.count(first[0].data_ptr()) == 2 + 1 and encoded.count(second[1].data_ptr()) == 2 + 1 and len(encoded) == 4 * 2 + 2 * 2
    run.global_scratch_size = 64
    assert launch._DirectLaunch.of(kernel, rest, recipe) is None  # Triton allocates scratch per launch: not here
    run.global_scratch_size = 0
    run.launch = nv.wrap_handle_tensordesc(lambda *args: received.append(args), signature, [None, None])
    assert launch._DirectLaunch.of(kernel, rest, recipe) is None  # descriptors passed as their parts: not here


def test_a_bound_launch_keeps_the_direct_form_while_it_holds(monkeypatch):
    """Launcher.bind: a generated module's launch for one call signature. Its first call goes through
    launch_recipe (the JIT, which compiles or finds the kernel, then the direct form); later ones call the direct
    form with the call's tensors, on the current stream, with nothing looked up; with a launch hook set, another
    kernel in the module (a bundle's recorder) or another current device, launch_recipe again."""
    directs = []

    class Direct:  # the direct form's stand-in: records (grid, tensors, stream)
        def __init__(self):
            self.calls, self.kernel = [], None
            directs.append(self)

        def __call__(self, grid, tensors, stream):
            self.calls.append((grid, tensors, stream))

    device = [0]
    driver = type("Driver", (), {"active": type("Active", (), {"get_current_device": staticmethod(lambda: device[0]),
                                                                 "get_current_stream": staticmethod(lambda d: 1000 + d)})})
    monkeypatch.setattr(launch, "driver", driver)
    monkeypatch.setattr(launch, "_current_device", driver.active.get_current_device)  # (the direct path asks torch itself)
    monkeypatch.setattr(launch, "_current_stream", driver.active.get_current_stream)
    monkeypatch.setattr(launch._DirectLaunch, "of", classmethod(lambda cls, kernel, rest, recipe: Direct()))
    namespace = {"_k": _Jit()}
    jit = namespace["_k"]
    launcher = launch.Launcher(namespace, "_k", num_warps=4)
    x, y = torch.zeros(64), torch.zeros(64)
    bound = launcher.bind("signature", (5, 2), launch.Recipe((x, 200), (x,)), BLOCK=64)
    bound((x,))  # the first call: the JIT, then the direct form is made
    assert len(jit.calls) == 1 and len(directs) == 1 and directs[0].calls == []
    bound((y,))
    bound((x,))
    assert len(jit.calls) == 1 and directs[0].calls == [((5, 2), (y,), 1000), ((5, 2), (x,), 1000)]
    hooks = triton.knobs.runtime.launch_enter_hook
    hooks.add(print)  # a profiler's hook: through the JIT, which calls it
    try:
        bound((y,))
    finally:
        hooks.remove(print)
    assert len(jit.calls) == 2 and jit.calls[-1][1] == (y, 200) and len(directs[0].calls) == 2
    bound((x,))  # no hook: the direct form again (made once)
    assert len(jit.calls) == 2 and len(directs) == 1 and directs[0].calls[-1] == ((5, 2), (x,), 1000)
    recorded = []
    namespace["_k"] = type("Recorder", (), {"__getitem__": lambda self, grid: lambda *a, **k: recorded.append((grid, a, k))})()
    bound((y,))  # a stand-in put in the module is what runs
    assert recorded == [((5, 2), (y, 200), {"num_warps": 4, "BLOCK": 64})] and len(directs[0].calls) == 3
    namespace["_k"] = jit
    device[0] = 1  # another current device: its own kernel (the JIT), then its own direct form
    bound((x,))
    assert len(jit.calls) == 3 and len(directs) == 2
    bound((y,))
    assert directs[1].calls == [((5, 2), (y,), 1001)] and len(directs[0].calls) == 3
