"""Call-time checks, compile() inputs, and the API contract of the kernel object."""
from pathlib import Path

import pytest
import torch

import attngen
from attngen.errors import AttngenError, InputError, SpecError
from attngen.runtime.checks import check_call

ROOT = Path(__file__).parent.parent


@pytest.fixture(scope="module")
def padded(target):
    return attngen.compile(ROOT / "specs" / "key_padding.attn", target)


_DEVICE = ["cpu"]


@pytest.fixture(autouse=True)
def _on_device(device):
    _DEVICE[0] = device


def _qkv(b=2, hq=4, hkv=2, nq=9, nk=11, d=64, dtype=torch.bfloat16):
    dev = _DEVICE[0]
    return tuple(torch.randn(b, h, n, d).to(device=dev, dtype=dtype) for h, n in ((hq, nq), (hkv, nk), (hkv, nk)))


def test_compile_accepts_path_text_and_spec(target):
    a = attngen.compile(str(ROOT / "specs" / "causal.attn"), target)
    b = attngen.compile((ROOT / "specs" / "causal.attn").read_text(), target)
    c = attngen.compile(a.spec, target)
    assert a.spec == b.spec == c.spec and a.source == b.source == c.source
    assert a.path.is_file() and a.path.read_text() == a.source
    assert a.plan.target.name == (target if target != "auto" else a.plan.target.name)
    assert "_attn_fwd" in a.source and "m_i" in a.source and "offs_m" in a.source


def test_compile_errors():
    with pytest.raises(AttngenError, match="no such spec file: nowhere.attn"):
        attngen.compile("nowhere.attn", "h100")
    with pytest.raises(SpecError, match=r"<string>:1:\d+: error: head_dim = 7"):
        attngen.compile("attention t { head_dim = 7 }", "h100")


@pytest.mark.parametrize(
    "mutate, message",
    [
        (lambda q, k, v, i: (q.float(), k, v, i), "q is torch.float32, the spec 'key_padding' says dtype = bf16"),
        (lambda q, k, v, i: (q[0], k, v, i), "q must be 4-D"),
        (lambda q, k, v, i: (q[..., :32], k, v, i), "q has head_dim 32, the spec says 64"),
        (lambda q, k, v, i: (q, k, v[:, :, :5], i), "k and v must have the same batch, heads and tokens"),
        (lambda q, k, v, i: (q[:, :3], k, v, i), r"query heads \(3\) must be a multiple of key/value heads \(2\)"),
        (lambda q, k, v, i: (q, k[:1], v[:1], i), "q has batch 2, k and v have 1"),
        (lambda q, k, v, i: (q, k, v, {}), "missing input 'lens'"),
        (lambda q, k, v, i: (q, k, v, {**i, "doc": i["lens"]}), r"unexpected argument\(s\) doc"),
        (lambda q, k, v, i: (q, k, v, {"lens": i["lens"].long()}), "input 'lens' is torch.int64, declared int32"),
        (lambda q, k, v, i: (q, k, v, {"lens": i["lens"][None]}), "input 'lens' has 2 dimension"),
        (lambda q, k, v, i: (q, k, v, {"lens": i["lens"][:1]}), r"input 'lens' dimension 0 \(B\) is 1, but B is 2"),
        (lambda q, k, v, i: (q, k, v, {"lens": [3, 4]}), "input 'lens' must be a torch.Tensor"),
        (lambda q, k, v, i: (q[:, :0], k[:, :0], v[:, :0], i), "q has 0 heads and k, v have 0: each needs at least one head"),
        (lambda q, k, v, i: (q, k[:, :0], v[:, :0], i), "q has 4 heads and k, v have 0"),
        # the integer analysis of expressions (attngen/lang/ranges.py) holds for lengths below 2**30 (a view, no memory)
        (lambda q, k, v, i: (q, k[:, :, :1].expand(-1, -1, 2**30, -1), v[:, :, :1].expand(-1, -1, 2**30, -1), i),
         r"the key length is 1073741824; attngen supports at most 1073741823 \(2\*\*30 - 1\)"),
    ],
)
def test_bad_calls_say_what_was_expected(padded, mutate, message):
    """Also after a good call of the same sizes: what passed the checks is remembered by each tensor's shape,
    element type and device (checks.check_call), which must never let another call skip them."""
    q, k, v = _qkv()
    good = {"lens": torch.tensor([3, 11], dtype=torch.int32, device=q.device)}
    assert check_call(padded, q, k, v, good)[0].q_len == 9 and padded._passed
    q, k, v, inputs = mutate(q, k, v, good)
    with pytest.raises(InputError, match=message):
        padded(q, k, v, **inputs)


