"""Which code generator renders each pass of a spec on a target: the Gluon generator where it can render the spec
and, under `backend = auto`, where it was measured faster than the Triton generator; the reasons are what
`attngen plan` prints. Above plan.py (what the generator can take, its sizes) and render.py (whether every piece
of expression code has a Gluon counterpart)."""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import PlanError
from ...lang.expr import FLOAT_FUNCTIONS, children, input_reads, variables
from ...lang.spec import Backend, Binary, Call, DType, Expr, Spec, Var
from ...plan.planner import KernelPlan
from ..lowering import bias_of
from .lower import Untranslatable
from .plan import ARCH, GluonPlan, plan_gluon, unsupported
from .render import context

# What `auto` takes, from measurements on the H100 (bf16, B*N = 16384; each figure the Gluon kernels' speed over the
# Triton generator's, both in one process):
# - head_dim 128 (2026-11-24): the Gluon forward 1.25-1.46x (dense, causal; sliding window 1.17-1.24x), but
#   0.87-1.06x with softcap's score modification (its tanh is the bottleneck): such specs stay with Triton unless
#   backend = gluon.
# - head_dim 256 (the forward alone: 64-key tiles, two ring stages; 2026-11-26): 2.15-2.42x (641-655 against 255-285
#   TFLOP/s, dense and causal, N = 4096 and 16384).
# - head_dim 64 (benchmarks/head_dims.py --dims 64, both passes, dQ in a fixed order; 2026-11-26), forward / backward:
#   1.08 / 1.02x (dense) and 1.02 / 1.01x (causal) at 1024 keys, 1.16 / 1.07x and 1.13 / 1.21x at 2048, 1.10-1.12 /
#   1.12-1.23x at 4096, 1.16-1.18 / 1.19-1.24x at 16384; but at 512 keys 1.05 / 0.96x and 0.86 / 0.89x, at 256 1.04 /
#   0.89x and 0.80 / 0.87x. So under auto a call of such a spec with fewer keys than GLUON_MIN_KEYS takes the Triton
#   generator for both passes, and the Gluon generator's from there on.
# - every variant at head_dim 128 and 64 (`attngen bench`, N = 1024, 2048, 4096, 16384; 2026-11-27): no mask and the
#   causal mask keep that rule (1.01-1.13x forward, 1.04-1.09x backward at 1024 keys; ALiBi, causal with a bias,
#   1.04 / 1.26x); other masks at head_dim 64 are behind at 1024 keys (sliding window 0.91 / 0.99x, prefix-LM 0.91 /
#   0.94x) and even or ahead from 2048 (0.97 / 1.06x, 1.01 / 0.98x): MASKED_MIN_KEYS; documents at head_dim 128 are
#   behind at 1024 keys (forward 1.15x, the ordered backward 0.85x: 0.90x the time of both; the unordered backward
#   1.03x) and ahead from 2048 (1.18 / 1.05x). Since the ordered backward reads its tile classes from the pre-pass's
#   class words (H200, 2026-11-29; benchmarks/results/h200_document_generators_2026-11-29.json): at 1024 keys the
#   forward 1.11x, the ordered backward 0.92x, both passes 0.96x; from 4096 1.10-1.11x / 1.22-1.25x. So documents at
#   128 take the Gluon forward at every length and its backward from MASKED_MIN_KEYS (_bwd_min_keys): at 1024 keys the
#   Gluon forward with the Triton backward takes 0.98x the time of the Triton generator's two passes in that run.
#   Block patterns: BLOCK_PATTERN_MEASURED.
GLUON_MIN_KEYS = {64: 1024}
MASKED_MIN_KEYS = 2048  # head_dim 64 with a mask other than causal's; documents (tile classes from the inputs) at 128
MIN_KEYS_MEASURED = ("the Gluon kernels measured 0.80-1.05x the Triton generator's at 256 and 512 keys and 1.01-1.21x from 1024 "
                     "(head_dim 64, H100)")
MASKED_MIN_KEYS_MEASURED = {64: "with a mask other than causal's at head_dim 64 (sliding window, prefix-LM) the Gluon kernels measured 0.91x "
                                "the Triton generator's forward and 0.94-0.99x its backward at 1024 keys, 0.97-1.01x and 0.98-1.06x at 2048 (H100)",
                            128: "with a document mask at head_dim 128 the ordered Gluon backward measured 0.92x the Triton one at 1024 "
                                 "keys (H200), 1.05x at 2048 (H100), where its forward measured 1.11x (H200)"}
