"""The gradients of a spec's declared float inputs (a bias the score reads): the dQ kernel writes each read's
terms, reduced here per input element in a fixed order (deterministic)."""
from __future__ import annotations

import torch

from ..lang.expr import SCORE_VARS, Scope
from ..lang.spec import Index, Spec, Var
from .checks import Dims
from .evaluate import evaluate

_AXES = ("b", "h", "q_idx", "kv_idx")  # the axes of a direct read's term buffer (B, H, Nq, Nk)


def reduce_input_grads(spec: Spec, dims: Dims, inputs: dict[str, torch.Tensor], reads, terms) -> dict[str, torch.Tensor]:
    """Each float input's gradient from the dQ kernel's terms, in a fixed order (deterministic). An input with
    no differentiable read in the score (read only by the mask, or not at all) gets zeros: the mask is
    piecewise constant."""
    grads = {name: torch.zeros(t.shape, device=t.device, dtype=torch.float64 if t.device.type == "cpu" else torch.float32)
             for name, t in inputs.items() if t.is_floating_point()}
    scope = Scope("score", SCORE_VARS, spec.inputs_by_name)
    index_inputs = {name: t.detach() for name, t in inputs.items() if not t.is_floating_point()}
    for g, term in zip(reads, terms):
        x = inputs[g.read.input]
        grad = grads[g.read.input]
        if g.kind == "direct":  # sum the term over the axes the read does not use, then place it
            _add_direct(g.read, term, grad)
            continue
        if g.kind == "uniform":  # one element per (b, h): the rows' sums
            term = term.sum(2)
        # uniform and scatter: evaluate the read's indices at every (b, h[, q_idx, kv_idx]) of the term
        env = {name: torch.arange(n, device=term.device).view([n if a == axis else 1 for a in range(term.dim())])
               for axis, (name, n) in enumerate(zip(_AXES, term.shape))}
        env |= {"q_len": dims.q_len, "kv_len": dims.kv_len}
        valid = torch.ones(term.shape, dtype=torch.bool, device=term.device)
        flat = torch.zeros(term.shape, dtype=torch.long, device=term.device)
        for i, size in zip(g.read.indices, x.shape):
            i = torch.as_tensor(evaluate(i, env, index_inputs, scope, torch.float64), device=term.device).long().broadcast_to(term.shape)
            valid &= (i >= 0) & (i < size)  # reads outside the input gave 0: no gradient
            flat = flat * size + i.clamp(0, size - 1)
        grad += _sum_by_element(flat[valid], term[valid], x.numel()).view(x.shape).to(grad)
    return {name: g.to(inputs[name].dtype) for name, g in grads.items()}


def _add_direct(read: Index, term: torch.Tensor, grad: torch.Tensor) -> None:
    """grad[read's indices] += the (B, H, Nq, Nk) term summed over the axes the read does not name."""
    used = [i.name for i in read.indices if isinstance(i, Var)]
    t = term.sum(dim=[a for a, name in enumerate(_AXES) if name not in used]) if len(used) < 4 else term
    t = t.permute([sorted(used, key=_AXES.index).index(name) for name in used])
    target, source = [], [slice(None)] * len(used)
    for i, size in zip(read.indices, grad.shape):
        if isinstance(i, Var):
            n = min(size, t.shape[used.index(i.name)])
            target.append(slice(0, n))
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
