"""plan(spec, target) -> KernelPlan: tile sizes from on-chip memory, every step of the derivation recorded.

The starting point is FlashAttention's rule (Dao et al. 2022, Algorithm 1): with M elements of on-chip
memory, key/value tiles of B_c = ceil(M / 4d) rows and query tiles of B_r = min(B_c, d) rows let the four
tiles K_j, V_j, Q_i, O_i fit at once. Triton then needs powers of two, the matrix units want at least 16
rows, and the tiles that stay live in registers (the float32 accumulator and score tile) must fit in the
register file: each of those adjustments is a recorded step.
"""
from __future__ import annotations

import math
import warnings
from dataclasses import dataclass, field

from ..errors import PlanError
from ..lang import expr as ex
from ..lang.algebra import derivative, read_derivative
from ..lang.canonical import spec_hash
from ..lang.intervals import keeps_first_key
from ..lang.spec import Binary, Const, DType, Expr, Index, KVLayout, LoopOrder, Spec, Type, Var
from ..targets import Target, detect, get_target

MIN_TILE = 16  # smallest tile side the matrix instructions (and tl.dot) accept
MAX_TILE = 128  # a larger side makes the float32 score tile alone 64K+ registers per program
REG_BUDGET = 168  # float32 registers per thread we let the live tiles take (255 max; the rest: operands, indices)
MAX_STAGES = 3  # leave shared memory for Triton's layout conversions


@dataclass(frozen=True)
class Step:
    what: str
    formula: str
    value: str


@dataclass(frozen=True)
class ReadGrad:
    """A read of a float input in the score (e.g. bias[h, q_idx, kv_idx]): the backward can give that input a
    gradient, d loss / d read = (d loss / d score) * `derivative`, summed over every (b, h, q_idx, kv_idx)
    that reads the element.
    kind "uniform": no index involves q_idx or kv_idx (slopes[h]): each dQ program sums its rows in registers.
    kind "direct": every index is a bare b, h, q_idx or kv_idx (each at most once) or an integer constant
    (bias[h, q_idx, kv_idx]): the dQ kernel writes each pair's term to a (B, H, Nq, Nk) float32 buffer.
    kind "scatter": other index expressions with q_idx or kv_idx (rel[h, q_idx - kv_idx + 64]): the dQ kernel
    writes each pair's term to the same buffer; the host evaluates the indices over every pair and sums the terms
    of each element (a stable sort by element, then sums in that order).
    Every kind is reduced in a fixed order: the gradients are deterministic."""

    read: Index
    derivative: Expr
    kind: str


def read_grads(spec: Spec) -> tuple[ReadGrad, ...]:
    """The float input reads of the score, each with d score / d read (reads it does not depend on are left out)."""
    if spec.score is None:
        return ()
    scope = ex.Scope("score", ex.SCORE_VARS, spec.inputs_by_name)
    found = [e for e in ex.input_reads(spec.score) if spec.inputs_by_name[e.input].type is Type.FLOAT]
    out = []
    for read in found:
        derivative = read_derivative(spec.score, scope, read)
        if derivative == Const(0.0, Type.FLOAT):
            continue
        names = [i.name for i in read.indices if isinstance(i, Var)]
        if not ({"q_idx", "kv_idx"} & set().union(*(ex.variables(i) for i in read.indices))):
            kind = "uniform"
        elif all(isinstance(i, Var) and i.name in ("b", "h", "q_idx", "kv_idx") or (isinstance(i, Const) and i.type is Type.INT)
                 for i in read.indices) and len(names) == len(set(names)):
            kind = "direct"
        else:
            kind = "scatter"
        out.append(ReadGrad(read, derivative, kind))
    return tuple(out)


