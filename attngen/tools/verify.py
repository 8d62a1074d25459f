"""Check a compiled kernel against the naive reference over a matrix of shapes (used by `attngen check`).

The rule, as in flash-attention's tests: the kernel's largest error against a float64 reference (computed on
the kernel's device) must stay within `factor` times the error of the same-precision naive attention (2 for
the output, 3 for the gradients), plus a floor of FLOOR_ULPS float32 ulps of the largest magnitude involved
(at least 1.0). The kernels accumulate in float32, so nothing they return is more exact than that. For the
gradients the magnitude is that of the terms, not of the result, and a float32 dot product's rounding grows
with the sum of the absolute values of its products: dQ and dK come from dP - delta, a cancellation of two
float32 sums of size scale * (|dO| |V|^T) * |K| (with a single key the true dQ is exactly 0, which the kernel
reaches only to float32 rounding); and the backward recomputes P = exp2(s - lse) from a recomputed score,
whose error is eps * scale * (|Q| |K|^T), and from the saved float32 row log-sum-exp, whose error is
eps * |lse| (large when a score modification makes scores large, as ALiBi does over long distances); both
reach dV multiplied by |dO|. The log-sum-exp is float32 from the same products, so it gets
a relative bound (LSE_RTOL) and must be -inf exactly where the reference's is. Any NaN fails.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..lang.algebra import read_derivative
from ..lang.expr import SCORE_VARS, SINK_VARS, Scope, input_reads
from ..lang.spec import Const, DType, KVLayout, Type
from ..runtime.dtypes import TORCH_DTYPES
from ..runtime.evaluate import evaluate, sink_rows
from ..runtime.samples import make_inputs
from .reference import probabilities, reference, score_env

# (batch, query heads, key/value heads, q_len, kv_len): a single token, an odd length, GQA with
# q_len != kv_len, MQA with short queries and long keys, and tile-aligned lengths.
CPU_SHAPES = ((1, 1, 1, 1, 1), (2, 2, 2, 17, 17), (1, 4, 2, 65, 63), (2, 2, 1, 113, 203), (1, 2, 2, 128, 128))
CUDA_SHAPES = CPU_SHAPES + ((2, 8, 2, 1000, 1000), (1, 4, 4, 2048, 512), (2, 4, 1, 300, 4096))

LSE_RTOL = 1e-4
FLOOR_ULPS = 4


@dataclass
class Result:
    shape: tuple
    dtype: str
    errors: dict = field(default_factory=dict)  # name -> (kernel error, naive error, bound)
    nan: bool = False

    @property
    def ok(self) -> bool:
        return not self.nan and all(err <= bound for err, _, bound in self.errors.values())


def _err(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double() - b.double()).abs().max().item() if a.numel() else 0.0


def _floor(ref: torch.Tensor, terms: float = 0.0) -> float:
    """FLOOR_ULPS float32 ulps at the largest magnitude of the result or of the terms summed into it (at least 1.0)."""
    peak = ref.abs().max().item() if ref.numel() else 0.0
    return FLOOR_ULPS * torch.finfo(torch.float32).eps * max(1.0, peak, terms)


def check_one(kernel, shape: tuple, device: str, seed: int = 0, backward: bool = True) -> Result:
    spec = kernel.spec
    if spec.kv_layout is KVLayout.PAGED or spec.kv_dtype is DType.FP8:
        return _check_serving(kernel, shape, device, seed)
    if spec.dtype is DType.FP8:
        return _check_fp8(kernel, shape, device, seed)
    dtype = TORCH_DTYPES[spec.dtype.value]
    B, Hq, Hkv, Nq, Nk = shape
    D, Dv = spec.head_dim, spec.dv
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=gen).to(device=device, dtype=dtype)
    k = torch.randn(B, Hkv, Nk, D, generator=gen).to(device=device, dtype=dtype)
    v = torch.randn(B, Hkv, Nk, Dv, generator=gen).to(device=device, dtype=dtype)
    do = torch.randn(B, Hq, Nq, Dv, generator=gen).to(device=device, dtype=dtype)
    inputs = make_inputs(spec, B, Hq, Nq, Nk, device, gen)
    # float inputs the backward differentiates (read in the score or by the sink) are checked like q, k and v
    grad_inputs = sorted({g.read.input for g in kernel.plan.read_grads} | set(_sink_reads(spec))) if backward else []
    for name in grad_inputs:
        inputs[name].requires_grad_()
    leaves = [t.requires_grad_(backward) for t in (q, k, v)] + [inputs[name] for name in grad_inputs]

    # dropout (the spec's probability): kernel and references use the same seed, so the same exact pattern
    drop = {"dropout_p": spec.dropout, "seed": 1000 + seed} if spec.dropout > 0.0 else {}
    out, lse = kernel(*leaves[:3], return_lse=True, **drop, **inputs)
    # float64 reference on the same device (exact enough to be the truth), and the same-precision naive attention
    wide = [t.detach().double().requires_grad_(backward) for t in leaves[:3]]
    wide_inputs = {**inputs, **{name: inputs[name].detach().double().requires_grad_() for name in grad_inputs}}
    wide += [wide_inputs[name] for name in grad_inputs]
    ref, ref_lse = reference(spec, *wide[:3], return_lse=True, dtype=torch.float64, **drop, **wide_inputs)
    ref_lse = ref_lse.detach().cpu()
    naive_leaves = [t.detach().clone().requires_grad_(backward) for t in leaves]
    naive_inputs = {**inputs, **dict(zip(grad_inputs, naive_leaves[3:]))}
    naive = reference(spec, *naive_leaves[:3], dtype=dtype, **drop, **naive_inputs)

    res = Result(shape, spec.dtype.value)
    res.nan = bool(torch.isnan(out).any() or torch.isnan(lse).any())
    res.errors["out"] = _bound(out.cpu(), naive.cpu(), ref.detach().cpu(), 2)
    finite = torch.isfinite(ref_lse)
    lse_peak = ref_lse[finite].abs().max().item() if finite.any() else 0.0
    same_support = torch.equal(torch.isfinite(lse.cpu()), finite)
    lse_err = _err(lse.cpu()[finite], ref_lse[finite]) if same_support else float("inf")
    res.errors["lse"] = (lse_err, 0.0, LSE_RTOL * max(1.0, lse_peak))
    if backward:
        grads = torch.autograd.grad(out, leaves, do)
        ref_grads = [g.cpu() for g in torch.autograd.grad(ref, wide, do.double())]
        naive_grads = torch.autograd.grad(naive, naive_leaves, do)
        terms = _gradient_terms(spec.softmax_scale, *(t.detach() for t in wide[:3]), do.double(), Hq // Hkv, lse_peak)
        reads = _read_derivatives(kernel, *(t.detach() for t in wide[:2]), wide_inputs)
        read_terms = _read_terms(kernel, *(t.detach() for t in wide[1:3]), do.double(), reads)
        via_delta = _error_through_delta(kernel, *(t.detach() for t in wide[:3]), do.double(), out.detach().double() - ref.detach(),
                                         wide_inputs, reads)
        for name, (term, bound) in _sink_bounds(spec, ref.detach(), ref_lse.to(ref.device), do.double(), out.detach().double() - ref.detach(),
                                                wide_inputs, Nk).items():
            read_terms[name] = max(read_terms.get(name, 0.0), term)
            via_delta[f"d{name}"] = via_delta.get(f"d{name}", 0.0) + bound
        names = ["dq", "dk", "dv"] + [f"d{name}" for name in grad_inputs]
        for name, g, rg, ng in zip(names, grads, ref_grads, naive_grads):
            res.nan |= bool(torch.isnan(g).any())
            err, naive_err, bound = _bound(g.cpu(), ng.cpu(), rg, 3, terms if name in ("dq", "dk", "dv") else read_terms[name[1:]])
            res.errors[name] = (err, naive_err, bound + via_delta.get(name, 0.0))
    return res


def _check_serving(kernel, shape: tuple, device: str, seed: int) -> Result:
    """A serving spec (forward only: a paged cache, or FP8 caches): the keys of `shape` appended to the caches (a
    paged one's pages in a shuffled order; the spare page and every slot no sequence owns hold NaN; FP8 caches with
    per-head descale factors), per-sequence lengths from 0 to Nk (the last sequence the whole Nk), O and the lse
    against the reference reading the same caches."""
    from ..kvcache import append

    spec = kernel.spec
    dtype = TORCH_DTYPES[spec.dtype.value]
    kv8 = spec.kv_dtype is DType.FP8
    cache_dtype = TORCH_DTYPES[(spec.kv_dtype or spec.dtype).value]
    B, Hq, Hkv, Nq, Nk = shape
    D, Dv, P = spec.head_dim, spec.dv, spec.page_size
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, D, generator=gen).to(device=device, dtype=dtype)
    k, v = (torch.randn(B, Hkv, Nk, d, generator=gen).to(device=device, dtype=torch.float32 if kv8 else dtype) for d in (D, Dv))
    lens = torch.randint(0, Nk + 1, (B,), generator=gen, dtype=torch.int32)
    lens[-1] = Nk
    scales = {"k_descale": k.abs().amax((0, 2, 3)).clamp(min=1e-6) / 448, "v_descale": v.abs().amax((0, 2, 3)).clamp(min=1e-6) / 448} if kv8 else {}
    if spec.kv_layout is KVLayout.PAGED:
        per_seq = -(-Nk // P)
        table = {"block_table": torch.randperm(B * per_seq + 1, generator=gen)[:B * per_seq].view(B, per_seq).to(torch.int32).to(device)}
        k_cache, v_cache = (torch.full((B * per_seq + 1, P, Hkv, d), float("nan"), device=device).to(cache_dtype) for d in (D, Dv))
    else:
        table = {}
        k_cache, v_cache = (torch.full((B, Hkv, Nk, d), float("nan"), device=device).to(cache_dtype) for d in (D, Dv))
    if kernel.plan.decode_tail:  # latent attention (MLA): V is K's first value_dim columns, passed as a view of the cache
        v_cache, v = k_cache[..., :Dv], k[..., :Dv]
    lens = lens.to(device)
    # every sequence's Nk keys; those past its length stay unread
    append(k_cache, v_cache, k, v, torch.zeros_like(lens), table.get("block_table"), **scales)
    inputs = make_inputs(spec, B, Hq, Nq, Nk, device, gen)
    serving = {**table, "kv_lens": lens, **scales}
    with torch.no_grad():
        out, lse = kernel(q, k_cache, v_cache, return_lse=True, **serving, **inputs)
    wide = (k_cache, v_cache) if kv8 else (k_cache.double(), v_cache.double())  # FP8 caches: the reference dequantizes
    ref, ref_lse = reference(spec, q.double(), *wide, return_lse=True, dtype=torch.float64, **serving, **inputs)
    naive = reference(spec, q, k_cache, v_cache, dtype=dtype, **serving, **inputs)
    return _forward_result(shape, spec, out, lse, naive, ref, ref_lse)


def _check_fp8(kernel, shape: tuple, device: str, seed: int) -> Result:
    """A `dtype = fp8` spec (forward only): fp8_case's tensors, the naive model's O rounded to bf16 as the kernels'."""
    out, lse, ref, ref_lse, naive = fp8_case(kernel, shape, device, seed)
    return _forward_result(shape, kernel.spec, out, lse, naive.to(torch.bfloat16), ref, ref_lse)


