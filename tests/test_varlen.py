"""Packed variable-length batches (cu_seqlens, flash_attn_varlen_func's layout): each sequence's rows through the
packed call equal the same kernel's call on that sequence alone, and match the float64 reference within the
error budget of attngen.verify (twice the error of same-precision naive attention, plus a floor); the lengths
mix 0, 1, a tile - 1, a tile + 1 and longer ones, with grouped-query heads and per-sequence q_len != kv_len.
Bad offsets are refused before any kernel runs."""
from pathlib import Path

import pytest
import torch

import attngen
from attngen.tools import verify
from attngen.runtime.dtypes import TORCH_DTYPES
from attngen.errors import InputError
from attngen.tools.verify import _bound

ROOT = Path(__file__).parent.parent
HQ, HKV = 4, 2
# (query lengths, key lengths) per sequence: 0, 1, tile - 1, tile + 1 (the forward's tiles are 128 rows), longer,
# a sequence with queries but no key; bottom-right causal sees q_len != kv_len in most of them
LENGTHS = ([3, 0, 1, 127, 129, 200, 4], [3, 5, 1, 130, 129, 260, 0])


def _offsets(lengths, device):
    return torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=device)


def _inputs(kern, device, gen):
    """The spec's declared inputs for the packed batch, sized by the longest sequences: b indexes sequences."""
    return verify.make_inputs(kern.spec, len(LENGTHS[0]), HQ, max(LENGTHS[0]), max(LENGTHS[1]), device, gen)


# every shipped spec but those whose features packed calls refuse (runtime sparsity, kv_outer, a paged cache:
# test_decode.py) and dropout's (its pattern depends on b, so a sequence alone is another pattern:
# test_dropout_with_packed_sequences_...)
# (and of the static block patterns one, strided_blocks: butterfly's and local_global's kernels walk their lists by the
# same code, which test_numerics.py checks for each)
PACKED_SPECS = sorted(p.stem for p in (ROOT / "specs").glob("*.attn")
                      if p.stem not in ("block_sparse_runtime", "causal_fa1", "causal_dropout", "paged_decode", "mla_decode",
                                        "butterfly_blocks", "local_global_blocks"))


QUICK = ("causal", "causal_bottom_right", "sliding_window", "causal_softcap", "key_padding")  # the rest are slow: ~20 s each


@pytest.mark.parametrize("name", [n if n in QUICK else pytest.param(n, marks=pytest.mark.slow) for n in PACKED_SPECS])
def test_packed_sequences_match_each_sequence_alone_and_the_reference(name, target, device):
    _check_packed(attngen.compile(ROOT / "specs" / f"{name}.attn", target), device)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("name", ["causal", "causal_bottom_right", "sliding_window", "dense"])
def test_packed_sequences_through_the_gluon_kernels(name, deterministic, device):
    """Both passes by the Gluon generator (backend = gluon, which takes the backward at any length): a tile reaching
    past its sequence reads the next one's rows, masked; dQ's zeros added there change nothing. With
    deterministic = false, dQ may differ from the unpacked call's in its last bits."""
    if device != "cuda":
        pytest.skip("Gluon kernels run on an sm_90 GPU only (Triton's interpreter does not run Gluon)")
    kern = attngen.compile(ROOT / "specs" / f"{name}.attn", backend="gluon", deterministic=deterministic)
    assert kern.generator.generator == kern.generator.backward == "gluon"
    _check_packed(kern, device, exact_dq=deterministic)


