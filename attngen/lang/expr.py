"""The expression IR: the language's variables and functions, typing, traversal and printing.

Everything downstream works from the AST nodes of spec.py, never from spec strings. Constant folding and
differentiation are in algebra.py, the sign and separability analyses in analysis.py, integer ranges in
ranges.py, interval analysis in intervals.py; the lowering to kernel code is the code generators'
(attngen/codegen/expr.py).
"""
from __future__ import annotations

import keyword
import math
from dataclasses import dataclass, field

from ..errors import SpecError
from .ranges import INT32, within
from .spec import ARITH_OPS, BIT_OPS, COMPARE_OPS, Binary, Call, Const, Expr, Index, InputDecl, Type, Unary, Var

# Variables of the language, with their type. Which ones an expression may use depends on the setting.
INDEX_VARS = ("b", "h", "q_idx", "kv_idx", "q_len", "kv_len")
MASK_VARS = frozenset(INDEX_VARS)
SCORE_VARS = frozenset(INDEX_VARS + ("score",))
SPARSITY_VARS = frozenset(("b", "h", "q_len", "kv_len", "q_blk", "kv_blk"))
SINK_VARS = frozenset(("b", "h", "q_idx", "q_len", "kv_len"))  # a sink is one logit per query row: no key, no score
VAR_TYPES = {name: Type.INT for name in INDEX_VARS + ("q_blk", "kv_blk")} | {"score": Type.FLOAT}

# name -> (min args, max args or None for "any")
FUNCTIONS = {
    "min": (2, None),
    "max": (2, None),
    "abs": (1, 1),
    "where": (3, 3),
    "exp": (1, 1),
    "log": (1, 1),
    "tanh": (1, 1),
    "sqrt": (1, 1),
    "sigmoid": (1, 1),
}
FLOAT_FUNCTIONS = ("exp", "log", "tanh", "sqrt", "sigmoid")


# ---- typing ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Scope:
    """What an expression may refer to: variables of its setting and the declared inputs."""

    setting: str  # "mask" | "score" | "sparsity", for messages
    variables: frozenset[str]
    inputs: dict[str, InputDecl] = field(default_factory=dict)


def is_number(t: Type) -> bool:
    return t in (Type.INT, Type.FLOAT)


def promote(a: Type, b: Type) -> Type:
    return Type.INT if a is Type.INT and b is Type.INT else Type.FLOAT


