"""Runtime block sparsity (sparsity = runtime): call-time checks, the block-mask helpers, and the kernels'
agreement with the dense kernels and the reference on the patterns that matter (all kept, none kept, one row
empty). Random patterns against the float64 reference: test_numerics.py (runtime_blocks_* variants)."""
import pytest
import torch

import attngen
from attngen.runtime import blocks
from attngen.errors import InputError, PlanError

SPARSE = "attention t {{ head_dim = 32 dtype = fp32 sparsity = runtime sparse_block = 32 {extra} }}"


def _qkv(device, nq=70, nk=90, hq=4, hkv=2, seed=0):
    gen = torch.Generator().manual_seed(seed)
    shapes = ((2, hq, nq, 32), (2, hkv, nk, 32), (2, hkv, nk, 32))
    return tuple(torch.randn(*s, generator=gen).to(device).requires_grad_() for s in shapes)


def _run(kern, q, k, v, **kwargs):
    out, lse = kern(q, k, v, return_lse=True, **kwargs)
    grads = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
    return (out, lse, *grads)


@pytest.mark.parametrize("extra", ["", pytest.param("mask = q_idx >= kv_idx block_m = 16 block_n = 16", marks=pytest.mark.slow),  # 16x16 tiles: ~10 s
                                   "loop_order = kv_outer"])
def test_all_blocks_kept_equals_dense(extra, device, target):
    """With every block kept, the sparse kernels visit the dense kernels' tiles in the same order: same bits."""
    text = SPARSE.format(extra=extra).replace("sparse_block = 32", "sparse_block = 128")
    sparse = attngen.compile(text, target)
    dense = attngen.compile(text.replace("sparsity = runtime sparse_block = 128", ""), target)
    assert sparse.plan.tile_sizes == dense.plan.tile_sizes
    q, k, v = _qkv(device, nq=200, nk=300, hq=2, hkv=1)
    everything = torch.ones(1, 1, 2, 3, dtype=torch.bool, device=device)
    for a, b in zip(_run(sparse, q, k, v, block_mask=everything), _run(dense, q, k, v)):
        assert torch.equal(a, b)


@pytest.mark.parametrize("loop_order", ["q_outer", "kv_outer"])
def test_no_block_kept_gives_zeros(loop_order, device, target):
    kern = attngen.compile(SPARSE.format(extra=f"loop_order = {loop_order}"), target)
    q, k, v = _qkv(device)
    out, lse, dq, dk, dv = _run(kern, q, k, v, block_mask=torch.zeros(2, 4, 3, 3, dtype=torch.bool, device=device))
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    for g in (dq, dk, dv):
        assert torch.equal(g, torch.zeros_like(g))


def test_pattern_matches_the_reference_with_broadcast_batch_and_heads(device, target):
    """A (1, 1, rows, cols) mask applies to every batch and head: local + global blocks."""
    kern = attngen.compile(SPARSE.format(extra="block_m = 16"), target)
    q, k, v = _qkv(device, nq=130, nk=130)
    bm = attngen.block_mask_from(lambda b, h, i, j: ((i - j).abs() <= 1) | (j == 0), 130, 130, sparse_block=32, device=device)
    assert bm.shape == (1, 1, 5, 5) and bm.sum().item() == 5 + 4 + 4 + 3
    out = kern(q, k, v, block_mask=bm)
    ref = attngen.reference(kern, *(t.detach().double() for t in (q, k, v)), block_mask=bm)
    assert not torch.isnan(out).any()
    assert (out.double() - ref).abs().max().item() < 1e-5


def test_block_mask_is_checked(device, target):
    kern = attngen.compile(SPARSE.format(extra=""), target)
    q, k, v = _qkv(device)  # 70 queries, 90 keys: 3 x 3 blocks of 32
    ok = torch.ones(2, 1, 3, 3, dtype=torch.bool, device=device)
    kern(q, k, v, block_mask=ok)
    with pytest.raises(InputError, match=r"pass block_mask= .*attngen.block_mask_from"):
        kern(q, k, v)
    with pytest.raises(InputError, match=r"block_mask has shape \(2, 1, 3, 2\); expected \(batch 2 or 1, heads 4 or 1, "
                                         r"ceil\(q_len / 32\) = 3, ceil\(kv_len / 32\) = 3\)"):
        kern(q, k, v, block_mask=ok[..., :2])
    with pytest.raises(InputError, match="block_mask must be bool, got torch.int64"):
        kern(q, k, v, block_mask=ok.long())
    with pytest.raises(InputError, match="does not say `sparsity = runtime`"):
        attngen.compile("attention t { head_dim = 32 dtype = fp32 }", target)(q, k, v, block_mask=ok)


