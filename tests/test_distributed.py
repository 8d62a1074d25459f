"""Context parallelism (attngen.distributed) over gloo, 2 and 4 processes spawned by the test, by each method (ring,
Ulysses, hybrid 2 x 2): every rank's shard of O, the lse and dQ, dK, dV, gathered, against the single-process kernel
and the float64 reference with the error budget of attngen.verify; reruns (RERUN) bit-identical; the masks (causal, window, documents, ALiBi, grouped-query heads,
dropout) and a sink evaluated at positions in the whole sequence; the gradients of float inputs (a score's three kinds
of reads, a sink's) summed over the ranks. Shapes that cannot be split are refused with a clear error.
On the GPU, benchmarks/context_parallel.py runs the same comparison over NCCL (BENCHMARKS.md)."""
import multiprocessing
import os
import traceback

import pytest
import torch

import attngen
import attngen.distributed
from attngen.tools import verify
from attngen.runtime.dtypes import TORCH_DTYPES
from attngen.errors import InputError
from attngen.tools.verify import _bound
from attngen.runtime.kernel import LN2

pytestmark = pytest.mark.slow  # starts processes; each runs the kernels in Triton's interpreter

# small tiles (16), 96 tokens: chunks of 24 (zigzag over two ranks, contiguous over four) and 48 tokens, tiles that
# straddle the chunks' edges and a window's
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
    # the score's three kinds of float reads, each getting its gradient through the shard kernels' terms: at neither
    # q_idx nor kv_idx (slopes: the rows' sums, combined once every key was seen, with the sink's share), at bare
    # indices (kb: each pair's term placed at its positions) and at an expression of both (rel: scattered)
    "bias": f"attention bias {{ {_TILES} dtype = fp32\n input slopes: fp32[H]\n input kb: fp32[B, N]\n input rel: fp32[H, 191]\n"
            f" input sinks: fp32[H]\n score = score - slopes[h] * (q_idx - kv_idx) + kb[b, kv_idx] + rel[h, q_idx - kv_idx + 95]\n"
            f" sink = sinks[h] }}",
}
# a mask that reads the query head itself (not as an input's index): under Ulysses and hybrid, the shard kernels with
# the inputs whole and a head offset
SPECS["head_mask"] = f"attention head_mask {{ {_TILES} dtype = fp32\n mask = q_idx >= kv_idx or h == 2 }}"
B, HQ, HKV, N = 1, 4, 2, 96
HEADS = {"dropout": (2, 1)}  # (query, key/value) heads where not HQ, HKV: dropout's cases run 256 tokens
SEED = 1234
# (spec, layout): run by every world size below; dropout needs 128-token chunks (world 2, contiguous: 256 tokens)
# (the contiguous layout: alibi, lengths and dropout's cases)
CASES = [("causal", "zigzag"), ("window", "zigzag"), ("document", "zigzag"), ("alibi", "contiguous"),
         ("dense_bf16", "zigzag"), ("lengths", "contiguous"), ("value_dim", "zigzag"), ("sink", "zigzag"), ("bias", "zigzag")]


# the case run twice, to compare bits: hybrid (zigzag), whose ring sums in a fixed order as the ring alone does
RERUN = {("causal", "zigzag", "hybrid")}
# Ulysses and hybrid (2 x 2 with four ranks): (spec, layout, method). ALiBi's slopes get gradients through Ulysses
# (the kernel itself on each rank's heads); with four ranks the two key/value heads each go to two ranks (their
# gradients summed), a sink's input too. Dropout (Ulysses) and a mask reading h (hybrid) run the shard kernels with
# a head offset: the same pattern and heads as one process; the hybrid's bias, its inputs' gradients through them.
# With the ring's cases above: causal, window, documents and ALiBi by each method
METHOD_CASES = {2: [("alibi", "contiguous", "ulysses"), ("dropout", "contiguous", "ulysses"), ("document", "zigzag", "ulysses"),
                    ("window", "contiguous", "ulysses")],
                4: [("causal", "zigzag", "hybrid"), ("sink", "zigzag", "ulysses"), ("head_mask", "zigzag", "hybrid"),
                    ("bias", "zigzag", "hybrid"), ("document", "zigzag", "hybrid"), ("alibi", "contiguous", "hybrid")]}


