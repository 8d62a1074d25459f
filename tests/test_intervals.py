"""The tile classifier: sound (an ALWAYS or NEVER verdict holds at every index of the tile, checked by brute
force over thousands of random masks and tiles) and precise on the masks that matter."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import bool_exprs, int_exprs

from attngen import expr as ex
from attngen.check import load_spec
from attngen.intervals import Interval, TileClass, Truth, classify_tiles, evaluate, tile_counts, tile_env, tile_map, truth
from attngen.naive import evaluate as evaluate_torch
from attngen.spec import Binary, Const, Type

SCOPE = ex.Scope("mask", ex.MASK_VARS, {})


def _brute(mask, q0, qn, k0, kn, q_len, kv_len, b, h):
    env = {"q_idx": torch.arange(q0, q0 + qn).view(-1, 1), "kv_idx": torch.arange(k0, k0 + kn).view(1, -1),
           "q_len": q_len, "kv_len": kv_len, "b": b, "h": h}
    return torch.as_tensor(evaluate_torch(mask, env, {}, SCOPE, torch.float64)).broadcast_to((qn, kn))


tiles = st.tuples(st.integers(0, 400), st.integers(1, 33), st.integers(0, 400), st.integers(1, 33), st.integers(1, 600), st.integers(1, 600))


def _float_masks():
    """Masks going through float arithmetic (true division, then maybe a function), compared with float constants."""
    def wrap(func, x):
        if func is None:
            return x
        if func in ("sqrt", "log"):  # keep the argument in the domain most of the time; outside it, NaN compares false
            x = Binary("+", ex.Call("abs", (x,)), Const(1.0, Type.FLOAT))
        return ex.Call(func, (x,))

    funcs = st.sampled_from([None, "exp", "tanh", "sigmoid", "sqrt", "log"])
    return st.tuples(int_exprs(4), st.integers(1, 9), funcs, st.sampled_from(["<", ">=", "=="]), st.floats(-50, 50).map(lambda x: round(x, 2))).map(
        lambda t: Binary(t[3], wrap(t[2], Binary("/", t[0], Const(t[1] * 7, Type.INT))), Const(t[4], Type.FLOAT)))


@settings(max_examples=3000, deadline=None)
@given(mask=st.one_of(bool_exprs(), _float_masks()), tile=tiles)
def test_classifier_is_sound(mask, tile):
    q0, qn, k0, kn, q_len, kv_len = tile
    verdict = truth(mask, tile_env(q0, q0 + qn - 1, k0, k0 + kn - 1, q_len, kv_len))
    if verdict is Truth.MAYBE:
        return
    for b in (0, 1, 7):
        for h in (0, 3):
            values = _brute(mask, q0, qn, k0, kn, q_len, kv_len, b, h)
            assert bool(values.all()) if verdict is Truth.ALWAYS else not bool(values.any()), (ex.format_expr(mask), tile, b, h)


@settings(max_examples=1000, deadline=None)
@given(e=int_exprs(), tile=tiles)
def test_integer_intervals_contain_every_value(e, tile):
    q0, qn, k0, kn, q_len, kv_len = tile
    iv = evaluate(e, tile_env(q0, q0 + qn - 1, k0, k0 + kn - 1, q_len, kv_len))
    values = _brute(e, q0, qn, k0, kn, q_len, kv_len, 2, 1)
    assert iv.lo <= values.min().item() and values.max().item() <= iv.hi, (ex.format_expr(e), iv)


def _mask(text):
    return load_spec(f"attention t {{ head_dim = 64 mask = {text} }}").mask


def _counts(text, n=4096, block=128):
    counts = tile_counts(classify_tiles(_mask(text), n, n, block, block))
    return counts[TileClass.FULL], counts[TileClass.PARTIAL], counts[TileClass.EMPTY]


def test_causal_is_exact():
    # 32 x 32 tiles: the diagonal is partial, the 496 below it full, the 496 above it empty
    assert _counts("q_idx >= kv_idx") == (496, 32, 496)
    assert _counts("q_idx + kv_len - q_len >= kv_idx") == (496, 32, 496)


def test_sliding_window_and_blocks_are_exact():
    # window 1024 = 8 tiles of 128: query tile i has full key tiles j in [i-7, i-1] (0+1+...+7 + 24*7 = 196)
    # and partial ones j = i and j = i-8 (32 + 24 = 56)
    full, partial, empty = _counts("q_idx >= kv_idx and q_idx - kv_idx < 1024")
    assert full + partial + empty == 1024 and partial == 32 + 24 and full == 196
    assert _counts("q_idx // 512 == kv_idx // 512") == (128, 0, 896)  # chunked attention: 8 blocks of 4x4 tiles


def test_uncertain_masks_stay_partial():
    assert _counts("(q_idx - kv_idx) % 3 == 0") == (0, 1024, 0)
    doc = load_spec("attention t { head_dim = 64 input doc: int32[B, N] mask = doc[b, q_idx] == doc[b, kv_idx] }").mask
    counts = tile_counts(classify_tiles(doc, 512, 512, 128, 128))
    assert counts[TileClass.PARTIAL] == 16  # an input's values are unknown at compile time


def test_tile_map_draws_the_classes():
    grid = tile_map(classify_tiles(_mask("q_idx >= kv_idx"), 512, 512, 128, 128))
    assert grid == "+...\n#+..\n##+.\n###+"
    big = tile_map(classify_tiles(_mask("q_idx >= kv_idx"), 16384, 16384, 128, 128), max_width=32)
    lines = big.splitlines()
    assert len(lines) == 32 and "each character: 4x4 tiles" in lines[-1]
    assert lines[0].startswith("+.") and lines[-1].startswith("#" * 31 + "+")


def test_intervals_basic_rules():
    env = {"x": Interval(-3, 5), "y": Interval(2, 4)}
    x, y = ex.Var("x"), ex.Var("y")
    assert evaluate(Binary("*", x, y), env) == Interval(-12, 20)
    assert evaluate(Binary("//", x, Const(2, Type.INT)), env) == Interval(-2, 2)
    assert evaluate(Binary("%", y, Const(8, Type.INT)), env) == Interval(2, 4)  # within one period
    assert evaluate(Binary("%", x, Const(4, Type.INT)), env) == Interval(0, 3)
    assert evaluate(ex.Call("abs", (x,)), env) == Interval(0, 5)
    assert evaluate(Binary("/", x, x), env) == Interval.everything()  # divisor interval contains 0


# ---- the generated in-kernel classifier agrees with this module -------------------------------------------
def _expected_ranges(classes, length, block):
    """(lo, full_lo, full_hi, hi) per row of tile classes, as the kernels' _tile_range defines them."""
    out = []
    for row in classes:
        nonempty = [j for j, c in enumerate(row) if c is not TileClass.EMPTY]
        lo, hi = (nonempty[0], nonempty[-1] + 1) if nonempty else (len(row), len(row))
        full = [c is TileClass.FULL and (j + 1) * block <= length for j, c in enumerate(row)]
        run = next((j for j, f in enumerate(full) if f), None)
        if run is None:
            out.append((lo, lo, lo, hi))
            continue
        end = run
        while end < len(full) and full[end]:
            end += 1
        out.append((lo, run, end, hi))
    return out


