"""`value_dim = N`: V and O with N columns of their own, q and k with head_dim (DeepSeek's training shape: 192 / 128).
Checked against the float64 reference like every spec (O, the lse, dQ, dK, dV, no NaN) with each kind of mask, a
score modification, a sink, dropout, the kv_outer schedule, packed sequences and the decode kernels (contiguous and
paged caches); the spec's and the call's errors."""
import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch

import attngen
from attngen.codegen.gluon import choose, render
from attngen.errors import InputError, SpecError
from attngen.lang.canonical import spec_hash
from attngen.lang.check import load_spec
from attngen.lang.spec import Backend
from attngen.plan.planner import plan
from attngen.tools import verify

# q.k over 32 columns, V and O 16 (or 24: padded to 32 in the kernels), in every kind of spec
MASKS = {
    "causal": "mask = q_idx >= kv_idx",
    "window_sink": "input sinks: fp32[H]\n    sink = sinks[h]\n    mask = q_idx >= kv_idx and kv_idx > q_idx - 24",
    "documents": "input doc: int32[B, N]\n    mask = doc[b, q_idx] == doc[b, kv_idx]",
    "alibi_dropout": "input slopes: fp32[H]\n    score = score - slopes[h] * abs(q_idx - kv_idx)\n    dropout = 0.1",
    "kv_outer": "mask = q_idx >= kv_idx\n    loop_order = kv_outer",
}


def _spec(body: str, value_dim: int = 16, dtype: str = "fp32", head_dim: int = 32, extra: str = "") -> str:
    return f"attention dv {{\n    head_dim = {head_dim}\n    value_dim = {value_dim}\n    dtype = {dtype}\n    {body}\n{extra}}}"


@pytest.mark.parametrize("name", list(MASKS))
def test_a_value_dim_is_exact_forward_and_backward(name, device, dtypes, target):
    """verify's rule on the shape matrix (on the CPU its first three shapes): O, the lse, dQ, dK, dV (and the
    gradients of the float inputs the score and the sink read) within the error budget, no NaN."""
    shapes = verify.CPU_SHAPES[:3] if device == "cpu" else verify.CUDA_SHAPES
    for dtype in dtypes[:1] if device == "cpu" else dtypes:
        kern = attngen.compile(_spec(MASKS[name], 24 if name == "documents" else 16, dtype), target)
        results = [verify.check_one(kern, shape, device, backward=name != "kv_outer" or device == "cuda") for shape in shapes]
        assert all(r.ok and not r.nan for r in results), verify.format_table(f"{name} {dtype}", results)
        assert results[-1].errors["out"][0] >= 0 and ("dv" in results[-1].errors or name == "kv_outer")


def test_the_output_and_dv_have_value_dim_columns(target, device):
    kern = attngen.compile(_spec(MASKS["causal"], 48), target)
    gen = torch.Generator().manual_seed(0)
    q, k = (torch.randn(1, 2, 40, 32, generator=gen).to(device).requires_grad_() for _ in range(2))
    v = torch.randn(1, 2, 40, 48, generator=gen).to(device).requires_grad_()
    o, lse = kern(q, k, v, return_lse=True)
    assert o.shape == (1, 2, 40, 48) and lse.shape == (1, 2, 40)
    dq, dk, dv = torch.autograd.grad(o.square().sum(), (q, k, v))
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref = attngen.reference(kern.spec, *wide)
    ref_grads = torch.autograd.grad(ref.square().sum(), wide)
    assert not o.isnan().any() and (o.double() - ref).abs().max() < 1e-4
    assert all(g.shape == r.shape and (g.double() - r).abs().max() < 1e-3 for g, r in zip((dq, dk, dv), ref_grads))


def test_packed_sequences_take_a_value_dim(target, device):
    kern = attngen.compile(_spec(MASKS["causal"]), target)
    o, lse, grads, ref, ref_lse, ref_grads = _packed_against_reference(kern, [5, 17, 9], [6, 0, 12], device, torch.float32)
    assert o.shape == (31, 4, 16) and not o.isnan().any() and all(not g.isnan().any() for g in grads)
    finite = ref_lse.isfinite()  # the second sequence has no key: lse = -inf
    assert torch.equal(lse.isfinite(), finite) and (lse.double()[finite] - ref_lse[finite]).abs().max() < 1e-4
    assert (o.double() - ref).abs().max() < 1e-4
    assert all((g.double() - r).abs().max() < 1e-3 for g, r in zip(grads, ref_grads))