def _check_packed(kern, device, exact_dq=True, seed=0, max_seqlen=False):
    """max_seqlen: the call gives max_seqlen_q and max_seqlen_k (which a packed call kept by signature needs)."""
    name = kern.spec.name
    dtype = TORCH_DTYPES[kern.spec.dtype.value]
    gen = torch.Generator().manual_seed(seed)
    cq, ck = _offsets(LENGTHS[0], device), _offsets(LENGTHS[1], device)
    d, dv = kern.spec.head_dim, kern.spec.dv
    q, do = (torch.randn(sum(LENGTHS[0]), HQ, w, generator=gen).to(device=device, dtype=dtype) for w in (d, dv))
    k, v = (torch.randn(sum(LENGTHS[1]), HKV, w, generator=gen).to(device=device, dtype=dtype) for w in (d, dv))
    inputs = _inputs(kern, device, gen)
    batched = {d.name: d.dims[0] == "B" for d in kern.spec.inputs}  # indexed by b: sliced to the sequence alone
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    longest = {"max_seqlen_q": max(LENGTHS[0]), "max_seqlen_k": max(LENGTHS[1])} if max_seqlen else {}
    out, lse = kern(*leaves, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True, **longest, **inputs)
    assert out.shape == (*q.shape[:2], dv) and lse.shape == (HQ, q.shape[0])
    grads = torch.autograd.grad(out, leaves, do)
    assert not any(torch.isnan(t).any() for t in (out, lse, *grads))

    # 1. each sequence alone through the same kernel, in the (1, H, N, D) layout (on sm_90, the same generators:
    # both calls run the Gluon forward where the spec has it, and these short keys the Triton backward)
    for i in range(len(LENGTHS[0])):
        qs, ks, vs, dos = (t[lo:hi].transpose(0, 1)[None].detach().clone().requires_grad_(t is not do)
                           for t, lo, hi in ((q, cq[i], cq[i + 1]), (k, ck[i], ck[i + 1]), (v, ck[i], ck[i + 1]), (do, cq[i], cq[i + 1])))
        alone, alone_lse = kern(qs, ks, vs, return_lse=True, **{n: t[i:i + 1] if batched[n] else t for n, t in inputs.items()})
        rows = slice(cq[i], cq[i + 1])
        assert torch.allclose(out[rows].transpose(0, 1)[None], alone, atol=0, rtol=0), (name, i)
        assert torch.equal(lse[:, rows][None], alone_lse), (name, i)
        if qs.shape[2] and ks.shape[2]:
            dq, dk, dv = torch.autograd.grad(alone, (qs, ks, vs), dos)
            assert torch.equal(grads[0][rows].transpose(0, 1)[None], dq) or (
                not exact_dq and torch.allclose(grads[0][rows].transpose(0, 1)[None].float(), dq.float(), rtol=0, atol=1e-2)), (name, i)
            assert torch.equal(grads[1][ck[i]:ck[i + 1]].transpose(0, 1)[None], dk), (name, i)
            assert torch.equal(grads[2][ck[i]:ck[i + 1]].transpose(0, 1)[None], dv), (name, i)

    # 2. the float64 reference, with the budget of the same-precision naive attention
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attngen.reference(kern, *wide, cu_seqlens_q=cq, cu_seqlens_k=ck, return_lse=True, dtype=torch.float64, **inputs)
    narrow = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    naive = attngen.reference(kern, *narrow, cu_seqlens_q=cq, cu_seqlens_k=ck, dtype=dtype, **inputs)
    err, _, bound = _bound(out.detach().cpu(), naive.detach().cpu(), ref.detach().cpu(), 2)
    assert err <= bound, (name, err, bound)
    finite = torch.isfinite(ref_lse)
    assert torch.equal(torch.isfinite(lse), finite.to(lse.device))
    assert (lse.double().cpu()[finite.cpu()] - ref_lse.detach().cpu()[finite.cpu()]).abs().max() <= 1e-3 * max(1.0, ref_lse[finite].abs().max())
    ref_grads = torch.autograd.grad(ref, wide, do.double())
    naive_grads = torch.autograd.grad(naive, narrow, do)
    for what, g, rg, ng in zip(("dq", "dk", "dv"), grads, ref_grads, naive_grads):
        err, _, bound = _bound(g.cpu(), ng.cpu(), rg.cpu(), 3, 1.0)
        assert err <= bound, (name, what, err, bound)


def _call(kern, device, **changes):
    q = torch.randn(10, HQ, 128).to(device=device, dtype=torch.bfloat16)
    k = torch.randn(12, HKV, 128).to(device=device, dtype=torch.bfloat16)
    args = {"q": q, "k": k, "v": k.clone(), "cu_seqlens_q": _offsets([4, 6], device), "cu_seqlens_k": _offsets([5, 7], device)}
    args.update(changes)
    return kern(args.pop("q"), args.pop("k"), args.pop("v"), **args)


