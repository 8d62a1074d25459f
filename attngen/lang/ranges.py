"""Integer ranges: the values an integer expression can take in any call.

The language's integers are mathematical integers. The kernels compute them in int32 where that is exact and
in int64 where it may not be, and a spec whose integer arithmetic could leave int64 is refused (check.py).
Both decisions come from `integer_range`, a sound interval evaluation over every call attngen accepts:
- the index variables b, h, q_idx, kv_idx (and q_blk, kv_blk) lie in [0, MAX_EXTENT), the lengths q_len and
  kv_len in [0, MAX_EXTENT] (a call with a larger batch, head count or length is refused at run time);
- an integer input read may hold any value of its element type (int8: [-128, 127], ..., int64).
Division semantics are total, identical in the kernels and the reference: a // 0 = 0 and a % 0 = a (so
a == (a // b) * b + a % b always holds); otherwise `//` rounds toward -inf and `%` takes the divisor's sign.

This module needs no types: it is called on integer-typed expressions only, whose operands are integers too
(the typing rules of expr.typeof), except the condition of `where`, which it does not evaluate.
"""
from __future__ import annotations

from .spec import Binary, Call, Const, Expr, Index, InputDecl, Unary, Var

MAX_EXTENT = 2**30  # batch, heads and lengths must be below this (checked by the runtime for every call)

INT32 = (-(2**31), 2**31 - 1)
INT64 = (-(2**63), 2**63 - 1)

_VARS = {
    "b": (0, MAX_EXTENT - 1),
    "h": (0, MAX_EXTENT - 1),
    "q_idx": (0, MAX_EXTENT - 1),
    "kv_idx": (0, MAX_EXTENT - 1),
    "q_blk": (0, MAX_EXTENT - 1),
    "kv_blk": (0, MAX_EXTENT - 1),
    "q_len": (0, MAX_EXTENT),
    "kv_len": (0, MAX_EXTENT),
}
ELEMENT_RANGES = {
    "bool": (0, 1),
    "int8": (-(2**7), 2**7 - 1),
    "int16": (-(2**15), 2**15 - 1),
    "int32": INT32,
    "int64": INT64,
}


def within(r: tuple[int, int], bounds: tuple[int, int]) -> bool:
    return bounds[0] <= r[0] and r[1] <= bounds[1]


def may_be_zero(r: tuple[int, int]) -> bool:
    return r[0] <= 0 <= r[1]


def _bits(r: tuple[int, int]) -> int:
    """The smallest k with -2**k <= lo and hi < 2**k: every bitwise result of such operands stays in that range."""
    lo, hi = r
    return max((-lo - 1).bit_length() if lo < 0 else 0, hi.bit_length() if hi > 0 else 0)


def integer_range(e: Expr, inputs: dict[str, InputDecl]) -> tuple[int, int]:
    """(lo, hi), inclusive, of an integer expression over every accepted call. Exact integer arithmetic."""
    if isinstance(e, Const):
        return (int(e.value), int(e.value))
    if isinstance(e, Var):
        return _VARS[e.name]
    if isinstance(e, Index):
        return ELEMENT_RANGES[inputs[e.input].dtype]
    if isinstance(e, Unary):  # "-" ("not" is boolean)
        lo, hi = integer_range(e.operand, inputs)
        return (-hi, -lo)
    if isinstance(e, Binary):
        a, b = integer_range(e.lhs, inputs), integer_range(e.rhs, inputs)
        if e.op == "+":
            return (a[0] + b[0], a[1] + b[1])
        if e.op == "-":
            return (a[0] - b[1], a[1] - b[0])
        if e.op == "*":
            products = [x * y for x in a for y in b]
            return (min(products), max(products))
        if e.op == "//":
            if b[0] == b[1] and b[0] != 0:  # a constant divisor: floor is monotone in a
                ends = [x // b[0] for x in a]
                return (min(ends), max(ends))
            m = max(abs(a[0]), abs(a[1]))  # |a // b| <= |a| for |b| >= 1, and a // 0 = 0
            return (-m, m)
        if e.op == "%":
            m = max(abs(b[0]), abs(b[1])) - 1  # |a % b| < |b|, with the sign of b
            r = (0 if b[0] > 0 else -m, 0 if b[1] < 0 else m)
            return (min(r[0], a[0]), max(r[1], a[1])) if may_be_zero(b) else r  # a % 0 = a
        if e.op in ("&", "|", "^"):
            k = max(_bits(a), _bits(b))
            nonneg = a[0] >= 0 and b[0] >= 0 or (e.op == "&" and (a[0] >= 0 or b[0] >= 0))
            return (0 if nonneg else -(2**k), 2**k - 1)
        raise TypeError(f"not an integer operation: {e.op}")  # internal
    if isinstance(e, Call):
        if e.func == "where":
            a, b = integer_range(e.args[1], inputs), integer_range(e.args[2], inputs)
            return (min(a[0], b[0]), max(a[1], b[1]))
        args = [integer_range(x, inputs) for x in e.args]
        if e.func == "min":
            return (min(r[0] for r in args), min(r[1] for r in args))
        if e.func == "max":
            return (max(r[0] for r in args), max(r[1] for r in args))
        if e.func == "abs":
            (lo, hi), = args
            return (0 if lo <= 0 <= hi else min(abs(lo), abs(hi)), max(abs(lo), abs(hi)))
    raise TypeError(f"not an integer expression: {e!r}")  # internal
