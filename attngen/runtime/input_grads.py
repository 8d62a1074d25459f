"""The gradients of a spec's declared float inputs: those the score reads (a bias), whose terms the dQ kernel
writes, and those a sink reads, from each row's gradient of its sink; reduced here per input element in a fixed
order (deterministic)."""
from __future__ import annotations

import torch

from ..lang.algebra import read_derivative
from ..lang.expr import SCORE_VARS, SINK_VARS, Scope, input_reads
from ..lang.spec import Const, Index, Spec, Var
from .checks import Dims
from .evaluate import evaluate

_AXES = ("b", "h", "q_idx", "kv_idx")  # the axes of a direct read's term buffer (B, H, Nq, Nk)
LOG2E = 1.4426950408889634


def reduce_input_grads(spec: Spec, dims: Dims, inputs: dict[str, torch.Tensor], reads, terms,
                       row_sink_grads: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """Each float input's gradient from the dQ kernel's terms (the score's reads) and, for a spec with a sink,
    from row_sink_grads (B, H, Nq): d loss / d sink of each query row, times d sink / d read there. Reduced in a fixed
    order (deterministic). An input with no differentiable read (read only by the mask, or not at all) gets
    zeros: the mask is piecewise constant."""
    if not reads and row_sink_grads is not None:
        direct = _sums_of_rows(spec, dims, inputs, row_sink_grads)
        if direct is not None:
            return direct
    grads = grad_buffers(inputs)
    add_score_terms(grads, spec, dims, inputs, reads, terms)
    if row_sink_grads is not None:
        add_sink_terms(grads, spec, dims, inputs, row_sink_grads)
    return {name: g.to(inputs[name].dtype) for name, g in grads.items()}


def grad_buffers(inputs: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Zeroed sums for the float inputs' gradients: float64 on the CPU, float32 on a GPU."""
    return {name: torch.zeros(t.shape, device=t.device, dtype=torch.float64 if t.device.type == "cpu" else torch.float32)
            for name, t in inputs.items() if t.is_floating_point()}


def add_score_terms(grads: dict[str, torch.Tensor], spec: Spec, dims: Dims, inputs: dict[str, torch.Tensor], reads, terms,
                    at: tuple[int, int, int, int] = (0, 0, 0, 0)) -> None:
    """grads (grad_buffers) += the gradients the dQ kernel's terms give the inputs the score reads, one term per read
    (ReadGrad): (B, H, Nq, Nk) for reads at q_idx or kv_idx, (B, H, Nq) rows for the others. at: the positions of the
    terms' first b, h, q_idx and kv_idx among the call's (a context-parallel shard's), which dims describe."""
    scope = Scope("score", SCORE_VARS, spec.inputs_by_name)
    index_inputs = {name: t.detach() for name, t in inputs.items() if not t.is_floating_point()}
    for g, term in zip(reads, terms):
        if g.kind == "direct":  # sum the term over the axes the read does not use, then place it
            _add_direct(g.read, term, grads[g.read.input], at)
            continue
        if g.kind == "uniform":  # one element per (b, h): the rows' sums
            term = term.sum(2)
        _scatter(g.read, term, grads[g.read.input], inputs[g.read.input].shape, dims, index_inputs, scope, at)


def add_sink_terms(grads: dict[str, torch.Tensor], spec: Spec, dims: Dims, inputs: dict[str, torch.Tensor], row_sink_grads: torch.Tensor) -> None:
    """grads (grad_buffers) += the gradients of the float inputs the sink reads, from each query row's d loss / d
    sink (B, H, Nq) times d sink / d read there."""
    sink_scope = Scope("sink", SINK_VARS, spec.inputs_by_name)
    values = {name: t.detach() for name, t in inputs.items()}
    for read, slope in _sink_slopes(spec):
        if not inputs[read.input].is_floating_point():
            continue
        if isinstance(slope, Const):  # gpt-oss's sinks[h]: d sink / d read = 1, nothing to evaluate
            term = row_sink_grads.double() * slope.value
        else:
            slope = evaluate(slope, _axes_env(row_sink_grads, dims), values, sink_scope, torch.float64)
            term = (row_sink_grads.double() * torch.as_tensor(slope, device=row_sink_grads.device).double()).broadcast_to(row_sink_grads.shape)
        _scatter(read, term, grads[read.input], inputs[read.input].shape, dims, values, sink_scope)


def shard_row_terms(sums: torch.Tensor, row_sums: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor | None,
                    dlse: torch.Tensor | None) -> torch.Tensor:
    """The term of each query row (B, H, Nq) of a score read that does not depend on q_idx or kv_idx (kind
    "uniform"), from what the shard kernels give over every shard of the row's keys, added: sums (2, B, H, Nq), the
    row's sum of P dP d and of P d; row_sums (2, B, H, Nq), its sum of P and of P dP. As the kernel of a whole row
    does, delta comes from the same P and dP (divided by the row's mass, P's sum plus a sink's share p_sink =
    2^(sink - lse), which the rounding of lse keeps from being exactly 1): sum P dP d - delta * sum P d, with
    delta = sum P dP / mass - d loss / d lse * log2(e). lse and sink (or None) in log2 units, dlse (or None) the
    gradient reaching the lse in log2 units."""
    mass = row_sums[0]
    if sink is not None:
        mass = mass + torch.where(lse == float("-inf"), 0.0, torch.exp2(sink - lse))
    delta = row_sums[1] / torch.where(mass == 0.0, 1.0, mass)
    if dlse is not None:
        delta = delta - dlse.float() * LOG2E
    return sums[0] - delta * sums[1]


_SLOPES: dict[int, tuple[Spec, tuple]] = {}  # id(spec) -> (spec, its sink's reads and slopes); hashing a spec costs more


def _sink_slopes(spec: Spec) -> tuple:
    """Each input read of the spec's sink with d sink / d read (an expression), derived once per spec object."""
    entry = _SLOPES.get(id(spec))
    if entry is None or entry[0] is not spec:
        scope = Scope("sink", SINK_VARS, spec.inputs_by_name)
        entry = _SLOPES[id(spec)] = (spec, tuple((read, read_derivative(spec.sink, scope, read)) for read in input_reads(spec.sink)))
    return entry[1]


def _sums_of_rows(spec: Spec, dims: Dims, inputs: dict[str, torch.Tensor], rows: torch.Tensor) -> dict[str, torch.Tensor] | None:
    """reduce_input_grads where the sink alone reads float inputs, each once, at distinct index variables that span
    the input exactly (gpt-oss's sinks[h] of an (H,) input), with a constant slope: each such input's gradient is
    the rows' gradients times the slope, summed over the other axes (one float32 reduction on the rows' device,
    the same order every run: a few thousand rows a head, far inside the gradient's error budget). None where the
    reads are not all of that form."""
    grads = {}
    sizes = dict(zip(_AXES, rows.shape))
    for read, slope in _sink_slopes(spec):
        t = inputs[read.input]
        if not t.is_floating_point():
            continue
        names = [i.name if isinstance(i, Var) else None for i in read.indices]
        if (read.input in grads or not isinstance(slope, Const) or not _plain(read, 3) or None in names
                or tuple(t.shape) != tuple(sizes[n] for n in names)):
            return None
        others = [a for a, name in enumerate(_AXES[:3]) if name not in names]
        g = rows.sum(dim=others) if others else rows
        order = [sorted(names, key=_AXES.index).index(n) for n in names]
        if order != sorted(order):
            g = g.permute(order)
        grads[read.input] = (g * slope.value if slope.value != 1 else g).to(t.dtype)
    return {name: grads[name] if name in grads else torch.zeros_like(t) for name, t in inputs.items() if t.is_floating_point()}


def sink_share_grads(sink: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """d loss / d sink of each query row from its sink and lse (log2 units) and the backward's delta (row_delta):
    with p_sink = exp(sink - lse) the sink's share of the row's softmax, O's rows shrink by it (d O / d sink =
    -p_sink O) and the lse grows (d lse / d sink = p_sink), so p_sink * (d loss / d lse - rowsum(dO * O)) =
    -p_sink * delta. (The Triton backward's pre-pass computes the same in its kernel.)"""
    p_sink = torch.where(lse == float("-inf"), 0.0, torch.exp2(sink - lse))
    return -p_sink * delta


def unpacked_rows(rows: torch.Tensor, varlen) -> torch.Tensor:
    """Packed sequences' per-row values (1, H, packed rows) laid out by sequence, (sequences, H, longest), zeros past
    each sequence's end: the (b, h, q_idx) axes along which reduce_input_grads sums a read's gradient."""
    cu_q, max_q = varlen[0], varlen[2]
    starts = cu_q[:-1].long()
    pos = torch.arange(max_q, device=rows.device)
    at = (starts[:, None] + pos).clamp(max=rows.shape[2] - 1)  # (sequences, longest)
    inside = pos < (cu_q[1:].long() - starts)[:, None]
    return torch.where(inside, rows[0][:, at], 0.0).transpose(0, 1)


def row_delta(o: torch.Tensor, do: torch.Tensor, dlse: torch.Tensor | None) -> torch.Tensor:
    """Each row's rowsum(dO * O) - dlse * log2(e) in float32 (dlse: the gradient reaching the lse, log2 units, or
    None), as the Triton backward's pre-pass computes it, for rows no backward kernel ran over."""
    delta = (do.float() * o.float()).sum(-1)
    return delta if dlse is None else delta - dlse.float() * LOG2E


def _axes_env(term: torch.Tensor, dims: Dims, at: tuple[int, ...] = (0, 0, 0, 0)) -> dict:
    """b, h[, q_idx, kv_idx] as index tensors broadcasting over a term of shape (B, H[, Nq, Nk]) whose first
    element is at `at` among the call's, and the lengths."""
    env = {name: (torch.arange(n, device=term.device) + at[axis]).view([n if a == axis else 1 for a in range(term.dim())])
           for axis, (name, n) in enumerate(zip(_AXES, term.shape))}
    return env | {"q_len": dims.q_len, "kv_len": dims.kv_len}


def _scatter(read: Index, term: torch.Tensor, grad: torch.Tensor, shape, dims: Dims, inputs: dict, scope: Scope,
             at: tuple[int, ...] = (0, 0, 0, 0)) -> None:
    """grad[read's indices at each element of the term] += that element: the indices evaluated at every (b, h[,
    q_idx, kv_idx]) of the term (its first element at `at`); a read outside the input was 0 there, so it gets no
    gradient. A read at plain indices (gpt-oss's sinks[h]) is the term summed along the other axes instead, on
    the device."""
    if _plain(read, term.dim()):
        _add_direct(read, term, grad, at)
        return
    env = _axes_env(term, dims, at)
    valid = torch.ones(term.shape, dtype=torch.bool, device=term.device)
    flat = torch.zeros(term.shape, dtype=torch.long, device=term.device)
    for i, size in zip(read.indices, shape):
        i = torch.as_tensor(evaluate(i, env, inputs, scope, torch.float64), device=term.device).long().broadcast_to(term.shape)
        valid &= (i >= 0) & (i < size)
        flat = flat * size + i.clamp(0, size - 1)
    grad += _sum_by_element(flat[valid], term[valid], grad.numel()).view(shape).to(grad)


def _plain(read: Index, ndim: int) -> bool:
    """Whether each index of the read is a constant or a distinct axis of a term of ndim axes (b, h, q_idx, kv_idx
    in that order): its gradient is then the term summed over the other axes (_add_direct), no scatter."""
    names = [i.name for i in read.indices if isinstance(i, Var)]
    return (len(set(names)) == len(names) and all(n in _AXES[:ndim] for n in names)
            and all(isinstance(i, Var) or (isinstance(i, Const) and isinstance(i.value, int)) for i in read.indices))


def _add_direct(read: Index, term: torch.Tensor, grad: torch.Tensor, at: tuple[int, ...] = (0, 0, 0, 0)) -> None:
    """grad[read's indices] += the term, (B, H, Nq, Nk) or its first axes whose first element is at `at`, summed
    over the axes the read does not name. A reduction along whole axes: the same order every run
    (deterministic), on the term's device."""
    axes = _AXES[:term.dim()]
    used = [i.name for i in read.indices if isinstance(i, Var)]
    t = term.sum(dim=[a for a, name in enumerate(axes) if name not in used]) if len(used) < len(axes) else term
    t = t.permute([sorted(used, key=_AXES.index).index(name) for name in used])
    target, source = [], [slice(None)] * len(used)
    for i, size in zip(read.indices, grad.shape):
        if isinstance(i, Var):
            first = at[_AXES.index(i.name)]
            n = min(size - first, t.shape[used.index(i.name)])
            if n <= 0:
                return  # past the input's end: read as 0, no gradient
            target.append(slice(first, first + n))
            source[used.index(i.name)] = slice(0, n)
        elif 0 <= i.value < size:
            target.append(i.value)
        else:
            return  # a constant index outside the input: read as 0, no gradient
    grad[tuple(target)] += t[tuple(source)].to(grad)


def _sum_by_element(flat: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    """out[j] = sum of values[flat == j] in float64, in index order (deterministic): CPU's index_add_ is a
    sequential loop. CUDA's index_add_ and scatter_add_ use atomics, and a GPU version built from a stable sort
    and a float64 cumsum was not bit-reproducible on the H100, so GPU terms are reduced on the host."""
    out = torch.zeros(n, dtype=torch.float64).index_add_(0, flat.cpu(), values.cpu().double())
    return out.to(values.device)