def test_a_plain_call_like_one_made_before_skips_its_checks_until_its_signature_changes(padded):
    """A plain call (q, k, v and the declared inputs) is kept by its signature once its checks passed
    (Kernel._plain_calls): a call with equal shapes, strides, element types, devices and alignment, gradient or
    not, runs with nothing decided again. Anything of that changing is checked again (a bad dtype, a bad input
    shape), and a call of other strides or with a gradient is a signature of its own, as exact as the first."""
    q, k, v = _qkv()
    lens = torch.tensor([3, 11], dtype=torch.int32, device=q.device)

    def check(out, q, k, v, lens):
        assert not torch.isnan(out).any()
        want = attngen.reference(padded, q.double().cpu(), k.double().cpu(), v.double().cpu(), lens=lens.cpu())
        assert (out.double().cpu() - want).abs().max() < 2e-2

    check(padded(q, k, v, lens=lens), q, k, v, lens)
    assert len(padded._plain_calls) == 1
    check(padded(q, k, v, lens=lens), q, k, v, lens)  # replayed: no new entry
    assert len(padded._plain_calls) == 1
    with pytest.raises(InputError, match="q is torch.float32"):
        padded(q.float(), k, v, lens=lens)
    with pytest.raises(InputError, match=r"input 'lens' dimension 0 \(B\) is 1, but B is 2"):
        padded(q, k, v, lens=lens[:1])
    k_rows = k.transpose(1, 2).contiguous().transpose(1, 2)  # the same values, other strides: a signature of its own
    check(padded(q, k_rows, v, lens=lens), q, k, v, lens)
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = padded(*leaves, lens=lens)
    check(out, q, k, v, lens)
    out.float().sum().backward()
    exact = [t.detach().double().cpu().requires_grad_() for t in (q, k, v)]
    attngen.reference(padded, *exact, lens=lens.cpu()).sum().backward()
    for got, want in zip(leaves, exact):
        assert not torch.isnan(got.grad).any() and (got.grad.double().cpu() - want.grad).abs().max() < 5e-2
    assert len(padded._plain_calls) == 3


@pytest.mark.parametrize("kept", [True, False], ids=["plain", "with_a_seed"])
def test_a_call_without_return_lse_records_o_alone(padded, kept):
    """A call that records a gradient and does not return the lse gets an autograd node with O as its only output
    (AttentionOutput; a second output costs host time in both passes): its gradients are those of the call that
    returns the lse and leaves it unused, bit for bit, and its backward is given no lse gradient. Plain calls
    (kept by signature) and the others alike (a seed makes a call not plain; this spec has no dropout)."""
    q, k, v = _qkv()
    lens = torch.tensor([3, 11], dtype=torch.int32, device=q.device)
    do = torch.randn(q.shape).to(device=q.device, dtype=q.dtype)
    extra = {} if kept else {"seed": 3}
    given = []
    backward = padded._backward_impl

    def recorded(*args, **kwargs):
        given.append(args[6])  # dlse
        return backward(*args, **kwargs)
    padded._backward_impl = recorded
    try:
        alone = [t.clone().requires_grad_() for t in (q, k, v)]
        out = padded(*alone, lens=lens, **extra)
        assert type(out.grad_fn).__name__ == "AttentionOutputBackward"
        grads = torch.autograd.grad(out, alone, do)
        both = [t.clone().requires_grad_() for t in (q, k, v)]
        out2, lse = padded(*both, lens=lens, return_lse=True, **extra)
        assert type(out2.grad_fn).__name__ == "AttentionFunctionBackward" and lse.requires_grad
        assert torch.equal(out, out2)
        assert all(torch.equal(a, b) for a, b in zip(grads, torch.autograd.grad(out2, both, do)))
    finally:
        del padded._backward_impl
    assert given or (kept and q.is_cuda)  # (on the GPU a plain call's backward route skips _backward_impl)
    assert not given or given[0] is None