# FP8 at d=128 on the H100 (2026-11-26): the Gluon forward 1.13-1.20x the Triton generator's
FP8_MEASURED = "the Gluon FP8 forward measured 1.13-1.20x the Triton generator's on the H100"
# Block patterns (sparsity = an expression of q_blk, kv_blk), with the Triton generator's loops skipping the holes
# between kept tiles: `attngen bench` of the three shipped patterns at N = 1024, 4096, 16384 (2026-11-27) puts the
# Gluon kernels at 0.19-0.75x the Triton forward and 0.36-0.94x
# its backward at head_dim 64 from 4096 keys; at 128 Gluon stays ahead on local_global and strided (1.52-2.12x /
# 0.90-1.75x) but not on butterfly, whose tiles are classified by pieces (0.96 / 1.12x at 4096, 0.59 / 0.73x at
# 16384; 1.33 / 1.37x at 1024). So under auto block patterns take the Triton generator at head_dim 64, and at 128
# where their tiles are classified by pieces.
BLOCK_PATTERN_MEASURED = ("the Gluon kernels measured 0.19-0.75x the Triton forward and 0.36-0.94x its backward with block patterns at "
                          "head_dim 64 from 4096 keys, 0.59-0.96x / 0.73-1.12x with butterfly's (classified by pieces) at 128 (H100)")
CAUSAL = Binary(">=", Var("q_idx"), Var("kv_idx"))  # the causal mask: at head_dim 64 GLUON_MIN_KEYS holds for it and for no mask
# A sink at head_dim 64 (benchmarks/gpt_oss.py --generators triton gluon: 64 query heads over 8, B = 1, the sinks
# trained, forward + backward, both generators in one process; 2026-11-29, H200): causal 1.02x the Triton generator at
# 4096 keys (within the run's noise: the auto row, the same Triton kernels, took 0.90x the Triton row's time), 1.10x at
# 8192 and 1.10x at 16384; a window of 128 keys 0.75-0.90x at 4096-16384 (those calls are short, and the Gluon backward
# leaves the sink's gradient to a pass of its own). So at head_dim 64 a sink takes the Gluon generator with the causal
# mask (or none) from SINK_MIN_KEYS keys, the Triton one with other masks.
SINK_MIN_KEYS = 8192
SINK_MEASURED = ("with a sink at head_dim 64 the Gluon kernels measured 1.02x the Triton generator's (forward + backward, causal) at "
                 "4096 keys, within noise, and 1.10x from 8192 (H200)")


@dataclass(frozen=True)
class Choice:
    generator: str  # of the forward: "gluon" or "triton"
    reason: str  # why (printed by `attngen plan`)
    gluon: GluonPlan | None = None
    backward: str = "triton"  # the generator of the backward ("gluon" only with a Gluon forward: one module)
    backward_reason: str = ""
    min_keys: int = 0  # calls with fewer keys (the longest sequence's) take the Triton generator for both passes
    min_keys_reason: str = MIN_KEYS_MEASURED
    bwd_min_keys: int = 0  # calls with fewer keys take the Triton generator's backward (the forward as above)
    bwd_min_keys_reason: str = ""

    def forward_at(self, kv_len: int) -> str:
        """The generator of the forward of a call with kv_len keys (packed sequences: the longest)."""
        return "triton" if kv_len < self.min_keys else self.generator

    def backward_at(self, kv_len: int) -> str:
        """The generator of the backward of a call with kv_len keys (the Triton backward reads a Gluon forward's O
        and lse as its own: both keep the lse in log2 units, O laid out as q)."""
        return "triton" if kv_len < self.min_keys or kv_len < self.bwd_min_keys else self.backward

    def describe(self) -> str:
        """`attngen plan`'s line: which generator renders each pass, and why."""
        line = f"{self.generator} forward ({self.reason})"
        if self.generator == "gluon":
            line += f"; {self.backward} backward ({self.backward_reason})"
        if self.min_keys:
            line += f"; calls with fewer than {self.min_keys} keys take the Triton generator for both passes ({self.min_keys_reason})"
        if self.bwd_min_keys:
            line += f"; calls with fewer than {self.bwd_min_keys} keys take the Triton generator's backward ({self.bwd_min_keys_reason})"
        return line


