"""Which code generator renders each pass of a spec on a target: the Gluon generator where it can render the spec
and, under `backend = auto`, where it was measured faster than the Triton generator; the reasons are what
`attngen plan` prints. Above plan.py (what the generator can take, its sizes) and render.py (whether every piece
of expression code has a Gluon counterpart)."""
from __future__ import annotations

from dataclasses import dataclass

from ...errors import PlanError
from ...intervals import Truth, tile_env, truth
from ...plan import KernelPlan
from ...spec import Backend, DType, Expr, Spec
from .lower import Untranslatable
from .plan import ARCH, BACKWARD_HEAD_DIMS, GluonPlan, plan_gluon, unsupported
from .render import context

# What `auto` takes: on the H100 (BENCHMARKS.md, 2026-11-24) the Gluon forward was 1.25-1.46x the Triton generator's
# at d=128 (dense, causal; sliding window 1.17-1.24x with the version before), but at d=64 0.90-0.93x at N=1024 (1.09-1.16x
# from 4096) and 0.87-1.06x with softcap's score modification (its tanh is the bottleneck): those stay with Triton
# unless backend = gluon.
# At head_dim 256 (the forward alone: 64-key tiles, two ring stages; BENCHMARKS.md, 2026-11-26 session 10) the Gluon
# forward was 2.15-2.42x the Triton generator's (641-655 against 255-285 TFLOP/s, dense and causal, N = 4096 and 16384).
AUTO_HEAD_DIMS = (128, 256)
HEAD_DIM_MEASURED = {64: "head_dim 64: 0.90-0.93x the Triton forward at N=1024 on the H100 (1.09-1.16x from 4096)"}
# FP8 at d=128 on the H100 (BENCHMARKS.md, 2026-11-26 session 9): the Gluon forward 1.13-1.20x the Triton generator's
FP8_MEASURED = "the Gluon FP8 forward measured 1.13-1.20x the Triton generator's on the H100"


@dataclass(frozen=True)
class Choice:
    generator: str  # of the forward: "gluon" or "triton"
    reason: str  # why (printed by `attngen plan`)
    gluon: GluonPlan | None = None
    backward: str = "triton"  # the generator of the backward ("gluon" only with a Gluon forward: one module)
    backward_reason: str = ""
    backward_min_keys: int = 0  # calls with fewer keys take the Triton backward (auto: measured faster there)

    def backward_for(self, kv_len: int) -> str:
        """The generator of a call's backward, by its number of keys."""
        return "triton" if self.backward == "gluon" and kv_len < self.backward_min_keys else self.backward

    def describe(self) -> str:
        """`attngen plan`'s line: which generator renders each pass, and why."""
        line = f"{self.generator} forward ({self.reason})"
        if self.generator == "gluon":
            line += f"; {self.backward} backward ({self.backward_reason})"
        if self.backward == "gluon" and self.backward_min_keys:
            line += f", from {self.backward_min_keys} keys; below, the Triton backward ({SHORT_BACKWARD_MEASURED})"
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
        bounded = bool(context(gp)["bounds"])  # every piece of expression code has a Gluon counterpart (lower.NAMES)
    except Untranslatable as err:
        if backend is Backend.GLUON:
            raise PlanError(f"{spec.name}: backend = gluon, but the Gluon generator cannot render it: {err}") from None
        return Choice("triton", f"the Gluon generator does not take it: {err}")
    if backend is Backend.AUTO:
        slower = slower_than_triton(spec)
        if slower:
            return Choice("triton", f"auto: the Gluon forward measured slower here ({slower}); backend = gluon takes it anyway")
    if spec.dtype is DType.FP8:
        return Choice("gluon", f"backend = {backend.value}: sm_{ARCH}, every feature of the spec is supported ({FP8_MEASURED})", gp,
                      "triton", "dtype fp8 is forward only")
    if not gp.has_backward:
        return Choice("gluon", f"backend = {backend.value}: sm_{ARCH}, every feature of the spec is supported", gp,
                      "triton", f"the Gluon backward takes head_dim {' or '.join(map(str, BACKWARD_HEAD_DIMS))}")
    return Choice("gluon", f"backend = {backend.value}: sm_{ARCH}, every feature of the spec is supported", gp,
                  *_choose_backward(spec, backend, bounded, _is_band(base)))


# The Gluon backward against the Triton generator's on the H100 (raw launchers, same inputs, bf16, B*N = 16384,
# H*d = 2048; BENCHMARKS.md, 2026-11-25 (session 4)): with dQ added in a fixed order (a dQ warp adds each part
# in its turn), 1.01-1.16x at head_dim 128 and 1.26-1.41x at 64 (dense and causal, N = 4096 and 16384); in no
# fixed order, 1.16-1.31x and 1.21-1.40x.
BACKWARD_MEASURED = {True: "1.01-1.41x the Triton backward on the H100", False: "1.16-1.40x the Triton backward on the H100"}
# ... but not on short sequences: the raw launchers in one process, alternating (the same conditions; BENCHMARKS.md,
# 2026-11-25 (session 5)), the ordered Gluon backward ÷ the Triton backward was 0.86 / 0.83 (dense / causal) at
# N = 1024, 1.02 / 0.95 at 2048, 1.06 / 1.02 at 3072, 1.11 / 1.04 at 4096 (d = 128). So under auto a call with fewer
# keys takes the Triton backward (bit-reproducible too; it reads the Gluon forward's O and lse as they are). Not
# the unordered one (deterministic = false): the same kind of run (BENCHMARKS.md, 2026-11-26 session 11) measured it
# 1.13 / 1.07x the Triton backward (dense / causal) at N = 1024, 1.19 / 1.16x at 2048, 1.22 / 1.16x at 4096 (the
# ordered one 0.91 / 0.94x, 0.99 / 1.03x, 1.06 / 1.07x), so with deterministic = false it runs at every length.
AUTO_BACKWARD_MIN_KEYS = 3072
SHORT_BACKWARD_MEASURED = "the ordered Gluon backward measured 0.83-1.03x of it at 1024-2048 keys on the H100"


