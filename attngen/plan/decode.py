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

from .planner import KernelPlan

# Plain calls (no kv_lens, q_lens or block_table) with at most DECODE_MAX_Q queries and at least DECODE_MIN_KEYS
# keys (a single query: DECODE_MIN_KEYS_1) take the decode kernels where nothing needs a gradient: the prefill
# forward launches one program per query tile and query head, so a few query rows keep a few SMs busy and read K
# and V once per query head. Measured on the H100 (2026-11-25; B=8, 32 over 8 heads, d=128,
# eager calls of the modules): 1 query: decode 13.5 / 29.9 / 68.5 us at 256 / 1024 / 4096 keys, the Gluon forward
# 19.6 / 39.2 / 109.5, the Triton forward 24.4 / 49.1 / 143.3; 16 queries: decode 37.2 / 75.6 us at 1024 / 4096 keys
# against 52.9 / 110.4 at best, but at 256 keys the Gluon forward took 20.6 us and decode 50.0.
DECODE_MAX_Q = 16
DECODE_MIN_KEYS = 1024
DECODE_MIN_KEYS_1 = 256
# The split fills PROGRAMS_PER_SM * SMs slots. Measured on the H100 (2026-11-25): one
# program per SM (B=1 and 8 at 32k keys: 15 and 2 runs) read 4-10 % faster than two (30 and 4 runs): fewer,
# longer runs, and a program already keeps enough bytes in flight (157-254 registers a thread, ptxas).
PROGRAMS_PER_SM = 1
MAX_SPLITS = 64  # more runs would only add partial results to merge; the generated module's combine takes this many
# The runs are counted so that the busiest program reads as few key tiles as any count gives (within SPAN_SLACK),
# each at least MIN_KEYS_PER_SPLIT keys. Measured on the H100 (2026-11-26; B=1, 32/8
# heads, d=128, one token, a step's graph): 16 runs against the fill rule's 15 (8 tiles a program against 9) 0.99x
# the time at 4096-32768 keys contiguous; paged (128-key tiles) 16 runs of 2 tiles against 8 of 4 at 4096 keys
# 0.84x, against 15 at 8192 0.95x.
SPAN_SLACK = 0.05
MIN_KEYS_PER_SPLIT = 256


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


def num_splits(programs: int, kv_len: int, block_n: int, sm_count: int) -> int:
    """Runs per (sequence, key/value head, row block): the fewest whose busiest slot (PROGRAMS_PER_SM per SM)
    reads within SPAN_SLACK of the fewest key tiles any count up to MAX_SPLITS gives; 1 when the pairs alone
    nearly fill the GPU. Each run keeps at least MIN_KEYS_PER_SPLIT keys. A run reads cdiv(key tiles, runs) of
    the key tiles of block_n keys, so the count that divides them evenly wins: 128 tiles (8192 keys) over 8 heads
    in 16 runs read 8 tiles a program on 128 SMs, in 15 runs 9 on 120."""
    key_tiles = _cdiv(kv_len, block_n)
    slots = PROGRAMS_PER_SM * sm_count
    most = max(1, min(MAX_SPLITS, kv_len // MIN_KEYS_PER_SPLIT))
    if programs >= 0.8 * slots or most == 1:
        return 1

    def span(s: int) -> int:  # key tiles the busiest slot reads: one run of cdiv(key_tiles, s) tiles a wave
        return math.ceil(programs * s / slots) * _cdiv(key_tiles, s)

    best = min(span(s) for s in range(1, most + 1))
    return next(s for s in range(1, most + 1) if span(s) <= (1 + SPAN_SLACK) * best)


def decode_shape(plan: KernelPlan, batch: int, heads: int, kv_heads: int, q_len: int, kv_len: int) -> DecodeShape:
    """The cut of a decode call of these sizes (kv_len: the cache's capacity per sequence) on the plan's target."""
    rows = max(1, heads // kv_heads * q_len)
    block_r = block_rows(rows)
    row_blocks = _cdiv(rows, block_r)
    programs = batch * kv_heads * row_blocks
    splits = num_splits(programs, kv_len, plan.decode_block_n, plan.target.sm_count)
    return DecodeShape(rows, block_r, row_blocks, splits, programs * splits)


def takes_plain_call(q_len: int, kv_len: int) -> bool:
    """Whether a plain call of these lengths (no gradient, no dropout, no block mask) takes the decode kernels."""
    return q_len <= DECODE_MAX_Q and kv_len >= (DECODE_MIN_KEYS_1 if q_len == 1 else DECODE_MIN_KEYS)