def choose(spec: Spec, base: KernelPlan, backend: Backend | None = None) -> Choice:
    """Which generator renders each pass: `backend` (the compile argument) or the spec's setting. auto takes the
    Gluon forward where it supports the spec and was measured faster; gluon asked for where it cannot render the
    spec is a PlanError with the reasons. The backward: see _choose_backward."""
    backend = backend or spec.backend
    if backend is Backend.TRITON:
        return Choice("triton", "backend = triton")
    why = unsupported(spec, base)
    if why:
        if backend is Backend.GLUON:
            raise PlanError(f"{spec.name}: backend = gluon, but the Gluon generator cannot render it: {'; '.join(why)}")
        return Choice("triton", "the Gluon generator does not take it: " + "; ".join(why))
    gp = plan_gluon(base)
    try:
        context(gp)  # every piece of expression code has a Gluon counterpart (lower.NAMES)
    except Untranslatable as err:
        if backend is Backend.GLUON:
            raise PlanError(f"{spec.name}: backend = gluon, but the Gluon generator cannot render it: {err}") from None
        return Choice("triton", f"the Gluon generator does not take it: {err}")
    if backend is Backend.AUTO:
        slower = slower_than_triton(spec, base)
        if slower:
            return Choice("triton", f"auto: the Triton generator here ({slower}); backend = gluon takes the Gluon one anyway")
    if spec.dtype is DType.FP8:
        return Choice("gluon", f"backend = {backend.value}: sm_{ARCH}, every feature of the spec is supported ({FP8_MEASURED})", gp,
                      "triton", "dtype fp8 is forward only")
    if not gp.has_backward:
        return Choice("gluon", f"backend = {backend.value}: sm_{ARCH}, every feature of the spec is supported", gp,
                      "triton", f"no Gluon backward: {gp.why_no_backward}")
    if backend is Backend.AUTO and isinstance(spec.sparsity, Expr) and (spec.head_dim == 64 or gp.class_piece):
        where = f"at head_dim {spec.head_dim}" if spec.head_dim == 64 else "whose tiles are classified by pieces"
        return Choice("triton", f"auto, a block pattern {where}: the Triton generator ({BLOCK_PATTERN_MEASURED}); backend = gluon takes the "
                                "Gluon one anyway")
    if backend is Backend.AUTO and gp.classes_read_inputs and spec.head_dim not in BOUNDED_GLUON_HEAD_DIMS:
        return Choice("triton", f"auto, tile classes from the inputs' per-chunk bounds at head_dim {spec.head_dim}: the Triton generator "
                                f"({BOUNDED_MEASURED_BELOW}); backend = gluon takes the Gluon one anyway")
    min_keys, why = _min_keys(spec, gp) if backend is Backend.AUTO else (0, "")
    bwd_min_keys, bwd_why = (0, "") if min_keys else _bwd_min_keys(spec, gp) if backend is Backend.AUTO else (0, "")
    return Choice("gluon", f"backend = {backend.value}: sm_{ARCH}, every feature of the spec is supported", gp,
                  *_choose_backward(spec, backend, gp.classes_read_inputs), min_keys=min_keys, min_keys_reason=why,
                  bwd_min_keys=bwd_min_keys, bwd_min_keys_reason=bwd_why)


def _min_keys(spec: Spec, gp: GluonPlan) -> tuple[int, str]:
    """Under auto, the calls (by their keys) below which the Triton generator runs both passes, and why: at head_dim
    64, 1024 keys for no mask or the causal mask, MASKED_MIN_KEYS for other masks; else none."""
    if spec.head_dim == 64:
        if spec.sink is not None:  # (other masks: slower_than_triton)
            return SINK_MIN_KEYS, SINK_MEASURED
        if gp.base.mask is None or gp.base.mask == CAUSAL:  # (the mask with a block pattern's)
            return GLUON_MIN_KEYS[64], MIN_KEYS_MEASURED
        return MASKED_MIN_KEYS, MASKED_MIN_KEYS_MEASURED[64]
    return GLUON_MIN_KEYS.get(spec.head_dim, 0), MIN_KEYS_MEASURED


