"""Context parallelism (attngen.distributed) over gloo, 2 and 4 processes spawned by the test: every rank's shard of
O, the lse and dQ, dK, dV, gathered, against the single-process kernel and the float64 reference with the error
budget of attngen.verify; reruns (RERUN) bit-identical; the masks (causal, window, documents, ALiBi, grouped-query heads,
dropout) and a sink evaluated at positions in the whole sequence, the sink's input's gradient summed over the ranks. Shapes that cannot be split are refused with a clear error.
On the GPU, benchmarks/context_parallel.py runs the same comparison over NCCL (BENCHMARKS.md)."""
import multiprocessing
import traceback

import pytest
import torch

import attngen
import attngen.distributed
from attngen.tools import verify
from attngen.runtime.dtypes import TORCH_DTYPES
from attngen.errors import InputError
from attngen.tools.verify import _bound

pytestmark = pytest.mark.slow  # starts processes; each runs the kernels in Triton's interpreter

# small tiles (16) so that every chunk spans several tiles and some tiles straddle a window's edge
_TILES = "head_dim = 16\n block_m = 16\n block_n = 16\n"
SPECS = {
    "causal": f"attention causal {{ {_TILES} dtype = fp32\n mask = q_idx >= kv_idx }}",
    "window": f"attention window {{ {_TILES} dtype = fp32\n mask = q_idx >= kv_idx and q_idx - kv_idx < 40 }}",
    "document": f"attention document {{ {_TILES} dtype = fp32\n input doc: int32[B, N]\n"
                f" mask = doc[b, q_idx] == doc[b, kv_idx] and q_idx >= kv_idx }}",
    "alibi": f"attention alibi {{ {_TILES} dtype = fp32\n input slopes: fp32[H]\n mask = q_idx >= kv_idx\n"
             f" score = score - slopes[h] * (q_idx - kv_idx) }}",
    "dense_bf16": f"attention dense_bf16 {{ {_TILES} dtype = bf16 }}",
    # the whole sequence's length, not the shard's: the last 8 rows of the sequence keep no key
    "lengths": f"attention lengths {{ {_TILES} dtype = fp32\n mask = q_idx >= kv_idx and q_idx + 8 < kv_len }}",
    # DeepSeek's shape, small: V and O narrower than q and k
    "value_dim": "attention value_dim { head_dim = 32\n value_dim = 16\n block_m = 16\n block_n = 16\n dtype = fp32\n mask = q_idx >= kv_idx }",
    # a learned sink per head that also reads the row's position in the whole sequence, over a window
    "sink": f"attention sink {{ {_TILES} dtype = fp32\n input sinks: fp32[H]\n sink = sinks[h] - 0.01 * q_idx\n"
            f" mask = q_idx >= kv_idx and q_idx - kv_idx < 40 }}",
    "dropout": "attention dropout { head_dim = 16\n block_m = 16\n block_n = 64\n dtype = fp32\n mask = q_idx >= kv_idx\n dropout = 0.2 }",
}
B, HQ, HKV, N = 1, 4, 2, 128
SEED = 1234
# (spec, layout): run by every world size below; dropout needs 128-token chunks (world 2, contiguous: 256 tokens)
# (the contiguous layout: alibi, lengths and dropout's cases; its bits rerun: dropout's)
CASES = [("causal", "zigzag"), ("window", "zigzag"), ("document", "zigzag"), ("alibi", "contiguous"),
         ("dense_bf16", "zigzag"), ("lengths", "contiguous"), ("value_dim", "zigzag"), ("sink", "zigzag")]


# the cases run twice, to compare bits: both layouts, an input read by the mask, dropout's pattern
RERUN = {("causal", "zigzag"), ("document", "zigzag"), ("dropout", "contiguous")}