def _packed_against_reference(kern, q_lens, kv_lens, device, dtype):
    """A packed call (4 query heads over 2, random q, k, v and dO of `dtype`) and its gradients, beside the float64
    reference's: (O, lse, grads, ref O, ref lse, ref grads)."""
    spec = kern.spec
    gen = torch.Generator().manual_seed(1)
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device) for n in (q_lens, kv_lens))
    q = torch.randn(sum(q_lens), 4, spec.head_dim, generator=gen).to(device, dtype).requires_grad_()
    k = torch.randn(sum(kv_lens), 2, spec.head_dim, generator=gen).to(device, dtype).requires_grad_()
    v = torch.randn(sum(kv_lens), 2, spec.dv, generator=gen).to(device, dtype).requires_grad_()
    o, lse = kern(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True)
    do = torch.randn(o.shape, generator=gen).to(device, dtype)
    grads = torch.autograd.grad(o, (q, k, v), do)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attngen.reference(spec, *wide, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True)
    return o, lse, grads, ref, ref_lse, torch.autograd.grad(ref, wide, do.double())


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_decoding_takes_a_value_dim(layout, target, device):
    """The decode kernels (split keys, merged partial results) with a contiguous cache and per-sequence lengths,
    and with a paged cache: verify's serving check (the reference gathers the pages)."""
    paged = "\n    kv_layout = paged\n    page_size = 16" if layout == "paged" else ""
    kern = attngen.compile(_spec(MASKS["causal"] + paged, 24), target)
    if layout == "paged":
        results = [verify.check_one(kern, shape, device) for shape in ((2, 4, 2, 1, 70), (1, 8, 1, 3, 200))]
        assert all(r.ok and not r.nan for r in results), verify.format_table("paged", results)
        return
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(3, 4, 2, 32, generator=gen).to(device)
    k = torch.randn(3, 2, 300, 32, generator=gen).to(device)
    v = torch.randn(3, 2, 300, 24, generator=gen).to(device)
    lens = torch.tensor([300, 17, 0], dtype=torch.int32, device=device)
    with torch.no_grad():
        o, lse = kern(q, k, v, kv_lens=lens, return_lse=True)
    ref, ref_lse = attngen.reference(kern.spec, q.double(), k.double(), v.double(), kv_lens=lens, return_lse=True)
    assert o.shape == (3, 4, 2, 24) and not o.isnan().any()
    assert (o.double() - ref).abs().max() < 1e-4
    finite = ref_lse.isfinite()
    assert torch.equal(lse.isfinite(), finite) and (lse.double()[finite] - ref_lse[finite]).abs().max() < 1e-4


def test_value_dim_equal_to_head_dim_is_the_plain_spec():
    """`value_dim = head_dim` says nothing more: the same spec, hash and generated code as without it."""
    plain = load_spec("attention a { head_dim = 64 mask = q_idx >= kv_idx }")
    same = load_spec("attention a { head_dim = 64 value_dim = 64 mask = q_idx >= kv_idx }")
    assert same == plain and spec_hash(same) == spec_hash(plain)
    assert spec_hash(load_spec("attention a { head_dim = 64 value_dim = 32 mask = q_idx >= kv_idx }")) != spec_hash(plain)


@pytest.mark.parametrize("value", ["8", "512", "auto", "1.5"])
def test_value_dim_out_of_range_is_an_error_at_its_text(value):
    text = f"attention a {{ head_dim = 64 value_dim = {value} }}"
    with pytest.raises(SpecError) as info:
        load_spec(text, "a.attn")
    message = str(info.value).splitlines()[0]
    assert message.startswith(f"a.attn:1:{text.index('value_dim = ') + 13}: error: value_dim") and "16..256" in message, message


@pytest.mark.parametrize("setting", ["dtype = fp8", "dtype = bf16 kv_dtype = fp8"])
def test_value_dim_with_fp8_is_not_yet_taken(setting):
    text = f"attention a {{ head_dim = 64 value_dim = 32 {setting} }}"
    with pytest.raises(SpecError) as info:
        load_spec(text, "a.attn")
    assert str(info.value).startswith(f"a.attn:1:29: error: value_dim cannot go with {setting.split()[-3]} = fp8 yet"), str(info.value)


def test_a_call_with_v_of_the_wrong_width_is_refused(target):
    kern = attngen.compile(_spec(MASKS["causal"]), target)
    q, k = (torch.randn(1, 2, 8, 32) for _ in range(2))
    with pytest.raises(InputError, match="v has 32 columns, the spec says value_dim = 16"):
        kern(q, k, torch.randn(1, 2, 8, 32))
    with pytest.raises(InputError, match=r"v \(B, Hkv, Nk, value_dim\) must agree"):
        attngen.reference(kern.spec, q, k, torch.randn(1, 2, 8, 32))
    plain = attngen.compile(MASKS["causal"].join(["attention p { head_dim = 32 dtype = fp32 ", " }"]), target)
    with pytest.raises(InputError, match="a spec with `value_dim = N` takes V of N columns"):
        plain(q, k, torch.randn(1, 2, 8, 16))