@dataclass(frozen=True)
class KernelPlan:
    spec: Spec
    spec_hash: str
    target: Target
    head_dim_pad: int
    scale: float
    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    # backward: the dK/dV kernel keeps a key tile of bwd_block_n rows and streams query tiles of bwd_block_m;
    # the dQ kernel keeps a query tile of dq_block_m rows and streams key tiles of dq_block_n.
    bwd_block_m: int
    bwd_block_n: int
    dq_block_m: int
    dq_block_n: int
    bwd_num_warps: int  # dK/dV kernel
    bwd_num_stages: int
    dq_num_warps: int
    dq_num_stages: int
    mask: Expr | None  # the mask with static block sparsity folded in
    score: Expr | None
    dscore: Expr | None  # d score / d (scaled q.k), for the backward
    steps: tuple[Step, ...] = field(compare=False)
    # False: kernels visit and mask every tile, as if nothing were proved (to measure what classification buys)
    classify: bool = True
    read_grads: tuple[ReadGrad, ...] = ()  # gradients of float inputs read in the score
    # the q_outer forward and the backward read Q, K, V and dO tiles through tensor descriptors (the TMA copy
    # engine; needs rows of head_dim * itemsize that are multiples of 16 bytes): measured, not derived
    tma: bool = False
    warp_specialize: bool = False  # the forward's loop over full tiles: tl.range(..., warp_specialize=True)
    # decoding (attngen/plan/decode.py): key tiles of decode_block_n rows, the rows of a key/value head's query heads
    decode_block_n: int = 64
    decode_num_warps: int = 4
    decode_num_stages: int = 2
    # with K in two parts (decode_tail): the stages when V is not the view of K it usually is (its own tiles too)
    decode_v_num_stages: int = 0
    # context parallelism (attngen/distributed): the forward and backward kernels take the position of their first
    # query and key in the whole sequence (q_offset, kv_offset) and its lengths (seq_q_len, seq_kv_len), which the
    # expressions see; a shard's kernels (runtime/shard.py), never a plain call's
    global_positions: bool = False
    value_dim_pad: int = 0  # V's and O's last dimension padded to a power of two (head_dim_pad where they match)

    @property
    def dtype(self) -> DType:
        return self.spec.dtype

    @property
    def head_dim(self) -> int:
        return self.spec.head_dim

    @property
    def value_dim(self) -> int:
        return self.spec.dv

    @property
    def decode_tail(self) -> int:
        """Above 256 columns (kv_layout = paged; DeepSeek's latent attention, 576 = 512 + 64) the decode kernels read
        K as two parts, its first value_dim columns, which V may share, and the head_dim - value_dim after them:
        that remainder's width. 0 for a K read whole."""
        return self.head_dim - self.value_dim if self.head_dim > 256 else 0

    @property
    def decode_tail_pad(self) -> int:
        """decode_tail padded to a power of two (tl.arange's), 0 without a tail."""
        return _pad(self.decode_tail) if self.decode_tail else 0

    @property
    def head_tail(self) -> int:
        """The training kernels take q.k as two products where that pads less than one (split_head_dim): over the
        first head_lead columns and the head_tail after them, padded to head_tail_pad. 0 for one product."""
        return split_head_dim(self.head_dim)[1]

    @property
    def head_lead(self) -> int:
        """With a head_tail, the columns of q.k's first product (the largest power of two below head_dim)."""
        return self.head_dim - self.head_tail if self.head_tail else 0

    @property
    def head_tail_pad(self) -> int:
        """head_tail padded to a power of two (tl.arange's), 0 without a tail."""
        return _pad(self.head_tail) if self.head_tail else 0

    @property
    def loop_order(self) -> LoopOrder:
        return self.spec.loop_order

    @property
    def tile_sizes(self) -> tuple[int, ...]:
        """Every tile size the forward and backward kernels use (powers of two)."""
        return (self.block_m, self.block_n, self.bwd_block_m, self.bwd_block_n, self.dq_block_m, self.dq_block_n)

    def tiles(self) -> dict[str, dict[str, int]]:
        """The launch configuration of each kernel (the generated module's TILES): its tile sides and options."""
        return {
            "fwd": {"BLOCK_M": self.block_m, "BLOCK_N": self.block_n, "num_warps": self.num_warps, "num_stages": self.num_stages},
            "dkdv": {"BLOCK_M": self.bwd_block_m, "BLOCK_N": self.bwd_block_n, "num_warps": self.bwd_num_warps, "num_stages": self.bwd_num_stages},
            "dq": {"BLOCK_M": self.dq_block_m, "BLOCK_N": self.dq_block_n, "num_warps": self.dq_num_warps, "num_stages": self.dq_num_stages},
            "decode": {"BLOCK_N": self.decode_block_n, "num_warps": self.decode_num_warps, "num_stages": self.decode_num_stages},
            **({"decode_v": {"BLOCK_N": self.decode_block_n, "num_warps": self.decode_num_warps, "num_stages": self.decode_v_num_stages}}
               if self.decode_tail else {}),
        }

    @property
    def tile_limits(self) -> tuple[int, int]:
        """The smallest and largest tile side the generated kernels accept: the plan's own tiles, or with tuning
        every side the tuner may try (it never leaves [MIN_TILE, MAX_TILE], nor a sparse block)."""
        if not self.spec.tune:
            return min(self.tile_sizes), max(self.tile_sizes)
        hi = MAX_TILE if self.spec.sparsity is None else min(MAX_TILE, self.spec.sparse_block)
        return MIN_TILE, hi

    @property
    def block_lists(self) -> bool:
        """Whether the Triton kernels walk lists of the blocks a static block pattern keeps, as runtime block sparsity's
        do, instead of classifying every tile of a row against the pattern and skipping the holes one tile at a time
        (attngen.runtime.Kernel evaluates the pattern once per shape on the device: runtime/blocks.py). For a
        pattern of the block indices, b and h alone (no length: the same lists for every sequence of a packed
        call), in a plain call's classified kernels, each tile inside one block (no tile larger than
        sparse_block, both powers of two): inside a kept block the pattern keeps every pair, so the tiles see
        the spec's mask alone."""
        s = self.spec
        if not isinstance(s.sparsity, Expr) or not self.classify or self.global_positions:
            return False
        if ex.variables(s.sparsity) & {"q_len", "kv_len"}:
            return False
        return self.tile_limits[1] <= s.sparse_block  # (tiles and sparse_block are powers of two: a tile lies in one block)

    @property
    def may_mask_rows(self) -> bool:
        """Whether a query row may have kept no key at some step (so the kernels need their 0/0 and -inf
        guards). Not when the mask provably keeps key 0 in every row (causal, prefix-LM: the forward visits a
        full tile or the tile of key 0 first) and no score modification can turn a score into -inf."""
        if self.score is not None or self.spec.sparsity == "runtime":
            return True  # a score modification may produce -inf (e.g. a bias input holding -inf); a block mask may drop key 0
        if self.global_positions and self.mask is not None:
            return True  # a shard's keys may all lie outside a row's window (key 0 of the sequence is in one shard)
        return self.mask is not None and not keeps_first_key(self.mask)

    def describe(self) -> str:
        t = self.target
        lines = [
            f"plan for {self.spec.name} on {t.full_name} ({t.name}, sm_{t.arch}, {t.sm_count} SMs)",
            f"  dtype {self.dtype.value}, head_dim {self.head_dim} (padded to {self.head_dim_pad}), "
            + (f"value_dim {self.value_dim} (padded to {self.value_dim_pad}), " if self.value_dim != self.head_dim else "") + f"scale {self.scale:.6g}",
            "",
            "derivation:",
        ]
        width = max(len(s.what) for s in self.steps)
        for s in self.steps:
            lines.append(f"  {s.what:<{width}}  {s.formula}  =>  {s.value}")
        if self.spec.tune:
            lines += ["", f"tuned on the GPU (auto): {', '.join(sorted(self.spec.tune))}, in every kernel, from the values below, once per "
                          f"shape bucket (attngen/plan/tune.py; `attngen tune` reports derived against tuned)"]
        lines += [
            "",
            f"forward  ({self.loop_order.value}): BLOCK_M={self.block_m} BLOCK_N={self.block_n} num_warps={self.num_warps} num_stages={self.num_stages}",
            f"backward dK/dV: BLOCK_M={self.bwd_block_m} BLOCK_N={self.bwd_block_n} num_warps={self.bwd_num_warps} num_stages={self.bwd_num_stages}; "
            f"dQ: BLOCK_M={self.dq_block_m} BLOCK_N={self.dq_block_n} num_warps={self.dq_num_warps} num_stages={self.dq_num_stages}",
            f"decode: BLOCK_N={self.decode_block_n} num_warps={self.decode_num_warps} num_stages={self.decode_num_stages}, rows = the query rows "
            f"of a key/value head's query heads (16..64 a program); keys split across programs (attngen plan --seq N)",
        ]
        if self.spec.kv_layout is KVLayout.PAGED:
            lines.append(f"kv_layout = paged ({self.spec.page_size}-token pages): every call runs the decode kernels (forward only)")
        return "\n".join(lines)


