"""Semantic checks: a valid spec becomes a typed Spec; every invalid one gets a pointed SpecError."""
from pathlib import Path

import pytest

from attngen.lang.check import load_spec
from attngen.errors import SpecError
from attngen.lang.expr import format_expr
from attngen.lang.spec import Binary, Const, DType, LoopOrder, Type, Var

SPECS = sorted((Path(__file__).parent.parent / "specs").glob("*.attn"))


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_shipped_specs_check(path):
    spec = load_spec(path.read_text(), str(path))
    assert spec.name == path.stem
    assert 16 <= spec.head_dim <= (576 if spec.kv_layout.value == "paged" else 256)  # wider: the decode kernels only


def test_defaults_and_values():
    spec = load_spec("attention t { head_dim = 64 }")
    assert spec.dtype is DType.BF16 and spec.scale is None and spec.softmax_scale == 64 ** -0.5
    assert spec.mask is None and spec.score is None and spec.loop_order is LoopOrder.Q_OUTER and spec.target == "auto"
    spec = load_spec("attention t { head_dim = 64 dtype = fp32 scale = 0.5 loop_order = kv_outer target = a100 block_m = 32 block_n = auto }")
    assert (spec.dtype, spec.scale, spec.loop_order, spec.target, spec.block_m, spec.block_n) == (DType.FP32, 0.5, LoopOrder.KV_OUTER, "a100", 32, None)


def test_identity_expressions_fold_away():
    spec = load_spec("attention t { head_dim = 64 mask = true or q_idx > 3 score = score * 1.0 - 0.0 }")
    assert spec.mask is None and spec.score is None


def test_float_folding_keeps_ieee_values():
    """score + 0.0 turns -0.0 into 0.0 and score * 0.0 turns an infinity into NaN: not identities on floats,
    so they stay (the kernel and the reference then compute the same thing); on integers x + 0 folds."""
    spec = load_spec("attention t { head_dim = 64 mask = q_idx + 0 >= kv_idx score = score + 0.0 * score }")
    assert format_expr(spec.mask) == "q_idx >= kv_idx"
    assert format_expr(spec.score) == "score + 0.0 * score"


def test_constants_fold():
    spec = load_spec("attention t { head_dim = 64 mask = q_idx - kv_idx < 2 * 512 }")
    assert spec.mask == Binary("<", Binary("-", Var("q_idx"), Var("kv_idx")), Const(1024, Type.INT))


def test_spec_equality_ignores_spans_and_text():
    a = load_spec("attention t { head_dim = 64 mask = q_idx >= kv_idx }")
    b = load_spec("attention t {\n\n   mask = q_idx>=kv_idx  # causal\n head_dim = 64 }")
    assert a == b and hash(a) == hash(b)


