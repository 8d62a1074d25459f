"""torch.compile over attngen kernels: under torch.compile a kernel call is a pair of torch.library
custom ops (forward, backward; in training, a call returning O alone holds them in an autograd.Function), so `fullgraph=True` traces a model that calls one, with dynamic shapes, under
no_grad and in training, with declared inputs and their gradients, dropout, runtime block masks and return_lse,
and packed sequences (cu_seqlens: a pair of ops of their own).
On the CPU the ops run the kernels in Triton's interpreter; torch.compile runs with the aot_eager backend
(Inductor's C++ code generation is not what is tested here, and is slow on two cores)."""
import math
from pathlib import Path

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch._subclasses.fake_tensor import FakeTensorMode

import attngen
from attngen.tools import verify
from attngen.runtime.checks import dropout_args
from attngen.runtime.dtypes import TORCH_DTYPES
from attngen.lang.check import load_spec
from attngen.tools.verify import _bound

SPECS = {p.stem: p for p in sorted((Path(__file__).parent.parent / "specs").glob("*.attn"))}

QUICK = ("causal", "relative_bias", "causal_dropout", "block_sparse_runtime")  # the rest are marked slow
# What the custom ops see differently from spec to spec: no input; a float input with a gradient, an integer one, a
# boolean one; dropout's seed; a runtime block mask; the decode op (a paged cache); a sink's input. The masks and
# scores themselves are the kernels' business (test_numerics.py, every shipped spec); on the GPU every shipped spec
# also runs under Inductor (test_every_shipped_spec_under_inductor_on_the_gpu).
CALL_KINDS = QUICK + ("document", "key_padding", "paged_decode", "sink_window")


def _kernel(name: str, target: str):
    spec = load_spec(SPECS[name].read_text())
    return attngen.compile(spec, target)


class Compiled:
    """A kernel behind torch.compile(fullgraph=True): what attngen.verify checks like a kernel (spec, plan, call)."""

    def __init__(self, kern, dynamic: bool = True, backend="aot_eager"):
        self.spec, self.plan, self.kern = kern.spec, kern.plan, kern
        self.fn = torch.compile(lambda q, k, v, **kw: kern(q, k, v, **kw), fullgraph=True, dynamic=dynamic, backend=backend)

    def __call__(self, q, k, v, **kwargs):
        return self.fn(q, k, v, **kwargs)


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in QUICK else pytest.mark.slow) for n in CALL_KINDS])
def test_each_kind_of_call_compiles_with_fullgraph_and_matches_the_reference(name, device, target):
    """verify.check_one on the compiled call: O, lse, dQ, dK, dV (and the gradients of float inputs the score
    reads) against the float64 reference with `attngen check`'s error budget, NaN failing, on every CPU shape
    (a single token, odd lengths, GQA, MQA, q_len != kv_len); and no graph break."""
    kern = _kernel(name, target)
    compiled = Compiled(kern)
    for i, shape in enumerate(verify.CPU_SHAPES if device == "cpu" else verify.CUDA_SHAPES[:6]):
        result = verify.check_one(compiled, shape, device, seed=i)
        assert result.ok, verify.format_table(f"{name} compiled", [result])
    B, Hq, Hkv, Nq, Nk = verify.CPU_SHAPES[2]
    gen = torch.Generator().manual_seed(0)
    dtype = TORCH_DTYPES[kern.spec.dtype.value]
    q, k, v = (torch.randn(B, h, n, d, generator=gen).to(device=device, dtype=dtype)
               for h, n, d in ((Hq, Nq, kern.spec.head_dim), (Hkv, Nk, kern.spec.head_dim), (Hkv, Nk, kern.spec.dv)))
    inputs = verify.make_inputs(kern.spec, B, Hq, Nq, Nk, device, gen)
    if kern.spec.kv_layout.value == "paged":  # the keys in pages of a cache, read by the decode op (no gradient)
        k, v, serving = _pages(kern, k, v)
        inputs |= serving
        with torch.no_grad():
            explained = torch._dynamo.explain(lambda q, k, v: kern(q, k, v, **inputs))(q, k, v)
    else:
        explained = torch._dynamo.explain(lambda q, k, v: kern(q, k, v, **inputs))(q, k, v)
    assert explained.graph_break_count == 0 and explained.graph_count == 1, explained.break_reasons


