"""The expression IR: printing round-trips through the parser, folding and differentiation keep values, and
lowered Triton code computes what the independent torch evaluator (attngen.naive.evaluate) computes."""
import importlib.util
import math
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from strategies import EDGE_INPUTS, bool_exprs, edge_bool_exprs, edge_float_exprs, edge_int_exprs, float_exprs, int_exprs

from attngen.lang import expr as ex
from attngen.lang import algebra
from attngen.lang import analysis
from attngen.codegen import expr as lowering
from attngen.runtime.dtypes import TORCH_DTYPES
from attngen.tools.reference import evaluate
from attngen.lang.spec import Binary, Call, Const, Index, InputDecl, Type, Var
from attngen.lang.syntax import parse

SCOPE = ex.Scope("score", ex.SCORE_VARS, {})


# ---- printing ------------------------------------------------------------------------------------
@settings(max_examples=300, deadline=None)
@given(st.one_of(int_exprs(), bool_exprs(), float_exprs()))
def test_format_parses_back_to_the_same_tree(e):
    text = ex.format_expr(e)
    parsed = parse(f"attention t {{ mask = {text} }}").settings[0].value
    assert parsed == e, text


# ---- folding and differentiation ----------------------------------------------------------------------
def _env(device="cpu"):
    q = torch.arange(-3, 9).view(-1, 1)
    kv = torch.arange(-2, 11).view(1, -1)
    return {"b": 1, "h": 2, "q_idx": q, "kv_idx": kv, "q_len": 12, "kv_len": 13, "score": (q - kv).double() * 0.37}


@settings(max_examples=300, deadline=None)
@given(st.one_of(int_exprs(), bool_exprs()))
def test_folding_keeps_integer_and_boolean_values(e):
    env = _env()
    before = torch.as_tensor(evaluate(e, env, {}, SCOPE, torch.float64))
    after = torch.as_tensor(evaluate(algebra.fold(e, SCOPE), env, {}, SCOPE, torch.float64))
    assert torch.equal(torch.broadcast_to(before, (12, 13)), torch.broadcast_to(after, (12, 13)))


@settings(max_examples=200, deadline=None)
@given(float_exprs())
def test_derivative_matches_autograd(e):
    score = torch.linspace(-4, 4, 97, dtype=torch.float64, requires_grad=True)
    env = {"score": score}
    value = torch.as_tensor(evaluate(e, env, {}, SCOPE, torch.float64)).broadcast_to(score.shape)
    if value.requires_grad:
        (auto,) = torch.autograd.grad(value.sum(), score, allow_unused=True)
    else:
        auto = None  # a constant expression
    auto = torch.zeros_like(score) if auto is None else auto
    ours = torch.as_tensor(evaluate(algebra.derivative(e, SCOPE), {"score": score.detach()}, {}, SCOPE, torch.float64), dtype=torch.float64)
    ours = ours.broadcast_to(score.shape)
    assert not torch.isnan(ours).any()
    # min/max/where/abs are not differentiable at ties; compare away from them
    assert torch.allclose(ours, auto, rtol=1e-9, atol=1e-9) or _ties_explain(e, ours, auto)


@settings(max_examples=200, deadline=None)
@given(float_exprs())
def test_read_derivative_matches_autograd(e):
    """d e / d w[h] for a score expression whose `score` leaves read an input instead (plus a score term, whose
    derivative with respect to the read is 0), against torch autograd through the read."""
    from attngen.lang.spec import Binary, Index, Var

    read = Index("w", (Var("h"),))
    e = Binary("+", ex.substitute(e, {"score": read}), Binary("*", Const(0.5, Type.FLOAT), Var("score")))
    scope = ex.Scope("score", ex.SCORE_VARS, {"w": InputDecl("w", "fp32", ("H",))})
    w = torch.linspace(-4, 4, 97, dtype=torch.float64, requires_grad=True)
    env = {"h": torch.arange(97), "score": torch.linspace(-1, 1, 97, dtype=torch.float64)}
    value = torch.as_tensor(evaluate(e, env, {"w": w}, scope, torch.float64)).broadcast_to(w.shape)
    (auto,) = torch.autograd.grad(value.sum(), w, allow_unused=True) if value.requires_grad else (None,)
    auto = torch.zeros_like(w) if auto is None else auto  # a constant expression
    ours = torch.as_tensor(evaluate(algebra.read_derivative(e, scope, read), env, {"w": w.detach()}, scope, torch.float64), dtype=torch.float64)
    ours = ours.broadcast_to(w.shape)
    assert not torch.isnan(ours).any()
    assert torch.allclose(ours, auto, rtol=1e-9, atol=1e-9) or _ties_explain(e, ours, auto)


def _ties_explain(e, ours, auto):
    bad = ~torch.isclose(ours, auto, rtol=1e-9, atol=1e-9)
    return bad.float().mean() < 0.05 and _has_kink(e)


def _has_kink(e):
    if isinstance(e, Call) and e.func in ("min", "max", "where", "abs"):
        return True
    return any(_has_kink(c) for c in ex.children(e))


