"""The kernels' index arithmetic stays inside int32, checked by Triton's interpreter.

The suite runs the interpreter with its int32 overflow checks off (interpreter_patches.py: they cost 40 % of a
kernel's time there, and compiled kernels make them only in debug builds). These tests turn them back on for a
kernel of each kind of index arithmetic the Triton templates emit: both loop orders forward and backward with
grouped-query heads, partial tiles, inputs indexed by b and positions, dropout's pattern offsets and a runtime
block mask; packed sequences' offsets; a paged cache's block table and the decode kernels' split and merge. The
first test shows that the check fires. Results are checked against the float64 reference as everywhere else.
"""
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

import attngen
from attngen import kvcache
from attngen.lang.check import load_spec
from attngen.runtime.dtypes import TORCH_DTYPES
from attngen.tools import verify
from attngen.tools.verify import _bound
from interpreter_patches import overflow_checks

pytestmark = pytest.mark.interpreter  # the CPU path itself

ROOT = Path(__file__).parent.parent


@triton.jit
def _square(x_ptr, out_ptr):
    x = tl.load(x_ptr)
    tl.store(out_ptr, x * x)


def test_the_overflow_check_fires():
    x, out = torch.tensor([70000], dtype=torch.int32), torch.zeros(1, dtype=torch.int32)
    _square[(1,)](x, out)  # off (the suite's setting): int32 wraps, as a compiled kernel's does
    assert out.item() == (70000 * 70000 + 2**31) % 2**32 - 2**31
    with overflow_checks(), pytest.raises(Exception, match="overflow"):
        _square[(1,)](x, out)
    x.fill_(40000)
    with overflow_checks():
        _square[(1,)](x, out)
    assert out.item() == 40000 * 40000


SPECS = {
    # q_outer: documents and a key bias (with its gradient) read through b and kv_idx, dropout, partial tiles
    "q_outer": "attention t { head_dim = 16 block_m = 16 block_n = 16 dtype = fp32 dropout = 0.2 input doc: int32[B, N] "
               "input kb: fp32[B, N] mask = doc[b, q_idx] == doc[b, kv_idx] score = score + kb[b, kv_idx] }",
    # kv_outer with a runtime block mask and a per-head input
    "kv_outer": "attention t { head_dim = 16 block_m = 16 block_n = 16 dtype = fp32 loop_order = kv_outer sparsity = runtime "
                "sparse_block = 16 input slopes: fp32[H] mask = q_idx >= kv_idx score = score - slopes[h] * (q_idx - kv_idx) }",
}


@pytest.mark.parametrize("name", sorted(SPECS))
def test_both_passes_stay_inside_int32(name):
    kern = attngen.compile(SPECS[name], "h100")
    with overflow_checks():
        r = verify.check_one(kern, (2, 4, 2, 24, 37), "cpu")
    assert r.ok, verify.format_table(name, [r])


def test_packed_sequences_stay_inside_int32():
    kern = attngen.compile(ROOT / "specs" / "sliding_window.attn", "h100")
    dtype = TORCH_DTYPES[kern.spec.dtype.value]
    lengths = ([3, 0, 17, 20], [5, 2, 17, 33])
    cq, ck = (torch.tensor([0] + torch.tensor(n).cumsum(0).tolist(), dtype=torch.int32) for n in lengths)
    gen = torch.Generator().manual_seed(0)
    d = kern.spec.head_dim
    q = torch.randn(sum(lengths[0]), 2, d, generator=gen).to(dtype)
    k, v = (torch.randn(sum(lengths[1]), 1, d, generator=gen).to(dtype) for _ in range(2))
    leaves = [t.clone().requires_grad_() for t in (q, k, v)]
    with overflow_checks():
        out = kern(*leaves, cu_seqlens_q=cq, cu_seqlens_k=ck)
        grads = torch.autograd.grad(out, leaves, torch.ones_like(out))
    assert not any(torch.isnan(t).any() for t in (out, *grads))
    wide = [t.double() for t in (q, k, v)]
    ref = attngen.reference(kern, *wide, cu_seqlens_q=cq, cu_seqlens_k=ck, dtype=torch.float64)
    naive = attngen.reference(kern, q, k, v, cu_seqlens_q=cq, cu_seqlens_k=ck, dtype=dtype)
    err, _, bound = _bound(out.detach(), naive, ref, 2)
    assert err <= bound, (err, bound)


def test_a_paged_cache_and_split_decoding_stay_inside_int32():
    spec = load_spec("attention t { head_dim = 16 dtype = fp32 kv_layout = paged page_size = 16\n"
                     " mask = q_idx + kv_len - q_len >= kv_idx }")
    kern = attngen.compile(spec, "h100")
    gen = torch.Generator().manual_seed(0)
    lens, hkv, capacity = [0, 1, 40, 64], 2, 64
    q = torch.randn(len(lens), 4, 2, 16, generator=gen)
    k, v = (torch.randn(len(lens), hkv, capacity, 16, generator=gen) for _ in range(2))
    per_seq = capacity // 16
    table = torch.randperm(len(lens) * per_seq, generator=gen).view(len(lens), per_seq).to(torch.int32)
    k_cache, v_cache = (torch.full((len(lens) * per_seq, 16, hkv, 16), float("nan")) for _ in range(2))
    zero = torch.zeros(1, dtype=torch.int32)
    for b, n in enumerate(lens):
        if n:
            kvcache.append(k_cache, v_cache, k[b:b + 1, :, :n], v[b:b + 1, :, :n], zero, table[b:b + 1])
    kv_lens = torch.tensor(lens, dtype=torch.int32)
    with overflow_checks(), torch.no_grad():
        out = kern(q, k_cache, v_cache, block_table=table, kv_lens=kv_lens)
    ref = attngen.reference(kern, q.double(), k_cache.double(), v_cache.double(), kv_lens=kv_lens, block_table=table,
                            dtype=torch.float64)
    naive = attngen.reference(kern, q, k_cache, v_cache, kv_lens=kv_lens, block_table=table, dtype=torch.float32)
    assert not torch.isnan(out).any()
    err, _, bound = _bound(out, naive, ref, 2)
    assert err <= bound, (err, bound)
