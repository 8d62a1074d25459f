"""Learnable sinks (`sink = EXPR`, gpt-oss's attention): one more logit in each query row's softmax, with no value.
Checked against the float64 reference like every spec (O, the lse, every gradient, the sink's inputs' included); a
row that keeps no key gives O = 0 and lse = its sink, in the training kernels and the decode ones; the spec's errors
(context parallelism: tests/test_distributed.py)."""
import warnings
from pathlib import Path

import pytest
import torch

import attngen
from attngen.codegen.gluon import choose
from attngen.errors import InputError, PlanError, SpecError
from attngen.lang.check import load_spec
from attngen.lang.spec import Backend
from attngen.plan.planner import plan
from attngen.runtime.evaluate import sink_rows
from attngen.tools import bench, verify
from tests.test_decode import _check_reference, _lens, _paged, _tensors

ROOT = Path(__file__).parent.parent
# gpt-oss's layers, shortened: a sink per head, a window (the model's is 128 keys), grouped-query heads in the shapes
GPT_OSS = """attention gpt_oss {
    head_dim = 64
    dtype = DT
    input sinks: fp32[H]
    sink = sinks[h]
    mask = q_idx >= kv_idx and kv_idx > q_idx - 16
}"""
# a sink that reads q_idx, beside a bias the score reads: the first three rows keep no key
ROWS = """attention rows {
    head_dim = 32
    dtype = DT
    input sinks: fp32[H]
    input bias: fp32[H]
    sink = sinks[h] - 0.02 * q_idx
    score = score + bias[h]
    mask = kv_idx <= q_idx - 3
}"""


@pytest.mark.parametrize("text", [GPT_OSS, pytest.param(ROWS, marks=pytest.mark.slow)], ids=["gpt_oss", "rows_without_keys"])
def test_a_sink_is_exact_forward_and_backward(text, device, dtypes, target):
    """The project's rule (attngen/tools/verify.py) on every shape of the matrix: O, the lse, dQ, dK, dV and the
    gradient of the sinks (and of the score's bias), within the error budget, no NaN."""
    for dtype in dtypes:
        kern = attngen.compile(text.replace("DT", dtype), target)
        results = [verify.check_one(kern, shape, device) for shape in (verify.CPU_SHAPES if device == "cpu" else verify.CUDA_SHAPES)]
        assert all(r.ok and not r.nan for r in results), verify.format_table(f"{kern.spec.name} {dtype}", results)
        assert "dsinks" in results[-1].errors


def test_a_row_that_keeps_no_key_gives_zero_and_its_sink(target, device):
    kern = attngen.compile(ROWS.replace("DT", "fp32"), target)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 20, 32, generator=gen).to(device) for _ in range(3))
    inputs = {"sinks": torch.randn(4, generator=gen).to(device), "bias": torch.randn(4, generator=gen).to(device)}
    o, lse = kern(q, k, v, return_lse=True, **inputs)
    assert not o.isnan().any() and not lse.isnan().any()
    assert torch.equal(o[:, :, :3], torch.zeros_like(o[:, :, :3]))  # rows 0-2: kv_idx <= q_idx - 3 keeps nothing
    sink = inputs["sinks"][None, :, None] - 0.02 * torch.arange(3, device=device)
    torch.testing.assert_close(lse[:, :, :3], sink.expand(2, 4, 3), rtol=1e-6, atol=1e-6)
    ref, ref_lse = attngen.reference(kern.spec, q.double(), k.double(), v.double(), return_lse=True, **inputs)
    assert (o.double() - ref).abs().max() < 1e-4 and (lse.double() - ref_lse).abs().max() < 1e-4


