"""A compiled attention variant: the Kernel a user calls like a function of (q, k, v, **inputs).

The call is dispatched by kind: a training call (checks.py; autograd.py when something needs a gradient,
custom ops under torch.compile), packed sequences (packed.py), serving with per-sequence lengths or paged
caches (serving.py), FP8 (fp8.py); the shards of context parallelism are shard.py's. Every kind ends in the
passes below, _forward_impl and _backward_impl, which run the generated modules: the Gluon generator's on
sm_90 where the choice of generators gave it a pass, the Triton generator's everywhere else (on CPU tensors
in Triton's interpreter, a bf16 spec through its float32 twin).
"""
from __future__ import annotations

import inspect
from pathlib import Path
from types import ModuleType

import torch

from ..codegen.gluon import Choice
from ..errors import InputError
from ..lang.spec import DType, KVLayout, Spec
from ..plan.decode import takes_plain_call
from ..plan.planner import KernelPlan
from ..plan.tune import Tuner
from ..plan.tune import bucket as tune_bucket
from .autograd import CompiledAttention, Ops, as_input_grads, attention_node
from .blocks import KeptLists
from .checks import Dims, check_all, check_block_mask, check_call, dims_of, direct_indices, dropout_args
from .dtypes import TORCH_DTYPES
from .evaluate import sink_rows
from .fp8 import dequantize, fp8_call, fp8_signature
from .input_grads import LOG2E, reduce_input_grads, row_delta, sink_share_grads, unpacked_rows
from .layout import empty_like_layout
from .loader import check_device, interpreted_if_cpu, is_sm90
from .packed import check_offsets, check_packed, check_packed_features, heads_first
from .serving import decode_impl, serving_call, serving_signature
from .signature import call_signature, packed_signature
from .twins import float32_twin, up

LN2 = 0.6931471805599453


class PlainCall:
    """What a plain call (q, k, v and the declared inputs, nothing else) of one signature runs, decided by its
    first call once its checks passed: the decode kernels (decodes), or `forward`, fn(q, k, v, inputs) -> (O, lse in
    log2 units), in an autograd node where the call records a gradient (grad), whose backward is `backward`,
    fn(q, k, v, o, lse, do, dlse, inputs, wanted) -> (dQ, dK, dV, each input's gradient or None), or None:
    Kernel._backward_impl's choice at each call (Kernel._plain_backward)."""

    __slots__ = ("dims", "names", "grad", "decodes", "forward", "backward")

    def __init__(self, dims: Dims, names: list[str], grad: bool, decodes: bool, forward, backward):
        self.dims, self.names, self.grad, self.decodes, self.forward, self.backward = dims, names, grad, decodes, forward, backward

    def run(self, kernel: Kernel, key: tuple, q, k, v, inputs: dict, return_lse: bool = True):
        """(O, the lse in log2 units; None where a call recording a gradient does not return it)."""
        tensors = [inputs[name] for name in self.names]
        if self.grad:
            return attention_node(kernel, self, q, k, v, tensors, return_lse)
        if self.decodes:
            return decode_impl(kernel, q, k, v, tensors, None, None, None, self.dims, known=key)
        return self.forward(q, k, v, tensors)


