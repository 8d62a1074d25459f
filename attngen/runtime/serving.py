"""Serving calls (forward only): per-sequence lengths (kv_lens, q_lens), paged key/value caches (a block table),
FP8 caches; their checks, and the decode kernels' launch (the split from attngen/plan/decode.py)."""
from __future__ import annotations

import torch

from ..errors import InputError
from ..lang.spec import DType, KVLayout
from ..plan.decode import decode_shape
from .checks import Dims, check_all
from .fp8 import cache_scales
from .layout import leading_columns_of
from .signature import decode_signature
from .loader import check_device, interpreted
from .twins import up


def serving_call(kernel, q, k, v, inputs: dict, kv_lens, q_lens, block_table, dropout_p, block_mask, packed: bool, compiling: bool,
                 descales: tuple = (None, None, None)):
    """A call with per-sequence lengths, a paged cache or an FP8 cache (kv_dtype = fp8, with the caches'
    descale factors k_descale, v_descale): checked, then the decode kernels (forward only)."""
    spec = kernel.spec
    paged = spec.kv_layout is KVLayout.PAGED
    if spec.kv_dtype is DType.FP8:
        if descales[0] is not None:
            raise InputError(f"q_descale: the spec {spec.name!r} has kv_dtype = fp8, whose queries are {spec.dtype.value}, not quantized; "
                             f"pass the caches' k_descale and v_descale")
        if compiling:
            raise InputError("FP8 key/value caches are not supported under torch.compile yet; call the kernel from a function marked "
                             "@torch.compiler.disable")
    if packed:
        raise InputError("kv_lens, q_lens and block_table do not go with packed sequences (cu_seqlens)")
    if spec.sparsity == "runtime" or block_mask is not None:
        raise InputError(f"the decode kernels read no block mask; {spec.name!r} has sparsity = runtime, which kv_lens, q_lens and "
                         f"paged caches do not support yet")
    p = spec.dropout if dropout_p is None else dropout_p
    if p:
        raise InputError(f"kv_lens, q_lens and paged caches are for inference, without dropout: pass dropout_p=0.0 (the spec "
                         f"{spec.name!r} says dropout = {spec.dropout})")
    if not isinstance(q, torch.Tensor) or q.dim() != 4:
        raise InputError(f"q must be a 4-D tensor (batch, heads, tokens, head_dim), got {tuple(q.shape) if isinstance(q, torch.Tensor) else type(q).__name__}")
    grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *inputs.values()) if isinstance(t, torch.Tensor))
    # the checks below read shapes, element types and devices only: a call with the signature of one that passed
    # skips them (the signature also holds the strides and alignments the decode launch follows from: it replays that)
    key = None if compiling else serving_signature(q, k, v, inputs, kv_lens, q_lens, block_table)  # (torch.compile: guards)
    dims = None if grad or key is None else kernel._passed.get(key)
    if dims is not None:
        tensors = [inputs[d.name] for d in spec.inputs]
    else:
        dims, tensors = _check_serving_call(kernel, q, k, v, inputs, kv_lens, q_lens, block_table)
        if key is not None:
            if len(kernel._passed) >= 256:
                kernel._passed.clear()
            kernel._passed[key] = dims
    if compiling:  # one operator; the values are not read while tracing (the kernels clamp lengths and pages)
        return kernel._ops().decode(q, k, v, tensors, kv_lens, q_lens, block_table)
    if (key is not None and kernel._serving_calls is not None and (q.device.type == "cuda" or spec.dtype is not DType.BF16)
            and dims.batch and dims.q_len and dims.heads):  # kept for calls like this one (Kernel.__call__ replays it; a
        # bf16 spec on the CPU runs its float32 twin: decode_impl)
        shape = decode_shape(kernel.plan, dims.batch, dims.heads, dims.kv_heads, dims.q_len, dims.kv_len)
        if len(kernel._serving_calls) >= 256:
            kernel._serving_calls.clear()
        served = kernel._serving_calls[key] = ServingCall(dims, [d.name for d in spec.inputs], shape.block_r, shape.splits,
                                                          k.shape[0] if paged else 0, spec.page_size if paged else 0)
        return served.run(kernel, key, q, k, v, inputs, kv_lens, q_lens, block_table)
    check_serving_values(kv_lens, q_lens, block_table, dims, k.shape[0] if paged else 0, spec.page_size if paged else 0)
    kv_scales = None
    if spec.kv_dtype is DType.FP8:
        kv_scales = tuple(cache_scales(name, s, dims.batch, dims.kv_heads, q.device) for name, s in (("k_descale", descales[1]), ("v_descale", descales[2])))
        key = None  # (the scales' tensors are made by this call)
    return decode_impl(kernel, q, k, v, tensors, kv_lens, q_lens, block_table, dims, kv_scales, known=key)