def fp8_case(kernel, shape: tuple, device: str, seed: int = 0, granularity: str = "block"):
    """One call of a `dtype = fp8` spec's forward on random values of `shape` (B, Hq, Hkv, Nq, Nk): Q and K quantized
    per `granularity` (attngen.fp8.quantize) with the Hadamard rotation where head_dim is a power of two, V per
    head; (O, lse, the float64 attention of the dequantized values and its lse, the naive model of the kernels'
    error: float64 attention with P rounded to e4m3 as they round it)."""
    from .. import fp8

    spec = kernel.spec
    B, Hq, Hkv, Nq, Nk = shape
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(B, Hq, Nq, spec.head_dim, generator=gen).to(device)
    k, v = (torch.randn(B, Hkv, Nk, spec.head_dim, generator=gen).to(device) for _ in range(2))
    hadamard = spec.head_dim & (spec.head_dim - 1) == 0
    (q8, qs), (k8, ks), (v8, vs) = fp8.quantize(q, granularity, hadamard), fp8.quantize(k, granularity, hadamard), fp8.quantize(v, "head")
    scales = {"q_descale": qs, "k_descale": ks, "v_descale": vs}
    inputs = make_inputs(spec, B, Hq, Nq, Nk, device, gen)
    drop = {"dropout_p": spec.dropout, "seed": 1000 + seed} if spec.dropout > 0.0 else {}
    with torch.no_grad():
        out, lse = kernel(q8, k8, v8, return_lse=True, **scales, **drop, **inputs)
    ref, ref_lse = reference(spec, q8, k8, v8, return_lse=True, dtype=torch.float64, **scales, **drop, **inputs)
    naive = reference(spec, q8, k8, v8, dtype=torch.float64, fp8_p=True, **scales, **drop, **inputs)
    return out, lse, ref, ref_lse, naive


