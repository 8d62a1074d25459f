"""The spec's expressions lowered for one kernel of any generator: the same code fragments (attngen/codegen/expr.py)
for the Triton templates and, translated name by name, for the Gluon ones."""
from __future__ import annotations

from dataclasses import dataclass

from ..lang import expr as ex
from ..lang.analysis import affine_in, separable_bias
from ..lang.spec import Binary, DType, Type, Var
from ..plan.planner import KernelPlan
from .expr import Lowerer


@dataclass(frozen=True)
class KernelCode:
    """The spec's expressions lowered for one kernel."""

    outer: list[str]
    inner: list[str]
    mask: str
    score: str
    dscore: str
    read_grads: list["ReadGradCode"]

    @property
    def has_uniform_grads(self) -> bool:
        return any(g.kind == "uniform" for g in self.read_grads)


@dataclass(frozen=True)
class ReadGradCode:
    """One input read the dQ kernel differentiates: its kind (plan.ReadGrad) and d score / d read as code."""

    read: str  # the read in the spec language, for comments
    kind: str
    derivative: str


def lower_for_kernel(plan: KernelPlan, inner_vars: frozenset[str], want_dscore: bool, helpers: set[str],
                      want_read_grads: bool = False, global_positions: bool = False, positions_leafwise: bool = False,
                      want_score: bool = True) -> KernelCode:
    """global_positions: the kernel is a context-parallel shard's (KernelPlan.global_positions), where the
    expressions' q_len and kv_len are the whole sequence's, seq_q_len and seq_kv_len (q_len and kv_len are the
    shard's rows), and h is the query head in the whole tensor, h + h_offset (the shard's heads are a slice of
    them under head-parallel methods; its inputs are whole). positions_leafwise: sums of positions converted to float leaf by leaf (expr.FLOAT_POSITIONS;
    the kernel is then exact for lengths of at most FLOAT_POSITIONS only). want_score=False: the mask alone (a
    kernel that adds a separable bias instead: lower_bias)."""
    spec = plan.spec
    scope = ex.Scope("score", ex.SCORE_VARS, spec.inputs_by_name)
    names = {v: v for v in ex.SCORE_VARS}
    if global_positions:
        names |= {"q_len": "seq_q_len", "kv_len": "seq_kv_len", "h": "(h + h_offset)"}
    lowerer = Lowerer(scope, names, inner_vars, positions_leafwise=positions_leafwise)
    grads = list(plan.read_grads) if want_read_grads else []
    scored = plan.score is not None and want_score
    exprs = [e for e in (plan.mask, plan.score if scored else None, plan.dscore if want_dscore and scored else None) if e is not None]
    lowered = lowerer.lower_all(exprs + [g.derivative for g in grads])
    helpers |= lowerer.helpers
    codes = iter(lowered.exprs)
    mask = next(codes) if plan.mask is not None else ""
    score = next(codes) if scored else ""
    dscore = next(codes) if scored and want_dscore else ""
    read_grads = [ReadGradCode(ex.format_expr(g.read), g.kind, next(codes)) for g in grads]
    return KernelCode(lowered.outer, lowered.inner, mask, score, dscore, read_grads)


@dataclass(frozen=True)
class SinkCode:
    """The sink lowered for a forward kernel: statements to run once per program, then the expression, one value
    per query row (row_var holds the rows' q_idx) or one for the program."""

    stmts: list[str]
    code: str


def lower_sink(plan: KernelPlan, row_var: str, helpers: set[str]) -> SinkCode | None:
    """The spec's sink (natural-log units) as code of b, h, the rows' positions `row_var`, the lengths and the
    declared inputs; None for a spec without one."""
    if plan.spec.sink is None:
        return None
    scope = ex.Scope("sink", ex.SINK_VARS, plan.spec.inputs_by_name)
    names = {v: v for v in ex.SINK_VARS} | {"q_idx": row_var}
    lowerer = Lowerer(scope, names, frozenset(), prefix="sink_")  # its temporaries apart from the score's
    code = lowerer.lower(plan.spec.sink, want=Type.FLOAT)
    helpers |= lowerer.helpers
    return SinkCode(lowerer.outer + lowerer.inner, code)


