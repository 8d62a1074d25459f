"""Decoding: a few new query tokens per sequence against a long key/value cache.

The work is reading the cache: every key and value once, so the kernels are limited by memory bandwidth, not
by the matrix units. The decode kernels (templates/triton/decode.py.jinja) therefore
  - read K and V once per key/value head: the query heads that share it (grouped-query attention) and the new
    tokens are the rows of one tile, `rows_per_kv_head = (Hq / Hkv) * Nq` of them, up to 64 a program;
  - split the key tiles of each (sequence, key/value head) into `splits` runs, one program each, when there are
    too few (sequence, head) pairs to fill the GPU (flash-decoding), and merge the runs' partial outputs by
    their log-sum-exp in a fixed order (bit-reproducible);
  - take per-sequence lengths (kv_lens, q_lens) and paged caches (block_table), with nothing read past a
    sequence's length.

This module decides the split and the rows (pure functions of the call's shapes and the target, never of the
lengths' values, so a CUDA graph can capture a decode step) and which plain calls take the decode kernels.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from .plan import KernelPlan

# Plain calls (no kv_lens, q_lens or block_table) with at most DECODE_MAX_Q queries and at least DECODE_MIN_KEYS
# keys (a single query: DECODE_MIN_KEYS_1) take the decode kernels where nothing needs a gradient: the prefill
# forward launches one program per query tile and query head, so a few query rows keep a few SMs busy and read K
# and V once per query head. Measured on the H100 (BENCHMARKS.md, 2026-11-25 session 8; B=8, 32 over 8 heads, d=128,
# eager calls of the modules): 1 query: decode 13.5 / 29.9 / 68.5 us at 256 / 1024 / 4096 keys, the Gluon forward
# 19.6 / 39.2 / 109.5, the Triton forward 24.4 / 49.1 / 143.3; 16 queries: decode 37.2 / 75.6 us at 1024 / 4096 keys
# against 52.9 / 110.4 at best, but at 256 keys the Gluon forward took 20.6 us and decode 50.0.
DECODE_MAX_Q = 16
DECODE_MIN_KEYS = 1024
DECODE_MIN_KEYS_1 = 256
# The split fills PROGRAMS_PER_SM * SMs slots. Measured on the H100 (BENCHMARKS.md, 2026-11-25 session 8): one
# program per SM (B=1 and 8 at 32k keys: 15 and 2 runs) read 4-10 % faster than two (30 and 4 runs): fewer,
# longer runs, and a program already keeps enough bytes in flight (157-254 registers a thread, ptxas).
PROGRAMS_PER_SM = 1
MAX_SPLITS = 64  # more runs would only add partial results to merge; the generated module's combine takes this many
MIN_TILES_PER_SPLIT = 4  # each run reads at least this many key tiles


@dataclass(frozen=True)
class DecodeShape:
    """How a decode call is cut into programs: block_r rows (of rows_per_kv_head) a program, row_blocks of those
    per (sequence, key/value head), and the key tiles in `splits` runs."""

    rows_per_kv_head: int
    block_r: int
    row_blocks: int
    splits: int
    programs: int  # batch * kv_heads * row_blocks * splits

    def describe(self) -> str:
        return (f"{self.rows_per_kv_head} rows per key/value head (query heads x queries) in {self.row_blocks} block(s) of {self.block_r}; "
                f"keys split in {self.splits} run(s): {self.programs} programs")


def block_rows(rows_per_kv_head: int) -> int:
    """BLOCK_R: a power of two in [16, 64] (tl.dot's smallest side; 64 rows of float32 O and scores fit the
    registers of 4 warps)."""
    return min(64, max(16, 1 << (max(1, rows_per_kv_head) - 1).bit_length()))


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def num_splits(programs: int, key_tiles: int, sm_count: int) -> int:
    """Runs per (sequence, key/value head, row block): the fewest that fill the GPU's slots (PROGRAMS_PER_SM
    per SM) in whole waves, to within 10 % of the best fill any count up to MAX_SPLITS gives; 1 when the pairs
    alone nearly fill it. Each run keeps at least MIN_TILES_PER_SPLIT key tiles."""
    slots = PROGRAMS_PER_SM * sm_count
    most = max(1, min(MAX_SPLITS, key_tiles // MIN_TILES_PER_SPLIT))
    if programs >= 0.8 * slots or most == 1:
        return 1

    def fill(s: int) -> float:  # the busy fraction of the last wave's slots, over all waves
        waves = programs * s / slots
        return waves / math.ceil(waves)

    best = max(fill(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if fill(s) >= 0.9 * best)


def decode_shape(plan: KernelPlan, batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int) -> DecodeShape:
    """The cut of a decode call of these sizes (kv_len: the cache's capacity per sequence) on the plan's target."""
    rows = max(1, heads // kv_heads * q_len)
    block_r = block_rows(rows)
    row_blocks = _cdiv(rows, block_r)
    programs = batch * kv_heads * row_blocks
    splits = num_splits(programs, _cdiv(kv_len, plan.decode_block_n), plan.target.sm_count)
    return DecodeShape(rows, block_r, row_blocks, splits, programs * splits)


def takes_plain_call(q_len: int, kv_len: int) -> bool:
    """Whether a plain call of these lengths (no gradient, no dropout, no block mask) takes the decode kernels."""
    return q_len <= DECODE_MAX_Q and kv_len >= (DECODE_MIN_KEYS_1 if q_len == 1 else DECODE_MIN_KEYS)
