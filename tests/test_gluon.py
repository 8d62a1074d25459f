"""The Gluon generator (sm_90): which specs it takes and why not, its plan (forward and backward), which
generator renders each pass, its name translation, that every spec it takes renders to readable source and
compiles to sm_90 binaries on this CPU machine, and, on a GPU (--device cuda), that its forward and backward
match the float64 reference through attngen.verify with `attngen check`'s error budget. Gluon does not run in
Triton's interpreter: on the CPU a kernel with a Gluon forward runs the Triton generator's kernels, which the
rest of the suite checks."""
import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import attngen
from attngen.tools import verify
from attngen.aot.record import takes_packed
from attngen.runtime.dtypes import TORCH_DTYPES
from attngen.lang.check import load_spec
from attngen.tools.cli import main
from attngen.codegen.gluon import choose, plan_gluon, render, unsupported
from attngen.codegen.gluon.lower import Untranslatable, translate
from attngen.errors import PlanError
from attngen.runtime.layout import empty_laid_out, heads_in_rows
from attngen.plan.planner import plan
from attngen.lang.spec import Backend, DType

ROOT = Path(__file__).parent.parent
SPECS = {p.stem: p for p in sorted((ROOT / "specs").glob("*.attn"))}
# What the generator takes of the shipped specs, and why not the others (each reason, as plan.py words it)
NOT_TAKEN = {
    "causal_fa1": "loop_order = kv_outer",
    "dilated": "head_dim 32", "odd_head_dim": "dtype fp32",
    "paged_decode": "kv_layout = paged", "mla_decode": "kv_layout = paged",
}
TAKEN = sorted(set(SPECS) - set(NOT_TAKEN))


def _spec(name, **changes):
    return dataclasses.replace(load_spec(SPECS[name].read_text()), **changes)


def test_what_the_generator_takes_and_why_not():
    assert TAKEN == ["alibi", "block_sparse_runtime", "butterfly_blocks", "causal", "causal_bottom_right", "causal_dropout", "causal_softcap", "dense", "document",
                     "key_padding", "local_global_blocks", "local_window", "prefix_lm", "relative_bias", "sink_window", "sliding_window", "strided_blocks"]
    for name in SPECS:
        spec = _spec(name)
        if name in NOT_TAKEN:
            with pytest.raises(PlanError, match=re.escape(NOT_TAKEN[name])):
                choose(spec, plan(spec, "h100"), Backend.GLUON)
        else:
            assert unsupported(spec, plan(spec, "h100")) == [], name
            assert choose(spec, plan(spec, "h100"), Backend.GLUON).generator == "gluon"


def test_runtime_block_sparsity_needs_blocks_of_whole_tiles():
    """The Gluon kernels walk the lists of kept blocks a whole tile at a time (128 keys, 128 query rows forward):
    sparse_block = 128 and above render (the shipped spec), smaller blocks fall back to the Triton generator,
    saying why."""
    for block in (128, 256):
        assert unsupported(_spec("block_sparse_runtime", sparse_block=block), plan(_spec("block_sparse_runtime", sparse_block=block), "h100")) == []
    small = _spec("block_sparse_runtime", sparse_block=64, head_dim=128)
    assert unsupported(small, plan(small, "h100")) == ["runtime block sparsity with sparse_block = 64: its tiles (128 keys, 128 query rows "
                                                       "forward) must each lie inside one block, so sparse_block >= 128"]
    choice = choose(small, plan(small, "h100"))
    assert choice.generator == "triton" and "sparse_block = 64" in choice.reason
    assert choose(_spec("block_sparse_runtime", head_dim=128), plan(_spec("block_sparse_runtime", head_dim=128), "h100")).generator == "gluon"


def test_auto_takes_gluon_where_it_was_measured_faster():
    """auto: Gluon on sm_90 at d=128 and 256 without a score modification, and at d=64 for calls of 1024 keys or
    more (the Triton generator's kernels for shorter ones, both passes), 2048 with a mask other than causal's;
    documents: the Triton generator at d=64; at 128 the Gluon forward, and its backward from 2048 keys; Triton elsewhere,
    with the reason."""
    for name in ("causal", "dense"):
        c = choose(_spec(name), plan(_spec(name), "h100"))
        assert (c.generator, c.min_keys, c.forward_at(1), c.backward_at(1)) == ("gluon", 0, "gluon", "gluon")
    short = choose(_spec("causal", head_dim=64), plan(_spec("causal", head_dim=64), "h100"))
    assert (short.generator, short.backward, short.min_keys) == ("gluon", "gluon", 1024) and short.gluon is not None
    assert [(short.forward_at(n), short.backward_at(n)) for n in (1, 1023, 1024, 65536)] == [("triton", "triton")] * 2 + [("gluon", "gluon")] * 2
    assert "calls with fewer than 1024 keys take the Triton generator for both passes (the Gluon kernels measured 0.80-1.05x" in short.describe()
    asked = choose(_spec("causal", head_dim=64), plan(_spec("causal", head_dim=64), "h100"), Backend.GLUON)
    assert asked.min_keys == 0 and asked.forward_at(1) == "gluon" and "fewer than" not in asked.describe()  # asked for: every length
    docs = choose(_spec("document"), plan(_spec("document"), "h100"))  # head_dim 64: the Triton generator at every length
    assert (docs.generator, docs.forward_at(4096), docs.backward_at(4096)) == ("triton", "triton", "triton") and "0.87-0.92x" in docs.reason
    docs = choose(_spec("document", head_dim=128), plan(_spec("document", head_dim=128), "h100"))
    assert [(docs.forward_at(n), docs.backward_at(n)) for n in (1, 2047, 2048)] == [("gluon", "triton")] * 2 + [("gluon", "gluon")]
    assert "fewer than 2048 keys take the Triton generator's backward" in docs.describe() and "0.92x the Triton one at 1024" in docs.describe()
    free = _spec("document", head_dim=128, deterministic=False)  # the unordered backward: 1.03x the Triton one at 1024 keys
    assert choose(free, plan(free, "h100")).min_keys == 0
    for name, want in (("dense", 1024), ("causal", 1024), ("alibi", 1024), ("sliding_window", 2048), ("prefix_lm", 2048)):
        c = choose(_spec(name, head_dim=64), plan(_spec(name, head_dim=64), "h100"))
        assert (c.generator, c.min_keys, c.forward_at(want - 1), c.forward_at(want)) == ("gluon", want, "triton", "gluon"), name
    assert "0.91x the Triton generator's forward" in c.describe()
    # block patterns: the Triton generator at head_dim 64, and at 128 where tiles are classified by pieces (butterfly)
    for name, d, want in (("local_global_blocks", 64, "triton"), ("strided_blocks", 64, "triton"), ("butterfly_blocks", 64, "triton"),
                          ("local_global_blocks", 128, "gluon"), ("strided_blocks", 128, "gluon"), ("butterfly_blocks", 128, "triton")):
        c = choose(_spec(name, head_dim=d), plan(_spec(name, head_dim=d), "h100"))
        assert (c.generator, c.forward_at(65536), c.backward_at(65536)) == (want, want, want), (name, d)
        assert want == "gluon" or "0.19-0.75x the Triton forward" in c.reason
        assert choose(_spec(name, head_dim=d), plan(_spec(name, head_dim=d), "h100"), Backend.GLUON).generator == "gluon"
    c = choose(_spec("causal_softcap"), plan(_spec("causal_softcap"), "h100"))
    assert c.generator == "triton" and "a score modification with a function per score" in c.reason and c.gluon is None
    # a separable bias (ALiBi): Gluon at every head dim; a read at positions: Triton; another bias of positions and
    # per-program values: Gluon at head_dim 128 only
    for name, d, want in (("alibi", 128, "gluon"), ("alibi", 64, "gluon"), ("relative_bias", 128, "triton")):
        c = choose(_spec(name, head_dim=d), plan(_spec(name, head_dim=d), "h100"))
        assert (c.generator, c.backward_at(4096)) == (want, want), (name, d, c.describe())
    square = "attention sq {{ head_dim = {d}\n mask = q_idx >= kv_idx\n score = score - 0.01 * (q_idx - kv_idx) * (q_idx - kv_idx) }}"
    for d, want in ((128, "gluon"), (64, "triton")):
        c = choose(load_spec(square.format(d=d)), plan(load_spec(square.format(d=d)), "h100"))
        assert c.generator == want, (d, c.describe())
    assert "at head_dim 64 that is no separable bias" in c.reason
    assert choose(_spec("causal_softcap"), plan(_spec("causal_softcap"), "h100"), Backend.GLUON).generator == "gluon"  # asked for: taken
    a100 = choose(_spec("causal"), plan(_spec("causal"), "a100"))
    assert a100.generator == "triton" and "the target is sm_80" in a100.reason
    assert choose(_spec("causal"), plan(_spec("causal"), "h100"), Backend.TRITON).generator == "triton"


