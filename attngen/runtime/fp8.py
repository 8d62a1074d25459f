"""FP8 calls (a `dtype = fp8` spec, forward only): e4m3 q, k, v with their float32 descale factors, checked and laid
out per block as the kernels read them (descale_blocks); an FP8 key/value cache's factors (cache_scales);
dequantization for the CPU path and the reference. attngen.fp8 quantizes."""
from __future__ import annotations

import torch

from ..errors import InputError
from ..lang.spec import DType
from .checks import check_block_mask, check_call, dropout_args

BLOCK = 128  # tokens per descale factor of granularity "block" (the kernels' DESCALE_BLOCK)


def fp8_call(kernel, q, k, v, inputs: dict, descales: tuple, dropout_p, seed, block_mask, compiling: bool, other_layout: bool):
    """A call of a `dtype = fp8` spec: checked, then the forward (no autograd: FP8 attention has no backward)."""
    spec = kernel.spec
    if spec.dtype is not DType.FP8:
        raise InputError(f"q_descale, k_descale and v_descale go with a `dtype = fp8` spec; {spec.name!r} has dtype = {spec.dtype.value}")
    if compiling:
        raise InputError("FP8 kernels are not supported under torch.compile yet; call them from a function marked @torch.compiler.disable")
    if other_layout:
        raise InputError("FP8 kernels take (B, H, N, D) tensors only: packed sequences (cu_seqlens), kv_lens, q_lens and paged caches "
                         "are not supported with dtype = fp8 yet")
    dims, tensors = check_call(kernel, q, k, v, inputs)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *tensors)):
        raise InputError("FP8 attention is forward only (its inputs are quantized): call it under torch.no_grad() or "
                         "torch.inference_mode()")
    p, seed_t = dropout_args(spec, dropout_p, seed, q.device)
    check_block_mask(spec, block_mask)
    blocks = [descale_blocks(name, d, dims.batch, heads, dims.kv_heads, n, q.device, per_block)
              for name, d, heads, n, per_block in (("q_descale", descales[0], dims.heads, dims.q_len, True),
                                                   ("k_descale", descales[1], dims.kv_heads, dims.kv_len, True),
                                                   ("v_descale", descales[2], dims.kv_heads, dims.kv_len, False))]
    return kernel._forward_impl(q, k, v, tensors, p, seed_t, block_mask, descales=tuple(blocks))


def descale_blocks(name: str, descale, batch: int, heads: int, kv_heads: int, length: int, device, per_block: bool = True) -> torch.Tensor:
    """A descale argument as the kernels read it: (B, heads, ceil(length / BLOCK)) float32 when per_block (Q with
    heads = Hq, K with heads = Hkv), else (B, kv_heads) (V); None is 1. Checked: float32, on `device`, one of the
    shapes attngen.fp8's docstring lists."""
    blocks = max(1, -(-length // BLOCK))
    if descale is None:
        return torch.ones((batch, heads, blocks) if per_block else (batch, kv_heads), device=device)
    _check_factor(name, descale, device)
    shapes = {"per tensor": (1,), "per (batch, key/value head)": (batch, kv_heads)}
    if per_block:
        shapes |= {"per (batch, head)": (batch, heads), "per block": (batch, heads, blocks)}
    shape = tuple(descale.shape)
    if shape in ((), (1,)):
        out = descale.reshape(1, 1, 1) if per_block else descale.reshape(1, 1)
        return out.expand((batch, heads, blocks) if per_block else (batch, kv_heads)).contiguous()
    if shape == (batch, kv_heads):
        if not per_block:
            return descale.contiguous()
        return descale.repeat_interleave(heads // kv_heads, 1)[:, :, None].expand(batch, heads, blocks).contiguous()
    if per_block and shape == (batch, heads):
        return descale[:, :, None].expand(batch, heads, blocks).contiguous()
    if per_block and shape == (batch, heads, blocks):
        return descale.contiguous()
    listing = ", ".join(f"{what} {s}" for what, s in shapes.items())
    raise InputError(f"{name} has shape {shape}; expected one of: {listing}")


def cache_scales(name: str, scale, batch: int, kv_heads: int, device) -> torch.Tensor:
    """The descale factor of an FP8 key/value cache (a `kv_dtype = fp8` spec) as the decode kernels read it, (B, Hkv)
    float32: given per tensor (1,), per key/value head (Hkv,) or per (sequence, key/value head) (B, Hkv); None is 1."""
    if scale is None:
        return torch.ones((batch, kv_heads), device=device)
    _check_factor(name, scale, device)
    shape = tuple(scale.shape)
    if shape in ((), (1,)):
        return scale.reshape(1, 1).expand(batch, kv_heads).contiguous()
    if shape == (kv_heads,):
        return scale[None, :].expand(batch, kv_heads).contiguous()
    if shape == (batch, kv_heads):
        return scale.contiguous()
    raise InputError(f"{name} has shape {shape}; expected per tensor (1,), per key/value head ({kv_heads},) or per (sequence, key/value head) "
                     f"({batch}, {kv_heads})")


def _check_factor(name: str, t, device) -> None:
    """A descale argument is a float32 tensor on q's device (any index of its type when `device` names none)."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.float32:
        raise InputError(f"{name} must be a float32 tensor, got {t.dtype if isinstance(t, torch.Tensor) else type(t).__name__}")
    want = torch.device(device)
    if t.device.type != want.type or (want.index is not None and t.device != want):
        raise InputError(f"{name} is on {t.device}, q on {device}")


def dequantize(x: torch.Tensor, descale: torch.Tensor, per_block: bool = True) -> torch.Tensor:
    """x (e4m3, (B, H, N, D)) as float32 values, with descale in descale_blocks' layout ((B, H, blocks) per block;
    (B, Hkv) for V, Hkv = H)."""
    if per_block:
        return x.float() * descale.repeat_interleave(BLOCK, 2)[:, :, :x.shape[2], None]
    return x.float() * descale[:, :, None, None]
