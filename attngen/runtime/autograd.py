"""Autograd for a kernel's calls: an eager call is a torch.autograd.Function (a few microseconds of dispatch);
under torch.compile the same work is a pair of torch.library custom ops (forward, backward) per kernel, which
the compiler traces as single calls. Both run Kernel._forward_impl and Kernel._backward_impl."""
from __future__ import annotations

import torch
from torch import Tensor  # at module scope: the custom ops' annotations are read as strings

from .layout import empty_like_layout
from .packed import heads_first, tokens_first
from .serving import decode_impl, serving_dims


def as_input_grads(inputs, grads: list, wanted) -> tuple:
    """One entry per input: its gradient where `wanted` says it needs one (grads holds one per float input, in
    order), None for the rest."""
    floats = iter(grads)
    per_input = [next(floats) if t.is_floating_point() else None for t in inputs]
    return tuple(g if w else None for g, w in zip(per_input, wanted))


PLAIN = (0.0, None, None, None)  # AttentionFunction's options of a plain call


class AttentionFunction(torch.autograd.Function):
    """An eager call: a few microseconds of dispatch (a torch.library custom op with autograd cost ~55 us more per
    call on the 2-core CPU machine, so the ops serve torch.compile only; both run Kernel._forward_impl and
    _backward_impl). `options`: (dropout_p, seed, block_mask, varlen); for a plain call (none of them), None or
    its kernel.PlainCall, whose passes were chosen once for its signature."""

    @staticmethod
    def forward(ctx, kernel, options, q, k, v, *inputs):
        ctx.set_materialize_grads(False)
        if options is None or type(options) is tuple:
            options = options or PLAIN
            o, lse = kernel._forward_impl(q, k, v, inputs, *options)
            ctx.route = None
        else:  # a plain call's passes (kernel.PlainCall)
            o, lse = options.forward(q, k, v, inputs)
            ctx.route, options = options.backward, PLAIN
        ctx.kernel, ctx.options = kernel, options
        ctx.save_for_backward(q, k, v, o, lse, *inputs)
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        q, k, v, o, lse, *inputs = ctx.saved_tensors
        if do is None and dlse is None:
            return (None, None, torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)) + (None,) * len(inputs)
        if do is None:
            do = torch.zeros_like(o)
        if ctx.route is not None:  # a plain call's backward, chosen once for its signature
            dq, dk, dv, grads = ctx.route(q, k, v, o, lse, do, dlse, inputs, ctx.needs_input_grad[5:])
            return (None, None, dq, dk, dv, *grads)
        dropout_p, seed, block_mask, varlen = ctx.options
        wanted = [w and t.is_floating_point() for w, t in zip(ctx.needs_input_grad[5:], inputs)]
        dq, dk, dv, grads = ctx.kernel._backward_impl(q, k, v, o, lse, do, dlse, inputs, dropout_p, seed, block_mask, any(wanted), varlen)
        return (None, None, dq, dk, dv) + as_input_grads(inputs, grads, wanted)


class AttentionOutput(AttentionFunction):
    """AttentionFunction's node for calls that do not return the lse: O its only output, the lse saved. A second
    output cost an eager call about 10 us in its forward and 20 us over forward and backward (an H100's host,
    autograd.Functions doing no work), and its backward never takes an lse gradient."""

    @staticmethod
    def forward(ctx, kernel, options, q, k, v, *inputs):
        return AttentionFunction.forward(ctx, kernel, options, q, k, v, *inputs)[0]

    @staticmethod
    def backward(ctx, do):
        return AttentionFunction.backward(ctx, do, None)


def attention_node(kernel, options, q, k, v, inputs, return_lse: bool) -> tuple:
    """(O, the lse in log2 units) through the eager autograd node, AttentionFunction's; without return_lse
    AttentionOutput's, and (O, None)."""
    if return_lse:
        return AttentionFunction.apply(kernel, options, q, k, v, *inputs)
    return AttentionOutput.apply(kernel, options, q, k, v, *inputs), None


