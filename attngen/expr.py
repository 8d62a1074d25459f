"""The expression IR: typing, constant folding, differentiation, printing, and lowering to Triton.

This is the only module that turns spec expressions into code text. It works from the AST nodes of
spec.py, never from spec strings: names in the output are either fixed kernel variables (`q_idx`,
`kv_idx`, ...), validated input identifiers, or temporaries it makes up; literals are printed from
Python numbers with `repr`, which cannot produce anything but a number.
"""
from __future__ import annotations

import keyword
import math
from dataclasses import dataclass, field

from .errors import SpecError
from .ranges import INT32, integer_range, may_be_zero, within
from .spec import ARITH_OPS, BIT_OPS, COMPARE_OPS, Binary, Call, Const, Expr, Index, InputDecl, Type, Unary, Var

# Variables of the language, with their type. Which ones an expression may use depends on the setting.
INDEX_VARS = ("b", "h", "q_idx", "kv_idx", "q_len", "kv_len")
MASK_VARS = frozenset(INDEX_VARS)
SCORE_VARS = frozenset(INDEX_VARS + ("score",))
SPARSITY_VARS = frozenset(("b", "h", "q_len", "kv_len", "q_blk", "kv_blk"))
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


def _is_number(t: Type) -> bool:
    return t in (Type.INT, Type.FLOAT)


def _promote(a: Type, b: Type) -> Type:
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
        if not _is_number(t):
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
            if _is_number(lt) and _is_number(rt):
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
            if not _is_number(t):
                raise SpecError(f"`{e.op}` needs numbers, got {t.value}", side.span)
        if e.op == "/":
            return Type.FLOAT
        return _promote(lt, rt)
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
            if _is_number(types[1]) and _is_number(types[2]):
                return _promote(types[1], types[2])
            raise SpecError(f"where()'s branches must both be numbers or both booleans, got {types[1].value} and {types[2].value}", e.span)
        for a, t in zip(e.args, types):
            if not _is_number(t):
                raise SpecError(f"{e.func}() needs numbers, got {t.value}", a.span)
        if e.func in FLOAT_FUNCTIONS:
            return Type.FLOAT
        out = types[0]
        for t in types[1:]:
            out = _promote(out, t)
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


# ---- constant folding -----------------------------------------------------------------------------
def _const(value, t: Type) -> Const:
    if t is Type.FLOAT:
        return Const(float(value), Type.FLOAT)
    if t is Type.INT:
        return Const(int(value), Type.INT)
    return Const(bool(value), Type.BOOL)


FLOAT32_TINY = 1.1754943508222875e-38  # float32's smallest normal


def _floor_quotient(a: float, b: float) -> float:
    """floor(a / b) of floats as the kernels compute it: a quotient below float32's normals is a signed zero."""
    q = a / b
    return math.copysign(0.0, q) if abs(q) < FLOAT32_TINY else float(math.floor(q))


def _floordiv(a, b):
    """The language's `//`: integers round toward -inf and a // 0 = 0; floats are floor(a / b) (IEEE: a // 0.0
    is +-inf or NaN), as the kernels compute them (Python's float // differs in the last place)."""
    if isinstance(a, float) or isinstance(b, float):
        return _floor_quotient(a, b)
    return a // b if b != 0 else 0


def _pymod(a, b):
    """The language's `%`: integers take the divisor's sign and a % 0 = a; floats are a - floor(a / b) * b."""
    if isinstance(a, float) or isinstance(b, float):
        return a - _floor_quotient(a, b) * b
    return a % b if b != 0 else a


_FOLD_BINARY = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
    "//": _floordiv,
    "%": _pymod,
    "<": lambda a, b: a < b,
    "<=": lambda a, b: a <= b,
    ">": lambda a, b: a > b,
    ">=": lambda a, b: a >= b,
    "==": lambda a, b: a == b,
    "!=": lambda a, b: a != b,
    "and": lambda a, b: a and b,
    "or": lambda a, b: a or b,
    "&": lambda a, b: a & b,
    "|": lambda a, b: a | b,
    "^": lambda a, b: a ^ b,
}

_FOLD_CALL = {
    "min": min,
    "max": max,
    "abs": abs,
    "exp": math.exp,
    "log": math.log,
    "tanh": math.tanh,
    "sqrt": math.sqrt,
    "sigmoid": lambda x: 1.0 / (1.0 + math.exp(-x)),
}


def _is_const(e: Expr, value=None) -> bool:
    return isinstance(e, Const) and (value is None or (e.type is not Type.BOOL and e.value == value))