def test_direct_index_out_of_range_is_refused(target):
    kern = attngen.compile(ROOT / "specs" / "document.attn", target)
    q, k, v = _qkv(nq=20, nk=8)
    with pytest.raises(InputError, match="indexed by q_idx on dimension 1, which has size 10; q_idx goes up to 19"):
        kern(q, k, v, doc=torch.zeros(2, 10, dtype=torch.int32, device=q.device))


def test_lengths_past_the_float_positions_take_the_triton_backward(target):
    """The Gluon backward converts a sum of positions in a float context per score (a square of distances here) to
    float32 leaf by leaf (codegen.expr.FLOAT_POSITIONS), exact for lengths up to 2**23: a longer call (or context-parallel
    sequence) takes the Triton backward, which converts per score. A separable bias (ALiBi) is added by its key
    part, converted per key, on one GPU (a context-parallel shard lowers it per score: leaf by leaf again). Masks
    of integer positions (causal, windows) and integer sums read as input indices (relative_bias) convert nothing,
    whatever their length."""
    import dataclasses

    from attngen.lang.check import load_spec
    from attngen.codegen.lowering import converts_positions
    from attngen.codegen.expr import FLOAT_POSITIONS

    square = load_spec("attention sq {\n head_dim = 128\n mask = q_idx >= kv_idx\n score = score - 0.001 * (q_idx - kv_idx) * (q_idx - kv_idx)\n}")
    sq = attngen.compile(square, target, backend="gluon")
    assert converts_positions(sq.plan) and sq.generator.backward == "gluon" and sq.generator.gluon.bwd_max_positions == FLOAT_POSITIONS
    assert sq._gluon_backward(4096, FLOAT_POSITIONS) and sq._gluon_backward(FLOAT_POSITIONS, 1)
    assert not sq._gluon_backward(FLOAT_POSITIONS + 1, 1) and not sq._gluon_backward(1, FLOAT_POSITIONS + 1, 4096)
    alibi = attngen.compile(ROOT / "specs" / "alibi.attn", target, backend="gluon")
    assert not converts_positions(alibi.plan) and alibi._gluon_backward(FLOAT_POSITIONS + 1, FLOAT_POSITIONS + 1)
    assert converts_positions(dataclasses.replace(alibi.plan, global_positions=True))
    for name in ("causal", "sliding_window", "relative_bias", "causal_softcap", "document"):
        kern = attngen.compile(ROOT / "specs" / f"{name}.attn", target, backend="gluon")
        assert not converts_positions(kern.plan) and kern._gluon_backward(FLOAT_POSITIONS + 1, FLOAT_POSITIONS + 1), name