def _data(name, n):
    """q, k, v, dO and the spec's inputs; a sink's input requires grad (its gradient is checked too)."""
    spec = attngen.compile(SPECS[name], "h100").spec
    gen = torch.Generator().manual_seed(0)
    dtype = TORCH_DTYPES[spec.dtype.value]
    q, do = (torch.randn(B, HQ, n, d, generator=gen).to(dtype) for d in (spec.head_dim, spec.dv))
    k, v = (torch.randn(B, HKV, n, d, generator=gen).to(dtype) for d in (spec.head_dim, spec.dv))
    inputs = verify.make_inputs(spec, B, HQ, n, n, "cpu", gen)
    if "sinks" in inputs:
        inputs["sinks"].requires_grad_()
    return q, k, v, do, inputs


def _run(kern, layout, q, k, v, do, inputs, **kw):
    """This rank's shards through context_parallel, forward and backward; the results gathered whole (then the
    gradients of the inputs that require one, the same on every rank)."""
    cp = attngen.distributed
    leaves = [cp.shard(t, layout).requires_grad_() for t in (q, k, v)]
    o, lse = cp.context_parallel(kern, *leaves, layout=layout, return_lse=True, **kw, **inputs)
    o.backward(cp.shard(do, layout))
    trained = [t.grad.clone() for t in inputs.values() if t.requires_grad]
    for t in inputs.values():
        t.grad = None
    return [cp.unshard(t.detach(), layout) for t in (o, lse, *(x.grad for x in leaves))] + trained


def _worker(rank, world, init, out, cases):
    import torch.distributed as dist

    import attngen.distributed  # noqa: F401 (attngen.distributed below)

    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    results = {}
    try:
        for name, layout in cases:
            kern = attngen.compile(SPECS[name], "h100")
            n = 256 if name == "dropout" else N
            q, k, v, do, inputs = _data(name, n)
            kw = {"seed": SEED} if name == "dropout" else {}
            first = _run(kern, layout, q, k, v, do, inputs, **kw)
            if (name, layout) in RERUN:  # run again: the same bits (every rank's sums in a fixed order)
                again = _run(kern, layout, q, k, v, do, inputs, **kw)
                results[(name, layout)] = (first, all(torch.equal(a, b) for a, b in zip(first, again)))
            else:
                results[(name, layout)] = (first, True)
        # refused: shards of different lengths on different ranks, zigzag's odd shard, dropout without a seed
        kern = attngen.compile(SPECS["causal"], "h100")
        errors = {}
        for what, call in (
            ("uneven", lambda: attngen.distributed.context_parallel(kern, *(torch.randn(1, 2, 16 + rank, 16) for _ in range(3)))),
            ("odd", lambda: attngen.distributed.context_parallel(kern, *(torch.randn(1, 2, 15, 16) for _ in range(3)), layout="zigzag")),
            ("seed", lambda: attngen.distributed.context_parallel(attngen.compile(SPECS["dropout"], "h100"), *(torch.randn(1, 2, 128, 16) for _ in range(3)))),
            ("layout", lambda: attngen.distributed.context_parallel(kern, *(torch.randn(1, 2, 16, 16) for _ in range(3)), layout="ring")),
        ):
            try:
                call()
                errors[what] = None
            except InputError as e:
                errors[what] = str(e)
        results["errors"] = errors
    except Exception:
        results = {"crash": traceback.format_exc()}
    if rank == 0:
        torch.save(results, out)
    dist.destroy_process_group()