def split_head_dim(d: int) -> tuple[int, int]:
    """(lead, tail): q.k over a head_dim that is not a power of two as two products, over its first `lead` columns (the
    largest power of two below d) and the `tail` after them (padded to a power of two), where those pad less than
    one product of d rounded up: DeepSeek's 192 = 128 + 64 is 192 columns of work where one product takes 256, and
    80 = 64 + 16 takes 80 where one takes 128. (d, 0) where one product pads as little (powers of two, 24, 112, 200)
    and above 256 (decoding only: KernelPlan.decode_tail)."""
    lead = 1 << (d.bit_length() - 1)
    if d > 256 or lead == d or lead + _pad(d - lead) >= _pad(d):
        return d, 0
    return lead, d - lead


def _pad(n: int) -> int:
    """n rounded up to a power of two, at least MIN_TILE: the columns of a tile that holds n."""
    return max(MIN_TILE, 1 << (n - 1).bit_length())


def _pow2_floor(n: int) -> int:
    return 1 << (max(1, n).bit_length() - 1)


def _regs(tiles: int, warps: int) -> int:
    return math.ceil(tiles / (32 * warps))


class TargetWarning(UserWarning):
    """`target = auto` on a machine without a CUDA device: the plan is for DEFAULT_TARGET."""


DEFAULT_TARGET = "h100"  # what `auto` plans for where no GPU is visible (Triton's interpreter runs any plan)
_warned_default_target = False