def _forward_result(shape: tuple, spec, out, lse, naive, ref, ref_lse) -> Result:
    """The Result of a forward-only check: O against the float64 reference with twice the naive model's error, the
    lse (same rows infinite, within LSE_RTOL of its largest magnitude), NaN anywhere."""
    res = Result(shape, spec.dtype.value)
    res.nan = bool(torch.isnan(out).any() or torch.isnan(lse).any())
    res.errors["out"] = _bound(out.cpu(), naive.cpu(), ref.cpu(), 2)
    ref_lse = ref_lse.cpu()
    finite = torch.isfinite(ref_lse)
    peak = ref_lse[finite].abs().max().item() if finite.any() else 0.0
    same = torch.equal(torch.isfinite(lse.cpu()), finite)
    res.errors["lse"] = (_err(lse.cpu()[finite], ref_lse[finite]) if same else float("inf"), 0.0, LSE_RTOL * max(1.0, peak))
    return res


def _gradient_terms(scale: float, q, k, v, do, group: int, lse_peak: float) -> float:
    """The largest magnitude among the terms the backward sums: scale*(|dO| |V|^T)*|Q or K| and
    (scale*(|Q| |K|^T) + |lse|) * |dO|."""
    if q.numel() == 0 or k.numel() == 0:
        return 0.0
    q, k, v, do = q.abs(), k.abs().repeat_interleave(group, dim=1), v.abs().repeat_interleave(group, dim=1), do.abs()
    dp = (do @ v.transpose(-1, -2)).max().item()
    score = scale * (q @ k.transpose(-1, -2)).max().item()
    return max(scale * dp * max(q.max().item(), k.max().item()), (score + lse_peak) * do.max().item())


