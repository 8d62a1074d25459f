"""Semantic checks: a ParsedSpec becomes a validated, frozen Spec, or SpecError at the offending span."""
from __future__ import annotations

import difflib
import keyword
import os
import re
from pathlib import Path

from ..errors import AttngenError, SpecError
from ..targets import TARGETS
from . import expr as ex
from .algebra import fold
from .ranges import INT32, INT64, integer_range, within
from .spec import INPUT_DTYPES, Backend, Binary, Call, Const, DType, Expr, InputDecl, KVLayout, LoopOrder, Spec, Type, Unary, Var
from .syntax import ParsedSpec, Setting, parse

SETTINGS = (
    "head_dim",
    "value_dim",
    "dtype",
    "scale",
    "mask",
    "score",
    "sink",
    "dropout",
    "sparsity",
    "sparse_block",
    "loop_order",
    "target",
    "backend",
    "deterministic",
    "kv_layout",
    "page_size",
    "kv_dtype",
    "block_m",
    "block_n",
    "num_warps",
    "num_stages",
)
# Settings that may say `auto`: measured on the GPU (attngen/plan/tune.py) rather than derived from the target.
TUNABLE = ("block_m", "block_n", "num_warps", "num_stages")

# head_dim and value_dim with kv_layout = paged (the decode kernels): DeepSeek's latent attention, 512 + 64 columns
MAX_DECODE_HEAD_DIM = 576
MAX_DECODE_VALUE_DIM = 512
MAX_NAME = 64  # characters of a spec's or an input's name (they name files, modules and kernel arguments)
_IDENT = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,%d}$" % (MAX_NAME - 1))


def _short(name: str) -> str:
    return name if len(name) <= MAX_NAME + 8 else name[:MAX_NAME] + "..."
# Names an input may not take: language words, kernel arguments and the call's own keywords.
RESERVED = (
    set(keyword.kwlist)
    | set(ex.VAR_TYPES)
    | set(ex.FUNCTIONS)
    | {"true", "false", "True", "False", "input", "attention", "auto", "none", "runtime"}
    | {"q", "k", "v", "o", "do", "lse", "return_lse", "dropout_p", "seed", "block_mask", "tiles", "tl", "triton", "torch"}
    | {"cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k", "kv_lens", "q_lens", "block_table", "num_splits"}
)


def _suggest(word: str, options) -> str:
    close = difflib.get_close_matches(word, list(options), n=1)
    return f"; did you mean {close[0]!r}?" if close else ""


def _names(options) -> str:
    return ", ".join(options)


def _number(s: Setting) -> float | int | None:
    """The value of a numeric literal (possibly negated), or None."""
    v = s.value
    if isinstance(v, Unary) and v.op == "-" and isinstance(v.operand, Const) and v.operand.type is not Type.BOOL:
        return -v.operand.value
    if isinstance(v, Const) and v.type is not Type.BOOL:
        return v.value
    return None


def _word(s: Setting) -> str | None:
    return s.value.name if isinstance(s.value, Var) else None


def _int_setting(s: Setting, lo: int, hi: int, *, allow_auto: bool = False, power_of_two: bool = False) -> int | None:
    if allow_auto and _word(s) == "auto":
        return None
    n = _number(s)
    if not isinstance(n, int):
        want = f"an integer in {lo}..{hi}" + (" or auto" if allow_auto else "")
        raise SpecError(f"{s.key} must be {want}", s.value.span)
    if not lo <= n <= hi:
        raise SpecError(f"{s.key} = {n} is out of range; expected {lo}..{hi}", s.value.span)
    if power_of_two and n & (n - 1):
        why = {"block": "Triton's tl.arange needs one", "page_size": "a key's page and slot are its index shifted and masked"}.get(
            "block" if s.key.startswith("block") else s.key, "Triton requires it")
        raise SpecError(f"{s.key} = {n} must be a power of two ({why})", s.value.span)
    return n


