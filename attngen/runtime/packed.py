"""Packed sequences (flash_attn_varlen_func's layout: q (total_q, Hq, D), k and v (total_k, Hkv, D), sequence i's
rows cu_seqlens[i]:cu_seqlens[i + 1]): their checks, and the (1, H, total, D) views the kernels take."""
from __future__ import annotations

import torch
from torch import Tensor

from ..errors import InputError
from ..lang.expr import variables
from ..lang.spec import LoopOrder, Spec


def check_packed(spec: Spec, q, k, v, cu_q, cu_k, max_q, max_k, compiling: bool):
    """Packed sequences: q, k, v as (1, H, total rows, D) views, and (cu_q, cu_k, max_q, max_k), checked. The
    values of cu_seqlens are checked (a host synchronization) except while a CUDA graph is captured or
    torch.compile traces (max_seqlen_q and max_seqlen_k must be given then)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 3:
            raise InputError(f"with cu_seqlens, {name} must be 3-D (total tokens, heads, head_dim), got shape {tuple(t.shape)}")
    if cu_q is None or cu_k is None:
        raise InputError("packed sequences need both cu_seqlens_q and cu_seqlens_k")
    if spec.loop_order is LoopOrder.KV_OUTER:
        raise InputError(f"the spec {spec.name!r} has loop_order = kv_outer, which has no packed-sequence kernels; use q_outer")
    for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
        if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() == 0:
            what = f"{cu.dtype} of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
            raise InputError(f"{name} must be a 1-D int32 tensor of B + 1 offsets, got {what}")
        if cu.device != q.device:
            raise InputError(f"{name} is on {cu.device}, q on {q.device}")
    if cu_q.numel() != cu_k.numel():
        raise InputError(f"cu_seqlens_q has {cu_q.numel()} entries and cu_seqlens_k {cu_k.numel()}: one more than the number of sequences each")
    # (not asked while torch.compile traces: dynamo cannot put a bool from torch.cuda into its graph, found on the H100)
    capturing = not compiling and q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
    lengths = {}
    for name, cu, total, given in (("cu_seqlens_q", cu_q, q.shape[0], max_q), ("cu_seqlens_k", cu_k, k.shape[0], max_k)):
        if given is not None and (not isinstance(given, (int, torch.SymInt)) or isinstance(given, bool) or given < 0):
            raise InputError(f"max_seqlen_{name[-1]} must be a non-negative int, got {given!r}")
        if capturing or compiling:
            if given is None:
                while_ = "a CUDA graph is captured" if capturing else "torch.compile traces"
                raise InputError(f"while {while_}, pass max_seqlen_{name[-1]} (it cannot be read from {name})")
            lengths[name] = given
            continue
        lengths[name] = check_offsets(name, cu, total, given)
    return (*heads_first(q, k, v), (cu_q, cu_k, lengths["cu_seqlens_q"], lengths["cu_seqlens_k"]))


def check_offsets(name: str, cu: torch.Tensor, total: int, given: int | None) -> int:
    """The longest sequence of offsets `cu` (longest_sequence's checks), at most `given` where that is given
    (max_seqlen_q or max_seqlen_k); returns given, or the longest."""
    longest = longest_sequence(name, cu, total)
    if given is not None and given < longest:
        raise InputError(f"max_seqlen_{name[-1]} = {given}, but a sequence of {name} has {longest} rows")
    return longest if given is None else given


def longest_sequence(name: str, cu: torch.Tensor, total: int) -> int:
    """The longest sequence of offsets `cu`, checked to start at 0, never decrease and end at `total`. Reading them
    is a host synchronization, which would stall every layer of a model on the GPU (0.3 ms per call measured on the
    H100): the result is remembered on the tensor, for its current version (an in-place change makes a new one), so
    the layers sharing one batch's cu_seqlens check it once."""
    seen = cu.__dict__.get("_attngen_checked")
    if seen is not None and seen[:2] == (cu._version, total):
        return seen[2]
    offsets = cu.tolist()
    steps = [b - a for a, b in zip(offsets, offsets[1:])]
    if offsets[0] != 0 or any(n < 0 for n in steps):
        raise InputError(f"{name} must start at 0 and never decrease, got {offsets[:8]}{' ...' if len(offsets) > 8 else ''}")
    if offsets[-1] != total:
        raise InputError(f"{name} ends at {offsets[-1]}, but the packed tensor has {total} rows")
    longest = max(steps, default=0)
    cu.__dict__["_attngen_checked"] = (cu._version, total, longest)
    return longest


def check_packed_features(spec: Spec, inputs: list[torch.Tensor], grad: bool, score_reads: bool, compiling: bool) -> None:
    """What packed sequences do not support yet: an InputError before any kernel runs. Inputs get gradients only
    through a sink (score_reads: the score reads float inputs, whose gradients the dQ kernel's terms carry), in eager
    calls, and not for a sink that reads q_len or kv_len (whose reduction would need each sequence's lengths)."""
    if spec.sparsity == "runtime":
        raise InputError("runtime block sparsity with packed sequences (cu_seqlens) is not supported yet")
    if not (grad and any(t.requires_grad for t in inputs)):
        return
    if spec.sink is None:
        raise InputError("gradients of declared inputs with packed sequences (cu_seqlens) are not supported yet, except a sink's")
    if score_reads:
        raise InputError("gradients of inputs the score reads, with packed sequences (cu_seqlens), are not supported yet (a sink's inputs "
                         "get theirs)")
    if variables(spec.sink) & {"q_len", "kv_len"}:
        raise InputError("gradients of the inputs of a sink that reads q_len or kv_len, with packed sequences (cu_seqlens), are not "
                         "supported yet")
    if compiling:
        raise InputError("gradients of declared inputs with packed sequences (cu_seqlens) under torch.compile are not supported yet "
                         "(eager calls give a sink's)")


def heads_first(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Packed (total, H, D) tensors as the kernels' (1, H, total, D) views."""
    return tuple(t.permute(1, 0, 2).unsqueeze(0) for t in tensors)


def tokens_first(t: Tensor) -> Tensor:
    """A kernel's (1, H, total, D) output as a (total, H, D) tensor (a view where the kernel wrote it so)."""
    return t.squeeze(0).transpose(0, 1).contiguous()
