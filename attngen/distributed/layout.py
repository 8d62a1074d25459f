"""How a sequence is split across the ranks of a process group: which tokens each rank holds (its chunks), and
shard / unshard, which convert between a whole tensor and a rank's part.

contiguous: rank r holds tokens [r n, (r + 1) n), n = N / world.
zigzag:     the sequence is cut into 2 world equal chunks and rank r holds chunks r and 2 world - 1 - r, so that
            under a causal mask every rank has the same work (an early chunk with little to attend to and a late
            one with much)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from ..errors import InputError

LAYOUTS = ("contiguous", "zigzag")


@dataclass(frozen=True)
class Chunk:
    """`length` consecutive tokens of the whole sequence from position `start`, held at rows `row`.. of the rank's
    shard."""

    start: int
    length: int
    row: int


def check_layout(layout: str) -> str:
    if layout not in LAYOUTS:
        raise InputError(f"layout must be one of {', '.join(LAYOUTS)}; got {layout!r}")
    return layout


def chunks(layout: str, rank: int, world: int, local_len: int) -> tuple[Chunk, ...]:
    """The chunks of the sequence rank `rank` of `world` holds, each rank holding local_len tokens."""
    if layout == "contiguous":
        return (Chunk(rank * local_len, local_len, 0),)
    if local_len % 2:
        raise InputError(f"layout='zigzag' splits each rank's tokens into two equal chunks; this shard has {local_len} tokens (odd)")
    half = local_len // 2
    return (Chunk(rank * half, half, 0), Chunk((2 * world - 1 - rank) * half, half, half))


def _group_shape(group) -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise InputError("attngen.distributed needs an initialized default process group (torch.distributed.init_process_group)")
    return dist.get_rank(group), dist.get_world_size(group)


def shard(x: torch.Tensor, layout: str = "contiguous", group=None, dim: int = 2) -> torch.Tensor:
    """This rank's part of a tensor every rank holds whole: tokens along `dim` (2 for (B, H, N, D) tensors), by
    `layout`. N must divide evenly (into world parts, or 2 world for zigzag). A contiguous copy."""
    check_layout(layout)
    rank, world = _group_shape(group)
    n = x.shape[dim]
    parts = world if layout == "contiguous" else 2 * world
    if n % parts:
        raise InputError(f"shard: {n} tokens along dim {dim} do not split into {parts} equal chunks ({world} ranks, layout={layout!r})")
    local = n // world
    return torch.cat([x.narrow(dim, c.start, c.length) for c in chunks(layout, rank, world, local)], dim).contiguous()


def unshard(x: torch.Tensor, layout: str = "contiguous", group=None, dim: int = 2) -> torch.Tensor:
    """The whole tensor from every rank's part (an all-gather): the inverse of shard. Every rank's part must have
    the same shape."""
    import torch.distributed as dist

    check_layout(layout)
    rank, world = _group_shape(group)
    x = x.contiguous()
    parts = [torch.empty_like(x) for _ in range(world)]
    dist.all_gather(parts, x, group=group)
    local = x.shape[dim]
    pieces = []
    for r, part in enumerate(parts):
        pieces += [(c.start, part.narrow(dim, c.row, c.length)) for c in chunks(layout, r, world, local)]
    return torch.cat([p for _, p in sorted(pieces, key=lambda sp: sp[0])], dim)