def serving_signature(q, k, v, inputs: dict, kv_lens, q_lens, block_table) -> tuple | None:
    """The signature of a serving call (signature.decode_signature, the inputs by name); None where an argument is
    not a tensor (the checks say which)."""
    try:
        return ("serving", *inputs, *decode_signature(q, k, v, (kv_lens, q_lens, block_table), tuple(inputs.values())))
    except AttributeError:
        return None


class ServingCall:
    """A serving call of one signature (bf16/fp16/fp32 caches; fp16/fp32 on the CPU) as its first call decided it
    once its checks passed: its sizes, the order of its inputs, the decode kernel's rows per program and split,
    and the cache's pages for the value checks, which run at every call (check_serving_values)."""

    __slots__ = ("dims", "names", "block_r", "splits", "num_pages", "page_size", "replay")

    def __init__(self, dims: Dims, names: list[str], block_r: int, splits: int, num_pages: int, page_size: int):
        self.dims, self.names, self.block_r, self.splits, self.num_pages, self.page_size = dims, names, block_r, splits, num_pages, page_size
        self.replay = None  # the module's replay of this signature's launch (decode_replay), once it has one

    def run(self, kernel, key: tuple, q, k, v, inputs: dict, kv_lens, q_lens, block_table, lse_wanted: bool = True):
        """(O, lse in log2 units); without lse_wanted the lse returned may be overwritten by a later call."""
        check_serving_values(kv_lens, q_lens, block_table, self.dims, self.num_pages, self.page_size)
        if q.device.type == "cuda":
            return self._decode(kernel, key, q, k, v, inputs, kv_lens, q_lens, block_table, lse_wanted)
        check_device(q.device, kernel.module)
        with interpreted():
            return self._decode(kernel, key, q, k, v, inputs, kv_lens, q_lens, block_table, lse_wanted)

    def _decode(self, kernel, key: tuple, q, k, v, inputs: dict, kv_lens, q_lens, block_table, lse_wanted: bool = True):
        if self.replay is not None:
            return self.replay(q, k, v, kv_lens, q_lens, block_table, [inputs[name] for name in self.names], lse_wanted=lse_wanted)
        out = kernel.module.attention_decode(q, k, v, *[inputs[name] for name in self.names], kv_lens=kv_lens, q_lens=q_lens,
                                             block_table=block_table, block_r=self.block_r, num_splits=self.splits, known=key)
        self.replay = kernel.module.decode_replay(key, self.block_r, self.splits)
        return out


def _check_serving_call(kernel, q, k, v, inputs: dict, kv_lens, q_lens, block_table) -> tuple[Dims, list[torch.Tensor]]:
    """serving_call's checks of the tensors' shapes, types and devices."""
    spec = kernel.spec
    paged = spec.kv_layout is KVLayout.PAGED
    batch = q.shape[0]
    paged_kv = None
    if paged:
        if block_table is None or kv_lens is None:
            raise InputError(f"the spec {spec.name!r} has kv_layout = paged: pass the caches as k and v (num_pages, {spec.page_size}, "
                             f"kv_heads, head_dim), block_table= (int32, sequences x pages) and kv_lens= (int32, one length per sequence)")
        for name, cache in (("k", k), ("v", v)):
            check_paged_cache(name, cache, spec.page_size)
        check_block_table(block_table, batch, q.device)
        paged_kv = (k.shape[2], block_table.shape[1] * spec.page_size)
    elif block_table is not None:
        raise InputError(f"block_table given, but the spec {spec.name!r} has kv_layout = contiguous: a paged cache needs "
                         f"`kv_layout = paged` (and page_size) in the spec")
    dims, tensors = check_all(kernel, q, k, v, inputs, paged_kv=paged_kv)
    for name, lens in (("kv_lens", kv_lens), ("q_lens", q_lens)):
        if lens is not None:
            check_lengths(name, lens, batch, q.device)
    if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *tensors)):
        raise InputError("kv_lens, q_lens and paged caches are for inference: their decode kernels have no backward; call under "
                         "torch.no_grad() (to train on sequences of different lengths, pack them: cu_seqlens_q/cu_seqlens_k)")
    return dims, tensors


