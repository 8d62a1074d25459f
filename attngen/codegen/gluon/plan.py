"""The Gluon generator's plan: which specs it renders (and, for the others, why not), and the sizes of its
FlashAttention-3 schedule, derived from the target like the Triton generator's tiles (attngen/plan.py).

The forward is warp-specialized: a load partition (one warp; Gluon pads it to a warpgroup) streams K and V
tiles by TMA into a ring of shared-memory stages, and consumer warpgroups, each with its own BLOCK_M query
rows, run Q.K^T and P.V on the tensor cores with the softmax in between. The backward stays the Triton
generator's (same lse, same gradients).
"""
from __future__ import annotations

from dataclasses import dataclass

from ...plan import KernelPlan, Step
from ...spec import Backend, DType, LoopOrder, Spec

ARCH = 90  # Hopper: wgmma, TMA and setmaxnreg
HEAD_DIMS = (64, 128)  # the head dims its kernels are written for (wgmma's K step is 16; 256 needs a smaller ring)
# What `auto` takes: on the H100 (BENCHMARKS.md, 2026-11-24) the Gluon forward was 1.25-1.46x the Triton generator's
# at d=128 (dense, causal; sliding window 1.17-1.24x with the version before), but at d=64 0.90-0.93x at N=1024 (1.09-1.16x
# from 4096) and 0.87-1.06x with softcap's score modification (its tanh is the bottleneck): those stay with Triton
# unless backend = gluon.
AUTO_HEAD_DIMS = (128,)
# Query rows per consumer warpgroup: one m64 wgmma row block. With 128 the score tile alone takes 128 registers
# per thread and ptxas spilled 1.5-4 KB and serialized the wgmmas at d=128 (compiled for sm_90, BENCHMARKS.md).
M_PER_WARPGROUP = 64
REGISTERS_PER_SM = 65536
LOAD_REGS = 24  # registers per thread the load warpgroup keeps (setmaxnreg.dec): it only issues TMA copies
MAX_STAGES = 4
SMEM_RESERVE = 1024  # mbarriers and Gluon's scratch


@dataclass(frozen=True)
class GluonPlan:
    base: KernelPlan  # the Triton plan: the shared facts (mask, score, scale, tile classes) and the backward
    consumers: int  # consumer warpgroups, each with its own M_PER_WARPGROUP query rows
    block_n: int  # keys per K/V tile
    stages: int  # depth of the K/V ring in shared memory
    load_regs: int
    consumer_regs: int
    steps: tuple[Step, ...]
    # the backward: one program per bwd_block_n keys (a half per consumer warpgroup), query tiles of bwd_block_m
    # rows through a ring of bwd_stages Q/dO stages; each warpgroup computes half of every dQ tile ("d": half of
    # its columns, "m": half of its rows: the halves that cut shared memory at a 128-byte swizzle boundary)
    bwd_block_n: int = 128
    bwd_block_m: int = 64
    bwd_stages: int = 2
    bwd_consumer_regs: int = 240
    dq_split: str = "d"
    bwd_steps: tuple[Step, ...] = ()

    @property
    def block_m(self) -> int:
        """Query rows per program."""
        return self.consumers * M_PER_WARPGROUP

    @property
    def num_warps(self) -> int:
        """Warps of the default partition (the consumers)."""
        return 4 * self.consumers

    def describe(self) -> str:
        width = max(len(s.what) for s in self.steps)
        lines = ["gluon forward (FlashAttention-3 schedule, sm_90):"]
        lines += [f"  {s.what:<{width}}  {s.formula}  =>  {s.value}" for s in self.steps]
        lines.append(f"  partitions: load 1 warp ({self.load_regs} registers/thread), {self.consumers} consumer warpgroup(s) "
                     f"({self.consumer_regs} registers/thread); BLOCK_M={self.block_m} BLOCK_N={self.block_n} ring of {self.stages} K/V stages")
        lines.append("gluon backward (FlashAttention-3 structure, sm_90):")
        width = max(len(s.what) for s in self.bwd_steps)
        lines += [f"  {s.what:<{width}}  {s.formula}  =>  {s.value}" for s in self.bwd_steps]
        lines.append(f"  partitions: load 1 warp ({self.load_regs} registers/thread), 2 consumer warpgroups ({self.bwd_consumer_regs} "
                     f"registers/thread); BLOCK_N={self.bwd_block_n} BLOCK_M={self.bwd_block_m} ring of {self.bwd_stages} Q/dO stages, "
                     f"dQ split by {'columns' if self.dq_split == 'd' else 'rows'}")
        return "\n".join(lines)


