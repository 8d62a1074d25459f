"""Spec text -> lark tree -> AST nodes carrying source spans. Parses only; meaning is check.py's job."""
from __future__ import annotations

import functools
from dataclasses import dataclass

from lark import Lark, Token, Transformer, Tree, v_args
from lark.exceptions import UnexpectedCharacters, UnexpectedEOF, UnexpectedInput, UnexpectedToken

from ..errors import Span, SpecSyntaxError
from .spec import Binary, Call, Const, Expr, Index, InputDecl, Type, Unary, Var


@dataclass(frozen=True)
class Setting:
    key: str
    value: Expr
    key_span: Span
    span: Span


@dataclass(frozen=True)
class ParsedSpec:
    name: str
    name_span: Span
    settings: tuple[Setting, ...]
    inputs: tuple[InputDecl, ...]


@functools.lru_cache(maxsize=1)
def _parser() -> Lark:
    return Lark.open_from_package("attngen.lang", "grammar.lark", parser="lalr", propagate_positions=True)


def _tok_span(tok: Token) -> Span:
    return Span(tok.line, tok.column, tok.end_line, tok.end_column)


def _tree_span(meta) -> Span:
    return Span(meta.line, meta.column, meta.end_line, meta.end_column)


@v_args(meta=True)
class _ToAst(Transformer):
    """Bottom-up: every expression rule becomes an Expr node with its span."""

    def int_lit(self, meta, c):
        return Const(int(c[0]), Type.INT, span=_tok_span(c[0]))

    def float_lit(self, meta, c):
        return Const(float(c[0]), Type.FLOAT, span=_tok_span(c[0]))

    def true_lit(self, meta, c):
        return Const(True, Type.BOOL, span=_tree_span(meta))

    def false_lit(self, meta, c):
        return Const(False, Type.BOOL, span=_tree_span(meta))

    def var(self, meta, c):
        return Var(str(c[0]), span=_tok_span(c[0]))

    def call(self, meta, c):
        args = tuple(a for a in c[1:] if a is not None)
        return Call(str(c[0]), args, span=_tree_span(meta))

    def index(self, meta, c):
        return Index(str(c[0]), tuple(c[1:]), span=_tree_span(meta))

    def unary(self, meta, c):
        op, operand = str(c[0]), c[1]
        if op == "+":
            return operand
        return Unary("-", operand, span=_tree_span(meta))

    def binary(self, meta, c):
        return Binary(str(c[1]), c[0], c[2], span=_tree_span(meta))

    def compare(self, meta, c):
        lhs, op, rhs = c
        return Binary(str(op), lhs, rhs, span=_tree_span(meta))

    def bool_and(self, meta, c):
        return Binary("and", c[0], c[1], span=_tree_span(meta))

    def bool_or(self, meta, c):
        return Binary("or", c[0], c[1], span=_tree_span(meta))

    def bool_not(self, meta, c):
        return Unary("not", c[0], span=_tree_span(meta))

    def setting(self, meta, c):
        key, value = c
        return Setting(str(key), value, _tok_span(key), _tree_span(meta))

    def dim_name(self, meta, c):
        return str(c[0])

    def dim_int(self, meta, c):
        return int(c[0])

    def input_decl(self, meta, c):
        name, dtype, *dims = c
        return InputDecl(str(name), str(dtype), tuple(dims), span=_tok_span(name), dtype_span=_tok_span(dtype))

    def attention(self, meta, c):
        name, *items = c
        settings = tuple(i for i in items if isinstance(i, Setting))
        inputs = tuple(i for i in items if isinstance(i, InputDecl))
        return name, settings, inputs

    def start(self, meta, c):
        return c[0]


# Readable names for the grammar's terminals, used in "expected ..." messages.
_TERMINAL_NAMES = {
    "NAME": "a name",
    "INT": "an integer",
    "FLOAT": "a number",
    "COMP_OP": "a comparison (<, <=, >, >=, ==, !=)",
    "ADD_OP": "'+' or '-'",
    "MUL_OP": "'*', '/', '//' or '%'",
    "PIPE": "'|'",
    "AMP": "'&'",
    "CARET": "'^'",
    "$END": "end of text",
}