def resolve_target(spec: Spec, target: str | Target | None) -> Target:
    """The Target object for an override, the spec's own target, or the live device for `auto` (DEFAULT_TARGET,
    with a TargetWarning once per process, where no CUDA device is visible: on CPU tensors the kernels run in
    Triton's interpreter, whatever GPU they were planned for)."""
    if isinstance(target, Target):
        return target
    if target is not None and not isinstance(target, str):
        raise PlanError(f"target must be a GPU's name (`attngen targets` lists them) or 'auto', got {target!r}")
    name = target or spec.target
    if name == "auto":
        import torch

        if not torch.cuda.is_available():
            global _warned_default_target
            if not _warned_default_target:
                _warned_default_target = True
                warnings.warn(f"target = auto: no CUDA device is visible, so attngen plans for {DEFAULT_TARGET} (CPU tensors run "
                              f"in Triton's interpreter, which runs any target's kernels); name one with target= or --target",
                              TargetWarning, stacklevel=4)
            return get_target(DEFAULT_TARGET)
        return detect()
    return get_target(name)


def compares_rows_and_columns_by_input(mask: Expr | None) -> bool:
    """Whether the mask reads an input at a query index and an input at a key index (documents:
    doc[b, q_idx] == doc[b, kv_idx]): a block structure the compiler cannot see, which leaves partial tiles
    along every block's edges."""
    sides = set().union(*(ex.variables(i) for read in ex.input_reads(mask) for i in read.indices))
    return {"q_idx", "kv_idx"} <= sides


def effective_mask(spec: Spec) -> Expr | None:
    """The spec's mask AND its static block sparsity (q_blk = q_idx // sparse_block, likewise kv_blk)."""
    mask = spec.mask
    if isinstance(spec.sparsity, Expr):
        blk = Const(spec.sparse_block, Type.INT)
        sparse = ex.substitute(spec.sparsity, {"q_blk": Binary("//", Var("q_idx"), blk), "kv_blk": Binary("//", Var("kv_idx"), blk)})
        mask = sparse if mask is None else Binary("and", mask, sparse)
    return mask