def test_the_kv_outer_forward_takes_the_sink(target, device):
    """loop_order = kv_outer (FlashAttention-1's order) joins the sink to each row when it normalizes: the same O and
    lse as the q_outer forward (rows that keep no key included), and verify's rule with every gradient."""
    text = ROWS.replace("DT", "fp32").replace("mask = kv_idx <= q_idx - 3", "mask = kv_idx <= q_idx - 3\n    loop_order = kv_outer")
    kern = attngen.compile(text, target)
    q_outer = attngen.compile(ROWS.replace("DT", "fp32"), target)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 40, 32, generator=gen).to(device) for _ in range(3))
    inputs = {"sinks": torch.randn(4, generator=gen).to(device), "bias": torch.randn(4, generator=gen).to(device)}
    o, lse = kern(q, k, v, return_lse=True, **inputs)
    want, want_lse = q_outer(q, k, v, return_lse=True, **inputs)
    assert not o.isnan().any() and (o - want).abs().max() < 1e-5 and (lse - want_lse).abs().max() < 1e-5
    result = verify.check_one(kern, verify.CPU_SHAPES[2], device)
    assert result.ok and not result.nan and "dsinks" in result.errors, verify.format_table(kern.spec.name, [result])


def test_a_call_with_no_key_gives_zero_and_the_sink(target, device):
    """kv_len = 0: every row keeps only its sink, so O = 0 and the lse is the sink, and a gradient reaching the lse
    reaches the sinks (d lse / d sink = 1), as the reference says; none reaches q."""
    kern = attngen.compile(ROWS.replace("DT", "fp32"), target)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 4, 5, 32, generator=gen).to(device).requires_grad_()
    k, v = (torch.randn(2, 2, 0, 32, generator=gen).to(device) for _ in range(2))
    sinks, bias = (torch.randn(4, generator=gen).to(device) for _ in range(2))
    sinks.requires_grad_()
    o, lse = kern(q, k, v, return_lse=True, sinks=sinks, bias=bias)
    weights = torch.randn(lse.shape, generator=gen).to(device)
    dq, dsinks = torch.autograd.grad((lse * weights).sum() + o.sum(), (q, sinks))
    wide = sinks.detach().double().requires_grad_()
    ref, ref_lse = attngen.reference(kern.spec, q.double(), k.double(), v.double(), return_lse=True, sinks=wide, bias=bias.double())
    (ref_dsinks,) = torch.autograd.grad((ref_lse * weights.double()).sum(), wide)
    assert not lse.isnan().any() and not dsinks.isnan().any()
    assert torch.equal(o, torch.zeros_like(o)) and torch.equal(ref, torch.zeros_like(ref)) and torch.equal(dq, torch.zeros_like(dq))
    assert (lse.double() - ref_lse).abs().max() < 1e-6 and (dsinks.double() - ref_dsinks).abs().max() < 1e-5


def test_packed_sequences_take_the_sink(target, device):
    """cu_seqlens: each sequence's rows start their softmax at the sink (q_idx counts inside the sequence); a
    sequence with no key gives O = 0 and lse = its sink; the gradients of q, k and v through the sink's share."""
    kern = attngen.compile(ROWS.replace("DT", "fp32").replace("mask = kv_idx <= q_idx - 3", "mask = kv_idx <= q_idx"), target)
    gen = torch.Generator().manual_seed(1)
    q_lens, kv_lens = [5, 17, 9], [6, 0, 12]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device) for n in (q_lens, kv_lens))
    q = torch.randn(sum(q_lens), 4, 32, generator=gen).to(device).requires_grad_()
    k, v = (torch.randn(sum(kv_lens), 2, 32, generator=gen).to(device).requires_grad_() for _ in range(2))
    inputs = {"sinks": torch.randn(4, generator=gen).to(device), "bias": torch.randn(4, generator=gen).to(device)}
    o, lse = kern(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True, **inputs)
    do = torch.randn(o.shape, generator=gen).to(device)
    grads = torch.autograd.grad(o, (q, k, v), do)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v)]
    ref, ref_lse = attngen.reference(kern.spec, *wide, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True, **inputs)
    ref_grads = torch.autograd.grad(ref, wide, do.double())
    assert not o.isnan().any() and all(not g.isnan().any() for g in grads)
    assert (o.double() - ref).abs().max() < 1e-4 and (lse.double() - ref_lse).abs().max() < 1e-4
    assert all((g.double() - r).abs().max() < 1e-3 for g, r in zip(grads, ref_grads))
    torch.testing.assert_close(lse[:, 5:22], inputs["sinks"][:, None] - 0.02 * torch.arange(17, device=device), rtol=1e-6, atol=1e-6)