BAD = [
    ("attention t { }", "head_dim is required"),
    ("attention t { head_dim = 8 }", "head_dim = 8 is out of range; expected 16..256"),
    ("attention t { head_dim = 64.0 }", "head_dim must be an integer"),
    ("attention t { head_dim = 64 head_dim = 32 }", "head_dim is set twice"),
    ("attention t { head_dim = 64 maks = true }", "unknown setting 'maks'; did you mean 'mask'?"),
    ("attention t { head_dim = 64 dtype = bf32 }", "dtype must be one of: fp16, bf16, fp32, fp8; got 'bf32'"),
    ("attention t { head_dim = 64 scale = -1.0 }", "scale must be a positive number or auto"),
    ("attention t { head_dim = 64 scale = 1e39 }", "outside float32's range once multiplied by log2"),  # was all-NaN output
    ("attention t { head_dim = 64 scale = 1e-45 }", "outside float32's range once multiplied by log2"),
    ("attention t { head_dim = 64 dropout = 1.0 }", "dropout must be a probability in [0, 1)"),
    ("attention t { head_dim = 64 loop_order = kv_first }", "loop_order must be one of: q_outer, kv_outer"),
    ("attention t { head_dim = 64 target = h1000 }", "target must be one of: auto, t4"),
    ("attention t { head_dim = 64 block_m = 48 }", "block_m = 48 must be a power of two"),
    ("attention t { head_dim = 64 sparse_block = 100 }", "sparse_block = 100 must be a power of two"),
    ("attention t { head_dim = 64 mask = q_idx + 1 }", "mask must be a boolean expression"),
    ("attention t { head_dim = 64 mask = score > 0 }", "'score' cannot be used in mask"),
    ("attention t { head_dim = 64 mask = q_blk > 0 }", "'q_blk' cannot be used in mask"),
    ("attention t { head_dim = 64 mask = foo > 0 }", "unknown name 'foo' in mask"),
    ("attention t { head_dim = 64 mask = input[b, q_idx] > 0 }", "declare it with `input ids: int32[B, N]` and index `ids[...]` ('input' is reserved)"),
    ("attention t { head_dim = 64 mask = q_idx and kv_idx }", "`and` needs booleans, got int"),
    ("attention t { head_dim = 64 mask = not q_idx }", "`not` needs a boolean, got int"),
    ("attention t { head_dim = 64 mask = (q_idx > 1) + 1 > 0 }", "`+` needs numbers, got bool"),
    ("attention t { head_dim = 64 mask = (q_idx > 1) < 3 }", "cannot compare bool < int"),
    ("attention t { head_dim = 64 score = score > 1.0 }", "score must be a number expression"),
    ("attention t { head_dim = 64 score = q_idx - kv_idx }", "score must be a float expression"),
    ("attention t { head_dim = 64 score = foo(score) }", "unknown function 'foo'"),
    ("attention t { head_dim = 64 score = tanh(score, 2.0) }", "tanh() takes 1 argument(s), got 2"),
    ("attention t { head_dim = 64 score = where(score, 1.0, 2.0) }", "where()'s first argument must be boolean"),
    ("attention t { head_dim = 64 mask = where(q_idx > 0, true, 1) }", "where()'s branches must both be numbers or both booleans"),
    ("attention t { head_dim = 64 mask = doc[b] > 0 }", "'doc' is not a declared input"),
    ("attention t { head_dim = 64 input doc: int32[B, N] mask = doc[b] > 0 }", "input 'doc' has 2 dimension(s), indexed with 1"),
    ("attention t { head_dim = 64 input doc: int32[B, N] mask = doc[b, 1.5] > 0 }", "indices of 'doc' must be integers"),
    ("attention t { head_dim = 64 input doc: int32[B, N] mask = doc > 0 }", "input 'doc' is a tensor: index it"),
    ("attention t { head_dim = 64 input doc: int33[B] }", "input element type must be one of"),
    ("attention t { head_dim = 64 input doc: int32[B] input doc: int32[B] }", "input 'doc' is declared twice"),
    ("attention t { head_dim = 64 input q: int32[B] }", "'q' cannot name an input"),
    ("attention t { head_dim = 64 input kv_idx: int32[B] }", "'kv_idx' cannot name an input"),
    ("attention t { head_dim = 64 input while: int32[B] }", "'while' cannot name an input"),
    ("attention t { head_dim = 64 input doc: int32[B, 0] }", "dimension sizes of 'doc' must be positive"),
    ("attention t { head_dim = 64 mask = q_idx < 99999999999 }", "does not fit in 32 bits"),
    ("attention t { head_dim = 64 score = score * 1e999 }", "is not finite"),
    ("attention t { head_dim = 64 sparsity = q_idx > 0 }", "'q_idx' cannot be used in sparsity"),
    ("attention t { head_dim = 64 mask = q_idx & 1 == 0 }", "`&` needs two integers (bitwise) or two booleans, got int and bool (`&` and `|` bind looser"),
    ("attention t { head_dim = 64 mask = (q_idx ^ 1.5) > 0 }", "`^` needs two integers (bitwise), got int and float"),
    # no value: a divisor that is always 0, integer arithmetic that could leave int64, constants the kernels cannot hold
    ("attention t { head_dim = 64 mask = q_idx % 0 == 0 }", "division by zero: the divisor of `%` is always 0"),
    ("attention t { head_dim = 64 mask = q_idx // (3 - 3) == 0 }", "division by zero: the divisor of `//` is always 0"),
    ("attention t { head_dim = 64 score = score / (0.5 - 0.5) }", "division by zero: the divisor of `/` is always 0"),
    ("attention t { head_dim = 64 mask = q_idx * kv_idx * q_idx > 3 }", "integer overflow: `q_idx * kv_idx * q_idx` can reach 2**89"),
    ("attention t { head_dim = 64 input x: int64[B] mask = x[b] + 1 > kv_idx }", "x (int64) may hold any value of its type"),
    ("attention t { head_dim = 64 mask = q_idx < 65536 * 65536 }", "`65536 * 65536` is 4294967296, which does not fit in 32 bits"),
    ("attention t { head_dim = 64 score = score * (1e30 * 1e30) }", "outside float32's range"),
    ("attention t { head_dim = 64 score = score * 1e-40 }", "outside float32's range"),
    ("attention t { head_dim = 64 score = score + exp(1000.0) }", "constant expression `exp(1000.0)` has no value"),
]