def test_the_gluon_generator_takes_deepseek_s_shape():
    """DeepSeek's shape (192 / 128): auto takes the Gluon forward (Q's and K's tiles in two parts, 128 + 64 columns,
    V and O of 128) and the Triton backward, and says why; a V as wide as q.k's 192 columns it leaves to the Triton
    generator, saying why. The Triton plan derives its tiles from both widths (K and V stages of 192 + 128 columns)."""
    spec = load_spec(_spec(MASKS["causal"], 128, "bf16", 192))
    p = plan(spec, "h100")
    choice = choose(spec, p, Backend.AUTO)
    assert (choice.generator, choice.backward) == ("gluon", "triton") and "head_dim 192: its backward takes 64 or 128" in choice.backward_reason
    assert choice.gluon.qk_tail == 64 and "q.k in two parts" in choice.gluon.describe() and choice.gluon.block_n == 128
    source = render(choice.gluon)
    assert "QK_LEAD = gl.constexpr(128)" in source and "QK_TAIL = gl.constexpr(64)" in source and "VALUE_DIM = gl.constexpr(128)" in source
    assert "qk = warpgroup_mma(q_tail, kt_smem.index(slot).reshape([BLOCK_N, QK_TAIL]).permute((1, 0)), qk, is_async=True)" in source
    wide = load_spec(_spec(MASKS["causal"], 192, "bf16", 192))
    refused = choose(wide, plan(wide, "h100"), Backend.AUTO)
    assert refused.generator == "triton" and "its forward takes V of 64 or 128 or 256 columns" in refused.reason
    assert p.head_dim_pad == 256 and p.value_dim_pad == 128 and "value_dim 128 (padded to 128)" in p.describe()
    same = plan(dataclasses.replace(spec, value_dim=None), "h100")
    assert p.num_stages >= same.num_stages  # V's stage is narrower: never fewer stages than with V as wide as K