def test_cpu_tensors_need_the_interpreter(padded, monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    q, k, v = (t.cpu() for t in _qkv())
    with pytest.raises(InputError, match="set TRITON_INTERPRET=1"):
        padded(q, k, v, lens=torch.tensor([1, 2], dtype=torch.int32))


def test_reference_accepts_a_kernel_and_inputs(padded):
    q, k, v = (t.double().cpu() for t in _qkv())
    lens = torch.tensor([0, 4], dtype=torch.int32)
    out, lse = attngen.reference(padded, q, k, v, lens=lens, return_lse=True)
    assert out.dtype == torch.float64 and torch.equal(out[0], torch.zeros_like(out[0])) and torch.isneginf(lse[0]).all()
    manual = torch.softmax((q[1] @ k[1].repeat_interleave(2, 0)[:, :4].transpose(-1, -2)) / 8.0, -1) @ v[1].repeat_interleave(2, 0)[:, :4]
    assert torch.allclose(out[1], manual)


def test_an_empty_batch_gives_empty_results(padded):
    q, k, v = (t[:0].requires_grad_() for t in _qkv())
    out, lse = padded(q, k, v, return_lse=True, lens=torch.zeros(0, dtype=torch.int32, device=q.device))
    assert out.shape == q.shape and lse.shape == q.shape[:3]
    out.sum().backward()
    assert q.grad.shape == q.shape and k.grad.shape == k.shape


@pytest.mark.filterwarnings("ignore::DeprecationWarning")  # torch.compile's own use of torch.jit
def test_torch_compile_without_fullgraph_runs_the_kernel(target):
    """torch.compile (default settings, Inductor) over a function that calls a kernel on CPU tensors: it crashed with
    KeyError(torch.uint64) tracing the interpreter; now the call is a custom op (tests/test_compile.py) and the
    result and the gradients equal the eager call's."""
    kern = attngen.compile(ROOT / "specs" / "odd_head_dim.attn", target)
    q, k, v = (t.float().requires_grad_() for t in _qkv(d=80))

    def f(q, k, v):
        return (kern(q, k, v) * 2.0).sum()

    eager = torch.autograd.grad(f(q, k, v), (q, k, v))
    torch._dynamo.reset()
    compiled = torch.autograd.grad(torch.compile(f)(q, k, v), (q, k, v))
    for a, b in zip(eager, compiled):
        assert not torch.isnan(b).any() and torch.equal(a, b)


@pytest.mark.slow  # a subprocess that imports torch and triton
def test_interpreter_set_after_triton_was_imported_is_explained(tmp_path, device):
    """TRITON_INTERPRET=1 set after `import triton`: Triton's own functions were made for the GPU, and the call
    failed with "Cannot call @triton.jit'd outside of the scope of a kernel". Now an InputError says what to do."""
    if device != "cpu":
        pytest.skip("a CPU-interpreter matter")
    import subprocess
    import sys

    script = (
        "import os, torch, triton\n"
        "os.environ['TRITON_INTERPRET'] = '1'\n"
        "import attngen\n"
        f"kern = attngen.compile({str(ROOT / 'specs' / 'odd_head_dim.attn')!r}, 'h100')\n"
        "q = torch.randn(1, 1, 8, 80)\n"
        "try:\n"
        "    kern(q, q, q)\n"
        "except attngen.InputError as err:\n"
        "    print('InputError:', err)\n"
    )
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env, timeout=300)
    assert "InputError: TRITON_INTERPRET=1 was set after triton was imported" in run.stdout, run.stdout + run.stderr


def test_auto_target_without_a_gpu_plans_for_the_default(monkeypatch, device):
    """The README's first example names no target: on a machine without a GPU it plans for h100 (the interpreter
    runs any plan) and says so once, with a TargetWarning."""
    from attngen.plan import planner as plan_module

    if torch.cuda.is_available():
        pytest.skip("a GPU is visible: auto resolves to it")
    monkeypatch.setattr(plan_module, "_warned_default_target", False)
    assert attngen.TargetWarning is plan_module.TargetWarning
    with pytest.warns(attngen.TargetWarning, match="no CUDA device is visible, so attngen plans for h100"):
        kern = attngen.compile(ROOT / "specs" / "causal.attn")
    assert kern.plan.target.name == "h100"
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        attngen.compile(ROOT / "specs" / "dense.attn")  # once per process