class CompiledAttention(torch.autograd.Function):
    """A call under torch.compile that records a gradient and returns O alone (no return_lse): the forward operator
    without an autograd formula (Ops.inference; packed sequences: Ops.varlen_forward) and the backward operator, in
    a Function that torch.compile traces into its graphs. With the lse an output of the traced call (Ops.forward's
    formula), the compiled backward got a zero-filled gradient for it, which the kernels then read (and which kept
    the Gluon backward from replaying its launches); here the lse is saved, not returned, so no gradient reaches it,
    and the forward operator is called without a Python autograd layer in front. `varlen`: packed sequences'
    (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k), or None."""

    @staticmethod
    def forward(ctx, ops, dropout_p, seed, block_mask, varlen, q, k, v, *inputs):
        if varlen is None:
            o, lse = ops.inference(q, k, v, list(inputs), dropout_p, seed, block_mask)
        else:
            o, lse = ops.varlen_forward(q, k, v, list(inputs), *varlen, dropout_p, seed)
        ctx.ops, ctx.dropout_p, ctx.varlen, ctx.n_inputs = ops, dropout_p, varlen, len(inputs)
        ctx.has_seed, ctx.has_block_mask = seed is not None, block_mask is not None
        ctx.save_for_backward(q, k, v, o, lse, *inputs, *(t for t in (seed, block_mask) if t is not None))
        return o

    @staticmethod
    def backward(ctx, do):
        q, k, v, o, lse, *rest = ctx.saved_tensors
        inputs, (seed, block_mask) = rest[:ctx.n_inputs], _optional(rest[ctx.n_inputs:], ctx.has_seed, ctx.has_block_mask)
        none = (None,) * 5
        if ctx.varlen is not None:  # (packed calls take no input gradients: the call checks)
            dq, dk, dv = ctx.ops.varlen_backward(q, k, v, o, lse, do, None, list(inputs), *ctx.varlen, ctx.dropout_p, seed)
            return (*none, dq, dk, dv) + (None,) * len(inputs)
        wanted = [w and t.is_floating_point() for w, t in zip(ctx.needs_input_grad[8:], inputs)]
        dq, dk, dv, grads = ctx.ops.backward(q, k, v, o, lse, do, None, list(inputs), ctx.dropout_p, seed, block_mask, any(wanted))
        return (*none, dq, dk, dv, *as_input_grads(inputs, grads, wanted))