def _read_derivatives(kernel, q, k, inputs: dict):
    """(the score variables of every pair, the inputs detached, |d score / d read| per differentiated read), in
    float64: shared by both bounds on the input gradients. None when there is no pair."""
    if q.numel() == 0 or k.numel() == 0:
        return None
    spec = kernel.spec
    kf = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    env = score_env((q @ kf.transpose(-1, -2)) * spec.softmax_scale)
    scope = Scope("score", SCORE_VARS, spec.inputs_by_name)
    detached = {name: t.detach() for name, t in inputs.items()}
    return env, detached, [torch.as_tensor(evaluate(g.derivative, env, detached, scope, torch.float64)).abs() for g in kernel.plan.read_grads]


def _error_through_delta(kernel, q, k, v, do, out_err, inputs: dict, reads) -> dict[str, float]:
    """What the forward's own error (already checked) adds to dQ and dK: the backward reads O back to form
    delta = rowsum(dO * O), as FlashAttention does, so delta is off by at most e_i = sum_d |dO_id| |O_id - O*_id|,
    and dS = P (dP - delta) by P e. That gives |dQ_id| <= scale * e_i * (P |K|)_id and |dK_jd| <=
    scale * (P^T (e |Q|))_jd (summed over the query heads of a key/value head). The naive reference has no such
    term (its autograd never reads O back): with dropout and a single key, where the naive error is 0, this is
    the whole difference. The dq and dk terms leave out the score modification's derivative; float64."""
    if q.numel() == 0 or k.numel() == 0:
        return {}
    p = probabilities(kernel.spec, q, k, dtype=torch.float64, **{n: t.detach() for n, t in inputs.items()}).detach()
    group = q.shape[1] // k.shape[1]
    e = (do.abs() * out_err.abs().to(do)).sum(-1)  # (B, Hq, Nq)
    scale = kernel.spec.softmax_scale
    kf = k.abs().repeat_interleave(group, dim=1)
    dq = scale * (e[..., None] * (p @ kf)).max().item()
    dk = scale * (p.transpose(-1, -2) @ (e[..., None] * q.abs()))  # (B, Hq, Nk, D)
    dk = dk.view(k.shape[0], k.shape[1], group, *dk.shape[2:]).sum(2).max().item()
    out = {"dq": dq, "dk": dk}
    # a float input's gradient sums P (dP - delta) |d score / d read| over the pairs that read each element: the
    # reference's own gather (evaluate on a zero copy of the input) sums P e |d| into the elements the same way
    env, detached, derivatives = reads
    scope = Scope("score", SCORE_VARS, kernel.spec.inputs_by_name)
    for g, d in zip(kernel.plan.read_grads, derivatives):
        probe = torch.zeros_like(detached[g.read.input], dtype=torch.float64, requires_grad=True)
        gathered = evaluate(g.read, env, {**detached, g.read.input: probe}, scope, torch.float64)
        weight = torch.nan_to_num(p * e[..., None] * d, posinf=0.0)
        (bound,) = torch.autograd.grad((weight * gathered).sum(), probe)
        name = f"d{g.read.input}"
        out[name] = out.get(name, 0.0) + bound.max().item()
    return out


