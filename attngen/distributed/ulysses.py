"""Head-parallel context parallelism (DeepSpeed-Ulysses) and its combination with the ring ("hybrid", unified
sequence parallelism), forward and backward.

ulysses: every rank of the group holds its shard of the sequence, all heads. One all_to_all gives each rank the
whole sequence for its share of the heads (query heads Hq / world each; key/value heads as many as those query
heads read, a head sent to several ranks where there are fewer key/value heads than ranks); the kernel runs on the
whole sequence, as on one GPU; a second all_to_all gives each rank its tokens of every head back. The backward is
the same exchanges reversed (autograd through _Exchange). Inputs the expressions index by the query head are split
the same way; their gradients (and those of every other input) are summed over the group.

hybrid: the group's ranks form sub-groups of `ulysses_size` consecutive ranks; Ulysses inside each sub-group turns
its ranks' shards into one shard of the sub-groups' sequence for a share of the heads, and the ring
(attngen/distributed/ring.py) runs across the sub-groups (ranks at the same place in each), on that shard.

Head offsets: the kernel itself runs on a rank's heads where the expressions read the query head `h` only as a
bare index of inputs whose H dimensions are read so (`slopes[h]`, `sinks[h]`: those inputs are split with the
heads) and there is no dropout. Otherwise (h in an expression, dropout, whose pattern is drawn by each head's
index in the whole tensor) and in the hybrid's ring, the shard kernels run (attngen/runtime/shard.py) with the
inputs whole and the index of the rank's first head in the whole tensor (h_offset), so they see h as one GPU
does; under Ulysses alone as a ring of one rank.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import InputError
from ..lang.expr import children, input_reads
from ..lang.spec import Expr, Index, Spec, Var
from ..plan.planner import effective_mask

METHODS = ("ring", "ulysses", "hybrid")


def check_method(method: str, ulysses_size, world: int) -> int:
    """The method, checked; the size of the Ulysses sub-groups (the whole group for ulysses, 1 for the ring)."""
    if method not in METHODS:
        raise InputError(f"method must be one of {', '.join(METHODS)}; got {method!r}")
    if method == "ring":
        if ulysses_size not in (None, 1):
            raise InputError(f"ulysses_size goes with method='hybrid' (or 'ulysses'); got ulysses_size={ulysses_size} with method='ring'")
        return 1
    if method == "ulysses":
        if ulysses_size not in (None, world):
            raise InputError(f"method='ulysses' runs over the whole group ({world} ranks); got ulysses_size={ulysses_size} (use method='hybrid')")
        return world
    if not isinstance(ulysses_size, int) or isinstance(ulysses_size, bool) or ulysses_size < 1 or world % ulysses_size:
        raise InputError(f"method='hybrid' needs ulysses_size, a divisor of the group's {world} ranks; got {ulysses_size!r}")
    return ulysses_size


def head_split_axes(spec: Spec) -> dict[str, tuple[int, ...]]:
    """For each input, the axes its reads index by the bare query head `h` (split across the ranks with the heads).
    InputError where `h` appears otherwise, or an input's axis is read both by `h` and by something else, saying
    why: such specs run the shard kernels with the inputs whole and a head offset instead (context_parallel)."""
    exprs = [e for e in (effective_mask(spec), spec.score, spec.sink) if e is not None]
    for e in exprs:
        where = _bare_head(e)
        if where:
            raise InputError(f"the spec {spec.name!r} reads the query head h in {where}: its inputs cannot be split by head")
    axes: dict[str, set[int]] = {}
    for read in input_reads(*exprs):
        for axis, idx in enumerate(read.indices):
            if isinstance(idx, Var) and idx.name == "h":
                axes.setdefault(read.input, set()).add(axis)
    for read in input_reads(*exprs):
        for axis in axes.get(read.input, ()):
            idx = read.indices[axis]
            if not (isinstance(idx, Var) and idx.name == "h"):
                raise InputError(f"input {read.input!r} is read at h and at other values on dimension {axis}: it cannot be split by head")
    for decl in spec.inputs:  # each rank's kernel sees its share of the heads: H-sized dimensions are exactly those split
        split = axes.get(decl.name, set())
        for axis, dim in enumerate(decl.dims):
            if (dim == "H") != (axis in split):
                raise InputError(f"input {decl.name!r} dimension {axis} is declared {dim} but {'not ' if axis not in split else ''}read at h: "
                                 f"a rank's kernel sees its share of the heads, so exactly the H dimensions read at h are split")
    return {name: tuple(sorted(a)) for name, a in axes.items()}


def _bare_head(e: Expr) -> str:
    """A description of where `h` appears other than as a bare index of an input ('' if nowhere)."""
    if isinstance(e, Var):
        return "an expression" if e.name == "h" else ""
    if isinstance(e, Index):
        for idx in e.indices:
            if not (isinstance(idx, Var) and idx.name == "h"):
                found = _bare_head(idx)
                if found:
                    return f"an index of input {e.input!r}"
        return ""
    for c in children(e):
        found = _bare_head(c)
        if found:
            return found
    return ""


class _Exchange(torch.autograd.Function):
    """One all_to_all over `group` as an autograd function: rank r gets x.index_select(dim, sends[r]); what each
    rank s sends this one (of shape recv_shapes[s]) is concatenated along cat_dim in rank order. The backward
    sends the gradient's pieces back and adds what comes back at the indices sent (a piece sent to several ranks
    gets the sum of their gradients)."""

    @staticmethod
    def forward(ctx, x, group, dim: int, sends: list, recv_shapes: list, cat_dim: int):
        ctx.group, ctx.dim, ctx.sends, ctx.cat_dim, ctx.shape = group, dim, sends, cat_dim, x.shape
        ctx.sizes = [s[cat_dim] for s in recv_shapes]
        out = [x.new_empty(s) for s in recv_shapes]
        dist.all_to_all(out, [x.index_select(dim, i).contiguous() for i in sends], group=group)
        return torch.cat(out, cat_dim)

    @staticmethod
    def backward(ctx, grad):
        pieces = [p.contiguous() for p in grad.split(ctx.sizes, ctx.cat_dim)]
        back = []
        for i in ctx.sends:
            shape = list(ctx.shape)
            shape[ctx.dim] = i.numel()
            back.append(grad.new_empty(shape))
        dist.all_to_all(back, pieces, group=ctx.group)
        dx = grad.new_zeros(ctx.shape)
        for i, piece in zip(ctx.sends, back):
            dx.index_add_(ctx.dim, i, piece)
        return dx, None, None, None, None, None


class _SumOverGroup(torch.autograd.Function):
    """The identity, whose gradient is summed over the group (each rank's part of an input's gradient)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _ranges(total: int, world: int) -> list[range]:
    """Rank r's share of `total` heads: [r total / world, (r + 1) total / world)."""
    return [range(r * total // world, (r + 1) * total // world) for r in range(world)]


def kv_head_ranges(hq: int, hkv: int, world: int) -> list[range]:
    """The key/value heads each rank's query heads read (grouped-query heads: hq / hkv query heads a key/value head);
    a key/value head goes to every rank whose query heads read it."""
    group_size = hq // hkv
    return [range(r.start // group_size, (r.stop - 1) // group_size + 1) for r in _ranges(hq, world)]


def check_head_split(hq: int, hkv: int, world: int) -> None:
    """The heads split across `world` ranks: query heads evenly, key/value heads a multiple or a divisor of world."""
    if hq % world:
        raise InputError(f"context_parallel with method='ulysses' or 'hybrid' splits the query heads across {world} ranks; q has {hq}")
    if hkv % world and world % hkv:
        raise InputError(f"context_parallel with method='ulysses' or 'hybrid': {hkv} key/value heads neither split across {world} ranks "
                         f"nor divide them")


def token_order(layout: str, rank: int, world: int, n: int, device=None) -> torch.Tensor | None:
    """Where the gathered rows (rank 0's shard, then rank 1's, ...) are in the sub-group's sequence order: None for
    the contiguous layout (already in order), else the permutation that puts them in order (zigzag: each rank's
    first chunks, then the second chunks in reverse rank order), on `device`."""
    if layout == "contiguous":
        return None
    half = n // 2
    firsts = torch.arange(world, device=device)[:, None] * n + torch.arange(half, device=device)
    seconds = torch.arange(world - 1, -1, -1, device=device)[:, None] * n + half + torch.arange(half, device=device)
    return torch.cat([firsts.flatten(), seconds.flatten()])


_PLANS: dict = {}  # (layout, world, n, query head ranges, key/value head ranges, device) -> _Plan


class _Plan:
    """The index tensors of one shape's exchanges, made once on the device (made per call they were host work and
    host-to-device copies, each of which waited for the GPU): each rank's heads (sends along the head axis),
    the row order (token_order) and where each rank's rows are in it (sends along the token axis)."""

    def __init__(self, layout: str, world: int, n: int, q_heads: list[range], kv_heads: list[range], device):
        self.q_sends = [torch.arange(r.start, r.stop, device=device) for r in q_heads]
        self.kv_sends = [torch.arange(r.start, r.stop, device=device) for r in kv_heads]
        self.order = token_order(layout, 0, world, n, device)
        if self.order is None:
            at = torch.arange(world * n, device=device)
        else:  # where each gathered row is in sequence order: the inverse permutation
            at = torch.empty_like(self.order)
            at[self.order] = torch.arange(self.order.numel(), device=device)
        self.token_sends = [at[r * n:(r + 1) * n] for r in range(world)]  # rank r's rows, where they are in the gathered rows


def exchange_plan(layout: str, world: int, n: int, q_heads: list[range], kv_heads: list[range], device) -> _Plan:
    """The exchanges' index tensors for these shapes on `device` (_Plan), made on first use."""
    key = (layout, world, n, tuple(q_heads), tuple(kv_heads), device)
    plan = _PLANS.get(key)
    if plan is None:
        if len(_PLANS) >= 64:
            _PLANS.clear()
        plan = _PLANS[key] = _Plan(layout, world, n, q_heads, kv_heads, device)
    return plan


def to_heads(t: torch.Tensor, heads: list[range], sends: list[torch.Tensor], group, order: torch.Tensor | None) -> torch.Tensor:
    """A rank's shard t (B, H, n, D) -> the sub-group's rows (B, len(heads[me]), world n, D) of its heads, in sequence
    order; sends: each rank's heads as index tensors on t's device."""
    me = dist.get_rank(group)
    shapes = [(t.shape[0], len(heads[me]), t.shape[2], *t.shape[3:]) for _ in heads]
    out = _Exchange.apply(t, group, 1, sends, shapes, 2)
    return out if order is None else out.index_select(2, order)


def to_tokens(t: torch.Tensor, heads: list[range], sends: list[torch.Tensor], group, n: int) -> torch.Tensor:
    """The inverse of to_heads: the sub-group's rows of this rank's heads (B, h, world n[, D]) -> this rank's
    shard (B, H, n[, D]) of every head; sends: where each rank's rows are in t (_Plan.token_sends)."""
    world = len(heads)
    shapes = [(t.shape[0], len(heads[s]), n, *t.shape[3:]) for s in range(world)]
    return _Exchange.apply(t, group, 2, sends, shapes, 1)


def split_inputs(inputs: list, names: list[str], axes: dict[str, tuple[int, ...]], heads: range, group) -> list:
    """The inputs as this rank's kernel call takes them: split along their axes indexed by h to its heads (none: whole);
    those that get gradients pass through _SumOverGroup, so each rank's part of their gradient is summed."""
    out = []
    for name, t in zip(names, inputs):
        if t.requires_grad and torch.is_grad_enabled():
            t = _SumOverGroup.apply(t, group)
        for axis in axes.get(name, ()):
            t = t.narrow(axis, heads.start, len(heads))
        out.append(t)
    return out


def ulysses_forward(kern, q, k, v, inputs: list, names: list[str], axes: dict[str, tuple[int, ...]] | None, group, layout: str,
                    shard_method=None):
    """O and the lse (natural log) of this rank's shard by Ulysses over `group`. With `axes` (head_split_axes), the
    kernel itself on the sub-group's sequence for this rank's heads, the inputs split along those axes; else
    shard_method(q, k, v, inputs, (h_offset, heads)) -> (O, lse in natural log), on the sub-group's sequence for
    this rank's heads, given the inputs whole and the index of its first query head among the `heads` of the whole
    tensor (the shard kernels: a ring of one rank, or the hybrid's ring across sub-groups)."""
    world, me = dist.get_world_size(group), dist.get_rank(group)
    hq, hkv, n = q.shape[1], k.shape[1], q.shape[2]
    check_head_split(hq, hkv, world)
    q_heads, kv_heads = _ranges(hq, world), kv_head_ranges(hq, hkv, world)
    plan = exchange_plan(layout, world, n, q_heads, kv_heads, q.device)
    qh = to_heads(q, q_heads, plan.q_sends, group, plan.order)
    kh, vh = (to_heads(t, kv_heads, plan.kv_sends, group, plan.order) for t in (k, v))
    local = split_inputs(inputs, names, axes or {}, q_heads[me], group)
    if axes is not None:
        o, lse = kern(qh, kh, vh, return_lse=True, **dict(zip(names, local)))
    else:
        o, lse = shard_method(qh, kh, vh, local, (q_heads[me].start, hq))
    return to_tokens(o, q_heads, plan.token_sends, group, n), to_tokens(lse, q_heads, plan.token_sends, group, n)


_SUBGROUPS: dict = {}  # (group, world, ulysses_size) -> (this rank's Ulysses sub-group, its ring group)


def hybrid_groups(group, world: int, size: int):
    """This rank's Ulysses sub-group (ulysses_size consecutive ranks of `group`) and ring group (the ranks at the same
    place in every sub-group). Made once per group and size: every process of the world makes every sub-group (a
    collective of the whole world), so the first hybrid call with a group runs on every process at once."""
    key = (id(group), world, size)
    if key not in _SUBGROUPS:
        ranks = list(range(world)) if group is None else [dist.get_global_rank(group, r) for r in range(world)]
        me = dist.get_rank(group)
        mine = [None, None]
        for g in range(world // size):  # (every process creates every group, in the same order)
            members = ranks[g * size:(g + 1) * size]
            made = dist.new_group(members)
            if me // size == g:
                mine[0] = made
        for j in range(size):
            members = ranks[j::size]
            made = dist.new_group(members)
            if me % size == j:
                mine[1] = made
        _SUBGROUPS[key] = tuple(mine)
    return _SUBGROUPS[key]


