"""What can be proved of an expression without running it: its sign (so that `//` and `%` may use the fast
truncating operators), whether it is affine in a variable, and whether a score modification is a separable bias
(ALiBi: a part of the row plus a part of the key)."""
from __future__ import annotations

from .algebra import fold
from .expr import FLOAT_FUNCTIONS, INDEX_VARS, Scope, children, substitute, variables
from .spec import Binary, Call, Const, Expr, Index, Type, Unary, Var

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


def positive_const(e: Expr) -> bool:
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
