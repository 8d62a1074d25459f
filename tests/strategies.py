"""Hypothesis strategies: well-typed random expressions of the .attn language (shared by the test files)."""
from hypothesis import strategies as st

from attngen.lang import expr as ex
from attngen.lang.spec import Binary, Call, Const, Type, Unary, Var

INT_VARS = ("b", "h", "q_idx", "kv_idx", "q_len", "kv_len")


def int_exprs(max_leaves=8):
    leaf = st.one_of(st.sampled_from([Var(v) for v in INT_VARS]), st.integers(0, 9).map(lambda n: Const(n, Type.INT)))

    def extend(children):
        nonzero = st.integers(1, 7).map(lambda n: Const(n, Type.INT)) | st.integers(1, 7).map(lambda n: Unary("-", Const(n, Type.INT)))
        return st.one_of(
            st.tuples(st.sampled_from(["+", "-", "*"]), children, children).map(lambda t: Binary(t[0], t[1], t[2])),
            st.tuples(st.sampled_from(["//", "%"]), children, nonzero).map(lambda t: Binary(t[0], t[1], t[2])),
            st.tuples(st.sampled_from(["&", "|", "^"]), children, children).map(lambda t: Binary(t[0], t[1], t[2])),
            children.map(lambda c: Unary("-", c)),
            children.map(lambda c: Call("abs", (c,))),
            st.tuples(st.sampled_from(["min", "max"]), children, children).map(lambda t: Call(t[0], (t[1], t[2]))),
        )

    return st.recursive(leaf, extend, max_leaves=max_leaves)


def bool_exprs():
    cmp = st.tuples(st.sampled_from(ex.COMPARE_OPS), int_exprs(5), int_exprs(5)).map(
        lambda t: Binary(t[0], t[1], t[2])
    )

    def extend(children):
        return st.one_of(
            st.tuples(st.sampled_from(["and", "or"]), children, children).map(lambda t: Binary(t[0], t[1], t[2])),
            children.map(lambda c: Unary("not", c)),
        )

    return st.recursive(cmp, extend, max_leaves=4)


def float_exprs():
    """Float expressions of `score` whose functions stay in their domains for |score| <= 4."""
    leaf = st.one_of(st.just(Var("score")), st.floats(0.25, 3.0).map(lambda x: Const(round(x, 3), Type.FLOAT)))

    def extend(children):
        return st.one_of(
            st.tuples(st.sampled_from(["+", "-", "*"]), children, children).map(lambda t: Binary(t[0], t[1], t[2])),
            st.tuples(children, st.floats(0.5, 4.0).map(lambda x: Const(round(x, 3), Type.FLOAT))).map(lambda t: Binary("/", t[0], t[1])),
            st.tuples(st.sampled_from(["tanh", "sigmoid"]), children).map(lambda t: Call(t[0], (t[1],))),
            children.map(lambda c: Call("exp", (Call("tanh", (c,)),))),  # bounded argument
            children.map(lambda c: Call("sqrt", (Binary("+", Binary("*", c, c), Const(1.0, Type.FLOAT)),))),
            children.map(lambda c: Call("log", (Binary("+", Call("sigmoid", (c,)), Const(0.5, Type.FLOAT)),))),
            st.tuples(children, children).map(lambda t: Call("where", (Binary(">", t[0], t[1]), t[0], t[1]))),
            st.tuples(st.sampled_from(["min", "max"]), children, children).map(lambda t: Call(t[0], (t[1], t[2]))),
        )

    return st.recursive(leaf, extend, max_leaves=6)


# ---- edge values: expressions over inputs holding extreme values, divisors that may be zero -----------------
EDGE_INPUTS = {"i8": "int8", "i32": "int32", "i64": "int64", "f": "fp32", "flag": "bool"}  # each indexed [kv_idx]


def _read(name):
    from attngen.lang.spec import Index

    return Index(name, (Var("kv_idx"),))


def edge_int_exprs(max_leaves=7):
    """Integer expressions of index variables, int8/int32/int64 input reads and constants up to int32's limits;
    any operand may be a divisor (zero included). Some leave int64 when index variables are near 2**30: the
    check refuses those, and the tests skip them as a user's spec would be refused."""
    consts = st.sampled_from([0, 1, 2, 7, 2**15, 2**31 - 1]).map(lambda n: Const(n, Type.INT))
    leaf = st.one_of(st.sampled_from([Var(v) for v in INT_VARS]), consts, st.sampled_from(["i8", "i32", "i64"]).map(_read))

    def extend(children):
        return st.one_of(
            st.tuples(st.sampled_from(["+", "-", "*", "//", "%", "&", "|", "^"]), children, children).map(lambda t: Binary(t[0], t[1], t[2])),
            children.map(lambda c: Unary("-", c)),
            children.map(lambda c: Call("abs", (c,))),
            st.tuples(st.sampled_from(["min", "max"]), children, children).map(lambda t: Call(t[0], (t[1], t[2]))),
            st.tuples(children, children, children).map(lambda t: Call("where", (Binary("<", t[0], t[1]), t[1], t[2]))),
        )

    return st.recursive(leaf, extend, max_leaves=max_leaves)


def edge_float_exprs(max_leaves=6):
    """Float expressions built from IEEE-exact operations only (+ - * / // % min max abs where, and integers
    converted to float): kernel and reference must agree bit for bit, NaN and infinities included."""
    consts = st.sampled_from([0.0, 0.5, 2.5, 1e30, 3e38]).map(lambda x: Const(x, Type.FLOAT))
    leaf = st.one_of(st.just(Var("score")), st.just(_read("f")), consts, edge_int_exprs(3))

    def extend(children):
        return st.one_of(
            st.tuples(st.sampled_from(["+", "-", "*", "/", "//", "%"]), children, children).map(lambda t: Binary(t[0], t[1], t[2])),
            children.map(lambda c: Unary("-", c)),
            children.map(lambda c: Call("abs", (c,))),
            st.tuples(st.sampled_from(["min", "max"]), children, children).map(lambda t: Call(t[0], (t[1], t[2]))),
            st.tuples(children, children, children).map(lambda t: Call("where", (Binary(">", t[0], t[1]), t[1], t[2]))),
        )

    return st.recursive(leaf, extend, max_leaves=max_leaves)


def edge_bool_exprs():
    """Comparisons of edge integers and floats (NaN included), boolean reads, and their combinations."""
    cmp = st.one_of(
        st.tuples(st.sampled_from(ex.COMPARE_OPS), edge_int_exprs(4), edge_int_exprs(4)).map(lambda t: Binary(t[0], t[1], t[2])),
        st.tuples(st.sampled_from(ex.COMPARE_OPS), edge_float_exprs(3), edge_float_exprs(3)).map(lambda t: Binary(t[0], t[1], t[2])),
        st.just(_read("flag")),
    )

    def extend(children):
        return st.one_of(
            st.tuples(st.sampled_from(["and", "or"]), children, children).map(lambda t: Binary(t[0], t[1], t[2])),
            children.map(lambda c: Unary("not", c)),
        )

    return st.recursive(cmp, extend, max_leaves=4)