def fold(e: Expr, scope: Scope, *, derivative: bool = False) -> Expr:
    """Constant-fold `e` and apply identities that keep its type and value (x*1, x-0, true and x, ...).

    Folding never changes meaning: operations that would fail at fold time (log of a negative
    constant, division by zero) are left as they are, and on floats only identities that IEEE arithmetic
    keeps for every value are used (x + 0.0 would turn -0.0 into 0.0, x * 0.0 an infinity into 0), except in a
    derivative (`derivative=True`), where a term without `score` contributes exactly 0 and x + 0 is x.
    """
    t = typeof(e, scope)
    if isinstance(e, Unary):
        a = fold(e.operand, scope, derivative=derivative)
        if isinstance(a, Const):
            return _const((not a.value) if e.op == "not" else -a.value, t)
        if isinstance(a, Unary) and a.op == e.op:
            return a.operand
        return Unary(e.op, a, span=e.span)
    if isinstance(e, Binary):
        if e.op in ("&", "|") and t is Type.BOOL:  # the boolean spellings of `and` and `or`
            return fold(Binary("and" if e.op == "&" else "or", e.lhs, e.rhs, span=e.span), scope, derivative=derivative)
        a, b = fold(e.lhs, scope, derivative=derivative), fold(e.rhs, scope, derivative=derivative)
        if isinstance(a, Const) and isinstance(b, Const):
            try:
                value = _FOLD_BINARY[e.op](a.value, b.value)
                if not (isinstance(value, float) and not math.isfinite(value)):  # literals are finite: leave it to run time
                    return _const(value, t)
            except (ZeroDivisionError, OverflowError, ValueError):
                pass
        if e.op == "and":
            for x, y in ((a, b), (b, a)):
                if isinstance(x, Const):
                    return y if x.value else _const(False, Type.BOOL)
        if e.op == "or":
            for x, y in ((a, b), (b, a)):
                if isinstance(x, Const):
                    return _const(True, Type.BOOL) if x.value else y
        # Arithmetic identities are applied only where they keep the type (int + 0.0 is a float).
        same_type = lambda x: typeof(x, scope) is t  # noqa: E731
        signed_zero_safe = t is Type.INT or derivative  # -0.0 + 0.0 is 0.0; 0.0 - 0.0 is 0.0, not -0.0
        if e.op == "+" and signed_zero_safe:
            if _is_const(a, 0) and same_type(b):
                return b
            if _is_const(b, 0) and same_type(a):
                return a
        if e.op == "-":
            if _is_const(b, 0) and same_type(a):
                return a
            if _is_const(a, 0) and same_type(b) and signed_zero_safe:
                return Unary("-", b)
        if e.op == "*":
            if _is_const(a, 1) and same_type(b):
                return b
            if _is_const(b, 1) and same_type(a):
                return a
        if e.op == "/" and _is_const(b, 1) and same_type(a):
            return a
        # In a derivative, x * 0 and 0 / x are 0: the term does not involve `score`, so it contributes nothing
        # (IEEE would say NaN where x is infinite; a spec's own expressions keep IEEE's answer).
        if t is Type.FLOAT and derivative and ((e.op == "*" and (_is_const(a, 0) or _is_const(b, 0))) or (e.op == "/" and _is_const(a, 0))):
            return _const(0.0, Type.FLOAT)
        return Binary(e.op, a, b, span=e.span)
    if isinstance(e, Call):
        args = tuple(fold(x, scope, derivative=derivative) for x in e.args)
        if e.func == "where" and isinstance(args[0], Const):
            chosen = args[1] if args[0].value else args[2]
            if typeof(chosen, scope) is t:
                return chosen
        if all(isinstance(x, Const) for x in args) and e.func in _FOLD_CALL:
            try:
                value = _FOLD_CALL[e.func](*(x.value for x in args))
                if not (isinstance(value, float) and not math.isfinite(value)):
                    return _const(value, t)
            except (ValueError, OverflowError):
                pass
        return Call(e.func, args, span=e.span)
    if isinstance(e, Index):
        return Index(e.input, tuple(fold(x, scope, derivative=derivative) for x in e.indices), span=e.span)
    return e


# ---- differentiation with respect to `score` ------------------------------------------------------
ZERO = Const(0.0, Type.FLOAT)
ONE = Const(1.0, Type.FLOAT)


def derivative(e: Expr, scope: Scope, wrt: str = "score") -> Expr:
    """d e / d wrt as a float expression, folded. Used for the backward of a score modification.

    Conventions where the function has no derivative: floor division and `%` treat the quotient as
    piecewise constant; abs'(0) = 0; at ties, min/max take the gradient of the first argument.
    """
    return fold(_d(e, scope, wrt), scope, derivative=True)


