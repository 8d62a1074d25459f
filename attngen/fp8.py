"""FP8 (e4m3) attention inputs: quantization with per-tensor, per-head or per-block scales, FlashAttention-3's
incoherent processing (a random orthogonal Hadamard rotation of Q and K), and the descale factors the kernels
and the reference take.

    q8, q_descale = attngen.fp8.quantize(q, granularity="block", hadamard=True)
    k8, k_descale = attngen.fp8.quantize(k, granularity="block", hadamard=True)
    v8, v_descale = attngen.fp8.quantize(v, granularity="head")
    o = kern(q8, k8, v8, q_descale=q_descale, k_descale=k_descale, v_descale=v_descale)   # a `dtype = fp8` spec

A value is e4m3 value * descale. Q's and K's descale factors may be one per tensor (shape (1,)), one per (batch,
key/value head) ((B, Hkv), flash-attn's FP8 interface), or one per block of BLOCK tokens of each (batch, head)
((B, H, ceil(N / BLOCK)), H = Q's or K's heads), or for Q one per (batch, query head) ((B, Hq)); V's one per
tensor or per (batch, key/value head).
"""
from __future__ import annotations

import math

import torch

from .errors import InputError
from .runtime.fp8 import BLOCK, cache_scales, dequantize, descale_blocks  # noqa: F401  (the factors' layouts the kernels read)

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # the largest finite e4m3 value
GRANULARITIES = ("tensor", "head", "block")


def hadamard_rotation(d: int, seed: int = 0, device=None, dtype=torch.float32) -> torch.Tensor:
    """The d x d rotation R = diag(random signs) H / sqrt(d), H the Sylvester-Hadamard matrix (d a power of two):
    orthogonal, so (Q R)(K R)^T = Q K^T; applied to both Q and K it spreads each row's outliers over every
    coordinate before quantization (FlashAttention-3's incoherent processing). The same seed gives the same R."""
    if d < 1 or d & (d - 1):
        raise InputError(f"the Hadamard rotation needs a head dim that is a power of two, got {d}")
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < d:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    signs = torch.randint(0, 2, (d,), generator=torch.Generator().manual_seed(seed), dtype=torch.int64) * 2 - 1
    return (signs[:, None].double() * h / math.sqrt(d)).to(device=device, dtype=dtype)


def quantize(x: torch.Tensor, granularity: str = "head", hadamard: bool = False, seed: int = 0, kv_heads: int | None = None
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """(x in e4m3, its float32 descale factors) for x of shape (B, H, N, D): each group's largest magnitude maps to
    448. granularity: "tensor" (shape (1,)), "head" ((B, kv_heads): one per key/value head, taking the group's
    query heads together when x is Q with kv_heads < H), or "block" ((B, H, ceil(N / 128)), per 128 tokens).
    hadamard=True rotates the last dimension first (hadamard_rotation(D, seed)): pass it, with the same seed, for
    both Q and K (never V: the product P V would change)."""
    if granularity not in GRANULARITIES:
        raise InputError(f"granularity must be one of {', '.join(GRANULARITIES)}; got {granularity!r}")
    if not isinstance(x, torch.Tensor) or x.dim() != 4 or not x.is_floating_point():
        raise InputError(f"quantize takes a floating-point tensor (B, H, N, D), got {tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__}")
    B, H, N, D = x.shape
    x = x.float()
    if hadamard:
        x = x @ hadamard_rotation(D, seed, x.device)
    if granularity == "tensor":
        amax = x.abs().amax().reshape(1)
        scale = amax / E4M3_MAX
        expanded = scale.reshape(1, 1, 1, 1)
    elif granularity == "head":
        groups = kv_heads or H
        if H % groups:
            raise InputError(f"kv_heads = {groups} must divide the {H} heads of x")
        amax = x.reshape(B, groups, -1).abs().amax(-1)
        scale = amax / E4M3_MAX
        expanded = scale.repeat_interleave(H // groups, 1)[:, :, None, None]
    else:
        blocks = -(-N // BLOCK)
        padded = torch.nn.functional.pad(x.abs(), (0, 0, 0, blocks * BLOCK - N))
        scale = padded.reshape(B, H, blocks, BLOCK * D).amax(-1) / E4M3_MAX
        expanded = scale.repeat_interleave(BLOCK, 2)[:, :, :N, None]
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))  # an all-zero group: any factor
    expanded = torch.where(expanded > 0, expanded, torch.ones_like(expanded))
    return to_cache(x, expanded), scale.float().contiguous()


def to_cache(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x as e4m3 cache entries for descale factors `scale` (broadcast against x): x / scale, saturated at +-448."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
