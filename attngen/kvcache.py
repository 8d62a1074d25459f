"""Key/value caches for serving: writing new tokens at each sequence's position, and reading a paged cache back.

A paged cache (a spec with `kv_layout = paged`) is vLLM's and flash_attn_with_kvcache's layout: `k_cache`,
`v_cache` of shape (num_pages, page_size, Hkv, D), shared by every sequence, and a block table (B, max_pages,
int32) whose row b lists sequence b's pages in order: its key j is slot j % page_size of page
block_table[b, j // page_size]. Pages may appear in any order and be shared between sequences (a common prefix).
A contiguous cache is (B, Hkv, capacity, D), attngen's usual layout, with per-sequence lengths.

Nothing here synchronizes the host with the GPU while a CUDA graph is being captured, and nothing allocates by
value, so a decode step (append, then attend) can be captured and replayed.
"""
from __future__ import annotations

import torch

from .errors import InputError
from .runtime.serving import check_block_table, check_lengths, check_paged_cache, check_values

__all__ = ["append", "gather"]


def append(k_cache: torch.Tensor, v_cache: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, kv_lens: torch.Tensor,
           block_table: torch.Tensor | None = None, k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None) -> torch.Tensor:
    """Writes T new keys and values per sequence, k_new and v_new of shape (B, Hkv, T, D) (attngen's layout),
    into the cache at each sequence's positions kv_lens[b] .. kv_lens[b] + T - 1, and returns the new lengths
    (kv_lens + T, a new tensor; kv_lens is not changed).

    Paged (block_table given): k_cache, v_cache are (num_pages, page_size, Hkv, D); the pages those positions
    fall in must already be in the sequence's row of the block table. Contiguous: (B, Hkv, capacity, D).
    The lengths and pages are checked against the cache first (a host synchronization), except while a CUDA
    graph is captured.

    FP8 caches (e4m3, a `kv_dtype = fp8` spec): the new values are written as value / descale, saturated at +-448,
    with the caches' descale factors k_descale, v_descale (float32, (1,), (Hkv,) or (B, Hkv); default 1): the
    factors the calls then pass."""
    for name, t in (("k_new", k_new), ("v_new", v_new)):
        if not isinstance(t, torch.Tensor) or t.dim() != 4:
            raise InputError(f"{name} must be a 4-D tensor (batch, kv_heads, new tokens, head_dim)")
    if k_new.shape[:3] != v_new.shape[:3]:
        raise InputError(f"k_new and v_new must have the same batch, heads and tokens, got {tuple(k_new.shape)} and {tuple(v_new.shape)}")
    batch, heads, tokens, _ = k_new.shape
    check_lengths("kv_lens", kv_lens, batch, k_new.device)
    if k_cache.dtype == torch.float8_e4m3fn and isinstance(k_cache, torch.Tensor) and k_new.dtype != k_cache.dtype:
        from .fp8 import cache_scales, to_cache

        k_new, v_new = (to_cache(x, cache_scales(name, s, batch, heads, x.device)[:, :, None, None])
                        for name, x, s in (("k_descale", k_new, k_descale), ("v_descale", v_new, v_descale)))
    elif k_descale is not None or v_descale is not None:
        raise InputError("k_descale and v_descale go with FP8 (e4m3) caches")
    pos = kv_lens.to(torch.int64)[:, None] + torch.arange(tokens, device=kv_lens.device)  # (B, T): where the new tokens go
    if block_table is None:
        for name, cache, dim in (("k_cache", k_cache, k_new.shape[3]), ("v_cache", v_cache, v_new.shape[3])):
            if not isinstance(cache, torch.Tensor) or cache.dim() != 4 or cache.shape[0] != batch or cache.shape[1] != heads or cache.shape[3] != dim:
                what = tuple(cache.shape) if isinstance(cache, torch.Tensor) else type(cache).__name__
                raise InputError(f"{name} must be a contiguous cache (batch {batch}, kv_heads {heads}, capacity, {dim} columns), got {what}")
            if cache.dtype != k_new.dtype or cache.device != k_new.device:
                raise InputError(f"{name} is {cache.dtype} on {cache.device}; k_new is {k_new.dtype} on {k_new.device}")
        if v_cache.shape[2] != k_cache.shape[2]:
            raise InputError(f"k_cache and v_cache must hold as many tokens, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
        capacity = k_cache.shape[2]
        check_values(kv_lens, capacity, extra=tokens)
        for cache, new in ((k_cache, k_new), (v_cache, v_new)):
            _bytes(cache).scatter_(2, pos[:, None, :, None].expand(batch, heads, tokens, new.shape[3]), _bytes(new))
    else:
        _append_paged(k_cache, v_cache, k_new, v_new, kv_lens, block_table, pos)
    return kv_lens + tokens


def _append_paged(k_cache, v_cache, k_new, v_new, kv_lens, block_table, pos) -> None:
    """append's paged case: the caches and table checked, the new tokens written at `pos` through the table."""
    batch, heads, tokens, _ = k_new.shape
    check_block_table(block_table, batch, k_new.device)
    for name, cache, new in (("k_cache", k_cache, k_new), ("v_cache", v_cache, v_new)):
        check_paged_cache(name, cache, None, k_new)
        if cache.shape[2] != heads or cache.shape[3] != new.shape[3]:
            raise InputError(f"{name} has {cache.shape[2]} kv_heads of {cache.shape[3]} columns; {name[0]}_new has {heads} of {new.shape[3]}")
    if v_cache.shape[:3] != k_cache.shape[:3]:
        raise InputError(f"k_cache and v_cache must have the same pages, page size and heads, got {tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    page_size = k_cache.shape[1]
    check_values(kv_lens, block_table.shape[1] * page_size, block_table, k_cache.shape[0], page_size, extra=tokens)
    pages = block_table.to(torch.int64).gather(1, pos // page_size)  # (B, T)
    slots = pos % page_size
    _bytes(k_cache)[pages, slots] = _bytes(k_new).transpose(1, 2)  # (B, T, Hkv, D) into (pages, slots) of (num_pages, page_size, Hkv, D)
    _bytes(v_cache)[pages, slots] = _bytes(v_new).transpose(1, 2)


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """An e4m3 tensor as its bytes (torch's scatter and indexed writes have no e4m3 kernels); others as they are."""
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def gather(cache: torch.Tensor, block_table: torch.Tensor, length: int | None = None) -> torch.Tensor:
    """A paged cache's keys (or values) of every sequence as one contiguous (B, Hkv, length, D) tensor: key j of
    sequence b from page block_table[b, j // page_size] (default length: every page of the table's rows). An
    entry that is not a page of the cache (one past what a sequence uses may hold anything) reads page 0 or the
    last page."""
    page_size = cache.shape[1]
    length = block_table.shape[1] * page_size if length is None else length
    pos = torch.arange(length, device=cache.device)
    pages = block_table.to(torch.int64)[:, pos // page_size].clamp(0, cache.shape[0] - 1)  # (B, length)
    return cache[pages, (pos % page_size)[None, :]].permute(0, 2, 1, 3)  # (B, length, Hkv, D) -> (B, Hkv, length, D)
