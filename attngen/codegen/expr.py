"""Expressions lowered to Triton code: the only place where spec expressions become kernel text.

It works from the AST nodes of attngen/lang/spec.py, never from spec strings: names in the output are either fixed
kernel variables (`q_idx`, `kv_idx`, ...), validated input identifiers, or temporaries it makes up; literals are
printed from Python numbers with `repr`, which cannot produce anything but a number. The Gluon generator
translates this code name by name (codegen/gluon/lower.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from ..lang.analysis import nonnegative, positive_const
from ..lang.expr import Scope, children, is_number, promote, typeof, variables
from ..lang.ranges import INT32, integer_range, may_be_zero, within
from ..lang.spec import BIT_OPS, COMPARE_OPS, Binary, Call, Const, Expr, Index, InputDecl, Type, Unary, Var

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
# length is at most FLOAT_POSITIONS. Measured on the H100 (2026-11-27, ALiBi): the Gluon
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


def positions_in_float(e: Expr) -> bool:
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
        if self.positions_leafwise and positions_in_float(e):
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
            common = promote(lt, rt) if is_number(lt) and is_number(rt) else lt
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
            if e.op in ("//", "%") and not (nonnegative(e.lhs) and positive_const(e.rhs)):
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