@pytest.mark.parametrize("changes, message", [
    ({"cu_seqlens_q": torch.tensor([0, 6, 4], dtype=torch.int32)}, "cu_seqlens_q must start at 0 and never decrease"),
    ({"cu_seqlens_q": torch.tensor([1, 4, 10], dtype=torch.int32)}, "cu_seqlens_q must start at 0"),
    ({"cu_seqlens_k": torch.tensor([0, 5, 11], dtype=torch.int32)}, "cu_seqlens_k ends at 11, but the packed tensor has 12 rows"),
    ({"cu_seqlens_q": torch.tensor([0, 4, 10])}, "cu_seqlens_q must be a 1-D int32 tensor of B \\+ 1 offsets, got torch.int64"),
    ({"cu_seqlens_k": torch.tensor([0, 12], dtype=torch.int32)}, "cu_seqlens_q has 3 entries and cu_seqlens_k 2"),
    ({"cu_seqlens_k": None}, "packed sequences need both cu_seqlens_q and cu_seqlens_k"),
    ({"q": torch.zeros(1, 10, HQ, 128, dtype=torch.bfloat16)}, "with cu_seqlens, q must be 3-D"),
    ({"max_seqlen_q": 5}, "max_seqlen_q = 5, but a sequence of cu_seqlens_q has 6 rows"),
    ({"max_seqlen_k": -1}, "max_seqlen_k must be a non-negative int"),
])
def test_bad_packed_calls_say_what_is_wrong(changes, message, target, device):
    kern = attngen.compile(ROOT / "specs" / "causal.attn", target)
    changes = {k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in changes.items()}
    with pytest.raises(InputError, match=message):
        _call(kern, device, **changes)