def typeof(e: Expr, scope: Scope) -> Type:
    """The type of `e`, or SpecError at the first node that is wrong (with its span)."""
    if isinstance(e, Const):
        if e.type is Type.FLOAT and not math.isfinite(e.value):
            raise SpecError(f"number {e.value!r} is not finite", e.span)
        if e.type is Type.INT and not within((e.value, e.value), INT32):
            raise SpecError(f"integer {e.value} does not fit in 32 bits", e.span)
        return e.type
    if isinstance(e, Var):
        if e.name in scope.variables:
            return VAR_TYPES[e.name]
        if e.name in scope.inputs:
            raise SpecError(f"input {e.name!r} is a tensor: index it, e.g. {e.name}[b, q_idx]", e.span)
        if e.name in VAR_TYPES:
            raise SpecError(
                f"{e.name!r} cannot be used in {scope.setting}; available here: {', '.join(sorted(scope.variables))}",
                e.span,
            )
        raise SpecError(
            f"unknown name {e.name!r} in {scope.setting}; expected one of: "
            f"{', '.join(sorted(scope.variables | set(scope.inputs)))}",
            e.span,
        )
    if isinstance(e, Index):
        decl = scope.inputs.get(e.input)
        if decl is None:
            known = ", ".join(sorted(scope.inputs)) or "none declared"
            name = e.input if e.input.isidentifier() and not keyword.iskeyword(e.input) and e.input not in ("input", "attention") else "ids"
            raise SpecError(f"{e.input!r} is not a declared input (inputs: {known}); declare it with `input {name}: int32[B, N]`"
                            + ("" if name == e.input else f" and index `{name}[...]` ({e.input!r} is reserved)"), e.span)
        if len(e.indices) != len(decl.dims):
            raise SpecError(f"input {e.input!r} has {len(decl.dims)} dimension(s), indexed with {len(e.indices)}", e.span)
        for idx in e.indices:
            if typeof(idx, scope) is not Type.INT:
                raise SpecError(f"indices of {e.input!r} must be integers", idx.span)
        return decl.type
    if isinstance(e, Unary):
        t = typeof(e.operand, scope)
        if e.op == "not":
            if t is not Type.BOOL:
                raise SpecError(f"`not` needs a boolean, got {t.value}", e.span)
            return Type.BOOL
        if not is_number(t):
            raise SpecError(f"unary `-` needs a number, got {t.value}", e.span)
        return t
    if isinstance(e, Binary):
        lt, rt = typeof(e.lhs, scope), typeof(e.rhs, scope)
        if e.op in ("and", "or"):
            for side, t in ((e.lhs, lt), (e.rhs, rt)):
                if t is not Type.BOOL:
                    raise SpecError(f"`{e.op}` needs booleans, got {t.value} (did you mean a comparison?)", side.span)
            return Type.BOOL
        if e.op in COMPARE_OPS:
            if is_number(lt) and is_number(rt):
                return Type.BOOL
            if lt is Type.BOOL and rt is Type.BOOL and e.op in ("==", "!="):
                return Type.BOOL
            raise SpecError(f"cannot compare {lt.value} {e.op} {rt.value}", e.span)
        if e.op in BIT_OPS:
            if e.op != "^" and lt is Type.BOOL and rt is Type.BOOL:
                return Type.BOOL  # `&`, `|` on booleans: `and`, `or`
            if lt is Type.INT and rt is Type.INT:
                return Type.INT
            what = "two integers (bitwise)" if e.op == "^" else "two integers (bitwise) or two booleans"
            hint = (" (`&` and `|` bind looser than comparisons, like `and` and `or`: write (a & b) == c)"
                    if Type.BOOL in (lt, rt) and e.op != "^" else "")
            raise SpecError(f"`{e.op}` needs {what}, got {lt.value} and {rt.value}{hint}", e.span)
        assert e.op in ARITH_OPS, e.op
        for side, t in ((e.lhs, lt), (e.rhs, rt)):
            if not is_number(t):
                raise SpecError(f"`{e.op}` needs numbers, got {t.value}", side.span)
        if e.op == "/":
            return Type.FLOAT
        return promote(lt, rt)
    if isinstance(e, Call):
        if e.func not in FUNCTIONS:
            raise SpecError(f"unknown function {e.func!r}; expected one of: {', '.join(FUNCTIONS)}", e.span)
        lo, hi = FUNCTIONS[e.func]
        n = len(e.args)
        if n < lo or (hi is not None and n > hi):
            want = f"{lo}" if lo == hi else f"at least {lo}"
            raise SpecError(f"{e.func}() takes {want} argument(s), got {n}", e.span)
        types = [typeof(a, scope) for a in e.args]
        if e.func == "where":
            if types[0] is not Type.BOOL:
                raise SpecError(f"where()'s first argument must be boolean, got {types[0].value}", e.args[0].span)
            if types[1] is Type.BOOL and types[2] is Type.BOOL:
                return Type.BOOL
            if is_number(types[1]) and is_number(types[2]):
                return promote(types[1], types[2])
            raise SpecError(f"where()'s branches must both be numbers or both booleans, got {types[1].value} and {types[2].value}", e.span)
        for a, t in zip(e.args, types):
            if not is_number(t):
                raise SpecError(f"{e.func}() needs numbers, got {t.value}", a.span)
        if e.func in FLOAT_FUNCTIONS:
            return Type.FLOAT
        out = types[0]
        for t in types[1:]:
            out = promote(out, t)
        return out
    raise TypeError(f"not an expression node: {e!r}")  # internal


