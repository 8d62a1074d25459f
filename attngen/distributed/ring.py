"""Ring attention over torch.distributed: one attention whose sequence is split across the ranks of a process
group, forward and backward.

Every rank holds its shard of q, k and v (attngen/distributed/layout.py says which tokens). The key/value shards
travel around the ring, rank r sending to r + 1 and receiving from r - 1 (torch.distributed's batch_isend_irecv:
NCCL on GPUs, gloo on CPUs), the transfer of the next shard overlapping the work on the current one. At step s rank
r holds the keys of rank r - s; for every pair of its query chunks and those key chunks that the mask does not
provably drop whole (attngen/lang/intervals.py, at the chunks' positions), the shard kernels (attngen/runtime/shard.py)
give a partial O and log-sum-exp (O float32 from the Triton generator, the inputs' type from the Gluon one), merged
into float32 in step order (so reruns are bit-identical). The backward sends the keys around again, with the
float32 sums of dK and dV for them: each rank adds its part, in ring order, and the last step hands each key
chunk's finished sums to its owner (in the inputs' element type) as soon as that chunk's pairs are done, under the
next chunk's. dQ stays on its rank. Float inputs get their gradients: those the score reads from the shard
kernels' terms (each pair's placed at its positions, or for reads at neither q_idx nor kv_idx the rows' sums over
the chunks, combined once every key was seen), those a sink reads from its rows; each rank's reduced as one GPU
does, then summed over the ranks. Expressions see positions in the whole sequence. Eager only: the
point-to-point calls and the host's choice of chunk pairs are not traced."""
from __future__ import annotations

import torch
import torch.distributed as dist

from ..errors import InputError
from ..lang.intervals import Truth, tile_env, truth
from ..lang.spec import DType, KVLayout
from ..runtime import Kernel
from ..runtime.checks import Dims, check_call, check_direct_indices, dropout_args
from ..runtime.evaluate import sink_rows
from ..runtime.input_grads import LOG2E, add_score_terms, add_sink_terms, grad_buffers, row_delta, shard_row_terms, sink_share_grads
from ..runtime.kernel import LN2
from ..runtime.loader import interpreted_if_cpu
from ..runtime.shard import shard_backward, shard_forward, shard_kernel
from .layout import Chunk, _group_shape, check_layout, chunks
from .ulysses import check_method, head_split_axes, hybrid_groups, ulysses_forward


class _Ring:
    """This rank's place in the group: its neighbours (as global ranks, which the point-to-point calls take)."""

    def __init__(self, group):
        self.group = group
        self.rank, self.world = _group_shape(group)
        peer = (lambda r: r) if group is None else (lambda r: dist.get_global_rank(group, r))
        self.next = peer((self.rank + 1) % self.world)
        self.prev = peer((self.rank - 1) % self.world)

    @classmethod
    def alone(cls) -> "_Ring":
        """A ring of one rank (no process group): the shard kernels on the whole sequence (Ulysses with head offsets)."""
        ring = cls.__new__(cls)
        ring.group, ring.rank, ring.world, ring.next, ring.prev = None, 0, 1, 0, 0
        return ring

    def send_recv(self, tensors: list[torch.Tensor]) -> "_Transfer":
        """Start sending `tensors` to the next rank and receiving the previous rank's (same shapes)."""
        bufs = [torch.empty_like(t) for t in tensors]
        ops = [dist.P2POp(dist.isend, t, self.next, self.group) for t in tensors]
        ops += [dist.P2POp(dist.irecv, b, self.prev, self.group) for b in bufs]
        return _Transfer(dist.batch_isend_irecv(ops), tensors, bufs)


class _Transfer:
    """Transfers in flight; wait() gives the received tensors (on a GPU: the current stream waits for them)."""

    def __init__(self, works, sent, received):
        self.works, self.sent, self.received = works, sent, received  # `sent` stays referenced until done

    def wait(self) -> list[torch.Tensor]:
        for w in self.works:
            w.wait()
        self.sent = None
        return self.received


_AGREED: set = set()  # (group, shapes) every rank of the group was seen to share


