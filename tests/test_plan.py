"""Planning: the paper's rule, then the recorded rounding/clamping; pure; errors for what cannot be built."""
import dataclasses
import math
import types

import pytest
import torch

from attngen.lang.check import load_spec
from attngen.errors import PlanError
from attngen.plan.planner import MAX_TILE, MIN_TILE, plan
from attngen.targets import TARGETS, detect, get_target


def _spec(extra="", d=128, dtype="bf16"):
    return load_spec(f"attention t {{ head_dim = {d} dtype = {dtype} {extra} }}")


def test_paper_rule_on_h100_bf16_d128():
    p = plan(_spec(), "h100")
    steps = {s.what: s for s in p.steps}
    # 227 KiB per block, 2 bytes per bf16: M = 116224; B_c = ceil(116224 / 512) = 227; B_r = min(227, 128) = 128
    assert steps["on-chip memory per block"].value == "M = 116224 elements"
    assert steps["paper: key tile"].value == "227"
    assert steps["paper: query tile"].value == "128"
    assert (p.block_m, p.block_n) == (128, 128)  # 227 rounds down to 128, which is also the cap
    assert p.head_dim_pad == 128 and p.scale == pytest.approx(128 ** -0.5)


def test_paper_rule_on_t4_fp16_d64():
    p = plan(_spec(d=64, dtype="fp16"), "t4")
    # 64 KiB / 2 = 32768 elements; B_c = ceil(32768 / 256) = 128; B_r = min(128, 64) = 64
    steps = {s.what: s.value for s in p.steps}
    assert steps["paper: key tile"] == "128" and steps["paper: query tile"] == "64"
    assert (p.block_m, p.block_n) == (64, 128)


@pytest.mark.parametrize("target", sorted(TARGETS))
@pytest.mark.parametrize("dtype", ["fp16", "bf16", "fp32"])
@pytest.mark.parametrize("d", [16, 17, 64, 80, 128, 200, 256])
def test_every_plan_is_buildable(target, dtype, d):
    spec = _spec(d=d, dtype=dtype)
    tgt = TARGETS[target]
    if tgt.unsupported:  # listed, but Triton cannot build for it (test_unsupported_targets_are_refused)
        with pytest.raises(PlanError, match="builds for 7.5"):
            plan(spec, target)
        return
    if dtype == "bf16" and not tgt.supports_bf16:
        with pytest.raises(PlanError, match="bf16 needs compute capability 8.0"):
            plan(spec, target)
        return
    p = plan(spec, target)
    for tile in (p.block_m, p.block_n, p.bwd_block_m, p.bwd_block_n, p.dq_block_m, p.dq_block_n, p.head_dim_pad):
        assert tile & (tile - 1) == 0 and tile >= MIN_TILE
    assert max(p.block_m, p.block_n) <= MAX_TILE
    assert p.head_dim_pad >= d and p.head_dim_pad < 2 * max(d, 16)
    isz = spec.dtype.itemsize
    # the pipelined forward fits in the block's shared memory (fp32 also passes P through it)
    p_tile = p.block_m * p.block_n * 4 if dtype == "fp32" else 0
    # a Q or K tile's columns: head_dim_pad, or with q.k in two products their two parts (80 = 64 + 16 where one product
    # takes 128; 17 stays one product: 16 + 1 padded to 16 would take 32 columns too)
    qk = p.head_lead + p.head_tail_pad if p.head_tail else p.head_dim_pad
    assert qk >= d and qk <= p.head_dim_pad and (p.head_tail == 0) == (d in (16, 17, 64, 128, 200, 256))
    assert p.block_m * qk * isz + p_tile + p.num_stages * p.block_n * (qk + p.value_dim_pad) * isz <= tgt.smem_per_block
    assert 1 <= p.num_stages <= 3 and p.num_warps in (4, 8)


def test_plan_is_pure():
    spec = _spec("mask = q_idx >= kv_idx")
    assert plan(spec, "a100") == plan(spec, "a100")
    assert plan(spec, "a100") != plan(spec, "h100")


def test_overrides_are_recorded():
    p = plan(_spec("block_m = 32 block_n = 64"), "h100")
    assert (p.block_m, p.block_n) == (32, 64)
    assert any(s.what == "BLOCK_M override" for s in p.steps)


def test_target_override_beats_spec_target():
    spec = _spec("target = a100")
    assert plan(spec).target.name == "a100"
    assert plan(spec, "h100").target.name == "h100"


def test_describe_shows_the_derivation():
    text = plan(_spec(), "h100").describe()
    for piece in ["232448 bytes", "B_c = ceil(M / 4d) = ceil(116224 / 512)", "B_r = min(B_c, d) = min(227, 128)", "BLOCK_M=128 BLOCK_N=128"]:
        assert piece in text


def test_runtime_sparsity_keeps_tiles_inside_sparse_blocks():
    p = plan(_spec("sparsity = runtime sparse_block = 32"), "h100")
    assert max(p.tile_sizes) == 32 and p.may_mask_rows  # a block mask may leave a row without keys
    assert any(s.what == "block sparsity" for s in p.steps)
    with pytest.raises(PlanError, match="block_n = 64 is larger than sparse_block = 32"):
        plan(_spec("sparsity = runtime sparse_block = 32 block_n = 64"), "h100")


