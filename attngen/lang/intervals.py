"""Interval analysis of expressions: what a mask can be over a whole tile of (query, key) indices.

`truth(mask, env)` answers ALWAYS, NEVER or MAYBE for every index combination that `env` allows (each
variable bounded by an Interval). It is sound: ALWAYS and NEVER are claimed only when they hold for every
point; whenever unsure it says MAYBE. From it, `classify_tiles` labels each (query tile, key tile) pair
FULL (every pair kept), EMPTY (none kept) or PARTIAL.

Soundness rules: numbers are closed intervals [lo, hi] over the extended reals (an unbounded side is
+-inf, and since actual values are finite, 0 * inf counts as 0); operations without a tight rule (an input
read, a division by an interval containing 0, `%` by a non-constant) give the whole line; booleans are
(may be false, may be true) pairs. Correlation between operands is lost (q_idx - q_idx is not known to be
0), which only costs precision.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from .algebra import FOLD_BINARY
from .analysis import nonnegative
from .spec import Binary, Call, Const, Expr, Index, Type, Unary, Var

INF = math.inf


class Truth(enum.Enum):
    NEVER = "never"
    MAYBE = "maybe"
    ALWAYS = "always"


class TileClass(enum.Enum):
    EMPTY = "."
    PARTIAL = "+"
    FULL = "#"


@dataclass(frozen=True)
class Interval:
    lo: float
    hi: float

    @staticmethod
    def point(x: float) -> "Interval":
        return Interval(x, x)

    @staticmethod
    def everything() -> "Interval":
        return Interval(-INF, INF)

    def hull(self, other: "Interval") -> "Interval":
        return Interval(min(self.lo, other.lo), max(self.hi, other.hi))


@dataclass(frozen=True)
class BoolRange:
    may_be_false: bool
    may_be_true: bool

    @property
    def truth(self) -> Truth:
        if not self.may_be_false:
            return Truth.ALWAYS
        if not self.may_be_true:
            return Truth.NEVER
        return Truth.MAYBE


MAYBE = BoolRange(True, True)


def _mul(a: float, b: float) -> float:
    return 0.0 if a == 0 or b == 0 else a * b


def _is_const(e: Expr) -> bool:
    return isinstance(e, Const) and e.type is not Type.BOOL


def evaluate(e: Expr, env: dict[str, Interval]):
    """The Interval (numbers) or BoolRange (booleans) `e` can take when each variable ranges over env's Interval.
    Variables missing from env are unbounded."""
    if isinstance(e, Const):
        if e.type is Type.BOOL:
            return BoolRange(not e.value, bool(e.value))
        return Interval.point(e.value)
    if isinstance(e, Var):
        return env.get(e.name, Interval.everything())
    if isinstance(e, Index):
        return _unknown_like(e)
    if isinstance(e, Unary):
        a = evaluate(e.operand, env)
        if e.op == "not":
            return BoolRange(a.may_be_true, a.may_be_false)
        return Interval(-a.hi, -a.lo)
    if isinstance(e, Binary):
        return _binary(e, env)
    if isinstance(e, Call):
        return _call(e, env)
    raise TypeError(e)


def _unknown_like(e: Index):
    # The element type of an input is not known here (no scope); booleans and numbers are both covered by
    # returning a value that every consumer treats as unknown: comparisons of unbounded intervals are MAYBE,
    # and a boolean context receiving an Interval treats it as MAYBE.
    return Interval.everything()


def _as_bool(x) -> BoolRange:
    return x if isinstance(x, BoolRange) else MAYBE


def _binary(e: Binary, env):
    a, b = evaluate(e.lhs, env), evaluate(e.rhs, env)
    if e.op in ("and", "or") or (e.op in ("&", "|") and (isinstance(a, BoolRange) or isinstance(b, BoolRange))):
        a, b = _as_bool(a), _as_bool(b)
        if e.op in ("and", "&"):
            return BoolRange(a.may_be_false or b.may_be_false, a.may_be_true and b.may_be_true)
        return BoolRange(a.may_be_false and b.may_be_false, a.may_be_true or b.may_be_true)
    if e.op in ("<", "<=", ">", ">=", "==", "!="):
        if isinstance(a, BoolRange) or isinstance(b, BoolRange):
            return _bool_compare(e.op, _as_bool(a), _as_bool(b))
        return _compare(e.op, a, b)
    result = _arith(e, a, b)
    return _widen(result) if _is_float(result, a, b, e.op) else result


def _is_float(result: Interval, a: Interval, b: Interval, op: str) -> bool:
    """Whether a result may carry float rounding: true division, or any non-integer operand or bound."""
    bounds = (a.lo, a.hi, b.lo, b.hi, result.lo, result.hi)
    return op == "/" or any(math.isfinite(x) and x != int(x) for x in bounds)


def _arith(e: Binary, a: Interval, b: Interval) -> Interval:
    # A non-empty interval never has lo = +inf or hi = -inf, so these sums never meet inf - inf.
    if e.op == "+":
        return Interval(a.lo + b.lo, a.hi + b.hi)
    if e.op == "-":
        return Interval(a.lo - b.hi, a.hi - b.lo)
    if e.op == "*":
        products = [_mul(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
        return Interval(min(products), max(products))
    if e.op == "/":
        if b.lo <= 0 <= b.hi:
            return Interval.everything()
        quotients = [x / y if not (math.isinf(x) and math.isinf(y)) else (INF if (x > 0) == (y > 0) else -INF)
                     for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
        return Interval(min(quotients), max(quotients))
    if e.op == "//":
        if not _is_const(e.rhs) or e.rhs.value == 0:
            return Interval.everything()
        c = e.rhs.value
        ends = [math.floor(x / c) if not math.isinf(x) else (x if c > 0 else -x) for x in (a.lo, a.hi)]
        return Interval(min(ends), max(ends))
    if e.op in ("&", "|", "^"):
        return _bitwise(e, a, b)
    if e.op == "%":
        if not _is_const(e.rhs) or e.rhs.value == 0:
            return Interval.everything()
        c = e.rhs.value
        if not (math.isinf(a.lo) or math.isinf(a.hi)) and math.floor(a.lo / c) == math.floor(a.hi / c):
            return Interval(a.lo - c * math.floor(a.lo / c), a.hi - c * math.floor(a.hi / c))  # within one period
        if isinstance(c, int):
            return Interval(0, c - 1) if c > 0 else Interval(c + 1, 0)
        return Interval(0, c) if c > 0 else Interval(c, 0)
    raise TypeError(e.op)


def _bitwise(e: Binary, a: Interval, b: Interval) -> Interval:
    """Bitwise and/or/xor of integers: exact when both sides are one value; otherwise bounds that hold for
    operands proved non-negative by the sign analysis (the same rules as the in-kernel code, _TileLowerer):
    0 <= a & b <= min(a, b) (a & b <= a when only a >= 0), max(a, b) <= a | b <= a + b, 0 <= a ^ b <= a + b."""
    if a.lo == a.hi and b.lo == b.hi and not math.isinf(a.lo) and not math.isinf(b.lo):
        return Interval.point(FOLD_BINARY[e.op](int(a.lo), int(b.lo)))
    left, right = nonnegative(e.lhs), nonnegative(e.rhs)
    if e.op == "&" and (left or right):
        return Interval(0, min(x.hi for x, known in ((a, left), (b, right)) if known))
    if left and right:
        if e.op == "|":
            return Interval(max(a.lo, b.lo), a.hi + b.hi)
        return Interval(0, a.hi + b.hi)
    return Interval.everything()



def _compare(op: str, a: Interval, b: Interval) -> BoolRange:
    if op == "<":
        return BoolRange(not a.hi < b.lo, a.lo < b.hi)
    if op == "<=":
        return BoolRange(not a.hi <= b.lo, a.lo <= b.hi)
    if op == ">":
        return BoolRange(not a.lo > b.hi, a.hi > b.lo)
    if op == ">=":
        return BoolRange(not a.lo >= b.hi, a.hi >= b.lo)
    disjoint = a.hi < b.lo or b.hi < a.lo
    same_point = a.lo == a.hi == b.lo == b.hi
    eq = BoolRange(not same_point, not disjoint)
    return eq if op == "==" else BoolRange(eq.may_be_true, eq.may_be_false)


def _bool_compare(op: str, a: BoolRange, b: BoolRange) -> BoolRange:
    if op not in ("==", "!="):
        return MAYBE
    a_fixed = a.truth is not Truth.MAYBE
    b_fixed = b.truth is not Truth.MAYBE
    if a_fixed and b_fixed:
        equal = a.truth is b.truth
        result = equal if op == "==" else not equal
        return BoolRange(not result, result)
    return MAYBE


# Monotone increasing functions: (function on finite x, value at -inf, value at +inf, smallest valid x).
_MONOTONE = {
    "exp": (math.exp, 0.0, INF, -INF),
    "tanh": (math.tanh, -1.0, 1.0, -INF),
    "sigmoid": (lambda x: 1.0 / (1.0 + math.exp(-x)) if x > -700 else 0.0, 0.0, 1.0, -INF),
    "log": (math.log, None, INF, 0.0),  # needs x > 0
    "sqrt": (math.sqrt, None, INF, 0.0),  # needs x >= 0
}
FLOAT_SLACK = 1e-5  # relative widening of float results: the kernels compute in float32, this analysis in float64


def _widen(iv: Interval) -> Interval:
    """Widen a float interval outward, so that float32 rounding in the kernel cannot leave it."""
    def pad(x: float) -> float:
        return FLOAT_SLACK * max(1.0, abs(x)) if math.isfinite(x) else 0.0
    return Interval(iv.lo - pad(iv.lo), iv.hi + pad(iv.hi))


def _apply(func: str, x: float) -> float:
    fn, at_neg_inf, at_pos_inf, _ = _MONOTONE[func]
    if x == -INF:
        return at_neg_inf
    if x == INF:
        return at_pos_inf
    try:
        return fn(x)
    except OverflowError:
        return INF


def _call(e: Call, env):
    args = [evaluate(a, env) for a in e.args]
    if e.func == "where":
        c = _as_bool(args[0])
        if c.truth is Truth.ALWAYS:
            return args[1]
        if c.truth is Truth.NEVER:
            return args[2]
        x, y = args[1], args[2]
        if isinstance(x, BoolRange) or isinstance(y, BoolRange):
            x, y = _as_bool(x), _as_bool(y)
            return BoolRange(x.may_be_false or y.may_be_false, x.may_be_true or y.may_be_true)
        return x.hull(y)
    if e.func in ("min", "max"):
        pick = min if e.func == "min" else max
        return Interval(pick(a.lo for a in args), pick(a.hi for a in args))
    (a,) = args
    if e.func == "abs":
        if a.lo >= 0:
            return a
        if a.hi <= 0:
            return Interval(-a.hi, -a.lo)
        return Interval(0, max(-a.lo, a.hi))
    smallest = _MONOTONE[e.func][3]
    if a.lo < smallest or (e.func == "log" and a.lo <= 0):
        return Interval.everything()  # may leave the domain (NaN, -inf): nothing known
    return _widen(Interval(_apply(e.func, a.lo), _apply(e.func, a.hi)))


def truth(mask: Expr, env: dict[str, Interval]) -> Truth:
    return _as_bool(evaluate(mask, env)).truth


def keeps_first_key(mask: Expr) -> bool:
    """Whether the mask provably keeps key 0 for every query row, batch and head, at any sequence lengths
    (q_idx >= 0, lengths >= 1). Then every row keeps at least one key, and a kernel that first visits a tile
    holding key 0 (or a full tile) never sees a row with no key so far: it needs no NaN guards."""
    env = {"q_idx": Interval(0, INF), "kv_idx": Interval.point(0), "q_len": Interval(1, INF), "kv_len": Interval(1, INF),
           "b": Interval(0, INF), "h": Interval(0, INF)}
    return truth(mask, env) is Truth.ALWAYS


def tile_env(q_lo: int, q_hi: int, kv_lo: int, kv_hi: int, q_len: int, kv_len: int,
             batch: Interval | None = None, heads: Interval | None = None) -> dict[str, Interval]:
    """Variable bounds for the tile q_idx in [q_lo, q_hi], kv_idx in [kv_lo, kv_hi] (inclusive)."""
    return {
        "q_idx": Interval(q_lo, q_hi),
        "kv_idx": Interval(kv_lo, kv_hi),
        "q_len": Interval.point(q_len),
        "kv_len": Interval.point(kv_len),
        "b": batch or Interval(0, INF),
        "h": heads or Interval(0, INF),
    }


def classify_tiles(mask: Expr | None, q_len: int, kv_len: int, block_m: int, block_n: int) -> list[list[TileClass]]:
    """The class of every (query tile, key tile) pair, for every batch and head. A tile that reaches past
    the end of the sequence is classified on the indices that exist (the kernels bound-check them anyway)."""
    rows = []
    for q0 in range(0, q_len, block_m):
        row = []
        for k0 in range(0, kv_len, block_n):
            if mask is None:
                row.append(TileClass.FULL)
                continue
            env = tile_env(q0, min(q0 + block_m, q_len) - 1, k0, min(k0 + block_n, kv_len) - 1, q_len, kv_len)
            t = truth(mask, env)
            row.append({Truth.ALWAYS: TileClass.FULL, Truth.NEVER: TileClass.EMPTY, Truth.MAYBE: TileClass.PARTIAL}[t])
        rows.append(row)
    return rows


def tile_map(classes: list[list[TileClass]], max_width: int = 64) -> str:
    """A character grid ('#' full, '+' partial, '.' empty), rows = query tiles, columns = key tiles. Larger
    grids are shown in groups of tiles: a group prints '#' or '.' only if every tile in it is that class."""
    if not classes:
        return "(no tiles)"
    n_rows, n_cols = len(classes), len(classes[0])
    step = max(1, math.ceil(max(n_rows, n_cols) / max_width))
    lines = []
    for r in range(0, n_rows, step):
        line = []
        for c in range(0, n_cols, step):
            group = {classes[i][j] for i in range(r, min(r + step, n_rows)) for j in range(c, min(c + step, n_cols))}
            line.append(group.pop().value if len(group) == 1 else TileClass.PARTIAL.value)
        lines.append("".join(line))
    note = f"  (each character: {step}x{step} tiles)" if step > 1 else ""
    return "\n".join(lines) + note


def tile_counts(classes: list[list[TileClass]]) -> dict[TileClass, int]:
    counts = {c: 0 for c in TileClass}
    for row in classes:
        for c in row:
            counts[c] += 1
    return counts
