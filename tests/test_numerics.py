"""Numerics: generated kernels against the float64 reference, forward and backward, with the error-budget rule
of attngen.verify (2x / 3x the same-precision naive error plus a float32-ulp floor; never NaN).

CPU runs go through Triton's interpreter in fp32 and fp16; `pytest --device cuda` adds bf16 and larger shapes.
"""
import dataclasses
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch

import attngen
from attngen.tools import verify
from attngen.lang.check import load_spec
from attngen.lang.spec import DType, LoopOrder

SPECS = sorted((Path(__file__).parent.parent / "specs").glob("*.attn"))

# Variants that need no file of their own: edge head dims, the other loop order with masks that empty rows,
# a window short enough to matter at test lengths, and masks that keep nothing.
VARIANTS = {
    "dense_d16": "attention v { head_dim = 16 }",
    "causal_d256": "attention v { head_dim = 256 mask = q_idx >= kv_idx }",
    "window_24": "attention v { head_dim = 32 mask = q_idx >= kv_idx and q_idx - kv_idx < 24 }",
    "kv_outer_padding": "attention v { head_dim = 48 loop_order = kv_outer input lens: int32[B] mask = kv_idx < lens[b] }",
    "kv_outer_softcap_bottom_right": "attention v { head_dim = 64 loop_order = kv_outer mask = q_idx + kv_len - q_len >= kv_idx score = 20.0 * tanh(score / 20.0) }",
    "kv_outer_document": "attention v { head_dim = 32 loop_order = kv_outer input doc: int32[B, N] mask = doc[b, q_idx] == doc[b, kv_idx] }",
    "nothing_kept": "attention v { head_dim = 32 mask = q_idx < 0 }",
    "score_only_where": "attention v { head_dim = 32 score = where(q_idx >= kv_idx, score, score - 4.0) }",
    "head_bias_int_input": "attention v { head_dim = 32 input bias: int32[H] score = score + bias[h] * 0.25 mask = q_idx != kv_idx }",
    "bool_input": "attention v { head_dim = 32 input allowed: bool[B, N] mask = allowed[b, kv_idx] or q_idx == kv_idx }",
    # small tiles: many empty, full and partial tiles at test lengths (tile skipping and unmasked full tiles)
    "causal_tiles_16": "attention v { head_dim = 32 mask = q_idx >= kv_idx block_m = 16 block_n = 16 }",
    "window_tiles_16": "attention v { head_dim = 32 mask = q_idx >= kv_idx and q_idx - kv_idx < 40 block_m = 16 block_n = 16 }",
    "chunked_tiles_16": "attention v { head_dim = 32 mask = q_idx // 32 == kv_idx // 32 block_m = 16 block_n = 16 }",
    "prefix_tiles_16": "attention v { head_dim = 32 input prefix: int32[B] mask = q_idx >= kv_idx or kv_idx < prefix[b] block_m = 16 block_n = 16 }",
    # masks that read inputs: tiles skipped from the inputs' per-chunk bounds (the pre-pass)
    "document_tiles_16": "attention v { head_dim = 32 input doc: int32[B, N] mask = doc[b, q_idx] == doc[b, kv_idx] and q_idx >= kv_idx block_m = 16 block_n = 16 }",
    "document_d128": "attention v { head_dim = 128 input doc: int32[B, N] mask = doc[b, q_idx] == doc[b, kv_idx] and q_idx >= kv_idx }",  # 64x64 forward tiles (plan)
    "padding_tiles_16": "attention v { head_dim = 32 input lens: int32[B] mask = kv_idx < lens[b] block_m = 16 block_n = 32 }",
    "bool_tiles_16": "attention v { head_dim = 32 input allowed: bool[B, N] mask = allowed[b, kv_idx] and q_idx >= kv_idx block_m = 16 block_n = 16 }",
    # float inputs read in the score get gradients (checked like dq/dk/dv): a (B, H, Nq, Nk) term buffer for
    # direct reads, per-row sums for reads without q_idx/kv_idx
    "bias_grad": "attention v { head_dim = 32 input bias: fp32[H, N, N] mask = q_idx >= kv_idx and q_idx - kv_idx < 40 score = score + bias[h, q_idx, kv_idx] block_m = 16 block_n = 16 }",
    "key_bias_softcap_grad": "attention v { head_dim = 32 input kb: fp32[B, N] score = 10.0 * tanh((score + kb[b, kv_idx]) / 10.0) }",
    # reads at computed indices: each pair's term summed into the element it read (one element gets many pairs)
    "relative_table_grad_kv_outer": "attention v { head_dim = 32 loop_order = kv_outer input rel: fp32[H, N] mask = q_idx - kv_idx < 30 score = score + rel[h, q_idx - kv_idx + 20] * 0.5 }",
    "bucketed_table_grad": "attention v { head_dim = 32 input rel: fp32[3, 9] input bucket: int32[N] score = score + rel[h % 3, bucket[abs(q_idx - kv_idx)] % 9] block_m = 16 block_n = 16 }",
    "head_temperature_grad": "attention v { head_dim = 32 input temp: fp32[H] input tab: fp32[3, N] mask = q_idx >= kv_idx score = score * temp[h] + tab[1, kv_idx] - tab[2, 5] }",
    # dropout: the kernels' pattern (Philox of seed, b, h, q_idx, 8 keys per call; 16-bit values) against the reference using attngen.dropout_mask
    "dropout_causal_tiles_16": "attention v { head_dim = 32 dropout = 0.25 mask = q_idx >= kv_idx block_m = 16 block_n = 16 }",
    "dropout_kv_outer_padding": "attention v { head_dim = 32 dropout = 0.1 loop_order = kv_outer input lens: int32[B] mask = kv_idx < lens[b] }",
    "dropout_document_bias_grad": "attention v { head_dim = 32 dropout = 0.2 input doc: int32[B, N] input slopes: fp32[H] mask = doc[b, q_idx] == doc[b, kv_idx] score = score - slopes[h] * abs(q_idx - kv_idx) block_m = 16 block_n = 16 }",
    # runtime block sparsity: kernels walk per-row lists of kept blocks (random blocks, one empty block row)
    "runtime_blocks_16": "attention v { head_dim = 32 sparsity = runtime sparse_block = 16 }",
    "runtime_blocks_32_tiles_16_window": "attention v { head_dim = 32 sparsity = runtime sparse_block = 32 block_m = 16 block_n = 16 mask = q_idx - kv_idx < 50 and kv_idx - q_idx < 50 }",
    "runtime_blocks_kv_outer_document": "attention v { head_dim = 32 loop_order = kv_outer sparsity = runtime sparse_block = 16 input doc: int32[B, N] mask = doc[b, q_idx] == doc[b, kv_idx] }",
    "runtime_blocks_dropout_bias_grad": "attention v { head_dim = 32 dropout = 0.2 sparsity = runtime sparse_block = 32 input kb: fp32[B, N] score = score + kb[b, kv_idx] }",
    # inputs named like the launchers' own variables (they are passed as in_NAME, so nothing is shadowed)
    "inputs_named_like_launcher_variables": "attention v { head_dim = 32 input batch: int32[B] input grid: fp32[H] mask = kv_idx < batch[b] score = score + grid[h] }",
    # a block pattern walked as lists of kept blocks (KernelPlan.block_lists), made per shape: holes between kept
    # blocks, blocks of 16 (thirteen along 203 keys), a causal mask inside them, a pattern that differs by head
    "butterfly_per_head_blocks_16": "attention v { head_dim = 32 block_m = 16 block_n = 16 mask = q_idx >= kv_idx "
                                    "sparsity = ((q_blk ^ kv_blk) & ((q_blk ^ kv_blk) - 1)) == 0 or (h == 1 and kv_blk == 0) sparse_block = 16 }",
    "softcap_bottom_right_tiles_16": "attention v { head_dim = 32 mask = q_idx + kv_len - q_len >= kv_idx score = 10.0 * tanh(score / 10.0) block_m = 16 block_n = 32 }",
}