class Ops:
    """A kernel's torch library operators, which torch.compile traces as single calls (with dynamic shapes): the
    forward `attngen::<name>_fwd` (O and the lse in log2 units) and the backward `attngen::<name>_bwd`, its
    autograd formula; `attngen::<name>_infer`, the forward of calls with nothing to differentiate. <name> is the
    spec's name and the first 12 hex digits of the spec's sha256, and a number where another kernel of the same
    spec (another target, generator or bundle) is registered in this process.
    Fake implementations give the outputs' shapes; the real ones run Kernel._forward_impl / _backward_impl.
    They are defined through torch.library.Library (a schema, a kernel per device type, a fake kernel and an
    autograd formula), not torch.library.custom_op, whose wrapper checks every call's outputs for aliases of its
    inputs: on an H200's host that check took longer than the rest of a compiled call."""

    _names: dict[str, int] = {}

    def __init__(self, kernel):
        spec = kernel.spec
        base = f"{spec.name}_{kernel.plan.spec_hash[:12]}"
        count = Ops._names[base] = Ops._names.get(base, 0) + 1
        self.name = base if count == 1 else f"{base}_{count}"

        def forward(q: Tensor, k: Tensor, v: Tensor, inputs: list[Tensor], dropout_p: float, seed: Tensor | None,
                    block_mask: Tensor | None) -> tuple[Tensor, Tensor]:
            if seed is None and block_mask is None:  # a plain call: its forward kept by signature
                return kernel._op_forward(q, k, v, inputs)
            return kernel._forward_impl(q, k, v, inputs, dropout_p, seed, block_mask)

        def backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, dlse: Tensor | None, inputs: list[Tensor],
                     dropout_p: float, seed: Tensor | None, block_mask: Tensor | None, input_grads: bool) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
            return kernel._backward_impl(q, k, v, o, lse, do, dlse, inputs, dropout_p, seed, block_mask, input_grads)

        def decode(q: Tensor, k: Tensor, v: Tensor, inputs: list[Tensor], kv_lens: Tensor | None, q_lens: Tensor | None,
                   block_table: Tensor | None) -> tuple[Tensor, Tensor]:
            return decode_impl(kernel, q, k, v, inputs, kv_lens, q_lens, block_table, serving_dims(q, k, block_table))

        self.decode = _define(f"{self.name}_decode", "(Tensor q, Tensor k, Tensor v, Tensor[] inputs, Tensor? kv_lens, Tensor? q_lens, "
                              "Tensor? block_table) -> (Tensor, Tensor)", decode, _fake_decode)
        self.forward = _define(f"{self.name}_fwd", "(Tensor q, Tensor k, Tensor v, Tensor[] inputs, float dropout_p, Tensor? seed, "
                               "Tensor? block_mask) -> (Tensor, Tensor)", forward, _fake_forward)
        self.backward = _define(f"{self.name}_bwd", "(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, Tensor? dlse, "
                                "Tensor[] inputs, float dropout_p, Tensor? seed, Tensor? block_mask, bool input_grads) -> "
                                "(Tensor, Tensor, Tensor, Tensor[])", backward, _fake_backward)
        torch.library.register_autograd(self.forward, self._autograd, setup_context=_setup_context, lib=_LIBRARY)
        # the same forward with no autograd formula, for calls traced with nothing to differentiate: the dispatcher
        # goes straight to its kernel, where the one above passes through its Python autograd layer first (a
        # redispatch, about a fifth of a compiled call's host time on an H200's host)
        self.inference = _define(f"{self.name}_infer", "(Tensor q, Tensor k, Tensor v, Tensor[] inputs, float dropout_p, Tensor? seed, "
                                 "Tensor? block_mask) -> (Tensor, Tensor)", forward, _fake_forward)

        # packed sequences (cu_seqlens): q, k, v, O, dO and the gradients in flash_attn's (total, H, D) layout, the
        # lse (Hq, total); the kernels see them as (1, H, total, D) views (packed.check_packed)
        def varlen_forward(q: Tensor, k: Tensor, v: Tensor, inputs: list[Tensor], cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, seed: Tensor | None) -> tuple[Tensor, Tensor]:
            o, lse = kernel._forward_impl(*heads_first(q, k, v), inputs, dropout_p, seed, None, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
            return tokens_first(o), lse.squeeze(0).contiguous()

        def varlen_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, dlse: Tensor | None, inputs: list[Tensor],
                            cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                            seed: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
            varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            dq, dk, dv, _ = kernel._backward_impl(*heads_first(q, k, v, o), lse.unsqueeze(0), *heads_first(do), None if dlse is None else dlse.unsqueeze(0),
                                                  inputs, dropout_p, seed, None, False, varlen)
            return tokens_first(dq), tokens_first(dk), tokens_first(dv)

        self.varlen_forward = _define(f"{self.name}_varlen_fwd", "(Tensor q, Tensor k, Tensor v, Tensor[] inputs, Tensor cu_seqlens_q, "
                                      "Tensor cu_seqlens_k, SymInt max_seqlen_q, SymInt max_seqlen_k, float dropout_p, Tensor? seed) -> "
                                      "(Tensor, Tensor)", varlen_forward, _fake_varlen_forward)
        self.varlen_backward = _define(f"{self.name}_varlen_bwd", "(Tensor q, Tensor k, Tensor v, Tensor o, Tensor lse, Tensor do, "
                                       "Tensor? dlse, Tensor[] inputs, Tensor cu_seqlens_q, Tensor cu_seqlens_k, SymInt max_seqlen_q, "
                                       "SymInt max_seqlen_k, float dropout_p, Tensor? seed) -> (Tensor, Tensor, Tensor)", varlen_backward,
                                       _fake_varlen_backward)
        torch.library.register_autograd(self.varlen_forward, self._varlen_autograd, setup_context=_setup_varlen_context, lib=_LIBRARY)

    def _autograd(self, ctx, do, dlse):
        q, k, v, o, lse, *rest = ctx.saved_tensors
        inputs, seed, block_mask = rest[:ctx.n_inputs], *_optional(rest[ctx.n_inputs:], ctx.has_seed, ctx.has_block_mask)
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv, grads = self.backward(q, k, v, o, lse, do, dlse, inputs, ctx.dropout_p, seed, block_mask, any(ctx.wanted))
        return dq, dk, dv, list(as_input_grads(inputs, grads, ctx.wanted)), None, None, None

    def _varlen_autograd(self, ctx, do, dlse):
        q, k, v, o, lse, cu_q, cu_k, *rest = ctx.saved_tensors
        inputs, seed = rest[:ctx.n_inputs], (rest[ctx.n_inputs] if ctx.has_seed else None)
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = self.varlen_backward(q, k, v, o, lse, do, dlse, inputs, cu_q, cu_k, ctx.max_q, ctx.max_k, ctx.dropout_p, seed)
        return dq, dk, dv, [None] * ctx.n_inputs, None, None, None, None, None, None


_LIBRARY = torch.library.Library("attngen", "FRAGMENT")  # the operators of every kernel (Ops), kept for the process


def _define(name: str, schema: str, impl, fake):
    """The operator attngen::<name><schema>: `impl` its kernel on CPU and CUDA tensors, `fake` its shapes."""
    _LIBRARY.define(name + schema)
    for device_type in ("CPU", "CUDA"):
        _LIBRARY.impl(name, impl, device_type)
    torch.library.register_fake(f"attngen::{name}", fake, lib=_LIBRARY)
    return getattr(torch.ops.attngen, name).default


def _setup_varlen_context(ctx, inputs, output) -> None:
    q, k, v, tensors, cu_q, cu_k, max_q, max_k, dropout_p, seed = inputs
    ctx.n_inputs, ctx.dropout_p, ctx.max_q, ctx.max_k, ctx.has_seed = len(tensors), dropout_p, max_q, max_k, seed is not None
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k, *tensors, *((seed,) if seed is not None else ()))