@pytest.mark.slow  # a subprocess
def test_readme_cpu_example_runs(device):
    """The README's example for machines without a GPU, run as written from the repository root."""
    if device != "cpu":
        pytest.skip("the CPU example")
    import re
    import subprocess
    import sys

    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    (code,) = [b for b in blocks if b.startswith('import os; os.environ["TRITON_INTERPRET"] = "1"')]
    env = {k: v for k, v in __import__("os").environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, env=env, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "TargetWarning" in run.stderr or torch.cuda.is_available()


def test_the_reference_refuses_what_a_call_refuses():
    """attngen.reference takes a call's arguments, so it raises a call's InputErrors: a declared input missing or
    misspelled, q, k, v that do not agree, query heads not a multiple of the key/value heads (a KeyError and raw
    torch errors before)."""
    import attngen
    from attngen.errors import InputError

    kern = attngen.compile(ROOT / "specs" / "document.attn", "h100")
    q = torch.randn(1, 2, 8, kern.spec.head_dim)
    doc = torch.zeros(1, 8, dtype=torch.int32)
    with pytest.raises(InputError, match="missing input 'doc' \\(declared `input doc: int32\\[B, N\\]`\\)"):
        attngen.reference(kern, q, q, q)
    with pytest.raises(InputError, match="unexpected argument\\(s\\) docs; 'document' declares inputs: doc"):
        attngen.reference(kern, q, q, q, doc=doc, docs=doc)
    with pytest.raises(InputError, match="must agree"):
        attngen.reference(kern, q, q[:, :, :4], q, doc=doc)
    with pytest.raises(InputError, match="query heads \\(3\\) must be a multiple of key/value heads \\(2\\)"):
        attngen.reference(kern, torch.randn(1, 3, 8, kern.spec.head_dim), q, q, doc=doc)
    assert not torch.isnan(attngen.reference(kern, q, q, q, doc=doc)).any()


def test_helpers_check_their_arguments():
    """target= that is not a name, a dropout seed a kernel call would refuse, a block size of 0: typed errors
    saying what was expected (an AttributeError, an interpreter assertion and a ZeroDivisionError before)."""
    import attngen
    from attngen.errors import InputError, PlanError

    with pytest.raises(PlanError, match="target must be a GPU's name"):
        attngen.compile(ROOT / "specs" / "causal.attn", target=90)
    for seed in (-5, 1.5, True):
        with pytest.raises(InputError, match="seed must be a non-negative integer below 2\\*\\*63"):
            attngen.dropout_mask(seed, 0.1, 1, 1, 4, 4)
    with pytest.raises(InputError, match="seed must be a one-element int64 tensor"):
        attngen.dropout_mask(torch.tensor([1, 2]), 0.1, 1, 1, 4, 4)
    with pytest.raises(InputError, match="sparse_block must be a positive integer"):
        attngen.block_mask_from_dense(torch.ones(4, 4, dtype=torch.bool), 0)


@pytest.mark.interpreter
def test_calls_from_several_threads_each_get_their_own_answer():
    """Eight threads calling one kernel on CPU tensors at once, forward and backward: each gets the answer of its own
    inputs. Triton's interpreter patches module-wide state while a kernel runs (concurrent runs failed with "Did you
    forget to add @triton.jit?"), so the runtime runs one interpreted kernel at a time."""
    from concurrent.futures import ThreadPoolExecutor

    kern = attngen.compile("attention threads {\n head_dim = 32\n dtype = fp32\n mask = q_idx >= kv_idx\n}", "h100")
    gens = [torch.Generator().manual_seed(i) for i in range(8)]
    cases = [[torch.randn(1, 2, 37, 32, generator=g, requires_grad=True) for _ in range(3)] for g in gens]

    def run(case):
        q, k, v = case
        o = kern(q, k, v)
        o.backward(torch.ones_like(o))
        return o.detach(), q.grad
    with ThreadPoolExecutor(max_workers=8) as pool:
        results = list(pool.map(run, cases))
    for (q, k, v), (o, dq) in zip(cases, results):
        qd, kd, vd = (t.detach().double().requires_grad_() for t in (q, k, v))
        ref = attngen.reference(kern.spec, qd, kd, vd)
        ref.backward(torch.ones_like(ref))
        assert not o.isnan().any() and not dq.isnan().any()
        assert (o.double() - ref).abs().max() < 1e-4 and (dq.double() - qd.grad).abs().max() < 1e-3
