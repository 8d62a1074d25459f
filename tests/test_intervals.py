"""The tile classifier: sound (an ALWAYS or NEVER verdict holds at every index of the tile, checked by brute
force over thousands of random masks and tiles) and precise on the masks that matter."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from strategies import bool_exprs, int_exprs

from attngen.lang import expr as ex
from attngen.lang.check import load_spec
from attngen.lang.intervals import Interval, TileClass, Truth, classify_tiles, evaluate, tile_counts, tile_env, tile_map, truth
from attngen.tools.reference import evaluate as evaluate_torch
from attngen.lang.spec import Binary, Const, Type

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


@pytest.mark.slow
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


@settings(max_examples=1500, deadline=None)
@given(mask=st.one_of(bool_exprs(), _float_masks()), tile=tiles, piece=st.integers(1, 16), axis=st.sampled_from(["q", "kv"]))
def test_a_group_verdict_holds_for_every_tile_inside_it(mask, tile, piece, axis):
    """The Gluon kernels classify a group of tiles before its tiles (a program's range scan: a group proved empty is
    skipped, one proved full visited whole), while the backward's order of dQ additions counts the visits tile by
    tile: a group's ALWAYS or NEVER must be the verdict of every piece of it too (the interval arithmetic is
    inclusion-isotonic), or a program could skip a tile that the order expects it to add into."""
    q0, qn, k0, kn, q_len, kv_len = tile
    verdict = truth(mask, tile_env(q0, q0 + qn - 1, k0, k0 + kn - 1, q_len, kv_len))
    if verdict is Truth.MAYBE:
        return
    start, size = (q0, qn) if axis == "q" else (k0, kn)
    for lo in range(start, start + size, piece):
        hi = min(lo + piece, start + size) - 1
        env = tile_env(lo, hi, k0, k0 + kn - 1, q_len, kv_len) if axis == "q" else tile_env(q0, q0 + qn - 1, lo, hi, q_len, kv_len)
        assert truth(mask, env) is verdict, (ex.format_expr(mask), tile, axis, lo, hi)


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


def _with_probe(tmp_path, name: str, source: str):
    """The generated module `source` plus a probe kernel that calls its own _tile_range, imported."""
    from attngen.runtime.loader import _import

    path = tmp_path / f"{name}.py"
    path.write_text(source)
    return _import(path)


@pytest.mark.skipif("not __import__('os').environ.get('TRITON_INTERPRET')", reason="runs generated code in Triton's interpreter")
@pytest.mark.parametrize("text", [
    "q_idx >= kv_idx",
    "q_idx >= kv_idx and q_idx - kv_idx < 40",
    "q_idx // 32 == kv_idx // 32",
    "q_idx + kv_len - q_len >= kv_idx",
    "abs(q_idx - kv_idx) <= 20 or kv_idx < 16",
    # butterfly blocks of 32: block indices that differ in at most one bit (bitwise operators on integers)
    "((q_idx // 32 ^ kv_idx // 32) & ((q_idx // 32 ^ kv_idx // 32) - 1)) == 0",
    "(q_idx | kv_idx) < 64 or (q_idx & 48) == (kv_idx & 48)",
])
def test_kernel_tile_ranges_match_the_classifier(text, tmp_path):
    import attngen

    kern = attngen.compile(f"attention t {{ head_dim = 16 dtype = fp32 mask = {text} block_m = 16 block_n = 16 }}", "h100")
    module = _with_probe(tmp_path, f"probe_{abs(hash(text))}", kern.source + PROBE)
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


# ---- masks that read inputs: the pre-pass summaries bound each tile, checked by brute force ----------------
INPUT_MASKS = {
    "document": ("input doc: int32[B, N]", "doc[b, q_idx] == doc[b, kv_idx] and q_idx >= kv_idx"),
    "padding": ("input lens: int32[B]", "kv_idx < lens[b]"),
    "prefix": ("input prefix: int32[B]", "q_idx >= kv_idx or kv_idx < prefix[b]"),
    "allowed": ("input allowed: bool[B, N]", "allowed[b, kv_idx] or q_idx == kv_idx"),
    "query_groups": ("input grp: int8[N, B]", "grp[q_idx, b % 2] <= grp[kv_idx, b % 2]"),
    "document64": ("input doc: int64[B, N]", "doc[b, q_idx] == doc[b, kv_idx] and q_idx >= kv_idx"),
    "limits": ("input lim: int32[B, N]", "lim[b, q_idx] >= kv_idx"),  # a read against a position
}


@pytest.mark.parametrize("dtype, width", [("int8", "int32"), ("int32", "int32"), ("bool", "int32"), ("int64", "int64")])
def test_summaries_are_read_in_the_inputs_width(dtype, width):
    """A read bounded by the pre-pass's summaries is compared in int32 for inputs of at most 32 bits (an int32
    vector of tiles takes half the registers of int64), its unknown interval that type's whole range; int64 inputs
    stay int64."""
    from attngen.codegen.tiles import lower_tile_class

    spec = load_spec(f"attention t {{ head_dim = 16 dtype = fp32 input x: {dtype}[B, N] mask = x[b, q_idx] == x[b, kv_idx] }}")
    code = "\n".join(lower_tile_class(spec.mask, ex.Scope("mask", ex.MASK_VARS, spec.inputs_by_name)).stmts)
    other = "int64" if width == "int32" else "int32"
    assert f".to(tl.{width})" in code and f"{width.upper()}_MAX" in code and f"{width.upper()}_MIN" in code
    assert f".to(tl.{other})" not in code and f"{other.upper()}_MAX" not in code


def _input_probe(params: list[str]) -> str:
    args = ", ".join(params)
    return f"""

