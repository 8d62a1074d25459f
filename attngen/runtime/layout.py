"""How attngen lays out what it returns: O and the gradients dQ, dK, dV follow the memory layout of q, k, v.

Attention layers make q, k, v as (B, N, H, D) tensors seen through transpose(1, 2) (a projection's output viewed
per head), or as views of one fused projection (B, N, 3, H, D). PyTorch's fused attention returns O laid out as
such a q (a contiguous (B, N, H, D) memory), so `o.transpose(1, 2).reshape(B, N, H * D)` is a view, not a copy.
attngen does the same, by one rule that reads only shapes and strides: a torch.compile fake tensor has those, so
the custom ops' fake implementations (attngen.runtime) lay out their outputs exactly as the kernels do.
"""
from __future__ import annotations

import torch


def heads_in_rows(t: torch.Tensor) -> bool:
    """Whether t (B, H, N, D) keeps every head of a token in one row of memory: t is not contiguous, its elements
    are contiguous along D and its heads D apart (or it has one head). Outputs made for such a t are contiguous
    (B, N, H, D) memories seen through transpose(1, 2); for any other t, contiguous."""
    return t.dim() == 4 and not t.is_contiguous() and t.stride(3) == 1 and (t.stride(1) == t.shape[3] or t.shape[1] == 1)


def empty_like_layout(t: torch.Tensor, shape=None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """An uninitialized tensor of `shape` (default t's; (B, H, N, D)) and `dtype` (default t's) on t's device, laid
    out for t as heads_in_rows says."""
    return empty_laid_out(t.shape if shape is None else shape, t.dtype if dtype is None else dtype, t.device, heads_in_rows(t))


def empty_laid_out(shape, dtype: torch.dtype, device, in_rows: bool) -> torch.Tensor:
    """An uninitialized (B, H, N, D) tensor, contiguous, or (in_rows) a contiguous (B, N, H, D) memory seen through
    transpose(1, 2)."""
    if in_rows:
        batch, heads, n, d = shape
        return torch.empty((batch, n, heads, d), device=device, dtype=dtype).transpose(1, 2)
    return torch.empty(shape, device=device, dtype=dtype)


def leading_columns_of(v: torch.Tensor, k: torch.Tensor) -> bool:
    """Whether v is k's first columns (`k[..., :n]`: the same storage start and strides), as latent attention's V is
    a view of its cache's first value_dim columns; the decode kernels then read those bytes once."""
    return v.data_ptr() == k.data_ptr() and v.stride() == k.stride()