def _dim_setting(s: Setting, hi: int, paged: bool) -> int:
    """head_dim or value_dim: 16..256, wider (up to hi) with kv_layout = paged."""
    n = _number(s)
    if isinstance(n, int) and 256 < n and not paged:
        raise SpecError(f"{s.key} = {n} is out of range; expected 16..256 (up to {MAX_DECODE_HEAD_DIM if s.key == 'head_dim' else MAX_DECODE_VALUE_DIM} "
                        f"with kv_layout = paged, whose decode kernels take wider heads)", s.value.span)
    return _int_setting(s, 16, hi)


def _choice(s: Setting, options: tuple[str, ...]) -> str:
    w = _word(s)
    if w not in options:
        got = f" {w!r}" if w else ""
        raise SpecError(f"{s.key} must be one of: {_names(options)}; got{got or ' an expression'}" + (_suggest(w, options) if w else ""), s.value.span)
    return w


def _check_input(decl: InputDecl) -> None:
    if not _IDENT.match(decl.name) or decl.name in RESERVED:
        why = (f"names are at most {MAX_NAME} characters" if len(decl.name) > MAX_NAME and _IDENT.match(decl.name[:MAX_NAME])
               else "a reserved word" if decl.name in RESERVED else "not an identifier")
        raise SpecError(f"{_short(decl.name)!r} cannot name an input ({why})", decl.span)
    if decl.dtype not in INPUT_DTYPES:
        raise SpecError(f"input element type must be one of: {_names(INPUT_DTYPES)}; got {decl.dtype!r}" + _suggest(decl.dtype, INPUT_DTYPES), decl.dtype_span)
    for d in decl.dims:
        if isinstance(d, int) and d <= 0:
            raise SpecError(f"dimension sizes of {decl.name!r} must be positive, got {d}", decl.span)
        if isinstance(d, str) and not _IDENT.match(d):
            raise SpecError(f"bad dimension name {d!r}", decl.span)


def _check_arithmetic(e: Expr, scope: ex.Scope) -> None:
    """Refuse what has no value: a divisor that is always 0 (a constant zero, before folding hides where it
    was), and integer arithmetic that could leave int64 (ranges.py: index variables below 2**30, input reads
    anywhere in their element type). Innermost offender first."""
    for child in ex.children(e):
        _check_arithmetic(child, scope)
    if isinstance(e, Binary) and e.op in ("/", "//", "%"):
        divisor = fold(e.rhs, scope)
        if isinstance(divisor, Const) and divisor.value == 0:
            raise SpecError(f"division by zero: the divisor of `{e.op}` is always 0", e.rhs.span or e.span)
    if isinstance(e, (Const, Unary, Binary, Call)) and not ex.variables(e) and ex.typeof(e, scope) is not Type.BOOL:
        _check_constant(e, scope)
    if isinstance(e, (Unary, Binary, Call)) and ex.typeof(e, scope) is Type.INT:
        lo, hi = integer_range(e, scope.inputs)
        if not within((lo, hi), INT64):
            reads = [f"{r.input} ({scope.inputs[r.input].dtype})" for r in ex.input_reads(e)]
            why = f"index variables go up to 2**30, and {', '.join(reads)} may hold any value of its type" if reads else \
                "index variables and lengths go up to 2**30"
            raise SpecError(f"integer overflow: `{ex.format_expr(e)}` can reach {_power_of_two(lo if lo < INT64[0] else hi)}, "
                            f"beyond 64-bit integers ({why}); rewrite it, or declare narrower inputs", e.span)


FLOAT32_MAX = (2 - 2**-23) * 2**127
FLOAT32_TINY = 2**-126  # the smallest normal float32
LOG2E = 1.4426950408889634  # the kernels' exp2: a score's scale enters as scale * log2(e)