def read_derivative(e: Expr, scope: Scope, read: Index) -> Expr:
    """d e / d read, where `read` is one input element read (e.g. bias[h, q_idx, kv_idx]): the gradient of a
    score with respect to an input it reads. Same conventions as `derivative`."""
    return fold(_d(e, scope, read), scope, derivative=True)


def _contains(e: Expr, node: Expr) -> bool:
    return e == node or any(_contains(c, node) for c in children(e))


def _d(e: Expr, scope: Scope, wrt: str | Index) -> Expr:
    """d e / d wrt, for wrt a variable name or an input read (Index node)."""
    depends = wrt in variables(e) if isinstance(wrt, str) else _contains(e, wrt)
    if not depends or typeof(e, scope) is Type.BOOL:
        return ZERO
    if isinstance(e, Var):
        return ONE if e.name == wrt else ZERO
    if isinstance(e, Index):
        return ONE if e == wrt else ZERO
    if isinstance(e, Const):
        return ZERO
    if isinstance(e, Unary):  # "-" (a "not" is boolean, handled above)
        return Unary("-", _d(e.operand, scope, wrt))
    if isinstance(e, Binary):
        a, b = e.lhs, e.rhs
        da, db = _d(a, scope, wrt), _d(b, scope, wrt)
        if e.op == "+":
            return Binary("+", da, db)
        if e.op == "-":
            return Binary("-", da, db)
        if e.op == "*":
            return Binary("+", Binary("*", da, b), Binary("*", a, db))
        if e.op == "/":
            # (da*b - a*db) / b^2, written so that db == 0 folds to da / b
            return Binary("-", Binary("/", da, b), Binary("/", Binary("*", a, db), Binary("*", b, b)))
        if e.op == "//" or e.op in BIT_OPS:  # piecewise constant (bitwise operators: integers only)
            return ZERO
        if e.op == "%":  # a % b = a - floor(a / b) * b
            return Binary("-", da, Binary("*", Binary("//", a, b), db))
    if isinstance(e, Call):
        args = e.args
        if e.func == "where":
            return Call("where", (args[0], _d(args[1], scope, wrt), _d(args[2], scope, wrt)))
        if e.func in ("min", "max"):
            # fold n-ary into nested binary choices: pick the derivative of the winning argument
            best, dbest = args[0], _d(args[0], scope, wrt)
            cmp = "<=" if e.func == "min" else ">="
            for x in args[1:]:
                dx = _d(x, scope, wrt)
                dbest = Call("where", (Binary(cmp, best, x), dbest, dx))
                best = Call(e.func, (best, x))
            return dbest
        (a,) = args
        da = _d(a, scope, wrt)
        if e.func == "abs":
            sign = Call("where", (Binary(">", a, ZERO), ONE, Call("where", (Binary("<", a, ZERO), Const(-1.0, Type.FLOAT), ZERO))))
            return Binary("*", sign, da)
        if e.func == "exp":
            return Binary("*", e, da)
        if e.func == "log":
            return Binary("/", da, a)
        if e.func == "tanh":
            return Binary("*", Binary("-", ONE, Binary("*", e, e)), da)
        if e.func == "sqrt":
            return Binary("/", da, Binary("*", Const(2.0, Type.FLOAT), e))
        if e.func == "sigmoid":
            return Binary("*", Binary("*", e, Binary("-", ONE, e)), da)
    raise TypeError(f"cannot differentiate {e!r}")  # internal


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


# ---- sign analysis (lets `//` and `%` use the fast truncating operators) ---------------------------
_NONNEG_VARS = frozenset(INDEX_VARS + ("q_blk", "kv_blk"))


def nonnegative(e: Expr) -> bool:
    """True only if `e` is provably >= 0 for every valid index (a sound, simple sign analysis)."""
    if isinstance(e, Const):
        return e.type is not Type.BOOL and e.value >= 0
    if isinstance(e, Var):
        return e.name in _NONNEG_VARS
    if isinstance(e, Binary) and e.op in ("+", "*", "//", "%", "/", "|", "^"):
        return nonnegative(e.lhs) and nonnegative(e.rhs)
    if isinstance(e, Binary) and e.op == "&":  # two's complement: a & b >= 0 when either is
        return nonnegative(e.lhs) or nonnegative(e.rhs)
    if isinstance(e, Call):
        if e.func == "abs" or e.func in ("exp", "sqrt", "sigmoid"):
            return True
        if e.func in ("min", "max"):
            return all(nonnegative(a) for a in e.args)
        if e.func == "where":
            return nonnegative(e.args[1]) and nonnegative(e.args[2])
    return False


def _positive_const(e: Expr) -> bool:
    return isinstance(e, Const) and e.type is Type.INT and e.value > 0