# sinks whose gradients packed sequences give: one per head (gpt-oss), and one per sequence and head that reads q_idx
PACKED_SINKS = {
    "per_head": ("input sinks: fp32[H]\n    sink = sinks[h]", (4,)),
    "per_sequence_row": ("input sinks: fp32[B, H]\n    sink = sinks[b, h] - 0.02 * q_idx", (3, 4)),
}


@pytest.mark.parametrize("name", list(PACKED_SINKS))
def test_packed_sequences_give_the_sinks_gradient(name, target, device):
    """cu_seqlens with the sinks trained: each row's gradient of its sink (the pre-pass finds each packed row's
    sequence in cu_seqlens), summed into d sinks by sequence, head and row as the float64 reference's autograd does;
    a sequence with no key (its rows: O = 0, lse = the sink) and one longer than the others included."""
    decl, shape = PACKED_SINKS[name]
    text = f"attention p {{\n    head_dim = 32\n    dtype = fp32\n    {decl}\n    mask = q_idx >= kv_idx\n}}"
    kern = attngen.compile(text, target)
    gen = torch.Generator().manual_seed(4)
    q_lens, kv_lens = [5, 70, 9], [6, 0, 80]
    cu_q, cu_k = (torch.tensor([0, *torch.tensor(n).cumsum(0).tolist()], dtype=torch.int32, device=device) for n in (q_lens, kv_lens))
    q = torch.randn(sum(q_lens), 4, 32, generator=gen).to(device).requires_grad_()
    k, v = (torch.randn(sum(kv_lens), 2, 32, generator=gen).to(device).requires_grad_() for _ in range(2))
    sinks = torch.randn(shape, generator=gen).to(device).requires_grad_()
    do, dlse = torch.randn(q.shape, generator=gen).to(device), torch.randn(4, q.shape[0], generator=gen).to(device)
    wide = [t.detach().double().requires_grad_() for t in (q, k, v, sinks)]
    ref, ref_lse = attngen.reference(kern.spec, *wide[:3], cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True, sinks=wide[3])
    ref_grads = torch.autograd.grad((ref, ref_lse), wide, (do.double(), dlse.double()))
    # checked each call; with max_seqlen given, the second call is the kept one (Kernel._packed_calls)
    for longest in ({}, {"max_seqlen_q": 70, "max_seqlen_k": 80}, {"max_seqlen_q": 70, "max_seqlen_k": 80}):
        o, lse = kern(q, k, v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, return_lse=True, sinks=sinks, **longest)
        grads = torch.autograd.grad((o, lse), (q, k, v, sinks), (do, dlse))
        assert all(not g.isnan().any() for g in grads) and grads[3].shape == sinks.shape
        for g, r in zip(grads, ref_grads):
            assert (g.double() - r).abs().max() < 1e-3 * max(1.0, r.abs().max().item()), (g, r)
    assert len(kern._packed_calls) == 1


@pytest.mark.parametrize("setting, message", [
    ("input sinks: fp32[H]\n    input bias: fp32[H]\n    sink = sinks[h]\n    score = score + bias[h]", "gradients of inputs the score reads"),
    ("input sinks: fp32[H]\n    sink = sinks[h] - 0.001 * q_len", "a sink that reads q_len or kv_len"),
])
def test_packed_sequences_refuse_what_their_sink_gradients_cannot_give(setting, message, target):
    kern = attngen.compile(f"attention p {{\n    head_dim = 32\n    dtype = fp32\n    {setting}\n}}", target)
    cu = torch.tensor([0, 3, 8], dtype=torch.int32)
    q, k, v = (torch.randn(8, 2, 32) for _ in range(3))
    inputs = {name: torch.randn(2).requires_grad_() for name in ("sinks", "bias") if f"input {name}" in setting}
    with pytest.raises(InputError, match=message):
        kern(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, **inputs)