def test_derivative_of_softcap_is_sech_squared():
    cap = parse("attention t { score = 30.0 * tanh(score / 30.0) }").settings[0].value
    d = algebra.derivative(cap, SCOPE)
    s = torch.linspace(-90, 90, 11, dtype=torch.float64)
    got = evaluate(d, {"score": s}, {}, SCOPE, torch.float64)
    assert torch.allclose(got, 1 / torch.cosh(s / 30.0) ** 2, rtol=1e-12)


def test_derivative_ignores_terms_without_score():
    e = parse("attention t { score = score - slopes[h] * (q_idx - kv_idx) }").settings[0].value
    scope = ex.Scope("score", ex.SCORE_VARS, {"slopes": InputDecl("slopes", "fp32", ("H",))})
    assert algebra.derivative(e, scope) == Const(1.0, Type.FLOAT)


# ---- lowering: run the generated Triton code in the interpreter ---------------------------------------
KERNEL = '''
import triton
import triton.language as tl

{helpers}

@triton.jit
def _eval_kernel(Out, b, h, q_len, kv_len, BM: tl.constexpr, BN: tl.constexpr):
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    q_idx = offs_m[:, None]
    kv_idx = offs_n[None, :]
    score = (q_idx - kv_idx).to(tl.float32) * 0.37
{stmts}
    val = {value} + tl.zeros([BM, BN], {zero_type})
    tl.store(Out + offs_m[:, None] * BN + offs_n[None, :], val)
'''

_counter = [0]


def _run_lowered(e, tmp_path):
    t = ex.typeof(e, SCOPE)
    lowerer = lowering.Lowerer(SCOPE, {v: v for v in ex.SCORE_VARS}, frozenset({"kv_idx", "score"}))
    low = lowerer.lower_all([e])
    value = low.exprs[0]
    if t is Type.BOOL:
        value, zero_type, out_dtype = f"tl.where({value}, 1, 0)", "tl.int32", torch.int32
    elif t is Type.INT:
        zero_type, out_dtype = "tl.int32", torch.int32
    else:
        zero_type, out_dtype = "tl.float32", torch.float32
    stmts = "\n".join("    " + s for s in low.outer + low.inner)
    src = KERNEL.format(helpers="\n\n".join(lowering.HELPERS[h] for h in sorted(lowerer.helpers)), stmts=stmts, value=value, zero_type=zero_type)
    _counter[0] += 1
    path = tmp_path / f"lowered_{_counter[0]}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    # Indices are >= 0, as in the kernels (the sign analysis relies on it); negative operands of // and %
    # still arise from subtraction and exercise the helpers' sign handling.
    out = torch.empty(16, 16, dtype=out_dtype)
    mod._eval_kernel[(1,)](out, 1, 2, 12, 13, BM=16, BN=16)
    return out, src


def _expected(e):
    q = torch.arange(16).view(-1, 1)
    kv = torch.arange(16).view(1, -1)
    env = {"b": 1, "h": 2, "q_idx": q, "kv_idx": kv, "q_len": 12, "kv_len": 13, "score": (q - kv).double() * 0.37}
    return torch.as_tensor(evaluate(e, env, {}, SCOPE, torch.float64)).broadcast_to((16, 16))


@pytest.mark.skipif("not __import__('os').environ.get('TRITON_INTERPRET')", reason="runs generated code in Triton's interpreter (CPU runs)")
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(e=st.one_of(int_exprs(6), bool_exprs()))
def test_lowered_integer_and_boolean_code_matches_torch(e, tmp_path):
    assume(ex.variables(e))
    got, src = _run_lowered(e, tmp_path)
    want = _expected(e).to(torch.int32)
    assert torch.equal(got, want), f"{ex.format_expr(e)}\n{src}"


@pytest.mark.skipif("not __import__('os').environ.get('TRITON_INTERPRET')", reason="runs generated code in Triton's interpreter (CPU runs)")
@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(e=float_exprs())
def test_lowered_float_code_matches_torch(e, tmp_path):
    assume(ex.variables(e))
    got, src = _run_lowered(e, tmp_path)
    want = _expected(e)
    assert not torch.isnan(got).any()
    assert torch.allclose(got.double(), want, rtol=1e-5, atol=1e-5), f"{ex.format_expr(e)}\n{src}"


@pytest.mark.parametrize(
    "text, code",
    [
        ("q_idx >= kv_idx", "q_idx >= kv_idx"),
        ("q_idx >= kv_idx and q_idx - kv_idx < 256", "(q_idx >= kv_idx) & (q_idx - kv_idx < 256)"),
        ("q_idx // 64 == kv_idx // 64", "q_idx // 64 == kv_idx // 64"),  # non-negative / positive: plain operators
        ("(q_idx - kv_idx) % 3 == 0", "_mod(q_idx - kv_idx, 3) == 0"),  # may be negative: Python semantics helper
        ("not (q_idx < 3) or kv_idx == 0", "~(q_idx < 3) | (kv_idx == 0)"),
        ("((q_idx ^ kv_idx) & 1) == 0 & q_idx >= 0", "((q_idx ^ kv_idx) & 1 == 0) & (q_idx >= 0)"),  # bitwise, then `&` as `and`
    ],
)
def test_lowering_is_readable(text, code):
    e = parse(f"attention t {{ mask = {text} }}").settings[0].value
    lowerer = lowering.Lowerer(SCOPE, {v: v for v in ex.SCORE_VARS}, frozenset({"kv_idx"}))
    assert lowerer.lower_all([algebra.fold(e, SCOPE)]).exprs[0] == code