def plan(spec: Spec, target: str | Target | None = None, *, classify: bool = True) -> KernelPlan:
    """Derive the kernel plan. Pure: the same spec and target always give the same plan. `classify=False`
    turns tile classification off (every tile visited and masked): a baseline for measurements."""
    tgt = resolve_target(spec, target)
    if spec.sparsity == "runtime":
        for key, value in (("block_m", spec.block_m), ("block_n", spec.block_n)):
            if value is not None and value > spec.sparse_block:
                raise PlanError(f"{spec.name}: {key} = {value} is larger than sparse_block = {spec.sparse_block}; with sparsity = runtime "
                                f"every tile must lie inside one sparse block (tile sizes are powers of two <= sparse_block)")
    if spec.dtype is DType.BF16 and not tgt.supports_bf16:
        cc = ".".join(map(str, tgt.compute_capability))
        raise PlanError(f"{spec.name}: bf16 needs compute capability 8.0 or newer; {tgt.full_name} is {cc} (use dtype = fp16)")
    if spec.dtype is DType.FP8:
        if tgt.arch < 89:
            cc = ".".join(map(str, tgt.compute_capability))
            raise PlanError(f"{spec.name}: dtype = fp8 needs FP8 tensor cores (compute capability 8.9 or newer); {tgt.full_name} is {cc}")
        if spec.loop_order is LoopOrder.KV_OUTER:
            raise PlanError(f"{spec.name}: dtype = fp8 has a q_outer forward only; remove loop_order = kv_outer")
        if spec.kv_layout is KVLayout.PAGED:
            raise PlanError(f"{spec.name}: dtype = fp8 is not supported with kv_layout = paged yet (FP8 key/value caches)")

    steps: list[Step] = []
    isz = spec.dtype.itemsize
    d = spec.head_dim
    dp = max(MIN_TILE, 1 << (d - 1).bit_length())
    smem = tgt.smem_per_block
    M = smem // isz
    steps.append(Step("on-chip memory per block", f"{smem} bytes / {isz} bytes per {spec.dtype.value}", f"M = {M} elements"))
    if dp != d:
        steps.append(Step("padded head dim", f"next power of two >= {d}", f"d_pad = {dp}"))
    lead, tail = split_head_dim(d)
    dqk = lead + _pad(tail) if tail else dp  # the columns of a Q or K tile in the training kernels
    qkn = "d_qk" if tail else "d_pad"
    if tail:
        steps.append(Step("q.k in two products", f"{d} = {lead} + {tail}" + (f" (padded to {_pad(tail)})" if _pad(tail) != tail else "")
                          + f": {dqk} columns where one product takes {dp}", f"d_qk = {dqk}"))
    dv = spec.dv  # V's and O's columns: the value tile, the accumulators of O and dV, and dO are dv_pad wide
    dvp = max(MIN_TILE, 1 << (dv - 1).bit_length())
    if dv != d:
        steps.append(Step("value dim", f"value_dim = {dv}" + (f", next power of two {dvp}" if dvp != dv else ""), f"dv_pad = {dvp}"))
    b_c = math.ceil(M / (4 * d))
    steps.append(Step("paper: key tile", f"B_c = ceil(M / 4d) = ceil({M} / {4 * d})", f"{b_c}"))
    b_r = min(b_c, d)
    steps.append(Step("paper: query tile", f"B_r = min(B_c, d) = min({b_c}, {d})", f"{b_r}"))

    def clamp(name: str, n: int) -> int:
        p = min(MAX_TILE, max(MIN_TILE, _pow2_floor(n)))
        if p != n:
            steps.append(Step(f"{name}: power of two in [{MIN_TILE}, {MAX_TILE}]", f"round down {n}", f"{p}"))
        return p

    bn = clamp("BLOCK_N", b_c)
    bm = clamp("BLOCK_M", b_r)
    if spec.block_m is not None:
        steps.append(Step("BLOCK_M override", "spec: block_m", f"{spec.block_m}"))
        bm = spec.block_m
    if spec.block_n is not None:
        steps.append(Step("BLOCK_N override", "spec: block_n", f"{spec.block_n}"))
        bn = spec.block_n
    elif tgt.arch >= 90 and dp == 64 and spec.dtype is not DType.FP32 and bn > 64:
        # `attngen tune` on the H100 (2026-11-22): at d=64 in bf16 the forward with 64-key tiles was
        # 1.09x (causal) and 1.10x (dense) faster than with 128 at N=4096
        steps.append(Step("BLOCK_N, measured", "best of attngen tune at d=64, 16-bit, sm_90", f"{bn} -> 64"))
        bn = 64

    if (tgt.arch >= 90 and dp == 128 and spec.dtype is not DType.FP32 and spec.block_m is None and spec.block_n is None
            and compares_rows_and_columns_by_input(effective_mask(spec))):
        # measured on the H100 (2026-11-22): packed documents of 256-2048 tokens at d=128 in bf16 ran
        # the forward 1.27-1.34x faster with 64x64 tiles (4 warps) than with 128x128 (8): fewer masked pairs along
        # the documents' edges. Masks read at one side only (key padding) keep the derived tiles.
        steps.append(Step("forward tiles, measured", "mask compares inputs read at q_idx and at kv_idx (documents); d=128, 16-bit, sm_90",
                          f"BLOCK_M {bm} -> 64, BLOCK_N {bn} -> 64"))
        bm, bn = 64, 64

    warps = 8 if bm >= 128 or dp >= 256 else 4
    steps.append(Step("num_warps", "8 if BLOCK_M >= 128 or d_pad >= 256 else 4", f"{warps}"))
    if spec.num_warps is not None:
        steps.append(Step("num_warps override", "spec: num_warps", f"{spec.num_warps}"))
        warps = spec.num_warps
    # Live in registers per program: acc (BM x dv_pad fp32), the score tile (BM x BN fp32) and the query tile.
    while True:
        live = bm * dvp + bm * bn + bm * dqk * isz // 4
        regs = _regs(live, warps)
        if regs <= REG_BUDGET or (bn == MIN_TILE and bm == MIN_TILE) or spec.block_m or spec.block_n:
            break
        if bn > 32 and bn >= bm // 2:
            steps.append(Step("registers", f"(BM*dv_pad + BM*BN + q tile) / {32 * warps} threads = {regs} > {REG_BUDGET}", f"BLOCK_N {bn} -> {bn // 2}"))
            bn //= 2
        else:
            steps.append(Step("registers", f"(BM*dv_pad + BM*BN + q tile) / {32 * warps} threads = {regs} > {REG_BUDGET}", f"BLOCK_M {bm} -> {bm // 2}"))
            bm //= 2
    steps.append(Step("forward registers", f"(BM*dv_pad + BM*BN + q tile) / {32 * warps} threads", f"{regs} per thread"))

    # fp32 products (input_precision="ieee") feed P to the second product through shared memory; 16-bit P stays in
    # registers. Measured on the H100: fp32 at d=64 with 3 stages needed 246016 bytes where Q + 3 K/V stages are 212992.
    # Dropout: a key tile of 64 or more keys gets its keep tile in the score tile's own layout (each thread draws
    # the Philox values of the keys it holds: templates/triton/dropout.py.jinja); a smaller one is cut from a 64-key
    # group, which goes through shared memory, one byte per pair (were every tile cut so, 128x128 tiles at d=128
    # would need 245760 bytes with 3 stages on the H100, 16384 more than without dropout).
    def keep_bytes(bn: int) -> int:
        return 1 if spec.dropout > 0.0 and bn < 64 else 0

    def smem_use(bm: int, bn: int) -> tuple[int, int]:
        return bm * dqk * isz + (bm * bn * 4 if spec.dtype is DType.FP32 else 0) + bm * bn * keep_bytes(bn), bn * (dqk + dvp) * isz

    q_bytes, stage_bytes = smem_use(bm, bn)
    while (smem - q_bytes) // stage_bytes < 1 and max(bm, bn) > MIN_TILE and not (spec.block_m or spec.block_n):
        need = q_bytes + stage_bytes
        if bn >= bm:
            bn //= 2
            steps.append(Step("shared memory", f"Q tile + one K/V stage = {need} > {smem} bytes", f"BLOCK_N -> {bn}"))
        else:
            bm //= 2
            steps.append(Step("shared memory", f"Q tile + one K/V stage = {need} > {smem} bytes", f"BLOCK_M -> {bm}"))
        q_bytes, stage_bytes = smem_use(bm, bn)
    stages = (smem - q_bytes) // stage_bytes
    if stages < 1:
        raise PlanError(
            f"{spec.name}: tiles BLOCK_M={bm}, BLOCK_N={bn} at head_dim {d} need {q_bytes + stage_bytes} bytes of shared memory; "
            f"{tgt.full_name} has {smem} per block (lower block_m / block_n)"
        )
    stages_c = min(MAX_STAGES, stages)
    extra = (" - P tile" if spec.dtype is DType.FP32 else "") + (" - keep tile" if keep_bytes(bn) else "")
    steps.append(Step("forward num_stages", f"min({MAX_STAGES}, (smem - Q tile{extra} {q_bytes}) // (K+V stage {stage_bytes}))", f"{stages_c}"))
    if spec.num_stages is not None:
        steps.append(Step("num_stages override", "spec: num_stages", f"{spec.num_stages}"))
        stages_c = spec.num_stages

    # Backward, dK/dV kernel: dK and dV accumulators (BN x d_qk and BN x dv_pad fp32) plus the transposed score and dP tiles.
    bwd_warps = 8 if dp >= 64 else 4
    kbn = min(bn if spec.block_n else MAX_TILE, max(MIN_TILE, _pow2_floor(b_c)))
    kbm = 64
    while _regs(kbn * (dqk + dvp) + 2 * kbn * kbm, bwd_warps) > REG_BUDGET and kbm > MIN_TILE:
        kbm //= 2
    while _regs(kbn * (dqk + dvp) + 2 * kbn * kbm, bwd_warps) > REG_BUDGET and kbn > MIN_TILE:
        kbn //= 2
    steps.append(Step("backward dK/dV tiles", f"(BN*({qkn} + dv_pad) + 2*BN*BM) / {32 * bwd_warps} threads <= {REG_BUDGET}", f"BLOCK_N={kbn}, BLOCK_M={kbm}"))
    if tgt.arch >= 90 and dp == 128 and spec.dtype is not DType.FP32 and not spec.block_n:
        # a sweep on the H100 (2026-11-22): of 18 dK/dV configs at d=128 in bf16, 64x32 tiles with 4 warps were
        # the fastest for causal (1.09x the rule above) and sliding-window (1.12x) masks
        kbn, kbm, dkdv_warps = 64, 32, 4
        steps.append(Step("backward dK/dV tiles, measured", "best of a tile sweep at d=128, bf16, sm_90", "BLOCK_N=64, BLOCK_M=32, 4 warps"))
    elif tgt.arch >= 90 and dp == 64 and spec.dtype is not DType.FP32 and not spec.block_n:
        # a sweep on the H100 (2026-11-22): of 9 dK/dV configs at d=64 in bf16, 64x64 tiles
        # with 4 warps beat the rule's 128x64 with 8 on dense and causal at N = 4096 and 16384 (1.02-1.10x the backward)
        kbn, kbm, dkdv_warps = 64, 64, 4
        steps.append(Step("backward dK/dV tiles, measured", "best of a tile sweep at d=64, bf16, sm_90", "BLOCK_N=64, BLOCK_M=64, 4 warps"))
    elif tgt.arch >= 90 and dqk == 192 and dvp == 128 and spec.dtype is not DType.FP32 and not spec.block_n:
        # a sweep on the H200 (2026-11-29; 192 = 128 + 64 with value_dim 128, causal, bf16, N = 4096): of 24 dK/dV
        # configs, 128-key tiles streaming 32 query rows with 8 warps were the fastest (the whole backward 1.59 ms; the
        # rule's 64 x 16 with 8 warps took 2.26x as long); 64 x 16 with 4 warps 1.05x, 128 x 64 1.06x. (V padded to 256
        # columns, head_dim 192 without a value_dim, was not measured: the rule's tiles there.)
        kbn, kbm, dkdv_warps = 128, 32, 8
        steps.append(Step("backward dK/dV tiles, measured", "best of a tile sweep at d_qk = 192, value_dim 128, bf16, sm_90", "BLOCK_N=128, BLOCK_M=32, 8 warps"))
    else:
        dkdv_warps = bwd_warps
    # dQ kernel: dQ accumulator (BM x d_qk) plus score and dP tiles (BM x BN).
    qbm, qbn = bm, 64
    while _regs(qbm * dqk + 2 * qbm * qbn, bwd_warps) > REG_BUDGET and qbn > MIN_TILE:
        qbn //= 2
    while _regs(qbm * dqk + 2 * qbm * qbn, bwd_warps) > REG_BUDGET and qbm > MIN_TILE:
        qbm //= 2
    steps.append(Step("backward dQ tiles", f"(BM*{qkn} + 2*BM*BN) / {32 * bwd_warps} threads <= {REG_BUDGET}", f"BLOCK_M={qbm}, BLOCK_N={qbn}"))
    # as the forward: two warp groups for 128-row query tiles. `attngen tune` on the H100 moved d=64's 64-row dQ
    # tiles from 8 warps to 4: the whole backward 1.31x (dense) and 1.33x (causal) faster at N=4096
    dq_warps = 8 if qbm >= 128 or dp >= 256 else 4
    steps.append(Step("backward dQ num_warps", "8 if BLOCK_M >= 128 or d_pad >= 256 else 4", f"{dq_warps}"))
    resident = kbn * (dqk + dvp) * isz + (2 * kbn * max(kbm, qbn) * 4 if spec.dtype is DType.FP32 else 0)  # fp32: P and dS via smem
    # dropout: dK/dV transposes its keep tile (as float32 Z) through shared memory; dQ's is cut from a group when small
    resident += max(4 * kbm * kbn, qbm * qbn * keep_bytes(qbn)) if spec.dropout > 0.0 else 0
    bwd_stage = kbm * (dqk + dvp) * isz
    bwd_stages = max(1, min(MAX_STAGES, (smem - resident) // bwd_stage))
    steps.append(Step("backward num_stages", f"min({MAX_STAGES}, (smem - K,V{' - P,dS' if spec.dtype is DType.FP32 else ''} {resident}) // (Q+dO stage {bwd_stage}))", f"{bwd_stages}"))

    if spec.sparsity is not None:
        # Runtime: the kernels walk lists of kept blocks, so a tile must not straddle two blocks (powers of two:
        # <= divides). Static: the block pattern is part of the mask; a tile inside one block row and column sees
        # q_blk and kv_blk as single values, so the classifier decides it exactly (a larger one is mostly partial).
        S = spec.sparse_block
        fits = [min(t, S) for t in (bm, bn, kbm, kbn, qbm, qbn)]
        if fits != [bm, bn, kbm, kbn, qbm, qbn]:
            steps.append(Step("block sparsity", f"every tile <= sparse_block = {S}", "tiles " + ", ".join(map(str, fits))))
        bm, bn, kbm, kbn, qbm, qbn = fits

    # Decoding: a program holds up to 64 query rows (a key/value head's query heads x the new tokens), so its
    # registers are not the limit; the key tiles are, as K and V stream through shared memory once. Measured on the
    # H100 (2026-11-25; bf16, d=128, 32 query / 8 KV heads): a contiguous cache read at
    # 94-102 % of the copy rate with 64-key tiles from B*N = 262144 keys up, 4 stages no worse than 2 or 3; a paged
    # cache of 16-token pages at 94-98 % with 128-key tiles (8 pages a tile) and 2 stages, 82-92 % with 64-key tiles.
    paged = spec.kv_layout is KVLayout.PAGED and spec.page_size < 128
    dec_bn = 128 if paged and dp <= 128 else 64 if dp <= 128 else 32
    if spec.sparsity is not None:
        dec_bn = min(dec_bn, spec.sparse_block)
    dec_q = 64 * dp * isz
    dec_stage = dec_bn * (dp + dvp) * isz + (64 * dec_bn * 4 if spec.dtype is DType.FP32 else 0)
    dec_warps = 4
    dec_v_stages = 0
    if d > 256:  # K in two parts (KernelPlan.decode_tail): a tile of value_dim columns (V's too, when V is a view of
        # them) and one of the rest; the rows' O (64 x value_dim float32) takes the registers of 8 warps. Measured on
        # the H200 (2026-11-28; 576 / 512, 128 query heads, B = 8-64, 8192 keys, V a view of K): 32-key tiles in 3
        # stages 1.22-1.23x the speed of 2, 64-key tiles in 2 stages 0.94-1.04x of that; 4 warps half the speed of 8
        tail_pad = max(MIN_TILE, 1 << (d - dv - 1).bit_length())  # KernelPlan.decode_tail_pad
        dec_q = 64 * (dv + tail_pad) * isz
        extra = 64 * dec_bn * 4 if spec.dtype is DType.FP32 else 0
        dec_v_stages = max(1, min(3, (smem - dec_q) // (dec_bn * (dv + tail_pad + dv) * isz + extra)))
        dec_stage = dec_bn * (dv + tail_pad) * isz + extra  # V a view of K: its tile is K's
        dec_warps = 8
    # paged: 3 stages since the block table's entries are read a tile ahead (the kernel's _tile_pages): on the H100
    # (2026-11-26) 0.94-0.98x the time of 2 stages at 8192-32768 keys (B=1) and B=8 at 4096,
    # 1.03-1.05x at B=1 4096; with the entries read in the tile's own step, 3 stages were slower than 2 everywhere
    dec_stages = max(1, min(3 if paged else 4, (smem - dec_q) // dec_stage))
    why_bn = "128 (pages under 128 tokens: a tile gathers several)" if paged and dp <= 128 else "64" if dp <= 128 else "32 (d_pad above 128)"
    steps.append(Step("decode tiles", f"BLOCK_N = {why_bn}; "
                                      f"num_stages = min({3 if paged else 4}, (smem - Q {dec_q}) // ({'K stage, V a view of it' if d > 256 else 'K+V stage'} "
                                      f"{dec_stage})); measured",
                      f"BLOCK_N={dec_bn}, num_stages={dec_stages}, {dec_warps} warps"))
    if spec.kv_dtype is DType.FP8 and dp <= 128 and spec.sparsity is None:
        # FP8 caches on the H100 (2026-11-26; B=8, 32/8 heads, d=128, one token, 8k-32k keys): the
        # bf16 cache's tiles read them at half the rate (each element widened to bf16 costs what its byte saved); 8 warps
        # and longer tiles: contiguous 256 keys, 3 stages (269 against 360 us at 32k); paged 128 keys, 3 stages (391 against 438)
        dec_bn, dec_stages, dec_warps = (128 if paged else 256), 3, 8
        steps.append(Step("decode tiles, FP8 cache", "measured: 8 warps, 3 stages, longer key tiles", f"BLOCK_N={dec_bn}, num_stages=3, 8 warps"))

    # Tile loads stay pointer loads. The templates can read Q, K, V and dO through tensor descriptors (Hopper's
    # copy engine, KernelPlan.tma), but on the H100 with Triton 3.6 that was 1-12% slower on every planned
    # configuration (measured 2026-11-22), so no plan turns it on.

    mask = effective_mask(spec)
    score = spec.score
    dscore = None
    if score is not None:
        scope = ex.Scope("score", ex.SCORE_VARS, spec.inputs_by_name)
        dscore = derivative(score, scope)
    return KernelPlan(
        spec=spec,
        spec_hash=spec_hash(spec),
        target=tgt,
        head_dim_pad=dp,
        value_dim_pad=dvp,
        scale=spec.softmax_scale,
        block_m=bm,
        block_n=bn,
        num_warps=warps,
        num_stages=stages_c,
        bwd_block_m=kbm,
        bwd_block_n=kbn,
        dq_block_m=qbm,
        dq_block_n=qbn,
        bwd_num_warps=dkdv_warps,
        bwd_num_stages=bwd_stages,
        dq_num_warps=dq_warps,
        dq_num_stages=bwd_stages,
        mask=mask,
        score=score,
        dscore=dscore,
        steps=tuple(steps),
        classify=classify,
        read_grads=read_grads(spec),
        decode_block_n=dec_bn,
        decode_num_stages=dec_stages,
        decode_num_warps=dec_warps,
        decode_v_num_stages=dec_v_stages,
    )