@pytest.mark.parametrize("backend", ["auto", "gluon"])
def test_dropout_with_packed_sequences_is_a_function_of_the_sequence(backend, target, device):
    """Dropout's pattern in a packed call is the kernels' function of (seed, b = the sequence, h, q_idx, kv_idx),
    positions inside the sequence: O and the gradients match the float64 reference applying attngen.dropout_mask
    at b = each sequence's index. backend = gluon: both passes by the Gluon generator's kernels (on sm_90)."""
    if backend == "gluon" and device != "cuda":
        pytest.skip("Gluon kernels run on an sm_90 GPU only (Triton's interpreter does not run Gluon)")
    kern = attngen.compile(ROOT / "specs" / "causal_dropout.attn", target, backend=backend)
    assert backend == "auto" or kern.generator.generator == kern.generator.backward == "gluon"
    dtype = TORCH_DTYPES[kern.spec.dtype.value]
    lengths = ([3, 0, 70, 129], [5, 2, 70, 130])
    cq, ck = _offsets(lengths[0], device), _offsets(lengths[1], device)
    gen = torch.Generator().manual_seed(1)
    d = kern.spec.head_dim
    q, do = (torch.randn(sum(lengths[0]), HQ, d, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    k, v = (torch.randn(sum(lengths[1]), HKV, d, generator=gen).to(device=device, dtype=dtype) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    out = kern(*leaves, cu_seqlens_q=cq, cu_seqlens_k=ck, dropout_p=0.3, seed=11)
    grads = torch.autograd.grad(out, leaves, do)
    assert not any(torch.isnan(t).any() for t in (out, *grads))
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attngen.reference(kern, *wide, cu_seqlens_q=cq, cu_seqlens_k=ck, dropout_p=0.3, seed=11, dtype=torch.float64)
    narrow = [t.detach().clone().requires_grad_() for t in (q, k, v)]
    naive = attngen.reference(kern, *narrow, cu_seqlens_q=cq, cu_seqlens_k=ck, dropout_p=0.3, seed=11, dtype=dtype)
    err, _, bound = _bound(out.detach().cpu(), naive.detach().cpu(), ref.detach().cpu(), 2)
    assert err <= bound, (err, bound)
    ref_grads = torch.autograd.grad(ref, wide, do.double())
    naive_grads = torch.autograd.grad(naive, narrow, do)
    for what, g, rg, ng in zip(("dq", "dk", "dv"), grads, ref_grads, naive_grads):
        err, _, bound = _bound(g.cpu(), ng.cpu(), rg.cpu(), 3, 1.0)
        assert err <= bound, (what, err, bound)
    # another sequence index gives another pattern: the reference with every sequence moved one place on differs
    shifted = attngen.reference(kern, *wide, cu_seqlens_q=_offsets([0] + lengths[0], device), cu_seqlens_k=_offsets([0] + lengths[1], device),
                                dropout_p=0.3, seed=11, dtype=torch.float64)
    assert (shifted - ref).abs().max() > 0.1


def test_max_seqlen_without_cu_seqlens_is_refused(target, device):
    kern = attngen.compile(ROOT / "specs" / "causal.attn", target)
    q = torch.randn(1, HQ, 8, 128).to(device=device, dtype=torch.bfloat16)
    with pytest.raises(InputError, match="max_seqlen_q/max_seqlen_k go with cu_seqlens"):
        kern(q, q, q, max_seqlen_q=8)


def test_offsets_checked_once_are_checked_again_after_an_in_place_change(target, device):
    """The offsets' check (a host synchronization) is remembered for the tensor's version: a later call with the same
    tensor skips it, an in-place change makes it run again."""
    kern = attngen.compile(ROOT / "specs" / "causal.attn", target)
    cq = _offsets([4, 6], device)
    _call(kern, device, cu_seqlens_q=cq)
    cq[1] = 11  # no longer ends at 10 after an increasing step
    with pytest.raises(InputError, match="cu_seqlens_q must start at 0 and never decrease"):
        _call(kern, device, cu_seqlens_q=cq)


def test_a_packed_call_like_one_made_before_is_kept(target, device):
    """Packed calls that give max_seqlen_q/_k are kept by their signature (Kernel._packed_calls): checks and choices
    once, then the passes on views made inside one autograd node. Later calls of the signature on other values are
    exact against each sequence alone and the reference; their offsets are still checked (once per tensor and
    version), and another max_seqlen is another signature. (A kept call with a declared input, the sinks, and
    their gradient: test_sink.py's test_packed_sequences_give_the_sinks_gradient.)"""
    kern = attngen.compile(ROOT / "specs" / "causal.attn", target)
    for seed in (0, 1):
        _check_packed(kern, device, seed=seed, max_seqlen=True)
    assert len(kern._packed_calls) == 1
    kern = attngen.compile(ROOT / "specs" / "causal.attn", target)
    cq = _offsets([4, 6], device)
    _call(kern, device, cu_seqlens_q=cq, max_seqlen_q=6, max_seqlen_k=7)
    _call(kern, device, cu_seqlens_q=cq, max_seqlen_q=6, max_seqlen_k=7)
    cq[1] = 11  # no longer ends at 10 after an increasing step
    with pytest.raises(InputError, match="cu_seqlens_q must start at 0 and never decrease"):
        _call(kern, device, cu_seqlens_q=cq, max_seqlen_q=6, max_seqlen_k=7)
    with pytest.raises(InputError, match="max_seqlen_q = 5, but a sequence of cu_seqlens_q has 6 rows"):
        _call(kern, device, max_seqlen_q=5, max_seqlen_k=7)
    assert len(kern._packed_calls) == 1


@pytest.mark.parametrize("backend", ["auto", "gluon"])
def test_a_packed_call_is_captured_in_a_cuda_graph(backend, device):
    """A packed training step (forward and backward) captured once and replayed over new values in the same
    tensors, offsets included (other lengths, the same total and max_seqlen): the grid comes from max_seqlen and the
    batch size, so no value reaches the host; each replay equals the eager call on those values."""
    if device != "cuda":
        pytest.skip("CUDA graphs need a GPU")
    kern = attngen.compile(ROOT / "specs" / "causal.attn", backend=backend)
    d, total, longest = kern.spec.head_dim, 1200, 700
    cq = _offsets([300, 700, 200], device)
    q, k, v, do = (torch.randn(total, HQ if i in (0, 3) else HKV, d, device="cuda", dtype=torch.bfloat16) for i in range(4))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]

    def step():
        out = kern(*leaves, cu_seqlens_q=cq, cu_seqlens_k=cq, max_seqlen_q=longest, max_seqlen_k=longest)
        return (out, *torch.autograd.grad(out, leaves, do))

    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        step()  # warm-up: compiles and checks the offsets once
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = step()
    for lengths in ([700, 100, 400], [1, 699, 500]):
        cq.copy_(_offsets(lengths, device))
        for t in (*leaves, do):
            with torch.no_grad():
                t.normal_()
        graph.replay()
        torch.cuda.synchronize()
        want = step()
        assert not any(torch.isnan(t).any() for t in captured)
        for got, expected in zip(captured, want):
            assert torch.equal(got, expected)