@pytest.mark.slow  # triton.compile for sm_90 in a subprocess: about 30 s on 2 cores
def test_the_gluon_forward_of_deepseek_s_shape_compiles_for_sm90(tmp_path):
    """Its forward (plain and packed) compiles for sm_90 with the schedule in the PTX (setmaxnreg 24 and 240, wgmma,
    TMA), no spills and shared memory within the target's; the module holds no backward."""
    from attngen.codegen.gluon import build_source

    spec = load_spec(_spec(MASKS["causal"], 128, "bf16", 192))
    gp = choose(spec, plan(spec, "h100"), Backend.AUTO).gluon
    path = tmp_path / "deepseek_gluon.py"
    path.write_text(build_source(gp)[1])
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    run = subprocess.run([sys.executable, "-m", "attngen.aot.gluon_binaries", str(path), "bf16"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    lines = [json.loads(line) for line in run.stdout.splitlines()]
    assert sorted(r["kernel"] for r in lines) == ["_attn_fwd", "_attn_fwd varlen"]
    for r in lines:
        assert {"24", "240"} <= set(r["setmaxnreg"]) and r["wgmma"] and r["tma"] and r["spill_bytes"] == 0, r
        assert 0 < r["shared"] <= gp.base.target.smem_per_block, r


# The Gluon forward with a value_dim of its own (the Triton backward after it), on the GPU: (head_dim, value_dim, mask,
# dtype). 192 / 128 reads Q and K in two parts and stores O through Q's first part; 128 / 64 and 256 / 128 store O
# through Q's tile seen as fewer columns, 128 / 64 in the persistent form too (its short calls)
GLUON = {
    "192_128_causal": (192, 128, "causal", "bf16"),
    "192_128_window_sink": (192, 128, "window_sink", "bf16"),
    "192_128_documents": (192, 128, "documents", "bf16"),
    "192_128_alibi_dropout": (192, 128, "alibi_dropout", "fp16"),
    "128_64_causal": (128, 64, "causal", "fp16"),
    "128_64_dense": (128, 64, "", "bf16"),
    "256_128_causal": (256, 128, "causal", "bf16"),
}


@pytest.mark.parametrize("name", list(GLUON))
def test_the_gluon_forward_with_a_value_dim_is_exact(name, device):
    """verify's rule on every CUDA shape: O, the lse and every gradient within budget, no NaN, with the Gluon forward."""
    if device != "cuda":
        pytest.skip("Gluon kernels run on an sm_90 GPU only (Triton's interpreter does not run Gluon)")
    head_dim, value_dim, mask, dtype = GLUON[name]
    kern = attngen.compile(_spec(MASKS.get(mask, ""), value_dim, dtype, head_dim), backend="gluon")
    assert (kern.generator.generator, kern.generator.backward) == ("gluon", "triton")
    results = [verify.check_one(kern, shape, "cuda", seed=i) for i, shape in enumerate(verify.CUDA_SHAPES)]
    assert all(r.ok and not r.nan for r in results), verify.format_table(name, results)


def test_packed_sequences_take_a_value_dim_through_the_gluon_forward(device):
    """DeepSeek's shape as packed sequences (the Gluon forward's VARLEN form, O stored row by row at VALUE_DIM
    columns a head) against the float64 reference, the gradients through the Triton backward."""
    if device != "cuda":
        pytest.skip("Gluon kernels run on an sm_90 GPU only (Triton's interpreter does not run Gluon)")
    kern = attngen.compile(_spec(MASKS["causal"], 128, "bf16", 192), backend="gluon")
    o, lse, grads, ref, ref_lse, ref_grads = _packed_against_reference(kern, [130, 300, 7], [200, 0, 129], "cuda", torch.bfloat16)
    assert o.shape == (437, 4, 128) and not o.isnan().any() and all(not g.isnan().any() for g in grads)
    finite = ref_lse.isfinite()  # the second sequence has no key: lse = -inf
    assert torch.equal(lse.isfinite(), finite) and (lse.double()[finite] - ref_lse[finite]).abs().max() < 2e-2
    # bf16: errors relative to each tensor's largest entry
    assert all((x.double() - r).abs().max() <= 2e-2 * r.abs().max() for x, r in zip((o, *grads), (ref, *ref_grads)))


# q.k over a head_dim that is not a power of two as two products (KernelPlan.head_tail): 48 = 32 + 16, and 40 = 32 + 8
# with the tail padded to 16; with V as wide as K and with a value_dim of its own
SPLIT = {
    "48_causal": (48, 48, "causal"),
    "40_window_sink_v16": (40, 16, "window_sink"),
    "48_documents_v32": (48, 32, "documents"),
    "40_alibi_dropout": (40, 40, "alibi_dropout"),
    "48_kv_outer_v16": (48, 16, "kv_outer"),
}


@pytest.mark.parametrize("name", list(SPLIT))
def test_q_k_in_two_products_is_exact_forward_and_backward(name, device, dtypes, target):
    """The kernels of a head_dim taken as two products (Q's, K's, dQ's and dK's tiles in two parts, the tail padded or
    not) against the float64 reference: O, the lse and every gradient within verify's budget, no NaN."""
    head_dim, value_dim, mask = SPLIT[name]
    shapes = verify.CPU_SHAPES[:2] if device == "cpu" else verify.CUDA_SHAPES
    for dtype in dtypes[:1] if device == "cpu" else dtypes:
        kern = attngen.compile(_spec(MASKS[mask], value_dim, dtype, head_dim), target)
        assert kern.plan.head_lead == 32 and kern.plan.head_tail == head_dim - 32 and "q_lead" in kern.source
        results = [verify.check_one(kern, shape, device, backward=mask != "kv_outer" or device == "cuda") for shape in shapes]
        assert all(r.ok and not r.nan for r in results), verify.format_table(f"{name} {dtype}", results)


def test_deepseek_s_192_is_two_products_of_128_and_64():
    """192 = 128 + 64: a Q or K tile of 192 columns, not 256, in the plan's registers and shared memory and in the
    source; the other widths keep one product."""
    p = plan(load_spec(_spec(MASKS["causal"], 128, "bf16", 192)), "h100")
    assert (p.head_lead, p.head_tail, p.head_tail_pad) == (128, 64, 64)
    assert "q.k in two products" in p.describe() and "d_qk = 192" in p.describe()
    source = attngen.compile(_spec(MASKS["causal"], 128, "bf16", 192), "h100").source
    assert "HEAD_LEAD = tl.constexpr(128)" in source and "tl.dot(q_tail, tl.trans(k_tail), tl.dot(q_lead" in source
    assert "dk_tail = tl.zeros([BLOCK_N, HEAD_TAIL_PAD]" in source and "dq_tail = tl.zeros([BLOCK_M, HEAD_TAIL_PAD]" in source
    for d in (32, 64, 112, 128, 200, 256):
        assert plan(load_spec(f"attention a {{ head_dim = {d} }}"), "h100").head_tail == 0
