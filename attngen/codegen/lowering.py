"""The spec's expressions lowered for one kernel of any generator: the same code fragments (attngen/expr.py)
for the Triton templates and, translated name by name, for the Gluon ones."""
from __future__ import annotations

from dataclasses import dataclass

from .. import expr as ex
from ..plan import KernelPlan


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
                      want_read_grads: bool = False, global_positions: bool = False, positions_leafwise: bool = False) -> KernelCode:
    """global_positions: the kernel is a context-parallel shard's (KernelPlan.global_positions), where the
    expressions' q_len and kv_len are the whole sequence's, seq_q_len and seq_kv_len (q_len and kv_len are the
    shard's rows). positions_leafwise: sums of positions converted to float leaf by leaf (expr.FLOAT_POSITIONS;
    the kernel is then exact for lengths of at most FLOAT_POSITIONS only)."""
    spec = plan.spec
    scope = ex.Scope("score", ex.SCORE_VARS, spec.inputs_by_name)
    names = {v: v for v in ex.SCORE_VARS}
    if global_positions:
        names |= {"q_len": "seq_q_len", "kv_len": "seq_kv_len"}
    lowerer = ex.Lowerer(scope, names, inner_vars, positions_leafwise=positions_leafwise)
    grads = list(plan.read_grads) if want_read_grads else []
    exprs = [e for e in (plan.mask, plan.score, plan.dscore if want_dscore else None) if e is not None]
    lowered = lowerer.lower_all(exprs + [g.derivative for g in grads])
    helpers |= lowerer.helpers
    codes = iter(lowered.exprs)
    mask = next(codes) if plan.mask is not None else ""
    score = next(codes) if plan.score is not None else ""
    dscore = next(codes) if plan.score is not None and want_dscore else ""
    read_grads = [ReadGradCode(ex.format_expr(g.read), g.kind, next(codes)) for g in grads]
    return KernelCode(lowered.outer, lowered.inner, mask, score, dscore, read_grads)


def converts_positions(plan: KernelPlan) -> bool:
    """Whether code lowered with positions_leafwise (the Gluon backward's) converts sums of positions to float leaf
    by leaf, exact for lengths of at most expr.FLOAT_POSITIONS only: longer calls take the Triton backward then."""
    scope = ex.Scope("score", ex.SCORE_VARS, plan.spec.inputs_by_name)
    lowerer = ex.Lowerer(scope, {v: v for v in ex.SCORE_VARS}, frozenset(), positions_leafwise=True)
    lowerer.lower_all([e for e in (plan.mask, plan.score, plan.dscore) if e is not None])
    return lowerer.positions_in_float