def _check_same_shapes(ring: _Ring, q: torch.Tensor, k: torch.Tensor) -> None:
    """Every rank's shards must have the same shapes (the ring exchanges equal buffers): checked once per group
    and shapes by an all-gather of the shapes."""
    key = (id(ring.group), ring.world, tuple(q.shape), tuple(k.shape), q.device)
    if key in _AGREED or ring.world == 1:
        return
    mine = torch.tensor([*q.shape, *k.shape], dtype=torch.int64, device=q.device)
    seen = [torch.empty_like(mine) for _ in range(ring.world)]
    dist.all_gather(seen, mine, group=ring.group)
    shapes = [tuple(s.tolist()) for s in seen]
    if len(set(shapes)) > 1:
        listing = "; ".join(f"rank {r}: q {s[:4]}, k {s[4:]}" for r, s in enumerate(shapes))
        raise InputError(f"context_parallel: every rank must hold a shard of the same shape (equal token counts); got {listing}")
    _AGREED.add(key)


def context_parallel(kern: Kernel, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group=None, layout: str = "contiguous", *,
                     method: str = "ring", ulysses_size: int | None = None, return_lse: bool = False, dropout_p: float | None = None,
                     seed: int | None = None, **inputs: torch.Tensor):
    """This rank's shard of the attention of the whole sequence, whose shards q, k, v (B, H, N / world, D) the
    ranks of `group` (default: the world) hold by `layout` ("contiguous" or "zigzag", see shard()).
    Differentiable (q, k, v). The spec's expressions see positions in the whole sequence, so causal masks,
    windows, documents and ALiBi mean what they mean on one GPU; declared inputs are passed whole (e.g. doc
    (B, N)), the same on every rank. return_lse: also this shard's rows' log-sum-exp (natural log). Dropout
    needs an explicit seed, the same on every rank, and chunks of a multiple of 128 tokens.

    method: "ring" (key/value shards travel around the group), "ulysses" (all_to_all exchanges sequence shards
    for head shards: each rank runs the kernel on the whole sequence for world / Hq of the query heads; Hq a
    multiple of the group's size, key/value heads a multiple or a divisor of it) or "hybrid" (Ulysses inside
    sub-groups of `ulysses_size` consecutive ranks, the ring across them); see attngen/distributed/ulysses.py.
    Every method sees the query head h and draws dropout's pattern as one GPU does.

    A sink joins each row of the merged result once. Float inputs that require grad get their gradients, summed
    over the ranks, by every method: those the score reads from the terms of the shard kernels (the Triton
    backward's; reads at q_idx or kv_idx give each pair of positions a float32 term, so such inputs cost the
    memory of a chunk pair's scores) or of the kernel itself (Ulysses), those a sink reads from its rows. Every
    rank must call it with equal shapes (checked once per group and shapes). Not supported: runtime block
    sparsity, paged caches, packed sequences, torch.compile (eager only)."""
    if not isinstance(kern, Kernel):
        raise InputError(f"context_parallel takes a kernel from attngen.compile, got {type(kern).__name__}")
    if torch.compiler.is_compiling():
        raise InputError("context_parallel is not supported under torch.compile yet: call it from a function marked "
                         "@torch.compiler.disable (the rest of the model can stay compiled)")
    check_layout(layout)
    spec = kern.spec
    if spec.sparsity == "runtime":
        raise InputError(f"context_parallel does not support runtime block sparsity yet (the spec {spec.name!r} has sparsity = runtime)")
    if spec.kv_layout is KVLayout.PAGED:
        raise InputError(f"context_parallel splits training-style attention; the spec {spec.name!r} has kv_layout = paged")
    if spec.dtype is DType.FP8:
        raise InputError(f"context_parallel does not take FP8 specs yet (their descale factors are not split); {spec.name!r} has dtype = fp8")
    ring = _Ring(group)
    ulysses_size = check_method(method, ulysses_size, ring.world)
    dims, tensors = check_call(kern, q, k, v, inputs)
    if q.shape[2] != k.shape[2]:
        raise InputError(f"context_parallel: q and k must be shards of one sequence (self-attention), the same number of tokens; "
                         f"q has {q.shape[2]}, k has {k.shape[2]}")
    seq_len = q.shape[2] * ring.world
    check_direct_indices(kern._direct_indices, Dims(dims.batch, dims.heads, dims.kv_heads, seq_len, seq_len), {d.name: t for d, t in zip(spec.inputs, tensors)})
    p, seed_t = dropout_args(spec, dropout_p, 0 if seed is None else seed, q.device)  # the probability and the seed, checked as for a call
    if p and seed is None:  # a call draws one from torch's generator, which the ranks need not share
        raise InputError("context_parallel with dropout needs seed= (a non-negative int below 2**63, the same on every rank), got None")
    seed_t = seed_t if p else None
    if method == "ring":
        o, lse2 = _ring_attention(kern, ring, layout, q, k, v, tensors, p, seed_t)
        return (o, lse2 * LN2) if return_lse else o
    # Ulysses, alone or inside the hybrid's sub-groups
    _check_same_shapes(ring, q, k)
    names = [d.name for d in spec.inputs]
    try:  # the kernel itself on each rank's heads, its inputs split with them
        axes = head_split_axes(spec) if method == "ulysses" and not p else None
    except InputError:  # h read otherwise: the shard kernels, with a head offset
        axes = None
    if method == "ulysses":
        def shard_method(qh, kh, vh, local, heads):  # a ring of one rank on the whole sequence
            o, lse2 = _ring_attention(kern, _Ring.alone(), "contiguous", qh, kh, vh, local, p, seed_t, heads)
            return o, lse2 * LN2
        o, lse = ulysses_forward(kern, q, k, v, tensors, names, axes, group, layout, shard_method)
    else:
        sub, across = hybrid_groups(group, ring.world, ulysses_size)

        def shard_method(qh, kh, vh, local, heads):  # the ring across sub-groups, on the sub-group's shard
            o, lse2 = _ring_attention(kern, _Ring(across), layout, qh, kh, vh, local, p, seed_t, heads)
            return o, lse2 * LN2
        o, lse = ulysses_forward(kern, q, k, v, tensors, names, None, sub, layout, shard_method)
    return (o, lse) if return_lse else o


