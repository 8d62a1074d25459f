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

from .expr import _FOLD_BINARY, nonnegative, typeof
from .ranges import INT32, integer_range, within
from .expr import variables as _variables
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
        return Interval.point(_FOLD_BINARY[e.op](int(a.lo), int(b.lo)))
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


# ---- the same analysis, as Triton code evaluated per tile inside the kernels --------------------------------
@dataclass(frozen=True)
class InputBounds:
    """Per-chunk minima and maxima of an integer or boolean input along the axis that q_idx or kv_idx indexes,
    made at run time by the generated pre-pass kernel, so the in-kernel classifier can bound a read such as
    doc[b, kv_idx] over a whole tile. Stored as one tensor [2, *shape with that axis in chunks]."""

    input: str
    axis: int

    @property
    def param(self) -> str:
        return f"tiles_{self.input}_{self.axis}"


@dataclass
class TileClassCode:
    """Triton statements computing, for a vector of tiles, whether the mask can be false (`may_drop`) and
    whether it can be true (`may_keep`). Integer arithmetic only, and every bound exact: index arithmetic in
    int32 where its range fits (ranges.py), else int64; input reads (only comparison operands) in int32 for
    inputs of at most 32 bits (their whole range is then the unknown interval), else int64."""

    stmts: list[str]
    may_drop: str
    may_keep: str
    helpers: set[str]  # generated helper functions the statements call (names of expr.HELPERS)
    params: list[str]  # kernel parameters the statements read (input pointers, strides, sizes, bounds)
    bounds: list[InputBounds]  # the pre-pass summaries they need


_AXIS_VARS = {"q_idx": ("q_lo", "q_hi"), "kv_idx": ("kv_lo", "kv_hi")}