# ---- separable biases (the softmax sees no row's constant) ----------------------------------------
# ALiBi's `score - slopes[h] * (q_idx - kv_idx)` costs a subtraction, a conversion and three float operations per
# score. It is `score + L(q_idx, kv_idx)` with L a sum of a part of the row and a part of the key, and the softmax of
# a row does not change when a constant is added to all of its scores: so for any row r (the ref),
#     L(q, kv) = L(q, r) + L(r, kv) - L(r, r)                                  (every q, kv, r)
# and a kernel adds only the key part L(r, kv), one value per key of a tile (a vector, not a tile), to the scaled
# products; the row part L(q, r) - L(r, r) leaves the softmax alone and goes into the log-sum-exp (FlashAttention-2
# does this for causal ALiBi, with r = 0). With r near the tile's rows every part is small, so nothing large cancels.
_AXES = frozenset(("q_idx", "kv_idx"))


def separable_bias(e: Expr, scope: Scope) -> Expr | None:
    """L where the score modification `e` is `score + L` with L separable (the identity above holds for every
    value of the indices) and finite wherever its inputs are; None for any other modification.

    `score` must appear once, reached from the top through `+` (either side) and `-` (left side) only. L is a sum
    (+, -, unary -, and products or quotients by factors of neither index) of terms each of which involves at most
    one of q_idx and kv_idx. A term of an index may not read a float input at it (a bias of -inf at r would make
    L(r, kv) -inf for every key), nor call a float function of it (exp may overflow), nor divide by anything but a
    nonzero constant."""
    if not _plus_score(e):
        return None
    rest = fold(substitute(e, {"score": Const(0.0, Type.FLOAT)}), scope)
    if not _separable(rest) or not _finite_at_positions(rest, scope):
        return None
    return rest


def affine_in(e: Expr, var: str) -> bool:
    """Whether e is affine in the variable `var` for fixed values of the others (e(x + d) = e(x) + e(d) - e(0)):
    sums, negations, and products or quotients by factors free of it."""
    if var not in variables(e):
        return True
    if isinstance(e, Var):
        return True
    if isinstance(e, Unary) and e.op == "-":
        return affine_in(e.operand, var)
    if isinstance(e, Binary):
        if e.op in ("+", "-"):
            return affine_in(e.lhs, var) and affine_in(e.rhs, var)
        if e.op == "*":
            return any(var not in variables(f) and affine_in(o, var) for f, o in ((e.lhs, e.rhs), (e.rhs, e.lhs)))
        if e.op == "/":
            return var not in variables(e.rhs) and affine_in(e.lhs, var)
    return False


def _plus_score(e: Expr) -> bool:
    if isinstance(e, Var):
        return e.name == "score"
    if isinstance(e, Binary) and e.op in ("+", "-"):
        in_lhs, in_rhs = "score" in variables(e.lhs), "score" in variables(e.rhs)
        if in_lhs and not in_rhs:
            return _plus_score(e.lhs)
        if in_rhs and not in_lhs and e.op == "+":
            return _plus_score(e.rhs)
    return False


def _separable(e: Expr) -> bool:
    if not _AXES <= variables(e):
        return True  # a term of one index (or of none)
    if isinstance(e, Unary) and e.op == "-":
        return _separable(e.operand)
    if isinstance(e, Binary):
        if e.op in ("+", "-"):
            return _separable(e.lhs) and _separable(e.rhs)
        if e.op == "*":
            for factor, other in ((e.lhs, e.rhs), (e.rhs, e.lhs)):
                if not variables(factor) & _AXES:
                    return _separable(other)
        if e.op == "/" and not variables(e.rhs) & _AXES:
            return _separable(e.lhs)
    return False


def _finite_at_positions(e: Expr, scope: Scope) -> bool:
    stack = [e]
    while stack:
        node = stack.pop()
        stack.extend(children(node))
        if not variables(node) & _AXES:
            continue
        if isinstance(node, Index) and scope.inputs[node.input].type is Type.FLOAT:
            return False
        if isinstance(node, Call) and node.func in FLOAT_FUNCTIONS:
            return False
        if isinstance(node, Binary) and node.op in ("/", "//", "%") and not (isinstance(node.rhs, Const) and node.rhs.value != 0):
            return False
    return True


# ---- lowering to Triton -----------------------------------------------------------------------------
# Python operator precedence of the generated code (higher binds tighter).
_PY_PREC = {"|": 3, "^": 4, "&": 5, "cmp": 2, "+": 7, "-": 7, "*": 8, "/": 8, "//": 8, "%": 8}
_PY_UNARY = 9
_PY_ATOM = 10

