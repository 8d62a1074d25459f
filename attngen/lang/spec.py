"""The typed, frozen form of a spec: settings, declared inputs and expression trees.

No torch and no triton here: everything downstream (check, plan, render, reference) reads these
values. Spans are kept for error messages but take no part in equality or hashing.
"""
from __future__ import annotations

import enum
from dataclasses import dataclass, field

from ..errors import Span


class DType(enum.Enum):
    FP16 = "fp16"
    BF16 = "bf16"
    FP32 = "fp32"
    FP8 = "fp8"  # e4m3 q, k, v with float32 descale factors given at call time; O in bf16; forward only

    @property
    def itemsize(self) -> int:
        return {"fp32": 4, "fp8": 1}.get(self.value, 2)

    @property
    def torch_name(self) -> str:
        return {"fp16": "float16", "bf16": "bfloat16", "fp32": "float32", "fp8": "float8_e4m3fn"}[self.value]


class LoopOrder(enum.Enum):
    Q_OUTER = "q_outer"  # FlashAttention-2: one program per query tile, loop over key tiles
    KV_OUTER = "kv_outer"  # FlashAttention-1, Algorithm 1: outer loop over key tiles, inner over query tiles


class Backend(enum.Enum):
    """Which code generator renders the kernels: auto picks Gluon where the target is sm_90 and the generator
    supports the spec (attngen/codegen/gluon), the portable Triton generator everywhere else."""

    AUTO = "auto"
    TRITON = "triton"
    GLUON = "gluon"


class KVLayout(enum.Enum):
    """How the keys and values are laid out: one (B, Hkv, Nk, D) tensor each, or pages of a cache shared by every
    sequence, (num_pages, page_size, Hkv, D), found through a block table (vLLM's layout; forward only)."""

    CONTIGUOUS = "contiguous"
    PAGED = "paged"


class Type(enum.Enum):
    INT = "int"
    FLOAT = "float"
    BOOL = "bool"


# Element types an `input` may declare, and the expression type their elements have.
INPUT_DTYPES: dict[str, Type] = {
    "bool": Type.BOOL,
    "int8": Type.INT,
    "int16": Type.INT,
    "int32": Type.INT,
    "int64": Type.INT,
    "fp16": Type.FLOAT,
    "bf16": Type.FLOAT,
    "fp32": Type.FLOAT,
}


# ---- expression nodes ---------------------------------------------------------------------------
def _span() -> Span | None:
    return field(default=None, compare=False, repr=False)


@dataclass(frozen=True)
class Expr:
    pass


@dataclass(frozen=True)
class Const(Expr):
    value: int | float | bool
    type: Type
    span: Span | None = _span()


@dataclass(frozen=True)
class Var(Expr):
    name: str
    span: Span | None = _span()


@dataclass(frozen=True)
class Unary(Expr):
    op: str  # "-" | "not"
    operand: Expr
    span: Span | None = _span()


@dataclass(frozen=True)
class Binary(Expr):
    op: str  # + - * / // % and or < <= > >= == !=
    lhs: Expr
    rhs: Expr
    span: Span | None = _span()


@dataclass(frozen=True)
class Call(Expr):
    func: str
    args: tuple[Expr, ...]
    span: Span | None = _span()


@dataclass(frozen=True)
class Index(Expr):
    input: str
    indices: tuple[Expr, ...]
    span: Span | None = _span()


ARITH_OPS = ("+", "-", "*", "/", "//", "%")
COMPARE_OPS = ("<", "<=", ">", ">=", "==", "!=")
BOOL_OPS = ("and", "or")
BIT_OPS = ("&", "|", "^")  # integers: bitwise; `&` and `|` on booleans mean `and` and `or` (folded to them)


# ---- the spec -----------------------------------------------------------------------------------
@dataclass(frozen=True)
class InputDecl:
    """`input doc: int32[B, N]`: a runtime tensor the expressions may index."""

    name: str
    dtype: str  # a key of INPUT_DTYPES
    dims: tuple[str | int, ...]
    span: Span | None = _span()
    dtype_span: Span | None = _span()

    @property
    def type(self) -> Type:
        return INPUT_DTYPES[self.dtype]


@dataclass(frozen=True)
class Spec:
    name: str
    head_dim: int
    dtype: DType = DType.BF16
    value_dim: int | None = None  # V's and O's last dimension; None: head_dim (see Spec.dv)
    scale: float | None = None  # None: 1/sqrt(head_dim)
    mask: Expr | None = None  # None: keep every pair
    score: Expr | None = None  # None: the scaled q.k unchanged
    # one more logit in each query row's softmax, with no value (gpt-oss's learnable sinks), natural-log units like
    # score; an expression of b, h, q_idx, the lengths and declared inputs. None: no sink
    sink: Expr | None = None
    dropout: float = 0.0
    sparsity: Expr | str | None = None  # None | "runtime" | boolean expression of q_blk, kv_blk
    sparse_block: int = 128
    loop_order: LoopOrder = LoopOrder.Q_OUTER
    target: str = "auto"
    backend: Backend = Backend.AUTO
    # false: the backward may sum dQ across key tiles in an unfixed order (atomic additions; faster where
    # measured so), so its last bits may differ between runs. true: every gradient is bit-reproducible.
    deterministic: bool = True
    kv_layout: KVLayout = KVLayout.CONTIGUOUS
    page_size: int = 16  # tokens per page of a paged cache (kv_layout = paged)
    # the key/value caches' element type where it differs from `dtype` (FP8: e4m3 caches with float32 descale factors;
    # every call runs the decode kernels, forward only); None: `dtype`
    kv_dtype: DType | None = None
    # Tiles and launch options of the forward kernel: an int fixes the value; None derives it from the target
    # (attngen/plan/planner.py). A key in `tune` was written `auto`: measured per shape on the GPU (attngen/plan/tune.py).
    block_m: int | None = None
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    tune: frozenset[str] = frozenset()
    inputs: tuple[InputDecl, ...] = ()
    # Where the spec came from (for error messages); not part of its meaning.
    text: str | None = field(default=None, compare=False, repr=False)
    filename: str | None = field(default=None, compare=False, repr=False)

    @property
    def inputs_by_name(self) -> dict[str, InputDecl]:
        return {decl.name: decl for decl in self.inputs}

    @property
    def dv(self) -> int:
        """The last dimension of V and O: value_dim where the spec sets one, head_dim otherwise."""
        return self.value_dim or self.head_dim

    @property
    def softmax_scale(self) -> float:
        return self.scale if self.scale is not None else self.head_dim ** -0.5
