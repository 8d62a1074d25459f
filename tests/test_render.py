"""Rendering: valid, readable Python; a header with the spec, hash and versions; nothing of the spec's raw text."""
import ast
from pathlib import Path

import pytest

from attngen.lang.check import load_spec
from attngen.plan.planner import plan
from attngen.codegen import templates_root, versions
from attngen.codegen.triton import render

SPECS = sorted((Path(__file__).parent.parent / "specs").glob("*.attn"))


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
@pytest.mark.parametrize("target", ["h100", "a100", "l4"])
def test_every_spec_renders_to_valid_python(path, target):
    spec = load_spec(path.read_text(), str(path))
    if spec.dtype.value == "bf16" and target == "t4":
        return
    src = render(plan(spec, target))
    tree = ast.parse(src)
    names = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    assert {"attention_forward", "attention_backward", "_attn_bwd_dkdv", "_attn_bwd_dq"} <= names
    assert ("_attn_fwd" in names) != ("_attn_fwd_kv_outer" in names)
    assert "do not edit" in src.splitlines()[1]
    for line in src.splitlines():
        assert len(line) < 200 and not line.endswith(" "), repr(line)


def test_header_carries_spec_hash_versions_and_glossary():
    spec = load_spec("attention causal { head_dim = 64 mask = q_idx >= kv_idx }")
    p = plan(spec, "h100")
    src = render(p)
    header = src.split("import torch")[0]
    assert "#   attention causal {" in header and "#       mask = q_idx >= kv_idx" in header
    assert p.spec_hash[:16] in header
    v = versions()
    assert f"triton {v['triton']}" in header and f"attngen {v['attngen']}" in header
    # not torch's: the generated code does not depend on it, and a bundle built with one torch must render the
    # same module on a machine with another (attngen.load compares them)
    assert "torch 2" not in header
    for word in ("m_i, l_i", "acc", "q_idx, kv_idx", "lse", "delta"):
        assert word in header


def _training(src: str) -> str:
    """The forward and backward kernels: the source before the decode kernels, which always guard against rows
    without a key (kv_lens may be 0)."""
    assert "m_ij_safe" in src.split("def _attn_decode(")[1]
    return src.split("def _attn_decode(")[0]


def test_dead_branches_are_resolved_by_jinja():
    plain = _training(render(plan(load_spec("attention t { head_dim = 64 }"), "h100")))
    assert "keep = offs_n[None, :] < kv_len" in plain  # the key bound: rows of the call's tensors
    assert "q_offset" not in plain and "seq_q_len" not in plain  # positions: only a context-parallel shard's kernels
    assert "m_ij_safe" not in plain and "l_safe" not in plain  # no row can be empty without a mask
    assert "QK_SCALE_LOG2" in plain and "score =" not in plain.split("_attn_fwd(")[1].split("def attention_forward")[0]
    assert "offs_d[None, :] < HEAD_DIM" not in plain  # 64 needs no padding
    window = render(plan(load_spec("attention t { head_dim = 80 mask = q_idx >= kv_idx and q_idx - kv_idx < 64 }"), "h100"))
    assert "m_ij_safe" in window and "l_safe" in window and "offs_d[None, :] < HEAD_DIM" in window
    causal = _training(render(plan(load_spec("attention t { head_dim = 80 mask = q_idx >= kv_idx }"), "h100")))
    assert "m_ij_safe" not in causal and "l_safe" not in causal  # every row keeps key 0


def test_fp32_asks_for_ieee_products():
    src = render(plan(load_spec("attention t { head_dim = 64 dtype = fp32 }"), "h100"))
    assert src.count('input_precision="ieee"') >= 5
    assert 'input_precision' not in render(plan(load_spec("attention t { head_dim = 64 }"), "h100"))


def test_spec_text_never_reaches_the_source():
    text = """attention t {   # __import__('os').system('echo pwned')
        head_dim = 64
        mask = q_idx >= kv_idx   # ''' \"\"\" ; import os
    }"""
    src = render(plan(load_spec(text), "h100"))
    for evil in ("__import__", "pwned", "import os", "'''"):
        assert evil not in src