@pytest.mark.skipif("not __import__('os').environ.get('TRITON_INTERPRET')", reason="runs generated code in Triton's interpreter")
@pytest.mark.parametrize("text", [
    "q_idx >= kv_idx",
    "q_idx >= kv_idx and q_idx - kv_idx < 40",
    "q_idx // 32 == kv_idx // 32",
    "q_idx + kv_len - q_len >= kv_idx",
    "abs(q_idx - kv_idx) <= 20 or kv_idx < 16",
])
def test_kernel_tile_ranges_match_the_classifier(text, tmp_path):
    import importlib.util
    import sys

    import attngen

    kern = attngen.compile(f"attention t {{ head_dim = 16 dtype = fp32 mask = {text} block_m = 16 block_n = 16 }}", "h100")
    path = tmp_path / f"probe_{abs(hash(text))}.py"
    path.write_text(kern.source + PROBE)  # the probe kernel calls the module's own _tile_range
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    for q_len, kv_len in ((100, 100), (64, 150), (150, 70)):
        n_rows = -(-q_len // 16)
        out = torch.zeros(n_rows * 4, dtype=torch.int32)
        module._probe[(n_rows,)](out, q_len, kv_len, BLOCK=16)
        got = [tuple(out[4 * i: 4 * i + 4].tolist()) for i in range(n_rows)]
        want = _expected_ranges(classify_tiles(kern.plan.mask, q_len, kv_len, 16, 16), kv_len, 16)
        assert got == want, (text, q_len, kv_len)


PROBE = """

@triton.jit
def _probe(Out, q_len, kv_len, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    q_lo = i * BLOCK
    q_hi = tl.minimum(q_lo + BLOCK, q_len) - 1
    lo, full_lo, full_hi, hi = _tile_range(q_lo, q_hi, 0, 0, q_len, kv_len, True, BLOCK)
    tl.store(Out + i * 4 + 0, lo)
    tl.store(Out + i * 4 + 1, full_lo)
    tl.store(Out + i * 4 + 2, full_hi)
    tl.store(Out + i * 4 + 3, hi)
"""