@pytest.mark.parametrize(
    "text, code, positions",
    [
        # a sum of positions in a float context: each position converted once (a temporary), the sum in float32
        ("score - 0.5 * (q_idx - kv_idx)", "score - 0.5 * (q_idx_f_0 - kv_idx_f_1)", True),
        ("score * (q_idx + kv_len - q_len - kv_idx)", "score * (q_idx_f_0 + kv_len_f_1 - q_len_f_2 - kv_idx_f_3)", True),
        ("score * (q_idx - kv_idx + 3)", "score * (q_idx_f_0 - kv_idx_f_1 + 3.0)", True),
        # a partial sum that may pass 2**24 (exact float32 integers end there): converted whole
        ("score * (q_idx + kv_len - q_len - kv_idx + 3)", "score * ((q_idx + kv_len - q_len - kv_idx).to(tl.int64) + 3).to(tl.float32)", False),
        ("score + (kv_idx - q_idx) / 2", "score + (kv_idx_f_0 - q_idx_f_1) / 2.0", True),
        # not a sum of positions alone (b, a product), one index only, or no float context: converted whole
        ("score - 0.5 * (q_idx - kv_idx + b)", "score - 0.5 * (q_idx - kv_idx + b).to(tl.float32)", False),
        ("score - 0.5 * ((q_idx - kv_idx) * 2)", "score - 0.5 * ((q_idx - kv_idx) * 2).to(tl.float32)", False),
        ("score - 0.5 * (q_len - kv_idx)", "score - 0.5 * (q_len - kv_idx).to(tl.float32)", False),
        ("score + 1.0 * (q_idx - kv_idx < 5)", None, False),
    ],
)
def test_positions_in_float_are_converted_leaf_by_leaf(text, code, positions):
    """codegen.expr.FLOAT_POSITIONS: no conversion per score where a row and a column index meet in a float context."""
    e = parse(f"attention t {{ score = {text} }}").settings[0].value
    try:
        ex.typeof(e, SCOPE)
    except Exception:
        assert code is None  # (a boolean is no number here: the case only shows that nothing is converted)
        return
    lowerer = lowering.Lowerer(SCOPE, {v: v for v in ex.SCORE_VARS}, frozenset({"kv_idx", "score"}), positions_leafwise=True)
    low = lowerer.lower_all([e])
    assert low.exprs[0] == code and lowerer.positions_in_float == positions
    # (only where asked: the Gluon backward's lowering)
    plain = lowering.Lowerer(SCOPE, {v: v for v in ex.SCORE_VARS}, frozenset({"kv_idx", "score"}))
    assert "_f_" not in plain.lower_all([e]).exprs[0] and not plain.positions_in_float
    assert ("_position_f32" in lowerer.helpers) == positions
    if positions:
        assert all("_position_f32(" in line for line in low.outer + low.inner)
        assert any(line.startswith("q_idx_f") for line in low.outer) and any(line.startswith("kv_idx_f") for line in low.inner)


def test_positions_in_float_are_exact_up_to_their_limit(tmp_path, device):
    """The leaf-by-leaf conversion gives the converted integer bit for bit for every position and length the
    runtime lets through (<= FLOAT_POSITIONS = 2**23), checked at those edges; past it (2**24 + 1, which the
    runtime refuses) it would not, which is why the limit is enforced."""
    from attngen.lang.spec import Var

    diff = Binary("-", Binary("+", Var("q_idx"), Var("kv_len")), Binary("+", Var("kv_idx"), Var("q_len")))
    e = Binary("*", Const(0.75, Type.FLOAT), diff)
    limit = lowering.FLOAT_POSITIONS
    for scalars in ({"b": 0, "h": 0, "q_len": limit, "kv_len": limit}, {"b": 0, "h": 0, "q_len": 1, "kv_len": limit},
                    {"b": 0, "h": 0, "q_len": limit, "kv_len": 0}):
        got, want, src = _run_edge(e, tmp_path, device, scalars, leafwise=True)
        assert "_position_f32(q_idx)" in src and ".to(tl.float32)" not in src.split("def _eval_kernel")[1]
        assert torch.equal(got.cpu(), want.cpu().float()), src
    # the helper itself past the limit: 2**24 + 1 is the float 2**24 + 2 there (rounded: 2**24 + 1 is no float32)
    x = 2**24 + 1
    assert np.array([x + 0x4B000000], dtype=np.int32).view(np.float32)[0] - np.float32(2**23) != np.float32(x)


def test_nonnegative_is_sound_on_examples():
    env = _env()
    for text in ["q_idx // 3", "abs(q_idx - kv_idx)", "q_len - q_idx", "min(q_idx, kv_idx) % 4", "(q_idx - 5) * 2"]:
        e = parse(f"attention t {{ mask = {text} }}").settings[0].value
        value = torch.as_tensor(evaluate(e, {**env, "q_idx": env["q_idx"].clamp(min=0), "kv_idx": env["kv_idx"].clamp(min=0)}, {}, SCOPE, torch.float64))
        if analysis.nonnegative(e):
            assert (value >= 0).all(), text
    assert not analysis.nonnegative(parse("attention t { mask = q_len - q_idx }").settings[0].value)


