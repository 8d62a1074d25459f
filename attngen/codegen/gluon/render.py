"""render(gluon plan) -> the source of a Gluon module (the forward with FlashAttention-3's schedule), from the
templates in templates/gluon/. The expressions are expr.py's, lowered for the Triton generator's q-outer forward
(the same fragments), their names translated by lower.py."""
from __future__ import annotations

from dataclasses import dataclass

from ... import expr as ex
from ...canonical import format_spec
from ...spec import DType
from ...intervals import lower_tile_class
from .. import Templates, versions
from ..lowering import KernelCode, lower_for_kernel
from .lower import helpers as gluon_helpers
from .lower import Untranslatable, translate
from .plan import M_PER_WARPGROUP, REGISTERS_PER_SM, GluonPlan

LOG2E = 1.4426950408889634
TEMPLATES = Templates("gluon", "module.py.jinja")


@dataclass(frozen=True)
class _Input:
    name: str
    dtype: str
    ndim: int


def context(gp: GluonPlan) -> dict:
    """Everything the template sees. Raises lower.Untranslatable for code with no Gluon counterpart."""
    plan = gp.base
    spec = plan.spec
    helpers: set[str] = set()
    pos = plan.global_positions  # a context-parallel shard's kernels: the expressions see the whole sequence's lengths
    fwd = lower_for_kernel(plan, frozenset({"kv_idx", "score"}), False, helpers, global_positions=pos)
    dkdv = lower_for_kernel(plan, frozenset({"q_idx", "h", "score"}), True, helpers, global_positions=pos)  # as the Triton dK/dV kernel's
    tile_class = None
    if plan.mask is not None and plan.classify:
        tile_class = lower_tile_class(plan.mask, ex.Scope("mask", ex.MASK_VARS, spec.inputs_by_name))
        if tile_class is not None:
            if tile_class.bounds:
                raise Untranslatable("tile classes from the inputs' per-chunk bounds (the pre-pass) are not ported to Gluon yet")
            helpers |= tile_class.helpers
            tile_class = type(tile_class)([translate(s) for s in tile_class.stmts], translate(tile_class.may_drop),
                                          translate(tile_class.may_keep), tile_class.helpers, tile_class.params, tile_class.bounds)
    return {
        "name": spec.name,
        "spec_hash": plan.spec_hash,
        "spec_lines": format_spec(spec).splitlines(),
        "versions": versions(),
        "target": plan.target,
        "plan": plan,
        "gp": gp,
        "m_per_wg": M_PER_WARPGROUP,
        "maxnreg": REGISTERS_PER_SM // (3 * 128) // 8 * 8,
        "scale": repr(float(plan.scale)),
        "qk_scale_log2": repr(float(plan.scale) * LOG2E),
        "has_mask": plan.mask is not None,
        "has_score": plan.score is not None,
        "has_dropout": spec.dropout > 0.0,
        "deterministic": spec.deterministic,  # dQ's additions in a fixed order
        "guard_rows": plan.may_mask_rows,
        "positions": pos,
        "fp8": spec.dtype is DType.FP8,
        # what a shard's kernels add to the row and key indices to make them positions in the whole sequence
        "q_pos": " + q_offset" if pos else "",
        "kv_pos": " + kv_offset" if pos else "",
        "mask": translate(fwd.mask),
        "score": translate(fwd.score),
        "inner": [translate(s) for s in fwd.inner],
        "outer": [translate(s) for s in fwd.outer],
        "helpers": gluon_helpers(helpers),
        "tile_class": tile_class,
        "skip_empty": gp.skip_empty and tile_class is not None,  # the forward skips the holes of a block pattern
        "inputs": [_Input(i.name, i.dtype, len(i.dims)) for i in spec.inputs],
        "dkdv": KernelCode([translate(s) for s in dkdv.outer], [translate(s) for s in dkdv.inner], translate(dkdv.mask),
                           translate(dkdv.score), translate(dkdv.dscore), []),
    }


def render(gp: GluonPlan) -> str:
    return TEMPLATES.render("module.py.jinja", context(gp))


def build_source(gp: GluonPlan) -> tuple[str, str]:
    """(cache key, generated source): the key covers the spec, both plans, the Gluon templates and the versions."""
    from ...cache import cache_key

    source = render(gp)
    ver = versions()
    key = cache_key("gluon", format_spec(gp.base.spec), repr(gp), TEMPLATES.digest(), ver["attngen"], ver["triton"], ver["torch"])
    return key, source