def test_input_names_appear_only_as_validated_identifiers():
    spec = load_spec("attention t { head_dim = 64 input doc_ids: int32[B, N] mask = doc_ids[b, q_idx] == doc_ids[b, kv_idx] }")
    src = render(plan(spec, "h100"))
    assert "in_doc_ids_ptr, in_doc_ids_stride_0, in_doc_ids_stride_1, in_doc_ids_size_0, in_doc_ids_size_1" in src
    assert "def attention_forward(q, k, v, in_doc_ids, varlen=None, tiles=TILES):" in src  # in_: no input name can shadow a launcher variable


def test_q_only_input_loads_are_hoisted_out_of_the_key_loop():
    spec = load_spec("attention t { head_dim = 64 input doc: int32[B, N] mask = doc[b, q_idx] == doc[b, kv_idx] }")
    src = render(plan(spec, "h100"))
    fwd = src.split("def _attn_fwd(")[1].split("def attention_forward")[0]
    before_loop, loop = fwd.split("# -- step 3: online softmax")
    assert "q_idx * in_doc_stride_1" in before_loop and "kv_idx * in_doc_stride_1" in loop


def test_templates_are_found():
    assert (templates_root() / "triton" / "module.py.jinja").is_file()


def test_a_shards_kernels_see_positions_in_the_whole_sequence():
    """KernelPlan.global_positions (context parallelism): the row and key indices the expressions and the tile
    classes see are offset to positions in the whole sequence, whose lengths replace the call's in the
    expressions; the bounds of the call's own rows stay local; the query head they and dropout's pattern see is
    offset to its index in the whole tensor (head-parallel methods); the plain kernels have none of it."""
    import dataclasses

    from attngen.codegen.gluon import plan_gluon
    from attngen.codegen.gluon import render as render_gluon

    spec = load_spec("attention t { head_dim = 128 dtype = bf16 mask = q_idx >= kv_idx and q_idx + 8 < q_len }")
    base = plan(spec, "h100")
    shard = dataclasses.replace(base, global_positions=True)
    causal = plan(load_spec("attention c { head_dim = 128 mask = q_idx >= kv_idx }"), "h100")
    assert not causal.may_mask_rows  # every row keeps key 0, but a shard's keys may all lie outside a row's mask:
    assert dataclasses.replace(causal, global_positions=True).may_mask_rows
    compile(render(shard), "t", "exec")
    src = _training(render(shard))
    for line in ("q_idx = offs_m[:, None] + q_offset", "kv_idx = offs_n[None, :] + kv_offset", "q_offset, kv_offset, seq_q_len, seq_kv_len, h_offset, seq_heads,",
                 "full, empty = _tile_class(row_lo + q_offset, row_hi + q_offset, start + kv_offset, end + kv_offset, b, h + h_offset, seq_q_len, seq_kv_len)",
                 "(offs_m[None, :] < q_len) & (offs_n[:, None] < kv_len)", "+ 8 < seq_q_len"):
        assert line in src, line
    assert "+ 8 < q_len" not in src.split("import triton.language as tl")[1]  # the expressions never see the call's rows (the header shows the spec)
    plain = _training(render(base))
    assert "q_offset" not in plain and "+ 8 < q_len" in plain
    gluon = render_gluon(plan_gluon(shard))
    compile(gluon, "t_gluon", "exec")
    for line in ("q_lo, q_hi, kv_lo, kv_hi = q_lo + q_offset, q_hi + q_offset, kv_lo + kv_offset, kv_hi + kv_offset",
                 "q_len, kv_len = seq_q_len, seq_kv_len", "h = h + h_offset", "(kv_idx < kv_len + kv_offset)", "+ 8 < seq_q_len"):
        assert line in gluon, line
    assert "q_offset" not in render_gluon(plan_gluon(base))
    heads = load_spec("attention d { head_dim = 128 dtype = bf16 mask = q_idx >= kv_idx or h == 3 dropout = 0.1 }")
    shard = dataclasses.replace(plan(heads, "h100"), global_positions=True)
    for src in (_training(render(shard)), render_gluon(plan_gluon(shard))):
        assert "(h + h_offset) == 3" in src and "b * seq_heads + h + h_offset" in src
    plain = plan(heads, "h100")
    assert "h_offset" not in render(plain) and "h_offset" not in render_gluon(plan_gluon(plain))
