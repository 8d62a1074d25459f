"""The naive reference: scores materialized, the spec's expressions evaluated with torch, softmax, P @ V.

Written from the Spec alone, independently of the templates and of the code generators' lowering
(attngen/codegen/expr.py), so that it can check them. By default it computes in float64 on CPU and float32 on GPU; `dtype=` gives the same-precision
naive attention used by the tolerance rule (error budget relative to what plain PyTorch would get).
"""
from __future__ import annotations

import torch

from ..errors import InputError
from ..lang.expr import SCORE_VARS, Scope
from ..plan.planner import effective_mask
from ..runtime import blocks
from ..runtime.checks import check_heads, check_input_names
from ..runtime.evaluate import evaluate, sink_rows


def reference(spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, dtype: torch.dtype | None = None,
              return_lse: bool = False, dropout_p: float = 0.0, seed: int | None = None, cu_seqlens_q: torch.Tensor | None = None,
              cu_seqlens_k: torch.Tensor | None = None, kv_lens: torch.Tensor | None = None, q_lens: torch.Tensor | None = None,
              block_table: torch.Tensor | None = None, q_descale: torch.Tensor | None = None, k_descale: torch.Tensor | None = None,
              v_descale: torch.Tensor | None = None, fp8_p: bool = False, **inputs: torch.Tensor):
    """Naive attention for `spec` (a Spec or a compiled kernel). Differentiable with torch autograd.
    With dropout_p > 0 (and the seed given to the kernel), probabilities are multiplied by
    attngen.dropout_mask(seed, ...) / (1 - attngen.dropout_probability(dropout_p)): the kernels' exact pattern
    and scale (p in steps of 1/65536), not a statistical match.

    q: (B, Hq, Nq, D); k, v: (B, Hkv, Nk, D). Computes in `dtype` (default: float64 on CPU, float32 on
    CUDA) and returns the output in that dtype, plus the row log-sum-exp (natural log, -inf for a row that
    keeps no key, its sink where the spec has one) when return_lse. Rows that keep no key give 0.

    Packed sequences (cu_seqlens_q and cu_seqlens_k, as the kernels take them): q (total_q, Hq, D), k and v
    (total_k, Hkv, D); each sequence is computed on its own, with b = its index (dropout's pattern too); O is
    (total_q, Hq, D) and the lse (Hq, total_q).

    Serving, as the kernels take it: kv_lens (B,): sequence b keeps its first kv_lens[b] keys (the rest is never
    read); q_lens (B,): its first q_lens[b] queries (the other rows give 0 and lse -inf); block_table (B, pages):
    k and v are paged caches (num_pages, page_size, Hkv, D), read through the table (attngen.kvcache.gather).
    Each sequence is computed on its own with its lengths as q_len and kv_len.

    FP8 (e4m3 q, k, v): their descale factors q_descale, k_descale, v_descale as the kernels take them
    (attngen.fp8); the inputs are dequantized, then computed in `dtype`. fp8_p=True also rounds P to e4m3 as the
    FP8 kernels do before P V (relative to each row's maximum): the naive model of their error.
    """
    _check_arguments(getattr(spec, "spec", spec), q, k, v, inputs, plain=cu_seqlens_q is None and cu_seqlens_k is None and kv_lens is None
                     and q_lens is None and block_table is None)
    dtype = dtype or (torch.float64 if q.device.type == "cpu" else torch.float32)
    if k.dtype == torch.float8_e4m3fn and q.dtype != torch.float8_e4m3fn:  # FP8 key/value caches (kv_dtype = fp8)
        from ..kvcache import gather
        from ..runtime import fp8

        if block_table is not None:
            k, v, block_table = gather(k, block_table), gather(v, block_table), None
        k, v = (x.float() * fp8.cache_scales(name, s, q.shape[0], x.shape[1], q.device)[:, :, None, None]
                for name, x, s in (("k_descale", k, k_descale), ("v_descale", v, v_descale)))
    elif q.dtype == torch.float8_e4m3fn or k.dtype == torch.float8_e4m3fn or v.dtype == torch.float8_e4m3fn:
        from ..runtime import fp8

        B, Hq, Nq, _ = q.shape
        Hkv, Nk = k.shape[1], k.shape[2]
        q = fp8.dequantize(q, fp8.descale_blocks("q_descale", q_descale, B, Hq, Hkv, Nq, q.device))
        k = fp8.dequantize(k, fp8.descale_blocks("k_descale", k_descale, B, Hkv, Hkv, Nk, k.device))
        v = fp8.dequantize(v, fp8.descale_blocks("v_descale", v_descale, B, Hkv, Hkv, Nk, v.device, per_block=False), per_block=False)
    if dropout_p > 0.0 and seed is None:
        raise ValueError("reference(..., dropout_p > 0) needs the seed the kernel was called with")
    if cu_seqlens_q is not None or cu_seqlens_k is not None:
        return _packed_reference(getattr(spec, "spec", spec), q, k, v, cu_seqlens_q.tolist(), cu_seqlens_k.tolist(), dtype, return_lse, inputs,
                                 dropout_p, seed)
    if kv_lens is not None or q_lens is not None or block_table is not None:
        return _serving_reference(getattr(spec, "spec", spec), q, k, v, kv_lens, q_lens, block_table, dtype, return_lse, inputs)
    p, lse = _softmax(getattr(spec, "spec", spec), q, k, dtype, inputs)
    Hq, Hkv = q.shape[1], k.shape[1]
    if fp8_p:  # P / its row maximum is what the kernels round to e4m3 (their running maximum: the same error level)
        row_max = p.amax(-1, keepdim=True).clamp(min=torch.finfo(p.dtype).tiny)
        p = (p / row_max).to(torch.float8_e4m3fn).to(dtype) * row_max
    if dropout_p > 0.0:
        p = _dropped(p, dropout_p, seed, 0)
    vf = v.to(dtype).repeat_interleave(Hq // Hkv, dim=1) if Hq != Hkv else v.to(dtype)
    out = torch.matmul(p, vf)
    return (out, lse) if return_lse else out


def _check_arguments(spec, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: dict, plain: bool) -> None:
    """The InputErrors a kernel call would raise for what the reference reads: the spec's declared inputs by name
    (a runtime block mask beside them), and (a plain call) q (B, Hq, Nq, D), k and v (B, Hkv, Nk, D)."""
    check_input_names(spec, inputs, frozenset({"block_mask"}) if spec.sparsity == "runtime" else frozenset())
    if not plain:
        return
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise InputError(f"q, k, v must be 4-D (B, H, N, D); got {q.dim()}-D, {k.dim()}-D, {v.dim()}-D")
    if k.shape[:3] != v.shape[:3] or q.shape[0] != k.shape[0] or q.shape[3] != k.shape[3] or v.shape[3] != spec.dv:
        raise InputError(f"q (B, Hq, Nq, D), k (B, Hkv, Nk, D) and v (B, Hkv, Nk, {'value_dim' if spec.value_dim else 'D'}) must agree; "
                         f"got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    check_heads(q.shape[1], k.shape[1])


def probabilities(spec, q: torch.Tensor, k: torch.Tensor, *, dtype: torch.dtype | None = None, **inputs: torch.Tensor) -> torch.Tensor:
    """The naive attention's probabilities P (B, Hq, Nq, Nk), before dropout; rows that keep no key are 0."""
    return _softmax(getattr(spec, "spec", spec), q, k, dtype or (torch.float64 if q.device.type == "cpu" else torch.float32), inputs)[0]


def _dropped(p: torch.Tensor, dropout_p: float, seed: int, first_batch: int) -> torch.Tensor:
    """p (B, Hq, Nq, Nk) with the kernels' dropout applied, batch entry i being sequence or batch first_batch + i:
    the keep pattern is a function of (seed, b, h, q_idx, kv_idx) alone, so rows of a longer batch's mask serve."""
    from ..runtime.dropout import dropout_mask, dropout_probability  # the kernels' keep pattern (generated code; Triton)

    B, Hq, Nq, Nk = p.shape
    keep = dropout_mask(seed, dropout_p, first_batch + B, Hq, Nq, Nk, p.device)[first_batch:]
    return p * keep.to(p.dtype) / (1.0 - dropout_probability(dropout_p))


def _packed_reference(spec, q, k, v, cq: list[int], ck: list[int], dtype, return_lse: bool, inputs, dropout_p: float = 0.0,
                      seed: int | None = None):
    outs, lses = [], []
    for i in range(len(cq) - 1):
        qs, ks, vs = (t[lo:hi].transpose(0, 1)[None] for t, lo, hi in ((q, cq[i], cq[i + 1]), (k, ck[i], ck[i + 1]), (v, ck[i], ck[i + 1])))
        if ks.shape[2] == 0:  # no key: O = 0, lse = -inf (the sink where the spec has one)
            outs.append(torch.zeros(qs.shape[2], qs.shape[1], vs.shape[3], dtype=dtype, device=q.device))
            lses.append(sink_rows(spec, inputs, 1, qs.shape[1], qs.shape[2], 0, q.device, dtype, first_batch=i)[0] if spec.sink is not None
                        else torch.full((qs.shape[1], qs.shape[2]), float("-inf"), dtype=dtype, device=q.device))
            continue
        p, lse = _softmax(spec, qs, ks, dtype, inputs, first_batch=i)
        if dropout_p > 0.0 and qs.shape[2]:
            p = _dropped(p, dropout_p, seed, i)
        group = qs.shape[1] // vs.shape[1]
        out = torch.matmul(p, vs.to(dtype).repeat_interleave(group, dim=1))
        outs.append(out[0].transpose(0, 1))
        lses.append(lse[0])
    out = torch.cat(outs) if outs else q.new_zeros((*q.shape[:2], v.shape[2]), dtype=dtype)
    lse = torch.cat(lses, dim=1) if lses else torch.zeros(q.shape[1], 0, dtype=dtype, device=q.device)
    return (out, lse) if return_lse else out


def _serving_reference(spec, q, k, v, kv_lens, q_lens, block_table, dtype, return_lse: bool, inputs):
    if block_table is not None:
        from ..kvcache import gather

        k, v = gather(k, block_table), gather(v, block_table)
    B, Hq, Nq, _ = q.shape
    out = torch.zeros((B, Hq, Nq, v.shape[3]), dtype=dtype, device=q.device)
    lse = torch.full((B, Hq, Nq), float("-inf"), dtype=dtype, device=q.device)
    for b in range(B):
        nq = Nq if q_lens is None else int(q_lens[b])
        nk = k.shape[2] if kv_lens is None else int(kv_lens[b])
        if nq == 0:
            continue
        if nk == 0:  # no key: O = 0, lse = -inf (the sink where the spec has one)
            if spec.sink is not None:
                lse[b, :, :nq] = sink_rows(spec, inputs, 1, Hq, nq, 0, q.device, dtype, first_batch=b)[0]
            continue
        qs, ks, vs = q[b:b + 1, :, :nq], k[b:b + 1, :, :nk], v[b:b + 1, :, :nk]
        p, row_lse = _softmax(spec, qs, ks, dtype, inputs, first_batch=b)
        group = Hq // vs.shape[1]
        out[b, :, :nq] = torch.matmul(p, vs.to(dtype).repeat_interleave(group, dim=1))[0]
        lse[b, :, :nq] = row_lse[0]
    return (out, lse) if return_lse else out


def score_env(score: torch.Tensor, first_batch: int = 0) -> dict:
    """The variables of a score expression for scores of shape (B, H, Nq, Nk): b, h, q_idx, kv_idx as
    broadcasting index tensors, the lengths, and `score`. b counts from first_batch (a packed sequence's index)."""
    B, H, Nq, Nk = score.shape
    dev = score.device
    return {
        "b": torch.arange(first_batch, first_batch + B, device=dev).view(B, 1, 1, 1),
        "h": torch.arange(H, device=dev).view(1, H, 1, 1),
        "q_idx": torch.arange(Nq, device=dev).view(1, 1, Nq, 1),
        "kv_idx": torch.arange(Nk, device=dev).view(1, 1, 1, Nk),
        "q_len": Nq,
        "kv_len": Nk,
        "score": score,
    }


def _softmax(spec, q, k, dtype, inputs, first_batch: int = 0):
    """(P, row log-sum-exp) of the spec's scores and mask, in `dtype`."""
    B, Hq, Nq, D = q.shape
    Hkv, Nk = k.shape[1], k.shape[2]
    group = Hq // Hkv
    qf, kf = q.to(dtype), k.to(dtype)
    if group > 1:
        kf = kf.repeat_interleave(group, dim=1)
    dev = q.device
    qk = torch.matmul(qf, kf.transpose(-1, -2))
    score = qk * spec.softmax_scale
    env = score_env(score, first_batch)
    scope = Scope("score", SCORE_VARS, spec.inputs_by_name)
    if spec.score is not None:
        score = torch.as_tensor(evaluate(spec.score, env, inputs, scope, dtype), device=dev).to(dtype)
        score = score.expand(B, Hq, Nq, Nk)
    mask = effective_mask(spec)
    if mask is not None:
        keep = torch.as_tensor(evaluate(mask, env, inputs, scope, dtype), device=dev).expand(B, Hq, Nq, Nk)
        score = score.masked_fill(~keep, float("-inf"))
    if spec.sparsity == "runtime":  # only pairs inside kept blocks
        if inputs.get("block_mask") is None:
            raise ValueError(f"{spec.name} has sparsity = runtime: pass the kernel's block_mask= to the reference")
        keep = blocks.expand(inputs["block_mask"].to(dev), spec.sparse_block, Nq, Nk).expand(B, Hq, Nq, Nk)
        score = score.masked_fill(~keep, float("-inf"))
    # softmax with rows that keep nothing giving 0 (and no NaN in value or gradient); a kept score of +inf or NaN
    # makes its row's P, and so its output and log-sum-exp, NaN (as in the kernels: inf - inf). A sink is one more
    # logit of each row, with no value: it joins the maximum and the denominator only.
    raw_max = score.amax(dim=-1, keepdim=True).detach() if Nk else score.new_full((B, Hq, Nq, 1), float("-inf"))  # no key at all
    sink = None
    if spec.sink is not None:
        sink = sink_rows(spec, inputs, B, Hq, Nq, Nk, dev, dtype, first_batch)[..., None]
        raw_max = torch.maximum(raw_max, sink.detach())
    row_max = torch.where(torch.isfinite(raw_max), raw_max, torch.zeros_like(raw_max))
    e = torch.exp(score - row_max)
    denom = e.sum(dim=-1, keepdim=True)
    if sink is not None:
        denom = denom + torch.exp(sink - row_max)
    p = e / torch.where(denom == 0, torch.ones_like(denom), denom)
    lse = torch.where(raw_max == float("inf"), torch.full_like(denom, float("nan")), row_max + torch.log(denom))
    return p, lse.squeeze(-1)