@pytest.mark.parametrize("name", sorted(SPECS))
def test_every_shipped_spec_under_inductor_on_the_gpu(name, device, target):
    """On the GPU, torch.compile's own backend (Inductor) over every shipped spec, fullgraph and dynamic: the
    custom ops run inside Inductor's generated code, O, lse and the gradients within `attngen check`'s budget of
    the float64 reference on four CUDA shapes (odd lengths, GQA, MQA, 1000 and 4096 keys: on sm_90 the Gluon
    kernels where the spec takes them), NaN failing. (The CPU runs take aot_eager: Inductor's C++ code generation
    on two cores is slow and not what attngen adds.)"""
    if device != "cuda":
        pytest.skip("Inductor's GPU code: run with --device cuda (on the CPU the tests above use aot_eager)")
    kern = _kernel(name, target)
    compiled = Compiled(kern, backend="inductor")
    for i in (1, 2, 5, 7):
        result = verify.check_one(compiled, verify.CUDA_SHAPES[i], device, seed=i)
        assert result.ok, verify.format_table(f"{name} under inductor", [result])


def _pages(kern, k, v):
    """k, v (B, Hkv, N, D) written into pages of a cache: (k_cache, v_cache, {"block_table", "kv_lens"})."""
    from attngen.kvcache import append

    B, Hkv, N, _ = k.shape
    P = kern.spec.page_size
    per_seq = -(-N // P)
    table = torch.arange(B * per_seq, dtype=torch.int32, device=k.device).view(B, per_seq).flip(0).contiguous()
    k_cache, v_cache = (torch.zeros(B * per_seq, P, Hkv, x.shape[3], dtype=k.dtype, device=k.device) for x in (k, v))
    lens = append(k_cache, v_cache, k, v, torch.zeros(B, dtype=torch.int32, device=k.device), table)
    return k_cache, v_cache, {"block_table": table, "kv_lens": lens}


def test_one_graph_for_every_length(device, target):
    """dynamic=True: new sequence lengths, batch sizes and head counts reuse the graph (sizes 0 and 1 aside, which
    torch.compile specializes), in training and under no_grad; results equal the eager call's bit for bit."""
    kern = _kernel("causal", target)
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda q, k, v: kern(q, k, v), fullgraph=True, dynamic=True, backend=counter)
    dtype = TORCH_DTYPES[kern.spec.dtype.value]
    compiled = []
    for B, H, N in ((2, 3, 40), (2, 3, 57), (4, 5, 64)):  # no two sizes equal in the first call (duck sizing would tie them)
        q, k, v = (torch.randn(B, H, N, 128, device=device, dtype=dtype).requires_grad_() for _ in range(3))
        out = fn(q, k, v)
        grads = torch.autograd.grad(out.float().square().sum(), (q, k, v))
        want = kern(q, k, v)
        assert torch.equal(out, want) and not torch.isnan(out).any()
        assert all(torch.equal(g, w) for g, w in zip(grads, torch.autograd.grad(want.float().square().sum(), (q, k, v))))
        with torch.no_grad():
            assert torch.equal(fn(q, k, v), want)
        compiled.append(counter.frame_count)
    assert compiled[0] >= 2 and compiled == [compiled[0]] * 3  # graphs with grad and under no_grad, then none per size