class PackedCall:
    """What a plain packed call (q, k, v in flash_attn's (total, H, D) layout, cu_seqlens_q/_k, max_seqlen_q/_k and
    the declared inputs) of one signature runs once its checks passed: the offsets' values checked (once per tensor
    and version: packed.longest_sequence) against the signature's longest lengths, then the passes on (1, H,
    total, D) views made inside the call, so autograd records one node (_PackedRun) and no view around it."""

    __slots__ = ("names", "grad", "max_q", "max_k")

    def __init__(self, names: list[str], grad: bool, max_q: int, max_k: int):
        self.names, self.grad, self.max_q, self.max_k = names, grad, max_q, max_k

    def run(self, kernel: Kernel, q, k, v, inputs: dict, cu_q, cu_k, checked: bool = False, return_lse: bool = True):
        """O (total_q, Hq, Dv) and the lse in log2 units (Hq, total_q; None where a call recording a gradient does
        not return it). `checked`: the offsets were checked by this call."""
        tensors = [inputs[name] for name in self.names]
        if not checked and not (q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            check_offsets("cu_seqlens_q", cu_q, q.shape[0], self.max_q)
            check_offsets("cu_seqlens_k", cu_k, k.shape[0], self.max_k)
        run = _PackedRun(kernel, (cu_q, cu_k, self.max_q, self.max_k))
        if self.grad:
            return attention_node(kernel, run, q, k, v, tensors, return_lse)
        return run.forward(q, k, v, tensors)


class _PackedRun:
    """One packed call's passes as AttentionFunction takes them (`forward`, and `backward` as its route), on (total, H,
    D) tensors: the kernels' (1, H, total, D) views are made and undone inside."""

    __slots__ = ("kernel", "varlen")

    def __init__(self, kernel: Kernel, varlen: tuple):
        self.kernel, self.varlen = kernel, varlen

    def forward(self, q, k, v, inputs):
        o, lse2 = self.kernel._forward_impl(*heads_first(q, k, v), inputs, 0.0, None, None, self.varlen)
        # (squeeze, not [0]: select's gradient is a zero-filled copy)
        return o.squeeze(0).transpose(0, 1), lse2.squeeze(0)

    def backward(self, q, k, v, o, lse, do, dlse, inputs, wanted):
        dq, dk, dv, grads = self.kernel._backward_impl(*heads_first(q, k, v, o), lse.unsqueeze(0), *heads_first(do),
                                                       None if dlse is None else dlse.unsqueeze(0), inputs, 0.0, None, None, any(wanted),
                                                       self.varlen)
        return (*(t.squeeze(0).transpose(0, 1) for t in (dq, dk, dv)), as_input_grads(inputs, grads, wanted))


class Kernel:
    """A compiled attention variant: call it like a function of (q, k, v, **inputs)."""

    def __init__(self, spec: Spec, kernel_plan: KernelPlan, source: str, path: Path, module: ModuleType):
        self.bundle = None  # attngen.aot.BundleInfo when loaded from an ahead-of-time bundle
        self.spec = spec
        self.plan = kernel_plan
        self.source = source
        self.path = path
        self.module = module
        self._direct_indices = direct_indices(spec)
        # `auto` tiles (attngen/plan/tune.py): measured per shape bucket on the GPU; None: the plan's tiles
        self.tuner = Tuner(kernel_plan, source) if spec.tune else None
        self._passed: dict[tuple, Dims] = {}  # calls whose checks passed: checks.check_call, serving.serving_call
        # plain calls (no option but the declared inputs) by signature (signature.call_signature): their checks passed
        # and their kernels chosen; None for a spec whose calls always take options (dropout, runtime sparsity, FP8, caches)
        self._plain_calls: dict[tuple, PlainCall] | None = (
            {} if spec.dropout == 0.0 and spec.sparsity != "runtime" and spec.dtype is not DType.FP8 and spec.kv_dtype is None
            and spec.kv_layout is not KVLayout.PAGED else None)
        # plain packed calls (cu_seqlens with max_seqlen, the declared inputs, nothing else) by signature
        # (signature.packed_signature): PackedCall; None where plain calls are
        self._packed_calls: dict[tuple, PackedCall] | None = None if self._plain_calls is None else {}
        # FP8 calls (q, k, v, the declared inputs and the descale factors, no other option) by signature
        # (fp8.fp8_signature): fp8.FP8Call; None for a spec of another dtype or whose calls take options
        self._fp8_calls: dict[tuple, object] | None = (
            {} if spec.dtype is DType.FP8 and spec.dropout == 0.0 and spec.sparsity != "runtime" else None)
        self._op_forwards: dict[tuple, object] = {}  # the same for the forwards of torch.compile's operator: _op_forward
        # serving calls by signature (serving.serving_signature): serving.ServingCall; None where the spec takes FP8
        # caches (their descale factors vary by call) or options the decode kernels refuse
        self._serving_calls: dict[tuple, object] | None = (
            {} if spec.dropout == 0.0 and spec.sparsity != "runtime" and spec.kv_dtype is None and spec.dtype is not DType.FP8 else None)
        self._decode_shapes: dict[Dims, object] = {}  # plan.decode.decode_shape of each call's sizes: serving.decode_impl
        self.lists = KeptLists(spec, kernel_plan.block_lists)  # block lists, a runtime mask's or a static pattern's, kept between calls
        self._cpu_twin: Kernel | None = None  # a bf16 spec's float32 kernels for the CPU interpreter: see _twin
        self._shard_twin: Kernel | None = None  # the kernels of a context-parallel shard: shard.shard_kernel
        # The torch.library ops of compiled calls (about 2 ms to register; torch.compile cannot trace a registration)
        self._custom_ops = Ops(self)
        # The generators of the passes (attngen/codegen/gluon/choice.py): with Gluon, `gluon` is its module, which
        # runs on CUDA tensors (sm_90) the passes the choice gives it; the Triton module runs the others, and
        # everything on the CPU and on other GPUs.
        self.generator = Choice("triton", "built without a choice of generator")
        self.gluon: ModuleType | None = None
        self.gluon_source: str | None = None

    def __repr__(self) -> str:
        return f"<attngen.Kernel {self.spec.name} target={self.plan.target.name} file={self.path}>"

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, return_lse: bool = False,
                 dropout_p: float | None = None, seed: int | torch.Tensor | None = None, block_mask: torch.Tensor | None = None,
                 cu_seqlens_q: torch.Tensor | None = None, cu_seqlens_k: torch.Tensor | None = None,
                 max_seqlen_q: int | None = None, max_seqlen_k: int | None = None, kv_lens: torch.Tensor | None = None,
                 q_lens: torch.Tensor | None = None, block_table: torch.Tensor | None = None, q_descale: torch.Tensor | None = None,
                 k_descale: torch.Tensor | None = None, v_descale: torch.Tensor | None = None, **inputs: torch.Tensor):
        """O (and the natural-log row log-sum-exp with return_lse). Dropout: `dropout_p` overrides the spec's
        `dropout` (0.0 at evaluation); `seed` fixes the pattern, which attngen.dropout_mask gives exactly: an
        int, or a one-element int64 tensor on q's device that the kernels read when they run (a captured CUDA graph
        replays with its value then); default: drawn on q's device from torch's generator, so torch.manual_seed
        makes runs repeatable, under torch.compile too, and each replay of a CUDA graph draws a new pattern.
        `block_mask`: the kept blocks of a `sparsity = runtime` spec (see attngen.block_mask_from).

        Packed sequences (flash_attn_varlen_func's layout and names): q (total_q, Hq, D), k and v (total_k, Hkv,
        D), sequence i's rows cu_seqlens_q[i]:cu_seqlens_q[i + 1] (int32, B + 1 entries, from 0 to total);
        max_seqlen_q/_k size the grid (default: read from cu_seqlens, a host synchronization). Expressions see
        positions and lengths inside each sequence, and b = the sequence (dropout's pattern too). O is (total_q, Hq,
        D), the lse (Hq, total_q). Under torch.compile, max_seqlen_q/_k must be given (cu_seqlens is not read
        while tracing). Not yet with runtime block sparsity or input gradients.

        Serving (forward only, serving.py): `kv_lens` (int32 (B,)): sequence b has kv_lens[b] valid keys in
        k, v (B, Hkv, capacity, D), the rest is never read; `q_lens` likewise for the queries (rows past it give O =
        0, lse = -inf). A spec with `kv_layout = paged` takes k, v as caches (num_pages, page_size, Hkv, D), a
        block_table (int32 (B, pages per sequence)) and kv_lens. Expressions see each sequence's lengths.
        Plain calls with few queries and nothing to differentiate take the same decode kernels.

        FP8 (a `dtype = fp8` spec, forward only): q, k, v in e4m3 and their float32 descale factors q_descale,
        k_descale, v_descale (default 1; shapes in attngen.fp8, which also quantizes); O in bf16.

        Eager calls go through a torch.autograd.Function; under torch.compile the same work is a pair of operators
        (forward, backward) named after the kernel, so a compiled model calls it with no graph break. A plain,
        packed, serving or FP8 call with the signature of one made before (each tensor's shape, strides, dtype,
        device and alignment; whether it records a gradient) skips the checks and choices that one passed
        (signature.py)."""
        compiling = torch.compiler.is_compiling()
        key = None
        if ((kv_lens is not None or block_table is not None) and self._serving_calls is not None and not compiling and dropout_p is None
                and seed is None and block_mask is None and cu_seqlens_q is None and cu_seqlens_k is None and max_seqlen_q is None
                and max_seqlen_k is None and q_descale is None and k_descale is None and v_descale is None):
            key = serving_signature(q, k, v, inputs, kv_lens, q_lens, block_table)
            served = self._serving_calls.get(key)
            if served is not None and not (torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad
                                                                         or any(t.requires_grad for t in inputs.values()))):
                # a serving call like one made before: its checks passed, its split known (the values are checked)
                o, lse2 = served.run(self, key, q, k, v, inputs, kv_lens, q_lens, block_table, return_lse)
                return (o, lse2 * LN2) if return_lse else o
            key = None
        if (self._plain_calls is not None and not compiling and dropout_p is None and seed is None and block_mask is None
                and cu_seqlens_q is None and cu_seqlens_k is None and max_seqlen_q is None and max_seqlen_k is None and kv_lens is None
                and q_lens is None and block_table is None and q_descale is None and k_descale is None and v_descale is None):
            try:
                key = call_signature(q, k, v, inputs)
            except AttributeError:  # not tensors: the checks below say which
                key = None
            plain = self._plain_calls.get(key)
            if plain is not None:  # a plain call like one made before: its checks passed, its kernels known
                o, lse2 = plain.run(self, key, q, k, v, inputs, return_lse)
                return (o, lse2 * LN2) if return_lse else o
        packed_key = None
        if (self._packed_calls is not None and not compiling and cu_seqlens_q is not None and cu_seqlens_k is not None and max_seqlen_q is not None
                and max_seqlen_k is not None and dropout_p is None and seed is None and block_mask is None and kv_lens is None and q_lens is None
                and block_table is None and q_descale is None and k_descale is None and v_descale is None):
            try:
                packed_key = packed_signature(q, k, v, inputs, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            except (AttributeError, TypeError):  # not tensors, or lengths that are no ints: the checks below say which
                packed_key = None
            kept = self._packed_calls.get(packed_key)
            if kept is not None:  # packed sequences like a call made before: its checks passed (the offsets' values are checked)
                o, lse2 = kept.run(self, q, k, v, inputs, cu_seqlens_q, cu_seqlens_k, return_lse=return_lse)
                return (o, lse2 * LN2) if return_lse else o
        if self.spec.dtype is DType.FP8 or (self.spec.kv_dtype is None and (q_descale is not None or k_descale is not None or v_descale is not None)):
            descales, fp8_key = (q_descale, k_descale, v_descale), None
            if (self._fp8_calls is not None and not compiling and dropout_p is None and seed is None and block_mask is None and cu_seqlens_q is None
                    and cu_seqlens_k is None and max_seqlen_q is None and max_seqlen_k is None and kv_lens is None and q_lens is None
                    and block_table is None):
                try:
                    fp8_key = fp8_signature(q, k, v, inputs, descales)
                except AttributeError:  # not tensors: the checks say which
                    fp8_key = None
                kept = self._fp8_calls.get(fp8_key)
                if kept is not None:  # an FP8 call like one made before: its checks passed, its factors' layouts known
                    o, lse2 = kept.run(self, q, k, v, inputs, descales)
                    return (o, lse2 * LN2) if return_lse else o
            o, lse2 = fp8_call(self, q, k, v, inputs, descales, dropout_p, seed, block_mask, compiling,
                               any(t is not None for t in (kv_lens, q_lens, block_table, cu_seqlens_q, cu_seqlens_k)), fp8_key)
            return (o, lse2 * LN2) if return_lse else o
        varlen = None
        if (kv_lens is not None or q_lens is not None or block_table is not None or self.spec.kv_layout is KVLayout.PAGED
                or self.spec.kv_dtype is not None):
            o, lse2 = serving_call(self, q, k, v, inputs, kv_lens, q_lens, block_table, dropout_p, block_mask,
                                   cu_seqlens_q is not None or cu_seqlens_k is not None, compiling, (q_descale, k_descale, v_descale))
            return (o, lse2 * LN2) if return_lse else o
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            packed = (q, k, v)  # flash_attn's (total, H, D) layout, which the packed ops under torch.compile take
            q, k, v, varlen = check_packed(self.spec, q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, compiling)
            dims, tensors = check_all(self, q, k, v, inputs, varlen)
        elif max_seqlen_q is not None or max_seqlen_k is not None:
            raise InputError("max_seqlen_q/max_seqlen_k go with cu_seqlens_q and cu_seqlens_k (packed sequences)")
        else:
            dims, tensors = check_call(self, q, k, v, inputs)
        p, seed_t = dropout_args(self.spec, dropout_p, seed, q.device)
        check_block_mask(self.spec, block_mask)
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or any(t.requires_grad for t in tensors))
        if varlen is not None:
            check_packed_features(self.spec, tensors, grad, bool(self.plan.read_grads), compiling)
        # few queries, nothing to differentiate: the decode kernels (serving.py)
        decodes = not grad and varlen is None and not p and block_mask is None and takes_plain_call(dims.q_len, dims.kv_len)
        if key is not None and not dims.empty:  # a plain call: kept by its signature (PlainCall), and run as it will be
            if len(self._plain_calls) >= 256:  # many signatures (lengths varying call by call): start again
                self._plain_calls.clear()
            plain = self._plain_calls[key] = PlainCall(dims, [d.name for d in self.spec.inputs], grad, decodes,
                                                       None if decodes else self._plain_forward(dims, q.device, key),
                                                       self._plain_backward(dims, q.device, key) if grad else None)
            o, lse2 = plain.run(self, key, q, k, v, inputs, return_lse)
            return (o, lse2 * LN2) if return_lse else o
        if packed_key is not None and not dims.empty:  # plain packed sequences: kept by their signature (PackedCall)
            if len(self._packed_calls) >= 256:
                self._packed_calls.clear()
            kept = self._packed_calls[packed_key] = PackedCall([d.name for d in self.spec.inputs], grad, varlen[2], varlen[3])
            o, lse2 = kept.run(self, *packed, inputs, cu_seqlens_q, cu_seqlens_k, checked=True, return_lse=return_lse)
            return (o, lse2 * LN2) if return_lse else o
        if compiling and grad and not return_lse:  # O alone: no gradient for the lse (CompiledAttention)
            return CompiledAttention.apply(self._ops(), p, seed_t, block_mask, varlen, *(q, k, v) if varlen is None else packed, *tensors)
        if compiling and varlen is not None:  # the packed ops take and give flash_attn's layout
            o, lse2 = self._ops().varlen_forward(*packed, tensors, *varlen, p, seed_t)
            return (o, lse2 * LN2) if return_lse else o
        if compiling and decodes:
            o, lse2 = self._ops().decode(q, k, v, tensors, None, None, None)
        elif compiling:  # (with nothing to differentiate, the operator without an autograd formula)
            o, lse2 = (self._ops().forward if grad else self._ops().inference)(q, k, v, tensors, p, seed_t, block_mask)
        elif decodes:
            o, lse2 = decode_impl(self, q, k, v, tensors, None, None, None, dims)
        elif not grad:
            o, lse2 = self._forward_impl(q, k, v, tensors, p, seed_t, block_mask, varlen)  # nothing to differentiate: no autograd node
        else:
            options = None if seed_t is None and block_mask is None and varlen is None else (p, seed_t, block_mask, varlen)
            o, lse2 = attention_node(self, options, q, k, v, tensors, return_lse)
        if varlen is not None:  # back to the packed layout: O (total_q, Hq, D), lse (Hq, total_q)
            # (squeeze, not [0]: select's gradient is a zero-filled copy, and dO would then reach the backward laid
            # out by heads, copied again there; squeeze's is a view of the caller's dO)
            o, lse2 = o.squeeze(0).transpose(0, 1), None if lse2 is None else lse2.squeeze(0)
        # The kernels keep the row log-sum-exp in log2 units (what their exp2 softmax needs, so the backward
        # recomputes P = exp2(s - lse2) exactly); users get natural log.
        return (o, lse2 * LN2) if return_lse else o

    def _forward_impl(self, q, k, v, inputs, dropout_p: float, seed: torch.Tensor | None, block_mask, varlen=None, descales=None):
        """O and the lse in log2 units: what every call runs, eager or compiled (the tensors are checked).
        varlen: packed sequences (packed.check_packed). descales: FP8's, in fp8.descale_blocks' layout."""
        device = q.device
        check_device(device, self.module)
        dims = dims_of(q, k, varlen)
        out_dtype = torch.bfloat16 if self.spec.dtype is DType.FP8 else q.dtype
        if dims.empty:  # nothing to attend to (or no query, or no sequence): O = 0, lse = -inf (the sink's where there is one)
            shape = (*q.shape[:3], v.shape[3])
            o = q.new_zeros(shape, dtype=out_dtype) if varlen is not None else empty_like_layout(q, shape, dtype=out_dtype).zero_()
            return o, self._empty_lse(q, inputs, dims, varlen)
        if descales is not None and device.type == "cpu":
            # Triton 3.6's interpreter rounds float32 to e4m3 wrongly where rounding carries into the exponent (0.4917
            # becomes 0.25): on the CPU an FP8 call runs the float32 kernels on the dequantized inputs (P unrounded),
            # its O rounded to bf16
            deq = (dequantize(q, descales[0]), dequantize(k, descales[1]), dequantize(v, descales[2], per_block=False))
            o, lse = self._twin()._forward_impl(*deq, up(*inputs), dropout_p, seed, block_mask)
            return o.to(torch.bfloat16), lse
        if self.generator.forward_at(dims.kv_len) == "gluon" and is_sm90(device):  # the Gluon generator's forward
            fp8_scales = {} if descales is None else {"descales": descales}
            return self.gluon.attention_forward(q, k, v, *inputs, **self._extra(dropout_p, seed, block_mask, dims, device), varlen=varlen,
                                                **fp8_scales)
        if device.type == "cpu" and self.spec.dtype is DType.BF16:
            o, lse = self._twin()._forward_impl(*up(q, k, v), up(*inputs), dropout_p, seed, block_mask, varlen)
            return o.to(torch.bfloat16), lse
        extra = self._extra(dropout_p, seed, block_mask, dims, q.device)
        if descales is not None:
            extra["descales"] = descales
        if varlen is None:
            return self._triton_forward(dims, extra, q, k, v, inputs)
        with interpreted_if_cpu(q.device):
            return self.module.attention_forward(q, k, v, *inputs, **extra, **self.lists.of_pattern(dims, device), varlen=varlen)

    def _op_forward(self, q, k, v, inputs: list):
        """The forward of a plain call in torch.compile's operator (autograd.Ops; the call was checked when it was
        traced): O and the lse in log2 units by the kernels _plain_forward chose for its signature."""
        key = call_signature(q, k, v, inputs)
        forward = self._op_forwards.get(key)
        if forward is None:
            dims = dims_of(q, k)
            if dims.empty:
                return self._forward_impl(q, k, v, inputs, 0.0, None, None)
            if len(self._op_forwards) >= 256:
                self._op_forwards.clear()
            forward = self._op_forwards[key] = self._plain_forward(dims, q.device, key)
        return forward(q, k, v, inputs)

    def _plain_forward(self, dims: Dims, device: torch.device, key: tuple):
        """The forward of a plain call without gradient (PlainCall): fn(q, k, v, inputs) -> (O, the lse in log2 units),
        the kernels _forward_impl takes for these sizes on this device, called with nothing left to decide (the
        Gluon module's replays the launch of the call signature `key`)."""
        gluon, module = self.gluon, self.module
        if device.type == "cuda" and self.generator.forward_at(dims.kv_len) == "gluon" and is_sm90(device):
            if hasattr(gluon, "forward_replay"):  # a module keeping recipes: `known` is the signature, replayed once it has one
                return _replayed(lambda q, k, v, inputs: gluon.attention_forward(q, k, v, *inputs, known=key), lambda: gluon.forward_replay(key))
            return lambda q, k, v, inputs: gluon.attention_forward(q, k, v, *inputs)
        if device.type == "cuda" and self.tuner is None and hasattr(module, "forward_replay"):  # the plan's tiles: the same launch every call
            return _replayed(lambda q, k, v, inputs: module.attention_forward(q, k, v, *inputs, known=key), lambda: module.forward_replay(key))
        if device.type == "cuda":
            return lambda q, k, v, inputs: self._triton_forward(dims, {}, q, k, v, inputs)
        return lambda q, k, v, inputs: self._forward_impl(q, k, v, inputs, 0.0, None, None)

    def _plain_backward(self, dims: Dims, device: torch.device, key: tuple):
        """The backward of a plain call (PlainCall) of signature `key` on a CUDA device, fn(q, k, v, o, lse, do, dlse,
        inputs, wanted) -> (dQ, dK, dV, the gradient of each input or None, as `wanted` says), decided once: the
        Gluon kernels where _backward_impl would take them and the spec declares no float input; the Triton
        module's, replaying its launches, where the plan's tiles are used and no input gradient comes from the
        score's terms (a sink's inputs from the rows' sink gradients its pre-pass writes); None otherwise
        (_backward_impl decides at each call)."""
        if device.type != "cuda":
            return None
        spec, gluon, module = self.spec, self.gluon, self.module
        none = (None,) * len(spec.inputs)
        floats = any(TORCH_DTYPES[d.dtype].is_floating_point for d in spec.inputs)
        if self._gluon_backward(dims.q_len, dims.kv_len) and is_sm90(device):
            if floats:
                return None
            return lambda q, k, v, o, lse, do, dlse, inputs, wanted: (*gluon.attention_backward(q, k, v, o, lse, do, dlse, *inputs), none)
        if self.tuner is not None or self.plan.read_grads or "known" not in inspect.signature(module.attention_backward).parameters:
            return None
        sink = spec.sink is not None

        def backward(q, k, v, o, lse, do, dlse, inputs, wanted):
            sink_grads = torch.empty(lse.shape, device=lse.device, dtype=torch.float32) if sink and any(wanted) else None
            extra = {"sink_grads": sink_grads} if sink else {}
            dq, dk, dv = module.attention_backward(q, k, v, o, lse, do, dlse, *inputs, **extra, known=key)
            if not any(wanted):
                return dq, dk, dv, none
            return dq, dk, dv, as_input_grads(inputs, self._sink_input_grads(dims, inputs, sink_grads, None), wanted)
        return backward

    def _named(self, inputs) -> dict:
        """The declared inputs (given in the spec's order) by name."""
        return dict(zip((d.name for d in self.spec.inputs), inputs))

    def _empty_lse(self, q, inputs, dims: Dims, varlen) -> torch.Tensor:
        """The lse (log2 units) of a call with no work: -inf, or the sink's value where the spec has one and a
        query row has no key (O = 0 there: the sink takes the whole row)."""
        lse = torch.full(q.shape[:3], float("-inf"), device=q.device, dtype=torch.float32)
        if self.spec.sink is None or lse.numel() == 0:
            return lse
        named = self._named(inputs)
        if varlen is None:
            return sink_rows(self.spec, named, *q.shape[:3], 0, q.device, torch.float32) * LOG2E
        bounds = varlen[0].tolist()  # packed sequences, all without keys: each sequence's rows, its b
        for i, (lo, hi) in enumerate(zip(bounds, bounds[1:])):
            lse[:, :, lo:hi] = sink_rows(self.spec, named, 1, q.shape[1], hi - lo, 0, q.device, torch.float32, first_batch=i) * LOG2E
        return lse

    def _backward_impl(self, q, k, v, o, lse, do, dlse, inputs, dropout_p: float, seed: torch.Tensor | None, block_mask,
                       input_grads: bool, varlen=None):
        """(dQ, dK, dV, [the gradient of each float input, or an empty tensor unless input_grads]). `dlse` (log2
        units, or None) is the gradient reaching the lse."""
        dims = dims_of(q, k, varlen)
        floats = [t for t in inputs if t.is_floating_point()]
        if dims.empty:
            dq, dk, dv = (torch.zeros_like(t) if varlen is not None else empty_like_layout(t).zero_() for t in (q, k, v))
            if not input_grads:
                return dq, dk, dv, [t.new_empty(0) for t in floats]
            # rows with no key: the lse is the sink's (O = 0), so only a gradient reaching the lse reaches the sink (p_sink = 1)
            rows = sink_share_grads(lse, lse, row_delta(o, do, dlse)) if self.spec.sink is not None and lse.numel() else None
            return dq, dk, dv, self._sink_input_grads(dims, inputs, rows, varlen)
        device = q.device
        if device.type == "cpu" and self.spec.dtype is DType.BF16:
            dq, dk, dv, grads = self._twin()._backward_impl(*up(q, k, v, o), lse, *up(do), dlse, up(*inputs), dropout_p, seed,
                                                            block_mask, input_grads, varlen)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), [g.to(t.dtype) for g, t in zip(grads, floats)]
        if self._gluon_backward(dims.q_len, dims.kv_len) and not (input_grads and self.plan.read_grads) and is_sm90(device):
            # the Gluon generator's backward (where the choice gives it, codegen/gluon/choice.py; packed sequences by
            # their longest keys); the gradients of inputs the score reads are the Triton kernels', those of a sink's
            # inputs come from the rows' sink gradients, written by the Triton module's pre-pass
            dq, dk, dv = self.gluon.attention_backward(q, k, v, o, lse, do, dlse, *inputs, **self._extra(dropout_p, seed, block_mask, dims, device),
                                                       varlen=varlen)
            if not input_grads:
                return dq, dk, dv, [t.new_empty(0) for t in floats]
            rows = self.module.attention_sink_grads(o, do, lse, dlse, k.shape[2], *inputs, varlen=varlen) if self.spec.sink is not None else None
            return dq, dk, dv, self._sink_input_grads(dims, inputs, rows, varlen)
        extra = self._extra(dropout_p, seed, block_mask, dims, device)
        if input_grads and self.spec.sink is not None:  # each row's gradient of its sink, which the pre-pass writes
            extra["sink_grads"] = torch.empty(lse.shape, device=device, dtype=torch.float32)
        if varlen is not None:  # packed sequences: the Triton generator's kernels (input gradients a sink's only: the call checks)
            with interpreted_if_cpu(q.device):
                dq, dk, dv = self.module.attention_backward(q, k, v, o, lse, do, dlse, *inputs, **extra, **self.lists.of_pattern(dims, device),
                                                            varlen=varlen)
            if not input_grads:
                return dq, dk, dv, [t.new_empty(0) for t in floats]
            return dq, dk, dv, self._sink_input_grads(dims, inputs, extra.get("sink_grads"), varlen)
        reads = self.plan.read_grads
        if input_grads and reads:
            extra["input_grads"] = True
        flags = tuple(f for f, on in (("dropout", extra.get("dropout_p")), ("input_grads", extra.get("input_grads"))) if on)
        dq, dk, dv, *terms = self._run_triton("bwd", self.module.attention_backward, dims, flags, (q, k, v, o, lse, do, dlse, *inputs),
                                              extra)  # with input_grads: the terms too
        if not input_grads:
            return dq, dk, dv, [t.new_empty(0) for t in floats]
        named = self._named(inputs)
        grads = reduce_input_grads(self.spec, dims, named, reads, terms[0] if terms else [], extra.get("sink_grads"))
        return dq, dk, dv, [grads[d.name] for d, t in zip(self.spec.inputs, inputs) if t.is_floating_point()]

    def _sink_input_grads(self, dims: Dims, inputs, rows: torch.Tensor | None, varlen) -> list[torch.Tensor]:
        """The float inputs' gradients (in declaration order) from each query row's gradient of its sink, `rows`
        (None: zeros); packed sequences' rows (1, H, packed rows) laid out by sequence first."""
        if rows is not None and varlen is not None:
            rows = unpacked_rows(rows, varlen)
        grads = reduce_input_grads(self.spec, dims, self._named(inputs), [], [], rows)
        return [grads[d.name] for d, t in zip(self.spec.inputs, inputs) if t.is_floating_point()]

    def _triton_forward(self, dims: Dims, extra: dict, q, k, v, inputs):
        """The Triton generator's forward: O and the lse in log2 units, with the tuned tiles where the spec says auto."""
        flags = ("dropout",) if extra.get("dropout_p") else ()
        return self._run_triton("fwd", self.module.attention_forward, dims, flags, (q, k, v, *inputs), extra)

    def _run_triton(self, phase: str, launcher, dims: Dims, flags: tuple[str, ...], args: tuple, extra: dict):
        """launcher(*args, **extra): a launcher of this kernel's Triton module for `phase` ("fwd" or "bwd"), with the
        tuned tiles where the spec tunes (_tiles), under loader.interpreted() for CPU tensors (args[0])."""
        device = args[0].device
        extra = extra | self.lists.of_pattern(dims, device)
        with interpreted_if_cpu(device):  # the tuner's runs too
            extra = extra | self._tiles(phase, dims, flags, device, lambda t: launcher(*args, **extra, tiles=t))
            return launcher(*args, **extra)

    def _twin(self) -> Kernel:
        """A bf16 spec's float32 kernels, which run its calls on CPU tensors. Triton's interpreter stores bf16 as raw
        16-bit integers and has no bf16 arithmetic (its products of bf16 tiles are products of those integers), so
        a call runs on float32 copies of q, k, v and of bf16 inputs, and its results are rounded to bf16. Every
        other part of the call (masks, dropout pattern, block lists, lse) is the same: only the element type
        differs; the backward reads the rounded O, as on a GPU."""
        if self._cpu_twin is None:
            self._cpu_twin = float32_twin(self)
        return self._cpu_twin

    def _gluon_backward(self, q_len: int, kv_len: int, keys: int | None = None) -> bool:
        """Whether the generator choice gives a backward over `keys` keys (default kv_len) the Gluon kernels, whose
        sums of positions are floats leaf by leaf where the spec has them (codegen.expr.FLOAT_POSITIONS): exact for lengths
        (positions: a shard's whole sequence's) of at most GluonPlan.bwd_max_positions, so longer calls take the
        Triton backward."""
        if self.generator.backward_at(kv_len if keys is None else keys) != "gluon":
            return False
        limit = self.generator.gluon.bwd_max_positions
        return not limit or max(q_len, kv_len) <= limit

    def _ops(self) -> Ops:
        """This kernel's custom ops: what a call under torch.compile records (autograd.Ops)."""
        return self._custom_ops

    def _extra(self, dropout_p: float, seed: torch.Tensor | None, block_mask, dims: Dims, device: torch.device) -> dict:
        """The launchers' keyword arguments for dropout (dropout_p, seed) and runtime sparsity (blocks)."""
        extra = {} if seed is None else {"dropout_p": dropout_p, "seed": seed}
        return extra | self.lists.of_mask(block_mask, dims, device)

    def _tiles(self, phase: str, dims: Dims, flags: tuple[str, ...], device: torch.device, run) -> dict:
        """The launchers' tiles= keyword for this call: {} (the plan's tiles) unless the spec tunes (then from the
        tuning cache, or measured now by timing run(tiles)). The interpreter is not timed unless a test gave the
        tuner a timer."""
        if self.tuner is None or (device.type != "cuda" and self.tuner.timer is None):
            return {}
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        name = tune_bucket(phase, gpu, dims.batch * dims.heads, dims.q_len, dims.kv_len, dims.heads // dims.kv_heads, flags)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        return {"tiles": self.tuner.tiles(phase, name, run, sync)}


def _replayed(first, replay_of):
    """A plain call's forward, fn(q, k, v, inputs) -> (O, lse): `first` (the same signature) until replay_of() gives
    the module's replay of its launch, recorded by a call of `first`; that replay (fn(q, k, v, *inputs)) from then on."""
    replayed = []

    def forward(q, k, v, inputs):
        if replayed:
            return replayed[0](q, k, v, *inputs)
        out = first(q, k, v, inputs)
        replay = replay_of()
        if replay is not None:
            replayed.append(replay)
        return out
    return forward