def _ring_attention(kern: Kernel, ring: _Ring, layout: str, q, k, v, tensors: list, p: float, seed_t, heads: tuple[int, int] | None = None):
    """O (q's element type) and the lse (log2 units) of this rank's shard by the ring over `ring` (the inputs whole,
    checked by the caller); heads: (h_offset, heads of the whole tensor) where q holds a slice of the query heads
    (Ulysses), else q's heads are all of them."""
    spec = kern.spec
    n = q.shape[2]
    if p and ring.world > 1:
        chunk = chunks(layout, ring.rank, ring.world, n)[0].length
        if chunk % 128:
            raise InputError(f"context_parallel with dropout needs chunks of a multiple of 128 tokens (the dropout pattern is drawn "
                             f"in groups of 64 keys at tile-aligned positions); this rank's chunks have {chunk}")
    _check_same_shapes(ring, q, k)
    run = _Run(kern, ring, layout, n, tensors, p, seed_t, heads or (0, q.shape[1]))
    leaves = [i for i, t in enumerate(tensors) if t.requires_grad] if torch.is_grad_enabled() else []
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or leaves):
        run.leaves = leaves
        return _RingAttention.apply(run, q, k, v, *(tensors[i] for i in leaves))
    return run.forward(q, k, v)


class _Run:
    """One context-parallel call's fixed parts: the kernel, the ring, the layout and the pairs of chunks to compute.
    Tensors are handled chunk by chunk, each chunk's rows contiguous (copied once per call where the layout has
    two chunks per rank), so no kernel call copies its operands and the ring sends whole tensors."""

    def __init__(self, kern: Kernel, ring: _Ring, layout: str, n: int, inputs: list, dropout_p: float, seed: torch.Tensor | None,
                 heads: tuple[int, int]):
        self.kern, self.ring, self.inputs, self.dropout_p, self.seed = kern, ring, inputs, dropout_p, seed
        self.heads = heads  # (the index of q's first head among the whole tensor's, their number): the kernels' h_offset, seq_heads
        self.leaves: list[int] = []  # which inputs (by position) get gradients
        self._sinks: torch.Tensor | None = None  # the sink of every row (_sink), once evaluated
        self.seq_len = n * ring.world
        self.mine = chunks(layout, ring.rank, ring.world, n)
        self.steps = _chunk_pairs(kern.plan, layout, ring.rank, ring.world, n)

    def _split(self, t: torch.Tensor | None) -> list:
        """t's rows as one contiguous tensor per chunk of this rank's layout."""
        if t is None:
            return [None] * len(self.mine)
        return [t[:, :, _rows(c)].contiguous() for c in self.mine]

    def forward(self, q, k, v):
        """This rank's O and lse (log2 units) of the whole attention."""
        qs = self._split(q)
        kv = self._split(k) + self._split(v)  # the key chunks, then the value chunks: what travels the ring
        count = len(self.mine)
        o_acc, lse_acc = [None] * count, [None] * count
        for step, pairs in enumerate(self.steps):
            transfer = self.ring.send_recv(kv) if step < self.ring.world - 1 else None
            for i, j, positions in pairs:
                o, lse = shard_forward(self.kern, qs[i], kv[j], kv[count + j], self.inputs, self.dropout_p, self.seed, positions + self.heads)
                if o_acc[i] is None:  # the first part of these rows: taken as it is
                    o_acc[i], lse_acc[i] = o.float().contiguous(), lse.contiguous()
                else:
                    _merge(self.kern, o_acc[i], lse_acc[i], o, lse)
            if transfer is not None:
                kv = transfer.wait()
        for i, c in enumerate(self.mine):  # rows that no key chunk reaches: O = 0, lse = -inf
            if o_acc[i] is None:
                o_acc[i] = q.new_zeros((*q.shape[:2], c.length, v.shape[3]), dtype=torch.float32)
                lse_acc[i] = torch.full((*q.shape[:2], c.length), float("-inf"), device=q.device, dtype=torch.float32)
        if self.kern.spec.sink is not None:  # one more term of each merged row's softmax, with no value
            sink = self._sink(q.shape[0], q.shape[1], q.device)
            for i, c in enumerate(self.mine):
                _merge(self.kern, o_acc[i], lse_acc[i], None, sink[:, :, _positions(c)])
        return torch.cat(o_acc, 2).to(q.dtype), torch.cat(lse_acc, 2)

    def _sink(self, batch: int, heads: int, device) -> torch.Tensor:
        """The sink of every row of the whole sequence (B, H, seq_len) for q's heads, log2 units, float32: evaluated
        once a call (for every head of the whole tensor, where q holds a slice of them), by the forward, and kept
        for the backward (the inputs it reads are the same tensors)."""
        if self._sinks is None:
            named = {d.name: t.detach() for d, t in zip(self.kern.spec.inputs, self.inputs)}
            first, total = self.heads
            every = sink_rows(self.kern.spec, named, batch, total, self.seq_len, self.seq_len, device, torch.float32)
            self._sinks = every[:, first:first + heads] * LOG2E
        return self._sinks

    def _add_pair_terms(self, grads: dict, uniform_rows: list, i: int, positions: tuple, terms: list) -> None:
        """A chunk pair's terms of the gradients of the inputs the score reads (shard_backward with input_grads):
        those of reads at q_idx or kv_idx placed at once at the pair's positions (and heads), the row sums of the
        others added up for query chunk i, to be combined once every key was seen (_input_grads)."""
        reads = self.kern.plan.read_grads
        pairwise = [(g, t) for g, t in zip(reads, terms) if g.kind != "uniform"]
        if pairwise:
            add_score_terms(grads, self.kern.spec, self._dims, self._named, *zip(*pairwise), (0, self.heads[0], positions[0], positions[1]))
        sums = [t for g, t in zip(reads, terms) if g.kind == "uniform"] + terms[len(reads):]  # then the rows' sums of P, P dP
        if sums:
            uniform_rows[i] = sums if uniform_rows[i] is None else [a.add_(b) for a, b in zip(uniform_rows[i], sums)]

    def _input_grads(self, grads: dict, uniform_rows: list, o, lse, do, dlse) -> list[torch.Tensor]:
        """The gradients of the inputs that get them (self.leaves), summed over the ranks: `grads` holds this rank's
        pairwise terms so far (_add_pair_terms); here the rows' terms of score reads at neither q_idx nor kv_idx
        (from their sums over every key, shard_row_terms) and each row's d loss / d sink, p_sink * (d loss / d lse
        - rowsum(dO * O)) with p_sink = 2^(sink - lse), each at its position in the whole sequence and its head
        among the whole tensor's, reduced as one GPU does (runtime/input_grads.py); then all-reduced."""
        spec = self.kern.spec
        batch, heads = o.shape[:2]
        first = self.heads[0]
        sink = self._sink(batch, heads, o.device) if spec.sink is not None else None
        uniform = [g for g in self.kern.plan.read_grads if g.kind == "uniform"]
        for i, c in enumerate(self.mine):
            if uniform_rows[i] is None:  # no key reached these rows: no terms
                continue
            at = _rows(c)
            *sums, row_sums = uniform_rows[i]
            rows = [shard_row_terms(t, row_sums, lse[:, :, at], None if sink is None else sink[:, :, _positions(c)],
                                    None if dlse is None else dlse[:, :, at]) for t in sums]
            add_score_terms(grads, spec, self._dims, self._named, uniform, rows, (0, first, c.start, 0))
        if sink is not None:
            rows = sink.new_zeros((batch, self.heads[1], self.seq_len))  # every head of the whole tensor: q's a slice of them
            for c in self.mine:
                at = _rows(c)
                delta = row_delta(o[:, :, at], do[:, :, at], None if dlse is None else dlse[:, :, at])
                rows[:, first:first + heads, _positions(c)] = sink_share_grads(sink[:, :, _positions(c)], lse[:, :, at], delta)
            add_sink_terms(grads, spec, self._dims, self._named, rows)
        out = []
        for i in self.leaves:
            g = grads[spec.inputs[i].name]
            if self.ring.world > 1:
                dist.all_reduce(g, group=self.ring.group)
            out.append(g.to(self.inputs[i].dtype))
        return out

    def backward(self, q, k, v, o, lse, do, dlse):
        """(dQ, dK, dV, [the gradients of the inputs self.leaves]) of this rank's shards: dQ summed here, dK and dV
        summed around the ring in float32, the inputs' gradients summed over the ranks (_input_grads)."""
        qs, os, lses, dos, dlses = (self._split(t) for t in (q, o, lse, do, dlse))
        count = len(self.mine)
        kv = self._split(k) + self._split(v)
        dq = [None] * count
        grads = None
        if self.leaves:  # the inputs' gradients: the score's reads give terms from the shard kernels, added here
            self._named = {d.name: t.detach() for d, t in zip(self.kern.spec.inputs, self.inputs)}
            self._dims = Dims(q.shape[0], self.heads[1], self.heads[1], self.seq_len, self.seq_len)
            grads = grad_buffers(self._named)
        trained = {self.kern.spec.inputs[i].name for i in self.leaves}
        input_grads = any(g.read.input in trained for g in self.kern.plan.read_grads)  # the shard kernels' terms wanted
        uniform_rows = [None] * count  # per query chunk: the row sums of score reads at neither q_idx nor kv_idx
        sums = None  # the dK, dV sums of the keys this rank holds, on their way from the previous rank
        handed = []  # the last step's transfers: each key chunk's finished dK, dV, to their owner
        for step, pairs in enumerate(self.steps):
            last = step == self.ring.world - 1
            transfer = None if last else self.ring.send_recv(kv)
            parts = [None] * (2 * count)  # this rank's part of dK (key chunks), then of dV
            received = None  # (the last step) the sums from the previous rank, once waited for
            # at the last step the pairs go key chunk by key chunk: a chunk's sums leave for their owner as soon as
            # they are complete, under the next chunk's pairs (each dQ chunk still adds its key chunks in order)
            for chunk in range(count) if last else (None,):
                for i, j, positions in pairs:
                    if chunk is not None and j != chunk:
                        continue
                    dq_p, dk_p, dv_p, *terms = shard_backward(self.kern, qs[i], kv[j], kv[count + j], os[i], lses[i], dos[i], dlses[i],
                                                              self.inputs, self.dropout_p, self.seed, positions + self.heads, input_grads)
                    if terms:
                        self._add_pair_terms(grads, uniform_rows, i, positions, terms[0])
                    dq[i] = dq_p.float() if dq[i] is None else dq[i].add_(dq_p)
                    for at, part in ((j, dk_p), (count + j, dv_p)):
                        parts[at] = part.float() if parts[at] is None else parts[at].add_(part)
                if chunk is None:
                    continue
                if received is None and sums is not None:
                    received = sums.wait()
                # complete: to their owner in the inputs' element type (what the owner would round them to)
                done = [_added(received, parts, at, kv).to(k.dtype) for at in (chunk, count + chunk)]
                handed.append(self.ring.send_recv(done) if self.ring.world > 1 else _Done(done))
            if not last:  # the sums so far (the ranks before this one in ring order, then this rank's part), to the next rank
                received = None if sums is None else sums.wait()
                total = [_added(received, parts, at, kv) for at in range(2 * count)]
                sums = self.ring.send_recv(total)
            if transfer is not None:
                kv = transfer.wait()
        for i, c in enumerate(self.mine):
            if dq[i] is None:
                dq[i] = q.new_zeros((*q.shape[:2], c.length, q.shape[3]), dtype=torch.float32)
        dq = torch.cat(dq, 2).to(q.dtype)  # under the last transfers
        done = [t.wait() for t in handed]  # (dK, dV) of each key chunk of this rank
        inputs = self._input_grads(grads, uniform_rows, o, lse, do, dlse) if grads is not None else []
        return dq, torch.cat([d[0] for d in done], 2), torch.cat([d[1] for d in done], 2), inputs