def test_outputs_are_laid_out_as_the_inputs_eager_and_under_compile(device, target):
    """q, k, v as views of one fused projection (B, N, 3, H, D), as separate (B, N, H, D) tensors seen through
    transpose(1, 2), and contiguous: O and dQ, dK, dV come back laid out as q, k, v came (attngen.layout: a (B, N, H,
    D) memory for the first two, so o.transpose(1, 2).reshape(B, N, H * D) is a view), with the values of the
    contiguous call bit for bit and within the float64 reference's budget; the compiled call (whose custom ops'
    fake implementations must give the kernels' strides, or torch.compile stops) returns the same."""
    kern = _kernel("causal", target)
    dtype = TORCH_DTYPES[kern.spec.dtype.value]
    gen = torch.Generator().manual_seed(0)
    B, H, N, D = 2, 3, 40, 128
    fused = torch.randn(B, N, 3, H, D, generator=gen).to(device=device, dtype=dtype)
    do = torch.randn(B, N, H, D, generator=gen).to(device=device, dtype=dtype).transpose(1, 2)
    layouts = {"fused": list(fused.permute(2, 0, 3, 1, 4)), "rows": [t.contiguous().transpose(1, 2) for t in fused.unbind(2)],
               "contiguous": [t.transpose(1, 2).contiguous() for t in fused.unbind(2)]}
    fn = torch.compile(lambda q, k, v: kern(q, k, v), fullgraph=True, dynamic=True, backend="aot_eager")
    results = {}
    for name, tensors in layouts.items():
        leaves = [t.detach().requires_grad_() for t in tensors]
        rows = name != "contiguous"
        for how, call in (("eager", kern), ("compiled", fn)):
            out = call(*leaves)
            grads = torch.autograd.grad(out, leaves, do)
            for got in (out, *grads):
                assert (got.transpose(1, 2) if rows else got).is_contiguous(), (name, how, got.stride())
            results[name, how] = (out, *grads)
        # the custom ops' fake implementations (what torch.compile's graphs are built from) give the kernels' strides
        ops, (o, dq, dk, dv) = kern._ops(), results[name, "eager"]
        with FakeTensorMode() as mode:
            fakes = [mode.from_tensor(t) for t in (*tensors, o, do)]
            fake_o, fake_lse = ops.forward(*fakes[:3], [], 0.0, None, None)
            fake_grads = ops.backward(*fakes[:3], fake_o, fake_lse, fakes[4], None, [], 0.0, None, None, False)[:3]
        for fake, real in zip((fake_o, *fake_grads), (o, dq, dk, dv)):
            assert fake.shape == real.shape and fake.stride() == real.stride(), (name, fake.stride(), real.stride())
    wide = [t.detach().double().requires_grad_() for t in layouts["contiguous"]]
    ref = attngen.reference(kern.spec, *wide, dtype=torch.float64)
    want = (ref, *torch.autograd.grad(ref, wide, do.double()))
    for key, got in results.items():
        for g, c, w in zip(got, results["contiguous", "eager"], want):
            assert torch.equal(g, c), key
            assert not torch.isnan(g).any() and (g.double() - w).abs().max().item() <= 2e-2 * max(1.0, w.abs().max().item()), key


def test_return_lse_and_its_gradient_under_compile(device, target):
    kern = _kernel("causal", target)
    fn = torch.compile(lambda q, k, v: kern(q, k, v, return_lse=True), fullgraph=True, backend="aot_eager")
    dtype = TORCH_DTYPES[kern.spec.dtype.value]
    q, k, v = (torch.randn(1, 2, 33, 128, device=device, dtype=dtype).requires_grad_() for _ in range(3))
    (o, lse), (o2, lse2) = fn(q, k, v), kern(q, k, v, return_lse=True)
    assert torch.equal(o, o2) and torch.equal(lse, lse2)
    g = torch.autograd.grad(lse.sum() + o.float().sum(), (q, k, v))
    g2 = torch.autograd.grad(lse2.sum() + o2.float().sum(), (q, k, v))
    assert all(torch.equal(a, b) for a, b in zip(g, g2))