@pytest.mark.parametrize("setting, column", [("mask = q_idx % (2 - 2) == 0", 19), ("mask = q_idx // (2 - 2) == 0", 20),
                                             ("score = score / (2.0 - 2.0)", 20)])
def test_zero_divisor_error_points_at_the_divisor(setting, column):
    with pytest.raises(SpecError) as info:
        load_spec(f"attention t {{\n  head_dim = 64\n  {setting}\n}}", "x.attn")
    assert str(info.value).startswith(f"x.attn:3:{column}: error: division by zero"), str(info.value)
    source, carets = str(info.value).splitlines()[1:]
    divisor = setting[setting.index("(") + 1:setting.index(")")]
    assert source[carets.index("^"):len(carets)] == divisor  # the divisor, inside its parentheses


@pytest.mark.parametrize("text, message", BAD, ids=[m for _, m in BAD])
def test_errors_point_at_the_problem(text, message):
    with pytest.raises(SpecError) as info:
        load_spec(text, "bad.attn")
    rendered = str(info.value)
    assert message in rendered, rendered
    assert rendered.startswith("bad.attn:1:"), rendered
    lines = rendered.splitlines()
    assert lines[1].strip() == text.strip() and "^" in lines[2], rendered


def test_error_span_is_the_value_not_the_line():
    text = "attention t {\n  head_dim = 64\n  mask = q_idx + 1\n}"
    with pytest.raises(SpecError) as info:
        load_spec(text, "x.attn")
    assert str(info.value).startswith("x.attn:3:10: error:")
    assert str(info.value).splitlines()[-1] == "    " + " " * 9 + "^" * len("q_idx + 1")


def test_names_longer_than_the_limit_say_so():
    """A spec's or an input's name over 64 characters: the message gives the limit (it said 'not an identifier')."""
    with pytest.raises(SpecError, match="bad attention name 'a{64}\\.\\.\\.' \\(names are at most 64 characters\\)"):
        load_spec("attention " + "a" * 80 + " { head_dim = 16 }")
    with pytest.raises(SpecError, match="cannot name an input \\(names are at most 64 characters\\)"):
        load_spec("attention t { head_dim = 16 input " + "x" * 70 + ": int32[B] }")
    with pytest.raises(SpecError, match="'q_idx' cannot name an input \\(a reserved word\\)"):
        load_spec("attention t { head_dim = 16 input q_idx: int32[B] }")


def test_spec_text_and_paths_are_told_apart(tmp_path):
    """compile()/read_spec take spec text or a path: a path with braces or spaces that exists is read as a file,
    text that starts with `attention` is parsed (its syntax error shown, not 'no such spec file')."""
    from attngen.lang.check import read_spec
    from attngen.errors import AttngenError, SpecSyntaxError

    braces = tmp_path / "exp{1} v2" / "small.attn"
    braces.parent.mkdir()
    braces.write_text("attention small { head_dim = 16 }")
    assert read_spec(str(braces)).name == "small"
    with pytest.raises(SpecSyntaxError, match="expected '{'"):
        read_spec("attention x head_dim = 16")
    assert read_spec("# a comment\nattention y { head_dim = 16 }").name == "y"
    with pytest.raises(AttngenError, match="no such spec file: attention.attn"):
        read_spec("attention.attn")
    with pytest.raises(AttngenError, match="a spec is a Spec, spec text or the path"):
        read_spec(42)
