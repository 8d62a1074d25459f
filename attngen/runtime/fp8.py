"""FP8 calls (a `dtype = fp8` spec, forward only): e4m3 q, k, v with their float32 descale factors, checked and laid
out per block as the kernels read them (descale_blocks), kept by signature once checked (FP8Call); an FP8
key/value cache's factors (cache_scales); dequantization for the CPU path and the reference. attngen.fp8
quantizes."""
from __future__ import annotations

import torch

from ..errors import InputError
from ..lang.spec import DType
from .checks import check_block_mask, check_call, dropout_args
from .signature import call_signature

BLOCK = 128  # tokens per descale factor of granularity "block" (the kernels' DESCALE_BLOCK)


class FP8Call:
    """What an FP8 call of one signature (fp8_signature) runs once its checks passed: the declared inputs by name and
    each descale factor's layout as the kernels read it (_layout), then the forward."""

    __slots__ = ("names", "layouts")

    def __init__(self, names: list[str], layouts: tuple):
        self.names, self.layouts = names, layouts

    def run(self, kernel, q, k, v, inputs: dict, descales: tuple):
        blocks = tuple(layout(d) for layout, d in zip(self.layouts, descales))
        return kernel._forward_impl(q, k, v, [inputs[name] for name in self.names], 0.0, None, None, descales=blocks)


def fp8_signature(q, k, v, inputs: dict, descales: tuple) -> tuple:
    """The signature of an FP8 call with no option but the declared inputs and the descale factors: call_signature's,
    and each factor's shape, strides, element type and device (None where not given). AttributeError where one
    is not a tensor."""
    return (call_signature(q, k, v, inputs), *(None if d is None else (d.shape, d.stride(), d.dtype, d.device) for d in descales))


def fp8_call(kernel, q, k, v, inputs: dict, descales: tuple, dropout_p, seed, block_mask, compiling: bool, other_layout: bool,
             key: tuple | None = None):
    """A call of a `dtype = fp8` spec: checked, then the forward (no autograd: FP8 attention has no backward). `key`:
    the call's fp8_signature where it takes no option, by which the kernel keeps it (Kernel._fp8_calls)."""
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
    layouts = tuple(_layout(name, d, dims.batch, heads, dims.kv_heads, n, q.device, per_block)
                    for name, d, heads, n, per_block in (("q_descale", descales[0], dims.heads, dims.q_len, True),
                                                         ("k_descale", descales[1], dims.kv_heads, dims.kv_len, True),
                                                         ("v_descale", descales[2], dims.kv_heads, dims.kv_len, False)))
    if key is not None and kernel._fp8_calls is not None and not dims.empty:
        if len(kernel._fp8_calls) >= 256:  # many signatures (lengths varying call by call): start again
            kernel._fp8_calls.clear()
        kept = kernel._fp8_calls[key] = FP8Call([d.name for d in spec.inputs], layouts)
        return kept.run(kernel, q, k, v, inputs, descales)
    blocks = tuple(layout(d) for layout, d in zip(layouts, descales))
    return kernel._forward_impl(q, k, v, tensors, p, seed_t, block_mask, descales=blocks)


def descale_blocks(name: str, descale, batch: int, heads: int, kv_heads: int, length: int, device, per_block: bool = True) -> torch.Tensor:
    """A descale argument as the kernels read it: (B, heads, ceil(length / BLOCK)) float32 when per_block (Q with
    heads = Hq, K with heads = Hkv), else (B, kv_heads) (V); None is 1. The kernels read it through its strides:
    a factor per tensor or per head comes back as a broadcast view (strides 0), not a copy; only Q's factors
    given per key/value head are copied (a query head's is its group's). Checked: float32, on `device`, one of
    the shapes attngen.fp8's docstring lists."""
    return _layout(name, descale, batch, heads, kv_heads, length, device, per_block)(descale)


def _layout(name: str, descale, batch: int, heads: int, kv_heads: int, length: int, device, per_block: bool):
    """descale_blocks' checks of a factor (its shape, element type and device), and its layout as a function of a
    factor of that shape, fn(descale) -> what the kernels read: decided once for a kept call (FP8Call)."""
    blocks = max(1, -(-length // BLOCK))
    full = (batch, heads, blocks) if per_block else (batch, kv_heads)
    if descale is None:
        return lambda _: torch.ones((1, 1, 1) if per_block else (1, 1), device=device).expand(full)
    _check_factor(name, descale, device)
    shapes = {"per tensor": (1,), "per (batch, key/value head)": (batch, kv_heads)}
    if per_block:
        shapes |= {"per (batch, head)": (batch, heads), "per block": (batch, heads, blocks)}
    shape = tuple(descale.shape)
    if shape in ((), (1,)):
        return lambda d: d.reshape((1, 1, 1) if per_block else (1, 1)).expand(full)
    if shape == (batch, kv_heads) and not per_block:
        return lambda d: d
    if shape == (batch, kv_heads) and heads != kv_heads:  # Q's: a query head's factor is its group's (a copy)
        group = heads // kv_heads
        return lambda d: d.repeat_interleave(group, 1)[:, :, None].expand(full)
    if per_block and shape in ((batch, kv_heads), (batch, heads)):
        return lambda d: d[:, :, None].expand(full)
    if per_block and shape == (batch, heads, blocks):
        return lambda d: d
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