def _check_constant(e: Expr, scope: ex.Scope) -> None:
    """A constant expression is folded at compile time and becomes a literal of the kernel: it must have a value,
    and that value must be what the kernels and the reference both take it for: an int32, or 0.0 or a normal
    float32 (Triton types larger integers as unsigned or int64, and larger, smaller or NaN floats as float64)."""
    value = fold(e, scope)
    text = ex.format_expr(e)
    if not isinstance(value, Const):
        raise SpecError(f"constant expression `{text}` has no value (it overflows, or leaves its function's domain)", e.span)
    if value.type is Type.INT and not within((value.value, value.value), INT32):
        raise SpecError(f"constant expression `{text}` is {value.value}, which does not fit in 32 bits", e.span)
    if value.type is Type.FLOAT and value.value != 0 and not FLOAT32_TINY <= abs(value.value) <= FLOAT32_MAX:
        raise SpecError(f"constant expression `{text}` is {value.value!r}, outside float32's range (the kernels compute "
                        f"in float32; nonzero magnitudes from {FLOAT32_TINY:.4g} to {FLOAT32_MAX:.4g})", e.span)


def _power_of_two(n: int) -> str:
    """n as about +-2**k, for messages."""
    return f"{'-' if n < 0 else ''}2**{abs(n).bit_length() - 1}" if abs(n) > 2**20 else str(n)


def _expression(s: Setting, scope: ex.Scope, want: Type) -> Expr:
    t = ex.typeof(s.value, scope)
    _check_arithmetic(s.value, scope)
    if want is Type.BOOL and t is not Type.BOOL:
        raise SpecError(f"{s.key} must be a boolean expression (e.g. q_idx >= kv_idx), got {t.value}", s.value.span)
    if want is Type.FLOAT and t is Type.BOOL:
        what = "of `score`" if s.key == "score" else f"of {', '.join(sorted(scope.variables))} and the declared inputs"
        raise SpecError(f"{s.key} must be a number expression {what}, got bool", s.value.span)
    return fold(s.value, scope)


def build(parsed: ParsedSpec, text: str | None = None, filename: str | None = None) -> Spec:
    """Interpret and validate every setting. Errors carry the span of the offending value."""
    try:
        return _build(parsed, text, filename)
    except SpecError as err:
        raise err.with_source(text, filename) if text is not None else err


