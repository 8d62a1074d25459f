"""The Hopper generator: Gluon kernels (triton.experimental.gluon) with FlashAttention-3's schedule for sm_90.
It renders the forward; the backward stays the Triton generator's. `plan.choose` decides per spec and target."""
from .plan import Choice, GluonPlan, choose, plan_gluon, unsupported
from .render import build_source, render

__all__ = ["Choice", "GluonPlan", "build_source", "choose", "plan_gluon", "render", "unsupported"]