def test_tiles_must_fit_in_sparse_blocks():
    with pytest.raises(PlanError, match="block_m = 64 is larger than sparse_block = 32"):
        attngen.compile(SPARSE.format(extra="block_m = 64"), "h100")
    plan = attngen.compile("attention t { head_dim = 64 sparsity = runtime sparse_block = 16 }", "h100").plan
    assert max(plan.tile_sizes) == 16


def test_block_mask_from_dense_keeps_exactly_the_blocks_with_a_kept_pair():
    mask = torch.zeros(1, 2, 40, 50, dtype=torch.bool)
    mask[0, 0, 3, 47] = True  # block (0, 2) of head 0
    mask[0, 1, 39, 0] = True  # block (2, 0) of head 1 (a partial last block)
    bm = attngen.block_mask_from_dense(mask, sparse_block=16)
    assert bm.shape == (1, 2, 3, 4)
    assert bm.nonzero().tolist() == [[0, 0, 0, 2], [0, 1, 2, 0]]
    assert torch.equal(blocks.expand(bm, 16, 40, 50) | mask, blocks.expand(bm, 16, 40, 50))  # covers the mask


def test_block_lists_are_kept_indices_in_order():
    bm = torch.tensor([[[[True, False, True], [False, False, False]]]])
    rows, cols = blocks.block_lists(bm, 16, 2, 3, 20, 40, torch.device("cpu"))
    assert rows.shape == (2, 3, 2, 4) and rows.stride()[:2] == (0, 0)
    assert rows[0, 0].tolist() == [[2, 0, 2, 1], [0, 0, 1, 2]]  # count, then kept blocks (the rest is padding)
    assert cols[1, 2].tolist() == [[1, 0, 1], [0, 0, 1], [1, 0, 1]]


def test_block_lists_of_the_last_mask_are_reused_until_it_changes(device, target, monkeypatch):
    """The same mask tensor, unmodified, is converted once; an in-place change, another tensor or other shapes
    convert again, and every call's output follows its mask (against the reference)."""
    kern = attngen.compile(SPARSE.format(extra="block_m = 16"), target)
    q, k, v = _qkv(device, nq=70, nk=90)
    conversions = []
    real = blocks._lists
    monkeypatch.setattr(blocks, "_lists", lambda m: conversions.append(m.shape) or real(m))

    def check(bm, batch=2):
        qkv = [t[:batch].detach().requires_grad_() for t in (q, k, v)]
        out = kern(*qkv, block_mask=bm)
        ref = attngen.reference(kern, *(t.detach().double() for t in qkv), block_mask=bm)
        assert not torch.isnan(out).any() and (out.double() - ref).abs().max().item() < 1e-5

    bm = attngen.block_mask_from(lambda b, h, i, j: i >= j, 70, 90, sparse_block=32, device=device)
    check(bm)
    check(bm)
    assert len(conversions) == 2  # rows and columns, once
    bm[0, 0, 2, 0] = False  # in place: the version counter moves
    check(bm)
    assert len(conversions) == 4
    check(bm.clone())  # equal content, another tensor
    assert len(conversions) == 6
    other = bm.clone()
    check(other)
    check(other, batch=1)  # the same (1, 1, rows, cols) mask for another batch size: lists of other shapes
    assert len(conversions) == 10


def test_a_static_pattern_runs_as_a_runtime_mask_of_its_blocks(device, target):
    """A static block pattern (KernelPlan.block_lists) walks the lists of its kept blocks, made from the pattern once
    per call sizes and device: the same tiles, in the same order, as runtime block sparsity given the pattern's
    block mask (computed here from the bits of i ^ j), so the same bits forward and backward."""
    pattern = "((q_blk ^ kv_blk) & ((q_blk ^ kv_blk) - 1)) == 0 or (h == 1 and kv_blk == 0)"
    text = SPARSE.format(extra="mask = q_idx >= kv_idx")
    static = attngen.compile(text.replace("sparsity = runtime", f"sparsity = {pattern}"), target)
    runtime = attngen.compile(text, target)
    assert static.plan.block_lists and static.plan.tile_sizes == runtime.plan.tile_sizes
    q, k, v = _qkv(device, nq=150, nk=150)  # 5 blocks of 32 each way
    mask = torch.tensor([[[bin(i ^ j).count("1") <= 1 or (h == 1 and j == 0) for j in range(5)] for i in range(5)] for h in range(4)])
    assert not mask.all() and (mask[1] != mask[0]).any()  # holes, and a head of its own
    got = _run(static, q, k, v)
    want = _run(runtime, q, k, v, block_mask=mask[None].to(device))
    assert not any(torch.isnan(t).any() for t in got)
    for a, b in zip(got, want):
        assert torch.equal(a, b)
    _run(static, q, k, v)
    assert len(static.lists._patterns) == 1  # the same sizes: the lists made once