def _spawn(world, cases, tmp_path):
    ctx = multiprocessing.get_context("spawn")
    out = tmp_path / "results.pt"
    init = f"file://{tmp_path / 'rendezvous'}"
    procs = [ctx.Process(target=_worker, args=(r, world, init, str(out), cases)) for r in range(world)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(timeout=900)
        assert p.exitcode == 0, f"a worker exited with {p.exitcode}"
    results = torch.load(out)
    assert "crash" not in results, results.get("crash")
    return results


def _check(name, layout, gathered, identical):
    """The gathered results against the kernel in one process and the float64 reference."""
    assert identical, f"{name} ({layout}): a rerun gave different bits"
    kern = attngen.compile(SPECS[name], "h100")
    n = gathered[0].shape[2]
    q, k, v, do, inputs = _data(name, n)
    o, lse, dq, dk, dv, *d_inputs = gathered
    assert not any(torch.isnan(t).any() for t in (o, dq, dk, dv, *d_inputs)), name
    dtype = q.dtype
    kw = {"seed": SEED} if name == "dropout" else {}
    trained = [n for n, t in inputs.items() if t.requires_grad]
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    one, one_lse = kern(*leaves, return_lse=True, **kw, **inputs)
    one_grads = torch.autograd.grad(one, leaves + [inputs[n] for n in trained], do)
    ref_kw = {"dropout_p": kern.spec.dropout, "seed": SEED} if name == "dropout" else {}  # the kernels' own keep pattern
    wide = [t.double().requires_grad_() for t in (q, k, v)] + [inputs[n].detach().double().requires_grad_() for n in trained]
    ref = attngen.reference(kern, *wide[:3], dtype=torch.float64, **ref_kw, **{**inputs, **dict(zip(trained, wide[3:]))})
    narrow = [t.clone().requires_grad_() for t in (q, k, v)] + [inputs[n].detach().clone().requires_grad_() for n in trained]
    naive = attngen.reference(kern, *narrow[:3], dtype=dtype, **ref_kw, **{**inputs, **dict(zip(trained, narrow[3:]))})
    ref_grads = torch.autograd.grad(ref, wide, do.double())
    naive_grads = torch.autograd.grad(naive, narrow, do)
    err, _, bound = _bound(o, naive.detach(), ref.detach(), 2)
    assert err <= bound, (name, layout, "out", err, bound)
    err1, _, bound1 = _bound(one.detach(), naive.detach(), ref.detach(), 2)
    assert err1 <= bound1  # the one-process kernel itself, on the same data
    finite = torch.isfinite(one_lse)
    assert torch.equal(torch.isfinite(lse), finite), (name, layout)
    assert (lse[finite] - one_lse[finite]).abs().max() <= 1e-4 * max(1.0, one_lse[finite].abs().max()), (name, layout)
    for what, g, rg, ng, og in zip(("dq", "dk", "dv", *trained), (dq, dk, dv, *d_inputs), ref_grads, naive_grads, one_grads):
        err, _, bound = _bound(g, ng, rg, 3, 1.0 if what in ("dq", "dk", "dv") else float(n))
        assert err <= bound, (name, layout, what, err, bound)
        assert (g.float() - og.float()).abs().max() <= 2 * bound, (name, layout, what)


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_matches_one_process_and_the_reference(world, tmp_path):
    # four ranks: the layouts' chunk pairs and a window's dropped blocks (every spec runs with two)
    cases = CASES + [("dropout", "contiguous")] if world == 2 else [("causal", "zigzag"), ("window", "contiguous"), ("lengths", "zigzag")]
    results = _spawn(world, cases, tmp_path)
    for name, layout in cases:
        _check(name, layout, *results[(name, layout)])
    errors = results["errors"]
    assert "same shape" in errors["uneven"] and "rank 1: q (1, 2, 17, 16)" in errors["uneven"], errors["uneven"]
    assert "odd" in errors["odd"], errors["odd"]
    assert "seed=" in errors["seed"], errors["seed"]
    assert "layout must be one of contiguous, zigzag" in errors["layout"], errors["layout"]


def test_an_fp8_spec_is_refused_before_any_communication():
    kern = attngen.compile("attention f { head_dim = 64 dtype = fp8 }", "h100")
    with pytest.raises(InputError, match="FP8"):
        attngen.distributed.context_parallel(kern, *(torch.zeros(1, 2, 16, 64, dtype=torch.float8_e4m3fn) for _ in range(3)))


def test_a_call_without_a_process_group_says_so():
    kern = attngen.compile(SPECS["causal"], "h100")
    with pytest.raises(InputError, match="init_process_group"):
        attngen.distributed.context_parallel(kern, *(torch.randn(1, 2, 16, 16) for _ in range(3)))
