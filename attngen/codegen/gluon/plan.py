"""The Gluon generator's plan: which specs it can render (and, for the others, why not), and the sizes of its
FlashAttention-3 schedules, derived from the target like the Triton generator's tiles (attngen/plan/planner.py).
Which generator renders each pass of a spec is choice.py's.

The forward is warp-specialized: a load partition (one warp; Gluon pads it to a warpgroup) streams K and V
tiles by TMA into a ring of shared-memory stages, and consumer warpgroups, each with its own 64 query rows,
run Q.K^T and P.V on the tensor cores with the softmax in between. The backward: a load partition streams Q
and dO tiles past a program's 128 keys, two consumer warpgroups of 64 keys each accumulate dK and dV and add
their halves of dQ.
"""
from __future__ import annotations

from dataclasses import dataclass

from ...lang import expr as ex
from ...lang.intervals import TileClass, classify_tiles
from ...lang.spec import DType, Expr, KVLayout, LoopOrder, Spec
from ...plan.planner import KernelPlan, Step
from ..expr import FLOAT_POSITIONS
from ..lowering import bias_of, converts_positions, key_part_affine
from ..tiles import lower_tile_class

ARCH = 90  # Hopper: wgmma, TMA and setmaxnreg
HEAD_DIMS = (64, 128, 192, 256)  # the head dims (of q and k) its forward is written for (wgmma's K step is 16)
# its value dims (of v and O; at most the head dim, O leaving through Q's tile): O's accumulator is a wgmma's N, and its
# register tiles' sizes are powers of two
VALUE_DIMS = (64, 128, 256)
# keys per forward tile: 128 where a K and a V row together hold at most this many columns (two stages of 128 keys fit
# beside Q up to q.k over 192 and V of 128, DeepSeek's training shape), else 64. At 192 + 128 (causal, bf16, B*N = 16384,
# H200, 2026-11-29) two stages of 128 keys ran 1.15x (4096 keys) and 1.12x (16384) four stages of 64
WIDE_TILE_MAX_COLUMNS = 320
# the head dims of its backward: per consumer warpgroup dK and dV of 64 keys are 2 x 64 x d float32, d registers per
# thread (256 at d = 256, beyond the 240 a consumer has); other head dims take the Triton backward
BACKWARD_HEAD_DIMS = (64, 128)
# Query rows per consumer warpgroup: one m64 wgmma row block. With 128 the score tile alone takes 128 registers
# per thread and ptxas spilled 1.5-4 KB and serialized the wgmmas at d=128 (compiled for sm_90, ptxas's report).
M_PER_WARPGROUP = 64
REGISTERS_PER_SM = 65536
# Three consumer warpgroups (192 query rows a work item, FlashAttention-3's choice at head_dim 64) against two, the
# forward alone on the H100 (benchmarks/ab_templates.py, bf16, d = 64, B*N = 16384; 2026-11-27; outputs
# bit-identical): dense 1.09x (4096 keys) and 1.13x (16384); causal 0.94x / 1.05x, ALiBi 0.84x / 0.95x,
# prefix-LM 0.99x / 1.05x, a sliding window of 1024 0.65x / 0.87x. A work item's key range is its rows' union, and
# at 192 rows more of its tiles are ones some warpgroup's rows do not see (computed, masked) or cut by the mask. So
# three only where no mask, score modification or dropout is (each consumer then gets 160 registers, not 240).
THREE_CONSUMERS_MAX_HEAD_DIM = 64
# An affine key part of a separable bias (ALiBi) added to the forward's scores by the tensor cores, not by an
# addition per score (GluonPlan.bias_mma), on the H100 (benchmarks/ab_templates.py, bf16, B*N = 16384;
# 2026-11-27): ALiBi's forward 1.067x (head_dim 64, 4096 keys), 1.065x (16384), 1.036x (128, 4096 keys,
# the persistent form); at head_dim 128 a program per tile's 3-stage ring leaves no room for the offsets' tiles
# (238 KB of shared memory): so head_dim 64 only.
BIAS_MMA_MAX_HEAD_DIM = 64
LOAD_REGS = 24  # registers per thread the load warpgroup keeps (setmaxnreg.dec): it only issues TMA copies
MAX_STAGES = 4
# The forward's persistent form (a program per SM taking query tiles from a counter: a tile's Q loads under the last
# one's end, and O leaves from a tile of its own) for calls of at most this many keys. Measured on the H100 against
# a program per tile (2026-11-26; bf16, dense / causal / sliding window, d = 64 and 128):
# 1.05-1.14x at 1024 keys dense and causal (sliding windows 0.99-1.02x), 0.98-1.09x at 4096, 0.94-1.00x at 16384
# (its ring is a stage shorter at d = 128, beside the O tiles)
PERSISTENT_MAX_KEYS = 4096
# The backward's persistent form (a program per SM taking work items by ticket: an item's K and V load under the
# last one's final products and dK/dV stores), with dQ in a fixed order, for calls of at most this many keys (by
# head_dim). Its dK and dV go out through each warpgroup's dS^T buffer and dQ part (K's and V's tiles are the next
# item's by then). Measured on the H100 against a program per item (2026-11-27; bf16,
# B*N = 16384, outputs bit-identical): at d = 128 1.00-1.06x up to 4096 keys (dense 0.996x at 4096; causal 1.04-1.06x
# at 1024-2048, documents 1.04-1.05x, windows 1.02x, packed sequences of <= 4096 1.01-1.02x), at 16384 dense 0.98x
# and causal 1.00x (windows and documents 1.03-1.04x there); at d = 64 dense 1.01-1.04x, documents 1.07-1.09x and
# packed sequences 1.04-1.08x, but causal 0.95x at 1024-4096 (kept: the rule measured 1.02-1.07x when it was set,
# 2026-11-26).
PERSISTENT_BACKWARD_MAX_KEYS = {64: 2048, 128: 4096}
# ... and calls of any length where the tile classes read the inputs' pre-pass (documents: each key tile's items are
# as short as the data's documents, whatever the call's length): 1.04x at 16384 keys at d = 128 and 1.05x at d = 64
# (2026-11-27; at 4096 1.05x and 1.07x)
PERSISTENT_BACKWARD_ANY_LENGTH = 2**31 - 1
# A block pattern's tiles are classified by pieces of sparse_block tokens where that proves this share of all tiles
# empty beyond what whole tiles prove, at PIECES_PROBE_N tokens (butterfly_blocks: 69 % more; local_global and
# strided_blocks: none, and the pieces' code made them 1.3-1.6x slower on the H100)
PIECES_MIN_GAIN = 0.05
PIECES_PROBE_N = 2048
SMEM_RESERVE = 1024  # mbarriers and Gluon's scratch
# runtime block sparsity: the kernels walk lists of kept blocks in whole tiles (the forward's 128 x 128, the
# backward's 128 keys x 64 or 128 query rows), so a block must hold whole tiles
SPARSE_BLOCK_MIN = 128