# ---- edge values: the lowered kernel code and the reference agree exactly -------------------------------------
# Index variables near their largest values (2**30 - 1), inputs holding their types' extremes, NaN and infinities,
# divisors that are zero at some points. Integers and booleans must be equal; floats from IEEE-exact operations
# equal bit for bit (same NaNs, same infinities) against the float32 reference, both given the expression with its
# constant parts folded (folding is checked on its own above). Expressions the check refuses
# (integer overflow past int64, a constant zero divisor) are skipped: no kernel is built for them.
EDGE_SCOPE = ex.Scope("score", ex.SCORE_VARS, {n: InputDecl(n, t, ("N",)) for n, t in EDGE_INPUTS.items()})
_BIG = 2**30 - 1
EDGE_Q = [0, 1, 2, 3, 5, 16, 2**15 - 1, 2**15, 2**16 + 1, 2**24 + 1, 2**28, 2**29 + 3, _BIG - 64, _BIG - 1, _BIG, 1000]
EDGE_FLOATS = [0.0, -0.0, 1.0, -1.0, 2.5, -3.75, 1e30, -1e30, 3e38, -3e38, float("inf"), float("-inf"), float("nan"), 1e-30, 88.75, -104.5]
EDGE_DATA = {
    "i8": [-128, 127, 0, -1, 1, 2, -2, 100, -100, 64, 3, -3, 7, 0, 1, -128],
    "i32": [-(2**31), 2**31 - 1, 0, -1, 1, 2, -2, 2**30, -(2**30), 65536, 3, -3, 7, 0, 1, -(2**31) + 1],
    "i64": [-(2**63), 2**63 - 1, 0, -1, 1, 2, -2, 2**40, -(2**40), 65536, 3, -3, 7, 0, 1, 2**62],
    "f": EDGE_FLOATS[::-1],
    "flag": [i % 3 == 0 for i in range(16)],
}
EDGE_KERNEL = '''
import triton
import triton.language as tl

{helpers}

@triton.jit(do_not_specialize=["b", "h", "q_len", "kv_len"])  # as in the kernels: never constants (1 would be)
def _eval_kernel(Out, Q, S, b, h, q_len, kv_len, {params}, BM: tl.constexpr, BN: tl.constexpr):
    offs_m = tl.arange(0, BM)
    offs_n = tl.arange(0, BN)
    q_idx = tl.load(Q + offs_m)[:, None]
    kv_idx = offs_n[None, :]
    score = tl.load(S + offs_m[:, None] * BN + offs_n[None, :])
{stmts}
    val = tl.where(tl.full([BM, BN], 1, tl.int1), {value}, tl.zeros([BM, BN], {zero_type}))  # broadcast, keeping -0.0
    tl.store(Out + offs_m[:, None] * BN + offs_n[None, :], val)
'''


def _edge_tensors(device, limit=None):
    """limit: the largest length of a call (positions below it), as the runtime enforces for code that converts
    positions to float leaf by leaf (codegen.expr.FLOAT_POSITIONS)"""
    q = torch.tensor(EDGE_Q if limit is None else [min(x, limit - 1) for x in EDGE_Q], dtype=torch.int32, device=device)
    gen = torch.Generator().manual_seed(0)
    score = torch.tensor(EDGE_FLOATS)[torch.randint(0, 16, (16, 16), generator=gen)].to(device)
    inputs = {n: torch.tensor(EDGE_DATA[n], dtype=TORCH_DTYPES[t], device=device) for n, t in EDGE_INPUTS.items()}
    return q, score, inputs