def serving_dims(q, k, block_table) -> Dims:
    """The sizes of a checked decode call (a paged cache: its key/value heads, keys per sequence by the table)."""
    if block_table is not None:
        return Dims(q.shape[0], q.shape[1], k.shape[2], q.shape[2], block_table.shape[1] * k.shape[1])
    return Dims(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2])


def decode_impl(kernel, q, k, v, inputs, kv_lens, q_lens, block_table, dims: Dims, kv_scales=None, known=None):
    """O and the lse in log2 units by the decode kernels (their split: attngen/plan/decode.py); the tensors are
    checked.
    kv_scales: an FP8 cache's (k's, v's) descale factors, (B, Hkv) float32 each. known: the call's signature
    (signature.decode_signature, with anything more), which the module replays the launch of a call by."""
    cuda = q.device.type == "cuda"
    if not cuda:
        check_device(q.device, kernel.module)
    if dims.batch == 0 or dims.q_len == 0 or dims.heads == 0:
        return q.new_zeros((*q.shape[:3], v.shape[-1])), torch.full(q.shape[:3], float("-inf"), device=q.device, dtype=torch.float32)
    if not cuda and kernel.spec.dtype is DType.BF16:
        q32, k32, v32 = up(q, k, v)
        if leading_columns_of(v, k):  # V a view of K's first columns stays one
            v32 = k32[..., :v.shape[-1]]
        o, lse = decode_impl(kernel._twin(), q32, k32, v32, up(*inputs), kv_lens, q_lens, block_table, dims, kv_scales)
        return o.to(torch.bfloat16), lse
    shape = kernel._decode_shapes.get(dims)
    if shape is None:
        if len(kernel._decode_shapes) >= 256:
            kernel._decode_shapes.clear()
        shape = kernel._decode_shapes[dims] = decode_shape(kernel.plan, dims.batch, dims.heads, dims.kv_heads, dims.q_len, dims.kv_len)
    scales = {} if kv_scales is None else {"kv_scales": kv_scales}
    if cuda:
        return kernel.module.attention_decode(q, k, v, *inputs, kv_lens=kv_lens, q_lens=q_lens, block_table=block_table,
                                              block_r=shape.block_r, num_splits=shape.splits, known=known, **scales)
    with interpreted():
        return kernel.module.attention_decode(q, k, v, *inputs, kv_lens=kv_lens, q_lens=q_lens, block_table=block_table,
                                              block_r=shape.block_r, num_splits=shape.splits, known=known, **scales)


def check_serving_values(kv_lens, q_lens, block_table, dims: Dims, num_pages: int, page_size: int) -> None:
    """The lengths and the block table's pages in range (check_values, a host synchronization).
    The layers of one decode step share these tensors: the result is remembered on the first of them for the
    versions and shapes it saw, so an unchanged set is checked once (an in-place update checks it again)."""
    first = next((t for t in (kv_lens, q_lens) if t is not None), None)
    if first is None:
        return
    key = (id(kv_lens), kv_lens._version if kv_lens is not None else 0, id(q_lens), q_lens._version if q_lens is not None else 0,
           id(block_table), block_table._version if block_table is not None else 0, dims.q_len, dims.kv_len, num_pages)
    if first.__dict__.get("_attngen_checked") == key:
        return
    lens = kv_lens if kv_lens is not None else torch.full_like(q_lens, dims.kv_len)
    check_values(lens, dims.kv_len, block_table, num_pages, page_size, q_lens, dims.q_len)
    if not capturing(first.device):
        first.__dict__["_attngen_checked"] = key


# ---- the key/value caches' checks (attngen.kvcache.append makes them too) ----------------------------------
def capturing(device: torch.device) -> bool:
    """Whether a CUDA graph is being captured on `device`'s current stream (nothing may synchronize then)."""
    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _check_int32(name: str, t, dim: int, what: str, batch: int, rows: str, device: torch.device) -> None:
    """`t` is a dim-D int32 tensor on `device` with `batch` entries along its first dimension."""
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != dim:
        got = f"{t.dtype} of shape {tuple(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
        raise InputError(f"{name} must be a {dim}-D int32 tensor {what}, got {got}")
    if t.shape[0] != batch:
        raise InputError(f"{name} has {t.shape[0]} {rows}; the batch has {batch} sequences")
    if t.device != device:
        raise InputError(f"{name} is on {t.device}, q on {device}")