def _data(name, n):
    """q, k, v, dO and the spec's inputs; the float inputs require grad (their gradients are checked too)."""
    spec = attngen.compile(SPECS[name], "h100").spec
    gen = torch.Generator().manual_seed(0)
    dtype = TORCH_DTYPES[spec.dtype.value]
    hq, hkv = HEADS.get(name, (HQ, HKV))
    q, do = (torch.randn(B, hq, n, d, generator=gen).to(dtype) for d in (spec.head_dim, spec.dv))
    k, v = (torch.randn(B, hkv, n, d, generator=gen).to(dtype) for d in (spec.head_dim, spec.dv))
    inputs = verify.make_inputs(spec, B, hq, n, n, "cpu", gen)
    for t in inputs.values():
        if t.is_floating_point():
            t.requires_grad_()
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

    if os.environ.get("TRITON_INTERPRET") == "1":
        from interpreter_patches import skip_repeated_patches

        skip_repeated_patches()  # as conftest.py does in the test process
    dist.init_process_group("gloo", init_method=init, rank=rank, world_size=world)
    results = {}
    try:
        for case in cases:
            name, layout, method = (*case, "ring")[:3]
            kern = attngen.compile(SPECS[name], "h100")
            n = 256 if name == "dropout" and method == "ring" else N  # (Ulysses runs the whole sequence: no chunk rule)
            q, k, v, do, inputs = _data(name, n)
            kw = {"seed": SEED} if name == "dropout" else {}
            if method != "ring":
                kw |= {"method": method, "ulysses_size": 2 if method == "hybrid" else None}
            first = _run(kern, layout, q, k, v, do, inputs, **kw)
            if case in RERUN:  # run again: the same bits (every rank's sums in a fixed order)
                again = _run(kern, layout, q, k, v, do, inputs, **kw)
                results[case] = (first, all(torch.equal(a, b) for a, b in zip(first, again)))
            else:
                results[case] = (first, True)
        # refused: shards of different lengths on different ranks, zigzag's odd shard, dropout without a seed
        kern = attngen.compile(SPECS["causal"], "h100")
        errors = {}
        for what, call in (
            ("uneven", lambda: attngen.distributed.context_parallel(kern, *(torch.randn(1, 2, 16 + rank, 16) for _ in range(3)))),
            ("odd", lambda: attngen.distributed.context_parallel(kern, *(torch.randn(1, 2, 15, 16) for _ in range(3)), layout="zigzag")),
            ("seed", lambda: attngen.distributed.context_parallel(attngen.compile(SPECS["dropout"], "h100"), *(torch.randn(1, 2, 128, 16) for _ in range(3)))),
            ("layout", lambda: attngen.distributed.context_parallel(kern, *(torch.randn(1, 2, 16, 16) for _ in range(3)), layout="ring")),
            ("method", lambda: attngen.distributed.context_parallel(kern, *(torch.randn(1, 2, 16, 16) for _ in range(3)), method="spiral")),
            ("size", lambda: attngen.distributed.context_parallel(kern, *(torch.randn(1, 2, 16, 16) for _ in range(3)), method="hybrid",
                                                                  ulysses_size=3)),
            ("heads", lambda: attngen.distributed.context_parallel(kern, *(torch.randn(1, 3, 16, 16) for _ in range(3)), method="ulysses")),
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


def _check(case, gathered, identical):
    """The gathered results against the kernel in one process and the float64 reference."""
    name, _, method = (*case, "ring")[:3]
    assert identical, f"{case}: a rerun gave different bits"
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
    assert err <= bound, (case, "out", err, bound)
    err1, _, bound1 = _bound(one.detach(), naive.detach(), ref.detach(), 2)
    assert err1 <= bound1  # the one-process kernel itself, on the same data
    finite = torch.isfinite(one_lse)
    assert torch.equal(torch.isfinite(lse), finite), case
    assert (lse[finite] - one_lse[finite]).abs().max() <= 1e-4 * max(1.0, one_lse[finite].abs().max()), case
    for what, g, rg, ng, og in zip(("dq", "dk", "dv", *trained), (dq, dk, dv, *d_inputs), ref_grads, naive_grads, one_grads):
        err, _, bound = _bound(g, ng, rg, 3, 1.0 if what in ("dq", "dk", "dv") else float(n))
        assert err <= bound, (case, what, err, bound)
        assert (g.float() - og.float()).abs().max() <= 2 * bound, (case, what)


@pytest.mark.parametrize("world", [2, 4])
def test_context_parallel_matches_one_process_and_the_reference(world, tmp_path):
    # four ranks: the layouts' chunk pairs and a window's dropped blocks (every spec runs with two)
    cases = CASES + [("dropout", "contiguous")] if world == 2 else [("causal", "zigzag"), ("window", "contiguous")]
    cases += METHOD_CASES[world]
    results = _spawn(world, cases, tmp_path)
    for case in cases:
        _check(case, *results[case])
    errors = results["errors"]
    assert "same shape" in errors["uneven"] and "rank 1: q (1, 2, 17, 16)" in errors["uneven"], errors["uneven"]
    assert "odd" in errors["odd"], errors["odd"]
    assert "seed=" in errors["seed"], errors["seed"]
    assert "layout must be one of contiguous, zigzag" in errors["layout"], errors["layout"]
    assert "method must be one of ring, ulysses, hybrid; got 'spiral'" in errors["method"], errors["method"]
    assert f"ulysses_size, a divisor of the group's {world} ranks; got 3" in errors["size"], errors["size"]
    assert f"splits the query heads across {world} ranks; q has 3" in errors["heads"], errors["heads"]


@pytest.mark.parametrize("name", ["dropout", "head_mask", "head_sink"])
def test_shard_kernels_with_a_head_offset_give_those_heads_of_the_whole_call(name):
    """What Ulysses runs where the spec reads h or has dropout: the shard kernels on a slice of the query heads (and
    their key/value heads), told the slice's first head among the whole tensor's, with the inputs whole. O, the lse
    and dQ are those heads' of the whole call (the same bits: the same kernels' arithmetic, the same dropout
    pattern; with a sink, merged after the kernels, within rounding); dK and dV (of the key/value head those query
    heads read alone) and a sink's input's gradient are those heads' share of the whole call's (the group sums the
    shares). The whole call itself is checked against the float64 reference."""
    from attngen.distributed.ring import _Ring, _ring_attention
    from attngen.runtime.checks import dropout_args

    specs = dict(SPECS, head_sink=f"attention head_sink {{ {_TILES} dtype = fp32\n input sinks: fp32[H]\n sink = sinks[h] - 0.25 * h\n"
                                  f" mask = q_idx >= kv_idx }}")
    kern = attngen.compile(specs[name], "h100")
    gen = torch.Generator().manual_seed(5)
    q, do = (torch.randn(2, 4, 64, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 2, 64, 16, generator=gen) for _ in range(2))
    inputs = {"sinks": torch.randn(4, generator=gen)} if name == "head_sink" else {}
    kw = {"seed": SEED} if name == "dropout" else {}
    leaves = [t.clone().requires_grad_() for t in (q, k, v, *inputs.values())]
    whole, whole_lse = kern(*leaves[:3], return_lse=True, **kw, **dict(zip(inputs, leaves[3:])))
    grads = torch.autograd.grad(whole, leaves, do)
    ref_kw = {"dropout_p": kern.spec.dropout, "seed": SEED} if name == "dropout" else {}
    wide = [t.double().requires_grad_() for t in (q, k, v, *inputs.values())]
    ref = attngen.reference(kern, *wide[:3], dtype=torch.float64, **ref_kw, **dict(zip(inputs, wide[3:])))
    ref_grads = torch.autograd.grad(ref, wide, do.double())
    assert torch.allclose(whole.double(), ref, atol=1e-5) and all(torch.allclose(g.double(), r, atol=1e-4) for g, r in zip(grads, ref_grads))
    p, seed_t = dropout_args(kern.spec, None, SEED, "cpu") if name == "dropout" else (0.0, None)
    part = [q[:, 2:].clone().requires_grad_(), k[:, 1:].clone().requires_grad_(), v[:, 1:].clone().requires_grad_(),
            *(t.clone().requires_grad_() for t in inputs.values())]  # query heads 2 and 3, their key/value head 1
    o, lse2 = _ring_attention(kern, _Ring.alone(), "contiguous", *part[:3], part[3:], p, seed_t, (2, 4))
    part_grads = torch.autograd.grad(o, part, do[:, 2:])
    assert not any(torch.isnan(t).any() for t in (o, *part_grads))
    # (a sink is merged into the rows after the kernels, not inside them: the same values up to rounding)
    same = torch.equal if name != "head_sink" else (lambda a, b: torch.allclose(a, b, atol=1e-6))
    assert same(o, whole[:, 2:]) and torch.allclose(lse2 * LN2, whole_lse[:, 2:], atol=1e-6)
    assert same(part_grads[0], grads[0][:, 2:])
    # key/value head 1 is read by query heads 2 and 3 alone: its whole gradients
    assert all(torch.allclose(g, w[:, 1:], atol=1e-5) for g, w in zip(part_grads[1:3], grads[1:3]))
    if inputs:  # the sink's input: heads 2 and 3 get theirs, the others none
        assert torch.allclose(part_grads[3][2:], grads[3][2:], atol=1e-6) and not part_grads[3][:2].any()


def test_shard_kernels_give_the_score_inputs_gradients_of_their_heads():
    """The gradients of the inputs a score reads, through the shard kernels on a slice of the query heads (what
    Ulysses with dropout or h, and the hybrid's ring, run): those of the whole call whose dO is zero outside the
    slice, for each kind of read (slopes[h]: the rows' sums combined with the sink's share; kb[b, kv_idx] at bare
    indices; rel[h, q_idx - kv_idx + 63] scattered) and the sink's input. The whole call against float64."""
    from attngen.distributed.ring import _Ring, _ring_attention

    kern = attngen.compile(SPECS["bias"].replace("191", "127").replace("+ 95", "+ 63"), "h100")
    gen = torch.Generator().manual_seed(5)
    q, do = (torch.randn(2, 4, 64, 16, generator=gen) for _ in range(2))
    k, v = (torch.randn(2, 2, 64, 16, generator=gen) for _ in range(2))
    inputs = {"slopes": torch.rand(4, generator=gen) * 0.1, "kb": torch.randn(2, 64, generator=gen), "rel": torch.randn(4, 127, generator=gen),
              "sinks": torch.randn(4, generator=gen)}
    do[:, :2] = 0  # the loss reads heads 2 and 3 only
    leaves = [t.clone().requires_grad_() for t in (q, k, v, *inputs.values())]
    whole = kern(*leaves[:3], **dict(zip(inputs, leaves[3:])))
    grads = torch.autograd.grad(whole, leaves, do)
    wide = [t.double().requires_grad_() for t in (q, k, v, *inputs.values())]
    ref = attngen.reference(kern, *wide[:3], dtype=torch.float64, **dict(zip(inputs, wide[3:])))
    ref_grads = torch.autograd.grad(ref, wide, do.double())
    for g, r in zip(grads, ref_grads):
        assert not torch.isnan(g).any() and torch.allclose(g.double(), r, rtol=1e-4, atol=1e-4 * r.abs().max().item())
    part = [q[:, 2:].clone().requires_grad_(), k[:, 1:].clone().requires_grad_(), v[:, 1:].clone().requires_grad_(),
            *(t.clone().requires_grad_() for t in inputs.values())]  # query heads 2 and 3, their key/value head 1
    o, _ = _ring_attention(kern, _Ring.alone(), "contiguous", *part[:3], part[3:], 0.0, None, (2, 4))
    part_grads = torch.autograd.grad(o, part, do[:, 2:])
    for name, g, w in zip(("q", "k", "v", *inputs), part_grads, grads):
        w = w[:, 2:] if name == "q" else w[:, 1:] if name in ("k", "v") else w
        assert not torch.isnan(g).any() and torch.allclose(g, w, rtol=1e-5, atol=1e-6 * w.abs().max().item()), name


def test_an_fp8_spec_is_refused_before_any_communication():
    kern = attngen.compile("attention f { head_dim = 64 dtype = fp8 }", "h100")
    with pytest.raises(InputError, match="FP8"):
        attngen.distributed.context_parallel(kern, *(torch.zeros(1, 2, 16, 64, dtype=torch.float8_e4m3fn) for _ in range(3)))


def test_a_call_without_a_process_group_says_so():
    kern = attngen.compile(SPECS["causal"], "h100")
    with pytest.raises(InputError, match="init_process_group"):
        attngen.distributed.context_parallel(kern, *(torch.randn(1, 2, 16, 16) for _ in range(3)))


def test_ulysses_splits_inputs_by_the_heads_they_are_read_at():
    """Which input axes Ulysses splits with the heads (those read at the bare query head), and the specs whose inputs
    cannot be split, saying why (context_parallel runs those through the shard kernels with a head offset): h read
    otherwise, or an axis read at h and at something else."""
    from attngen.distributed.ulysses import head_split_axes

    def axes(body):
        return head_split_axes(attngen.compile(f"attention s {{ {_TILES} dtype = fp32\n {body} }}", "h100").spec)

    assert axes("input slopes: fp32[H]\n mask = q_idx >= kv_idx\n score = score - slopes[h] * (q_idx - kv_idx)") == {"slopes": (0,)}
    assert axes("input sinks: fp32[H]\n sink = sinks[h]") == {"sinks": (0,)}
    assert axes("input doc: int32[B, N]\n mask = doc[b, q_idx] == doc[b, kv_idx]") == {}
    assert axes("input bias: fp32[H, 64]\n score = score + bias[h, kv_idx % 64]") == {"bias": (0,)}
    for body, message in (("mask = q_idx >= kv_idx or h == 0", "reads the query head h in an expression"),
                          ("input slopes: fp32[H]\n score = score - slopes[h // 2]", "reads the query head h in an index of input 'slopes'"),
                          ("input slopes: fp32[H]\n score = score - slopes[h] + slopes[0]", "input 'slopes' is read at h and at other values"),
                          ("input slopes: fp32[H]\n score = score - slopes[0]", "input 'slopes' dimension 0 is declared H but not read at h"),
                          ("input slopes: fp32[16]\n score = score - slopes[h]", "input 'slopes' dimension 0 is declared 16 but read at h")):
        with pytest.raises(InputError, match=message):
            axes(body)


@pytest.mark.parametrize("world", [1, 2, 4])
@pytest.mark.parametrize("layout", ["contiguous", "zigzag"])
def test_ulysses_puts_the_gathered_rows_in_sequence_order(world, layout):
    """The rows every rank's shard contributes (rank 0's, then rank 1's, ...), reordered by token_order, are the
    sub-group's positions in order; key/value heads go to the ranks whose query heads read them."""
    from attngen.distributed.layout import chunks
    from attngen.distributed.ulysses import kv_head_ranges, token_order

    n = 8
    gathered = torch.tensor([c.start + i for r in range(world) for c in chunks(layout, r, world, n) for i in range(c.length)])
    order = token_order(layout, 0, world, n)
    assert torch.equal(gathered if order is None else gathered[order], torch.arange(world * n))
    assert kv_head_ranges(16, 16, 2) == [range(0, 8), range(8, 16)]
    assert kv_head_ranges(8, 2, 4) == [range(0, 1), range(0, 1), range(1, 2), range(1, 2)]
    assert kv_head_ranges(4, 1, 4) == [range(0, 1)] * 4