def _sink_reads(spec) -> dict[str, list]:
    """The float inputs a sink reads, each with its reads (Index nodes) that d sink / d read does not make 0."""
    out: dict[str, list] = {}
    if spec.sink is None:
        return out
    scope = Scope("sink", SINK_VARS, spec.inputs_by_name)
    for read in input_reads(spec.sink):
        if spec.inputs_by_name[read.input].type is Type.FLOAT and read_derivative(spec.sink, scope, read) != Const(0.0, Type.FLOAT):
            out.setdefault(read.input, []).append(read)
    return out


def _sink_bounds(spec, ref, ref_lse, do, out_err, inputs: dict, kv_len: int) -> dict[str, tuple[float, float]]:
    """Per float input the sink reads: (the largest term its gradient sums, what the forward's own error adds).
    A row's gradient of its sink is p_sink * (d loss / d lse - delta), delta = rowsum(dO * O), each term at most
    p_sink * sum_d |dO| |O| * |d sink / d read|; the backward forms delta from the forward's O, off by
    e = sum_d |dO| |O - O*| (as in _error_through_delta), which reaches the input as p_sink * e * |d sink / d read|,
    summed into the elements as the reference's own gather sums it. float64."""
    out = {}
    reads = _sink_reads(spec)
    if not reads or ref.numel() == 0:
        return out
    scope = Scope("sink", SINK_VARS, spec.inputs_by_name)
    detached = {name: t.detach() for name, t in inputs.items()}
    env = score_env(ref[..., :1]) | {"kv_len": kv_len}  # b, h, q_idx of every row, (B, H, Nq, 1)
    sink = sink_rows(spec, detached, *ref_lse.shape, kv_len, ref.device, torch.float64)[..., None]
    p_sink = torch.nan_to_num(torch.exp(sink - ref_lse[..., None]))  # (B, H, Nq, 1)
    row_term = p_sink * (do.abs() * ref.abs()).sum(-1, keepdim=True)
    row_err = p_sink * (do.abs() * out_err.abs().to(do)).sum(-1, keepdim=True)
    for name, found in reads.items():
        term, bound = 0.0, 0.0
        for read in found:
            d = torch.as_tensor(evaluate(read_derivative(spec.sink, scope, read), env, detached, scope, torch.float64), device=ref.device).abs()
            term = max(term, 2 * (row_term * d).max().item())
            probe = torch.zeros_like(detached[name], dtype=torch.float64, requires_grad=True)
            gathered = evaluate(read, env, {**detached, name: probe}, scope, torch.float64)
            (summed,) = torch.autograd.grad((torch.nan_to_num(row_err * d, posinf=0.0) * gathered).sum(), probe)
            bound += summed.max().item()
        out[name] = (term, bound)
    return out


def _read_terms(kernel, k, v, do, reads) -> dict[str, float]:
    """Per differentiated input: the largest term its gradient sums, |dP| * |d score / d read| (|delta| <= max
    |dP|, so each term d loss/d score * d score/d read = P (dP - delta) * ... is at most twice that)."""
    out: dict[str, float] = {}
    if reads is None:
        return {g.read.input: 0.0 for g in kernel.plan.read_grads}
    vf = v.repeat_interleave(do.shape[1] // k.shape[1], dim=1)
    dp = (do.abs() @ vf.abs().transpose(-1, -2)).max().item()
    for g, d in zip(kernel.plan.read_grads, reads[2]):
        d = d[torch.isfinite(d)]
        out[g.read.input] = max(out.get(g.read.input, 0.0), 2 * dp * (d.max().item() if d.numel() else 0.0))
    return out


def _bound(got: torch.Tensor, naive: torch.Tensor, ref: torch.Tensor, factor: int, terms: float = 0.0) -> tuple[float, float, float]:
    naive_err = _err(naive, ref)
    return _err(got, ref), naive_err, factor * naive_err + _floor(ref, terms)


def format_table(title: str, results: list[Result]) -> str:
    names = list(dict.fromkeys(["out", "lse", "dq", "dk", "dv"] + [n for r in results for n in r.errors]))
    head = f"{'shape (B,Hq,Hkv,Nq,Nk)':<26}{'dtype':<6}" + "".join(f"{n + ' err/bound':>20}" for n in names) + "  status"
    lines = [title, head, "-" * len(head)]
    for r in results:
        cells = []
        for n in names:
            if n in r.errors:
                err, _, bound = r.errors[n]
                cells.append(f"{err:9.2e}/{bound:8.2e}{'!' if err > bound else ' '}")
            else:
                cells.append(f"{'-':>19} ")
        status = "NaN" if r.nan else ("ok" if r.ok else "FAIL")
        lines.append(f"{str(r.shape):<26}{r.dtype:<6}" + "".join(f"{c:>20}" for c in cells) + f"  {status}")
    return "\n".join(lines)