def test_dropout_under_compile_draws_its_seed_as_eager_does(device, target):
    """The default seed comes from torch's generator (q's device) inside the graph: torch.manual_seed makes a
    compiled call repeat the eager call's pattern, and each call draws a new one."""
    kern = _kernel("causal_dropout", target)
    fn = torch.compile(lambda q, k, v: kern(q, k, v), fullgraph=True, backend="aot_eager")
    dtype = TORCH_DTYPES[kern.spec.dtype.value]
    q, k, v = (torch.randn(1, 2, 48, kern.spec.head_dim, device=device, dtype=dtype) for _ in range(3))
    torch.manual_seed(7)
    eager = kern(q, k, v)
    torch.manual_seed(7)
    first, second = fn(q, k, v), fn(q, k, v)
    assert torch.equal(first, eager) and not torch.equal(first, second)
    assert torch.equal(torch.compile(lambda q, k, v: kern(q, k, v, seed=123), fullgraph=True, backend="aot_eager")(q, k, v),
                       kern(q, k, v, seed=123))


@pytest.mark.parametrize("name", [pytest.param(n, marks=() if n in QUICK else pytest.mark.slow) for n in CALL_KINDS])
def test_opcheck_passes_for_each_kind_of_call(name, device, target):
    """torch.library.opcheck on the ops: schema, autograd registration (forward and backward), fake tensors (the
    outputs' shapes), and AOT dispatch with dynamic shapes; the decode op (no autograd) where the spec decodes."""
    kern = _kernel(name, target)
    spec = kern.spec
    # grouped heads, partial tiles, more keys than rows: small, since opcheck checks the ops' registration (and runs each
    # several times); their numerics are test_numerics.py's
    B, Hq, Hkv, Nq, Nk = 1, 4, 2, 20, 27
    gen = torch.Generator().manual_seed(0)
    dtype = TORCH_DTYPES[spec.dtype.value]
    q, k, v, do = (torch.randn(B, h, n, d, generator=gen).to(device=device, dtype=dtype)
                   for h, n, d in ((Hq, Nq, spec.head_dim), (Hkv, Nk, spec.head_dim), (Hkv, Nk, spec.dv), (Hq, Nq, spec.dv)))
    inputs = verify.make_inputs(spec, B, Hq, Nq, Nk, device, gen)
    block_mask = inputs.pop("block_mask", None)
    tensors = [inputs[d.name] for d in spec.inputs]
    for t in tensors:
        if t.is_floating_point():
            t.requires_grad_()
    ops = kern._ops()
    if hasattr(kern.module, "attention_decode"):  # the decode op: a cache with per-sequence lengths (a paged spec: in pages)
        if spec.kv_layout.value == "paged":
            k_cache, v_cache, serving = _pages(kern, k, v)
            decode_args = (q, k_cache, v_cache, tensors, serving["kv_lens"], None, serving["block_table"])
        else:
            decode_args = (q, k, v, tensors, torch.full((B,), Nk - 3, dtype=torch.int32, device=device), None, None)
        with torch.no_grad():
            torch.library.opcheck(ops.decode, decode_args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    if spec.kv_layout.value == "paged":
        return  # a paged cache has no training ops to check
    p, seed = dropout_args(kern.spec, None, 5, q.device)
    forward_args = (q.requires_grad_(), k.requires_grad_(), v.requires_grad_(), tensors, p, seed, block_mask)
    torch.library.opcheck(ops.forward, forward_args)
    with torch.no_grad():  # the forward of calls with nothing to differentiate (no autograd formula)
        torch.library.opcheck(ops.inference, forward_args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
    o, lse = ops.forward(*forward_args)
    backward_args = (q.detach(), k.detach(), v.detach(), o.detach(), lse.detach(), do, None, [t.detach() for t in tensors], p, seed, block_mask, True)
    torch.library.opcheck(ops.backward, backward_args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))


def test_ops_are_named_after_the_spec(target):
    """attngen::<spec name>_<12 hex digits of its sha256>_fwd / _bwd; another kernel of the same spec in the same
    process (another target, generator or a bundle) gets a number, so no two kernels share an op."""
    a = _kernel("causal", target)
    b = _kernel("dense", target)
    c = _kernel("causal", target)
    assert a._ops().name.startswith(f"causal_{a.plan.spec_hash[:12]}") and b._ops().name.startswith("dense_")
    assert len({a._ops().name, b._ops().name, c._ops().name}) == 3
    assert a._ops().forward.name() == f"attngen::{a._ops().name}_fwd"
    assert hasattr(torch.ops.attngen, f"{c._ops().name}_bwd")


def test_a_compiled_call_with_nothing_to_differentiate_takes_the_inference_operator(device, target):
    """Traced under no_grad the graph calls attngen::<name>_infer (no autograd layer). With grad, a call returning O
    alone runs the same operator inside an autograd.Function the graph holds (CompiledAttention), whose backward
    gets no gradient for the lse; with return_lse, attngen::<name>_fwd, whose formula takes the lse's gradient.
    All give the eager call's O and gradients."""
    kern = _kernel("causal", target)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm.print_readable(print_output=False))
        return gm.forward

    fn = torch.compile(lambda q, k, v: kern(q, k, v), fullgraph=True, backend=recording)
    with_lse = torch.compile(lambda q, k, v: kern(q, k, v, return_lse=True), fullgraph=True, backend=recording)
    dtype = TORCH_DTYPES[kern.spec.dtype.value]
    q, k, v = (torch.randn(1, 2, 40, 128, device=device, dtype=dtype) for _ in range(3))
    do = torch.randn(q.shape, device=device, dtype=dtype)
    name = kern._ops().name
    with torch.no_grad():
        assert torch.equal(fn(q, k, v), kern(q, k, v))
    assert f"attngen.{name}_infer" in graphs[-1] and f"attngen.{name}_fwd" not in graphs[-1], graphs[-1]

    lse_grads = []
    backward = kern._backward_impl

    def recorded(q, k, v, o, lse, do, dlse, *rest, **kwargs):
        lse_grads.append(dlse)
        return backward(q, k, v, o, lse, do, dlse, *rest, **kwargs)
    kern._backward_impl = recorded
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    eager = [t.clone().requires_grad_() for t in (q, k, v)]
    o, want = fn(*leaves), kern(*eager)
    assert torch.equal(o, want)
    assert "autograd_function_apply" in graphs[-1] and f"attngen.{name}_infer" in graphs[-1] and f"attngen.{name}_fwd" not in graphs[-1], graphs[-1]
    got, wanted = torch.autograd.grad(o, leaves, do), torch.autograd.grad(want, eager, do)
    assert all(torch.equal(a, b) for a, b in zip(got, wanted)) and lse_grads[0] is None
    lse_grads.clear()
    o, lse = with_lse(*leaves)
    assert torch.equal(o, want.detach()) and f"attngen.{name}_fwd" in graphs[-1] and f"attngen.{name}_infer" not in graphs[-1], graphs[-1]
    torch.autograd.grad((o, lse), leaves, (do, torch.ones_like(lse)))
    assert lse_grads[0] is not None and torch.allclose(lse_grads[0], torch.full_like(lse_grads[0], math.log(2)))  # d(lse2 ln 2) / d lse2