def _compile(spec, dtype, target):
    return attngen.compile(dataclasses.replace(spec, dtype=DType(dtype)), target)


def _check(kernel, device, shapes=None):
    """verify's rule on the shape matrix. On the CPU a 16-bit spec takes the three smaller shapes (partial tiles,
    grouped heads, rows of one key), the two larger ones run in float32 only: what they add (many tiles, long rows)
    does not depend on the element type, and they are most of the interpreter's time. The GPU runs every shape in
    every element type."""
    if shapes is None and device == "cuda":
        shapes = verify.CUDA_SHAPES
    elif shapes is None:
        shapes = verify.CPU_SHAPES if kernel.spec.dtype.value == "fp32" else verify.CPU_SHAPES[:3]
    results = [verify.check_one(kernel, shape, device, seed=i) for i, shape in enumerate(shapes)]
    assert all(r.ok for r in results), "\n" + verify.format_table(kernel.spec.name, results)


# The longest interpreter runs (20-60 s each on 2 cores) are marked slow: `-m "not slow"` keeps the others, which
# still cover every feature once (README, Set-up); CI runs all.
SLOW_SPECS = {'causal_dropout', 'causal_softcap', 'causal', 'sliding_window', 'document', 'odd_head_dim', 'dense', 'dilated'}
SLOW_VARIANTS = {'dropout_document_bias_grad', 'dropout_causal_tiles_16', 'runtime_blocks_kv_outer_document', 'bucketed_table_grad', 'runtime_blocks_dropout_bias_grad', 'runtime_blocks_32_tiles_16_window', 'bool_tiles_16', 'document_tiles_16', 'runtime_blocks_16', 'bias_grad', 'softcap_bottom_right_tiles_16', 'chunked_tiles_16', 'prefix_tiles_16', 'window_tiles_16', 'causal_tiles_16', 'dropout_kv_outer_padding', 'causal_d256', 'padding_tiles_16', 'document_d128', 'bool_input'}


def _slow_if(names):
    return lambda x: pytest.param(x, marks=pytest.mark.slow) if (getattr(x, "stem", x) in names) else x


@pytest.mark.parametrize("path", [_slow_if(SLOW_SPECS)(p) for p in SPECS], ids=lambda p: p.stem)
def test_shipped_spec(path, device, dtypes, target):
    spec = load_spec(path.read_text(), str(path))
    for dtype in dtypes:
        _check(_compile(spec, dtype, target), device)


@pytest.mark.parametrize("name", [_slow_if(SLOW_VARIANTS)(n) for n in sorted(VARIANTS)])
def test_variant(name, device, dtypes, target):
    spec = load_spec(VARIANTS[name], name)
    for dtype in dtypes:
        _check(_compile(spec, dtype, target), device)


@pytest.mark.parametrize("loop_order", list(LoopOrder))
def test_both_loop_orders_agree(loop_order, device, target):
    spec = dataclasses.replace(load_spec((Path(__file__).parent.parent / "specs" / "causal_softcap.attn").read_text()), loop_order=loop_order)
    kern = _compile(spec, "fp32", target)
    _check(kern, device, shapes=((2, 4, 2, 70, 90),))


def _rand(*shape, device, dtype, gen):
    return torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)