def _run_edge(e, tmp_path, device, scalars, leafwise=False):
    from attngen.lang.check import _check_arithmetic
    from attngen.errors import SpecError

    try:
        _check_arithmetic(e, EDGE_SCOPE)
    except SpecError:
        return None  # refused at check time, never lowered
    t = ex.typeof(e, EDGE_SCOPE)
    lowerer = lowering.Lowerer(EDGE_SCOPE, {v: v for v in ex.SCORE_VARS}, frozenset({"kv_idx", "score"}), positions_leafwise=leafwise)
    folded = algebra.fold(e, EDGE_SCOPE)  # the kernels see constant subexpressions folded (exactly, or in float64)
    low = lowerer.lower_all([folded])
    value = low.exprs[0]
    if t is Type.BOOL:
        value, zero_type, out_dtype = f"tl.where({value}, 1, 0)", "tl.int32", torch.int32
    elif t is Type.INT:
        zero_type, out_dtype = "tl.int64", torch.int64
    else:
        zero_type, out_dtype = "tl.float32", torch.float32
    params = ", ".join(f"in_{n}_ptr, in_{n}_stride_0, in_{n}_size_0" for n in EDGE_INPUTS)
    stmts = "\n".join("    " + s for s in low.outer + low.inner)
    src = EDGE_KERNEL.format(helpers="\n\n".join(lowering.HELPERS[h] for h in sorted(lowerer.helpers)), stmts=stmts, value=value,
                             zero_type=zero_type, params=params)
    _counter[0] += 1
    path = tmp_path / f"edge_{_counter[0]}.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = mod
    spec.loader.exec_module(mod)
    limit = lowering.FLOAT_POSITIONS if lowerer.positions_in_float else None  # longer calls are refused then (runtime)
    if limit is not None:
        scalars = {**scalars, "q_len": min(scalars["q_len"], limit), "kv_len": min(scalars["kv_len"], limit)}
    q, score, inputs = _edge_tensors(device, limit)
    out = torch.empty(16, 16, dtype=out_dtype, device=device)
    args = [a for x in inputs.values() for a in (x, x.stride(0), x.numel())]
    with np.errstate(all="ignore"):  # the interpreter computes with numpy: inf - inf and 0 / 0 are intended here
        mod._eval_kernel[(1,)](out, q, score, scalars["b"], scalars["h"], scalars["q_len"], scalars["kv_len"], *args, BM=16, BN=16)
    env = {"q_idx": q.long().view(16, 1), "kv_idx": torch.arange(16, device=device).view(1, 16), "score": score, **scalars}
    want = torch.as_tensor(evaluate(folded, env, inputs, EDGE_SCOPE, torch.float32), device=device).broadcast_to((16, 16))
    return out, want, src


_SCALARS = st.fixed_dictionaries({"b": st.sampled_from([0, 1, 3, _BIG]), "h": st.sampled_from([0, 2, _BIG]),
                                  "q_len": st.sampled_from([1, 17, _BIG + 1]), "kv_len": st.sampled_from([1, 16, 2**20, _BIG + 1])})
# (each example compiles a kernel: on the GPU that takes a second, in the interpreter a few milliseconds)
_EDGE_SETTINGS = settings(max_examples=100 if __import__("os").environ.get("TRITON_INTERPRET") == "1" else 15, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])


_EDGE_SETTINGS_SMALL = settings(max_examples=40 if __import__("os").environ.get("TRITON_INTERPRET") == "1" else 8, deadline=None,
                                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow, HealthCheck.filter_too_much])


def _position_sums():
    """Sums of positions, lengths and small constants (+, -, negation): what the leafwise lowering takes."""
    from attngen.lang.spec import Unary, Var

    leaves = st.one_of(st.sampled_from([Var("q_idx"), Var("kv_idx"), Var("q_len"), Var("kv_len")]),
                       st.integers(-300, 300).map(lambda c: Const(c, Type.INT)))
    return st.recursive(leaves, lambda sub: st.one_of(st.builds(Binary, st.sampled_from(["+", "-"]), sub, sub),
                                                      sub.map(lambda x: Unary("-", x))), max_leaves=6)


@_EDGE_SETTINGS_SMALL
@given(total=_position_sums(), scalars=_SCALARS)
def test_random_sums_of_positions_in_float_are_exact(total, scalars, tmp_path, device):
    """Any sum the leafwise lowering takes gives the converted integer bit for bit, at the largest positions and
    lengths a call may have then (FLOAT_POSITIONS) as at small ones."""
    assume(lowering.positions_in_float(total))
    got, want, src = _run_edge(Binary("*", Const(0.75, Type.FLOAT), total), tmp_path, device, scalars, leafwise=True)
    assert "_position_f32(" in src
    assert torch.equal(got.cpu(), want.cpu().float()), f"{ex.format_expr(total)}\n{src}"


@_EDGE_SETTINGS
@given(e=edge_int_exprs(), scalars=_SCALARS)
def test_lowered_integers_match_the_reference_at_edges(e, scalars, tmp_path, device):
    run = _run_edge(e, tmp_path, device, scalars)
    assume(run is not None)
    got, want, src = run
    assert torch.equal(got.cpu(), want.cpu().long()), f"{ex.format_expr(e)}\n{src}"


@_EDGE_SETTINGS
@given(e=edge_bool_exprs(), scalars=_SCALARS)
def test_lowered_booleans_match_the_reference_at_edges(e, scalars, tmp_path, device):
    run = _run_edge(e, tmp_path, device, scalars)
    assume(run is not None)
    got, want, src = run
    assert torch.equal(got.cpu(), want.cpu().to(torch.int32)), f"{ex.format_expr(e)}\n{src}"


def test_a_tiny_float_quotient_floors_to_a_signed_zero(tmp_path, device):
    """-1.0 / 3e38 is below float32's normals, which the GPU's division flushes to -0.0: floor gives -0.0 there
    and -1.0 from the exact quotient. The language takes the GPU's answer everywhere (kernel, reference, folding),
    so the H100 run of the edge tests and the CPU agree."""
    from attngen.lang.spec import Binary, Const, Index, Var

    assert math.copysign(1.0, algebra.floordiv(-1.0, 3e38)) == -1.0 and algebra.floordiv(-1.0, 3e38) == 0.0
    assert algebra.pymod(-1.0, 3e38) == -1.0 and algebra.floordiv(-3.75, 2.0) == -2.0
    folded = algebra.fold(Binary("//", Const(-1.0, Type.FLOAT), Const(3e38, Type.FLOAT)), EDGE_SCOPE)
    assert isinstance(folded, Const) and math.copysign(1.0, folded.value) == -1.0
    got, want, _ = _run_edge(Binary("//", Var("score"), Index("f", (Var("kv_idx"),))), tmp_path, device,
                             {"b": 0, "h": 0, "q_len": 1, "kv_len": 1})
    _, score, inputs = _edge_tensors(device)
    tiny = (score / inputs["f"]).abs() < 1.1754943508222875e-38
    tiny &= (score / inputs["f"]) != 0
    assert tiny.any()  # the edge values hold such quotients
    got, want = got.cpu(), want.cpu().float()
    assert torch.equal(torch.signbit(got[tiny.cpu()]), torch.signbit(want[tiny.cpu()])) and (got[tiny.cpu()] == 0).all()