def _build(parsed: ParsedSpec, text: str | None, filename: str | None) -> Spec:
    if not _IDENT.match(parsed.name):
        why = f"names are at most {MAX_NAME} characters" if len(parsed.name) > MAX_NAME else "not an identifier"
        raise SpecError(f"bad attention name {_short(parsed.name)!r} ({why})", parsed.name_span)
    seen: dict[str, Setting] = {}
    for s in parsed.settings:
        if s.key not in SETTINGS:
            raise SpecError(f"unknown setting {s.key!r}{_suggest(s.key, SETTINGS)} (settings: {_names(SETTINGS)})", s.key_span)
        if s.key in seen:
            first = seen[s.key].key_span
            raise SpecError(f"{s.key} is set twice (first at line {first.line})", s.key_span)
        seen[s.key] = s

    inputs: dict[str, InputDecl] = {}
    for decl in parsed.inputs:
        _check_input(decl)
        if decl.name in inputs:
            raise SpecError(f"input {decl.name!r} is declared twice", decl.span)
        inputs[decl.name] = decl

    if "head_dim" not in seen:
        raise SpecError("head_dim is required (an integer in 16..256), e.g. `head_dim = 128`", parsed.name_span)
    # a paged cache is read by the decode kernels only, which take wider heads: DeepSeek's latent attention
    # (MLA, absorbed) decodes over 576 columns a token, V being the first 512 of them
    paged = "kv_layout" in seen and _word(seen["kv_layout"]) == KVLayout.PAGED.value
    values: dict = {"head_dim": _dim_setting(seen["head_dim"], MAX_DECODE_HEAD_DIM if paged else 256, paged)}
    if "value_dim" in seen:  # V's and O's last dimension where it differs from q's and k's (DeepSeek's 192 / 128)
        value_dim = _dim_setting(seen["value_dim"], MAX_DECODE_VALUE_DIM if paged else 256, paged)
        if value_dim != values["head_dim"]:
            values["value_dim"] = value_dim
    d, dv = values["head_dim"], values.get("value_dim", values["head_dim"])
    if d > 256 and (dv & (dv - 1) or dv >= d or d - dv > 256):
        # the decode kernels read such a K as two parts, its first value_dim columns (which V may share) and the rest
        raise SpecError(f"head_dim = {d} (above 256) needs a value_dim that is a power of two below it, with at most 256 "
                        f"columns left over (the decode kernels read K as its first value_dim columns and the rest), e.g. "
                        f"head_dim = 576 with value_dim = 512", seen["head_dim"].value.span)

    if "dtype" in seen:
        values["dtype"] = DType(_choice(seen["dtype"], tuple(d.value for d in DType)))
    if "scale" in seen:
        s = seen["scale"]
        if _word(s) != "auto":
            n = _number(s)
            if n is None or not (0 < float(n) < float("inf")):
                raise SpecError("scale must be a positive number or auto (1/sqrt(head_dim))", s.value.span)
            if not FLOAT32_TINY <= float(n) * LOG2E <= FLOAT32_MAX:  # the kernels fold scale * log2(e) into one float32
                raise SpecError(f"scale = {n} is outside float32's range once multiplied by log2(e), as the kernels use it "
                                f"(from {FLOAT32_TINY / LOG2E:.4g} to {FLOAT32_MAX / LOG2E:.4g})", s.value.span)
            values["scale"] = float(n)
    if "dropout" in seen:
        s = seen["dropout"]
        n = _number(s)
        if n is None or not 0.0 <= float(n) < 1.0:
            raise SpecError("dropout must be a probability in [0, 1)", s.value.span)
        values["dropout"] = float(n)
    if "sparse_block" in seen:
        values["sparse_block"] = _int_setting(seen["sparse_block"], 16, 1 << 16, power_of_two=True)
    if "loop_order" in seen:
        values["loop_order"] = LoopOrder(_choice(seen["loop_order"], tuple(o.value for o in LoopOrder)))
    if "target" in seen:
        values["target"] = _choice(seen["target"], ("auto",) + tuple(TARGETS))
    if "backend" in seen:
        values["backend"] = Backend(_choice(seen["backend"], tuple(b.value for b in Backend)))
    if "deterministic" in seen:
        s = seen["deterministic"]
        if not (isinstance(s.value, Const) and s.value.type is Type.BOOL):
            raise SpecError("deterministic must be true or false", s.value.span)
        values["deterministic"] = bool(s.value.value)
    if "kv_layout" in seen:
        values["kv_layout"] = KVLayout(_choice(seen["kv_layout"], tuple(k.value for k in KVLayout)))
    if "page_size" in seen:
        if values.get("kv_layout") is not KVLayout.PAGED:
            raise SpecError("page_size goes with kv_layout = paged (the keys and values in pages of a cache)", seen["page_size"].key_span)
        values["page_size"] = _int_setting(seen["page_size"], 16, 256, power_of_two=True)
    if "kv_dtype" in seen:
        values["kv_dtype"] = DType(_choice(seen["kv_dtype"], ("fp8",)))
        if values.get("dtype", DType.BF16) not in (DType.BF16, DType.FP16):
            raise SpecError(f"kv_dtype = fp8 (e4m3 key/value caches) goes with dtype = bf16 or fp16 (the queries and the output); "
                            f"got dtype = {values['dtype'].value}", seen["kv_dtype"].key_span)
    if "value_dim" in values:
        for key, bad in (("dtype", values.get("dtype") is DType.FP8), ("kv_dtype", values.get("kv_dtype") is DType.FP8)):
            if bad:
                raise SpecError(f"value_dim cannot go with {key} = fp8 yet (the FP8 kernels read V as wide as K)", seen["value_dim"].key_span)
    tune = set()
    for key, lo, hi, pow2 in (("block_m", 16, 256, True), ("block_n", 16, 256, True), ("num_warps", 1, 16, True), ("num_stages", 1, 8, False)):
        if key in seen:
            values[key] = _int_setting(seen[key], lo, hi, allow_auto=True, power_of_two=pow2)
            if values[key] is None:
                tune.add(key)
    values["tune"] = frozenset(tune)

    if "mask" in seen:
        scope = ex.Scope("mask", ex.MASK_VARS, inputs)
        mask = _expression(seen["mask"], scope, Type.BOOL)
        values["mask"] = None if mask == Const(True, Type.BOOL) else mask
    if "score" in seen:
        scope = ex.Scope("score", ex.SCORE_VARS, inputs)
        score = _expression(seen["score"], scope, Type.FLOAT)
        if ex.typeof(score, scope) is Type.INT:
            raise SpecError("score must be a float expression; an integer score makes every key equal or unrelated to q.k", seen["score"].value.span)
        values["score"] = None if score == Var("score") else score
    if "sink" in seen:  # one logit per query row: it may read b, h, q_idx, the lengths and inputs, not a key or a score
        values["sink"] = _expression(seen["sink"], ex.Scope("sink", ex.SINK_VARS, inputs), Type.FLOAT)
        for key, bad, why in (("dtype", values.get("dtype") is DType.FP8, "the FP8 kernels have none"),):
            if bad:
                raise SpecError(f"a sink cannot go with {key} = {_word(seen[key])} yet ({why})", seen["sink"].key_span)
    if "sparsity" in seen:
        s = seen["sparsity"]
        w = _word(s)
        if w == "none":
            pass
        elif w == "runtime":
            values["sparsity"] = "runtime"
        else:
            scope = ex.Scope("sparsity", ex.SPARSITY_VARS, {})
            sp = _expression(s, scope, Type.BOOL)
            values["sparsity"] = None if sp == Const(True, Type.BOOL) else sp

    serving = [f"{k} = {v}" for k, v, on in (("kv_layout", "paged", values.get("kv_layout") is KVLayout.PAGED),
                                             ("kv_dtype", "fp8", values.get("kv_dtype") is DType.FP8)) if on]
    if serving:  # a serving cache: the decode kernels, forward only
        what = serving[0]
        for key, bad, why in (("dropout", values.get("dropout", 0.0) > 0.0, "its caches are read by the forward only (serving)"),
                              ("sparsity", values.get("sparsity") == "runtime", "runtime block masks are not read by the decode kernels"),
                              ("loop_order", values.get("loop_order") is LoopOrder.KV_OUTER, "its caches are read by the decode kernels, which "
                                                                                                  "split the keys themselves")):
            if bad:
                raise SpecError(f"{key} cannot go with {what}: {why}", seen[key].key_span)
    return Spec(name=parsed.name, inputs=tuple(inputs.values()), text=text, filename=filename, **values)