def _expected(err: UnexpectedInput, parser: Lark) -> str:
    names = set()
    terms = getattr(err, "expected", None) or getattr(err, "allowed", None) or ()
    interactive = getattr(err, "interactive_parser", None)
    if interactive is not None:
        try:  # what the parser really accepts here, past LALR's default reductions
            terms = interactive.accepts() or terms
        except Exception:  # pragma: no cover - fall back to lark's own (wider) list
            pass
    for term in sorted(terms):
        if term in _TERMINAL_NAMES:
            names.add(_TERMINAL_NAMES[term])
            continue
        try:
            pattern = parser.get_terminal(term).pattern
        except KeyError:
            names.add(term)
            continue
        names.add(repr(pattern.value) if pattern.type == "str" else term)
    if not names:
        return ""
    listed = sorted(names)
    return "expected " + (listed[0] if len(listed) == 1 else "one of: " + ", ".join(listed))


def _describe(tok: Token) -> str:
    if tok.type == "$END":
        return "end of text"
    return repr(str(tok))


MAX_NESTING = 100  # levels of a parse tree: every later stage walks expressions recursively


def _check_nesting(tree, text: str, filename: str | None) -> None:
    """SpecSyntaxError at the first node nested deeper than MAX_NESTING (found without recursion): a mask of
    hundreds of `or` clauses would otherwise end in Python's RecursionError somewhere later."""
    stack = [(tree, 1)]
    while stack:
        node, depth = stack.pop()
        if depth > MAX_NESTING:
            meta = node.meta
            span = Span(meta.line, meta.column, meta.line, meta.column + 1) if not meta.empty else Span(1, 1, 1, 2)
            raise SpecSyntaxError(f"expression nested more than {MAX_NESTING} levels deep (a chain of that many operators nests "
                                  f"as deep); split it, e.g. into declared inputs or shorter conditions", span, text, filename)
        stack.extend((child, depth + 1) for child in node.children if isinstance(child, Tree))


def parse(text: str, filename: str | None = None) -> ParsedSpec:
    """Parse spec text. Raises SpecSyntaxError with file:line:col, the line, a caret and what was expected."""
    parser = _parser()
    try:
        tree = parser.parse(text)
    except UnexpectedToken as err:
        tok = err.token
        if tok.type == "$END":
            lines = text.splitlines() or [""]
            span = Span(len(lines), len(lines[-1]) + 1, len(lines), len(lines[-1]) + 2)
        else:
            span = _tok_span(tok)
        msg = f"unexpected {_describe(tok)}; {_expected(err, parser)}".rstrip("; ")
        if tok.type == "COMP_OP" and tok.start_pos and text[tok.start_pos - 1] in "<>=!":  # `>>=`, `=<`: one operator misspelled
            msg += f" ({text[tok.start_pos - 1]}{tok.value!s} is no operator; comparisons are <, <=, >, >=, ==, !=)"
        elif tok.type == "COMP_OP":
            msg += " (comparisons do not chain: write `a < b and b < c`)"
        raise SpecSyntaxError(msg, span, text, filename) from None
    except UnexpectedCharacters as err:
        span = Span(err.line, err.column, err.line, err.column + 1)
        ch = text[err.pos_in_stream] if err.pos_in_stream < len(text) else ""
        msg = f"unexpected character {ch!r}; {_expected(err, parser)}".rstrip("; ")
        raise SpecSyntaxError(msg, span, text, filename) from None
    except UnexpectedEOF as err:  # pragma: no cover - LALR reports EOF as UnexpectedToken($END)
        lines = text.splitlines() or [""]
        span = Span(len(lines), len(lines[-1]) + 1, len(lines), len(lines[-1]) + 2)
        raise SpecSyntaxError(f"unexpected end of text; {_expected(err, parser)}", span, text, filename) from None
    _check_nesting(tree, text, filename)
    name, settings, inputs = _ToAst().transform(tree)
    return ParsedSpec(
        name=str(name),
        name_span=_tok_span(name),
        settings=settings,
        inputs=inputs,
    )