def _fake_varlen_forward(q, k, v, inputs, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, seed):
    return q.new_empty((*q.shape[:2], v.shape[2])), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


def _fake_varlen_backward(q, k, v, o, lse, do, dlse, inputs, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, seed):
    return q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, tensors, dropout_p, seed, block_mask = inputs
    ctx.n_inputs, ctx.dropout_p = len(tensors), dropout_p
    ctx.has_seed, ctx.has_block_mask = seed is not None, block_mask is not None
    ctx.wanted = [t.requires_grad and t.is_floating_point() for t in tensors]
    ctx.save_for_backward(q, k, v, *output, *tensors, *(t for t in (seed, block_mask) if t is not None))


def _optional(saved, has_seed: bool, has_block_mask: bool) -> tuple:
    saved = iter(saved)
    return (next(saved) if has_seed else None), (next(saved) if has_block_mask else None)


def _fake_decode(q, k, v, inputs, kv_lens, q_lens, block_table):
    return q.new_empty((*q.shape[:3], v.shape[3])), q.new_empty(q.shape[:3], dtype=torch.float32)


def _fake_forward(q, k, v, inputs, dropout_p, seed, block_mask):
    return empty_like_layout(q, (*q.shape[:3], v.shape[3])), q.new_empty(q.shape[:3], dtype=torch.float32)  # O laid out as the kernels lay it out


def _fake_backward(q, k, v, o, lse, do, dlse, inputs, dropout_p, seed, block_mask, input_grads):
    grads = [t.new_empty(t.shape if input_grads else (0,)) for t in inputs if t.is_floating_point()]
    return empty_like_layout(q), empty_like_layout(k), empty_like_layout(v), grads
