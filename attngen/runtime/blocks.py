"""Runtime block sparsity (`sparsity = runtime`): block masks and the kept-block lists the kernels walk; the same
lists for a static block pattern (pattern_lists), which the Triton generator's kernels walk likewise.

A block mask is a bool tensor (B or 1, H or 1, ceil(Nq / S), ceil(Nk / S)) for the spec's `sparse_block` S:
block (i, j) keeps the pairs q_idx in [i S, (i + 1) S), kv_idx in [j S, (j + 1) S) that the spec's mask keeps;
every other pair is dropped. The kernels do not read the mask itself: it becomes two lists (once per mask
tensor: attngen.runtime.Kernel keeps the last mask's lists while that tensor is unmodified),
like a compressed sparse row matrix and its transpose, which the forward and dQ kernels (rows of query
blocks) and the dK/dV kernel (rows of key blocks) walk, so they visit only kept blocks.
"""
from __future__ import annotations

import weakref
from typing import Callable

import torch

from ..errors import InputError
from ..lang.expr import SPARSITY_VARS, Scope, variables
from .evaluate import evaluate


def block_mask_from(fn: Callable, q_len: int, kv_len: int, *, sparse_block: int = 128, batch: int = 1, heads: int = 1,
                    device="cpu") -> torch.Tensor:
    """The block mask (batch, heads, ceil(q_len / S), ceil(kv_len / S)) with fn(b, h, q_blk, kv_blk) -> bool,
    called once with broadcasting index tensors (so write it with tensor operations: `&`, `|`, `torch.where`).
    Example, local + global blocks: `lambda b, h, i, j: ((i - j).abs() <= 2) | (j == 0)`."""
    if sparse_block < 1:
        raise InputError(f"sparse_block must be positive, got {sparse_block}")
    rows, cols = -(-q_len // sparse_block), -(-kv_len // sparse_block)
    shape = (batch, heads, rows, cols)
    idx = [torch.arange(n, device=device).view([n if a == axis else 1 for a in range(4)]) for axis, n in enumerate(shape)]
    out = torch.as_tensor(fn(*idx), device=device)
    if out.dtype != torch.bool:
        raise InputError(f"block_mask_from: fn must return booleans, got {out.dtype}")
    return out.broadcast_to(shape).contiguous()


def block_mask_from_dense(mask: torch.Tensor, sparse_block: int = 128) -> torch.Tensor:
    """The block mask that keeps every block holding at least one kept pair of an element mask
    (..., Nq, Nk) (bool; leading dims as the block mask's). With the same mask in the spec (or the element
    mask applied otherwise), attention is unchanged and the empty blocks are skipped."""
    if mask.dtype != torch.bool or mask.dim() < 2:
        raise InputError(f"block_mask_from_dense needs a bool tensor (..., Nq, Nk), got {mask.dtype} of shape {tuple(mask.shape)}")
    if isinstance(sparse_block, bool) or not isinstance(sparse_block, int) or sparse_block < 1:
        raise InputError(f"sparse_block must be a positive integer (the spec's sparse_block), got {sparse_block!r}")
    *lead, nq, nk = mask.shape
    rows, cols = -(-nq // sparse_block), -(-nk // sparse_block)
    padded = mask.new_zeros(*lead, rows * sparse_block, cols * sparse_block)
    padded[..., :nq, :nk] = mask
    return padded.view(*lead, rows, sparse_block, cols, sparse_block).any(-1).any(-2)


def block_lists(block_mask, sparse_block: int, batch: int, heads: int, q_len: int, kv_len: int,
                device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Checked block mask -> (rows of query blocks, rows of key blocks), each (batch, heads, rows, 1 + cols)
    int32 (broadcast dims with stride 0): entry 0 the number of kept blocks, then their indices ascending."""
    rows, cols = -(-q_len // sparse_block), -(-kv_len // sparse_block)
    want = f"(batch {batch} or 1, heads {heads} or 1, ceil(q_len / {sparse_block}) = {rows}, ceil(kv_len / {sparse_block}) = {cols})"
    if not isinstance(block_mask, torch.Tensor):
        raise InputError(f"block_mask must be a bool torch.Tensor {want}, got {type(block_mask).__name__} "
                         f"(attngen.block_mask_from builds one)")
    if block_mask.dtype != torch.bool:
        raise InputError(f"block_mask must be bool, got {block_mask.dtype}")
    shape = tuple(block_mask.shape)
    if len(shape) != 4 or shape[0] not in (1, batch) or shape[1] not in (1, heads) or shape[2:] != (rows, cols):
        raise InputError(f"block_mask has shape {shape}; expected {want} for sparse_block = {sparse_block}")
    if block_mask.device != device:
        raise InputError(f"block_mask is on {block_mask.device}, q on {device}")
    return tuple(_lists(m).expand(batch, heads, -1, -1) for m in (block_mask, block_mask.transpose(-1, -2)))


def pattern_lists(spec, batch: int, heads: int, q_len: int, kv_len: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """A static block pattern's lists (KernelPlan.block_lists: `sparsity = <expression of q_blk, kv_blk, b, h>`), as
    block_lists gives a block mask's: the expression evaluated at every pair of blocks of a call of these sizes, on
    `device` (exact integers, float64 where it computes floats, as the reference does), over b and h only where it
    reads them."""
    size = spec.sparse_block
    rows, cols = -(-q_len // size), -(-kv_len // size)
    names = variables(spec.sparsity)
    shape = (batch if "b" in names else 1, heads if "h" in names else 1, rows, cols)
    env = {name: torch.arange(n, device=device).view([n if a == axis else 1 for a in range(4)])
           for axis, (name, n) in enumerate(zip(("b", "h", "q_blk", "kv_blk"), shape))}
    env |= {"q_len": q_len, "kv_len": kv_len}
    scope = Scope("sparsity", SPARSITY_VARS, spec.inputs_by_name)
    kept = torch.as_tensor(evaluate(spec.sparsity, env, {}, scope, torch.float64), device=device).to(torch.bool)
    return block_lists(kept.broadcast_to(shape).contiguous(), size, batch, heads, q_len, kv_len, torch.device(device))


def _lists(block_mask: torch.Tensor) -> torch.Tensor:
    """(count, kept indices ascending, then padding) per row of the last dimension."""
    kept = block_mask.to(torch.int8)
    count = kept.sum(-1, keepdim=True, dtype=torch.int32)
    order = torch.argsort(1 - kept, dim=-1, stable=True).to(torch.int32)  # kept first, each group in index order
    return torch.cat([count, order], dim=-1).contiguous()


def expand(block_mask: torch.Tensor, sparse_block: int, q_len: int, kv_len: int) -> torch.Tensor:
    """The element mask (B or 1, H or 1, q_len, kv_len) of a block mask (for the reference)."""
    return block_mask.repeat_interleave(sparse_block, -2)[..., :q_len, :].repeat_interleave(sparse_block, -1)[..., :kv_len]


class KeptLists:
    """A kernel's block lists as its Triton launchers take them (blocks=), kept between calls: a runtime block mask's
    (the last mask's, reused by a call with the same tensor object, unmodified since (its version counter), and the
    same shapes, instead of converting again: 0.15-0.34 ms at N = 8192 on the H100), and a static pattern's
    (KernelPlan.block_lists: made once per call sizes and device, pattern_lists)."""

    def __init__(self, spec, pattern: bool):
        self.spec, self.pattern = spec, pattern
        self._last = None  # (weakref to a block mask, its version, call shapes, its lists)
        self._patterns: dict[tuple, tuple] = {}  # call sizes and device -> a static pattern's lists

    def of_mask(self, block_mask, dims, device: torch.device) -> dict:
        """The blocks= keyword for a runtime block mask ({} for a spec without runtime sparsity); dims: the call's."""
        spec = self.spec
        if spec.sparsity != "runtime":
            return {}
        shapes = (dims.batch, dims.heads, dims.q_len, dims.kv_len, device)
        last = self._last
        if last is not None and last[0]() is block_mask and last[1] == block_mask._version and last[2] == shapes:
            return {"blocks": last[3]}
        lists = block_lists(block_mask, spec.sparse_block, dims.batch, dims.heads, dims.q_len, dims.kv_len, device)
        self._last = (weakref.ref(block_mask), block_mask._version, shapes, lists)
        return {"blocks": lists}

    def of_pattern(self, dims, device: torch.device) -> dict:
        """The blocks= keyword where the Triton kernels walk a static pattern's lists ({} otherwise)."""
        if not self.pattern:
            return {}
        key = (dims.batch, dims.heads, dims.q_len, dims.kv_len, device)
        lists = self._patterns.get(key)
        if lists is None:
            if len(self._patterns) >= 64:  # many shapes: start again
                self._patterns.clear()
            lists = self._patterns[key] = pattern_lists(self.spec, *key)
        return {"blocks": lists}