def test_a_call_takes_the_generators_its_length_gives(monkeypatch, device):
    """With a length rule (auto at head_dim 64), a call's keys pick the generator of each pass at run time: fewer
    than 1024, the Triton generator's kernels both ways; from 1024, the Gluon module's. Stand-ins for the Gluon
    module's launchers record their calls (on the CPU machine the device is taken for an sm_90); the short call runs
    the Triton kernels, checked against the float64 reference."""
    from attngen.runtime import kernel as kernel_module
    from attngen.runtime.loader import is_sm90

    kern = attngen.compile(_spec("causal", head_dim=64, dtype=DType.FP16), "h100")  # fp16: the interpreter's arithmetic
    assert kern.generator.min_keys == 1024 and kern.gluon is not None
    if device == "cpu":
        monkeypatch.setattr(kernel_module, "is_sm90", lambda dev: True)
    elif not is_sm90(torch.device(device)):
        pytest.skip("the Gluon generator's calls need an sm_90 GPU")
    seen = []

    def forward(q, k, v, *rest, **kw):
        seen.append(("gluon forward", k.shape[2]))
        return torch.zeros_like(q), torch.zeros(q.shape[:3], device=q.device)

    def backward(q, k, v, *rest, **kw):
        seen.append(("gluon backward", k.shape[2]))
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)

    monkeypatch.setattr(kern.gluon, "attention_forward", forward)
    monkeypatch.setattr(kern.gluon, "attention_backward", backward)
    gen = torch.Generator().manual_seed(0)
    for n_keys in (100, 1024):
        q = torch.randn(1, 2, 20, 64, generator=gen).half().to(device).requires_grad_()
        k, v = (torch.randn(1, 2, n_keys, 64, generator=gen).half().to(device).requires_grad_() for _ in range(2))
        o = kern(q, k, v)
        dq, dk, dv = torch.autograd.grad(o, (q, k, v), torch.ones_like(o))
        if n_keys == 100:  # the Triton generator's kernels ran: the result is attention's
            assert seen == []
            ref = attngen.reference(kern.spec, q.double(), k.double(), v.double(), dtype=torch.float64)
            assert not torch.isnan(o).any() and (o.double() - ref).abs().max() < 1e-2
            ref_grads = torch.autograd.grad(ref, (q, k, v), torch.ones_like(ref))
            for got, want in zip((dq, dk, dv), ref_grads):
                assert not torch.isnan(got).any() and (got.double() - want).abs().max() < 5e-2
    assert seen == [("gluon forward", 1024), ("gluon backward", 1024)]


def test_backend_gluon_for_what_it_cannot_render_is_a_plan_error():
    spec = load_spec("attention t { head_dim = 32 dtype = bf16 backend = gluon }")
    assert spec.backend is Backend.GLUON
    with pytest.raises(PlanError, match="backend = gluon, but the Gluon generator cannot render it: head_dim 32"):
        attngen.compile(spec, "h100")
    with pytest.raises(attngen.InputError, match="backend must be one of auto, triton, gluon; got 'cuda'"):
        attngen.compile("specs/causal.attn", "h100", backend="cuda")
    with pytest.raises(attngen.SpecError, match="backend must be one of: auto, triton, gluon"):
        load_spec("attention t { head_dim = 64 backend = cute }")