def _added(received: list | None, parts: list, at: int, kv: list) -> torch.Tensor:
    """The float32 sums of kv[at]'s gradient so far: those received (None: this rank's part is the first), plus this
    rank's part (None: it had no pair with those keys)."""
    if received is None:
        return parts[at] if parts[at] is not None else torch.zeros_like(kv[at], dtype=torch.float32)
    return received[at] if parts[at] is None else received[at].add_(parts[at])


_PAIRS: dict = {}  # (mask, classify, layout, rank, world, n) -> _chunk_pairs' steps


def _chunk_pairs(plan, layout: str, rank: int, world: int, n: int) -> list:
    """Step s of the ring: the pairs (i, j, positions) of this rank's query chunk i and key chunk j of rank r - s
    whose block the mask does not provably drop (interval analysis at the chunks' positions). Worked out once per
    mask, layout, rank and shard length: a training loop's calls share them."""
    key = (plan.mask, plan.classify, layout, rank, world, n)
    steps = _PAIRS.get(key)
    if steps is None:
        seq_len = n * world
        mine = chunks(layout, rank, world, n)

        def dropped(qc: Chunk, kc: Chunk) -> bool:
            if plan.mask is None or not plan.classify:
                return False
            env = tile_env(qc.start, qc.start + qc.length - 1, kc.start, kc.start + kc.length - 1, seq_len, seq_len)
            return truth(plan.mask, env) is Truth.NEVER

        steps = []
        for s in range(world):
            theirs = chunks(layout, (rank - s) % world, world, n)
            steps.append([(i, j, (qc.start, kc.start, seq_len, seq_len)) for i, qc in enumerate(mine)
                          for j, kc in enumerate(theirs) if not dropped(qc, kc)])
        if len(_PAIRS) >= 256:  # many shapes: start again
            _PAIRS.clear()
        _PAIRS[key] = steps
    return steps