def test_a_short_plain_call_decodes_with_its_sink(target, device):
    """Few queries and nothing to differentiate take the decode kernels: the sink joins each row there too, as in
    the forward a gradient-enabled call runs."""
    kern = attngen.compile(GPT_OSS.replace("DT", "fp32"), target)
    assert hasattr(kern.module, "attention_decode")
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(2, 8, 1, 64, generator=gen).to(device)
    k, v = (torch.randn(2, 2, 300, 64, generator=gen).to(device) for _ in range(2))
    sinks = torch.randn(8, generator=gen).to(device)
    with torch.no_grad():
        o, lse = kern(q, k, v, sinks=sinks, return_lse=True)
    trained, trained_lse = kern(q.requires_grad_(), k, v, sinks=sinks, return_lse=True)  # the forward kernel
    ref, ref_lse = attngen.reference(kern.spec, q.double(), k.double(), v.double(), sinks=sinks, return_lse=True)
    assert not o.isnan().any() and (o.double() - ref).abs().max() < 1e-4 and (lse.double() - ref_lse).abs().max() < 1e-4
    assert (o - trained).abs().max() < 1e-5 and (lse - trained_lse).abs().max() < 1e-5


# a sink that reads q_idx (each new token's index) over a window of the cache's last keys
DECODE = """attention decode_sink {
    head_dim = 64
    dtype = fp32
    input sinks: fp32[H]
    sink = sinks[h] - 0.01 * q_idx
    mask = q_idx + kv_len - q_len >= kv_idx and q_idx + kv_len - q_len - kv_idx < 48
    LAYOUT
}"""