def _bwd_min_keys(spec: Spec, gp: GluonPlan) -> tuple[int, str]:
    """Under auto, the calls below which the Triton generator runs the backward while the Gluon forward stays, and
    why: documents at head_dim 128 with dQ in a fixed order, MASKED_MIN_KEYS (the unordered backward measured 1.03x
    the Triton one at 1024 keys: none); else none."""
    if gp.classes_read_inputs and spec.head_dim == 128 and spec.deterministic:
        return MASKED_MIN_KEYS, MASKED_MIN_KEYS_MEASURED[128]
    return 0, ""


# The Gluon backward against the Triton generator's on the H100 (benchmarks/backward_choice.py: through autograd, the
# same inputs, bf16, B*N = 16384, H*d = 2048; 2026-11-26), d = 128, dense and causal, 1024-4096 keys: with dQ added in
# a fixed order (a dQ warp per consumer warpgroup adds its parts, each in its turn) 1.00-1.19x (1.00x: causal at 1024
# keys), in no fixed order 1.05-1.27x. (With one dQ warp for both warpgroups' parts, its turns and additions, each a
# round trip to L2, made it the backward's bottleneck: the ordered backward measured 0.91-0.94x the Triton one at 1024
# keys.)
BACKWARD_MEASURED = {True: "1.00-1.19x the Triton backward on the H100", False: "1.05-1.27x the Triton backward on the H100"}
# Runtime block sparsity (random 128 x 128 blocks, B=2 H=16 N=8192 d=128, the same run): the ordered Gluon backward
# 1.08x the Triton generator's with half of the blocks kept but 0.92x with a quarter: a key tile's program waits at
# each query tile for the one that adds before it, and along random lists of kept blocks those waits add up. Under
# auto such specs take the Triton backward with deterministic = true; the unordered Gluon backward (deterministic =
# false) measured 1.18-1.27x the Triton one, so it is taken then.
SPARSE_BACKWARD_MEASURED = "the ordered Gluon backward measured 0.92-1.08x of it at 1/4-1/2 of the blocks kept on the H100"
# Tile classes that read the input pre-pass (documents: doc[b, q_idx] == doc[b, kv_idx], causal inside; random
# documents of 256-2048 tokens, N = 4096 and 16384; the same run). The Gluon backward's pre-pass ranks each query
# tile's key tiles by a vector scan (one at a time, a summary load each, it ran 0.79-0.95x as fast), and keeps the
# classes of the tiles it visits as bits from that scan (read again from the summaries, a wait for memory per tile,
# it ran 0.90-0.92x as fast at d = 128). So, on the H100 (2026-11-26): at d = 128 the Gluon forward 1.04-1.07x the
# Triton generator's, its backward 1.05-1.08x in order and 1.09-1.11x in no order: documents take the Gluon backward
# at head_dim 128 in both settings, the Triton one below (0.85x at d = 64). The suite of every variant (2026-11-27,
# see GLUON_MIN_KEYS) found the Gluon forward 0.87-0.92x the Triton one with documents at head_dim 64 (1024-16384
# keys): there auto takes the Triton generator for both passes. With the class words (H200, 2026-11-29) the ordered
# backward measured 1.22-1.25x the Triton one at d = 128 from 4096 keys, and 0.84-0.90x at d = 64 (forward 0.87x).
BOUNDED_GLUON_HEAD_DIMS = (128,)
BOUNDED_MEASURED_BELOW = ("with a document mask at head_dim 64 the Gluon forward measured 0.87-0.92x the Triton one and the ordered "
                          "Gluon backward 0.85x on the H100")
BOUNDED_MEASURED = {True: "dQ in a fixed order, measured 1.22-1.25x the Triton backward with a document mask from 4096 keys on the H200",
                    False: "dQ in no fixed order, measured 1.09-1.11x the Triton backward with a document mask on the H100"}