@_EDGE_SETTINGS
@given(e=edge_float_exprs(), scalars=_SCALARS, leafwise=st.booleans())
def test_lowered_floats_match_the_reference_at_edges(e, scalars, leafwise, tmp_path, device):
    """Both lowerings: the kernels' and the Gluon backward's (positions_leafwise, its calls' lengths limited)."""
    run = _run_edge(e, tmp_path, device, scalars, leafwise)
    assume(run is not None)
    got, want, src = run
    got, want = got.cpu(), want.cpu().float()
    assert torch.equal(torch.isnan(got), torch.isnan(want)), f"NaN differs: {ex.format_expr(e)}\n{src}"
    if device == "cpu" or not _divides(e):  # IEEE float32 (numpy in the interpreter): bit for bit
        assert torch.equal(got.nan_to_num(0.0), want.nan_to_num(0.0)), f"{ex.format_expr(e)}\n{src}"
    else:  # the GPU's `/` is Triton's fast float32 division (within 2 ulps): the same NaNs and infinities here,
        # the values bit for bit on the CPU
        for sign in (1, -1):
            assert torch.equal(got * sign == float("inf"), want * sign == float("inf")), f"{ex.format_expr(e)}\n{src}"


def _divides(e):
    return (isinstance(e, Binary) and e.op == "/") or any(_divides(c) for c in ex.children(e))


@pytest.mark.parametrize("func", ["exp", "log", "sqrt", "tanh", "sigmoid"])
def test_lowered_functions_match_the_reference_at_edges(func, tmp_path, device):
    """exp, log, sqrt, tanh and sigmoid of NaN, +-inf, +-0, huge, tiny and negative values: the same NaNs (log and
    sqrt of negatives, anything of NaN) and infinities (exp overflow, log 0) as torch, finite values to float32
    accuracy (absolute 1e-7 for tanh near 0, which the kernels compute through exp2)."""
    from attngen.lang.spec import Index, Var

    for arg in (Var("score"), Index("f", (Var("kv_idx"),))):
        got, want, src = _run_edge(Call(func, (arg,)), tmp_path, device, {"b": 0, "h": 0, "q_len": 1, "kv_len": 1})
        got, want = got.cpu(), want.cpu().float()
        assert torch.equal(torch.isnan(got), torch.isnan(want)), src
        assert torch.equal(torch.isinf(got) & (got > 0), torch.isinf(want) & (want > 0)), src
        assert torch.equal(torch.isinf(got) & (got < 0), torch.isinf(want) & (want < 0)), src
        finite = torch.isfinite(want)
        assert torch.allclose(got[finite], want[finite], rtol=4e-6, atol=1e-7), src


# ---- separable biases: score + L(q_idx, kv_idx), added by the Gluon kernels as a key part (lang.analysis.separable_bias) ----
BIAS_SPEC = """attention t {{
    head_dim = 64
    input slopes: fp32[H]
    input pos: int32[B, N]
    input kbias: fp32[B, N]
    mask = q_idx >= kv_idx
    score = {score}
}}"""


def _bias_spec(score: str):
    from attngen.lang.check import load_spec

    return load_spec(BIAS_SPEC.format(score=score))


def _bias_env(q, kv, generator):
    return ({"b": 1, "h": 2, "q_idx": q, "kv_idx": kv, "q_len": 40, "kv_len": 48},
            {"slopes": torch.rand(4, generator=generator, dtype=torch.float64) - 0.5,
             "pos": torch.randint(-50, 50, (2, 48), generator=generator),
             "kbias": torch.randn(2, 48, generator=generator, dtype=torch.float64)})


@pytest.mark.parametrize(
    "score, separable",
    [
        ("score - slopes[h] * (q_idx - kv_idx)", True),  # ALiBi
        ("score - slopes[h] * (q_idx + kv_len - q_len - kv_idx)", True),  # bottom-right ALiBi
        ("score + 0.5 * q_idx - 0.25 * kv_idx + b", True),
        ("(score + q_idx) - kv_idx * 2", True),
        ("score + (q_idx // 64) * 0.5 + pos[b, kv_idx]", True),  # an integer read at a position: finite
        ("score - slopes[h] * abs(q_idx - kv_idx)", False),  # |q - kv| is no sum of a row's and a key's term
        ("score + (q_idx - kv_idx) * (q_idx - kv_idx)", False),
        ("score + kbias[b, kv_idx]", False),  # a float read at a position may hold -inf: L(r, kv) would be -inf
        ("score + exp(0.01 * kv_idx)", False),  # a float function of a position may overflow
        ("score + q_idx / kv_len", False),  # a division by something that may be 0
        ("score * 2.0 + q_idx", False),  # score scaled
        ("q_idx - score", False),
        ("score + score * 0.5", False),
        ("30.0 * tanh(score / 30.0)", False),  # softcap
    ],
)
def test_separable_biases_are_recognized(score, separable):
    spec = _bias_spec(score)
    scope = ex.Scope("score", ex.SCORE_VARS, spec.inputs_by_name)
    assert (analysis.separable_bias(spec.score, scope) is not None) == separable