def test_unsupported_targets_are_refused(monkeypatch):
    """Triton 3.6 builds for compute capability 7.5 and newer: an older GPU is refused by name, from the spec's
    target and as the live device, with the reason, before the bf16 check (which would suggest fp16)."""
    assert [name for name, t in TARGETS.items() if t.unsupported] == ["v100"]
    why = r"NVIDIA V100 SXM2 \(v100\) is compute capability 7.0 \(sm_70\): Triton 3.6, which attngen's kernels are written for, builds for 7.5"
    for spec, target in ((_spec(dtype="fp16"), "v100"), (_spec(dtype="fp16"), "V100"), (_spec("target = v100", dtype="fp16"), None),
                         (_spec(), "v100")):
        with pytest.raises(PlanError, match=why):
            plan(spec, target)
    with pytest.raises(PlanError, match=why):
        get_target("v100")
    assert get_target("t4").compute_capability == (7, 5)

    v100 = types.SimpleNamespace(name="Tesla V100-SXM2-16GB", major=7, minor=0, multi_processor_count=80,
                                 shared_memory_per_block_optin=96 * 1024, shared_memory_per_multiprocessor=96 * 1024)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda index: v100)
    with pytest.raises(PlanError, match=r"Tesla V100-SXM2-16GB \(v100\) is compute capability 7.0 \(sm_70\): Triton 3.6"):
        plan(_spec(dtype="fp16"), "auto")
    monkeypatch.setattr(v100, "minor", 5)  # a GPU of 7.5 not in the table is planned for, under its own name
    assert detect().name == "cuda-tesla-v100-sxm2-16gb"


def test_unknown_target():
    with pytest.raises(PlanError, match="unknown target 'x100'"):
        plan(_spec(), "x100")


def test_static_sparsity_joins_the_mask():
    spec = _spec("mask = q_idx >= kv_idx sparsity = abs(q_blk - kv_blk) <= 1 sparse_block = 64")
    p = plan(spec, "h100")
    from attngen.lang.expr import format_expr

    assert format_expr(p.mask) == "q_idx >= kv_idx and abs(q_idx // 64 - kv_idx // 64) <= 1"


def test_a_static_block_pattern_is_walked_as_lists_where_every_tile_lies_in_one_block():
    """KernelPlan.block_lists: the Triton kernels walk a pattern's kept blocks (made once per shape from the
    pattern) where the pattern reads no length (every tile lies inside one block: the planner keeps tiles within
    sparse_block, even a spec's own); otherwise
    they classify tiles against it (the mask above, with the pattern folded in)."""
    pattern = "sparsity = ((q_blk ^ kv_blk) & ((q_blk ^ kv_blk) - 1)) == 0 or h == 1 sparse_block = 64"
    assert plan(_spec(pattern, d=64), "h100").block_lists
    assert plan(_spec("mask = q_idx >= kv_idx " + pattern, d=64), "h100").block_lists
    p = plan(_spec(pattern, d=64), "h100")
    assert not dataclasses.replace(p, global_positions=True).block_lists  # a shard's kernels: positions of the whole sequence
    assert not plan(_spec(pattern, d=64), "h100", classify=False).block_lists
    wide = plan(_spec(pattern + " block_m = 128", d=64), "h100")
    assert max(wide.tile_sizes) <= 64 and wide.block_lists
    for extra in ("sparsity = kv_blk < kv_len // 64 sparse_block = 64",  # a length: packed sequences would differ
                  "sparsity = runtime sparse_block = 64", "mask = q_idx >= kv_idx"):
        assert not plan(_spec(extra, d=64), "h100").block_lists, extra


def test_derivative_planned_for_score_mods():
    p = plan(_spec("score = 30.0 * tanh(score / 30.0)"), "h100")
    assert p.dscore is not None
    assert dataclasses.replace(p).dscore == p.dscore
    assert math.isclose(p.scale, 128 ** -0.5)


DOCS = "input doc: int32[B, N] mask = doc[b, q_idx] == doc[b, kv_idx] and q_idx >= kv_idx"


def test_document_masks_get_small_forward_tiles_on_sm90():
    """Masks comparing inputs read at q_idx and at kv_idx (packed documents) take the measured 64x64 forward tiles
    with 4 warps at d=128 on sm_90; one-sided reads (key padding), other targets and explicit tiles keep theirs."""
    p = plan(_spec(DOCS), "h100")
    assert (p.block_m, p.block_n, p.num_warps) == (64, 64, 4)
    assert "forward tiles, measured" in {s.what for s in p.steps}
    padding = plan(_spec("input lens: int32[B] mask = kv_idx < lens[b]"), "h100")
    assert (padding.block_m, padding.block_n, padding.num_warps) == (128, 128, 8)
    for target, d in (("a100", 128), ("h100", 64)):
        assert plan(_spec(DOCS, d=d), target).tiles()["fwd"] == plan(_spec(d=d), target).tiles()["fwd"]
    assert (plan(_spec(DOCS + " block_m = 128"), "h100").block_m, plan(_spec(DOCS + " block_n = 128"), "h100").block_n) == (128, 128)