# Variables that are tiles in every kernel (the others, b, h and the lengths, are one value per program).
_BLOCK_VARS = frozenset(("q_idx", "kv_idx", "score"))

# Positions as float32. An integer expression of a row and a column index converted to float (ALiBi's
# slopes[h] * (q_idx - kv_idx)) costs an integer subtraction and a conversion (I2FP in the SASS) per score. Such an
# expression of positions, lengths and integer constants joined by + and - can be lowered leaf by leaf instead: each
# position or length becomes a float32 once per row or column vector (_position_f32: an integer and a float
# addition) and the sums are float32 subtractions, one per score. The result is bit for bit the converted integer
# as long as every leaf and every partial sum is an integer of magnitude at most 2**24, which holds when every
# length is at most FLOAT_POSITIONS. Measured on the H100 (BENCHMARKS.md, 2026-11-27 session 18, ALiBi): the Gluon
# backward ran 1.20-1.60x faster so (why that much is not established: its SASS holds more instructions after the
# change and the same spills), the forwards and the Triton backward 0.94-0.98x (their per-tile vector of key
# positions costs what the per-score conversions saved), so only the Gluon backward lowers them so
# (Lowerer(positions_leafwise=True)), and the runtime gives calls longer than FLOAT_POSITIONS the Triton backward
# (codegen.lowering.converts_positions).
FLOAT_POSITIONS = 2**23
_POSITION_RANGES = {"q_idx": (0, FLOAT_POSITIONS - 1), "kv_idx": (0, FLOAT_POSITIONS - 1),
                    "q_len": (0, FLOAT_POSITIONS), "kv_len": (0, FLOAT_POSITIONS)}


def _position_sum_range(e: Expr) -> tuple[int, int] | None:
    """(lo, hi) of a sum of positions, lengths and integer constants (+, - and negation only) when every length is
    at most FLOAT_POSITIONS, each partial sum within +-2**24; None for any other expression."""
    if isinstance(e, Const):
        ok = e.type is Type.INT and abs(e.value) <= 2**24
        return (int(e.value), int(e.value)) if ok else None
    if isinstance(e, Var):
        return _POSITION_RANGES.get(e.name)
    if isinstance(e, Unary) and e.op == "-":
        r = _position_sum_range(e.operand)
        return None if r is None else (-r[1], -r[0])
    if isinstance(e, Binary) and e.op in ("+", "-"):
        a, b = _position_sum_range(e.lhs), _position_sum_range(e.rhs)
        if a is None or b is None:
            return None
        r = (a[0] + b[0], a[1] + b[1]) if e.op == "+" else (a[0] - b[1], a[1] - b[0])
        return r if -(2**24) <= r[0] and r[1] <= 2**24 else None
    return None


def _positions_in_float(e: Expr) -> bool:
    """Whether float(e) is lowered leaf by leaf (see FLOAT_POSITIONS): e is a sum of positions, lengths and integer
    constants that mixes a row and a column index (where one conversion per score would be paid otherwise)."""
    return {"q_idx", "kv_idx"} <= variables(e) and _position_sum_range(e) is not None


