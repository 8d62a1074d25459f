"""Expression code for Gluon kernels. attngen/codegen/expr.py lowers the spec's expressions to Triton code (`tl.`);
Gluon's language (`gl.`) has the same elementwise operations under other names. The names are translated
one by one from a closed table: a name outside it raises Untranslatable, and the spec falls back to the Triton
generator with that reason, so nothing unreviewed reaches a Gluon kernel."""
from __future__ import annotations

import re

from ..expr import HELPERS

# Triton name -> Gluon name (the same operation: elementwise, IEEE-rounded where the Triton one is)
NAMES = {
    "tl.where": "gl.where",
    "tl.minimum": "gl.minimum",
    "tl.maximum": "gl.maximum",
    "tl.abs": "gl.abs",
    "tl.math.floor": "gl.floor",
    "tl.math.div_rn": "gl.div_rn",
    "tl.math.exp": "gl.exp",
    "tl.math.exp2": "gl.exp2",
    "tl.exp": "gl.exp",
    "tl.log": "gl.log",
    "tl.sqrt": "gl.sqrt",
    "tl.zeros_like": "gl.zeros_like",
    "tl.cdiv": "gl.cdiv",
    "tl.load": "gl.load",  # an input read: its pointers carry the layout of the indices they are computed from
    "tl.int1": "gl.int1",
    "tl.int8": "gl.int8",
    "tl.int16": "gl.int16",
    "tl.int32": "gl.int32",
    "tl.int64": "gl.int64",
    "tl.float32": "gl.float32",
    "tl.PropagateNan.ALL": "tl.PropagateNan.ALL",  # an enum value (Gluon's minimum/maximum take it as a constexpr)
    "triton.jit": "gluon.jit",
}
_NAME = re.compile(r"\b(?:tl|triton)(?:\.[A-Za-z_][A-Za-z0-9_]*)+")


class Untranslatable(Exception):
    """Code that uses a Triton name with no Gluon counterpart in NAMES (e.g. tl.load of an input, tl.sigmoid)."""


def translate(code: str) -> str:
    def one(m: re.Match) -> str:
        name = m.group(0)
        if name not in NAMES:
            raise Untranslatable(f"{name} has no Gluon counterpart here yet")
        return NAMES[name]

    return _NAME.sub(one, code)


def helpers(names: set[str]) -> list[str]:
    """The Gluon definitions of codegen/expr.py's helper functions (_floordiv, _tanh, ...)."""
    return [translate(HELPERS[h]) for h in sorted(names)]