# Runtime block sparsity (random 128 x 128 blocks, B=2 H=16 N=8192 d=128 on the H100; BENCHMARKS.md, 2026-11-26
# session 10), the ordered Gluon backward against the Triton generator's: 1.30x with every block kept, but 0.96x at
# half the blocks, 0.80x at a quarter, 0.69x at an eighth: a key tile's program waits at each query tile for the one
# that adds before it, and with random lists those waits add up. Under auto such specs take the Triton backward with
# deterministic = true; the unordered Gluon backward (deterministic = false) measured 1.26-1.29x the Triton one at
# 1/4-1/2 of the blocks kept (the same session's probe), so it is taken then.
SPARSE_BACKWARD_MEASURED = "the ordered Gluon backward measured 0.69-0.96x of it at 1/8-1/2 of the blocks kept on the H100"
# Tile classes that read the input pre-pass (documents: doc[b, q_idx] == doc[b, kv_idx], causal inside; random
# documents of 256-2048 tokens, N = 4096 and 16384, d = 128; BENCHMARKS.md, 2026-11-26 session 10): the Gluon
# forward 1.04-1.07x the Triton generator's, the ordered Gluon backward 0.70-0.80x of it (each program scans its
# query tiles' classes per head with the summaries' loads, under the register budget of dK and dV: it spills); the
# unordered one 0.90-0.94x (the same session's probe): the Triton backward in both settings.
BOUNDED_BACKWARD_MEASURED = "the Gluon backward measured 0.70-0.80x of it (0.90-0.94x unordered) with a document mask on the H100"
# Band masks, which drop the corner of the last queries and the first keys (a sliding window: each key tile meets a
# bounded run of query tiles, so a program's fixed costs weigh more): sliding window 1024, d = 128 (the same run),
# the ordered Gluon backward 0.98x the Triton generator's at N = 4096 and 0.92x at 16384. Block patterns are not
# counted as bands here (through Gluon their backward measured 1.3-4x the Triton generator's, session 5). The
# unordered Gluon backward (deterministic = false) measured 1.06-1.11x the Triton one: taken then.
BAND_BACKWARD_MEASURED = "the ordered Gluon backward measured 0.92-0.98x of it with a sliding window of 1024 on the H100"
BAND_PROBE = 16384  # the length at which the corner tile is classified


def _is_band(base: KernelPlan) -> bool:
    """Whether the mask (not a block pattern) provably drops the tile of the last 128 queries and the first 128 keys
    at BAND_PROBE tokens: a band around the diagonal."""
    if base.mask is None or isinstance(base.spec.sparsity, Expr):
        return False
    n = BAND_PROBE
    return truth(base.mask, tile_env(n - 128, n - 1, 0, 127, n, n)) is Truth.NEVER


def _choose_backward(spec: Spec, backend: Backend, bounded: bool = False, band: bool = False) -> tuple[str, str, int]:
    """The backward of a spec whose forward is Gluon's: Gluon's (under auto with deterministic = true, for calls
    of at least AUTO_BACKWARD_MIN_KEYS keys; not where the Triton backward measured faster: tile classes that read the input
    pre-pass, `bounded` (BOUNDED_BACKWARD_MEASURED), and with deterministic = true runtime block sparsity
    (SPARSE_BACKWARD_MEASURED) and band masks, `band` (BAND_BACKWARD_MEASURED)). With deterministic = true (the
    default) its programs add into each dQ tile in a fixed order (a dQ warp waits for each addition's turn), so
    the gradients are bit-reproducible; with deterministic = false in no fixed order, its last bits may vary
    between runs."""
    ordered = spec.deterministic
    if backend is Backend.AUTO and ordered and spec.sparsity == "runtime":
        return ("triton", f"auto, runtime block sparsity: the Triton backward ({SPARSE_BACKWARD_MEASURED}; deterministic = false takes the "
                          "unordered Gluon backward, 1.26-1.29x); backend = gluon takes it anyway", 0)
    if backend is Backend.AUTO and bounded:
        return ("triton", f"auto, tile classes from the inputs' per-chunk bounds: the Triton backward ({BOUNDED_BACKWARD_MEASURED}); "
                          "backend = gluon takes it anyway", 0)
    if backend is Backend.AUTO and ordered and band:
        return ("triton", f"auto, a band mask: the Triton backward ({BAND_BACKWARD_MEASURED}; deterministic = false takes the unordered "
                          "Gluon backward, 1.06-1.11x); backend = gluon takes it anyway", 0)
    min_keys = AUTO_BACKWARD_MIN_KEYS if backend is Backend.AUTO and ordered else 0
    if ordered:
        return "gluon", f"deterministic: dQ added in a fixed order, each program in its turn ({BACKWARD_MEASURED[True]})", min_keys
    return ("gluon", f"deterministic = false: dQ added in no fixed order, its last bits may vary between runs ({BACKWARD_MEASURED[False]})",
            min_keys)


def slower_than_triton(spec: Spec) -> str | None:
    """Why `auto` keeps a supported spec on the Triton generator (measured on the H100), or None."""
    if spec.head_dim not in AUTO_HEAD_DIMS:
        return HEAD_DIM_MEASURED.get(spec.head_dim, f"head_dim {spec.head_dim}: not measured against the Triton forward")
    if spec.score is not None:
        return "a score modification: 0.87-1.06x the Triton forward on the H100 (softcap)"
    return None