# Helper functions a lowering may need; the template emits the ones used, from this table.
HELPERS = {
    "_floordiv": (
        "@triton.jit\n"
        "def _floordiv(a, b):\n"
        '    """Python\'s a // b (rounds toward -inf) for integers of any sign; b != 0."""\n'
        "    q = a // b\n"
        "    r = a % b\n"
        "    return q - ((r != 0) & ((r < 0) != (b < 0))).to(q.dtype)\n"
    ),
    "_mod": (
        "@triton.jit\n"
        "def _mod(a, b):\n"
        '    """Python\'s a % b (the sign of b) for integers of any sign; b != 0."""\n'
        "    r = a % b\n"
        "    return r + b * ((r != 0) & ((r < 0) != (b < 0))).to(r.dtype)\n"
    ),
    "_floordiv_or_0": (
        "@triton.jit\n"
        "def _floordiv_or_0(a, b):\n"
        '    """a // b rounding toward -inf, and a // 0 = 0 (the language\'s definition: never undefined)."""\n'
        "    d = tl.where(b == 0, 1, b)\n"
        "    q = a // d\n"
        "    r = a % d\n"
        "    q = q - ((r != 0) & ((r < 0) != (d < 0))).to(q.dtype)\n"
        "    return tl.where(b == 0, 0, q)\n"
    ),
    "_mod_or_a": (
        "@triton.jit\n"
        "def _mod_or_a(a, b):\n"
        '    """a % b with the sign of b, and a % 0 = a (so a == (a // b) * b + a % b always holds)."""\n'
        "    d = tl.where(b == 0, 1, b)\n"
        "    r = a % d\n"
        "    r = r + d * ((r != 0) & ((r < 0) != (d < 0))).to(r.dtype)\n"
        "    return tl.where(b == 0, a, r)\n"
    ),
    "_floor_quotient": (
        "@triton.jit\n"
        "def _floor_quotient(a, b):\n"
        '    """floor(a / b) of floats, IEEE-rounded (the floor of an approximate quotient can be off by 1); a quotient\n'
        '    below the smallest normal float32 counts as a zero of its sign, as the division of the GPU flushes it."""\n'
        "    q = tl.math.div_rn(a, b)\n"
        "    q = tl.where(tl.abs(q) < 1.1754943508222875e-38, q * 0.0, q)\n"
        "    return tl.math.floor(q)\n"
    ),
    "_position_f32": (
        "@triton.jit\n"
        "def _position_f32(x):\n"
        '    """x (an int32 position or length, 0 <= x <= 2**23) as float32, exactly: added to the bits of 2**23, x is\n'
        "    the mantissa of 2**23 + x, from which 2**23 is subtracted: an integer and a float addition, no conversion\n"
        '    instruction."""\n'
        "    return (x + 0x4B000000).to(tl.float32, bitcast=True) - 8388608.0\n"
    ),
    "_tanh": (
        "@triton.jit\n"
        "def _tanh(x):\n"
        '    """tanh through exp2, stable for large |x| (runs in the interpreter too, unlike libdevice)."""\n'
        "    t = tl.math.exp2(-2.8853900817779268 * tl.abs(x))  # exp(-2|x|)\n"
        "    y = (1.0 - t) / (1.0 + t)\n"
        "    return tl.where(x < 0, -y, y)\n"
    ),
}


@dataclass
class Lowered:
    """Code for one or more expressions: statements to run once per outer tile, per inner tile, and the expressions."""

    outer: list[str]
    inner: list[str]
    exprs: list[str]


class InputAccess:
    """How kernel code reads an element of a declared input: pointer, strides and sizes named in_<name>_*."""

    def __init__(self, decl: InputDecl):
        self.decl = decl

    def load(self, indices: list[tuple[str, bool]]) -> str:
        """A masked load; `indices` are (code, provably non-negative). Reads outside the tensor give 0."""
        n = self.decl.name
        offset = " + ".join(f"{c} * in_{n}_stride_{i}" for i, (c, _) in enumerate(indices))
        bounds = []
        for i, (c, nonneg) in enumerate(indices):
            if not nonneg:
                bounds.append(f"({c} >= 0)")
            bounds.append(f"({c} < in_{n}_size_{i})")
        return f"tl.load(in_{n}_ptr + {offset}, mask={' & '.join(bounds)}, other=0)"