def test_plan_sizes_the_ring_from_shared_memory():
    for d, stages in ((128, 3), (64, 4)):
        gp = plan_gluon(plan(_spec("causal", head_dim=d), "h100"))
        smem = plan(_spec("causal"), "h100").target.smem_per_block
        q_bytes, stage_bytes = 2 * 64 * d * 2, 2 * 128 * d * 2
        assert gp.stages == stages == min(4, (smem - 1024 - q_bytes) // stage_bytes)
        assert (gp.block_m, gp.block_n, gp.consumers, gp.load_regs, gp.consumer_regs) == (128, 128, 2, 24, 240)
        # the register budget: 2 consumer warpgroups at 240 and the load warpgroup at 24 fit the 65536 of an SM
        assert 128 * (2 * gp.consumer_regs + gp.load_regs) <= 65536
        assert gp.fwd_maxnreg * 128 * 3 <= 65536 and "consumers 240 (maxnreg 168 at entry)" in render(gp)


def test_which_specs_take_the_persistent_forward():
    """The persistent forward (calls of at most 4096 keys) where no input is read by the mask or at a position by
    the score: ALiBi's slopes[h] take it, a bias table read at q_idx - kv_idx, a document mask, prefix-LM's
    prefix[b] (read by the mask) and runtime block sparsity do not."""
    takes = {name: plan_gluon(plan(_spec(name), "h100")).persistent
             for name in ("causal", "dense", "alibi", "relative_bias", "document", "prefix_lm", "block_sparse_runtime")}
    assert takes == {"causal": True, "dense": True, "alibi": True, "relative_bias": False, "document": False, "prefix_lm": False,
                     "block_sparse_runtime": False}
    assert not plan_gluon(plan(load_spec(KEY_BIAS), "h100")).persistent and plan_gluon(plan(load_spec(SLOPE_BIAS), "h100")).persistent


def test_three_consumer_warpgroups_where_no_mask_or_score_is():
    """head_dim 64 with no mask, score modification or dropout: three consumer warpgroups of 64 rows (192 a work
    item), 160 registers each, the ring of the Q tiles that leave room; masked, biased or dropped-out specs and
    head_dim 128 keep two (as measured: plan.py's THREE_CONSUMERS_MAX_HEAD_DIM); the backward keeps its two at 240 either way."""
    dense = plan_gluon(plan(_spec("dense", head_dim=64), "h100"))
    assert (dense.consumers, dense.block_m, dense.consumer_regs, dense.fwd_maxnreg, dense.bwd_consumer_regs) == (3, 192, 160, 128, 240)
    assert 128 * (3 * dense.consumer_regs + dense.load_regs) <= 65536 and dense.stages == 4
    src = render(dense)
    assert "def _consumer_2(" in src and "], [1, 4, 4], [LOAD_REGS, CONSUMER_REGS, CONSUMER_REGS])" in src and "CONSUMERS = gl.constexpr(3)" in src
    assert "FWD_MAXNREG = 128" in src and "MAXNREG = 168" in src
    for name, changes in (("causal", {"head_dim": 64}), ("alibi", {}), ("dense", {"head_dim": 128}), ("dense", {"head_dim": 64, "dropout": 0.1})):
        gp = plan_gluon(plan(_spec(name, **changes), "h100"))
        assert (gp.consumers, gp.block_m) == (2, 128), (name, changes)
        assert "def _consumer_2(" not in render(gp)


def test_head_dim_256_has_a_forward_of_64_key_tiles_and_the_triton_backward():
    """At head_dim 256 a K+V stage of 128 keys would leave one ring stage beside the Q tiles: 64 keys per tile, two
    stages. Its Gluon backward would need 256 registers per thread for dK and dV (a consumer has 240): the module
    holds the forward only, and every backend takes the Triton backward, saying why; auto takes the Gluon forward
    (measured 2.15-2.42x the Triton generator's on the H100)."""
    spec = _spec("causal", head_dim=256)
    gp = plan_gluon(plan(spec, "h100"))
    smem = plan(spec, "h100").target.smem_per_block
    assert (gp.block_m, gp.block_n, gp.has_backward) == (128, 64, False)
    assert gp.stages == 2 == (smem - 1024 - 2 * 64 * 256 * 2) // (2 * 64 * 256 * 2)
    assert "gluon backward: none (head_dim 256: its backward takes 64 or 128 (dK and dV of 64 keys per warpgroup would take 256 registers" in gp.describe()
    c = choose(spec, plan(spec, "h100"), Backend.GLUON)
    assert (c.generator, c.backward) == ("gluon", "triton") and c.backward_reason.startswith("no Gluon backward: head_dim 256: its backward takes 64 or 128")
    assert (choose(spec, plan(spec, "h100")).generator, choose(spec, plan(spec, "h100")).backward) == ("gluon", "triton")
    src = render(gp)
    assert "def _attn_fwd(" in src and "def attention_forward(" in src and "def _attn_bwd(" not in src and "attention_backward" not in src


@pytest.mark.slow  # triton.compile for sm_90 in a subprocess: about 30 s on 2 cores
def test_the_head_dim_256_forward_compiles_for_sm90(tmp_path):
    """With dropout, plain and packed: the forward kernels alone (no persistent form at head_dim 256), no spill,
    the register budgets in the PTX."""
    from attngen.codegen.gluon import build_source

    path = tmp_path / "d256_gluon.py"
    path.write_text(build_source(plan_gluon(plan(_spec("causal_dropout", head_dim=256), "h100")))[1])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "attngen.aot.gluon_binaries", str(path), "bf16"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = {r["kernel"]: r for r in map(json.loads, run.stdout.splitlines())}
    assert sorted(lines) == ["_attn_fwd", "_attn_fwd dropout", "_attn_fwd varlen", "_attn_fwd varlen dropout"]
    for r in lines.values():
        assert r["spill_bytes"] == 0 and {"24", "240"} <= set(r["setmaxnreg"]) and r["wgmma"] and r["tma"], r


def test_plan_sizes_the_backward():
    """One program per 128 keys (64 per consumer warpgroup); query tiles of 64 rows at d=128 (dQ split by columns)
    and 128 at d=64 (by rows): 2 * 64 * (d + BLOCK_M) / 128 registers of dK, dV, S^T and dP^T per thread stay at
    192; the Q/dO ring (with lse and delta) as deep as shared memory allows beside K, V, two dS^T buffers and the
    dQ tile (at most 3)."""
    smem = plan(_spec("causal"), "h100").target.smem_per_block - 1024
    for d, block_m, split, stages in ((128, 64, "d", 3), (64, 128, "m", 2)):
        gp = plan_gluon(plan(_spec("causal", head_dim=d), "h100"))
        assert (gp.bwd_block_n, gp.bwd_block_m, gp.dq_split, gp.bwd_consumer_regs) == (128, block_m, split, 240)
        assert 2 * 64 * (d + block_m) // 128 == 192
        fixed = 2 * 128 * d * 2 + 2 * 128 * block_m * 2 + block_m * d * 4  # K and V; two dS^T buffers; dQ in float32
        assert gp.bwd_stages == min(3, (smem - fixed) // (2 * block_m * (d * 2 + 4))) == stages  # Q, dO, lse, delta
        text = gp.describe()
        assert "gluon backward" in text and f"BLOCK_M={block_m}" in text and f"ring of {stages} Q/dO stages" in text


def test_which_calls_take_the_persistent_backward():
    """By head_dim, calls of few keys (PERSISTENT_BACKWARD_MAX_KEYS); where the tile classes read the inputs
    (documents), every call: their work items are short whatever the length. With dQ in no fixed order, none."""
    from attngen.codegen.gluon.plan import PERSISTENT_BACKWARD_ANY_LENGTH, PERSISTENT_BACKWARD_MAX_KEYS

    for d in (64, 128):
        assert plan_gluon(plan(_spec("causal", head_dim=d), "h100")).bwd_persistent_max_keys == PERSISTENT_BACKWARD_MAX_KEYS[d]
        assert plan_gluon(plan(_spec("sliding_window", head_dim=d), "h100")).bwd_persistent_max_keys == PERSISTENT_BACKWARD_MAX_KEYS[d]
        gp = plan_gluon(plan(_spec("document", head_dim=d), "h100"))
        assert gp.bwd_persistent_max_keys == PERSISTENT_BACKWARD_ANY_LENGTH and "=>  every call" in gp.describe()
    assert plan_gluon(plan(_spec("document", deterministic=False), "h100")).bwd_persistent_max_keys == 0


def test_the_forward_skips_the_holes_of_a_block_pattern():
    """A block pattern (sparsity = ...) leaves tiles its mask proves empty between the first and last kept key
    tile of a row: the forward's load warp and consumers walk only the others (_next_tile). A mask without one
    keeps the branch-free range."""
    for name, holes in (("local_global_blocks", True), ("strided_blocks", True), ("butterfly_blocks", True), ("causal", False),
                        ("sliding_window", False), ("dense", False)):
        gp = plan_gluon(plan(_spec(name, head_dim=128), "h100"))
        source = render(gp)
        assert gp.skip_empty == holes and ("def _next_tile(" in source) == holes, name
        assert ("not proved empty" if holes else "the range from the first") in gp.describe(), name
        assert source.count("_next_tile(") == (4 if holes else 0), name  # its definition, the load warp, the consumer (twice)
        # the pattern's blocks (64) are smaller than the tiles (128). Butterfly's `q_blk ^ kv_blk` has no useful
        # bounds over a whole tile, but is exact per 64 x 64 piece (q_blk, kv_blk single values): its tiles are
        # classified by pieces, which prove 176 of 256 tiles empty at N = 2048 where whole tiles prove none. The
        # other patterns' whole tiles prove as much as pieces (and the pieces' code costs): whole tiles.
        pieces = name == "butterfly_blocks"
        assert gp.class_piece == (64 if pieces else 0) and ("def _piece_class(" in source) == pieces, name
        assert ("piece_full & kv_full" in source) == pieces, name  # the backward's consumers classify a tile once
        if holes:
            assert ("176 of 256 by pieces, 0 whole" in gp.describe()) == pieces and ("whole tiles" in gp.describe()) != pieces, name


def test_which_generator_renders_the_backward():
    """The Gluon backward renders the backward of every spec whose forward is Gluon's, in both settings and at
    every length (measured as fast as the Triton generator's or faster from 1024 keys): with deterministic = true
    (the default) a dQ warp per consumer warpgroup adds its parts of dQ in a fixed order, so the gradients are
    bit-reproducible; with false, in no fixed order. Under auto the Triton backward stays where it measured
    faster: runtime block sparsity in order, and tile classes that read the inputs (documents)."""
    spec = _spec("causal")
    free = _spec("causal", deterministic=False)
    for backend in (None, Backend.AUTO, Backend.GLUON):
        c = choose(spec, plan(spec, "h100"), backend)
        assert (c.generator, c.backward) == ("gluon", "gluon") and "fixed order" in c.backward_reason
        assert "1.00-1.19x the Triton backward" in c.backward_reason and "gluon backward (deterministic" in c.describe()
        c = choose(free, plan(free, "h100"), backend)
        assert (c.generator, c.backward) == ("gluon", "gluon") and "last bits may vary" in c.backward_reason
        assert "1.05-1.27x the Triton backward" in c.backward_reason
    short = choose(_spec("causal", head_dim=64), plan(_spec("causal", head_dim=64), "h100"))  # d=64: by length
    assert (short.backward_at(1023), short.backward_at(1024)) == ("triton", "gluon")
    assert choose(free, plan(free, "h100"), Backend.TRITON).backward == "triton"
    assert attngen.compile(free, "h100").generator.backward == "gluon"
    assert attngen.compile(spec, "h100", deterministic=False).generator.backward == "gluon"
    assert attngen.compile(free, "h100", backend="gluon", deterministic=True).generator.backward == "gluon"
    # runtime block sparsity: the Gluon forward, and under auto the Triton backward (the ordered Gluon backward waits
    # for its turns along random block lists: measured slower at a quarter of the blocks); backend = gluon takes both
    sparse = _spec("block_sparse_runtime", head_dim=128)
    c = choose(sparse, plan(sparse, "h100"))
    assert (c.generator, c.backward) == ("gluon", "triton") and "0.92-1.08x" in c.backward_reason
    assert choose(sparse, plan(sparse, "h100"), Backend.GLUON).backward == "gluon"
    unordered = _spec("block_sparse_runtime", head_dim=128, deterministic=False)  # its waits are what cost: measured faster
    assert choose(unordered, plan(unordered, "h100")).backward == "gluon"
    # tile classes from the input pre-pass (documents): the Gluon backward at head_dim 128 in both settings (1.22-1.25x
    # the Triton one in order, H200 2026-11-29; 1.09-1.11x in no order, 2026-11-26), the Triton generator at 64 (the backward 0.85x,
    # 2026-11-26; the forward 0.87-0.92x, 2026-11-27)
    docs = _spec("document", head_dim=128)
    c = choose(docs, plan(docs, "h100"))
    assert (c.generator, c.backward) == ("gluon", "gluon") and "1.22-1.25x" in c.backward_reason
    unordered_docs = _spec("document", head_dim=128, deterministic=False)
    c = choose(unordered_docs, plan(unordered_docs, "h100"))
    assert c.backward == "gluon" and "1.09-1.11x" in c.backward_reason
    docs64 = _spec("document", head_dim=64)
    c = choose(docs64, plan(docs64, "h100"))
    assert (c.generator, c.backward) == ("triton", "triton") and "0.85x" in c.reason
    assert choose(docs64, plan(docs64, "h100"), Backend.GLUON).backward == "gluon"
    # masks whose tile classes need no input (windows, prefix-LM, block patterns): the Gluon backward in both settings
    for name in ("sliding_window", "local_window", "causal", "prefix_lm", "local_global_blocks"):
        for det in (True, False):
            spec = _spec(name, head_dim=128, deterministic=det)
            assert choose(spec, plan(spec, "h100")).backward == "gluon", (name, det)


def test_the_deterministic_setting():
    spec = load_spec("attention t { head_dim = 64 deterministic = false }")
    assert spec.deterministic is False and load_spec("attention t { head_dim = 64 }").deterministic is True
    from attngen.lang.canonical import format_spec, spec_hash
    assert "deterministic = false" in format_spec(spec)
    # printed only when false: the hashes (cache keys, bundle names) of every spec that does not say it stay as they were
    assert "deterministic" not in format_spec(load_spec("attention t { head_dim = 64 deterministic = true }"))
    assert spec_hash(load_spec("attention t { head_dim = 64 deterministic = true }")) == spec_hash(load_spec("attention t { head_dim = 64 }"))
    with pytest.raises(attngen.SpecError, match="deterministic must be true or false") as err:
        load_spec("attention t {\n    head_dim = 64\n    deterministic = 1\n}")
    assert "line 3" in str(err.value) or ":3:" in str(err.value)
    with pytest.raises(attngen.InputError, match="deterministic must be True or False; got 'no'"):
        attngen.compile("specs/causal.attn", "h100", deterministic="no")
    with pytest.raises(attngen.InputError, match="a bundle holds the kernels of the generators its build chose from the spec's own backend and deterministic"):
        attngen.compile("specs/causal.attn", bundle="build", deterministic=False)


def test_names_are_translated_from_a_closed_table():
    assert translate("tl.where(a < b, tl.minimum(a, b), tl.math.div_rn(a, 2.0))") == "gl.where(a < b, gl.minimum(a, b), gl.div_rn(a, 2.0))"
    assert translate("x.to(tl.float32)") == "x.to(gl.float32)"
    assert translate("tl.load(in_x_ptr + h * in_x_stride_0, mask=(h < in_x_size_0), other=0)") == "gl.load(in_x_ptr + h * in_x_stride_0, mask=(h < in_x_size_0), other=0)"
    for code in ("tl.arange(0, 16)", "tl.sigmoid(x)", "tl.math.tanh(x)", "triton.language.exp(x)", "tl.min(x, axis=1)"):
        with pytest.raises(Untranslatable):
            translate(code)
    # a spec whose score needs a function Gluon lacks is not rendered: sigmoid is refused by the translation, so
    # the spec stays with the Triton generator (auto) or is a PlanError (backend = gluon)
    spec = load_spec("attention t { head_dim = 128 score = score * sigmoid(score) }")
    with pytest.raises(Untranslatable, match="tl.sigmoid"):
        render(plan_gluon(plan(spec, "h100")))
    with pytest.raises(PlanError, match="backend = gluon, but the Gluon generator cannot render it: tl.sigmoid has no Gluon counterpart"):
        choose(spec, plan(spec, "h100"), Backend.GLUON)
    masked = load_spec("attention t { head_dim = 128 mask = sigmoid(q_idx - kv_idx + 0.0) > 0.3 }")
    c = choose(masked, plan(masked, "h100"))
    assert c.generator == "triton" and "tl.sigmoid has no Gluon counterpart" in c.reason
    assert attngen.compile(masked, "h100").gluon is None


def test_plan_command_says_which_generator_and_why(capsys):
    assert main(["plan", str(SPECS["causal"]), "--target", "h100"]) == 0
    out = capsys.readouterr().out
    assert "generator: gluon forward (backend = auto: sm_90" in out and "; gluon backward (deterministic: dQ added in a fixed order" in out
    assert "dQ 2 warps, one per consumer warpgroup (24 registers/thread: add dQ in a fixed order)" in out
    assert "ring stages" in out and "consumers get" in out and "gluon backward (FlashAttention-3 structure" in out
    assert main(["plan", str(SPECS["paged_decode"]), "--target", "h100"]) == 0
    assert "generator: triton forward (the Gluon generator does not take it: kv_layout = paged" in capsys.readouterr().out


@pytest.mark.parametrize("name", TAKEN)
def test_rendered_source_is_readable_and_carries_only_ir_code(name):
    spec = _spec(name)
    src = render(plan_gluon(plan(spec, "h100")))
    compile(src, name, "exec")  # valid Python
    assert "Generated by attngen" in src and "Glossary" in src and spec.name in src
    for m in re.finditer(r"\btl\.(?!PropagateNan)", src):  # every Triton name was translated, but in the input pre-pass (plain Triton)
        owner = src.rfind("\ndef ", 0, m.start()) + 5
        assert src[owner:src.index("(", owner)] == "_input_bounds", src[owner:m.end() + 40]
    for fn in ("_load_partition", "_consumer", "_softmax_step", "_attn_fwd", "attention_forward",
               "_bwd_delta", "_q_tiles", "_bwd_load_partition", "_bwd_consumer", "_attn_bwd", "attention_backward",
               "_bwd_dq_partition", "_wait_turn", "_pass_turn"):  # the last three: dQ in a fixed order (the default)
        assert f"def {fn}(" in src
    assert "The forward's schedule" in src and "The backward's schedule" in src
    unordered = render(plan_gluon(plan(_spec(name, deterministic=False), "h100")))
    assert "def _attn_bwd(" in unordered and "_wait_turn" not in unordered and "_bwd_dq_partition" not in unordered


# A separable bias whose key part is not affine in kv_idx (a read at the key): the kernels add it key by key
KEY_BIAS = """attention key_bias {
    head_dim = 128
    dtype    = bf16
    input pos: int32[B, N]
    mask     = q_idx >= kv_idx
    score    = score + 0.05 * (q_idx // 16) - 0.01 * pos[b, kv_idx]
}"""
# An affine one without inputs at head_dim 64: its calls of few keys take both passes' persistent forms
SLOPE_BIAS = """attention slope_bias {
    head_dim = 64
    dtype    = bf16
    mask     = q_idx >= kv_idx
    score    = score - 0.0625 * (q_idx + kv_len - q_len - kv_idx)
}"""
BIASES = {"key_bias": KEY_BIAS, "slope_bias": SLOPE_BIAS}


def test_a_separable_bias_is_added_as_a_key_part():
    """ALiBi (lang.analysis.separable_bias): the forward adds its key part's offsets in a tile by the tensor cores at head_dim
    64 (a product of ones and a tile of the offsets, chained onto Q K^T; the tile's first key's value in each row's
    maximum), at 128 as the tile's first key's value plus a vector of offsets made once an item, and its row part
    to the lse; the backward adds the key part of its query tile's first row, the pre-pass takes the row part off
    the lse (with dQ in no fixed order too, whose pre-pass then takes the inputs); no score pays a position's
    conversion or (d = 64) an addition. A key part that is not affine goes key by key; softcap's tanh is no bias."""
    gp = plan_gluon(plan(_spec("alibi"), "h100"))
    assert gp.base.spec.head_dim == 64 and gp.bias_mma
    src = render(gp)
    assert "bias_step" not in src and "_softmax_step(qk, m_i, l_i, q_idx, q_ref, j, full," in src
    assert src.count("qk = warpgroup_mma(ones, bias_tile.permute((1, 0)), qk, is_async=True)") == 2  # the first tile and the loop's
    assert "bias_tile.store(" in src and "ones = gl.full([M_PER_WG, BIAS_K], 1.0, dtype" in src
    assert "m_i + gl.log2(l_safe) + (" in src and "lse -= (" in src and "s = s_t * QK_SCALE_LOG2 + bias_key" in src
    step = src.split("def _softmax_step(")[1].split("\n\n\n")[0]
    assert "(q_ref - j * BLOCK_N).to(gl.float32)" in step and "kv_idx).to(" not in step  # a conversion per tile, none per key
    assert "    s = qk\n" in step and "gl.expand_dims(m_use - tile_bias, 1)" in step  # nothing added per score
    assert "_position_f32" not in src and "(q_idx - kv_idx).to(" not in src
    wide = plan_gluon(plan(_spec("alibi", head_dim=128), "h100"))
    src = render(wide)
    assert not wide.bias_mma and "bias_tile" not in src and "BIAS_K" not in src
    assert "bias_step = (" in src and "_softmax_step(qk, m_i, l_i, q_idx, q_ref, bias_step, j, full," in src
    unordered = render(plan_gluon(plan(_spec("alibi", deterministic=False), "h100")))
    delta = unordered.split("def _bwd_delta(")[1].split(")")[0]
    assert "in_slopes_ptr" in delta and "lse -= (" in unordered
    keyed = render(plan_gluon(plan(load_spec(KEY_BIAS), "h100")))
    assert "bias_step" not in keyed and "s = qk * QK_SCALE_LOG2 + (" in keyed and "fbias_pos_" in keyed
    for spec in (load_spec(BIASES[name]) for name in BIASES):  # (with dQ in no fixed order: with inputs or none)
        compile(render(plan_gluon(plan(dataclasses.replace(spec, deterministic=False), "h100"))), spec.name, "exec")
    softcap = render(plan_gluon(plan(_spec("causal_softcap"), "h100")))
    assert "q_ref" not in softcap and "bias_key" not in softcap
    # and `attngen plan` says which way each goes
    steps = {name: {st.what: st.value for st in plan_gluon(plan(_spec(name), "h100")).steps} for name in ("alibi", "causal_softcap", "causal")}
    assert steps["alibi"]["score modification"] == "separable bias" and steps["causal_softcap"]["score modification"] == "per score"
    assert "score modification" not in steps["causal"]


@pytest.mark.slow  # triton.compile for sm_90 in a subprocess: about 1 min each on 2 cores
@pytest.mark.parametrize("name, deterministic", [("key_bias", True), ("key_bias", False), ("slope_bias", True)])
def test_a_separable_bias_compiles_for_sm90(name, deterministic, tmp_path):
    """BIASES through the Gluon kernels (the key-by-key one with dQ in order or not; the affine one without inputs,
    whose short calls take the persistent forms) compile for sm_90 with the schedule intact and no spills in the
    forward (ALiBi: in the tests above and below)."""
    from attngen.codegen.gluon import build_source

    path = tmp_path / f"{name}_{deterministic}_gluon.py"
    spec = dataclasses.replace(load_spec(BIASES[name]), deterministic=deterministic)
    gp = plan_gluon(plan(spec, "h100"))
    # (key_bias reads an input at a position: no persistent forward; slope_bias reads none)
    assert gp.persistent == (name == "slope_bias") and (gp.bwd_persistent_max_keys > 0) == deterministic
    path.write_text(build_source(gp)[1])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "attngen.aot.gluon_binaries", str(path), "bf16"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = {r["kernel"]: r for r in map(json.loads, run.stdout.splitlines())}
    kernels = ["_attn_fwd", "_attn_bwd"] + ["_attn_fwd persistent"] * gp.persistent + ["_attn_bwd persistent"] * deterministic
    for kernel in kernels:
        r = lines[kernel]
        assert {"24", "240"} <= set(r["setmaxnreg"]) and r["wgmma"] and r["tma"] and r["cubin_bytes"] > 0, r
    assert lines["_attn_fwd"]["spill_bytes"] == 0 and lines["_bwd_delta"]["cubin_bytes"] > 0


@pytest.mark.parametrize("name, deterministic", [("key_bias", True), ("key_bias", False), ("slope_bias", True), ("slope_bias", False)])
def test_a_separable_bias_matches_the_reference(name, deterministic, device):
    """BIASES through both Gluon passes within `attngen check`'s budget on every CUDA shape (the lse included,
    which holds the row part; slope_bias's short calls through the persistent forms), bf16."""
    if device != "cuda":
        pytest.skip("Gluon kernels run on an sm_90 GPU only (Triton's interpreter does not run Gluon)")
    kern = attngen.compile(dataclasses.replace(load_spec(BIASES[name]), deterministic=deterministic), backend="gluon")
    assert (kern.generator.generator, kern.generator.backward) == ("gluon", "gluon")
    results = [verify.check_one(kern, shape, "cuda", seed=i) for i, shape in enumerate(verify.CUDA_SHAPES)]
    assert all(r.ok for r in results), verify.format_table(name, results)


# every taken spec (deterministic), three with deterministic = false, and dense at head_dim 64 (three consumer warpgroups)
SM90_CASES = [(name, True) for name in TAKEN] + [("dense", False), ("causal", False), ("alibi", False), ("dense64", True)]


@pytest.mark.slow  # triton.compile for sm_90 in a subprocess: 10-40 s each on 2 cores
@pytest.mark.parametrize("name, det", SM90_CASES, ids=[f"{n}-{'deterministic' if d else 'unordered'}" for n, d in SM90_CASES])
def test_every_taken_spec_compiles_for_sm90(name, det, tmp_path):
    """A Gluon kernel that does not compile would only fail on the GPU: compile each spec's kernels for sm_90 here
    (the forward, the backward and its pre-pass, each also for packed sequences; in bf16, and for the causal spec in
    fp16 too (the element type changes nothing else); in a process of its own, without the interpreter, specialized
    as Triton's JIT would on the GPU) and check the schedule made it into the PTX: the register budgets (setmaxnreg
    24 and 240), the wgmma products, the TMA copies, the backward's dQ added by TMA reduce-adds (no floating-point
    atomic: with deterministic = true, the default, only the integer ticket and turn counters; with false, none);
    and the shared memory fits."""
    from attngen.codegen.gluon import build_source

    smem = plan(_spec("causal"), "h100").target.smem_per_block
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    dtypes = ("bf16", "fp16") if (name, det) == ("causal", True) else ("bf16",)
    path = tmp_path / f"{name}_{det}_gluon.py"
    spec = _spec("dense", head_dim=64) if name == "dense64" else _spec(name, deterministic=det)
    gp = plan_gluon(plan(spec, "h100"))
    path.write_text(build_source(gp)[1])
    run = subprocess.run([sys.executable, "-m", "attngen.aot.gluon_binaries", str(path), *dtypes], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{name}: {run.stderr[-3000:]}"
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    tails = ("", " varlen") if takes_packed(spec) else ("",)  # packed sequences where the spec takes them
    kernels = [k + tail for tail in tails for k in ("_attn_fwd", "_attn_bwd", "_bwd_delta")]
    if spec.dropout:  # and with dropout compiled in
        kernels += [k + tail + " dropout" for k in ("_attn_fwd", "_attn_bwd") for tail in tails]
    if gp.persistent:  # the forward's persistent form (calls of few keys)
        kernels += ["_attn_fwd persistent"] + (["_attn_fwd persistent dropout"] if spec.dropout else [])
    if det and gp.bwd_persistent_max_keys:  # the backward's (head_dim 64: calls of few keys)
        kernels += [f"_attn_bwd{tail} persistent" for tail in tails] + [f"_attn_bwd{tail} persistent dropout" for tail in tails if spec.dropout]
    assert sorted((r["kernel"], r["dtype"]) for r in lines) == sorted((k, t) for t in dtypes for k in kernels)
    for r in lines:
        assert r["cubin_bytes"] > 0 and 0 <= r["shared"] <= smem, (name, r)
        if not r["kernel"].startswith("_bwd_delta"):
            regs = str(gp.consumer_regs if r["kernel"].startswith("_attn_fwd") else gp.bwd_consumer_regs)  # (three consumers: 160)
            assert {"24", regs} <= set(r["setmaxnreg"]) and r["wgmma"] and r["tma"] and r["shared"] > 0, (name, r)
        if r["kernel"].startswith("_attn_fwd"):
            # (three consumers at 160 registers: the persistent form keeps two of an item's values in local
            # memory across its loop, 32 bytes, stored once an item and read at its end)
            allowed = 32 if gp.consumers == 3 and "persistent" in r["kernel"] else 0
            assert r["spill_bytes"] <= allowed, (name, r)
    bwd = [r for r in lines if r["kernel"].startswith("_attn_bwd")]
    counters = ["atom.global.gpu.acq_rel.add.u32", "red.release.gpu.global.add.s32"] if det else []  # ticket, turns
    assert all(r["atomics"] == counters and r["tma_reduce"] == ["cp.reduce.async.bulk.tensor.3d.global.shared::cta.add.bulk_group"]
               for r in bwd), (name, det, bwd)


@pytest.mark.slow  # triton.compile for sm_90 in subprocesses: about 40 s on 2 cores
@pytest.mark.parametrize("name", ["causal_dropout", "alibi"])
def test_a_shards_kernels_compile_for_sm90(name, tmp_path):
    """The kernels of a context-parallel shard (KernelPlan.global_positions: attngen.distributed) compile for sm_90
    with their schedule intact: a mask with dropout, and a score reading an input (ALiBi). Their numerics: on
    the GPU, benchmarks/context_parallel.py (BENCHMARKS.md)."""
    from attngen.codegen.gluon import build_source

    path = tmp_path / f"{name}_shard_gluon.py"
    path.write_text(build_source(plan_gluon(dataclasses.replace(plan(_spec(name), "h100"), global_positions=True)))[1])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "attngen.aot.gluon_binaries", str(path), "bf16"], env=env,
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, f"{name}: {run.stderr[-3000:]}"
    lines = {r["kernel"]: r for r in map(json.loads, run.stdout.splitlines())}
    for kernel in ("_attn_fwd", "_attn_bwd"):
        r = lines[kernel]
        assert {"24", "240"} <= set(r["setmaxnreg"]) and r["wgmma"] and r["tma"] and r["cubin_bytes"] > 0, (name, r)
    assert lines["_attn_fwd"]["spill_bytes"] == 0


def test_on_the_cpu_a_gluon_kernel_runs_the_triton_forward(device):
    """kernel.gluon is made (it imports without a GPU), but CPU tensors go through the interpreter's Triton kernels."""
    kern = attngen.compile(_spec("causal", dtype=DType.FP16), "h100", backend="gluon")
    assert kern.generator.generator == "gluon" and kern.gluon is not None and "gluon.jit" in kern.gluon_source
    q, k, v = (torch.randn(1, 2, 70, 128, dtype=torch.float16).to(device) for _ in range(3))
    out = kern(q, k, v)
    ref = attngen.reference(kern.spec, q.double(), k.double(), v.double(), dtype=torch.float64)
    assert not torch.isnan(out).any() and torch.allclose(out.double(), ref, atol=2e-3)  # (on a GPU: through Gluon)


@pytest.mark.parametrize("name", TAKEN)
def test_gluon_forward_matches_the_reference(name, device):
    """Through both generators: the forward by Gluon (backward by Triton) within `attngen check`'s budget on every
    CUDA shape (odd lengths, GQA, MQA, q_len != kv_len), bf16 and fp16; reruns bit-identical."""
    if device != "cuda":
        pytest.skip("Gluon kernels run on an sm_90 GPU only (Triton's interpreter does not run Gluon)")
    for dtype in (DType.BF16, DType.FP16):
        kern = attngen.compile(_spec(name, dtype=dtype), backend="gluon")
        results = [verify.check_one(kern, shape, "cuda", seed=i) for i, shape in enumerate(verify.CUDA_SHAPES)]
        assert all(r.ok for r in results), verify.format_table(name, results)
        q, k, v = (torch.randn(2, 4, 777, kern.spec.head_dim, device="cuda", dtype=TORCH_DTYPES[kern.spec.dtype.value]) for _ in range(3))
        inputs = verify.make_inputs(kern.spec, 2, 4, 777, 777, "cuda", torch.Generator().manual_seed(1))
        inputs |= {"seed": 5} if kern.spec.dropout else {}  # the same dropout pattern
        assert torch.equal(kern(q, k, v, **inputs), kern(q, k, v, **inputs))


def test_three_consumer_warpgroups_match_the_reference(device):
    """Dense at head_dim 64 (three consumer warpgroups in the forward, 192 rows a work item): within `attngen
    check`'s budget on every CUDA shape, bf16 and fp16, the short ones through the persistent forward; packed
    sequences as each sequence alone and against the reference (test_varlen's check)."""
    if device != "cuda":
        pytest.skip("Gluon kernels run on an sm_90 GPU only (Triton's interpreter does not run Gluon)")
    from test_varlen import _check_packed

    for dtype in (DType.BF16, DType.FP16):
        kern = attngen.compile(_spec("dense", head_dim=64, dtype=dtype), backend="gluon")
        assert kern.generator.gluon.consumers == 3
        results = [verify.check_one(kern, shape, "cuda", seed=i) for i, shape in enumerate(verify.CUDA_SHAPES)]
        assert all(r.ok for r in results), verify.format_table("dense d=64", results)
    _check_packed(kern, device)


@pytest.mark.parametrize("name", ["causal_dropout", "dense", "document"])
def test_the_head_dim_256_forward_matches_the_reference(name, device):
    """backend = gluon at head_dim 256: the Gluon forward (64-key tiles) and the Triton backward, within `attngen
    check`'s budget on every CUDA shape, bf16 and fp16."""
    if device != "cuda":
        pytest.skip("Gluon kernels run on an sm_90 GPU only (Triton's interpreter does not run Gluon)")
    for dtype in (DType.BF16, DType.FP16):
        kern = attngen.compile(_spec(name, dtype=dtype, head_dim=256), backend="gluon")
        assert (kern.generator.generator, kern.generator.backward) == ("gluon", "triton")
        results = [verify.check_one(kern, shape, "cuda", seed=i) for i, shape in enumerate(verify.CUDA_SHAPES)]
        assert all(r.ok for r in results), verify.format_table(name, results)


@pytest.mark.parametrize("deterministic", [True, False])
@pytest.mark.parametrize("name", TAKEN)
def test_gluon_backward_matches_the_reference(name, deterministic, device):
    """Both passes through Gluon (backend = gluon) within `attngen check`'s budget on every CUDA shape, bf16 and
    fp16; reruns give bit-identical O, dK and dV, and dQ too with deterministic = true (with false, dQ is added
    by TMA reduce-adds in no fixed order)."""
    if device != "cuda":
        pytest.skip("Gluon kernels run on an sm_90 GPU only (Triton's interpreter does not run Gluon)")
    for dtype in (DType.BF16, DType.FP16):
        kern = attngen.compile(_spec(name, dtype=dtype), backend="gluon", deterministic=deterministic)
        assert kern.generator.backward == "gluon"
        results = [verify.check_one(kern, shape, "cuda", seed=i) for i, shape in enumerate(verify.CUDA_SHAPES)]
        assert all(r.ok for r in results), verify.format_table(name, results)
        gen = torch.Generator(device="cuda").manual_seed(3)
        q, do = (torch.randn(2, 4, 777, kern.spec.head_dim, device="cuda", dtype=TORCH_DTYPES[dtype.value], generator=gen) for _ in range(2))
        k, v = (torch.randn(2, 2, 777, kern.spec.head_dim, device="cuda", dtype=TORCH_DTYPES[dtype.value], generator=gen) for _ in range(2))
        inputs = verify.make_inputs(kern.spec, 2, 4, 777, 777, "cuda", torch.Generator().manual_seed(1))
        inputs |= {"seed": 5} if kern.spec.dropout else {}  # the same dropout pattern
        runs = []
        for _ in range(2):
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = kern(*leaves, **inputs)
            runs.append((out, *torch.autograd.grad(out, leaves, do)))
        (o1, dq1, dk1, dv1), (o2, dq2, dk2, dv2) = runs
        assert torch.equal(o1, o2) and torch.equal(dk1, dk2) and torch.equal(dv1, dv2)
        assert not torch.isnan(dq1).any() and torch.allclose(dq1.float(), dq2.float(), rtol=0, atol=1e-2)
        assert torch.equal(dq1, dq2) or not deterministic


@pytest.mark.parametrize("deterministic", [True, False])
def test_a_document_past_the_class_bits_matches_the_reference(deterministic, device, monkeypatch):
    """Where the tile classes read the input pre-pass (documents), the Gluon backward keeps the classes of a key
    tile's first 32 query tiles as bits and classifies later ones again, and the forward those of a query tile's
    first 32 key tiles: a 4200-token document is 66 query tiles of 64 rows and 33 key tiles of 128 at head_dim
    128, so its first key tiles and its last query tiles take both ways (the suite's documents are ~16 tokens);
    within `attngen check`'s budget."""
    if device != "cuda":
        pytest.skip("Gluon kernels run on an sm_90 GPU only (Triton's interpreter does not run Gluon)")
    kern = attngen.compile(_spec("document", head_dim=128), backend="gluon", deterministic=deterministic)
    assert kern.generator.backward == "gluon"

    def long_document(spec, batch, heads, q_len, kv_len, device, generator):
        doc = (torch.arange(max(q_len, kv_len)) >= 4200).to(torch.int32)  # tokens 0..4199, then a second document
        return {"doc": doc.expand(batch, -1).contiguous().to(device)}

    monkeypatch.setattr(verify, "make_inputs", long_document)
    results = [verify.check_one(kern, shape, "cuda", seed=i) for i, shape in enumerate(((1, 2, 1, 4400, 4400), (2, 4, 2, 4310, 4310)))]
    assert all(r.ok for r in results), verify.format_table("document", results)


@pytest.mark.parametrize("name", ["causal", "document", "causal_dropout", "block_sparse_runtime"])
def test_the_persistent_backward_gives_the_gradients_of_a_program_per_item(name, device, monkeypatch):
    """The backward's two forms (a program per SM taking key tiles by ticket, or one per key tile) add dQ's parts
    in the same order: O and every gradient bit-identical, whichever form a call's length would pick (head_dim
    128 and 64, ranked tile classes, dropout, runtime block sparsity, GQA, a length ending inside a tile, and
    272 work items, so each program of the persistent form takes two or three); packed sequences too."""
    if device != "cuda":
        pytest.skip("Gluon kernels run on an sm_90 GPU only (Triton's interpreter does not run Gluon)")
    kern = attngen.compile(_spec(name), backend="gluon")
    g = kern.gluon
    assert kern.generator.backward == "gluon" and hasattr(g, "takes_persistent_backward")
    gen = torch.Generator(device="cuda").manual_seed(7)
    d = kern.spec.head_dim
    for B, Hq, Hkv, N in ((2, 4, 2, 777), (4, 16, 4, 2100)):  # 2100 keys: 17 key tiles x 16 (batch, key/value head)
        q, do = (torch.randn(B, Hq, N, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        k, v = (torch.randn(B, Hkv, N, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(2))
        inputs = verify.make_inputs(kern.spec, B, Hq, N, N, "cuda", torch.Generator().manual_seed(1))
        inputs |= {"seed": 5} if kern.spec.dropout else {}
        runs = []
        for persistent in (True, False):
            monkeypatch.setattr(g, "takes_persistent_backward", lambda kv_len, p=persistent: p)
            monkeypatch.setattr(g, "_BACKWARD_CALLS", {}, raising=False)
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = kern(*leaves, **inputs)
            runs.append((out, *torch.autograd.grad(out, leaves, do)))
        for a, b in zip(*runs):
            assert not torch.isnan(a).any() and torch.equal(a, b), (name, B, Hq, N)
    if name == "causal":  # packed sequences
        lengths = [5, 300, 1, 2049, 128]
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device="cuda")
        q, k, v, do = (torch.randn(sum(lengths), 4, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        runs = []
        for persistent in (True, False):
            monkeypatch.setattr(g, "takes_persistent_backward", lambda kv_len, p=persistent: p)
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = kern(*leaves, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=max(lengths), max_seqlen_k=max(lengths))
            runs.append((out, *torch.autograd.grad(out, leaves, do)))
        for a, b in zip(*runs):
            assert not torch.isnan(a).any() and torch.equal(a, b), "packed"


def _layouts(B, Hq, Hkv, N, D, dtype, device, gen):
    """{name: (q, k, v)} of one set of values in the layouts callers hand over: contiguous; (B, N, H, D) memories seen
    through transpose(1, 2) (attention layers, flash_attn's layout); q, k, v viewed out of one fused projection (B, N,
    Hq + 2 Hkv, D); q in rows with k, v contiguous (a KV cache); k in rows, v contiguous."""
    q, k, v = (torch.randn(B, h, N, D, device=device, dtype=dtype, generator=gen) for h in (Hq, Hkv, Hkv))
    rows = lambda t: t.transpose(1, 2).contiguous().transpose(1, 2)
    fused = torch.cat([t.transpose(1, 2) for t in (q, k, v)], dim=2).transpose(1, 2)  # (B, Hq + 2 Hkv, N, D) view
    return {"contiguous": (q, k, v), "rows": (rows(q), rows(k), rows(v)),
            "fused": (fused[:, :Hq], fused[:, Hq:Hq + Hkv], fused[:, Hq + Hkv:]),
            "q rows, kv contiguous": (rows(q), k, v), "k rows, v contiguous": (q, rows(k), v)}


def test_descriptors_address_every_layout_where_the_kernels_index_it():
    """The contract between the Gluon module's host code and its kernels, on the CPU: _tma_ready leaves a tensor
    where it is when TMA can read it (contiguous, or a row holding every head at 16-byte strides) and copies it
    otherwise (in the layout attngen.layout gives outputs), and the descriptor _descriptor makes for it, indexed
    as the kernels index it (planes: (b * H + h, n, d); rows: (b, n, h * D + d)), lands on each element's own
    address, inside its bounds, at strides TMA takes. empty_laid_out and _as_layout give dense tensors of the layout
    they are asked for, with the values kept."""
    g = attngen.compile(_spec("causal"), "h100", backend="gluon").gluon
    gen = torch.Generator().manual_seed(0)
    cases = {f"{name}: {what}": (t, False) for name, ts in _layouts(2, 4, 2, 33, 128, torch.bfloat16, "cpu", gen).items()
             for what, t in zip("qkv", ts)}
    for B, N, H in ((2, 5, 1), (2, 1, 4), (1, 7, 4)):  # sizes of 1: one head, one row, one sequence
        fused = torch.randn(B, N, 3, H, 128, generator=gen).to(torch.bfloat16)
        cases[f"fused, B={B} N={N} H={H}"] = (fused[:, :, 1].transpose(1, 2), False)
    wide = torch.randn(2, 33, 4, 136, generator=gen).to(torch.bfloat16)
    cases["rows of 136 elements, not 16-byte units"] = (wide[..., :128].transpose(1, 2), True)
    flat = torch.randn(2 * 4 * 33 * 128 + 1, generator=gen).to(torch.bfloat16)
    cases["not 16-byte aligned"] = (flat[1:].view(2, 4, 33, 128), True)
    cases["heads apart"] = (torch.randn(2, 33, 4, 256, generator=gen).to(torch.bfloat16)[..., ::2].transpose(1, 2), True)
    for name, (t, copies) in cases.items():
        ready = g._tma_ready(t)
        assert torch.equal(ready, t) and (ready.data_ptr() != t.data_ptr()) == copies, name
        assert heads_in_rows(ready) == heads_in_rows(t), name  # a copy keeps the layout outputs follow (attngen.layout)
        flag = g._in_rows(ready)
        desc = g._descriptor(ready, 64, flag)
        B, H, N, D = ready.shape
        size = ready.element_size()
        assert all(s > 0 and s * size % 16 == 0 for s in desc.strides[:-1]) and desc.strides[-1] == 1, (name, desc.strides)
        for b, h, n, d in {(0, 0, 0, 0), (B - 1, H - 1, N - 1, D - 1), (B - 1, 0, N // 2, 7), (0, H - 1, 1 % N, D // 2)}:
            coord = (b, n, h * D + d) if flag else (b * H + h, n, d)
            assert all(0 <= c < s for c, s in zip(coord, desc.shape)), (name, coord, desc.shape)
            at = desc.base.data_ptr() + sum(c * s for c, s in zip(coord, desc.strides)) * size
            assert at == ready[b, h, n, d].data_ptr(), (name, (b, h, n, d))
    t = cases["fused: k"][0]
    for flag in (0, 1):
        fresh = empty_laid_out(t.shape, torch.float32, "cpu", flag).zero_()
        assert fresh.shape == t.shape and not fresh.any()
        assert (fresh.transpose(1, 2) if flag else fresh).is_contiguous()
        laid = g._as_layout(t, flag)
        assert torch.equal(laid, t) and (laid.transpose(1, 2) if flag else laid).is_contiguous()
        assert g._as_layout(laid, flag) is laid


class _Recorder:
    """A kernel's stand-in in a Gluon module (as attngen.bundle's recorders): keeps each launch's grid, arguments
    and keyword arguments."""

    def __init__(self):
        self.launches = []

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.launches.append((grid, args, kwargs))


def _same_arguments(got, expected, what):
    """Launch arguments equal as the kernel sees them: the same tensors (by identity), descriptors over the same
    tensor with equal shape, strides, block, layout and padding, equal values (and types) otherwise."""
    assert len(got) == len(expected), what
    for i, (a, b) in enumerate(zip(got, expected)):
        if isinstance(b, torch.Tensor):
            assert a is b, (what, i)
        elif hasattr(b, "block_shape"):
            assert type(a) is type(b) and a.base is b.base, (what, i)
            assert [list(a.shape), list(a.strides), list(a.block_shape), a.layout, a.padding] == \
                [list(b.shape), list(b.strides), list(b.block_shape), b.layout, b.padding], (what, i)
        else:
            assert type(a) is type(b) and a == b, (what, i, a, b)


@pytest.mark.parametrize("name, d", [("causal", 128), ("sliding_window", 128), ("causal", 64)])
def test_a_call_like_one_before_launches_what_the_host_code_would(name, d, monkeypatch):
    """attention_forward and attention_backward keep a recipe of their launches' arguments per call signature
    (attngen.runtime.launch.Recipe), so a call like one made before skips the layout decisions that made them. On the CPU,
    with the kernels swapped for recorders: such a call launches exactly the arguments, grid and flags that
    launch_args, grid, delta_launch_args and bwd_launch_args give for its own tensors and outputs, in each layout
    callers hand over, persistent or not (1024 and 4160 rows; the backward's persistent form at 1024);
    a call whose tensors are copied first (k in rows, v contiguous) or that passes one tensor in two roles keeps no
    recipe, and the next such call decides again."""
    g = attngen.compile(_spec(name, head_dim=d), "h100", backend="gluon").gluon
    kernels = {n: _Recorder() for n in ("_attn_fwd", "_bwd_delta", "_attn_bwd")}
    for n, rec in kernels.items():
        monkeypatch.setitem(vars(g), n, rec)  # the Launchers look the kernel up in the module on every call
    monkeypatch.setattr(g, "_FORWARD_CALLS", {})
    monkeypatch.setattr(g, "_BACKWARD_CALLS", {})
    made = []  # calls of the functions that make the arguments (the recipes replay them instead)
    full = {fn: getattr(g, fn) for fn in ("launch_args", "delta_launch_args", "bwd_launch_args")}
    for fn, f in full.items():
        monkeypatch.setattr(g, fn, (lambda f, fn: lambda *a, **k: made.append(fn) or f(*a, **k))(f, fn))
    gen = torch.Generator().manual_seed(0)
    recorded = {"contiguous", "rows", "fused", "q rows, kv contiguous"}
    for kv_len in (1024, 4160):
        for layout in ("contiguous", "rows", "fused", "q rows, kv contiguous", "k rows, v contiguous"):
            for call in range(2):
                q, k, v = _layouts(2, 4, 2, kv_len, d, torch.bfloat16, "cpu", gen)[layout]
                what = (kv_len, layout, call)
                made.clear()
                o, lse = g.attention_forward(q, k, v)
                known = call == 1 and layout in recorded
                assert made == ([] if known else ["launch_args"]), what
                grid, args, kwargs = kernels["_attn_fwd"].launches[-1]
                assert args[4] is o and args[5] is lse and heads_in_rows(o) == heads_in_rows(q), what
                persistent = g.takes_persistent(kv_len)
                assert (grid, kwargs) == (g.grid(kv_len, 2, 4, q.device, persistent), {**g._FORWARD.options, **({"PERSISTENT": True} if persistent else {})}), what
                if layout in recorded:
                    _same_arguments(args, full["launch_args"](q, k, v, o, lse, persistent=persistent), what)
                do = torch.randn(o.shape, generator=gen).to(torch.bfloat16)
                do = empty_laid_out(o.shape, o.dtype, "cpu", heads_in_rows(o)).copy_(do)  # as the layer's gradient comes
                made.clear()
                grads = g.attention_backward(q, k, v, o, lse, do, None)
                assert made == ([] if known else ["delta_launch_args", "bwd_launch_args"]), what
                assert all(t.shape == x.shape and heads_in_rows(t) == heads_in_rows(x) for t, x in zip(grads, (q, k, v))), what
                if layout not in recorded:
                    continue
                (dgrid, dargs, _), (bgrid, bargs, bkwargs) = kernels["_bwd_delta"].launches[-1], kernels["_attn_bwd"].launches[-1]
                stats, dq, dk, dv, order = bargs[4].base, bargs[5].base, bargs[6], bargs[7], bargs[10:12]  # (8, 9: dK's and dV's descriptors)
                assert dk is grads[1] and dv is grads[2], what
                _same_arguments(bargs, full["bwd_launch_args"](q, k, v, do, stats, order, dq, dk, dv), what)
                _same_arguments(dargs, full["delta_launch_args"](o, do, lse, None, stats, order, k, dq=dq), what)
                persistent = g.takes_persistent_backward(kv_len)
                assert persistent == (kv_len == 1024), what  # (at most 2048 keys at head_dim 64, 4096 at 128)
                assert bgrid == g.bwd_grid(kv_len, 2, 2, q.device, persistent) and dgrid == (-(-stats.shape[2] // g.DELTA_ROWS), 8), what
                assert bkwargs == {**g._BACKWARD.options, **({"PERSISTENT": True} if persistent else {})}, what
    assert len(g._FORWARD_CALLS) == len(g._BACKWARD_CALLS) == 2 * len(recorded)
    q, k, v = _layouts(2, 4, 2, 64, d, torch.bfloat16, "cpu", gen)["contiguous"]
    made.clear()
    g.attention_forward(q, k, k)  # one tensor as both k and v: decided each time
    g.attention_forward(q, k, k)
    assert made == ["launch_args"] * 2 and len(g._FORWARD_CALLS) == 2 * len(recorded)


@pytest.mark.parametrize("name", ["causal", "dense", "causal_dropout"])
def test_gluon_reads_q_k_v_in_the_layout_they_come_in(name, device):
    """Forward and backward through Gluon on q, k, v in every layout of _layouts, GQA, with lengths that end inside
    a tile: O and every gradient bit-identical to the call on contiguous copies (the same kernels, addressed
    otherwise) and within the float64 reference's budget; O comes back laid out as q (a (B, N, H, D) memory for
    q in rows). Also one head, and one row."""
    if device != "cuda":
        pytest.skip("Gluon kernels run on an sm_90 GPU only (Triton's interpreter does not run Gluon)")
    kern = attngen.compile(_spec(name), backend="gluon")
    assert (kern.generator.generator, kern.generator.backward) == ("gluon", "gluon")
    gen = torch.Generator(device="cuda").manual_seed(0)
    extra = {"seed": 11} if kern.spec.dropout else {}
    d = kern.spec.head_dim
    for B, Hq, Hkv, N in ((2, 4, 2, 200), (3, 1, 1, 130), (2, 4, 2, 1)):
        cases = _layouts(B, Hq, Hkv, N, d, torch.bfloat16, "cuda", gen)
        do = torch.randn(B, N, Hq, d, device="cuda", dtype=torch.bfloat16, generator=gen).transpose(1, 2)
        results = {}
        for layout, tensors in cases.items():
            leaves = [t.detach().requires_grad_() for t in tensors]
            out = kern(*leaves, **extra)
            results[layout] = (out, *torch.autograd.grad(out, leaves, do))
            if not leaves[0].is_contiguous():  # q read in rows: O in a (B, N, Hq, D) memory
                assert out.transpose(1, 2).is_contiguous(), (layout, out.stride())
        wide = [t.detach().double().requires_grad_() for t in cases["contiguous"]]
        dropout = {"dropout_p": kern.spec.dropout, "seed": 11} if kern.spec.dropout else {}
        ref = attngen.reference(kern.spec, *wide, dtype=torch.float64, **dropout)
        ref_all = (ref, *torch.autograd.grad(ref, wide, do.double()))
        for layout, got in results.items():
            for what, g_, c_, want in zip("O dQ dK dV".split(), got, results["contiguous"], ref_all):
                assert torch.equal(g_, c_), (name, (B, Hq, Hkv, N), layout, what)
                assert torch.isfinite(g_).all()
                assert (g_.double() - want).abs().max().item() <= 2e-2 * max(1.0, want.abs().max().item()), (layout, what)


@pytest.mark.parametrize("name", ["dense", "causal"])
def test_a_head_reads_nothing_of_the_next_one(name, device):
    """Tiles past the end of a head are read as zeros (3-D TMA descriptors, one (batch, head) per coordinate), not
    as the next head's first rows: inf in head 1's first rows of q, k, v and dO leaves head 0's output and
    gradients finite and equal to the float64 reference. Before, with the tensors viewed as (B*H*N, D) rows, head
    0's last key tile read head 1's first keys, masked to weight 0, and 0 * inf made NaN."""
    if device != "cuda":
        pytest.skip("Gluon kernels run on an sm_90 GPU only (Triton's interpreter does not run Gluon)")
    kern = attngen.compile(_spec(name), backend="gluon", deterministic=False)
    gen = torch.Generator(device="cuda").manual_seed(0)
    n = 200  # not a multiple of 128 (keys per tile) or 64 (query rows per warpgroup)
    q, k, v, do = (torch.randn(1, 2, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    for t in (q, k, v, do):
        t[:, 1, :64] = float("inf")
    leaves = [t.detach().requires_grad_() for t in (q, k, v)]
    out = kern(*leaves)
    grads = torch.autograd.grad(out, leaves, do)
    wide = [t[:, :1].detach().double().requires_grad_() for t in (q, k, v)]
    ref = attngen.reference(kern.spec, *wide, dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, wide, do[:, :1].double())
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        got = got[:, :1].double()
        assert torch.isfinite(got).all()
        assert (got - want).abs().max().item() <= 2e-2 * max(1.0, want.abs().max().item())


@pytest.mark.parametrize("head_dim", [64, 128])
def test_gluon_dropout_draws_the_pattern_of_dropout_mask(head_dim, device):
    """The Gluon kernels' dropout pattern is attngen.dropout_mask's, bit for bit (the Triton generator's too): with
    q = 0 every probability is 1 / N, so with V's rows unit vectors, O[i, c] = (keep[i, c] + 2 keep[i, c + D]) *
    scale / N names each pair's decision; with dO's rows unit vectors, dV does the same for the backward's
    pattern, transposed."""
    if device != "cuda":
        pytest.skip("Gluon kernels run on an sm_90 GPU only (Triton's interpreter does not run Gluon)")
    spec = load_spec(f"attention drop {{ head_dim = {head_dim}\n dtype = bf16\n dropout = 0.25 }}")
    kern = attngen.compile(spec, backend="gluon")
    assert kern.generator.generator == "gluon" and kern.generator.backward == "gluon"
    d, n = head_dim, 2 * head_dim
    eye = torch.eye(d, device="cuda", dtype=torch.bfloat16)
    units = torch.cat([eye, 2 * eye])[None, None].expand(2, 3, n, d).contiguous()  # row j: e_(j % D), doubled from D on
    scale = n * (1 - attngen.dropout_probability(0.25))
    for seed in (0, 12345, 2**40 + 3):
        q = torch.zeros(2, 3, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        k = torch.randn(2, 3, n, d, device="cuda", dtype=torch.bfloat16, requires_grad=True)
        v = units.clone().requires_grad_()
        o = kern(q, k, v, seed=seed)
        _, _, dv = torch.autograd.grad(o, (q, k, v), units)
        keep = attngen.dropout_mask(seed, 0.25, 2, 3, n, n, device="cuda")
        want = keep[..., :d].int() + 2 * keep[..., d:].int()  # [b, h, query, c]
        assert torch.equal(torch.round(o.float() * scale).int(), want), seed
        want_t = keep.transpose(2, 3)  # [b, h, key, query]
        got_t = torch.round(dv.float() * scale).int()  # dV[j, c] = (keep[c, j] + 2 keep[c + D, j]) / scale
        assert torch.equal(got_t, want_t[..., :d].int() + 2 * want_t[..., d:].int()), seed


def test_a_replayed_backward_keeps_its_buffers_per_stream(device):
    """The Gluon backward replayed by signature keeps what only its launches read (the pre-pass's results, dQ's
    float32 sum, the order of dQ's additions) in the stream's scratch memory: two signatures taking turns on one
    stream, a side stream and a CUDA graph give the first calls' gradients bit for bit, within budget of the
    float64 reference. On the CPU: the scratch layout (each buffer at a 256-byte boundary, none overlapping)."""
    from attngen.runtime.counters import stream_carve

    layout = (((2, 3, 5), (15, 5, 1), torch.float32), ((7,), (1,), torch.int32), ((4, 9), (9, 1), torch.bfloat16))
    carved = stream_carve("test layout", torch.device("cpu"), layout)
    assert [(tuple(t.shape), t.stride(), t.dtype) for t in carved] == [(s, st, d) for s, st, d in layout]
    starts = [t.data_ptr() for t in carved]
    assert all(a % 256 == starts[0] % 256 for a in starts) and starts == sorted(starts)
    assert all(a + t.numel() * t.element_size() <= b for a, t, b in zip(starts, carved, starts[1:]))
    if device != "cuda":
        pytest.skip("Gluon kernels run on an sm_90 GPU only (Triton's interpreter does not run Gluon)")
    kern = attngen.compile(_spec("causal"))
    gen = torch.Generator(device="cuda").manual_seed(0)
    shapes = ((1, 4, 512), (2, 2, 384))
    data = [[torch.randn(b, h, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_(i < 3) for i in range(4)]
            for b, h, n in shapes]

    def grads(q, k, v, do):
        return torch.autograd.grad(kern(q, k, v), (q, k, v), do)
    first = [grads(*d) for d in data]
    for _ in range(2):  # the two signatures in turn, each replayed
        assert all(all(torch.equal(a, b) for a, b in zip(grads(*d), f)) for d, f in zip(data, first))
    main_stream, side = torch.cuda.current_stream(), torch.cuda.Stream()
    side.wait_stream(main_stream)
    with torch.cuda.stream(side):
        on_side = [grads(*d) for d in data]
    main_stream.wait_stream(side)
    assert all(all(torch.equal(a, b) for a, b in zip(g, f)) for g, f in zip(on_side, first))
    q, k, v, do = data[0]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = grads(q, k, v, do)
    graph.replay()
    torch.cuda.synchronize()
    assert all(torch.equal(a, b) for a, b in zip(captured, first[0]))
    for d, f in zip(data, first):
        q, k, v, do = (t.detach().double() for t in d)
        ref = torch.autograd.grad(attngen.reference(kern.spec, *(t.requires_grad_() for t in (q, k, v)), dtype=torch.float64),
                                  (q, k, v), do)
        for g, r in zip(f, ref):
            assert not g.isnan().any() and (g.double() - r).abs().max() <= 2e-2 * max(1.0, r.abs().max().item())


def test_a_replayed_persistent_forward_keeps_a_counter_per_stream(device):
    """A plain call of the persistent forward (1024 keys) replayed on the default stream, on a side stream and from
    a CUDA graph gives the first call's O bit for bit, within budget of the float64 reference; every stream's
    counter of work items is back to 0 after each launch."""
    if device != "cuda":
        pytest.skip("Gluon kernels run on an sm_90 GPU only (Triton's interpreter does not run Gluon)")
    from attngen.runtime.counters import stream_counters

    kern = attngen.compile(_spec("causal"))
    assert kern.gluon.takes_persistent(1024)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(2, 8, 1024, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    main_stream, side = torch.cuda.current_stream(), torch.cuda.Stream()
    with torch.no_grad():
        first = kern(q, k, v)
        outs = [kern(q, k, v), kern(q, k, v)]
        side.wait_stream(main_stream)
        with torch.cuda.stream(side):
            outs += [kern(q, k, v), kern(q, k, v)]
            assert not stream_counters("persistent forward", q.device, 1).any()
        main_stream.wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = kern(q, k, v)
        for _ in range(2):
            graph.replay()
            outs.append(captured.clone())
        torch.cuda.synchronize()
    assert not stream_counters("persistent forward", q.device, 1).any()
    assert all(torch.equal(o, first) for o in outs)
    ref = attngen.reference(kern.spec, q.double(), k.double(), v.double(), dtype=torch.float64)
    assert not first.isnan().any() and (first.double() - ref).abs().max() < 2e-2