def test_bad_calls_fail_while_tracing_with_the_eager_message(target):
    kern = _kernel("causal", target)
    fn = torch.compile(lambda q, k, v: kern(q, k, v), fullgraph=True, backend="aot_eager")
    q = torch.randn(1, 2, 16, 64)
    with pytest.raises(Exception, match="q has head_dim 64, the spec says 128"):
        fn(q, q, q)


def test_compiled_with_cuda_graph_trees_a_layer_replays_the_eager_results(device):
    """torch.compile(fullgraph=True, mode="reduce-overhead") (inductor's CUDA graph trees) over a layer that calls a
    causal spec on the model's views of one projection, at 1024 keys (the Gluon forward's persistent form on
    sm_90): it runs, and its replays give the eager layer's O and gradients bit for bit. The graph trees stop a
    run where a tensor made while a graph's first calls ran stays alive in the graph's pool (the persistent form's
    counter was, once)."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    kern = attngen.compile(SPECS["causal"])

    def layer(x):
        q, k, v = x.unflatten(-1, (3, 2, kern.spec.head_dim)).permute(2, 0, 3, 1, 4)  # (3, B, H, N, D) views
        return kern(q, k, v).transpose(1, 2).flatten(2)

    compiled = torch.compile(layer, fullgraph=True, mode="reduce-overhead")
    gen = torch.Generator(device="cuda").manual_seed(0)
    for _ in range(4):  # warm-up, recording, replays
        x = torch.randn(2, 1024, 3 * 2 * kern.spec.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen, requires_grad=True)
        do = torch.randn(2, 1024, 2 * kern.spec.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
        o = compiled(x)
        (dx,) = torch.autograd.grad(o, x, do)
        o, dx = o.clone(), dx.clone()  # (a replay's outputs live in the graph's pool)
        x_eager = x.detach().requires_grad_()
        o_eager = layer(x_eager)
        (dx_eager,) = torch.autograd.grad(o_eager, x_eager, do)
        assert not o.isnan().any() and not dx.isnan().any()
        assert torch.equal(o, o_eager) and torch.equal(dx, dx_eager)


@pytest.mark.parametrize("backend", ["triton", "gluon"])
def test_dropout_captured_in_a_cuda_graph_draws_a_new_pattern_per_replay(backend, device):
    """Forward and backward with dropout captured in a CUDA graph: with the default seed every replay draws a new
    pattern (the seed is drawn on the GPU and read by the kernels, not baked into the graph), and a seed tensor
    is read at each replay: a replay after seed.fill_(s) equals an eager call with seed=s, bit for bit. Both
    generators (Gluon's on sm_90 only)."""
    if device != "cuda" or (backend == "gluon" and torch.cuda.get_device_capability() != (9, 0)):
        pytest.skip("CUDA graphs need a GPU; Gluon kernels an sm_90 one")
    kern = attngen.compile(SPECS["causal_dropout"], backend=backend)
    q, k, v, do = (torch.randn(2, 4, 256, kern.spec.head_dim, device="cuda", dtype=torch.bfloat16) for _ in range(4))
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    seed = torch.tensor([5], device="cuda")

    def step(s):
        o = kern(q, k, v, seed=s)
        return (o, *torch.autograd.grad(o, (q, k, v), do))

    for s in (None, seed):
        step(s)  # compile and warm up outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            outs = step(s)
        replays = []
        for value in (5, 6):
            seed.fill_(value)
            graph.replay()
            torch.cuda.synchronize()
            replays.append([t.clone() for t in outs])
            assert not any(torch.isnan(t).any() for t in outs)
            if s is seed:
                assert all(torch.equal(a, b) for a, b in zip(outs, step(value)))
        assert not torch.equal(replays[0][0], replays[1][0]) and not torch.equal(replays[0][1], replays[1][1])


def test_a_decode_loop_captured_in_a_cuda_graph_replays(device):
    """CUDA-graph capture of eager calls (forward, and forward + backward): replays give the same results as new
    calls on the new inputs."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    kern = attngen.compile(SPECS["causal"])
    q, k, v = (torch.randn(2, 4, 256, 128, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    kern(q, k, v)  # compile and warm up outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = kern(q, k, v)
    for _ in range(2):
        for t in (q, k, v):
            t.copy_(torch.randn_like(t))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, kern(q, k, v))


def _packed(kern, lengths, device, gen, heads=(4, 2)):
    """q (total, Hq, D), k and v (total, Hkv, D), dO, and cu_seqlens for sequences of `lengths`."""
    dtype = TORCH_DTYPES[kern.spec.dtype.value]
    total, d = sum(lengths), kern.spec.head_dim
    q, do = (torch.randn(total, heads[0], d, generator=gen).to(device, dtype) for _ in range(2))
    k, v = (torch.randn(total, heads[1], d, generator=gen).to(device, dtype) for _ in range(2))
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)
    return [t.requires_grad_() for t in (q, k, v)], do, cu


def test_packed_sequences_under_compile_in_one_graph(device, target):
    """Packed sequences (cu_seqlens) under torch.compile(fullgraph=True, dynamic=True): their own pair of ops,
    in flash_attn's layout. O, the lse and the gradients equal the eager call's bit for bit and the float64
    reference within the naive attention's budget; other packings (number of sequences, lengths, max_seqlen)
    reuse the graph."""
    kern = _kernel("causal", target)
    counter = CompileCounterWithBackend("aot_eager")
    fn = torch.compile(lambda q, k, v, cu, m: kern(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=m, max_seqlen_k=m,
                                                   return_lse=True), fullgraph=True, dynamic=True, backend=counter)
    gen = torch.Generator().manual_seed(3)
    frames = []
    for lengths in ([5, 17, 1, 30], [9, 2, 40], [33, 7, 12, 3, 21]):
        (q, k, v), do, cu = _packed(kern, lengths, device, gen)
        o, lse = fn(q, k, v, cu, max(lengths))
        grads = torch.autograd.grad((o.float() * do.float()).sum() + lse.sum(), (q, k, v))
        o2, lse2 = kern(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths), return_lse=True)
        grads2 = torch.autograd.grad((o2.float() * do.float()).sum() + lse2.sum(), (q, k, v))
        assert o.shape == q.shape and lse.shape == (q.shape[1], q.shape[0]) and not torch.isnan(o).any()
        assert torch.equal(o, o2) and torch.equal(lse, lse2) and all(torch.equal(a, b) for a, b in zip(grads, grads2))
        # the float64 reference, within the budget of the same-precision naive attention (as tests/test_varlen.py)
        wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
        ref, ref_lse = attngen.reference(kern, *wide, cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True, dtype=torch.float64)
        narrow = [t.detach().clone().requires_grad_() for t in (q, k, v)]
        naive, naive_lse = attngen.reference(kern, *narrow, cu_seqlens_q=cu, cu_seqlens_k=cu, return_lse=True, dtype=q.dtype)
        err, _, bound = _bound(o.detach().cpu(), naive.detach().cpu(), ref.detach().cpu(), 2)
        assert err <= bound, (lengths, err, bound)
        ref_grads = torch.autograd.grad((ref * do.double()).sum() + ref_lse.sum(), wide)
        naive_grads = torch.autograd.grad((naive.float() * do.float()).sum() + naive_lse.float().sum(), narrow)
        for g, rg, ng in zip(grads, ref_grads, naive_grads):
            assert not torch.isnan(g).any()
            err, _, bound = _bound(g.cpu(), ng.cpu(), rg.cpu(), 3, 1.0)
            assert err <= bound, (lengths, err, bound)
        frames.append(counter.frame_count)
    assert frames == [frames[0]] * 3


def test_packed_sequences_under_compile_need_max_seqlen(target):
    """cu_seqlens is not read while torch.compile traces (a host synchronization): max_seqlen_q and max_seqlen_k
    must be given, and a call without them says so."""
    kern = _kernel("causal", target)
    fn = torch.compile(lambda q, k, v, cu: kern(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu), fullgraph=True, backend="aot_eager")
    (q, k, v), _, cu = _packed(kern, [3, 4], "cpu", torch.Generator().manual_seed(0))
    with pytest.raises(Exception, match="while torch.compile traces, pass max_seqlen_q"):
        fn(q, k, v, cu)


def test_opcheck_passes_for_the_packed_ops(device, target):
    """torch.library.opcheck on the packed ops: schema, autograd registration, fake tensors, AOT dispatch with
    dynamic shapes."""
    kern = _kernel("causal", target)
    (q, k, v), do, cu = _packed(kern, [5, 1, 12], device, torch.Generator().manual_seed(1))
    ops = kern._ops()
    args = (q, k, v, [], cu, cu, 12, 12, 0.0, None)
    torch.library.opcheck(ops.varlen_forward, args)
    o, lse = ops.varlen_forward(*args)
    backward_args = (q.detach(), k.detach(), v.detach(), o.detach(), lse.detach(), do, None, [], cu, cu, 12, 12, 0.0, None)
    torch.library.opcheck(ops.varlen_backward, backward_args, test_utils=("test_schema", "test_faketensor", "test_aot_dispatch_dynamic"))