def converts_positions(plan: KernelPlan) -> bool:
    """Whether code lowered with positions_leafwise (the Gluon backward's) converts sums of positions to float leaf
    by leaf, exact for lengths of at most expr.FLOAT_POSITIONS only: longer calls take the Triton backward then.
    (A separable bias is lowered by lower_bias, without: only the mask counts then.)"""
    scope = ex.Scope("score", ex.SCORE_VARS, plan.spec.inputs_by_name)
    lowerer = Lowerer(scope, {v: v for v in ex.SCORE_VARS}, frozenset(), positions_leafwise=True)
    scored = bias_of(plan) is None
    lowerer.lower_all([e for e in (plan.mask, plan.score if scored else None, plan.dscore if scored else None) if e is not None])
    return lowerer.positions_in_float


def bias_of(plan: KernelPlan) -> ex.Expr | None:
    """L where the Gluon kernels add the plan's score modification as a separable bias (expr.separable_bias):
    score + L, with neither FP8 scales (the score is q.k times a block's factors there) nor a context-parallel
    shard's positions (its rows are offsets into the whole sequence); None where they lower it per score."""
    spec = plan.spec
    if plan.score is None or spec.dtype is DType.FP8 or plan.global_positions:
        return None
    return separable_bias(plan.score, ex.Scope("score", ex.SCORE_VARS, spec.inputs_by_name))


@dataclass(frozen=True)
class BiasCode:
    """One part of a separable bias score + L lowered for one kernel (lower_bias): statements before the kernel's
    loop (outer) and inside it (inner), and the part's value."""

    outer: list[str]
    inner: list[str]
    code: str


def key_part_affine(plan: KernelPlan) -> bool:
    """Whether the separable bias's key part L(r, kv_idx) is affine in kv_idx (ALiBi's): then a tile's key part is
    its first key's value plus a vector of the offsets in a tile, the same for every tile (lower_bias's parts
    "tile" and "step")."""
    bias = bias_of(plan)
    return bias is not None and affine_in(bias, "kv_idx")


def bias_part(bias: ex.Expr, part: str) -> tuple[ex.Expr, dict[str, str]]:
    """A part of a separable bias L (expr.separable_bias) as an expression, with the roles of its index variables:
    "ref" (the kernel's ref row r) or "rows" (the part's own index code). Part "key": L(r, kv_idx), what a kernel
    adds to the scaled products (a vector of the keys); "row": L(q, r) - L(r, r), each row's constant, which the
    softmax does not see and the log-sum-exp holds (`rows`: q); where the key part is affine in kv_idx
    (key_part_affine), "tile": L(r, kv_lo) (`rows`: a tile's first key) and "step": L(r, r + off) - L(r, r)
    (`rows`: the offsets of a tile's keys), whose sum is the key part of key kv_lo + off. Every index difference
    stays an exact integer, so nothing large cancels."""
    if part == "key":
        return bias, {"q_idx": "ref"}
    if part == "tile":
        return bias, {"q_idx": "ref", "kv_idx": "rows"}
    if part == "step":  # q_idx is the ref row, kv_idx the offsets
        shifted = ex.substitute(bias, {"kv_idx": Binary("+", Var("q_idx"), Var("kv_idx"))})
        return Binary("-", shifted, ex.substitute(bias, {"kv_idx": Var("q_idx")})), {"q_idx": "ref", "kv_idx": "rows"}
    assert part == "row", part
    # kv_idx is the ref row, and the second term reads q_idx there too
    return Binary("-", bias, ex.substitute(bias, {"q_idx": Var("kv_idx")})), {"q_idx": "rows", "kv_idx": "ref"}


def lower_bias(plan: KernelPlan, part: str, rows: str, ref: str, inner_vars: frozenset[str], helpers: set[str],
               prefix: str) -> BiasCode:
    """Part `part` of the separable bias of bias_of(plan) (see bias_part) for a kernel whose ref row is the code
    `ref` and whose part's own index is the code `rows`. Temporaries are named with `prefix` (apart from the
    mask's)."""
    bias = bias_of(plan)
    assert bias is not None, "lower_bias without a separable bias"
    scope = ex.Scope("score", ex.SCORE_VARS, plan.spec.inputs_by_name)
    expr, roles = bias_part(bias, part)
    names = {v: v for v in ex.SCORE_VARS} | {v: {"ref": ref, "rows": rows}[role] for v, role in roles.items()}
    lowerer = Lowerer(scope, names, inner_vars, prefix=prefix)
    lowered = lowerer.lower_all([expr])
    helpers |= lowerer.helpers
    code = lowered.exprs[0]
    if ex.typeof(expr, scope) is not Type.FLOAT:
        code = f"({code}).to(tl.float32)"
    return BiasCode(lowered.outer, lowered.inner, code)