def _parts_agree(bias, scope, inputs, q, kv, r):
    """The identities the kernels rely on, in float64 with the reference evaluator: L(q, kv) = row(q) + key(kv)
    for the ref row r, and (affine key parts) key(kv_lo + off) = tile(kv_lo) + step(off)."""
    from attngen.codegen.lowering import bias_part

    def part(name, rows):
        expr, roles = bias_part(bias, name)
        env = {"b": 1, "h": 2, "q_len": 40, "kv_len": 48, "q_idx": q, "kv_idx": kv}
        env |= {v: {"ref": r, "rows": rows}[role] for v, role in roles.items()}
        return torch.as_tensor(evaluate(expr, env, inputs, scope, torch.float64), dtype=torch.float64)

    env = {"b": 1, "h": 2, "q_len": 40, "kv_len": 48, "q_idx": q, "kv_idx": kv}
    whole = torch.as_tensor(evaluate(bias, env, inputs, scope, torch.float64), dtype=torch.float64).broadcast_to((q.shape[0], kv.shape[1]))
    split = (part("row", q) + part("key", None)).broadcast_to(whole.shape)
    assert torch.allclose(split, whole, rtol=1e-12, atol=1e-9), (ex.format_expr(bias), r)
    if analysis.affine_in(bias, "kv_idx"):
        kv_lo, off = 16, kv - 16
        assert torch.allclose((part("tile", kv_lo) + part("step", off)).broadcast_to(kv.shape),
                              part("key", None).broadcast_to(kv.shape), rtol=1e-12, atol=1e-9)


@pytest.mark.parametrize("score", ["score - slopes[h] * (q_idx - kv_idx)", "score - slopes[h] * (q_idx + kv_len - q_len - kv_idx)",
                                   "score + (q_idx // 64) * 0.5 + pos[b, kv_idx]", "score + 0.5 * q_idx * slopes[h] - pos[b, q_idx] + kv_idx"])
def test_a_separable_bias_is_its_row_part_plus_its_key_part(score):
    spec = _bias_spec(score)
    scope = ex.Scope("score", ex.SCORE_VARS, spec.inputs_by_name)
    bias = analysis.separable_bias(spec.score, scope)
    g = torch.Generator().manual_seed(0)
    q, kv = torch.arange(40).view(-1, 1), torch.arange(48).view(1, -1)
    _, inputs = _bias_env(q, kv, g)
    for r in (0, 7, 39, 1000):
        _parts_agree(bias, scope, inputs, q, kv, r)


def _one_index_terms():
    """Random integer expressions of q_idx alone or kv_idx alone (b, h, lengths and constants beside)."""
    def only(var):
        other = "kv_idx" if var == "q_idx" else "q_idx"
        return int_exprs(5).map(lambda e: ex.substitute(e, {other: Var(var)}))
    return st.tuples(only("q_idx"), only("kv_idx"))


@settings(max_examples=150, deadline=None)
@given(terms=_one_index_terms(), mixed=int_exprs(4), ops=st.tuples(st.sampled_from(["+", "-"]), st.sampled_from(["+", "-"])),
       factor=st.sampled_from([None, Const(0.5, Type.FLOAT), Index("slopes", (Var("h"),))]), with_mixed=st.booleans())
def test_every_bias_taken_as_separable_splits_exactly(terms, mixed, ops, factor, with_mixed):
    """Sums of terms of one index each, scaled or not, sometimes with a term of both (which may or may not be
    separable): whatever separable_bias takes satisfies the identities, for several ref rows."""
    spec = _bias_spec("score")
    scope = ex.Scope("score", ex.SCORE_VARS, spec.inputs_by_name)
    rest = Binary(ops[0], terms[0], terms[1])
    if with_mixed:
        rest = Binary(ops[1], rest, mixed)
    if factor is not None:
        rest = Binary("*", factor, rest)
    e = Binary("+", Var("score"), rest)
    bias = analysis.separable_bias(e, scope)
    if not with_mixed:
        assert bias is not None, ex.format_expr(e)  # a sum of terms of one index each is always taken
    assume(bias is not None)
    g = torch.Generator().manual_seed(1)
    q, kv = torch.arange(40).view(-1, 1), torch.arange(48).view(1, -1)
    _, inputs = _bias_env(q, kv, g)
    env = {"b": 1, "h": 2, "q_len": 40, "kv_len": 48, "q_idx": q, "kv_idx": kv, "score": torch.zeros(40, 48, dtype=torch.float64)}
    assert torch.allclose(torch.as_tensor(evaluate(e, env, inputs, scope, torch.float64), dtype=torch.float64),
                          torch.as_tensor(evaluate(bias, env, inputs, scope, torch.float64), dtype=torch.float64))  # L = e - score
    for r in (0, 13, 47):
        _parts_agree(bias, scope, inputs, q, kv, r)