def _choose_backward(spec: Spec, backend: Backend, bounded: bool = False) -> tuple[str, str]:
    """The backward of a spec whose forward is Gluon's: Gluon's, except under auto with deterministic = true and
    runtime block sparsity, where the Triton backward measured faster (SPARSE_BACKWARD_MEASURED). (Under auto, tile
    classes that read the input pre-pass (`bounded`) at head dims other than BOUNDED_GLUON_HEAD_DIMS take the Triton
    generator for both passes: see choose.) With deterministic = true (the
    default) its programs add into each dQ tile in a fixed order (a dQ warp per consumer warpgroup waits for each addition's turn), so
    the gradients are bit-reproducible; with deterministic = false in no fixed order, its last bits may vary
    between runs."""
    ordered = spec.deterministic
    if backend is Backend.AUTO and ordered and spec.sparsity == "runtime":
        return ("triton", f"auto, runtime block sparsity: the Triton backward ({SPARSE_BACKWARD_MEASURED}; deterministic = false takes the "
                          "unordered Gluon backward, 1.18-1.27x); backend = gluon takes it anyway")
    if bounded and spec.head_dim in BOUNDED_GLUON_HEAD_DIMS:
        return "gluon", f"tile classes from the inputs' per-chunk bounds at head_dim {spec.head_dim}: {BOUNDED_MEASURED[ordered]}"
    if ordered:
        return "gluon", f"deterministic: dQ added in a fixed order, each program in its turn ({BACKWARD_MEASURED[True]})"
    return "gluon", f"deterministic = false: dQ added in no fixed order, its last bits may vary between runs ({BACKWARD_MEASURED[False]})"


# Score modifications, on the H100 (bf16, B*N = 16384). Softcap's tanh (a function call, evaluated per score) makes
# the Gluon forward 0.87-1.06x the Triton generator's at d=128 (2026-11-24; 0.89x at 4096 keys and 1.13x at 16384 on
# 2026-11-26). A bias of positions and per-program values lowered per score (N = 4096 and 16384; 2026-11-27): at
# head_dim 128 the Gluon kernels 1.20-1.24x the Triton generator's forward and 1.26-1.38x its backward (dQ in a fixed
# order); at 64, 0.86-0.95x forward and 0.98-1.08x backward. A separable bias (lang.analysis.separable_bias: ALiBi),
# which the Gluon kernels add as a key part: 1.44-1.45x forward and 1.33-1.39x backward at head_dim 128, 1.04-1.24x
# and 1.34-1.41x at 64 (2026-11-27). So separable biases take the Gluon generator at every head dim, other biases of
# positions and per-program values at head_dim 128, every other score modification the Triton one.
SCORE_GLUON_HEAD_DIMS = (128,)


def slower_than_triton(spec: Spec, base: KernelPlan) -> str | None:
    """Why `auto` keeps a supported spec on the Triton generator at every length (measured on the H100), or None.
    (Every head dim the generator takes was measured: 128 and 256 faster; 64 faster from GLUON_MIN_KEYS keys.)"""
    if spec.sink is not None and spec.head_dim == 64 and not (base.mask is None or base.mask == CAUSAL):
        return ("a sink with a mask other than causal's at head_dim 64: 0.89-0.90x the Triton generator's forward + backward with gpt-oss's "
                "128-key window at 4096 and 16384 keys (H200)")
    if spec.score is None or bias_of(base) is not None:
        return None  # no score modification, or a separable bias
    if any(isinstance(e, Call) and e.func in FLOAT_FUNCTIONS for e in _nodes(spec.score)):
        return "a score modification with a function per score: 0.87-1.13x the Triton forward on the H100 (softcap's tanh)"
    if any(isinstance(e, Call) for e in _nodes(spec.score)) or any(variables(i) & {"q_idx", "kv_idx"} for i in input_reads(spec.score)):
        return ("a score modification other than a bias of positions and per-program values (ALiBi's), the only kind measured "
                "faster through the Gluon generator")
    if spec.head_dim not in SCORE_GLUON_HEAD_DIMS:
        return (f"a score modification at head_dim {spec.head_dim} that is no separable bias: ALiBi's Gluon forward measured "
                "0.86-0.95x the Triton one at head_dim 64 on the H100 when it was computed per score (1.20-1.24x at 128)")
    return None


def _nodes(e):
    """e and every expression inside it."""
    yield e
    for c in children(e):
        yield from _nodes(c)