def load_spec(text: str, filename: str | None = None) -> Spec:
    """Parse and check spec text."""
    return build(parse(text, filename), text, filename)


def _looks_like_text(spec: str) -> bool:
    """Spec text rather than a path: not the name of an existing file (a path may hold braces or spaces), and
    it starts with the keyword `attention` and a space (after comments and blank lines) or holds a `{`."""
    try:
        if "\n" not in spec and Path(spec).is_file():
            return False
    except (OSError, ValueError):  # too long or not a path at all
        return True
    body = "\n".join(line for line in spec.splitlines() if not line.lstrip().startswith("#")).lstrip()
    return "{" in spec or (body.startswith("attention") and len(body) > 9 and body[9].isspace())


def read_spec(spec: Spec | str | os.PathLike) -> Spec:
    """A Spec from a Spec, a path to a .attn file, or spec text."""
    if isinstance(spec, Spec):
        return spec
    if not isinstance(spec, (str, os.PathLike)):
        raise AttngenError(f"a spec is a Spec, spec text or the path of a .attn file; got {type(spec).__name__}")
    if isinstance(spec, os.PathLike) or not _looks_like_text(spec):
        path = Path(spec)
        try:
            text = path.read_text(encoding="utf-8")
        except FileNotFoundError:
            raise AttngenError(f"no such spec file: {path}") from None
        except (OSError, UnicodeDecodeError) as err:
            raise AttngenError(f"cannot read spec file {path}: {err}") from None
        return load_spec(text, str(path))
    return load_spec(str(spec), "<string>")