def variables(e: Expr) -> frozenset[str]:
    """Variables and inputs an expression refers to."""
    if isinstance(e, Var):
        return frozenset((e.name,))
    if isinstance(e, Index):
        out = frozenset((e.input,))
        for i in e.indices:
            out |= variables(i)
        return out
    return frozenset().union(*(variables(c) for c in children(e))) if children(e) else frozenset()


def input_reads(*exprs: Expr | None) -> list[Index]:
    """The input reads (Index nodes) of expressions, nested ones included, each distinct read once, in the order
    of a depth-first walk."""
    found: list[Index] = []
    stack = [e for e in exprs if e is not None]
    while stack:
        e = stack.pop()
        stack.extend(children(e))
        if isinstance(e, Index) and e not in found:
            found.append(e)
    return found


def children(e: Expr) -> tuple[Expr, ...]:
    if isinstance(e, Unary):
        return (e.operand,)
    if isinstance(e, Binary):
        return (e.lhs, e.rhs)
    if isinstance(e, Call):
        return e.args
    if isinstance(e, Index):
        return e.indices
    return ()


def substitute(e: Expr, mapping: dict[str, Expr]) -> Expr:
    """Replace variables by expressions (used to express q_blk as q_idx // sparse_block)."""
    if isinstance(e, Var):
        return mapping.get(e.name, e)
    if isinstance(e, Unary):
        return Unary(e.op, substitute(e.operand, mapping), span=e.span)
    if isinstance(e, Binary):
        return Binary(e.op, substitute(e.lhs, mapping), substitute(e.rhs, mapping), span=e.span)
    if isinstance(e, Call):
        return Call(e.func, tuple(substitute(a, mapping) for a in e.args), span=e.span)
    if isinstance(e, Index):
        return Index(e.input, tuple(substitute(a, mapping) for a in e.indices), span=e.span)
    return e


# ---- printing in the spec language ----------------------------------------------------------------
# Binding strength of the .attn language's operators (higher binds tighter).
_SPEC_PREC = {"or": 1, "|": 1, "and": 2, "&": 2, "not": 3, **{op: 4 for op in COMPARE_OPS}, "^": 4.5, "+": 5, "-": 5, "*": 6, "/": 6, "//": 6, "%": 6}
_ATOM = 10


def format_expr(e: Expr) -> str:
    """Canonical .attn text of an expression (used in generated headers and cache keys)."""
    return _fmt(e)[0]


def _fmt(e: Expr) -> tuple[str, int]:
    if isinstance(e, Const):
        if e.type is Type.BOOL:
            return ("true" if e.value else "false"), _ATOM
        if e.value < 0:
            return repr(e.value), 7
        return repr(e.value), _ATOM
    if isinstance(e, Var):
        return e.name, _ATOM
    if isinstance(e, Index):
        return f"{e.input}[{', '.join(format_expr(i) for i in e.indices)}]", _ATOM
    if isinstance(e, Call):
        return f"{e.func}({', '.join(format_expr(a) for a in e.args)})", _ATOM
    if isinstance(e, Unary):
        if e.op == "not":
            inner, p = _fmt(e.operand)
            return f"not {inner if p >= 3 else '(' + inner + ')'}", 3
        inner, p = _fmt(e.operand)
        return f"-{inner if p >= 7 else '(' + inner + ')'}", 7
    if isinstance(e, Binary):
        prec = _SPEC_PREC[e.op]
        lhs, lp = _fmt(e.lhs)
        rhs, rp = _fmt(e.rhs)
        chain = e.op in COMPARE_OPS  # comparisons do not chain: both sides need parentheses at equal strength
        lhs = lhs if lp > prec or (lp == prec and not chain) else f"({lhs})"
        rhs = rhs if rp > prec else f"({rhs})"
        return f"{lhs} {e.op} {rhs}", prec
    raise TypeError(e)
