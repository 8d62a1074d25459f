"""The expression IR evaluated with torch: the naive reference's scores and masks, FlexAttention's twins of a spec
(attngen bench), and the indices of declared inputs' gradients (runtime/input_grads.py). Independent of the
code generators' lowering (attngen/codegen/expr.py), which the tests compare with it."""
from __future__ import annotations

import torch

from ..lang.algebra import FLOAT32_TINY
from ..lang.expr import SINK_VARS, Scope, typeof
from ..lang.spec import Binary, Call, Const, Expr, Index, Type, Unary, Var


def _tensor(x, fdtype: torch.dtype) -> torch.Tensor:
    """A tensor of x; Python floats become `fdtype` (torch.as_tensor would make them float32)."""
    if torch.is_tensor(x):
        return x
    return torch.as_tensor(x, dtype=fdtype) if isinstance(x, float) else torch.as_tensor(x)


def sink_rows(spec, inputs: dict, batch: int, heads: int, q_len: int, kv_len: int, device, fdtype: torch.dtype,
              first_batch: int = 0) -> torch.Tensor:
    """The spec's sink at every query row, (batch, heads, q_len) in `fdtype`; b counts from first_batch (a packed
    sequence's index). Differentiable with torch autograd through the inputs it reads."""
    env = {"b": torch.arange(first_batch, first_batch + batch, device=device).view(batch, 1, 1),
           "h": torch.arange(heads, device=device).view(1, heads, 1), "q_idx": torch.arange(q_len, device=device).view(1, 1, q_len),
           "q_len": q_len, "kv_len": kv_len}
    value = evaluate(spec.sink, env, inputs, Scope("sink", SINK_VARS, spec.inputs_by_name), fdtype)
    return torch.as_tensor(value, device=device).to(fdtype).expand(batch, heads, q_len)


def evaluate(e: Expr, env: dict, inputs: dict, scope: Scope, fdtype: torch.dtype):
    """Value of an expression with torch: `env` maps variables to tensors or numbers, `inputs` names to tensors.
    The language's semantics (attngen/lang/ranges.py): exact integers (int64 here), floor division and a remainder
    with the divisor's sign, a // 0 = 0 and a % 0 = a; true division; on floats a // b = floor(a / b) and
    a % b = a - floor(a / b) * b, IEEE at b = 0; min and max propagate NaN."""
    if isinstance(e, Const):
        return e.value
    if isinstance(e, Var):
        return env[e.name]
    if isinstance(e, Index):
        t = inputs[e.input]
        idx = [torch.as_tensor(evaluate(i, env, inputs, scope, fdtype), device=t.device).long() for i in e.indices]
        idx = torch.broadcast_tensors(*idx)
        valid = torch.ones_like(idx[0], dtype=torch.bool)
        clamped = []
        for dim, i in enumerate(idx):
            valid = valid & (i >= 0) & (i < t.shape[dim])  # not in place: under vmap (FlexAttention) shapes differ
            clamped.append(i.clamp(0, t.shape[dim] - 1))
        val = t[tuple(clamped)]
        if val.dtype.is_floating_point:
            val = val.to(fdtype)
        elif val.dtype != torch.bool:
            val = val.long()  # integer arithmetic is exact: int64 holds every value a checked spec computes
        return torch.where(valid, val, torch.zeros((), dtype=val.dtype, device=val.device))  # outside the tensor: 0
    if isinstance(e, Unary):
        a = evaluate(e.operand, env, inputs, scope, fdtype)
        if e.op == "not":
            return ~a if torch.is_tensor(a) else not a
        return -a
    if isinstance(e, Binary):
        a = evaluate(e.lhs, env, inputs, scope, fdtype)
        b = evaluate(e.rhs, env, inputs, scope, fdtype)
        op = e.op
        if op in ("and", "&"):
            return torch.as_tensor(a) & torch.as_tensor(b)
        if op in ("or", "|"):
            return torch.as_tensor(a) | torch.as_tensor(b)
        if op == "^":
            return torch.as_tensor(a) ^ torch.as_tensor(b)
        if op == "/":
            return _tensor(a, fdtype).to(fdtype) / _tensor(b, fdtype).to(fdtype)
        if op in ("//", "%"):
            ta, tb = _tensor(a, fdtype), _tensor(b, fdtype)
            if typeof(e, scope) is not Type.INT:  # floats: floor(a / b) and a - floor(a / b) * b (IEEE at b = 0)
                ta, tb = ta.to(fdtype), tb.to(fdtype)
                q = ta / tb
                q = torch.floor(torch.where(q.abs() < FLOAT32_TINY, q * 0.0, q))  # below float32's normals: a signed zero
                return q if op == "//" else ta - q * tb
            # integers: floor division, remainder with the divisor's sign; a // 0 = 0 and a % 0 = a
            zero = tb == 0
            q = torch.div(ta, torch.where(zero, torch.ones_like(tb), tb), rounding_mode="floor")
            if op == "//":
                return torch.where(zero, torch.zeros_like(q), q)
            return torch.where(zero, ta, ta - q * tb)
        if op in ("+", "-", "*") and typeof(e, scope) is Type.FLOAT:
            # in fdtype: torch would multiply an integer tensor by a Python float in its default dtype (float32)
            a, b = _tensor(a, fdtype).to(fdtype), _tensor(b, fdtype).to(fdtype)
        return {
            "+": lambda: a + b,
            "-": lambda: a - b,
            "*": lambda: a * b,
            "<": lambda: a < b,
            "<=": lambda: a <= b,
            ">": lambda: a > b,
            ">=": lambda: a >= b,
            "==": lambda: a == b,
            "!=": lambda: a != b,
        }[op]()
    if isinstance(e, Call):
        args = [_tensor(evaluate(a, env, inputs, scope, fdtype), fdtype) for a in e.args]
        if e.func == "where":
            c, x, y = args
            if x.dtype.is_floating_point or y.dtype.is_floating_point:
                x, y = x.to(fdtype), y.to(fdtype)
            return torch.where(c, x, y)
        if e.func in ("min", "max"):
            out = args[0]
            for x in args[1:]:
                if out.dtype.is_floating_point or x.dtype.is_floating_point:
                    out, x = out.to(fdtype), x.to(fdtype)
                out = torch.minimum(out, x) if e.func == "min" else torch.maximum(out, x)
            return out
        a = args[0]
        if e.func == "abs":
            return a.abs()
        a = a.to(fdtype)
        return {"exp": torch.exp, "log": torch.log, "tanh": torch.tanh, "sqrt": torch.sqrt, "sigmoid": torch.sigmoid}[e.func](a)
    raise TypeError(e)