@triton.jit
def _probe(Out, q_len, kv_len, {args}, ROWS_ARE_QUERIES: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    b = tl.program_id(1)
    length = q_len if ROWS_ARE_QUERIES else kv_len
    row_lo = i * BLOCK
    row_hi = tl.minimum(row_lo + BLOCK, length) - 1
    lo, full_lo, full_hi, hi = _tile_range(row_lo, row_hi, b, 0, q_len, kv_len, {args}, ROWS_ARE_QUERIES, BLOCK)
    out = Out + (b * tl.num_programs(0) + i) * 4
    tl.store(out + 0, lo)
    tl.store(out + 1, full_lo)
    tl.store(out + 2, full_hi)
    tl.store(out + 3, hi)
"""


def _random_input(decl, batch, n, gen, aligned):
    shape = tuple({"B": batch, "N": n}[d] for d in decl.dims)
    if decl.dtype == "bool":
        runs = torch.rand((batch, n // 16 + 1), generator=gen) < 0.5  # runs of 16 (aligned) or random noise
        return runs.repeat_interleave(16, 1)[:, :n] if aligned else torch.rand(shape, generator=gen) < 0.7
    if len(shape) == 1:
        return torch.randint(0, n + 20, shape, generator=gen, dtype=torch.int32)
    if aligned:  # documents of 32 tokens: every 16-token tile inside one document
        t = torch.arange(n).div(32, rounding_mode="floor").expand(shape[::-1] if decl.dims[0] == "N" else shape)
        t = t.T if decl.dims[0] == "N" else t
    else:
        t = torch.randint(0, 6, shape, generator=gen).cumsum(0 if decl.dims[0] == "N" else 1)  # runs of any length
    return t.to(getattr(torch, decl.dtype)).contiguous()


@pytest.mark.skipif("not __import__('os').environ.get('TRITON_INTERPRET')", reason="runs generated code in Triton's interpreter")
@pytest.mark.parametrize("name", sorted(INPUT_MASKS))
def test_kernel_tile_ranges_with_inputs_are_sound(name, tmp_path):
    """Every tile the kernels skip keeps no pair, every tile they run unmasked keeps all, for random inputs (and
    inputs shorter than the sequence, which read 0); with tile-aligned inputs the ranges are exact."""
    import attngen
    from attngen.codegen.triton import context

    decl_text, mask_text = INPUT_MASKS[name]
    kern = attngen.compile(f"attention t {{ head_dim = 16 dtype = fp32 {decl_text} mask = {mask_text} block_m = 16 block_n = 16 }}", "h100")
    params = context(kern.plan)["tile_class"].params
    module = _with_probe(tmp_path, f"probe_inputs_{name}", kern.source + _input_probe(params))
    decl = kern.spec.inputs[0]
    scope = ex.Scope("mask", ex.MASK_VARS, kern.spec.inputs_by_name)
    gen = torch.Generator().manual_seed(0)
    batch, block = 3, 16
    skipped = 0
    for q_len, kv_len, n, aligned in ((100, 100, 100, False), (64, 150, 150, False), (150, 70, 150, False),
                                      (96, 96, 96, True), (90, 120, 100, False)):  # the last: input shorter than kv_len
        x = _random_input(decl, batch, n, gen, aligned)
        args = []
        for p in params:
            kind, axis = p.rsplit("_", 1)
            if p == f"in_{decl.name}_ptr":
                args.append(x)
            elif kind == f"in_{decl.name}_stride":
                args.append(x.stride(int(axis)))
            elif kind == f"in_{decl.name}_size":
                args.append(x.shape[int(axis)])
            else:
                args.append(module._bounds_of(x, int(axis)))
        for rows_are_queries in (True, False):
            rows, cols = (q_len, kv_len) if rows_are_queries else (kv_len, q_len)
            n_rows, n_cols = -(-rows // block), -(-cols // block)
            out = torch.zeros(batch * n_rows * 4, dtype=torch.int32)
            module._probe[(n_rows, batch)](out, q_len, kv_len, *args, ROWS_ARE_QUERIES=rows_are_queries, BLOCK=block)
            for b in range(batch):
                env = {"q_idx": torch.arange(q_len).view(-1, 1), "kv_idx": torch.arange(kv_len).view(1, -1),
                       "q_len": q_len, "kv_len": kv_len, "b": b, "h": 0}
                grid = torch.as_tensor(evaluate_torch(kern.plan.mask, env, {decl.name: x}, scope, torch.float64)).broadcast_to((q_len, kv_len))
                grid = grid if rows_are_queries else grid.T
                classes = []
                for i in range(n_rows):
                    row = []
                    for j in range(n_cols):
                        t = grid[i * block:(i + 1) * block, j * block:(j + 1) * block]
                        row.append(TileClass.FULL if bool(t.all()) else TileClass.EMPTY if not bool(t.any()) else TileClass.PARTIAL)
                    classes.append(row)
                want = _expected_ranges(classes, cols, block)
                for i in range(n_rows):
                    lo, full_lo, full_hi, hi = out[(b * n_rows + i) * 4:(b * n_rows + i + 1) * 4].tolist()
                    where = (name, q_len, kv_len, rows_are_queries, b, i)
                    assert 0 <= lo <= full_lo <= full_hi <= hi <= n_cols, where
                    assert all(classes[i][j] is TileClass.EMPTY for j in range(n_cols) if not lo <= j < hi), where
                    assert all(classes[i][j] is TileClass.FULL and (j + 1) * block <= cols for j in range(full_lo, full_hi)), where
                    skipped += n_cols - (hi - lo)
                    if aligned:
                        assert (lo, full_lo, full_hi, hi) == want[i], (where, want[i])
    if name != "allowed":  # random booleans rarely leave a whole 16-token tile False
        assert skipped > 0, "the classifier skipped nothing"


@pytest.mark.parametrize("mask, keeps", [
    ("q_idx >= kv_idx", True),
    ("q_idx >= kv_idx or kv_idx < prefix[b]", True),
    ("kv_idx // 64 == 0 or q_idx // 64 == kv_idx // 64", True),
    ("q_idx >= kv_idx and q_idx - kv_idx < 1024", False),  # far rows do not see key 0
    ("q_idx + kv_len - q_len >= kv_idx", False),  # rows before kv_len - q_len see nothing
    ("kv_idx < prefix[b]", False),  # prefix[b] may be 0
    ("doc[b, q_idx] == doc[b, kv_idx]", False),
])
def test_nan_guards_only_where_a_row_may_keep_no_key(mask, keeps):
    import attngen
    from attngen.lang.intervals import keeps_first_key

    decls = "input prefix: int32[B] input doc: int32[B, N]"
    kern = attngen.compile(f"attention t {{ head_dim = 16 {decls} mask = {mask} }}", "h100")
    assert keeps_first_key(kern.plan.mask) is keeps
    training = kern.source.split("def _attn_decode(")[0]  # (the decode kernel always guards: a sequence may have no key)
    guarded = 'float("-inf"), 0.0' in training  # the -inf -> 0 replacements of the guards
    assert guarded is not keeps
    if keeps:  # brute force: key 0 is kept in every row, for a few lengths
        for q_len in (1, 5, 300):
            env = {"q_idx": torch.arange(q_len).view(-1, 1), "kv_idx": torch.zeros(1, 1, dtype=torch.long),
                   "q_len": q_len, "kv_len": 7, "b": 0, "h": 0}
            scope = ex.Scope("mask", ex.MASK_VARS, kern.spec.inputs_by_name)
            inputs = {"prefix": torch.zeros(1, dtype=torch.int32), "doc": torch.zeros(1, q_len, dtype=torch.int32)}
            assert bool(torch.as_tensor(evaluate_torch(kern.plan.mask, env, inputs, scope, torch.float64)).all())


@pytest.mark.skipif("not __import__('os').environ.get('TRITON_INTERPRET')", reason="runs generated code in Triton's interpreter")
@pytest.mark.parametrize("dtype", [torch.int8, torch.int32, torch.int64, torch.bool])
def test_input_pre_pass_gives_chunk_minima_and_maxima(dtype):
    import attngen

    kern = attngen.compile("attention t { head_dim = 16 dtype = fp32 input x: int32[B, N, 5] mask = x[b, kv_idx, 2] == 1 }", "h100")
    chunk = min(kern.plan.tile_sizes)
    gen = torch.Generator().manual_seed(1)
    x = torch.randint(-100, 100, (3, 70, 5), generator=gen)
    x = (x > 0) if dtype is torch.bool else x.to(dtype)
    for axis in range(3):
        got = kern.module._bounds_of(x.transpose(0, 2) if axis == 2 else x, 1 if axis == 2 else axis)  # non-contiguous too
        t = (x.transpose(0, 2) if axis == 2 else x).to(torch.int64)
        ax = 1 if axis == 2 else axis
        n = t.shape[ax]
        lo, hi = (g.reshape(*t.shape[:ax], -1, *t.shape[ax + 1:]).to(torch.int64) for g in got)  # [2, outer, chunks, inner]
        for c in range(-(-n // chunk)):
            part = t.narrow(ax, c * chunk, min(chunk, n - c * chunk))
            assert torch.equal(lo.select(ax, c), part.amin(ax)), (dtype, axis, c)
            assert torch.equal(hi.select(ax, c), part.amax(ax)), (dtype, axis, c)