class _Done:
    """A transfer to oneself (a group of one rank)."""

    def __init__(self, tensors):
        self.tensors = tensors

    def wait(self):
        return self.tensors


def _rows(c: Chunk) -> slice:
    return slice(c.row, c.row + c.length)


def _positions(c: Chunk) -> slice:
    """The chunk's rows as positions in the whole sequence."""
    return slice(c.start, c.start + c.length)


def _merge(kern: Kernel, o_acc: torch.Tensor, lse_acc: torch.Tensor, o: torch.Tensor | None, lse: torch.Tensor) -> None:
    """o_acc, lse_acc (float32, contiguous, updated in place) := the softmax merge of two partial results over
    disjoint keys (log2 units): lse = log2(2^lse_acc + 2^lse), O = the two O's weighted by 2^(lse_i - lse); o None:
    a term with no value (a sink). Rows with no key in either (-inf) stay O = 0, lse = -inf. The shard kernels'
    merge (attention_merge): one pass over O."""
    with interpreted_if_cpu(o_acc.device):
        shard_kernel(kern).module.attention_merge(o_acc, lse_acc, None if o is None else o.contiguous(), lse.contiguous())


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, run: _Run, q, k, v, *inputs):
        ctx.set_materialize_grads(False)
        o, lse = run.forward(q, k, v)
        ctx.run = run
        ctx.save_for_backward(q, k, v, o, lse)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse = ctx.saved_tensors
        if do is None:  # only the lse reaches the loss; every rank still joins the ring (the others need its part)
            do = torch.zeros_like(o)
        dq, dk, dv, inputs = ctx.run.backward(q, k, v, o, lse, do.contiguous(), dlse)
        return None, dq, dk, dv, *inputs
