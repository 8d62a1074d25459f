"""One shard of a context-parallel attention (attngen/distributed): q's rows against k's and v's keys, at their
global positions in the whole sequence, forward and backward; the ring merges the partial results."""
from __future__ import annotations

import torch

from ..lang.spec import DType
from .checks import dims_of
from .loader import check_device, is_sm90
from .twins import positions_twin, up


def shard_kernel(kernel):
    """This spec's kernels for one shard of a context-parallel attention (attngen/distributed): its forward and
    backward with global positions (KernelPlan.global_positions), by the same generators as this kernel's
    (positions_twin). Built on first use (just in time, also for a kernel loaded from a bundle)."""
    if kernel._shard_twin is None:
        kernel._shard_twin = positions_twin(kernel)
    return kernel._shard_twin


def shard_forward(kernel, q, k, v, inputs, dropout_p: float, seed: torch.Tensor | None, positions: tuple[int, ...]):
    """O and the lse (log2 units) of q's rows attending to k's and v's keys only, where q's first row and k's
    first key are at positions[0] and positions[1] of a sequence of positions[2] queries and positions[3] keys,
    and q's first head is head positions[4] of positions[5] query heads (a slice of them under head-parallel
    methods, whose inputs are whole), which the expressions and dropout's pattern see (attngen/distributed merges
    these partial results). O is float32 from the
    Triton generator, q's element type from the Gluon one (it stores O through Q's tile). The tensors are
    checked by the caller."""
    kern = shard_kernel(kernel)
    check_device(q.device, kern.module)
    extra = {} if seed is None else {"dropout_p": dropout_p, "seed": seed}
    if kern.generator.forward_at(k.shape[2]) == "gluon" and is_sm90(q.device):  # O in q's element type (TMA stores through Q's tile)
        return kern.gluon.attention_forward(q, k, v, *inputs, **extra, positions=positions)
    if q.device.type == "cpu" and kern.spec.dtype is DType.BF16:
        kern, (q, k, v), inputs = kern._twin(), up(q, k, v), up(*inputs)
    return kern._run_triton("fwd", kern.module.attention_forward, dims_of(q, k), ("dropout",) if dropout_p else (), (q, k, v, *inputs),
                            extra | {"positions": positions, "out_dtype": torch.float32})


def shard_backward(kernel, q, k, v, o, lse, do, dlse, inputs, dropout_p: float, seed: torch.Tensor | None, positions: tuple[int, ...],
                   input_grads: bool = False):
    """(dQ, dK, dV) of one shard pair (as shard_forward's): the contributions of q's rows and k's keys to the
    whole attention's gradients, from its O and lse (log2 units) and dO, dlse (or None). float32, but dK and
    dV in k's element type from the Gluon backward. input_grads (a spec whose score reads float inputs): the
    Triton backward, which also gives the pair's unreduced terms of those inputs' gradients (its module's
    attention_backward says which: each pair's for reads at q_idx or kv_idx, the rows' sums for the others),
    (dQ, dK, dV, terms)."""
    kern = shard_kernel(kernel)
    lse = lse.contiguous()  # the kernels index the lse (and dlse) as (B, H, rows) rows
    dlse = None if dlse is None else dlse.contiguous()
    extra = {} if seed is None else {"dropout_p": dropout_p, "seed": seed}
    if not input_grads and kern._gluon_backward(positions[2], positions[3], k.shape[2]) and is_sm90(q.device):  # dK, dV in k's and v's element type
        return kern.gluon.attention_backward(q, k, v, o.contiguous(), lse, do.contiguous(), dlse, *inputs, **extra, positions=positions,
                                             grad_dtype=torch.float32)
    if q.device.type == "cpu" and kern.spec.dtype is DType.BF16:
        kern, (q, k, v, o, do), inputs = kern._twin(), up(q, k, v, o, do), up(*inputs)
    flags = tuple(f for f, on in (("dropout", dropout_p), ("input_grads", input_grads)) if on)
    if input_grads:
        extra["input_grads"] = True
    dq, dk, dv, *terms = kern._run_triton("bwd", kern.module.attention_backward, dims_of(q, k), flags, (q, k, v, o, lse, do, dlse, *inputs),
                                          extra | {"positions": positions, "grad_dtype": torch.float32})
    return (dq, dk, dv, terms[0]) if input_grads else (dq, dk, dv)