def check_lengths(name: str, lens, batch: int, device: torch.device) -> None:
    """`lens` is an int32 (B,) tensor on `device`, its entries adjacent (the kernels read entry b at lens + b; values
    are checked where they are used)."""
    _check_int32(name, lens, 1, "of one length per sequence", batch, "entries", device)
    if batch > 1 and lens.stride(0) != 1:
        raise InputError(f"{name}'s entries must be contiguous (stride 1), got stride {lens.stride(0)}; pass {name}.contiguous()")


def check_block_table(block_table, batch: int, device: torch.device) -> None:
    """`block_table` is an int32 (B, max_pages) tensor on `device` with a unit stride along its pages."""
    _check_int32("block_table", block_table, 2, "(sequences, pages per sequence)", batch, "rows", device)
    if block_table.shape[1] > 1 and block_table.stride(1) != 1:
        raise InputError("block_table's pages must be contiguous along each row (stride 1); pass block_table.contiguous()")


def check_paged_cache(name: str, cache, page_size: int | None, like: torch.Tensor | None = None) -> None:
    """`cache` is a (num_pages, page_size, Hkv, D) tensor (of `like`'s dtype and device where given)."""
    if not isinstance(cache, torch.Tensor) or cache.dim() != 4:
        what = f"shape {tuple(cache.shape)}" if isinstance(cache, torch.Tensor) else type(cache).__name__
        raise InputError(f"{name} must be a paged cache of shape (num_pages, page_size, kv_heads, head_dim), got {what}")
    if page_size is not None and cache.shape[1] != page_size:
        raise InputError(f"{name} has pages of {cache.shape[1]} tokens (dimension 1); the spec says page_size = {page_size}")
    if cache.shape[0] == 0:
        raise InputError(f"{name} has no page")
    if like is not None and (cache.dtype != like.dtype or cache.device != like.device):
        raise InputError(f"{name} is {cache.dtype} on {cache.device}; expected {like.dtype} on {like.device}")


def check_values(kv_lens: torch.Tensor, capacity: int, block_table: torch.Tensor | None = None, num_pages: int = 0,
                 page_size: int = 0, q_lens: torch.Tensor | None = None, q_capacity: int = 0, extra: int = 0) -> None:
    """The values: 0 <= kv_lens[b] (+ extra) <= capacity, 0 <= q_lens[b] <= q_capacity, and every page that a
    sequence's first kv_lens[b] (+ extra) keys use is in [0, num_pages). A host synchronization: skipped while a
    CUDA graph is captured (the kernels clamp lengths and page indices, so a bad value cannot read outside a tensor)."""
    if capturing(kv_lens.device):
        return
    lens = kv_lens.to(torch.int64) + extra
    if lens.numel() and (int(lens.min()) < 0 or int(lens.max()) > capacity):
        bad = int(torch.nonzero((lens < 0) | (lens > capacity))[0, 0])
        what = "kv_lens + the new tokens" if extra else "kv_lens"
        raise InputError(f"{what} of sequence {bad} is {int(lens[bad])}; the cache holds 0..{capacity} keys per sequence")
    if q_lens is not None and q_lens.numel() and (int(q_lens.min()) < 0 or int(q_lens.max()) > q_capacity):
        bad = int(torch.nonzero((q_lens < 0) | (q_lens > q_capacity))[0, 0])
        raise InputError(f"q_lens of sequence {bad} is {int(q_lens[bad])}; q holds 0..{q_capacity} queries per sequence")
    if block_table is not None and block_table.numel():
        pages_used = (lens + page_size - 1) // page_size  # (B,)
        used = torch.arange(block_table.shape[1], device=block_table.device)[None, :] < pages_used[:, None]
        bad = used & ((block_table < 0) | (block_table >= num_pages))
        if bool(bad.any()):
            b, j = (int(x) for x in torch.nonzero(bad)[0])
            raise InputError(f"block_table[{b}, {j}] = {int(block_table[b, j])} is not a page of the cache (0..{num_pages - 1}); "
                             f"sequence {b} uses its first {int(pages_used[b])} entries")