class Lowerer:
    """Turns typed expressions into Triton expressions.

    `var_code` maps language variables to kernel variables; `inner_vars` are the ones that change in
    the kernel's inner loop. Input loads and transcendental calls become named temporaries (each
    computed once, even when the score and its derivative both use it); those that depend on no
    inner variable are placed before the loop.
    """

    def __init__(self, scope: Scope, var_code: dict[str, str], inner_vars: frozenset[str], prefix: str = "",
                 positions_leafwise: bool = False):
        self.scope = scope
        self.var_code = var_code
        self.inner_vars = inner_vars
        self.prefix = prefix
        self.helpers: set[str] = set()
        self._temps: dict[Expr, tuple[str, bool]] = {}
        self._counter = 0
        self.outer: list[str] = []
        self.inner: list[str] = []
        self.positions_leafwise = positions_leafwise  # sums of positions in float contexts leaf by leaf (FLOAT_POSITIONS)
        self.positions_in_float = False  # whether some code relies on lengths of at most FLOAT_POSITIONS

    def lower_all(self, exprs: list[Expr]) -> Lowered:
        codes = [self.lower(e) for e in exprs]
        return Lowered(self.outer, self.inner, codes)

    def lower(self, e: Expr, want: Type | None = None) -> str:
        code, _ = self._lower(e)
        t = typeof(e, self.scope)
        if want is Type.FLOAT and t is Type.INT:
            return self._to_float(e, code, _PY_ATOM)[0]
        return code

    # -- helpers
    def _is_inner(self, e: Expr) -> bool:
        if any(v in self.inner_vars for v in variables(e)):
            return True
        return any(self._temps.get(c, ("", False))[1] for c in children(e))

    def _temp(self, e: Expr, stem: str, code: str) -> tuple[str, int]:
        if e in self._temps:
            return self._temps[e][0], _PY_ATOM
        name = f"{self.prefix}{stem}_{self._counter}"
        self._counter += 1
        inner = self._is_inner(e)
        (self.inner if inner else self.outer).append(f"{name} = {code}")
        self._temps[e] = (name, inner)
        return name, _PY_ATOM

    def _paren(self, lowered: tuple[str, int], need: int) -> str:
        code, prec = lowered
        return code if prec >= need else f"({code})"

    def _to_float(self, e: Expr, code: str, prec: int) -> tuple[str, int]:
        if isinstance(e, Const):
            return repr(float(e.value)), _PY_ATOM
        if self.positions_leafwise and _positions_in_float(e):
            self.positions_in_float = True
            return self._positions_as_float(e)
        return f"{self._paren((code, prec), _PY_ATOM)}.to(tl.float32)", _PY_ATOM

    def _positions_as_float(self, e: Expr) -> tuple[str, int]:
        """A sum of positions as float32, leaf by leaf (FLOAT_POSITIONS): each position or length converted once
        (a named temporary, before the loop where it does not change there), the sums in float32."""
        if isinstance(e, Const):
            return repr(float(e.value)), (_PY_UNARY if e.value < 0 else _PY_ATOM)
        if isinstance(e, Var):
            self.helpers.add("_position_f32")
            return self._temp(e, f"{e.name}_f", f"_position_f32({self.var_code[e.name]})")
        if isinstance(e, Unary):  # 0.0 - x: +0.0 for x = 0, as the converted integer -0 is
            return f"0.0 - {self._paren(self._positions_as_float(e.operand), _PY_PREC['-'] + 1)}", _PY_PREC["-"]
        prec = _PY_PREC[e.op]
        lhs = self._paren(self._positions_as_float(e.lhs), prec)
        rhs = self._paren(self._positions_as_float(e.rhs), prec + 1)
        return f"{lhs} {e.op} {rhs}", prec

    def _lower_as(self, e: Expr, t: Type) -> tuple[str, int]:
        low = self._lower(e)
        if t is Type.FLOAT and typeof(e, self.scope) is Type.INT:
            return self._to_float(e, *low)
        return low

    def _lower(self, e: Expr) -> tuple[str, int]:
        t = typeof(e, self.scope)
        if isinstance(e, Const):
            if e.type is Type.BOOL:
                return ("True" if e.value else "False"), _PY_ATOM
            if e.value < 0:
                return repr(e.value), _PY_UNARY
            return repr(e.value), _PY_ATOM
        if isinstance(e, Var):
            return self.var_code[e.name], _PY_ATOM
        if isinstance(e, Index):
            access = InputAccess(self.scope.inputs[e.input])
            indices = []
            for i in e.indices:
                code = self._lower(i)
                if not isinstance(i, (Var, Const)):  # a computed index: named once, used in the offset and the bounds
                    code = self._temp(i, f"{e.input}_index", code[0])
                indices.append((self._paren(code, _PY_ATOM), nonnegative(i)))
            load = access.load(indices)
            widen = {"int8": "tl.int32", "int16": "tl.int32", "fp16": "tl.float32", "bf16": "tl.float32"}
            if self.scope.inputs[e.input].dtype in widen:  # arithmetic happens in int32 (or wider) and in float32
                load = f"{load}.to({widen[self.scope.inputs[e.input].dtype]})"
            return self._temp(e, e.input, load)
        if isinstance(e, Unary):
            if e.op == "not":
                return f"~{self._paren(self._lower(e.operand), _PY_UNARY)}", _PY_UNARY
            if t is Type.FLOAT:  # Triton's unary minus is 0 - x, which maps 0.0 to 0.0; the product flips every sign
                return f"{self._paren(self._lower(e.operand), _PY_PREC['*'])} * -1.0", _PY_PREC["*"]
            return f"-{self._paren(self._int_operand(e.operand, self._wide(e, t)), _PY_UNARY)}", _PY_UNARY
        if isinstance(e, Binary):
            return self._lower_binary(e, t)
        if isinstance(e, Call):
            return self._lower_call(e, t)
        raise TypeError(e)

    def _lower_binary(self, e: Binary, t: Type) -> tuple[str, int]:
        if e.op in ("and", "or") or e.op in BIT_OPS:  # booleans (and, or) or integers (bitwise): Python's operators
            op = {"and": "&", "or": "|"}.get(e.op, e.op)
            prec = _PY_PREC[op]
            lhs = self._paren(self._lower(e.lhs), prec)
            rhs = self._paren(self._lower(e.rhs), prec + 1)
            return f"{lhs} {op} {rhs}", prec
        if e.op in COMPARE_OPS:
            lt, rt = typeof(e.lhs, self.scope), typeof(e.rhs, self.scope)
            common = _promote(lt, rt) if _is_number(lt) and _is_number(rt) else lt
            prec = _PY_PREC["cmp"]
            lhs = self._paren(self._lower_as(e.lhs, common), prec + 1)
            rhs = self._paren(self._lower_as(e.rhs, common), prec + 1)
            if not (_BLOCK_VARS & (variables(e.lhs) | variables(e.rhs))):
                # One value per program (slopes[h] > 0.0, b < q_len): Triton 3.6's interpreter stores such a
                # comparison in its operands' type, which breaks `&`, `|` and `~` with boolean tiles on the CPU.
                # The select gives it boolean storage; on the GPU it is free.
                return f"tl.where({lhs} {e.op} {rhs}, True, False)", _PY_ATOM
            return f"{lhs} {e.op} {rhs}", prec
        if t is Type.INT:  # + - * // % on integers: int32 where the result provably fits, else int64
            wide = self._wide(e, t)
            lhs, rhs = self._int_operand(e.lhs, wide), self._int_operand(e.rhs, wide)
            if e.op in ("//", "%") and not (nonnegative(e.lhs) and _positive_const(e.rhs)):
                if may_be_zero(integer_range(e.rhs, self.scope.inputs)):
                    helper = "_floordiv_or_0" if e.op == "//" else "_mod_or_a"  # a // 0 = 0, a % 0 = a
                else:
                    helper = "_floordiv" if e.op == "//" else "_mod"  # signs unknown: Python's floor semantics
                self.helpers.add(helper)
                return f"{helper}({lhs[0]}, {rhs[0]})", _PY_ATOM
            # (// and % of a non-negative value by a positive constant: C's truncation equals Python's floor)
            prec = _PY_PREC[e.op]
            return f"{self._paren(lhs, prec)} {e.op} {self._paren(rhs, prec + 1)}", prec
        operand_type = Type.FLOAT if e.op == "/" else t
        if e.op in ("//", "%") and t is Type.FLOAT:
            a = self._paren(self._lower_as(e.lhs, Type.FLOAT), _PY_PREC["/"])
            b = self._paren(self._lower_as(e.rhs, Type.FLOAT), _PY_PREC["/"] + 1)
            self.helpers.add("_floor_quotient")
            quotient = f"_floor_quotient({a}, {b})"
            if e.op == "//":
                return quotient, _PY_ATOM
            return f"{a} - {quotient} * {b}", _PY_PREC["-"]
        prec = _PY_PREC[e.op]
        lhs = self._paren(self._lower_as(e.lhs, operand_type), prec)
        rhs = self._paren(self._lower_as(e.rhs, operand_type), prec + 1)
        return f"{lhs} {e.op} {rhs}", prec

    def _wide(self, e: Expr, t: Type) -> bool:
        """Whether an integer operation must run in int64: its result may not fit int32 (ranges.py)."""
        return t is Type.INT and not within(integer_range(e, self.scope.inputs), INT32)

    def _int_operand(self, e: Expr, wide: bool) -> tuple[str, int]:
        """An integer operand, converted to int64 for a wide operation (constants and int64 values as they are)."""
        code = self._lower(e)
        if not wide or not variables(e) or not within(integer_range(e, self.scope.inputs), INT32):  # constants: Python ints
            return code
        return f"{self._paren(code, _PY_ATOM)}.to(tl.int64)", _PY_ATOM

    def _lower_call(self, e: Call, t: Type) -> tuple[str, int]:
        if e.func in ("min", "max"):
            fn = "tl.minimum" if e.func == "min" else "tl.maximum"
            # NaN wins, as in torch.minimum/maximum (the GPU's plain min.f32 would return the other operand)
            nan = ", propagate_nan=tl.PropagateNan.ALL" if t is Type.FLOAT else ""
            code = self._lower_as(e.args[0], t)[0]
            for a in e.args[1:]:
                code = f"{fn}({code}, {self._lower_as(a, t)[0]}{nan})"
            return code, _PY_ATOM
        if e.func == "where":
            cond = self._lower(e.args[0])[0]
            a, b = (self._lower_as(x, t)[0] for x in e.args[1:])
            return f"tl.where({cond}, {a}, {b})", _PY_ATOM
        if e.func == "abs":
            return f"tl.abs({self._int_operand(e.args[0], self._wide(e, t))[0]})", _PY_ATOM
        arg = self._lower_as(e.args[0], Type.FLOAT)[0]
        if e.func == "tanh":
            self.helpers.add("_tanh")
            code = f"_tanh({arg})"
        else:
            code = f"tl.{e.func}({arg})"
        return self._temp(e, e.func, code)