@dataclass(frozen=True)
class GluonPlan:
    base: KernelPlan  # the Triton plan: the shared facts (mask, score, scale, tile classes) and the backward
    consumers: int  # consumer warpgroups, each with its own M_PER_WARPGROUP query rows
    block_n: int  # keys per K/V tile
    stages: int  # depth of the K/V ring in shared memory
    load_regs: int
    consumer_regs: int
    steps: tuple[Step, ...]
    # the forward walks only the key tiles its mask does not prove empty (True for a block pattern, which leaves
    # holes between the first and the last kept tile); else the whole range between them, with no branch
    skip_empty: bool = False
    # a block pattern's tile classes are exact only over one sparse block (q_blk, kv_blk single values; interval
    # arithmetic cannot bound `q_blk ^ kv_blk` over several): tiles larger than this many tokens are classified
    # piece by piece (0: whole tiles)
    class_piece: int = 0
    # the backward: one program per bwd_block_n keys (a half per consumer warpgroup), query tiles of bwd_block_m
    # rows through a ring of bwd_stages Q/dO stages; each warpgroup computes half of every dQ tile ("d": half of
    # its columns, "m": half of its rows: the halves that cut shared memory at a 128-byte swizzle boundary)
    bwd_block_n: int = 128
    bwd_block_m: int = 64
    bwd_stages: int = 2
    bwd_consumer_regs: int = 240
    dq_split: str = "d"
    bwd_steps: tuple[Step, ...] = ()
    has_backward: bool = True  # False: the head dim has no Gluon backward (BACKWARD_HEAD_DIMS); the module holds the forward only
    # the forward has a persistent form, which calls of at most persistent_max_keys keys take: one program per SM,
    # each taking work items (a query tile of a head) from a counter, so a program's next Q loads while its last
    # item finishes (packed sequences keep one program per item)
    persistent: bool = False
    persistent_stages: int = 2  # its K/V ring, beside an O tile per consumer warpgroup
    persistent_max_keys: int = 0  # the calls that take it: at most this many keys
    # the backward (dQ in a fixed order) likewise: calls of at most this many keys take a program per SM taking
    # work items (key tiles of a (batch, key/value head)) by ticket; 0: none
    bwd_persistent_max_keys: int = 0
    # the backward lowers sums of positions as floats leaf by leaf (codegen.expr.FLOAT_POSITIONS): exact for calls of at most
    # this many tokens, longer ones take the Triton backward; 0: no limit
    bwd_max_positions: int = 0
    # the mask's tile classes read the inputs' pre-pass summaries (a document mask): short work items whatever the
    # length (the persistent backward's rule), and the backward choice of choice.py
    classes_read_inputs: bool = False
    # the forward adds an affine key part of a separable bias (lowering.key_part_affine) by the tensor cores: one
    # more product of K = 16 per score tile in place of an addition per score (BIAS_MMA_MAX_HEAD_DIM)
    bias_mma: bool = False
    # q.k over a head_dim that is no power of two (192): Q's and K's tiles in two parts, the first head_dim - qk_tail
    # columns and qk_tail after them (TMA tiles are powers of two wide); 0: one part
    qk_tail: int = 0

    @property
    def bwd_persistent_every_call(self) -> bool:
        """Whether every call takes the persistent backward (PERSISTENT_BACKWARD_ANY_LENGTH)."""
        return self.bwd_persistent_max_keys == PERSISTENT_BACKWARD_ANY_LENGTH

    @property
    def block_m(self) -> int:
        """Query rows per program."""
        return self.consumers * M_PER_WARPGROUP

    @property
    def fwd_maxnreg(self) -> int:
        """The forward's registers per thread at entry (entry_regs)."""
        return entry_regs(self.consumers)

    @property
    def why_no_backward(self) -> str:
        """Why the module holds no backward (has_backward False; the Triton generator's backward runs)."""
        spec = self.base.spec
        if spec.head_dim not in BACKWARD_HEAD_DIMS:
            return (f"head_dim {spec.head_dim}: its backward takes {' or '.join(map(str, BACKWARD_HEAD_DIMS))} (dK and dV of 64 keys per "
                    f"warpgroup would take {spec.head_dim} registers per thread)")
        return f"value_dim {spec.dv} with head_dim {spec.head_dim}: its backward takes V as wide as K"

    def describe(self) -> str:
        width = max(len(s.what) for s in self.steps)
        lines = ["gluon forward (FlashAttention-3 schedule, sm_90):"]
        lines += [f"  {s.what:<{width}}  {s.formula}  =>  {s.value}" for s in self.steps]
        lines.append(f"  partitions: load 1 warp ({self.load_regs} registers/thread), {self.consumers} consumer warpgroup(s) "
                     f"({self.consumer_regs} registers/thread); BLOCK_M={self.block_m} BLOCK_N={self.block_n} ring of {self.stages} K/V stages")
        if not self.has_backward:
            lines.append(f"gluon backward: none ({self.why_no_backward}): the Triton backward")
            return "\n".join(lines)
        lines.append("gluon backward (FlashAttention-3 structure, sm_90):")
        width = max(len(s.what) for s in self.bwd_steps)
        lines += [f"  {s.what:<{width}}  {s.formula}  =>  {s.value}" for s in self.bwd_steps]
        dq_warp = f", dQ 2 warps, one per consumer warpgroup ({self.load_regs} registers/thread: add dQ in a fixed order)" if self.base.spec.deterministic else ""
        lines.append(f"  partitions: load 1 warp ({self.load_regs} registers/thread){dq_warp}, 2 consumer warpgroups ({self.bwd_consumer_regs} "
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
    if spec.dtype is DType.FP8 and spec.head_dim != 128:
        why.append(f"dtype fp8 with head_dim {spec.head_dim}: its FP8 forward is written for 128")
    if spec.head_dim not in HEAD_DIMS:
        why.append(f"head_dim {spec.head_dim}: its kernels take {' or '.join(map(str, HEAD_DIMS))}")
    if spec.sparsity == "runtime" and spec.sparse_block < SPARSE_BLOCK_MIN:
        why.append(f"runtime block sparsity with sparse_block = {spec.sparse_block}: its tiles ({SPARSE_BLOCK_MIN} keys, {SPARSE_BLOCK_MIN} query "
                   f"rows forward) must each lie inside one block, so sparse_block >= {SPARSE_BLOCK_MIN}")
    if spec.kv_layout is KVLayout.PAGED:
        why.append("kv_layout = paged: a paged cache is read by the decode kernels, which are the Triton generator's")
    if spec.kv_dtype is DType.FP8:
        why.append("kv_dtype = fp8: FP8 caches are read by the decode kernels, which are the Triton generator's")
    if spec.loop_order is LoopOrder.KV_OUTER:
        why.append("loop_order = kv_outer is a schedule of the Triton generator")
    if spec.sink is not None and bias_of(base) is not None:
        why.append("a sink with a score modification it adds as a separable bias (its softmax runs in the bias's units)")
    if spec.head_dim in HEAD_DIMS and (spec.dv not in VALUE_DIMS or spec.dv > spec.head_dim):
        why.append(f"{'value_dim' if spec.value_dim else 'head_dim'} {spec.dv} of V and O (q.k over {spec.head_dim}): its forward takes V of "
                   f"{' or '.join(map(str, VALUE_DIMS))} columns, at most q.k's (O leaves through Q's tile)")
    fixed = [k for k in ("block_m", "block_n", "num_warps", "num_stages") if getattr(spec, k) is not None or k in spec.tune]
    if fixed:
        why.append(f"{', '.join(fixed)} set: those are the Triton generator's tiles")
    return why


def entry_regs(consumers: int) -> int:
    """Registers per thread at a kernel's entry (its maxnreg): the consumer warpgroups and the load warp's, padded
    to a warpgroup, share the SM's registers."""
    return REGISTERS_PER_SM // (128 * (consumers + 1)) // 8 * 8


def consumer_regs_of(consumers: int) -> int:
    """What each consumer warpgroup raises its registers to (setmaxnreg) once the load warpgroup keeps LOAD_REGS."""
    return min(240, (REGISTERS_PER_SM // 128 - LOAD_REGS) // consumers // 8 * 8)


def plan_gluon(base: KernelPlan) -> GluonPlan:
    """The schedule's sizes for a spec the generator supports (see `unsupported`)."""
    spec, tgt = base.spec, base.target
    d, dv, isz = spec.head_dim, spec.dv, spec.dtype.itemsize
    steps = []
    bias_mma = False
    reads_inputs = _classes_read_inputs(base)
    three = d <= THREE_CONSUMERS_MAX_HEAD_DIM and base.mask is None and base.score is None and not spec.dropout and spec.sparsity is None
    consumers = 3 if three and spec.dtype is not DType.FP8 else 2
    steps.append(Step("consumer warpgroups", f"{consumers} x {M_PER_WARPGROUP} query rows, in turn on the tensor cores (one's softmax under the "
                                             f"others' products); three at head_dim <= {THREE_CONSUMERS_MAX_HEAD_DIM} with no mask, score "
                                             "modification or dropout (measured 1.09-1.13x two there on the H100, 0.65-1.05x with masks or ALiBi)", f"{consumers}"))
    block_n = 128 if d + dv <= WIDE_TILE_MAX_COLUMNS else 64
    steps.append(Step("BLOCK_N", f"keys per tile: the wgmma's N (S: 64 x 128 float32 = 64 registers per thread), 64 where head_dim + value_dim "
                                 f"> {WIDE_TILE_MAX_COLUMNS} (O takes value_dim / 2 registers per thread and a K+V stage (d + dv) BLOCK_N "
                                 f"x {isz} bytes)", f"{block_n}"))
    qk_tail = d - 128 if d == 192 else 0
    if qk_tail:
        steps.append(Step("q.k in two parts", f"TMA and register tiles are powers of two wide: Q's and K's tiles as their first 128 columns and "
                                              f"the {qk_tail} after them, S = Q_lead K_lead^T + Q_tail K_tail^T (two chained products)",
                          f"128 + {qk_tail}"))
    q_bytes = consumers * M_PER_WARPGROUP * d * isz
    o_bytes = consumers * M_PER_WARPGROUP * dv * isz
    stage_bytes = block_n * (d + dv) * isz
    smem = tgt.smem_per_block - SMEM_RESERVE
    stages = min(MAX_STAGES, (smem - q_bytes) // stage_bytes)
    steps.append(Step("ring stages", f"min({MAX_STAGES}, (smem {smem} - Q tiles {q_bytes}) // (K+V stage {stage_bytes}))", f"{stages}"))
    skips = isinstance(spec.sparsity, Expr) and base.classify  # a block pattern: the visited tiles have holes
    # (declared inputs the mask reads, head_dim 256 and block patterns: the load warp, which keeps 24 registers,
    # spilled in the persistent form, compiled for sm_90; none of them measured. Inputs the score alone reads: with
    # ALiBi's slopes[h] the persistent form measured 1.02-1.07x a program per tile at 1024-4096 keys, with a bias
    # table read at q_idx - kv_idx 0.75-0.92x (2026-11-27): taken for reads of neither
    # index only)
    index_reads = any(ex.variables(i) & {"q_idx", "kv_idx"} for i in ex.input_reads(base.score))
    mask_reads = base.mask is not None and bool(ex.input_reads(base.mask))
    persistent = (spec.dtype is not DType.FP8 and spec.sparsity != "runtime" and not mask_reads and not index_reads and d <= 128
                  and not skips)
    persistent_stages = min(MAX_STAGES, (smem - q_bytes - o_bytes) // stage_bytes)
    steps.append(Step("persistent forward", f"calls of <= {PERSISTENT_MAX_KEYS} keys: a program per SM takes query tiles from a counter, the next "
                                            f"one's Q loading under the last one's end, O stored from a tile of its own; its ring: min({MAX_STAGES}, "
                                            f"(smem - Q and O tiles {q_bytes + o_bytes}) // {stage_bytes}) (not for FP8, runtime block sparsity, inputs the "
                                            "mask reads or the score reads at a position, block patterns, head_dim 256; packed sequences: a program "
                                            "per tile)",
                      f"{persistent_stages} stages" if persistent else "none"))
    threads = 32 * 4 * (consumers + 1)
    cap = entry_regs(consumers)
    consumer_regs = consumer_regs_of(consumers)
    steps.append(Step("registers", f"{REGISTERS_PER_SM} / {threads} threads = {cap} at entry; load keeps {LOAD_REGS}, consumers get "
                                   f"min(240, ({REGISTERS_PER_SM // 128} - {LOAD_REGS}) / {consumers})", f"{consumer_regs}"))
    skip_empty = isinstance(spec.sparsity, Expr) and base.classify
    steps.append(Step("key tiles visited", "a block pattern (sparsity = ...) leaves holes: only those not proved empty" if skip_empty else
                      "the range from the first to the last not proved empty (no holes in it: no branch)",
                      "not proved empty" if skip_empty else "range"))
    if base.score is not None:  # how the kernels compute the score modification (render.py: its code)
        if bias_of(base) is None:
            steps.append(Step("score modification", "computed score by score (no separable bias: lang.analysis.separable_bias)", "per score"))
        else:
            affine = key_part_affine(base)
            bias_mma = affine and d <= BIAS_MMA_MAX_HEAD_DIM
            how = ("its offsets in a tile by the tensor cores, a product of ones and those offsets chained onto Q K^T, the tile's first "
                   "key's value in each row's maximum; the forward at this head dim" if bias_mma
                   else "a tile's first key's value plus a vector of offsets made once an item" if affine else "key by key")
            steps.append(Step("score modification", f"score + L, L a sum of a row's and a key's terms: the key part L(r, kv_idx) added per key "
                                                     f"({how}), the row part in the lse (a row's softmax ignores a constant)", "separable bias"))
    # (the backward's two consumer warpgroups)
    bwd = _plan_backward(base, consumer_regs_of(2), reads_inputs) if d in BACKWARD_HEAD_DIMS and dv == d else {"has_backward": False}
    piece = 0
    tiles = (consumers * M_PER_WARPGROUP, block_n, bwd.get("bwd_block_m", 0), bwd.get("bwd_block_n", 0))
    if isinstance(spec.sparsity, Expr) and base.classify and max(tiles) > spec.sparse_block:
        whole, pieces, total = _empty_tiles(base, consumers * M_PER_WARPGROUP, block_n, spec.sparse_block)
        piece = spec.sparse_block if pieces - whole >= PIECES_MIN_GAIN * total else 0
        steps.append(Step("tile classes", f"by {spec.sparse_block} x {spec.sparse_block} pieces where that proves >= {PIECES_MIN_GAIN:.0%} more tiles empty "
                                          f"(N={PIECES_PROBE_N}: {pieces} of {total} by pieces, {whole} whole)",
                          f"{piece} x {piece} pieces" if piece else "whole tiles"))
    return GluonPlan(base, consumers, block_n, stages, LOAD_REGS, consumer_regs, tuple(steps), skip_empty, piece, **bwd, persistent=persistent,
                     persistent_stages=persistent_stages, persistent_max_keys=PERSISTENT_MAX_KEYS, classes_read_inputs=reads_inputs,
                     bias_mma=bias_mma, qk_tail=qk_tail)


def _empty_tiles(base: KernelPlan, block_m: int, block_n: int, piece: int) -> tuple[int, int, int]:
    """(tiles proved empty whole, tiles whose every piece is proved empty, all tiles) of the forward's tiles at
    PIECES_PROBE_N tokens: what classifying by pieces gains for this mask (its cost, a loop over the pieces of
    the tiles left partial, showed in every pattern measured on the H100, 2026-11-25)."""
    n = PIECES_PROBE_N
    whole = classify_tiles(base.mask, n, n, block_m, block_n)
    small = classify_tiles(base.mask, n, n, piece, piece)
    rm, rn = block_m // piece, block_n // piece
    pieces = sum(all(small[i * rm + a][j * rn + c] is TileClass.EMPTY for a in range(rm) for c in range(rn))
                 for i in range(len(whole)) for j in range(len(whole[0])))
    return sum(c is TileClass.EMPTY for row in whole for c in row), pieces, len(whole) * len(whole[0])


def _classes_read_inputs(base: KernelPlan) -> bool:
    """Whether the mask's tile classes read the inputs' pre-pass summaries (a document mask), as the kernels classify."""
    if base.mask is None or not base.classify:
        return False
    code = lower_tile_class(base.mask, ex.Scope("mask", ex.MASK_VARS, base.spec.inputs_by_name))
    return code is not None and bool(code.bounds)


def _plan_backward(base: KernelPlan, consumer_regs: int, reads_inputs: bool) -> dict:
    """The backward's sizes. Per consumer warpgroup (64 keys) the registers hold dK and dV (2 x 64 x d float32)
    and the transposed score tiles S^T and dP^T (2 x 64 x BLOCK_M float32): 2 * 64 * (d + BLOCK_M) / 128 per
    thread, which the 240 of a consumer must hold with the dQ tile and addresses. reads_inputs: the tile classes
    read the inputs (_classes_read_inputs)."""
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
    dq_bytes = block_m * d * 4  # both warpgroups' halves, float32
    stage_bytes = 2 * block_m * (d * isz + 4)  # Q and dO tiles, their rows' lse and delta (float32)
    smem = tgt.smem_per_block - SMEM_RESERVE
    stages = min(3, (smem - kv_bytes - ds_bytes - dq_bytes) // stage_bytes)
    steps.append(Step("ring stages", f"min(3, (smem {smem} - K,V {kv_bytes} - dS^T x2 {ds_bytes} - dQ {dq_bytes}) // (Q,dO,lse,delta stage {stage_bytes}))",
                      f"{stages}"))
    persistent_keys = PERSISTENT_BACKWARD_MAX_KEYS.get(d, 0) if spec.deterministic else 0
    any_length = bool(persistent_keys) and reads_inputs
    rule = ", ".join(f"{keys} keys at head_dim {dim}" for dim, keys in PERSISTENT_BACKWARD_MAX_KEYS.items())
    steps.append(Step("persistent backward", f"calls of <= {rule}, or of any length where the tile classes read the inputs (short work "
                                             "items whatever the length: documents), dQ in a fixed order: a program per SM takes key tiles by "
                                             "ticket, the next one's K and V loading under the last one's end (measured faster there only)",
                      "every call" if any_length else f"calls of <= {persistent_keys} keys" if persistent_keys else "none"))
    if any_length:
        persistent_keys = PERSISTENT_BACKWARD_ANY_LENGTH
    max_positions = FLOAT_POSITIONS if converts_positions(base) else 0
    if max_positions:
        steps.append(Step("positions as floats", f"a sum of positions in the score (ALiBi's q_idx - kv_idx): a float per row and column, "
                                                 f"one subtraction per score (exact for lengths <= {FLOAT_POSITIONS})",
                          f"calls of <= {FLOAT_POSITIONS} tokens; longer ones take the Triton backward"))
    return {"bwd_block_n": block_n, "bwd_block_m": block_m, "bwd_stages": stages, "bwd_consumer_regs": consumer_regs,
            "dq_split": dq_split, "bwd_steps": tuple(steps), "bwd_persistent_max_keys": persistent_keys, "bwd_max_positions": max_positions}
