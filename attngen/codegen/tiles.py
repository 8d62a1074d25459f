"""Tile classes as kernel code: the interval analysis of attngen/lang/intervals.py, lowered to integer Triton
code that each program runs over a vector of tiles (the generated `_tile_class`), so the kernels skip the tiles
a mask drops and run the ones it keeps whole without the mask."""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.analysis import nonnegative
from ..lang.expr import typeof
from ..lang.expr import variables as _variables
from ..lang.ranges import INT32, integer_range, within
from ..lang.spec import Binary, Call, Const, Expr, Index, Type, Unary, Var


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
    helpers: set[str]  # generated helper functions the statements call (names of codegen.expr.HELPERS)
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
        arithmetic, codegen.expr.Lowerer._wide): the bounds are exact integers either way."""
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