def unsupported(spec: Spec, base: KernelPlan) -> list[str]:
    """Why the Gluon generator cannot render this spec for this target (empty: it can)."""
    why = []
    if base.target.arch != ARCH:
        why.append(f"the target is sm_{base.target.arch}; the Gluon generator writes Hopper (sm_{ARCH}) kernels")
    if spec.dtype is DType.FP32:
        why.append("dtype fp32: its matrix products are bf16/fp16 wgmma")
    if spec.head_dim not in HEAD_DIMS:
        why.append(f"head_dim {spec.head_dim}: its kernels take {' or '.join(map(str, HEAD_DIMS))}")
    if spec.dropout:
        why.append("dropout: the Philox pattern is not ported to Gluon yet")
    if spec.sparsity == "runtime":
        why.append("runtime block sparsity: the block lists are not ported to Gluon yet")
    if spec.loop_order is LoopOrder.KV_OUTER:
        why.append("loop_order = kv_outer is a schedule of the Triton generator")
    fixed = [k for k in ("block_m", "block_n", "num_warps", "num_stages") if getattr(spec, k) is not None or k in spec.tune]
    if fixed:
        why.append(f"{', '.join(fixed)} set: those are the Triton generator's tiles")
    return why


def plan_gluon(base: KernelPlan) -> GluonPlan:
    """The schedule's sizes for a spec the generator supports (see `unsupported`)."""
    spec, tgt = base.spec, base.target
    d, isz = spec.head_dim, spec.dtype.itemsize
    steps = []
    consumers = 2
    steps.append(Step("consumer warpgroups", f"2 x {M_PER_WARPGROUP} query rows (one softmax under the other's products)", f"{consumers}"))
    block_n = 128
    steps.append(Step("BLOCK_N", "keys per tile: the wgmma's N (S: 64 x 128 float32 = 64 registers per thread)", f"{block_n}"))
    q_bytes = consumers * M_PER_WARPGROUP * d * isz
    stage_bytes = 2 * block_n * d * isz
    smem = tgt.smem_per_block - SMEM_RESERVE
    stages = min(MAX_STAGES, (smem - q_bytes) // stage_bytes)
    steps.append(Step("ring stages", f"min({MAX_STAGES}, (smem {smem} - Q tiles {q_bytes}) // (K+V stage {stage_bytes}))", f"{stages}"))
    threads = 32 * 4 * (consumers + 1)
    cap = REGISTERS_PER_SM // threads // 8 * 8
    consumer_regs = min(240, (REGISTERS_PER_SM // 128 - LOAD_REGS) // consumers // 8 * 8)
    steps.append(Step("registers", f"{REGISTERS_PER_SM} / {threads} threads = {cap} at entry; load keeps {LOAD_REGS}, consumers get "
                                   f"min(240, ({REGISTERS_PER_SM // 128} - {LOAD_REGS}) / {consumers})", f"{consumer_regs}"))
    bwd = _plan_backward(base, consumer_regs)
    return GluonPlan(base, consumers, block_n, stages, LOAD_REGS, consumer_regs, tuple(steps), **bwd)


def _plan_backward(base: KernelPlan, consumer_regs: int) -> dict:
    """The backward's sizes. Per consumer warpgroup (64 keys) the registers hold dK and dV (2 x 64 x d float32)
    and the transposed score tiles S^T and dP^T (2 x 64 x BLOCK_M float32): 2 * 64 * (d + BLOCK_M) / 128 per
    thread, which the 240 of a consumer must hold with the dQ tile and addresses."""
    spec, tgt = base.spec, base.target
    d, isz = spec.head_dim, spec.dtype.itemsize
    steps = []
    block_n = 2 * 64
    steps.append(Step("BLOCK_N", "2 consumer warpgroups x 64 keys (one m64 wgmma row block each)", f"{block_n}"))
    block_m = 128 if d <= 64 else 64
    steps.append(Step("BLOCK_M", f"query rows per step: 2 * 64 * (d {d} + BLOCK_M) / 128 registers of dK, dV, S^T, dP^T "
                                 f"<= 192 of {consumer_regs} per thread", f"{block_m}"))
    dq_split = "d" if block_m == 64 else "m"
    steps.append(Step("dQ split", "each warpgroup's half of dQ_i = dS_i K: by columns with 64 rows, by rows with 128 (a wgmma has 64 rows)",
                      "columns" if dq_split == "d" else "rows"))
    kv_bytes = 2 * block_n * d * isz
    ds_bytes = 2 * block_n * block_m * isz
    stage_bytes = 2 * block_m * d * isz
    smem = tgt.smem_per_block - SMEM_RESERVE
    stages = min(3, (smem - kv_bytes - ds_bytes) // stage_bytes)
    steps.append(Step("ring stages", f"min(3, (smem {smem} - K,V {kv_bytes} - dS^T x2 {ds_bytes}) // (Q+dO stage {stage_bytes}))", f"{stages}"))
    return {"bwd_block_n": block_n, "bwd_block_m": block_m, "bwd_stages": stages, "bwd_consumer_regs": consumer_regs,
            "dq_split": dq_split, "bwd_steps": tuple(steps)}


@dataclass(frozen=True)
class Choice:
    generator: str  # of the forward: "gluon" or "triton"
    reason: str  # why (printed by `attngen plan`)
    gluon: GluonPlan | None = None
    backward: str = "triton"  # the generator of the backward ("gluon" only with a Gluon forward: one module)
    backward_reason: str = ""

    def describe(self) -> str:
        """`attngen plan`'s line: which generator renders each pass, and why."""
        line = f"{self.generator} forward ({self.reason})"
        if self.generator == "gluon":
            line += f"; {self.backward} backward ({self.backward_reason})"
        return line


def choose(spec: Spec, base: KernelPlan, backend: Backend | None = None) -> Choice:
    """Which generator renders the forward: `backend` (the compile argument) or the spec's setting. auto takes
    Gluon where it supports the spec; gluon asked for where it cannot is a PlanError with the reasons."""
    from ...errors import PlanError

    backend = backend or spec.backend
    if backend is Backend.TRITON:
        return Choice("triton", "backend = triton")
    why = unsupported(spec, base)
    if why:
        if backend is Backend.GLUON:
            raise PlanError(f"{spec.name}: backend = gluon, but the Gluon generator cannot render it: {'; '.join(why)}")
        return Choice("triton", "the Gluon generator does not take it: " + "; ".join(why))
    gp = plan_gluon(base)
    from .lower import Untranslatable
    from .render import context

    try:
        context(gp)  # every piece of expression code has a Gluon counterpart (lower.NAMES)
    except Untranslatable as err:
        if backend is Backend.GLUON:
            raise PlanError(f"{spec.name}: backend = gluon, but the Gluon generator cannot render it: {err}") from None
        return Choice("triton", f"the Gluon generator does not take it: {err}")
    if backend is Backend.AUTO:
        slower = slower_than_triton(spec)
        if slower:
            return Choice("triton", f"auto: the Gluon forward measured slower here ({slower}); backend = gluon takes it anyway")
    return Choice("gluon", f"backend = {backend.value}: sm_{ARCH}, every feature of the spec is supported", gp,
                  *_choose_backward(spec, backend))


# The Gluon backward against the Triton generator's on the H100 (raw launchers, same inputs, bf16, N = 4096 and
# 16384, dense and causal; BENCHMARKS.md, 2026-11-25): 0.74-0.81x at head_dim 128, 0.66-0.78x at 64.
BACKWARD_MEASURED = "0.66-0.81x the Triton backward on the H100"


def _choose_backward(spec: Spec, backend: Backend) -> tuple[str, str]:
    """The backward of a spec whose forward is Gluon's. Gluon's adds dQ across key tiles with atomics, in no
    fixed order, and was measured slower than the Triton generator's: it is taken only when asked for twice,
    backend = gluon and deterministic = false. Otherwise the Triton generator's, whose gradients are
    bit-reproducible."""
    if spec.deterministic:
        return "triton", "deterministic: the Gluon backward adds dQ in no fixed order (deterministic = false allows it)"
    if backend is not Backend.GLUON:
        return "triton", f"auto: the Gluon backward measured slower ({BACKWARD_MEASURED}); backend = gluon takes it anyway"
    return "gluon", f"backend = gluon, deterministic = false: dQ added by atomics, its last bits may vary between runs ({BACKWARD_MEASURED})"


def slower_than_triton(spec: Spec) -> str | None:
    """Why `auto` keeps a supported spec on the Triton generator (measured on the H100), or None."""
    if spec.head_dim not in AUTO_HEAD_DIMS:
        return f"head_dim {spec.head_dim}: 0.90-0.93x the Triton forward at N=1024 on the H100 (1.09-1.16x from 4096)"
    if spec.score is not None:
        return "a score modification: 0.87-1.06x the Triton forward on the H100 (softcap)"
    return None