def test_non_contiguous_inputs_and_grad(device, target):
    """q/k/v stored as (B, N, H, D) and viewed as (B, H, N, D); dO non-contiguous too."""
    kern = _compile(load_spec("attention t { head_dim = 40 mask = q_idx >= kv_idx }"), "fp32", target)
    gen = torch.Generator().manual_seed(3)
    B, Hq, Hkv, Nq, Nk = 2, 4, 2, 37, 53
    q = _rand(B, Nq, Hq, 40, device=device, dtype=torch.float32, gen=gen).transpose(1, 2).requires_grad_()
    kv = _rand(B, Nk, 2, Hkv, 40, device=device, dtype=torch.float32, gen=gen)
    k = kv[:, :, 0].transpose(1, 2).detach().requires_grad_()
    v = kv[:, :, 1].transpose(1, 2).detach().requires_grad_()
    assert not (q.is_contiguous() or k.is_contiguous() or v.is_contiguous())
    do = _rand(B, Nq, Hq, 80, device=device, dtype=torch.float32, gen=gen)[..., ::2].transpose(1, 2)
    assert not do.is_contiguous()
    out = kern(q, k, v)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref = attngen.reference(kern.spec, *(t.double() for t in (q, k, v)), dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
    assert torch.allclose(out.double(), ref, atol=2e-5)
    for g, rg in zip(grads, ref_grads):
        assert torch.allclose(g.double(), rg.double(), atol=5e-5)



@pytest.mark.parametrize("contiguous", ["k", "v"])
def test_k_and_v_in_different_layouts(contiguous, device, target):
    """k contiguous and v a (B, N, H, D) memory seen through transpose(1, 2), or the other way round, as models make
    them where rotary embeddings copy k and v stays the projection's view: dK and dV each laid out as its input came,
    each written through its own strides."""
    kern = _compile(load_spec("attention t { head_dim = 32 mask = q_idx >= kv_idx }"), "fp32", target)
    gen = torch.Generator().manual_seed(4)
    B, Hq, Hkv, N = 2, 4, 2, 37
    q = _rand(B, Hq, N, 32, device=device, dtype=torch.float32, gen=gen).requires_grad_()
    flat, viewed = (_rand(B, Hkv, N, 32, device=device, dtype=torch.float32, gen=gen),
                    _rand(B, N, Hkv, 32, device=device, dtype=torch.float32, gen=gen).transpose(1, 2))
    k, v = ((flat, viewed) if contiguous == "k" else (viewed, flat))
    k, v = k.detach().requires_grad_(), v.detach().requires_grad_()
    do = _rand(B, Hq, N, 32, device=device, dtype=torch.float32, gen=gen)
    grads = torch.autograd.grad(kern(q, k, v), (q, k, v), do)
    ref = attngen.reference(kern.spec, *(t.double() for t in (q, k, v)), dtype=torch.float64)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
    for g, rg, t in zip(grads, ref_grads, (q, k, v)):
        assert g.stride() == t.stride() and not g.isnan().any()
        assert torch.allclose(g.double(), rg.double(), atol=5e-5)


TMA_SPECS = {
    "causal_padded_head": "attention t { head_dim = 40 mask = q_idx >= kv_idx }",
    "document_gqa": "attention t { head_dim = 32 input doc: int32[B, N] mask = doc[b, q_idx] == doc[b, kv_idx] block_m = 16 block_n = 32 }",
    "dropout_softcap": "attention t { head_dim = 32 dropout = 0.2 score = 20.0 * tanh(score / 20.0) }",
}


@pytest.mark.parametrize("name", sorted(TMA_SPECS))
def test_tensor_descriptor_loads(name, device, target):
    """The kernels' tensor-descriptor path (KernelPlan.tma: Q, K, V, dO tiles through tl.make_tensor_descriptor;
    no plan turns it on today, it measured slower on the H100) against the float64 reference, on the shapes of
    `attngen check`, and with inputs it cannot read in place: a view starting 4 bytes into its storage and a dO
    with a stride along head_dim (the launchers copy those)."""
    from attngen import runtime
    from attngen.runtime.loader import load_module
    from attngen.plan.planner import plan as make_plan
    from attngen.codegen.triton import build_source

    spec = dataclasses.replace(load_spec(TMA_SPECS[name]), dtype=DType.FP32)
    kplan = dataclasses.replace(make_plan(spec, target), tma=True)
    key, source = build_source(kplan)
    assert "tl.make_tensor_descriptor" in source and "_tma_ready" in source
    module = load_module(spec.name, key, source)
    kern = runtime.Kernel(spec, kplan, source, Path(module.__file__), module)
    _check(kern, device, shapes=((1, 4, 2, 45, 70), (2, 2, 2, 33, 33)))

    gen = torch.Generator().manual_seed(11)
    B, H, N, d = 1, 2, 50, spec.head_dim
    wide = _rand(B, H, N, d + 4, device=device, dtype=torch.float32, gen=gen)
    q = wide[..., 1:d + 1].detach().requires_grad_()  # starts 4 bytes in: not 16-byte aligned
    k, v = (_rand(B, H, N, d, device=device, dtype=torch.float32, gen=gen).requires_grad_() for _ in range(2))
    do = _rand(B, H, N, 2 * d, device=device, dtype=torch.float32, gen=gen)[..., ::2]
    inputs = {"doc": (torch.arange(N, device=device) // 20).view(1, N).expand(B, N).contiguous().int()} if "doc" in name else {}
    drop = {"dropout_p": 0.2, "seed": 5} if spec.dropout else {}
    out = kern(q, k, v, **drop, **inputs)
    grads = torch.autograd.grad(out, (q, k, v), do)
    ref = attngen.reference(kern.spec, *(t.double() for t in (q, k, v)), dtype=torch.float64, **drop, **inputs)
    ref_grads = torch.autograd.grad(ref, (q, k, v), do.double())
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        assert not torch.isnan(got).any()
        assert (got.double() - want).abs().max().item() < 1e-4


def test_backward_waits_for_its_dq_stream(device, target):
    """On CUDA the dQ kernel runs on a second stream, alongside dK/dV; the launcher makes the caller's stream wait
    for it. The shape makes dQ far slower than dK/dV (16 queries and 65536 keys: 16 dQ programs of 4096 key tiles
    each, against thousands of one-tile dK/dV programs), so a copy of dQ queued on the caller's stream right after
    the call would catch it half-written if that wait were missing."""
    if device != "cuda":
        pytest.skip("streams exist on CUDA only; on the CPU the kernels run one after another")
    kern = _compile(load_spec((Path(__file__).parent.parent / "specs" / "dense.attn").read_text()), "bf16", target)
    gen = torch.Generator().manual_seed(4)
    q, do = (_rand(1, 16, 16, 128, device=device, dtype=torch.bfloat16, gen=gen) for _ in range(2))
    k, v = (_rand(1, 16, 65536, 128, device=device, dtype=torch.bfloat16, gen=gen) for _ in range(2))
    o, lse = kern.module.attention_forward(q, k, v)
    want = kern.module.attention_backward(q, k, v, o, lse, do, None)
    torch.cuda.synchronize()
    slow = {**kern.module.TILES, "dq": {"BLOCK_M": 16, "BLOCK_N": 16, "num_warps": 1, "num_stages": 1}}
    for tiles in (kern.module.TILES, slow):
        dq, dk, dv = kern.module.attention_backward(q, k, v, o, lse, do, None, tiles=tiles)
        early = dq.clone()  # on the caller's stream, at once
        torch.cuda.synchronize()
        assert not torch.isnan(dq).any()
        assert torch.equal(early, dq)
        assert torch.equal(dk, want[1]) and torch.equal(dv, want[2])
        assert (dq.float() - want[0].float()).abs().max().item() < 1e-2 * want[0].float().abs().max().item()
    q, k, v = (t.double().requires_grad_() for t in (q, k, v))  # and the float64 reference
    ref_dq, ref_dk = torch.autograd.grad(attngen.reference(kern.spec, q, k, v, dtype=torch.float64), (q, k), do.double())
    for got, ref in ((want[0], ref_dq), (want[1], ref_dk)):
        assert (got.double() - ref).abs().max().item() < 2e-2 * ref.abs().max().item()


def test_fully_masked_rows_are_zero_with_minus_inf_lse(device, target):
    """A row that keeps no key: O = 0, lse = -inf, zero gradients, no NaN; and no RuntimeWarning from the
    interpreter's numpy (log2(0) = -inf is intended there; `attngen check` used to print it, and kv_outer's
    padding lanes once computed 0/0)."""
    spec = load_spec((Path(__file__).parent.parent / "specs" / "key_padding.attn").read_text())
    for loop_order in LoopOrder:
        kern = _compile(dataclasses.replace(spec, loop_order=loop_order), "fp32", target)
        gen = torch.Generator().manual_seed(1)
        q, k, v = (_rand(3, 2, 33, 64, device=device, dtype=torch.float32, gen=gen).requires_grad_() for _ in range(3))
        lens = torch.tensor([0, 5, 33], dtype=torch.int32, device=device)
        with warnings.catch_warnings():
            warnings.simplefilter("error", RuntimeWarning)
            out, lse = kern(q, k, v, return_lse=True, lens=lens)
            grads = torch.autograd.grad(out.sum(), (q, k, v), retain_graph=True)
        assert torch.equal(out[0], torch.zeros_like(out[0]))
        assert torch.isneginf(lse[0]).all() and torch.isfinite(lse[1:]).all()
        for g in grads:
            assert not torch.isnan(g).any()
            assert torch.equal(g[0], torch.zeros_like(g[0]))
        assert torch.equal(grads[1][1, :, 5:], torch.zeros_like(grads[1][1, :, 5:]))  # padded keys get no gradient


def test_lse_is_differentiable(device, target):
    kern = _compile(load_spec("attention t { head_dim = 32 mask = q_idx >= kv_idx }"), "fp32", target)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (_rand(1, 2, 29, 32, device=device, dtype=torch.float32, gen=gen).requires_grad_() for _ in range(3))
    out, lse = kern(q, k, v, return_lse=True)
    w = _rand(1, 2, 29, device=device, dtype=torch.float32, gen=gen)
    grads = torch.autograd.grad((lse * w).sum() + out.square().sum(), (q, k, v))
    ref, ref_lse = attngen.reference(kern.spec, *(t.double() for t in (q, k, v)), return_lse=True, dtype=torch.float64)
    ref_grads = torch.autograd.grad((ref_lse * w.double()).sum() + ref.square().sum(), (q, k, v))
    for g, rg in zip(grads, ref_grads):
        assert torch.allclose(g.double(), rg.double(), atol=5e-5)


def test_empty_sequences(device, target):
    kern = _compile(load_spec("attention t { head_dim = 32 }"), "fp32", target)
    q = torch.randn(1, 2, 5, 32, device=device, requires_grad=True)
    empty = torch.randn(1, 2, 0, 32, device=device, requires_grad=True)
    out, lse = kern(q, empty, empty, return_lse=True)
    assert torch.equal(out, torch.zeros_like(out)) and torch.isneginf(lse).all()
    out.sum().backward()
    assert torch.equal(q.grad, torch.zeros_like(q))
    assert kern(empty, q, q).shape == (1, 2, 0, 32)


@pytest.mark.slow
def test_backward_is_deterministic(device, target):
    """No atomics: two backward passes give bit-identical gradients (GQA sums happen in registers, input
    gradients are reduced in a fixed order)."""
    kern = _compile(load_spec("attention t { head_dim = 32 input slopes: fp32[H] input bias: fp32[H, N, N] input rel: fp32[H, 64] "
                              "mask = q_idx >= kv_idx score = score - slopes[h] * (q_idx - kv_idx) + bias[h, q_idx, kv_idx] "
                              "+ rel[h, min(q_idx - kv_idx, 63)] }"), "fp16", target)
    gen = torch.Generator().manual_seed(4)
    q = _rand(2, 8, 70, 32, device=device, dtype=torch.float16, gen=gen).requires_grad_()
    k, v = (_rand(2, 2, 70, 32, device=device, dtype=torch.float16, gen=gen).requires_grad_() for _ in range(2))
    slopes = _rand(8, device=device, dtype=torch.float32, gen=gen).requires_grad_()
    bias = _rand(8, 70, 70, device=device, dtype=torch.float32, gen=gen).requires_grad_()
    rel = _rand(8, 64, device=device, dtype=torch.float32, gen=gen).requires_grad_()
    leaves = (q, k, v, slopes, bias, rel)
    first = torch.autograd.grad(kern(q, k, v, slopes=slopes, bias=bias, rel=rel).sum(), leaves)
    second = torch.autograd.grad(kern(q, k, v, slopes=slopes, bias=bias, rel=rel).sum(), leaves)
    assert all(torch.equal(a, b) for a, b in zip(first, second))


# ---- the checker itself can fail --------------------------------------------------------------------------
class _Broken:
    """Wraps a generated module and perturbs one result."""

    def __init__(self, module, which, factor=1.01):
        self._module, self._which, self._factor = module, which, factor

    def attention_forward(self, *args):
        o, lse = self._module.attention_forward(*args)
        return (o * self._factor if self._which == "out" else o), lse

    def attention_backward(self, *args, **kwargs):
        dq, dk, dv, *terms = self._module.attention_backward(*args, **kwargs)
        if terms:  # the input-gradient terms
            terms = [[t * self._factor for t in terms[0]] if self._which == "dbias" else terms[0]]
        return (dq, (dk * self._factor if self._which == "dk" else dk), dv, *terms)


@pytest.mark.parametrize("which", ["out", "dk", "dbias"])
def test_verify_catches_a_one_percent_error(which, device, target):
    kern = _compile(load_spec("attention t { head_dim = 32 input bias: fp32[H, N] mask = q_idx >= kv_idx score = score + bias[h, kv_idx] }"), "fp16", target)
    assert verify.check_one(kern, (1, 2, 2, 40, 40), device).ok
    broken = attngen.Kernel(kern.spec, kern.plan, kern.source, kern.path, _Broken(kern.module, which))
    result = verify.check_one(broken, (1, 2, 2, 40, 40), device)
    assert not result.ok
    err, _, bound = result.errors[which]
    assert err > bound


def test_verify_catches_a_wrong_mask(device, target):
    """The kernel of one mask checked against the reference of another fails."""
    causal = _compile(load_spec("attention t { head_dim = 32 mask = q_idx >= kv_idx }"), "fp32", target)
    window = load_spec("attention t { head_dim = 32 dtype = fp32 mask = q_idx >= kv_idx and q_idx - kv_idx < 30 }")
    impostor = attngen.Kernel(window, causal.plan, causal.source, causal.path, causal.module)
    assert not verify.check_one(impostor, (1, 1, 1, 64, 64), device).ok


def test_classification_off_is_a_correct_baseline(device, target):
    """classify=False (the benchmarks' baseline) visits and masks every tile, and stays correct."""
    spec = dataclasses.replace(load_spec(VARIANTS["document_tiles_16"]), dtype=DType.FP32)
    kern = attngen.compile(spec, target, classify=False)
    assert "_tile_class" not in kern.source and "classification is turned off" in kern.source
    assert kern.source != attngen.compile(spec, target).source
    _check(kern, device, shapes=((2, 2, 1, 70, 90),))


# ---- dropout: one pattern for every tiling, loop order and pass ---------------------------------------------
def test_dropout_pattern_is_a_pure_function_of_the_indices(device):
    """attngen.dropout_mask: a sub-block of a larger mask is the smaller mask (tiling-independent), the same seed
    repeats, another seed differs, and the kept fraction is 1 - p within 0.01 over >= 20k pairs."""
    small = attngen.dropout_mask(5, 0.3, 2, 3, 40, 90, device)
    large = attngen.dropout_mask(5, 0.3, 2, 3, 71, 130, device)
    assert torch.equal(large[:, :, :40, :90], small)
    assert torch.equal(attngen.dropout_mask(5, 0.3, 2, 3, 40, 90, device), small)
    assert not torch.equal(attngen.dropout_mask(6, 0.3, 2, 3, 40, 90, device), small)
    many = attngen.dropout_mask(9, 0.1, 1, 2, 128, 128, device)  # 32768 pairs
    assert abs(many.float().mean().item() - 0.9) < 0.01
    assert torch.equal(attngen.dropout_mask(9, 0.0, 1, 2, 16, 16, device), torch.ones(1, 2, 16, 16, dtype=torch.bool, device=device))


_M32 = np.uint64(0xFFFFFFFF)


def _philox4x32_10(c0, c1, c2, c3, seed: int):
    """Philox-4x32-10 (Salmon et al., SC'11) in numpy uint64 arithmetic, independent of Triton: counters
    (c0, c1, c2, c3), key (k0, k1) = (low, high 32 bits of the seed), as tl.random.philox splits it. Each round:
    c0, c1, c2, c3 = hi(B c2) ^ c1 ^ k0, lo(B c2), hi(A c0) ^ c3 ^ k1, lo(A c0), then the key is bumped."""
    A, B, KEY_A, KEY_B = (np.uint64(x) for x in (0xD2511F53, 0xCD9E8D57, 0x9E3779B9, 0xBB67AE85))
    c0, c1, c2, c3 = (np.asarray(c, dtype=np.uint64) & _M32 for c in (c0, c1, c2, c3))
    k0, k1 = np.uint64(seed & 0xFFFFFFFF), np.uint64(seed >> 32)
    for _ in range(10):
        pb, pa = B * c2, A * c0  # 32 x 32 -> 64 bits: exact in uint64
        c0, c1, c2, c3 = (pb >> np.uint64(32)) ^ c1 ^ k0, pb & _M32, (pa >> np.uint64(32)) ^ c3 ^ k1, pa & _M32
        k0, k1 = (k0 + KEY_A) & _M32, (k1 + KEY_B) & _M32
    return c0, c1, c2, c3


def test_dropout_philox_reference_matches_published_vectors():
    """The numpy Philox above against Random123's known-answer vectors (kat_vectors, philox4x32 10)."""
    cases = [((0, 0, 0, 0), 0, (0x6627E8D5, 0xE169C58D, 0xBC57AC4C, 0x9B00DBD8)),
             ((0xFFFFFFFF,) * 4, 2**64 - 1, (0x408F276D, 0x41C83B0E, 0xA20BC7C6, 0x6D5451FD)),
             ((0x243F6A88, 0x85A308D3, 0x13198A2E, 0x03707344), (0x299F31D0 << 32) | 0xA4093822,
              (0xD16CFE09, 0x94FDCCEB, 0x5001E420, 0x24126EA1))]
    for counters, seed, expected in cases:
        assert tuple(int(x) for x in _philox4x32_10(*counters, seed)) == expected


def _documented_values(seed: int, B: int, H: int, Nq: int, Nk: int, lanes=True):
    """The 16-bit value of every pair (B, H, Nq, Nk) as the dropout pattern is documented: with r the outputs of
    Philox-4x32-10 with the counters (q_idx, 8 * (kv_idx // 64) + (kv_idx % 16) // 2, b * H + h, 0) and the seed
    as key, r[(kv_idx % 64) // 16] >> (16 * (kv_idx % 2)) & 0xFFFF (lanes=False: r[0]'s low half for every key,
    to show that the test tells them apart)."""
    b, h, q_idx, kv_idx = np.meshgrid(*(np.arange(n, dtype=np.uint64) for n in (B, H, Nq, Nk)), indexing="ij")
    call = np.uint64(8) * (kv_idx // np.uint64(64)) + (kv_idx % np.uint64(16)) // np.uint64(2)
    outputs = _philox4x32_10(q_idx, call, b * np.uint64(H) + h, np.zeros_like(q_idx), seed)
    if not lanes:
        return outputs[0] & np.uint64(0xFFFF)
    word = np.choose(((kv_idx % np.uint64(64)) // np.uint64(16)).astype(np.intp), outputs)
    return (word >> (np.uint64(16) * (kv_idx % np.uint64(2)))) & np.uint64(0xFFFF)


def test_dropout_mask_is_its_documented_definition(device, target):
    """attngen.dropout_mask against the documented pattern, computed in numpy: pair (b, h, q_idx, kv_idx) is kept
    iff its 16-bit value (above) is >= round(p * 65536). The seed is above 2**32, so both key words matter; the
    shape has keys past one 64-key group and a partial group. Then a kernel's forward and backward with that seed
    (16-key tiles: a part of a group) against the float64 reference (which uses dropout_mask), without NaN."""
    B, H, Nq, Nk = 2, 3, 37, 150
    seed = 0x2545F4914F6CDD1D
    values = _documented_values(seed, B, H, Nq, Nk)
    for p in (0.3, 0.75):
        threshold = int(p * 65536 + 0.5)
        expected = values >= np.uint64(threshold)
        got = attngen.dropout_mask(seed, p, B, H, Nq, Nk, device).cpu().numpy()
        assert got.shape == expected.shape and np.array_equal(got, expected)
        assert abs(expected.mean() - (1 - p)) < 0.02
        assert attngen.dropout_probability(p) == threshold / 65536
    # the check tells patterns apart: the low key word alone, or one output for every key, differs in > 20% of pairs
    for other in (_documented_values(seed & 0xFFFFFFFF, B, H, Nq, Nk), _documented_values(seed, B, H, Nq, Nk, lanes=False)):
        assert ((other >= np.uint64(19661)) != (values >= np.uint64(19661))).mean() > 0.2

    kern = _compile(load_spec("attention t { head_dim = 32 dropout = 0.3 mask = q_idx >= kv_idx block_m = 16 block_n = 16 }"), "fp32", target)
    gen = torch.Generator().manual_seed(4)
    q, k, v, do = (_rand(2, 3, Nq if i in (0, 3) else 45, 32, device=device, dtype=torch.float32, gen=gen) for i in range(4))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    out = kern(*leaves, seed=seed)
    wide = [t.detach().double().requires_grad_() for t in leaves]
    ref = attngen.reference(kern.spec, *wide, dtype=torch.float64, dropout_p=0.3, seed=seed)
    grads = torch.autograd.grad(out, leaves, do)
    ref_grads = torch.autograd.grad(ref, wide, do.double())
    for got, want in zip((out, *grads), (ref, *ref_grads)):
        assert not torch.isnan(got).any()
        assert (got.double() - want).abs().max().item() < 1e-4


def test_dropout_is_the_same_for_every_tiling_and_loop_order(device, target):
    """Three kernels of one spec (16- and 32-wide tiles, and Algorithm 1's loop order) with one seed give the
    same output up to rounding, and each matches the reference using the exact pattern."""
    texts = ["block_m = 16 block_n = 16", "block_m = 32 block_n = 64", "loop_order = kv_outer"]
    gen = torch.Generator().manual_seed(8)
    q, k, v = (_rand(2, 4, 50, 32, device=device, dtype=torch.float32, gen=gen) for _ in range(3))
    outs = []
    for extra in texts:
        kern = _compile(load_spec(f"attention t {{ head_dim = 32 dropout = 0.3 mask = q_idx >= kv_idx {extra} }}"), "fp32", target)
        outs.append(kern(q, k, v, seed=123))
        _check(kern, device, shapes=((1, 2, 1, 45, 61),))
    ref = attngen.reference(kern.spec, q.double(), k.double(), v.double(), dropout_p=0.3, seed=123)
    for out in outs:
        assert (out.double() - ref).abs().max().item() < 1e-5
    plain = _compile(load_spec("attention t { head_dim = 32 mask = q_idx >= kv_idx block_m = 16 block_n = 16 }"), "fp32", target)
    evaluation = _compile(load_spec(f"attention t {{ head_dim = 32 dropout = 0.3 mask = q_idx >= kv_idx {texts[0]} }}"), "fp32", target)
    assert torch.allclose(evaluation(q, k, v, dropout_p=0.0), plain(q, k, v), rtol=0, atol=1e-6)  # dropout_p=0: no dropout


def test_dropout_seed_defaults_to_torch_generator(device, target):
    kern = _compile(load_spec("attention t { head_dim = 32 dropout = 0.5 }"), "fp32", target)
    gen = torch.Generator().manual_seed(2)
    q, k, v = (_rand(1, 2, 20, 32, device=device, dtype=torch.float32, gen=gen) for _ in range(3))
    torch.manual_seed(0)
    first = kern(q, k, v)
    torch.manual_seed(0)
    assert torch.equal(kern(q, k, v), first)
    assert not torch.equal(kern(q, k, v), first)  # the generator moved on: another pattern


def test_a_seed_tensor_gives_the_pattern_of_its_value_when_the_kernels_run(device, target):
    """seed= a one-element int64 tensor: forward and backward use the value it holds when they run (what a CUDA
    graph replay needs), the same pattern as that int; the reference takes the tensor too. Bad tensors are
    InputErrors before any kernel runs."""
    kern = _compile(load_spec("attention t { head_dim = 32 dropout = 0.4 mask = q_idx >= kv_idx }"), "fp32", target)
    gen = torch.Generator().manual_seed(3)
    q, k, v, do = (_rand(1, 2, 40, 32, device=device, dtype=torch.float32, gen=gen) for _ in range(4))
    seed = torch.tensor([11], device=device)

    def run(s):
        qs, ks, vs = (t.clone().requires_grad_() for t in (q, k, v))
        o = kern(qs, ks, vs, seed=s)
        return (o, *torch.autograd.grad(o, (qs, ks, vs), do))

    with_tensor, with_int = run(seed), run(11)
    assert all(torch.equal(a, b) for a, b in zip(with_tensor, with_int))
    seed.fill_(12)
    changed = run(seed)
    assert all(torch.equal(a, b) for a, b in zip(changed, run(12)))
    assert not torch.equal(changed[0], with_int[0])
    ref = attngen.reference(kern.spec, q.double(), k.double(), v.double(), dropout_p=0.4, seed=seed)
    assert not torch.isnan(changed[0]).any() and (changed[0].double() - ref).abs().max().item() < 1e-5
    for bad, why in ((torch.tensor([1.0], device=device), "one int64"), (torch.tensor([1, 2], device=device), "one int64")):
        with pytest.raises(attngen.InputError, match=why):
            kern(q, k, v, seed=bad)


# bf16 specs on CPU tensors: Triton's interpreter has no bf16 arithmetic (it multiplied the raw 16-bit patterns and
# returned outputs near 8e8), so the call runs the spec's float32 kernels on float32 copies and rounds to bf16.
BF16_CPU = {
    "causal": (Path(__file__).parent.parent / "specs" / "causal.attn").read_text(),
    "dense": (Path(__file__).parent.parent / "specs" / "dense.attn").read_text(),
    "causal_softcap": (Path(__file__).parent.parent / "specs" / "causal_softcap.attn").read_text(),
    "bf16_input_dropout_blocks": "attention v { head_dim = 32 dtype = bf16 dropout = 0.2 sparsity = runtime sparse_block = 16 "
                                 "input kb: bf16[B, N] score = score + kb[b, kv_idx] mask = q_idx >= kv_idx }",
}


@pytest.mark.parametrize("name", sorted(BF16_CPU))
def test_bf16_specs_are_exact_on_every_device(name, device, target):
    kern = attngen.compile(load_spec(BF16_CPU[name], name), target)
    assert kern.spec.dtype is DType.BF16
    _check(kern, device, shapes=((1, 2, 2, 17, 17), (1, 4, 2, 65, 63)))


# ---- edges of the expression language, through whole kernels: each result is the language's defined
# value (README, "Semantics"), the same in the kernel and the float64 reference, never a silent wrap-around.
def _edge_case(text, device, target, inputs, B=2, H=2, N=40, D=32):
    kern = attngen.compile(load_spec(text), target)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(B, H, N, D, generator=gen).to(device) for _ in range(3))
    inputs = {name: t.to(device) for name, t in inputs.items()}
    out, lse = kern(q, k, v, return_lse=True, **inputs)
    ref, ref_lse = attngen.reference(kern.spec, q.double(), k.double(), v.double(), return_lse=True, dtype=torch.float64, **inputs)
    return out.double(), lse.double(), ref, ref_lse, v.double()


def _same(a, b, atol=2e-5):
    """Equal NaN and infinity patterns, finite values within atol."""
    assert torch.equal(torch.isnan(a), torch.isnan(b))
    assert torch.equal(torch.isinf(a), torch.isinf(b)) and torch.equal(a[torch.isinf(a)], b[torch.isinf(b)])
    finite = torch.isfinite(b)
    assert torch.allclose(a[finite], b[finite], atol=atol)


def test_runtime_zero_divisors_have_one_meaning(device, target):
    """a % 0 = a and a // 0 = 0, in the kernel and the reference: with d = 0, (q_idx - kv_idx) % d == 0 keeps the
    diagonal only (each query sees its own key: O = V), and kv_idx // d <= q_idx // d keeps every pair."""
    d = torch.tensor([0, 3], dtype=torch.int32)
    out, lse, ref, ref_lse, v = _edge_case("attention t { head_dim = 32 dtype = fp32 input d: int32[H] mask = (q_idx - kv_idx) % d[h] == 0 }",
                                           device, target, {"d": d})
    _same(out, ref)
    _same(lse, ref_lse, atol=1e-4)
    assert torch.allclose(out[:, 0], v[:, 0], atol=1e-5)  # head 0: d = 0, the diagonal
    out, _, ref, _, _ = _edge_case("attention t { head_dim = 32 dtype = fp32 input d: int32[H] mask = kv_idx // d[h] <= q_idx // d[h] }",
                                   device, target, {"d": d})
    _same(out, ref)
    dense, _, dense_ref, _, _ = _edge_case("attention t { head_dim = 32 dtype = fp32 }", device, target, {})
    assert torch.allclose(out[:, 0], dense_ref[:, 0], atol=2e-5)  # head 0: every pair kept


@pytest.mark.parametrize("text, values, kept_everywhere", [
    # int32 + int32 past 2**31: computed in int64 (it used to wrap to a negative number and drop every key but 0)
    ("input x: int32[B] mask = x[b] + kv_idx >= 0", [2**31 - 1, -5], [True, False]),
    # int8 arithmetic happens in int32 (200 > kv_idx; in int8 it would be -56)
    ("input s: int8[B] mask = s[b] * 2 > kv_idx", [100, 10], [True, False]),
    # a product of an index and an int32 input: int64
    ("input w: int32[B] mask = kv_idx * w[b] <= 40 * w[b]", [2**30, 7], [True, True]),
])
def test_integer_arithmetic_is_exact(text, values, kept_everywhere, device, target):
    decl = text.split(":")[1].split("[")[0].strip()
    name = text.split()[1].rstrip(":")
    x = torch.tensor(values, dtype=getattr(torch, decl))
    out, lse, ref, ref_lse, _ = _edge_case(f"attention t {{ head_dim = 32 dtype = fp32 {text} }}", device, target, {name: x})
    _same(out, ref)
    _same(lse, ref_lse, atol=1e-4)
    dense, _, dense_ref, _, _ = _edge_case("attention t { head_dim = 32 dtype = fp32 }", device, target, {})
    for b, everything in enumerate(kept_everywhere):
        assert torch.allclose(out[b], dense_ref[b], atol=2e-5) == everything


# +inf scores from the input make inf - inf = NaN in the interpreter's numpy, which is the point of the test
@pytest.mark.filterwarnings("ignore:invalid value encountered in subtract:RuntimeWarning")
def test_nan_and_infinite_inputs(device, target):
    """A NaN compared in the mask is false (the key is dropped); a score of -inf drops the pair; +inf or NaN in a
    kept score makes that row NaN (output and lse), in the kernel and the reference alike."""
    t = torch.randn(2, 40)
    t[:, 3] = float("nan")
    t[:, 5] = float("inf")
    out, lse, ref, ref_lse, _ = _edge_case("attention t { head_dim = 32 dtype = fp32 input t: fp32[B, N] mask = t[b, kv_idx] > 0.0 or kv_idx == 3 }",
                                           device, target, {"t": t})
    _same(out, ref)
    assert not torch.isnan(out).any()  # the NaN key is dropped by `t > 0.0`, kept by `kv_idx == 3` (its score is finite)
    bias = torch.zeros(2, 40)
    bias[:, 7] = float("-inf")
    bias[1, 9] = float("inf")
    bias[1, 11] = float("nan")
    out, lse, ref, ref_lse, _ = _edge_case("attention t { head_dim = 32 dtype = fp32 input bias: fp32[B, N] mask = q_idx >= kv_idx "
                                           "score = score + bias[b, kv_idx] }", device, target, {"bias": bias})
    _same(out, ref)
    _same(lse, ref_lse, atol=1e-4)
    assert not torch.isnan(out[0]).any() and torch.isnan(out[1, :, 9:]).all() and not torch.isnan(out[1, :, :9]).any()
    # the gradients: NaN where the reference's are (the NaN rows reach every key they attend to), equal elsewhere
    kern = attngen.compile(load_spec("attention t { head_dim = 32 dtype = fp32 input bias: fp32[B, N] mask = q_idx >= kv_idx "
                                     "score = score + bias[b, kv_idx] }"), target)
    gen = torch.Generator().manual_seed(5)
    leaves = [torch.randn(2, 2, 40, 32, generator=gen).to(device).requires_grad_() for _ in range(3)]
    grads = torch.autograd.grad(kern(*leaves, bias=bias.to(device)).sum(), leaves)
    wide = [t.detach().double().requires_grad_() for t in leaves]
    ref_grads = torch.autograd.grad(attngen.reference(kern.spec, *wide, bias=bias.to(device), dtype=torch.float64).sum(), wide)
    for g, rg in zip(grads, ref_grads):
        _same(g.double(), rg, atol=1e-4)
    assert torch.isnan(grads[0][0]).sum() == 0
