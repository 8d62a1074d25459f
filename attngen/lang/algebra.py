"""Algebra on the expression IR: constant folding and symbolic differentiation (the backward of a score
modification, and of the score with respect to an input it reads)."""
from __future__ import annotations

import math

from .expr import Scope, children, typeof, variables
from .spec import BIT_OPS, Binary, Call, Const, Expr, Index, Type, Unary, Var


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


def floordiv(a, b):
    """The language's `//`: integers round toward -inf and a // 0 = 0; floats are floor(a / b) (IEEE: a // 0.0
    is +-inf or NaN), as the kernels compute them (Python's float // differs in the last place)."""
    if isinstance(a, float) or isinstance(b, float):
        return _floor_quotient(a, b)
    return a // b if b != 0 else 0


def pymod(a, b):
    """The language's `%`: integers take the divisor's sign and a % 0 = a; floats are a - floor(a / b) * b."""
    if isinstance(a, float) or isinstance(b, float):
        return a - _floor_quotient(a, b) * b
    return a % b if b != 0 else a


FOLD_BINARY = {
    "+": lambda a, b: a + b,
    "-": lambda a, b: a - b,
    "*": lambda a, b: a * b,
    "/": lambda a, b: a / b,
    "//": floordiv,
    "%": pymod,
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
                value = FOLD_BINARY[e.op](a.value, b.value)
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
