"""A kernel's twins: the same spec's kernels built for another use. A bf16 spec's calls on CPU tensors run float32
kernels (Triton's interpreter has no bf16 arithmetic); a context-parallel shard runs kernels that see global
positions. A twin is a Kernel of the same class, built just in time (also for a kernel loaded from a bundle)."""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..codegen.gluon import build_source as build_gluon_source
from ..codegen.gluon import plan_gluon
from ..codegen.triton import build_source
from ..errors import PlanError
from ..lang.spec import DType, LoopOrder
from ..plan.planner import plan as make_plan
from .loader import load_module


def up(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """bf16 tensors as float32 (the CPU path of bf16 specs, see Kernel._twin); the others as they are."""
    return [t.float() if t.dtype == torch.bfloat16 else t for t in tensors]


def float32_twin(kernel):
    """The same spec with float32 elements (bf16 inputs declared fp32), planned for the same target: what a bf16
    kernel runs on the CPU interpreter. The interpreter ignores on-chip memory, so where the spec's fixed tiles
    do not fit float32 on the target, the twin takes the derived ones (tiles never change results)."""
    spec = kernel.spec
    inputs = tuple(dataclasses.replace(d, dtype="fp32") if d.dtype == "bf16" else d for d in spec.inputs)
    twin = dataclasses.replace(spec, dtype=DType.FP32, inputs=inputs)
    try:
        twin_plan = make_plan(twin, kernel.plan.target, classify=kernel.plan.classify)
    except PlanError:
        twin = dataclasses.replace(twin, block_m=None, block_n=None, num_warps=None, num_stages=None, tune=frozenset())
        twin_plan = make_plan(twin, kernel.plan.target, classify=kernel.plan.classify)
    twin_plan = dataclasses.replace(twin_plan, global_positions=kernel.plan.global_positions)
    key, source = build_source(twin_plan)
    module = load_module(twin.name, key, source)
    return type(kernel)(twin, twin_plan, source, Path(module.__file__), module)


def positions_twin(kernel):
    """The same spec's kernels with global positions (KernelPlan.global_positions), for context-parallel shards:
    the Triton generator's, and the Gluon generator's where the kernel's choice of generators took it (the same
    choice for each pass). loop_order = kv_outer is planned q_outer (its forward has no positions; results
    differ by rounding); a sink is left out (attngen/distributed/ring.py joins it to the merged rows)."""
    spec = kernel.spec
    if spec.loop_order is not LoopOrder.Q_OUTER:
        spec = dataclasses.replace(spec, loop_order=LoopOrder.Q_OUTER)
    if spec.sink is not None:  # each shard's partial softmax would count it: the ring adds it once to the merged rows
        spec = dataclasses.replace(spec, sink=None)
    twin_plan = dataclasses.replace(make_plan(spec, kernel.plan.target, classify=kernel.plan.classify), global_positions=True)
    key, source = build_source(twin_plan)
    module = load_module(spec.name, key, source)
    twin = type(kernel)(spec, twin_plan, source, Path(module.__file__), module)
    if kernel.generator.gluon is not None:
        gp = plan_gluon(twin_plan)
        twin.generator = dataclasses.replace(kernel.generator, gluon=gp)
        key, twin.gluon_source = build_gluon_source(gp)
        twin.gluon = load_module(f"{spec.name}_gluon", key, twin.gluon_source)
    return twin
