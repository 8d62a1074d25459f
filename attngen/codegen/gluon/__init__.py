"""The Hopper generator: Gluon kernels (triton.experimental.gluon) with FlashAttention-3's schedule for sm_90,
forward and backward. `choice.choose` decides per spec and target which generator renders each pass;
plan.py sizes the schedules, render.py renders them (through the name table of lower.py)."""
from .choice import Choice, choose
from .plan import GluonPlan, plan_gluon, unsupported
from .render import build_source, render

__all__ = ["Choice", "GluonPlan", "build_source", "choose", "plan_gluon", "render", "unsupported"]
