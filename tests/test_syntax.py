"""Parsing: every shipped spec parses; every kind of syntax error says file:line:col, shows a caret, says what was expected."""
from pathlib import Path

import pytest

from attngen.errors import SpecSyntaxError
from attngen.lang.spec import Binary, Call, Const, Index, Type, Unary, Var
from attngen.lang.check import load_spec
from attngen.lang.syntax import parse

SPECS = sorted((Path(__file__).parent.parent / "specs").glob("*.attn"))


def test_specs_exist():
    assert len(SPECS) >= 10


@pytest.mark.parametrize("path", SPECS, ids=lambda p: p.name)
def test_shipped_specs_parse(path):
    parsed = parse(path.read_text(), str(path))
    assert parsed.name == path.stem
    assert any(s.key == "head_dim" for s in parsed.settings)


def test_full_language_example():
    text = """
    # comments run to the end of the line
    attention causal_softcap {
        head_dim   = 128            # required, 16..256
        dtype      = bf16
        scale      = auto
        mask       = q_idx >= kv_idx                  # boolean expression
        score      = 30.0 * tanh(score / 30.0)
        dropout    = 0.0
        sparsity   = none
        sparse_block = 128
        loop_order = q_outer
        target     = auto
        block_m    = auto
        block_n    = auto
        input doc: int32[B, N]
    }
    """
    p = parse(text)
    assert p.name == "causal_softcap"
    keys = [s.key for s in p.settings]
    assert keys == ["head_dim", "dtype", "scale", "mask", "score", "dropout", "sparsity", "sparse_block", "loop_order", "target", "block_m", "block_n"]
    assert p.inputs[0].name == "doc" and p.inputs[0].dims == ("B", "N")
    score = dict((s.key, s.value) for s in p.settings)["score"]
    assert score == Binary("*", Const(30.0, Type.FLOAT), Call("tanh", (Binary("/", Var("score"), Const(30.0, Type.FLOAT)),)))


def _expr(src: str):
    return parse(f"attention t {{ mask = {src} }}").settings[0].value


@pytest.mark.parametrize(
    "src, expected",
    [
        ("a + b * c", Binary("+", Var("a"), Binary("*", Var("b"), Var("c")))),
        ("a - b - c", Binary("-", Binary("-", Var("a"), Var("b")), Var("c"))),
        ("a // b % c", Binary("%", Binary("//", Var("a"), Var("b")), Var("c"))),
        ("-a * b", Binary("*", Unary("-", Var("a")), Var("b"))),
        ("a < b and c or not d", Binary("or", Binary("and", Binary("<", Var("a"), Var("b")), Var("c")), Unary("not", Var("d")))),
        # `&` and `|` parse at the level of `and` and `or` (their meaning, logical or bitwise, comes from the types)
        ("a & b | !c", Binary("|", Binary("&", Var("a"), Var("b")), Unary("not", Var("c")))),
        ("a ^ b == c + 1", Binary("==", Binary("^", Var("a"), Var("b")), Binary("+", Var("c"), Const(1, Type.INT)))),
        ("(a & b) == 0", Binary("==", Binary("&", Var("a"), Var("b")), Const(0, Type.INT))),
        ("q_idx + 1 >= kv_idx", Binary(">=", Binary("+", Var("q_idx"), Const(1, Type.INT)), Var("kv_idx"))),
        ("doc[b, q_idx - 1]", Index("doc", (Var("b"), Binary("-", Var("q_idx"), Const(1, Type.INT))))),
        ("where(true, 1.5e-3, .5)", Call("where", (Const(True, Type.BOOL), Const(1.5e-3, Type.FLOAT), Const(0.5, Type.FLOAT)))),
        ("max(a, b, c)", Call("max", (Var("a"), Var("b"), Var("c")))),
        ("+a", Var("a")),
    ],
)
def test_precedence_and_atoms(src, expected):
    assert _expr(src) == expected


def test_spans_point_at_source():
    p = parse("attention t {\n  mask = q_idx >= kv_idx\n}")
    s = p.settings[0]
    assert (s.key_span.line, s.key_span.col) == (2, 3)
    assert (s.value.span.line, s.value.span.col, s.value.span.end_col) == (2, 10, 25)


@pytest.mark.parametrize(
    "text, line, col, expected_words",
    [
        ("attention t { mask = q_idx >= }", 1, 31, ["unexpected '}'", "a name", "a number"]),
        ("attention t {\n  mask = q_idx @ 3\n}", 2, 16, ["unexpected character '@'"]),
        ("attn t { }", 1, 1, ["expected 'attention'"]),
        ("attention t { head_dim 64 }", 1, 24, ["expected '='"]),
        ("attention t { mask = a < b < c }", 1, 28, ["comparisons do not chain"]),
        ("attention t { mask = q_idx >>= kv_idx }", 1, 29, [">>= is no operator; comparisons are <, <=, >, >=, ==, !="]),
        ("attention t { mask = (a < b }", 1, 29, ["expected ')'"]),
        ("attention t { input d: int32[B,] }", 1, 32, ["unexpected ']'"]),
        ("attention t { mask = q_idx", 1, 27, ["unexpected end of text"]),
    ],
)
def test_syntax_errors_are_pointed(text, line, col, expected_words):
    with pytest.raises(SpecSyntaxError) as info:
        parse(text, "bad.attn")
    msg = str(info.value)
    assert msg.startswith(f"bad.attn:{line}:{col}: syntax error:"), msg
    for word in expected_words:
        assert word in msg, msg
    src_line = text.splitlines()[line - 1]
    assert src_line in msg  # the offending line is shown ...
    caret = msg.splitlines()[-1]
    assert caret.strip().startswith("^") and caret.index("^") - 4 == col - 1  # ... with a caret under the column


def test_an_expression_nested_too_deep_is_a_syntax_error_not_a_recursion_error():
    """500 `or` clauses (a parse tree 500 levels deep) used to end in RecursionError while checking or planning;
    the parser now refuses more than MAX_NESTING levels with the file and position, and 95 clauses (just under
    it) still parse."""
    from attngen.lang.syntax import MAX_NESTING

    def spec(n):
        return "attention deep {\n head_dim = 16\n dtype = fp32\n mask = " + " or ".join(f"(q_idx == {i} and kv_idx == {i})" for i in range(n)) + "\n}"

    with pytest.raises(SpecSyntaxError, match=rf"deep.attn:4:\d+: syntax error: expression nested more than {MAX_NESTING} levels deep"):
        load_spec(spec(500), "deep.attn")
    with pytest.raises(SpecSyntaxError, match="nested more than"):
        load_spec("attention s {\n head_dim = 16\n dtype = fp32\n score = " + " + ".join(["score"] * 600) + "\n}")
    assert load_spec(spec(95)).mask is not None