class _TileLowerer:
    """Lowers `evaluate` to Triton code over a vector of tiles: q_idx in [q_lo, q_hi], kv_idx in [kv_lo, kv_hi]
    (elementwise); b, h, q_len, kv_len are exact scalars. Floats are unknown (None), and so is arithmetic on
    input values (its endpoints could wrap around where the kernel's elementwise values do not). An input
    read is known when it is a comparison operand or a boolean: exact if its indices do not involve q_idx or
    kv_idx, else bounded by the pre-pass summary when one index is q_idx or kv_idx itself."""

    def __init__(self, scope, span: int | None = None):
        self.scope = scope
        self.span = span  # chunks a tile covers at most, read one by one (elementwise: scalar tiles too); None: TILE_SPAN at once
        self.stmts: list[str] = []
        self.helpers: set[str] = set()
        self.params: list[str] = []
        self.bounds: list[InputBounds] = []
        self._chunks: dict[InputBounds, str] = {}
        self.n = 0

    def _new(self, code: str) -> str:
        name = f"t{self.n}"
        self.n += 1
        self.stmts.append(f"{name} = {code}")
        return name

    def _param(self, name: str) -> str:
        if name not in self.params:
            self.params.append(name)
        return name

    def read(self, e: Index):
        """(lo, hi) code for an integer or boolean input read (booleans as 0/1), or None when unknown."""
        decl = self.scope.inputs[e.input]
        if decl.type not in (Type.INT, Type.BOOL):
            return None
        n = decl.name
        # the bounds' type: int32 for inputs of at most 32 bits (an int32 vector of tiles takes one register a tile
        # where int64 takes two: measured 1.02-1.04x on the Gluon forward with a document mask), else int64
        width, lowest, highest = ("tl.int64", "INT64_MIN", "INT64_MAX") if decl.dtype == "int64" else ("tl.int32", "INT32_MIN", "INT32_MAX")
        ptr, size = f"in_{n}_ptr", [f"in_{n}_size_{i}" for i in range(len(e.indices))]
        axes = [i for i, idx in enumerate(e.indices) if {"q_idx", "kv_idx"} & _variables(idx)]
        exact = {}
        for i, idx in enumerate(e.indices):
            if i in axes:
                continue
            r = self.read(idx) if isinstance(idx, Index) else self.number(idx)
            if r is None:
                return None
            exact[i] = r[0]  # no q_idx or kv_idx: every bound of it is the one value (lo == hi)
        checks = [f"({exact[i]} < {self._param(size[i])})" for i in exact]  # reads outside the input give 0
        checks += [f"({exact[i]} >= 0)" for i in exact if not nonnegative(e.indices[i])]
        in_bounds = " & ".join(checks) or "True"
        if not axes:  # one element for the whole tile
            offset = " + ".join(f"{exact[i]} * {self._param(f'in_{n}_stride_{i}')}" for i in exact)
            value = self._new(f"tl.load({self._param(ptr)} + {offset}, mask={in_bounds}, other=0).to(tl.int64)")
            return value, value
        if len(axes) > 1 or not isinstance(e.indices[axes[0]], Var):
            return None
        axis = axes[0]
        lo, hi = _AXIS_VARS[e.indices[axis].name]
        summary = InputBounds(n, axis)
        if summary not in self.bounds:
            self.bounds.append(summary)
        tiles = self._param(summary.param)
        for s in size:
            self._param(s)
        # the summary is [2, *shape] with the axis in chunks of TILE_CHUNK; read the chunks the tile covers
        if summary not in self._chunks:  # the same input read on both axes shares its chunk count
            self._chunks[summary] = self._new(f"tl.cdiv({size[axis]}, TILE_CHUNK)")
        chunks = self._chunks[summary]
        c0 = self._new(f"{lo} // TILE_CHUNK")
        c1 = self._new(f"{hi} // TILE_CHUNK")
        dims = [size[i] if i != axis else chunks for i in range(len(size))]
        total = " * ".join(dims)
        if self.span is not None:
            mn, mx = self._chunks_one_by_one(tiles, exact, dims, total, chunks, c0, c1, width, lowest, highest)
            covered = self._new(f"{c1} - {c0} < {self.span}")
        else:
            mn, mx = self._chunks_at_once(tiles, exact, dims, total, chunks, c0, c1, width, lowest, highest)
            covered = self._new(f"{c1} - {c0} < TILE_SPAN")
        # unknown if the tile spans more chunks than were read; indices past the input's end read 0
        past_end = self._new(f"{hi} >= {size[axis]}")
        mn = self._new(f"tl.where({covered}, tl.where({past_end}, tl.minimum({mn}, 0), {mn}), {lowest})")
        mx = self._new(f"tl.where({covered}, tl.where({past_end}, tl.maximum({mx}, 0), {mx}), {highest})")
        if in_bounds == "True":
            return mn, mx
        return self._new(f"tl.where({in_bounds}, {mn}, 0)"), self._new(f"tl.where({in_bounds}, {mx}, 0)")

    def _offset(self, index: list[str], dims: list[str]) -> str:
        offset = index[0]
        for i in range(1, len(dims)):
            offset = f"{offset if offset.isidentifier() else f'({offset})'} * {dims[i]} + {index[i]}"
        return offset

    def _chunks_at_once(self, tiles, exact, dims, total, chunks, c0, c1, width, lowest, highest):
        """(min, max) over the chunks c0..c1 of a vector of tiles: TILE_SPAN chunks per tile as a second axis,
        in `width` (lowest, highest: its extremes)."""
        c = self._new(f"{c0}[:, None] + tl.arange(0, TILE_SPAN)[None, :]")
        offset = self._offset([exact.get(i, c) for i in range(len(dims))], dims)
        ok = self._new(f"({c} <= {c1}[:, None]) & ({c} < {chunks})")
        mn = self._new(f"tl.load({tiles} + {offset}, mask={ok}, other=0).to({width})")
        mx = self._new(f"tl.load({tiles} + {total} + {offset}, mask={ok}, other=0).to({width})")
        mn = self._new(f"tl.min(tl.where({ok}, {mn}, {highest}), axis=1)")
        mx = self._new(f"tl.max(tl.where({ok}, {mx}, {lowest}), axis=1)")
        return mn, mx

    def _chunks_one_by_one(self, tiles, exact, dims, total, chunks, c0, c1, width, lowest, highest):
        """(min, max) over the chunks c0..c1 of tiles (scalars or vectors alike): `span` elementwise reads of the
        chunks c0, c0 + 1, ..., those past c1 or past the input's end left out; in `width` (lowest, highest: its
        extremes)."""
        mn = mx = None
        for k in range(self.span):
            c = c0 if k == 0 else self._new(f"{c0} + {k}")
            offset = self._offset([exact.get(i, c) for i in range(len(dims))], dims)
            ok = self._new(f"{c} < {chunks}" if k == 0 else f"({c} <= {c1}) & ({c} < {chunks})")
            chunk_min = self._new(f"tl.where({ok}, tl.load({tiles} + {offset}, mask={ok}, other=0).to({width}), {highest})")
            chunk_max = self._new(f"tl.where({ok}, tl.load({tiles} + {total} + {offset}, mask={ok}, other=0).to({width}), {lowest})")
            mn = chunk_min if mn is None else self._new(f"tl.minimum({mn}, {chunk_min})")
            mx = chunk_max if mx is None else self._new(f"tl.maximum({mx}, {chunk_max})")
        return mn, mx

    def number(self, e: Expr):
        """(lo, hi) code for an integer expression, or None when unknown."""
        if typeof(e, self.scope) is not Type.INT:
            return None
        if isinstance(e, Const):
            return repr(e.value), repr(e.value)
        if isinstance(e, Var):
            return _AXIS_VARS.get(e.name, (e.name, e.name))
        if isinstance(e, Index):
            return None  # see read(): only comparison operands
        if isinstance(e, Unary):
            a = self._operand(e.operand, e)
            return None if a is None else (self._new(f"-{a[1]}"), self._new(f"-{a[0]}"))
        if isinstance(e, Binary):
            a, b = self._operand(e.lhs, e), self._operand(e.rhs, e)
            if a is None or b is None:
                return None
            if e.op == "+":
                return self._new(f"{a[0]} + {b[0]}"), self._new(f"{a[1]} + {b[1]}")
            if e.op == "-":
                return self._new(f"{a[0]} - {b[1]}"), self._new(f"{a[1]} - {b[0]}")
            if e.op == "*":
                products = [self._new(f"{x} * {y}") for x in a for y in b]
                lo = hi = products[0]
                for p in products[1:]:
                    lo, hi = self._new(f"tl.minimum({lo}, {p})"), self._new(f"tl.maximum({hi}, {p})")
                return lo, hi
            if e.op in ("&", "|", "^"):
                return self._bitwise(e, a, b)
            positive = isinstance(e.rhs, Const) and e.rhs.value > 0
            if e.op == "//" and positive:  # monotone: floor(lo / c), floor(hi / c)
                self.helpers.add("_floordiv")
                return self._new(f"_floordiv({a[0]}, {e.rhs.value})"), self._new(f"_floordiv({a[1]}, {e.rhs.value})")
            if e.op == "%" and positive:
                c = e.rhs.value
                self.helpers |= {"_floordiv", "_mod"}
                same = self._new(f"_floordiv({a[0]}, {c}) == _floordiv({a[1]}, {c})")  # within one period
                return (self._new(f"tl.where({same}, _mod({a[0]}, {c}), 0)"), self._new(f"tl.where({same}, _mod({a[1]}, {c}), {c - 1})"))
            return None
        if isinstance(e, Call):
            if e.func in ("min", "max"):
                args = [self.number(x) for x in e.args]
                if any(x is None for x in args):
                    return None
                fn = "tl.minimum" if e.func == "min" else "tl.maximum"
                lo, hi = args[0]
                for x in args[1:]:
                    lo, hi = self._new(f"{fn}({lo}, {x[0]})"), self._new(f"{fn}({hi}, {x[1]})")
                return lo, hi
            if e.func == "abs":
                a = self._operand(e.args[0], e)
                if a is None:
                    return None
                lo = self._new(f"tl.where({a[0]} >= 0, {a[0]}, tl.where({a[1]} <= 0, -{a[1]}, 0))")
                hi = self._new(f"tl.maximum(tl.abs({a[0]}), tl.abs({a[1]}))")
                return lo, hi
            if e.func == "where":
                c = self.boolean(e.args[0])
                a, b = self.number(e.args[1]), self.number(e.args[2])
                if a is None or b is None:
                    return None
                # hull of both branches, narrowed to one when the condition is decided
                lo = self._new(f"tl.where(~{c[0]}, {a[0]}, tl.where(~{c[1]}, {b[0]}, tl.minimum({a[0]}, {b[0]})))")
                hi = self._new(f"tl.where(~{c[0]}, {a[1]}, tl.where(~{c[1]}, {b[1]}, tl.maximum({a[1]}, {b[1]})))")
                return lo, hi
        return None

    def _operand(self, e: Expr, parent: Expr):
        """number(e), as int64 where the parent's value may not fit int32 (the same rule as the kernels' own
        arithmetic, expr.Lowerer._wide): the bounds are exact integers either way."""
        r = self.number(e)
        if r is None or not _variables(e) or within(integer_range(parent, self.scope.inputs), INT32):
            return r
        return tuple(x if _is_int_literal(x) else self._new(f"{x}.to(tl.int64)") for x in r)

    def _bitwise(self, e: Binary, a: tuple[str, str], b: tuple[str, str]):
        """As intervals._bitwise: the exact value where both sides are one value in this tile, else bounds from
        the operands' signs (known at compile time; None if they do not give any)."""
        left, right = nonnegative(e.lhs), nonnegative(e.rhs)
        if e.op == "&" and (left or right):
            bound = {(True, True): f"tl.minimum({a[1]}, {b[1]})", (True, False): a[1], (False, True): b[1]}[left, right]
            lo, hi = "0", bound
        elif left and right:
            lo = f"tl.maximum({a[0]}, {b[0]})" if e.op == "|" else "0"
            hi = f"{a[1]} + {b[1]}"
        else:
            return None
        exact = self._new(f"({a[0]} == {a[1]}) & ({b[0]} == {b[1]})")
        value = self._new(f"{a[0]} {e.op} {b[0]}")
        return self._new(f"tl.where({exact}, {value}, {lo})"), self._new(f"tl.where({exact}, {value}, {hi})")

    def boolean(self, e: Expr) -> tuple[str, str]:
        """(may be false, may be true) code for a boolean expression; ("True", "True") when unknown."""
        unknown = ("True", "True")
        if isinstance(e, Const) and e.type is Type.BOOL:
            return ("False", "True") if e.value else ("True", "False")
        if isinstance(e, Unary) and e.op == "not":
            f, t = self.boolean(e.operand)
            return t, f
        if isinstance(e, Binary) and e.op in ("and", "or"):
            (af, at), (bf, bt) = self.boolean(e.lhs), self.boolean(e.rhs)
            if e.op == "and":
                return self._new(f"{af} | {bf}"), self._new(f"{at} & {bt}")
            return self._new(f"{af} & {bf}"), self._new(f"{at} | {bt}")
        if isinstance(e, Index):
            r = self.read(e)
            return unknown if r is None else (self._new(f"{r[0]} == 0"), self._new(f"{r[1]} != 0"))
        if isinstance(e, Binary) and e.op in ("<", "<=", ">", ">=", "==", "!="):
            a, b = (self.read(x) if isinstance(x, Index) else self.number(x) for x in (e.lhs, e.rhs))
            if a is None or b is None:
                return unknown
            (alo, ahi), (blo, bhi) = a, b
            rule = {
                "<": (f"{ahi} >= {blo}", f"{alo} < {bhi}"),
                "<=": (f"{ahi} > {blo}", f"{alo} <= {bhi}"),
                ">": (f"{alo} <= {bhi}", f"{ahi} > {blo}"),
                ">=": (f"{alo} < {bhi}", f"{ahi} >= {blo}"),
            }
            if e.op in rule:
                return tuple(self._new(code) for code in rule[e.op])
            same_point = self._new(f"({alo} == {ahi}) & ({blo} == {bhi}) & ({alo} == {blo})")
            overlap = self._new(f"({ahi} >= {blo}) & ({bhi} >= {alo})")
            return (self._new(f"~{same_point}"), overlap) if e.op == "==" else (overlap, self._new(f"~{same_point}"))
        return unknown


def _is_int_literal(code: str) -> bool:
    return code.lstrip("-").isdigit()


def lower_tile_class(mask: Expr, scope, span: int | None = None) -> TileClassCode | None:
    """Triton code deciding a tile's class at run time, or None if nothing about the mask is decidable that way.
    Inputs bounded by the pre-pass's chunks: read TILE_SPAN chunks at once for a vector of tiles (a second axis),
    or with `span` (the most chunks a tile covers) one by one, elementwise, so that scalar tiles work too."""
    lowerer = _TileLowerer(scope, span)
    may_drop, may_keep = lowerer.boolean(mask)
    if (may_drop, may_keep) == ("True", "True"):
        return None
    # a side decided for every tile is a Python constant here: make it a vector like the others
    constant = {"True": "tl.zeros_like(q_lo) == 0", "False": "tl.zeros_like(q_lo) != 0"}
    may_drop, may_keep = (lowerer._new(constant[x]) if x in constant else x for x in (may_drop, may_keep))
    return TileClassCode(lowerer.stmts, may_drop, may_keep, lowerer.helpers, lowerer.params, lowerer.bounds)