@pytest.mark.parametrize("layout", ["contiguous", "paged"])
def test_decoding_over_a_cache_takes_the_sink_once(layout, target, device):
    """kv_lens of 200, 77, 1 and 0 over a cache of NaN past each length (paged: shuffled pages): the sink joins
    each row once however many runs the keys are split into (split 0 starts from it), rows that keep no key
    give O = 0 and lse = their sink, against the float64 reference."""
    paged = layout == "paged"
    kern = attngen.compile(DECODE.replace("LAYOUT", "kv_layout = paged\n    page_size = 16" if paged else ""), target)
    lens = [200, 77, 1, 0]
    q, k, v = _tensors(kern.spec, device, lens, 2, hq=8, hkv=2, capacity=208)
    serving = {"kv_lens": _lens(lens, device)}
    if paged:
        k, v, serving["block_table"], _, _ = _paged(k, v, lens, 16, device, shared_prefix=False)
    sinks = torch.randn(8, generator=torch.Generator().manual_seed(4)).to(device)
    with torch.no_grad():
        o, lse = kern(q, k, v, return_lse=True, sinks=sinks, **serving)
        for splits in (1, 3):
            o_s, lse_s = kern.module.attention_decode(q, k, v, sinks, **serving, block_r=16, num_splits=splits)
            assert (o_s - o).abs().max() < 1e-5 and (lse_s * 0.6931471805599453 - lse).abs().max() < 1e-5
    _check_reference(kern, o, lse, q, k, v, sinks=sinks, **serving)
    assert torch.equal(o[3], torch.zeros_like(o[3]))  # sequence 3 keeps no key: its sink alone
    want = sinks[:, None] - 0.01 * torch.arange(2, device=device)
    torch.testing.assert_close(lse[3], want, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("setting, at, message", [
    ("sink = kv_idx", "kv_idx", "'kv_idx' cannot be used in sink"),
    ("sink = score * 2.0", "score", "'score' cannot be used in sink"),
    ("sink = q_idx > 3", "q_idx", "sink must be a number expression of b, h, kv_len, q_idx, q_len and the declared inputs, got bool"),
    ("dtype = fp8 sink = 1.0", "sink", "a sink cannot go with dtype = fp8 yet (the FP8 kernels have none)"),
])
def test_what_a_sink_may_not_be(setting, at, message):
    """A SpecError at the offending text (file:line:col), before anything is planned."""
    text = f"attention s {{ head_dim = 32 mask = true {setting} }}"
    with pytest.raises(SpecError) as info:
        load_spec(text, "s.attn")
    assert str(info.value).startswith(f"s.attn:1:{text.index(setting) + setting.index(at) + 1}: error: {message}"), str(info.value)


def test_the_gluon_generator_takes_a_sink_but_not_beside_a_separable_bias():
    """The Gluon forward starts each row's softmax from its sink as the Triton one does (its numerics: the GPU tests of
    tests/test_gluon.py, which take specs/sink_window.attn); a sink beside a score modification the Gluon kernels add
    as a separable bias (ALiBi) is left to the Triton generator, with the reason."""
    spec = load_spec(GPT_OSS.replace("DT", "bf16"))
    assert choose(spec, plan(spec, "h100"), Backend.GLUON).generator == "gluon"
    # auto, from gpt-oss's layers measured both ways: the window's stay with the Triton generator, causal ones take
    # the Gluon generator from 8192 keys
    auto = choose(spec, plan(spec, "h100"))
    assert auto.generator == "triton" and "a sink with a mask other than causal's at head_dim 64" in auto.reason
    causal = load_spec(GPT_OSS.replace("DT", "bf16").replace(" and kv_idx > q_idx - 16", ""))
    auto = choose(causal, plan(causal, "h100"))
    assert (auto.forward_at(4096), auto.forward_at(8192), auto.backward_at(8192)) == ("triton", "gluon", "gluon")
    alibi = load_spec(GPT_OSS.replace("DT", "bf16").replace("    sink = sinks[h]", "    sink = sinks[h]\n    score = score - 0.1 * (q_idx - kv_idx)"))
    with pytest.raises(PlanError, match="a sink with a score modification it adds as a separable bias"):
        choose(alibi, plan(alibi, "h100"), Backend.GLUON)


@pytest.mark.parametrize("dlse", [False, True])
def test_the_pre_pass_alone_gives_each_row_s_sink_gradient(dlse, target, device):
    """attention_sink_grads, the Triton module's pre-pass alone (the Gluon generator's backward leaves the sink's
    gradient to it): each row's d loss / d sink = -p_sink * (rowsum(dO * O) - dlse * log2(e)), p_sink = 2^(sink * log2(e)
    - lse), against that formula in float64, for a sink that reads q_idx and kv_len; a row whose lse is -inf gets 0."""
    from attngen.runtime.loader import interpreted_if_cpu

    text = ("attention s { head_dim = 32 dtype = fp32 input sinks: fp32[H]\n sink = sinks[h] - 0.01 * q_idx + 0.001 * kv_len\n"
            " mask = q_idx >= kv_idx }")
    kern = attngen.compile(text, target)
    gen = torch.Generator().manual_seed(5)
    B, H, N, NK = 2, 3, 37, 45
    o, do = (torch.randn(B, H, N, 32, generator=gen).to(device) for _ in range(2))
    lse = (torch.randn(B, H, N, generator=gen) + 2.0).to(device)
    lse[1, 2, 4] = float("-inf")
    grad_lse = torch.randn(B, H, N, generator=gen).to(device) if dlse else None
    sinks = torch.randn(H, generator=gen).to(device)
    with interpreted_if_cpu(o.device):
        got = kern.module.attention_sink_grads(o, do, lse, grad_lse, NK, sinks)
    sink = sinks.double()[None, :, None] - 0.01 * torch.arange(N, device=device).double() + 0.001 * NK
    p_sink = torch.where(lse == float("-inf"), 0.0, torch.exp2(sink * 1.4426950408889634 - lse.double()))
    delta = (o.double() * do.double()).sum(-1) - (grad_lse.double() * 1.4426950408889634 if dlse else 0.0)
    want = -p_sink * delta
    assert got.shape == (B, H, N) and not got.isnan().any() and got[1, 2, 4] == 0
    assert (got.double() - want).abs().max() < 1e-4 * max(1.0, want.abs().max().item())


def test_a_plain_call_like_one_made_before_replays_its_launches(target, device):
    """The Triton module keeps a plain call's launches by its signature (`known`) and replays them for later calls
    of that signature: forward and backward (the pre-pass writing the rows' sink gradients, dQ's kernel and dK/dV's)
    exact on other values against the float64 reference, into new outputs each call. On the GPU the same through
    the kernel's calls (Kernel._plain_calls), the sinks' gradient reduced from the rows', checked by the project's
    rule on three calls of one signature."""
    from attngen.runtime.loader import interpreted_if_cpu

    kern = attngen.compile(GPT_OSS.replace("DT", "fp32"), target, backend="triton")
    m, key, outputs = kern.module, ("a plain call's signature",), []
    for seed in range(2):
        gen = torch.Generator().manual_seed(seed)
        q, do = (torch.randn(2, 4, 40, 64, generator=gen).to(device) for _ in range(2))
        k, v = (torch.randn(2, 2, 40, 64, generator=gen).to(device) for _ in range(2))
        sinks = torch.randn(4, generator=gen).to(device)
        with interpreted_if_cpu(q.device):
            o, lse = m.attention_forward(q, k, v, sinks, known=key)
            rows = torch.empty(lse.shape, device=device)
            dq, dk, dv = m.attention_backward(q, k, v, o, lse, do, None, sinks, sink_grads=rows, known=key)
        wide = [t.double().requires_grad_() for t in (q, k, v, sinks)]
        ref, ref_lse = attngen.reference(kern.spec, *wide[:3], return_lse=True, dtype=torch.float64, sinks=wide[3])
        want = (ref, ref_lse, *torch.autograd.grad(ref, wide, do.double()))
        got = (o, lse * 0.6931471805599453, dq, dk, dv, rows.sum((0, 2)))
        for name, g, w in zip(("O", "lse", "dQ", "dK", "dV", "dsinks"), got, want):
            assert not g.isnan().any() and (g.double() - w).abs().max() <= 1e-4 * max(1.0, w.abs().max().item()), name
        assert not any(o is t for t in outputs)
        outputs += [o, dq]
    assert m.forward_replay(key) is not None and len(m._BACKWARD_CALLS) == 1 and all(m._BACKWARD_CALLS.values())
    if device == "cuda":
        results = [verify.check_one(kern, (2, 4, 2, 200, 200), device, seed) for seed in range(3)]
        assert all(r.ok and not r.nan for r in results), verify.format_table(kern.spec.name, results)
        (plain,) = kern._plain_calls.values()
        assert plain.backward is not None and len(m._FORWARD_CALLS) == 2 and len(m._BACKWARD_CALLS) == 2


def test_flex_with_the_sink_applied_outside_matches_the_reference():
    """attngen bench's FlexAttention peer for a spec with a sink: Flex's output and row log-sum-exp, the sink
    joined afterwards (eager FlexAttention runs on CPU)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    spec = load_spec(ROWS.replace("DT", "fp32"))
    gen = torch.Generator().manual_seed(3)
    B, H, N = 2, 4, 64
    q, k, v = (torch.randn(B, H, N, 32, generator=gen) for _ in range(3))
    inputs = {"sinks": torch.randn(H, generator=gen), "bias": torch.randn(H, generator=gen)}
    mask_mod, score_mod = bench.flex_mods(spec, inputs, N, N)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
        out, lse = flex_attention(q, k, v, score_mod=score_mod, block_mask=create_block_mask(mask_mod, None, None, N, N, device="cpu"),
                                  return_lse=True)
    out = bench.with_sink(out, lse, sink_rows(spec, inputs, B, H, N, N, "cpu", torch.float32))
    ref = attngen.reference(spec, q.double(), k.double(), v.double(), **inputs)
    assert not out.isnan().any() and (out.double() - ref).abs().max() < 1e-4
