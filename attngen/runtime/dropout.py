"""The dropout pattern: a pure function of (seed, b, h, q_idx, kv_idx), the same for every spec, tiling and
loop order. The kernels compute it inline (templates/triton/dropout.py.jinja); this module serves it as a
tensor to the reference and to users, from a generated module of its own (no kernel of any spec)."""
from __future__ import annotations

from types import ModuleType

import torch

from ..codegen.triton import build_dropout_source
from ..errors import InputError
from .loader import check_device, interpreted_if_cpu, load_module


def _dropout_module() -> ModuleType:
    return load_module("dropout", *build_dropout_source())


def dropout_mask(seed: int | torch.Tensor, dropout_p: float, batch: int, heads: int, q_len: int, kv_len: int, device="cpu") -> torch.Tensor:
    """The exact keep mask (bool, batch x heads x q_len x kv_len; heads = query heads) that every attngen kernel
    with dropout uses for this seed and probability, the same for every spec, tiling and loop order. Pair
    (b, h, q_idx, kv_idx) is kept iff its 16-bit value is >= round(dropout_p * 65536): with r[0..3] the outputs
    of Philox-4x32-10 with the counters (q_idx, 8 * (kv_idx // 64) + (kv_idx % 16) // 2, b * heads + h, 0) and
    the seed as key, the value is r[(kv_idx % 64) // 16] >> (16 * (kv_idx % 2)) & 0xFFFF (one call per 8 keys).
    Kept probabilities are scaled by 1 / (1 - dropout_probability(dropout_p)). `seed`: an int, or the one-element
    int64 tensor a kernel was called with (its value is read here)."""
    if isinstance(seed, torch.Tensor):
        if seed.numel() != 1 or seed.dtype != torch.int64:
            raise InputError(f"seed must be a one-element int64 tensor or an int, got a {seed.dtype} tensor of shape {tuple(seed.shape)}")
        seed = int(seed.item())
    if isinstance(seed, bool) or not isinstance(seed, int) or not 0 <= seed < 2**63:
        raise InputError(f"seed must be a non-negative integer below 2**63 (as a kernel call takes it), got {seed!r}")
    if not 0.0 <= dropout_p < 1.0:
        raise InputError(f"dropout_p must be a probability in [0, 1), got {dropout_p!r}")
    device = torch.device(device)
    module = _dropout_module()
    check_device(device, module)
    with interpreted_if_cpu(device):
        return module.dropout_mask(seed, float(dropout_p), batch, heads, q_len, kv_len, device)


def dropout_probability(dropout_p: float) -> float:
    """The drop probability the kernels apply for dropout_p: rounded to a multiple of 1/65536 (the keep decision
    compares 16-bit random values), e.g. 0.1 -> 6554 / 65536 = 0.100006."""
    module = _dropout_module()
    return module._dropout_threshold(dropout_p) / module.DROPOUT_LEVELS