BIAS_KERNEL = '''
import triton
import triton.language as tl

{helpers}

@triton.jit
def _bias_kernel(Out, in_slopes_ptr, in_slopes_stride_0, in_slopes_size_0, in_pos_ptr, in_pos_stride_0, in_pos_stride_1,
                 in_pos_size_0, in_pos_size_1, in_kbias_ptr, in_kbias_stride_0, in_kbias_stride_1, in_kbias_size_0,
                 in_kbias_size_1, q_ref, b, h, q_len, kv_len, BM: tl.constexpr, BN: tl.constexpr, AFFINE: tl.constexpr):
    offs_m = tl.arange(0, BM)
    q_idx = offs_m[:, None]
    kv_idx = tl.arange(0, BN)[None, :]
{key_stmts}
    key = {key} + tl.zeros([1, BN], tl.float32)
    if AFFINE:  # the tile of 16 keys from kv_lo = 16, as the forward adds it: its first key's value and the offsets'
        kv_lo = 16
        offs_n = kv_idx - 16
{tile_stmts}
{step_stmts}
        key = tl.where(kv_idx >= 16, ({step}) + ({tile}), key)
{row_stmts}
    row = {row} + tl.zeros([BM], tl.float32)
    tl.store(Out + offs_m[:, None] * BN + kv_idx, key + row[:, None])
'''


@pytest.mark.skipif("not __import__('os').environ.get('TRITON_INTERPRET')", reason="runs generated code in Triton's interpreter (CPU runs)")
@pytest.mark.parametrize("score", ["score - slopes[h] * (q_idx - kv_idx)", "score - slopes[h] * (q_idx + kv_len - q_len - kv_idx)",
                                   "score + (q_idx // 64) * 0.5 + pos[b, kv_idx]"])
def test_lowered_bias_parts_add_up_to_the_bias(score, tmp_path):
    """The code lower_bias gives the Gluon kernels (here in Triton's names, which lower.translate maps one to one),
    run in the interpreter: the row part plus the key part (or, affine, the tile's and the step's) is L(q, kv)
    within float32 rounding of the reference's float64, for a ref row inside the tile and one far from it."""
    from attngen.codegen.lowering import key_part_affine, lower_bias
    from attngen.plan.planner import plan

    spec = _bias_spec(score)
    p = plan(spec, "h100")
    scope = ex.Scope("score", ex.SCORE_VARS, spec.inputs_by_name)
    bias = analysis.separable_bias(p.score, scope)
    helpers: set[str] = set()
    key = lower_bias(p, "key", "", "q_ref", frozenset({"kv_idx"}), helpers, "k_")
    row = lower_bias(p, "row", "offs_m", "q_ref", frozenset(), helpers, "r_")
    affine = key_part_affine(p)
    tile = lower_bias(p, "tile", "kv_lo", "q_ref", frozenset(), helpers, "t_") if affine else key
    step = lower_bias(p, "step", "offs_n", "q_ref", frozenset(), helpers, "s_") if affine else key

    def stmts(code, indent):
        return "\n".join(" " * indent + line for line in code.outer + code.inner) or " " * indent + "pass"

    src = BIAS_KERNEL.format(helpers="\n\n".join(lowering.HELPERS[h] for h in sorted(helpers)), key_stmts=stmts(key, 4), key=key.code,
                             tile_stmts=stmts(tile, 8), step_stmts=stmts(step, 8), tile=tile.code, step=step.code,
                             row_stmts=stmts(row, 4), row=row.code)
    path = tmp_path / "bias_parts.py"
    path.write_text(src)
    mspec = importlib.util.spec_from_file_location("bias_parts", path)
    mod = importlib.util.module_from_spec(mspec)
    sys.modules["bias_parts"] = mod
    mspec.loader.exec_module(mod)
    g = torch.Generator().manual_seed(2)
    q, kv = torch.arange(32).view(-1, 1), torch.arange(32).view(1, -1)
    env, inputs = _bias_env(q, kv, g)
    want = torch.as_tensor(evaluate(bias, env, inputs, scope, torch.float64), dtype=torch.float64).broadcast_to((32, 32))
    slopes, pos, kbias = inputs["slopes"].float(), inputs["pos"].int(), inputs["kbias"].float()
    for q_ref in (0, 16, 5000):
        out = torch.empty(32, 32)
        mod._bias_kernel[(1,)](out, slopes, 1, 4, pos, pos.stride(0), 1, 2, 48, kbias, kbias.stride(0), 1, 2, 48, q_ref, 1, 2, 40, 48,
                               BM=32, BN=32, AFFINE=affine)
        assert not torch.isnan(out).any()
        assert torch.allclose(out.double(), want, rtol=1e-5, atol=1e-4 * (1 + q_ref / 100)), (score, q_ref, src)
