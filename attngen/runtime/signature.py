"""Call signatures: what a call's checks, its choice of kernels and its launch arguments follow from, as one
hashable value per call. A call whose signature equals an earlier one's replays that call's decisions (its checks,
the kernels and split it took, its launch arguments as a Recipe) instead of making them again."""
from __future__ import annotations

import torch


def decode_signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, extras: tuple, inputs: tuple) -> tuple:
    """The signature of a decode call: each tensor's device, shape, strides, element type and 16-byte alignment
    (what Triton specializes a pointer on), for q, k, v, the optional `extras` (kv_lens, q_lens, the block table,
    descale factors: None where absent) and the declared inputs; whether V starts where K does (a view of K's
    first columns, which the latent-attention kernels read once)."""
    parts = [q.device, k.device, v.device, q.dtype, k.dtype, v.dtype, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(),
             q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() == k.data_ptr() or v.data_ptr() % 16]
    for t in extras:
        parts.append(None if t is None else (t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16))
    for t in inputs:
        parts.append((t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16))
    return tuple(parts)


def call_signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: dict | list) -> tuple:
    """The signature of a plain call (Kernel.__call__ with no option but declared inputs): whether it records a
    gradient, the devices, and each tensor's shape, strides, element type and 16-byte alignment (q, k, v, and
    the inputs by name, or by place where they come as a list). AttributeError where one is not a tensor."""
    tensors = inputs.values() if isinstance(inputs, dict) else inputs
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or any(t.requires_grad for t in tensors))
    plain = (grad, q.device, k.device, v.device, q.dtype, k.dtype, v.dtype, q.shape, q.stride(), k.shape, k.stride(), v.shape, v.stride(),
             q.data_ptr() % 16, k.data_ptr() % 16, v.data_ptr() % 16)
    if not inputs:
        return plain
    named = inputs.items() if isinstance(inputs, dict) else enumerate(inputs)
    return plain + tuple((name, t.shape, t.stride(), t.dtype, t.device, t.data_ptr() % 16) for name, t in named)


def packed_signature(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, inputs: dict, cu_q: torch.Tensor, cu_k: torch.Tensor,
                     max_q: int, max_k: int) -> tuple:
    """The signature of a plain packed call (cu_seqlens_q/_k with max_seqlen_q/_k, no other option): call_signature's
    of q, k, v and the inputs, whether each input records a gradient (packed calls refuse some input gradients),
    each offsets tensor's shape, element type, device and 16-byte alignment, and the two longest lengths.
    AttributeError where one is not a tensor."""
    return (call_signature(q, k, v, inputs), tuple(t.requires_grad for t in inputs.values()), cu_q.shape, cu_q.dtype, cu_q.device,
            cu_q.data_ptr() % 16, cu_k.shape, cu_k.dtype, cu_k.device, cu_k.data_ptr() % 16, max_q, max_k)
