"""Load a generated module and wrap it: call-time checks of the tensors, and a torch.autograd.Function."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import weakref
from pathlib import Path
from types import ModuleType
from typing import NamedTuple

import numpy as np
import torch
from torch import Tensor  # at module scope: the custom ops' annotations are read as strings

from . import fp8, kvcache
from .blocks import block_lists
from .cache import module_path
from .check import read_spec
from .decode import decode_shape, takes_plain_call
from .dtypes import TORCH_DTYPES
from .codegen.gluon import Choice
from .codegen.gluon import build_source as build_gluon_source
from .codegen.gluon import choose as choose_generator
from .codegen.gluon import plan_gluon
from .codegen.triton import build_source
from .errors import InputError, PlanError
from .expr import SCORE_VARS, Scope, input_reads
from .layout import empty_like_layout
from .loader import check_device, load_module
from .naive import check_heads, check_input_names, evaluate
from .plan import KernelPlan, effective_mask
from .plan import plan as make_plan
from .ranges import MAX_EXTENT
from .spec import Backend, DType, Index, KVLayout, LoopOrder, Spec, Var
from .tune import Tuner
from .tune import bucket as tune_bucket

LN2 = 0.6931471805599453


class _Dims(NamedTuple):
    """A call's sizes (a named tuple: made at every call, where a frozen dataclass's construction cost a few
    microseconds of host time)."""

    batch: int
    heads: int
    kv_heads: int
    q_len: int
    kv_len: int

    @property
    def empty(self) -> bool:
        """No work: no sequence, no query or no key (O = 0, lse = -inf, zero gradients)."""
        return self.batch == 0 or self.q_len == 0 or self.kv_len == 0


class Kernel:
    """A compiled attention variant: call it like a function of (q, k, v, **inputs)."""

    def __init__(self, spec: Spec, kernel_plan: KernelPlan, source: str, path: Path, module: ModuleType):
        self.bundle = None  # attngen.bundle.BundleInfo when loaded from an ahead-of-time bundle
        self.spec = spec
        self.plan = kernel_plan
        self.source = source
        self.path = path
        self.module = module
        self._direct_indices = _direct_indices(spec)
        # `auto` tiles (attngen/tune.py): measured per shape bucket on the GPU; None: the plan's tiles
        self.tuner = Tuner(kernel_plan, source) if spec.tune else None
        self._passed: dict[tuple, _Dims] = {}  # what passed _check (and _serving_call's checks): see there
        self._decode_shapes: dict[_Dims, object] = {}  # decode.decode_shape of each call's sizes
        self._last_blocks = None  # (weakref to a block mask, its version, call shapes, its lists): see _blocks
        self._cpu_twin: Kernel | None = None  # a bf16 spec's float32 kernels for the CPU interpreter: see _twin
        self._shard_twin: Kernel | None = None  # the kernels of a context-parallel shard: see _shard_kernel
        # The torch.library ops of compiled calls (about 2 ms to register; torch.compile cannot trace a registration)
        self._custom_ops = _Ops(self)
        # The generators of the passes (attngen/codegen/gluon/choice.py): with Gluon, `gluon` is its module, which
        # runs on CUDA tensors (sm_90) the passes the choice gives it; the Triton module runs the others, and
        # everything on the CPU and on other GPUs.
        self.generator = Choice("triton", "built without a choice of generator")
        self.gluon: ModuleType | None = None
        self.gluon_source: str | None = None

    def __repr__(self) -> str:
        return f"<attngen.Kernel {self.spec.name} target={self.plan.target.name} file={self.path}>"

    # -- call-time checks
    def _check(self, q, k, v, inputs: dict) -> tuple[_Dims, list[torch.Tensor]]:
        """The call's sizes and its declared inputs in order; an InputError for anything the spec does not allow.
        (The device is checked where the work starts, _forward_impl: torch.compile cannot trace that check.)
        What the checks read is each tensor's shape, element type and device and the inputs' names, so a call
        alike in those to one that passed skips them (a third of the checks' host time). Not while torch.compile
        traces the call: it runs the checks once per graph, and the memo would only add guards."""
        if torch.compiler.is_compiling():
            return self._check_all(q, k, v, inputs)
        try:
            key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
                   *[(name, t.shape, t.dtype, t.device) for name, t in inputs.items()])
        except AttributeError:  # not tensors: the checks below say which
            key = None
        dims = self._passed.get(key)
        if dims is not None:
            return dims, [inputs[d.name] for d in self.spec.inputs]
        dims, ordered = self._check_all(q, k, v, inputs)
        if key is not None:
            if len(self._passed) >= 256:  # many shapes (lengths varying call by call): start again
                self._passed.clear()
            self._passed[key] = dims
        return dims, ordered

    def _check_all(self, q, k, v, inputs: dict, varlen=None, paged_kv: tuple[int, int] | None = None) -> tuple[_Dims, list[torch.Tensor]]:
        """_check's checks. With packed sequences (varlen), q, k, v are (1, H, total rows, D) views and the batch
        and lengths the expressions and inputs see are the number of sequences and the longest ones. paged_kv =
        (key/value heads, keys per sequence): k and v are pages of a cache (checked by the caller)."""
        spec = self.spec
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 4:
                raise InputError(f"{name} must be 4-D (batch, heads, tokens, head_dim), got shape {tuple(t.shape)}")
            if t.shape[-1] != spec.head_dim:
                raise InputError(f"{name} has head_dim {t.shape[-1]}, the spec says {spec.head_dim}")
            setting = spec.kv_dtype if name != "q" and spec.kv_dtype is not None else spec.dtype
            want = TORCH_DTYPES[setting.value]
            if t.dtype != want:
                key = "dtype" if setting is spec.dtype else "kv_dtype"
                raise InputError(f"{name} is {t.dtype}, the spec {spec.name!r} says {key} = {setting.value} ({want})")
            if t.device != q.device:
                raise InputError(f"q, k, v must be on one device; {name} is on {t.device}, q on {q.device}")
        B, Hq, Nq, _ = q.shape
        if k.shape != v.shape:
            raise InputError(f"k and v must have the same shape, got {tuple(k.shape)} and {tuple(v.shape)}")
        if paged_kv is not None:
            Hkv, Nk = paged_kv
        elif k.shape[0] != B:
            raise InputError(f"q has batch {B}, k and v have {k.shape[0]}")
        else:
            Hkv, Nk = k.shape[1], k.shape[2]
        check_heads(Hq, Hkv)
        for what, n in (("batch size", B), ("number of query heads", Hq), ("query length", Nq), ("key length", Nk)):
            if n >= MAX_EXTENT:  # the integer analysis of the spec's expressions (ranges.py) assumes less
                raise InputError(f"the {what} is {n}; attngen supports at most {MAX_EXTENT - 1} (2**30 - 1)")
        dims = _dims_of(q, k, varlen) if paged_kv is None else _Dims(B, Hq, Hkv, Nq, Nk)

        check_input_names(spec, inputs)
        declared = [d.name for d in spec.inputs]
        ordered = []
        bound: dict[str, int] = {"B": dims.batch, "H": Hq}
        for decl in spec.inputs:
            t = inputs[decl.name]
            if not isinstance(t, torch.Tensor):
                raise InputError(f"input {decl.name!r} must be a torch.Tensor, got {type(t).__name__}")
            if t.dtype != TORCH_DTYPES[decl.dtype]:
                raise InputError(f"input {decl.name!r} is {t.dtype}, declared {decl.dtype}")
            if t.dim() != len(decl.dims):
                raise InputError(f"input {decl.name!r} has {t.dim()} dimension(s), declared {len(decl.dims)}: [{', '.join(map(str, decl.dims))}]")
            if t.device != q.device:
                raise InputError(f"input {decl.name!r} is on {t.device}, q on {q.device}")
            for axis, (dim, size) in enumerate(zip(decl.dims, t.shape)):
                if isinstance(dim, int):
                    if size != dim:
                        raise InputError(f"input {decl.name!r} dimension {axis} is {size}, declared {dim}")
                elif dim in bound and bound[dim] != size:
                    what = {"B": "the batch size", "H": "the number of query heads"}.get(dim, f"{dim} elsewhere")
                    raise InputError(f"input {decl.name!r} dimension {axis} ({dim}) is {size}, but {dim} is {bound[dim]} ({what})")
                else:
                    bound[dim] = size
            ordered.append(t)
        self._check_direct_indices(dims, dict(zip(declared, ordered)))
        return dims, ordered

    def _check_direct_indices(self, dims: _Dims, tensors: dict[str, torch.Tensor]) -> None:
        """An input dimension indexed directly by q_idx (kv_idx, b, h) must cover every value it takes."""
        limits = {"q_idx": ("q_len", dims.q_len), "kv_idx": ("kv_len", dims.kv_len), "b": ("batch", dims.batch), "h": ("query heads", dims.heads)}
        for name, axis, var in self._direct_indices:
            what, n = limits[var]
            size = tensors[name].shape[axis]
            if size < n:
                raise InputError(f"input {name!r} is indexed by {var} on dimension {axis}, which has size {size}; {var} goes up to {n - 1} ({what} = {n})")

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

        Serving (forward only, attngen/decode.py): `kv_lens` (int32 (B,)): sequence b has kv_lens[b] valid keys in
        k, v (B, Hkv, capacity, D), the rest is never read; `q_lens` likewise for the queries (rows past it give O =
        0, lse = -inf). A spec with `kv_layout = paged` takes k, v as caches (num_pages, page_size, Hkv, D), a
        block_table (int32 (B, pages per sequence)) and kv_lens. Expressions see each sequence's lengths.
        Plain calls with few queries and nothing to differentiate take the same decode kernels.

        FP8 (a `dtype = fp8` spec, forward only): q, k, v in e4m3 and their float32 descale factors q_descale,
        k_descale, v_descale (default 1; shapes in attngen/fp8.py, which also quantizes); O in bf16.

        Eager calls go through a torch.autograd.Function; under torch.compile the same work is a pair of custom
        ops (forward, backward) named after the kernel, so a compiled model calls it with no graph break."""
        compiling = torch.compiler.is_compiling()
        if self.spec.dtype is DType.FP8 or (self.spec.kv_dtype is None and (q_descale is not None or k_descale is not None or v_descale is not None)):
            o, lse2 = self._fp8_call(q, k, v, inputs, (q_descale, k_descale, v_descale), dropout_p, seed, block_mask, compiling,
                                     any(t is not None for t in (kv_lens, q_lens, block_table, cu_seqlens_q, cu_seqlens_k)))
            return (o, lse2 * LN2) if return_lse else o
        varlen = None
        if (kv_lens is not None or q_lens is not None or block_table is not None or self.spec.kv_layout is KVLayout.PAGED
                or self.spec.kv_dtype is not None):
            o, lse2 = self._serving_call(q, k, v, inputs, kv_lens, q_lens, block_table, dropout_p, block_mask,
                                         cu_seqlens_q is not None or cu_seqlens_k is not None, compiling, (q_descale, k_descale, v_descale))
            return (o, lse2 * LN2) if return_lse else o
        if cu_seqlens_q is not None or cu_seqlens_k is not None:
            packed = (q, k, v)  # flash_attn's (total, H, D) layout, which the packed ops under torch.compile take
            q, k, v, varlen = self._varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, compiling)
            dims, tensors = self._check_all(q, k, v, inputs, varlen)
        elif max_seqlen_q is not None or max_seqlen_k is not None:
            raise InputError("max_seqlen_q/max_seqlen_k go with cu_seqlens_q and cu_seqlens_k (packed sequences)")
        else:
            dims, tensors = self._check(q, k, v, inputs)
        p, seed_t = self._dropout_args(dropout_p, seed, q.device)
        self._check_block_mask(block_mask)
        grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad or any(t.requires_grad for t in tensors))
        if varlen is not None:
            _check_varlen_features(self.spec, tensors, grad)
        # few queries, nothing to differentiate: the decode kernels (attngen/decode.py)
        decodes = not grad and varlen is None and not p and block_mask is None and takes_plain_call(dims.q_len, dims.kv_len)
        if compiling and varlen is not None:  # the packed ops take and give flash_attn's layout
            o, lse2 = self._ops().varlen_forward(*packed, tensors, *varlen, p, seed_t)
            return (o, lse2 * LN2) if return_lse else o
        if compiling and decodes:
            o, lse2 = self._ops().decode(q, k, v, tensors, None, None, None)
        elif compiling:
            o, lse2 = self._ops().forward(q, k, v, tensors, p, seed_t, block_mask)
        elif decodes:
            o, lse2 = self._decode_impl(q, k, v, tensors, None, None, None, dims)
        elif not grad:
            o, lse2 = self._forward_impl(q, k, v, tensors, p, seed_t, block_mask, varlen)  # nothing to differentiate: no autograd node
        else:
            options = None if seed_t is None and block_mask is None and varlen is None else (p, seed_t, block_mask, varlen)
            o, lse2 = _AttentionFunction.apply(self, options, q, k, v, *tensors)
        if varlen is not None:  # back to the packed layout: O (total_q, Hq, D), lse (Hq, total_q)
            # (squeeze, not [0]: select's gradient is a zero-filled copy, and dO would then reach the backward laid
            # out by heads, copied again there; squeeze's is a view of the caller's dO)
            o, lse2 = o.squeeze(0).transpose(0, 1), lse2.squeeze(0)
        # The kernels keep the row log-sum-exp in log2 units (what their exp2 softmax needs, so the backward
        # recomputes P = exp2(s - lse2) exactly); users get natural log.
        return (o, lse2 * LN2) if return_lse else o

    def _fp8_call(self, q, k, v, inputs: dict, descales: tuple, dropout_p, seed, block_mask, compiling: bool, other_layout: bool):
        """A call of a `dtype = fp8` spec: checked, then the forward (no autograd: FP8 attention has no backward)."""
        spec = self.spec
        if spec.dtype is not DType.FP8:
            raise InputError(f"q_descale, k_descale and v_descale go with a `dtype = fp8` spec; {spec.name!r} has dtype = {spec.dtype.value}")
        if compiling:
            raise InputError("FP8 kernels are not supported under torch.compile yet; call them from a function marked @torch.compiler.disable")
        if other_layout:
            raise InputError("FP8 kernels take (B, H, N, D) tensors only: packed sequences (cu_seqlens), kv_lens, q_lens and paged caches "
                             "are not supported with dtype = fp8 yet")
        dims, tensors = self._check(q, k, v, inputs)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *tensors)):
            raise InputError("FP8 attention is forward only (its inputs are quantized): call it under torch.no_grad() or "
                             "torch.inference_mode()")
        p, seed_t = self._dropout_args(dropout_p, seed, q.device)
        self._check_block_mask(block_mask)
        blocks = [fp8.descale_blocks(name, d, dims.batch, heads, dims.kv_heads, n, q.device, per_block)
                  for name, d, heads, n, per_block in (("q_descale", descales[0], dims.heads, dims.q_len, True),
                                                       ("k_descale", descales[1], dims.kv_heads, dims.kv_len, True),
                                                       ("v_descale", descales[2], dims.kv_heads, dims.kv_len, False))]
        return self._forward_impl(q, k, v, tensors, p, seed_t, block_mask, descales=tuple(blocks))

    def _serving_call(self, q, k, v, inputs: dict, kv_lens, q_lens, block_table, dropout_p, block_mask, packed: bool, compiling: bool,
                      descales: tuple = (None, None, None)):
        """A call with per-sequence lengths, a paged cache or an FP8 cache (kv_dtype = fp8, with the caches'
        descale factors k_descale, v_descale): checked, then the decode kernels (forward only)."""
        spec = self.spec
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
        # the checks below read shapes, element types and devices only: a call alike in those to one that passed skips them
        key = ("serving", *[(t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else t if t is None else type(t) for t in (q, k, v, kv_lens, q_lens)],
               (block_table.shape, block_table.stride(), block_table.dtype, block_table.device) if isinstance(block_table, torch.Tensor) else type(block_table),
               *[(name, t.shape, t.dtype, t.device) if isinstance(t, torch.Tensor) else (name, type(t)) for name, t in inputs.items()])
        dims = None if compiling or grad else self._passed.get(key)
        if dims is not None:
            tensors = [inputs[d.name] for d in spec.inputs]
        else:
            dims, tensors = self._checked_serving_call(q, k, v, inputs, kv_lens, q_lens, block_table)
            if not compiling:
                if len(self._passed) >= 256:
                    self._passed.clear()
                self._passed[key] = dims
        if compiling:  # one custom op; the values are not read while tracing (the kernels clamp lengths and pages)
            return self._ops().decode(q, k, v, tensors, kv_lens, q_lens, block_table)
        _check_serving_values(kv_lens, q_lens, block_table, dims, k.shape[0] if paged else 0, spec.page_size if paged else 0)
        kv_scales = None
        if spec.kv_dtype is DType.FP8:
            kv_scales = tuple(fp8.cache_scales(name, s, dims.batch, dims.kv_heads, q.device) for name, s in (("k_descale", descales[1]), ("v_descale", descales[2])))
        return self._decode_impl(q, k, v, tensors, kv_lens, q_lens, block_table, dims, kv_scales)

    def _checked_serving_call(self, q, k, v, inputs: dict, kv_lens, q_lens, block_table) -> tuple[_Dims, list[torch.Tensor]]:
        """_serving_call's checks of the tensors' shapes, types and devices."""
        spec = self.spec
        paged = spec.kv_layout is KVLayout.PAGED
        batch = q.shape[0]
        paged_kv = None
        if paged:
            if block_table is None or kv_lens is None:
                raise InputError(f"the spec {spec.name!r} has kv_layout = paged: pass the caches as k and v (num_pages, {spec.page_size}, "
                                 f"kv_heads, head_dim), block_table= (int32, sequences x pages) and kv_lens= (int32, one length per sequence)")
            for name, cache in (("k", k), ("v", v)):
                kvcache.check_paged_cache(name, cache, spec.page_size)
            kvcache.check_block_table(block_table, batch, q.device)
            paged_kv = (k.shape[2], block_table.shape[1] * spec.page_size)
        elif block_table is not None:
            raise InputError(f"block_table given, but the spec {spec.name!r} has kv_layout = contiguous: a paged cache needs "
                             f"`kv_layout = paged` (and page_size) in the spec")
        dims, tensors = self._check_all(q, k, v, inputs, paged_kv=paged_kv)
        for name, lens in (("kv_lens", kv_lens), ("q_lens", q_lens)):
            if lens is not None:
                kvcache.check_lengths(name, lens, batch, q.device)
        if torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, *tensors)):
            raise InputError("kv_lens, q_lens and paged caches are for inference: their decode kernels have no backward; call under "
                             "torch.no_grad() (to train on sequences of different lengths, pack them: cu_seqlens_q/cu_seqlens_k)")
        return dims, tensors

    def _serving_dims(self, q, k, block_table) -> _Dims:
        """The sizes of a checked decode call (a paged cache: its key/value heads, keys per sequence by the table)."""
        if block_table is not None:
            return _Dims(q.shape[0], q.shape[1], k.shape[2], q.shape[2], block_table.shape[1] * k.shape[1])
        return _Dims(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2])

    def _decode_impl(self, q, k, v, inputs, kv_lens, q_lens, block_table, dims: _Dims, kv_scales=None):
        """O and the lse in log2 units by the decode kernels (attngen/decode.py); the tensors are checked.
        kv_scales: an FP8 cache's (k's, v's) descale factors, (B, Hkv) float32 each."""
        check_device(q.device, self.module)
        if dims.batch == 0 or dims.q_len == 0 or dims.heads == 0:
            return q.new_zeros(q.shape), torch.full(q.shape[:3], float("-inf"), device=q.device, dtype=torch.float32)
        if q.device.type == "cpu" and self.spec.dtype is DType.BF16:
            o, lse = self._twin()._decode_impl(*_up(q, k, v), _up(*inputs), kv_lens, q_lens, block_table, dims, kv_scales)
            return o.to(torch.bfloat16), lse
        shape = self._decode_shapes.get(dims)
        if shape is None:
            if len(self._decode_shapes) >= 256:
                self._decode_shapes.clear()
            shape = self._decode_shapes[dims] = decode_shape(self.plan, dims.batch, dims.heads, dims.kv_heads, dims.q_len, dims.kv_len)
        with _interpreter_errstate() if q.device.type == "cpu" else contextlib.nullcontext():
            scales = {} if kv_scales is None else {"kv_scales": kv_scales}
            return self.module.attention_decode(q, k, v, *inputs, kv_lens=kv_lens, q_lens=q_lens, block_table=block_table,
                                                block_r=shape.block_r, num_splits=shape.splits, **scales)

    def _varlen(self, q, k, v, cu_q, cu_k, max_q, max_k, compiling: bool):
        """Packed sequences: q, k, v as (1, H, total rows, D) views, and (cu_q, cu_k, max_q, max_k), checked. The
        values of cu_seqlens are checked (a host synchronization) except while a CUDA graph is captured or
        torch.compile traces (max_seqlen_q and max_seqlen_k must be given then)."""
        for name, t in (("q", q), ("k", k), ("v", v)):
            if not isinstance(t, torch.Tensor):
                raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
            if t.dim() != 3:
                raise InputError(f"with cu_seqlens, {name} must be 3-D (total tokens, heads, head_dim), got shape {tuple(t.shape)}")
        if cu_q is None or cu_k is None:
            raise InputError("packed sequences need both cu_seqlens_q and cu_seqlens_k")
        if self.spec.loop_order is LoopOrder.KV_OUTER:
            raise InputError(f"the spec {self.spec.name!r} has loop_order = kv_outer, which has no packed-sequence kernels; use q_outer")
        for name, cu in (("cu_seqlens_q", cu_q), ("cu_seqlens_k", cu_k)):
            if not isinstance(cu, torch.Tensor) or cu.dtype != torch.int32 or cu.dim() != 1 or cu.numel() == 0:
                what = f"{cu.dtype} of shape {tuple(cu.shape)}" if isinstance(cu, torch.Tensor) else type(cu).__name__
                raise InputError(f"{name} must be a 1-D int32 tensor of B + 1 offsets, got {what}")
            if cu.device != q.device:
                raise InputError(f"{name} is on {cu.device}, q on {q.device}")
        if cu_q.numel() != cu_k.numel():
            raise InputError(f"cu_seqlens_q has {cu_q.numel()} entries and cu_seqlens_k {cu_k.numel()}: one more than the number of sequences each")
        # (not asked while torch.compile traces: dynamo cannot put a bool from torch.cuda into its graph, found on the H100)
        capturing = not compiling and q.device.type == "cuda" and torch.cuda.is_current_stream_capturing()
        lengths = {}
        for name, cu, total, given in (("cu_seqlens_q", cu_q, q.shape[0], max_q), ("cu_seqlens_k", cu_k, k.shape[0], max_k)):
            if given is not None and (not isinstance(given, (int, torch.SymInt)) or isinstance(given, bool) or given < 0):
                raise InputError(f"max_seqlen_{name[-1]} must be a non-negative int, got {given!r}")
            if capturing or compiling:
                if given is None:
                    while_ = "a CUDA graph is captured" if capturing else "torch.compile traces"
                    raise InputError(f"while {while_}, pass max_seqlen_{name[-1]} (it cannot be read from {name})")
                lengths[name] = given
                continue
            longest = _longest_sequence(name, cu, total)
            if given is not None and given < longest:
                raise InputError(f"max_seqlen_{name[-1]} = {given}, but a sequence of {name} has {longest} rows")
            lengths[name] = longest if given is None else given
        return (*_heads_first(q, k, v), (cu_q, cu_k, lengths["cu_seqlens_q"], lengths["cu_seqlens_k"]))

    def _forward_impl(self, q, k, v, inputs, dropout_p: float, seed: torch.Tensor | None, block_mask, varlen=None, descales=None):
        """O and the lse in log2 units: what every call runs, eager or compiled (the tensors are checked).
        varlen: packed sequences (see _varlen). descales: FP8's, in attngen.fp8.descale_blocks' layout."""
        device = q.device
        check_device(device, self.module)
        dims = _dims_of(q, k, varlen)
        out_dtype = torch.bfloat16 if self.spec.dtype is DType.FP8 else q.dtype
        if dims.empty:  # nothing to attend to (or no query, or no sequence): O = 0, lse = -inf
            o = q.new_zeros(q.shape, dtype=out_dtype) if varlen is not None else empty_like_layout(q, dtype=out_dtype).zero_()
            return o, torch.full(q.shape[:3], float("-inf"), device=device, dtype=torch.float32)
        if descales is not None and device.type == "cpu":
            # Triton 3.6's interpreter rounds float32 to e4m3 wrongly where rounding carries into the exponent (0.4917
            # becomes 0.25): on the CPU an FP8 call runs the float32 kernels on the dequantized inputs (P unrounded),
            # its O rounded to bf16
            deq = (fp8.dequantize(q, descales[0]), fp8.dequantize(k, descales[1]), fp8.dequantize(v, descales[2], per_block=False))
            o, lse = self._twin()._forward_impl(*deq, _up(*inputs), dropout_p, seed, block_mask)
            return o.to(torch.bfloat16), lse
        if self.generator.forward_at(dims.kv_len) == "gluon" and _is_sm90(device):  # the Gluon generator's forward
            fp8_scales = {} if descales is None else {"descales": descales}
            return self.gluon.attention_forward(q, k, v, *inputs, **self._extra(dropout_p, seed, block_mask, dims, device), varlen=varlen,
                                                **fp8_scales)
        if device.type == "cpu" and self.spec.dtype is DType.BF16:
            o, lse = self._twin()._forward_impl(*_up(q, k, v), _up(*inputs), dropout_p, seed, block_mask, varlen)
            return o.to(torch.bfloat16), lse
        extra = self._extra(dropout_p, seed, block_mask, dims, q.device)
        if descales is not None:
            extra["descales"] = descales
        if varlen is None:
            return self._triton_forward(dims, extra, q, k, v, inputs)
        with _interpreter_errstate() if q.device.type == "cpu" else contextlib.nullcontext():
            return self.module.attention_forward(q, k, v, *inputs, **extra, varlen=varlen)

    def _backward_impl(self, q, k, v, o, lse, do, dlse, inputs, dropout_p: float, seed: torch.Tensor | None, block_mask,
                       input_grads: bool, varlen=None):
        """(dQ, dK, dV, [the gradient of each float input, or an empty tensor unless input_grads]). `dlse` (log2
        units, or None) is the gradient reaching the lse."""
        dims = _dims_of(q, k, varlen)
        floats = [t for t in inputs if t.is_floating_point()]
        if dims.empty:
            dq, dk, dv = (torch.zeros_like(t) if varlen is not None else empty_like_layout(t).zero_() for t in (q, k, v))
            return dq, dk, dv, [torch.zeros_like(t) if input_grads else t.new_empty(0) for t in floats]
        device = q.device
        if device.type == "cpu" and self.spec.dtype is DType.BF16:
            dq, dk, dv, grads = self._twin()._backward_impl(*_up(q, k, v, o), lse, *_up(do), dlse, _up(*inputs), dropout_p, seed,
                                                             block_mask, input_grads, varlen)
            return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype), [g.to(t.dtype) for g, t in zip(grads, floats)]
        if self._gluon_backward(dims.q_len, dims.kv_len) and not input_grads and _is_sm90(device):
            # the Gluon generator's backward (where the choice gives it, codegen/gluon/choice.py; packed sequences by
            # their longest keys); input gradients are the Triton kernels'
            dq, dk, dv = self.gluon.attention_backward(q, k, v, o, lse, do, dlse, *inputs, **self._extra(dropout_p, seed, block_mask, dims, device),
                                                       varlen=varlen)
            return dq, dk, dv, [t.new_empty(0) for t in floats]
        extra = self._extra(dropout_p, seed, block_mask, dims, device)
        if varlen is not None:  # packed sequences: the Triton generator's kernels (no input gradients: refused at the call)
            with _interpreter_errstate() if q.device.type == "cpu" else contextlib.nullcontext():
                dq, dk, dv = self.module.attention_backward(q, k, v, o, lse, do, dlse, *inputs, **extra, varlen=varlen)
            return dq, dk, dv, [t.new_empty(0) for t in floats]
        reads = self.plan.read_grads
        if input_grads and reads:
            extra["input_grads"] = True
        flags = tuple(f for f, on in (("dropout", extra.get("dropout_p")), ("input_grads", extra.get("input_grads"))) if on)
        dq, dk, dv, *terms = self._run_triton("bwd", self.module.attention_backward, dims, flags, (q, k, v, o, lse, do, dlse, *inputs),
                                              extra)  # with input_grads: the terms too
        if not input_grads:
            return dq, dk, dv, [t.new_empty(0) for t in floats]
        grads = _reduce_input_grads(self.spec, dims, dict(zip((d.name for d in self.spec.inputs), inputs)), reads, terms[0] if terms else [])
        return dq, dk, dv, [grads[d.name] for d, t in zip(self.spec.inputs, inputs) if t.is_floating_point()]

    def _triton_forward(self, dims: _Dims, extra: dict, q, k, v, inputs):
        """The Triton generator's forward: O and the lse in log2 units, with the tuned tiles where the spec says auto."""
        flags = ("dropout",) if extra.get("dropout_p") else ()
        return self._run_triton("fwd", self.module.attention_forward, dims, flags, (q, k, v, *inputs), extra)

    def _run_triton(self, phase: str, launcher, dims: _Dims, flags: tuple[str, ...], args: tuple, extra: dict):
        """launcher(*args, **extra): a launcher of this kernel's Triton module for `phase` ("fwd" or "bwd"), with the
        tuned tiles where the spec tunes (_tiles), under the interpreter's error state for CPU tensors (args[0])."""
        device = args[0].device
        with _interpreter_errstate() if device.type == "cpu" else contextlib.nullcontext():  # the tuner's runs too
            extra = extra | self._tiles(phase, dims, flags, device, lambda t: launcher(*args, **extra, tiles=t))
            return launcher(*args, **extra)

    def _twin(self) -> Kernel:
        """A bf16 spec's float32 kernels, which run its calls on CPU tensors. Triton's interpreter stores bf16 as raw
        16-bit integers and has no bf16 arithmetic (its products of bf16 tiles are products of those integers), so
        a call runs on float32 copies of q, k, v and of bf16 inputs, and its results are rounded to bf16. Every
        other part of the call (masks, dropout pattern, block lists, lse) is the same: only the element type
        differs; the backward reads the rounded O, as on a GPU."""
        if self._cpu_twin is None:
            self._cpu_twin = _float32_twin(self)
        return self._cpu_twin

    def _shard_kernel(self) -> Kernel:
        """This spec's kernels for one shard of a context-parallel attention (attngen/distributed): its forward and
        backward with global positions (KernelPlan.global_positions), by the same generators as this kernel's
        (_positions_twin). Built on first use (just in time, also for a kernel loaded from a bundle)."""
        if self._shard_twin is None:
            self._shard_twin = _positions_twin(self)
        return self._shard_twin

    def _gluon_backward(self, q_len: int, kv_len: int, keys: int | None = None) -> bool:
        """Whether the generator choice gives a backward over `keys` keys (default kv_len) the Gluon kernels, whose
        sums of positions are floats leaf by leaf where the spec has them (expr.FLOAT_POSITIONS): exact for lengths
        (positions: a shard's whole sequence's) of at most GluonPlan.bwd_max_positions, so longer calls take the
        Triton backward."""
        if self.generator.backward_at(kv_len if keys is None else keys) != "gluon":
            return False
        limit = self.generator.gluon.bwd_max_positions
        return not limit or max(q_len, kv_len) <= limit

    def _shard_forward(self, q, k, v, inputs, dropout_p: float, seed: torch.Tensor | None, positions: tuple[int, int, int, int]):
        """O and the lse (log2 units) of q's rows attending to k's and v's keys only, where q's first row and k's
        first key are at positions[0] and positions[1] of a sequence of positions[2] queries and positions[3] keys,
        which the expressions see (attngen/distributed merges these partial results). O is float32 from the
        Triton generator, q's element type from the Gluon one (it stores O through Q's tile). The tensors are
        checked by the caller."""
        kern = self._shard_kernel()
        check_device(q.device, kern.module)
        extra = {} if seed is None else {"dropout_p": dropout_p, "seed": seed}
        if kern.generator.forward_at(k.shape[2]) == "gluon" and _is_sm90(q.device):  # O in q's element type (TMA stores through Q's tile)
            return kern.gluon.attention_forward(q, k, v, *inputs, **extra, positions=positions)
        if q.device.type == "cpu" and kern.spec.dtype is DType.BF16:
            kern, (q, k, v), inputs = kern._twin(), _up(q, k, v), _up(*inputs)
        return kern._run_triton("fwd", kern.module.attention_forward, _dims_of(q, k), ("dropout",) if dropout_p else (), (q, k, v, *inputs),
                                extra | {"positions": positions, "out_dtype": torch.float32})

    def _shard_backward(self, q, k, v, o, lse, do, dlse, inputs, dropout_p: float, seed: torch.Tensor | None, positions: tuple[int, int, int, int]):
        """(dQ, dK, dV) of one shard pair (as _shard_forward's): the contributions of q's rows and k's keys to the
        whole attention's gradients, from its O and lse (log2 units) and dO, dlse (or None). float32, but dK and
        dV in k's element type from the Gluon backward."""
        kern = self._shard_kernel()
        lse = lse.contiguous()  # the kernels index the lse (and dlse) as (B, H, rows) rows
        dlse = None if dlse is None else dlse.contiguous()
        extra = {} if seed is None else {"dropout_p": dropout_p, "seed": seed}
        if kern._gluon_backward(positions[2], positions[3], k.shape[2]) and _is_sm90(q.device):  # dK, dV in k's and v's element type
            return kern.gluon.attention_backward(q, k, v, o.contiguous(), lse, do.contiguous(), dlse, *inputs, **extra, positions=positions,
                                                 grad_dtype=torch.float32)
        if q.device.type == "cpu" and kern.spec.dtype is DType.BF16:
            kern, (q, k, v, o, do), inputs = kern._twin(), _up(q, k, v, o, do), _up(*inputs)
        return kern._run_triton("bwd", kern.module.attention_backward, _dims_of(q, k), ("dropout",) if dropout_p else (),
                                (q, k, v, o, lse, do, dlse, *inputs), extra | {"positions": positions, "grad_dtype": torch.float32})

    def _ops(self) -> _Ops:
        """This kernel's custom ops: what a call under torch.compile records (see _Ops)."""
        return self._custom_ops

    def _check_block_mask(self, block_mask) -> None:
        spec = self.spec
        if spec.sparsity != "runtime" and block_mask is not None:
            raise InputError(f"block_mask given, but the spec {spec.name!r} does not say `sparsity = runtime`")
        if spec.sparsity == "runtime" and block_mask is None:
            raise InputError(f"the spec {spec.name!r} has sparsity = runtime: pass block_mask= (bool, (B or 1, H or 1, "
                             f"ceil(Nq / {spec.sparse_block}), ceil(Nk / {spec.sparse_block}))), e.g. from attngen.block_mask_from")

    def _extra(self, dropout_p: float, seed: torch.Tensor | None, block_mask, dims: _Dims, device: torch.device) -> dict:
        """The launchers' keyword arguments for dropout (dropout_p, seed) and runtime sparsity (blocks)."""
        extra = {} if seed is None else {"dropout_p": dropout_p, "seed": seed}
        return extra | self._blocks(block_mask, dims, device)

    def _blocks(self, block_mask, dims: _Dims, device: torch.device) -> dict:
        """The block lists keyword of the generated launchers ({} for a spec without runtime sparsity)."""
        spec = self.spec
        if spec.sparsity != "runtime":
            return {}
        # The lists of the last mask are kept: a call with the same tensor object, unmodified since (its version
        # counter), and the same shapes reuses them instead of converting again (0.15-0.34 ms at N = 8192 on the H100).
        shapes = (dims.batch, dims.heads, dims.q_len, dims.kv_len, device)
        last = self._last_blocks
        if last is not None and last[0]() is block_mask and last[1] == block_mask._version and last[2] == shapes:
            return {"blocks": last[3]}
        lists = block_lists(block_mask, spec.sparse_block, dims.batch, dims.heads, dims.q_len, dims.kv_len, device)
        self._last_blocks = (weakref.ref(block_mask), block_mask._version, shapes, lists)
        return {"blocks": lists}

    def _dropout_args(self, dropout_p: float | None, seed, device: torch.device) -> tuple[float, torch.Tensor | None]:
        """(the dropout probability, the seed as a one-element int64 tensor on `device`, which the kernels read
        there); (0.0, None) for a spec without dropout. `seed`: an int (the pattern is fixed; captured in a CUDA
        graph, every replay draws it), a one-element int64 tensor (read at each launch: a CUDA graph replays with
        its value then), or None: drawn on `device` from torch's generator, a tensor op that torch.compile records
        and that CUDA graphs replay with a fresh value, so each step draws a new pattern."""
        if self.spec.dropout == 0.0:
            if dropout_p:
                raise InputError(f"dropout_p={dropout_p}, but the spec {self.spec.name!r} has no dropout: set `dropout = p` in "
                                 f"the spec (the dropout path is compiled only then)")
            return 0.0, None
        p = self.spec.dropout if dropout_p is None else dropout_p
        if not isinstance(p, (int, float)) or not 0.0 <= p < 1.0:
            raise InputError(f"dropout_p must be a probability in [0, 1), got {p!r}")
        if seed is None:
            return float(p), torch.randint(0, 2**62, (1,), dtype=torch.int64, device=device)
        if isinstance(seed, torch.Tensor):
            if seed.dtype != torch.int64 or seed.numel() != 1:
                raise InputError(f"a seed tensor must hold one int64, got {seed.dtype} of shape {tuple(seed.shape)}")
            if seed.device != device:
                raise InputError(f"the seed tensor is on {seed.device}, q on {device}: the kernels read it on q's device")
            return float(p), seed.reshape(1)
        if not isinstance(seed, int) or isinstance(seed, bool) or not 0 <= seed < 2**63:
            raise InputError(f"seed must be a non-negative integer below 2**63 or a one-element int64 tensor, got {seed!r}")
        return float(p), torch.full((1,), seed, dtype=torch.int64, device=device)


    def _tiles(self, phase: str, dims: _Dims, flags: tuple[str, ...], device: torch.device, run) -> dict:
        """The launchers' tiles= keyword for this call: {} (the plan's tiles) unless the spec tunes (then from the
        tuning cache, or measured now by timing run(tiles)). The interpreter is not timed unless a test gave the
        tuner a timer."""
        if self.tuner is None or (device.type != "cuda" and self.tuner.timer is None):
            return {}
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else device.type
        name = tune_bucket(phase, gpu, dims.batch * dims.heads, dims.q_len, dims.kv_len, dims.heads // dims.kv_heads, flags)
        sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
        return {"tiles": self.tuner.tiles(phase, name, run, sync)}


def _longest_sequence(name: str, cu: torch.Tensor, total: int) -> int:
    """The longest sequence of offsets `cu`, checked to start at 0, never decrease and end at `total`. Reading them
    is a host synchronization, which would stall every layer of a model on the GPU (0.3 ms per call measured on the
    H100): the result is remembered on the tensor, for its current version (an in-place change makes a new one), so
    the layers sharing one batch's cu_seqlens check it once."""
    seen = cu.__dict__.get("_attngen_checked")
    if seen is not None and seen[:2] == (cu._version, total):
        return seen[2]
    offsets = cu.tolist()
    steps = [b - a for a, b in zip(offsets, offsets[1:])]
    if offsets[0] != 0 or any(n < 0 for n in steps):
        raise InputError(f"{name} must start at 0 and never decrease, got {offsets[:8]}{' ...' if len(offsets) > 8 else ''}")
    if offsets[-1] != total:
        raise InputError(f"{name} ends at {offsets[-1]}, but the packed tensor has {total} rows")
    longest = max(steps, default=0)
    cu.__dict__["_attngen_checked"] = (cu._version, total, longest)
    return longest


def _check_serving_values(kv_lens, q_lens, block_table, dims: _Dims, num_pages: int, page_size: int) -> None:
    """The lengths and the block table's pages in range (attngen.kvcache.check_values, a host synchronization).
    The layers of one decode step share these tensors: the result is remembered on the first of them for the
    versions and shapes it saw, so an unchanged set is checked once (an in-place update checks it again)."""
    first = next((t for t in (kv_lens, q_lens) if t is not None), None)
    if first is None:
        return
    key = tuple((id(t), t._version) if t is not None else None for t in (kv_lens, q_lens, block_table)) + (dims.q_len, dims.kv_len, num_pages)
    if first.__dict__.get("_attngen_checked") == key:
        return
    lens = kv_lens if kv_lens is not None else torch.full_like(q_lens, dims.kv_len)
    kvcache.check_values(lens, dims.kv_len, block_table, num_pages, page_size, q_lens, dims.q_len)
    if not kvcache._capturing(first.device):
        first.__dict__["_attngen_checked"] = key


def _check_varlen_features(spec: Spec, inputs: list[torch.Tensor], grad: bool) -> None:
    """What packed sequences do not support yet: an InputError before any kernel runs."""
    if spec.sparsity == "runtime":
        raise InputError("runtime block sparsity with packed sequences (cu_seqlens) is not supported yet")
    if grad and any(t.requires_grad for t in inputs):
        raise InputError("gradients of declared inputs with packed sequences (cu_seqlens) are not supported yet")


def _interpreter_errstate():
    """numpy's error state for the interpreter's kernel runs: a row that keeps no key has lse = m + log2(0) = -inf
    by design, which numpy would report as a division by zero on stderr."""
    return np.errstate(divide="ignore")


def _float32_twin(kernel: Kernel) -> Kernel:
    """The same spec with float32 elements (bf16 inputs declared fp32), planned for the same target: what a bf16
    kernel runs on the CPU interpreter. The interpreter ignores on-chip memory, so where the spec's fixed tiles
    do not fit float32 on the target, the twin takes the derived ones (tiles never change results)."""
    spec = kernel.spec
    inputs = tuple(dataclasses.replace(d, dtype="fp32") if d.dtype == "bf16" else d for d in spec.inputs)
    twin = dataclasses.replace(spec, dtype=DType.FP32, inputs=inputs)
    try:
        twin_plan = make_plan(twin, kernel.plan.target, classify=kernel.plan.classify)
    except PlanError:
        twin = dataclasses.replace(twin, block_m=None, block_n=None, num_warps=None, num_stages=None, tune=frozenset())
        twin_plan = make_plan(twin, kernel.plan.target, classify=kernel.plan.classify)
    twin_plan = dataclasses.replace(twin_plan, global_positions=kernel.plan.global_positions)
    key, source = build_source(twin_plan)
    module = load_module(twin.name, key, source)
    return Kernel(twin, twin_plan, source, Path(module.__file__), module)


def _positions_twin(kernel: Kernel) -> Kernel:
    """The same spec's kernels with global positions (KernelPlan.global_positions), for context-parallel shards:
    the Triton generator's, and the Gluon generator's where the kernel's choice of generators took it (the same
    choice for each pass). loop_order = kv_outer is planned q_outer (its forward has no positions; results
    differ by rounding)."""
    spec = kernel.spec
    if spec.loop_order is not LoopOrder.Q_OUTER:
        spec = dataclasses.replace(spec, loop_order=LoopOrder.Q_OUTER)
    twin_plan = dataclasses.replace(make_plan(spec, kernel.plan.target, classify=kernel.plan.classify), global_positions=True)
    key, source = build_source(twin_plan)
    module = load_module(spec.name, key, source)
    twin = Kernel(spec, twin_plan, source, Path(module.__file__), module)
    if kernel.generator.gluon is not None:
        gp = plan_gluon(twin_plan)
        twin.generator = dataclasses.replace(kernel.generator, gluon=gp)
        key, twin.gluon_source = build_gluon_source(gp)
        twin.gluon = load_module(f"{spec.name}_gluon", key, twin.gluon_source)
    return twin


def _direct_indices(spec: Spec) -> list[tuple[str, int, str]]:
    """(input, axis, variable) for every input dimension the spec indexes with a bare b, h, q_idx or kv_idx."""
    found = []
    for e in input_reads(effective_mask(spec), spec.score):
        for axis, idx in enumerate(e.indices):
            if isinstance(idx, Var) and idx.name in ("b", "h", "q_idx", "kv_idx") and (e.input, axis, idx.name) not in found:
                found.append((e.input, axis, idx.name))
    return found


def _dims_of(q: torch.Tensor, k: torch.Tensor, varlen=None) -> _Dims:
    """The call's sizes; with packed sequences (q, k as (1, H, total rows, D) views, varlen = (cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k)): the number of sequences and the longest lengths."""
    if varlen is not None:
        return _Dims(varlen[0].numel() - 1, q.shape[1], k.shape[1], varlen[2], varlen[3])
    return _Dims(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2])


def _up(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """bf16 tensors as float32 (the CPU path of bf16 specs, see Kernel._twin); the others as they are."""
    return [t.float() if t.dtype == torch.bfloat16 else t for t in tensors]


def _as_input_grads(inputs, grads: list, wanted) -> tuple:
    """One entry per input: its gradient where `wanted` says it needs one (grads holds one per float input, in
    order), None for the rest."""
    floats = iter(grads)
    per_input = [next(floats) if t.is_floating_point() else None for t in inputs]
    return tuple(g if w else None for g, w in zip(per_input, wanted))


class _AttentionFunction(torch.autograd.Function):
    """An eager call: a few microseconds of dispatch (a torch.library custom op with autograd cost ~55 us more per
    call on the 2-core CPU machine, so the ops serve torch.compile only; both run Kernel._forward_impl and
    _backward_impl). `options`: (dropout_p, seed, block_mask, varlen), or None for none of them (a plain call:
    fewer arguments for autograd to pass over)."""

    @staticmethod
    def forward(ctx, kernel: Kernel, options, q, k, v, *inputs):
        ctx.set_materialize_grads(False)
        options = options or _PLAIN
        o, lse = kernel._forward_impl(q, k, v, inputs, *options)
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
        dropout_p, seed, block_mask, varlen = ctx.options
        wanted = [w and t.is_floating_point() for w, t in zip(ctx.needs_input_grad[5:], inputs)]
        dq, dk, dv, grads = ctx.kernel._backward_impl(q, k, v, o, lse, do, dlse, inputs, dropout_p, seed, block_mask, any(wanted), varlen)
        return (None, None, dq, dk, dv) + _as_input_grads(inputs, grads, wanted)


_PLAIN = (0.0, None, None, None)  # _AttentionFunction's options of a plain call


class _Ops:
    """A kernel's torch.library custom ops, which torch.compile traces as single calls (with dynamic shapes): the
    forward `attngen::<name>_fwd` (O and the lse in log2 units) and the backward `attngen::<name>_bwd`, its
    autograd formula. <name> is the spec's name and the first 12 hex digits of the spec's sha256, and a number
    where another kernel of the same spec (another target, generator or bundle) is registered in this process.
    Fake implementations give the outputs' shapes; the real ones run Kernel._forward_impl / _backward_impl."""

    _names: dict[str, int] = {}

    def __init__(self, kernel: Kernel):
        spec = kernel.spec
        base = f"{spec.name}_{kernel.plan.spec_hash[:12]}"
        count = _Ops._names[base] = _Ops._names.get(base, 0) + 1
        self.name = base if count == 1 else f"{base}_{count}"

        def forward(q: Tensor, k: Tensor, v: Tensor, inputs: list[Tensor], dropout_p: float, seed: Tensor | None,
                    block_mask: Tensor | None) -> tuple[Tensor, Tensor]:
            return kernel._forward_impl(q, k, v, inputs, dropout_p, seed, block_mask)

        def backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, dlse: Tensor | None, inputs: list[Tensor],
                     dropout_p: float, seed: Tensor | None, block_mask: Tensor | None, input_grads: bool) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
            return kernel._backward_impl(q, k, v, o, lse, do, dlse, inputs, dropout_p, seed, block_mask, input_grads)

        def decode(q: Tensor, k: Tensor, v: Tensor, inputs: list[Tensor], kv_lens: Tensor | None, q_lens: Tensor | None,
                   block_table: Tensor | None) -> tuple[Tensor, Tensor]:
            return kernel._decode_impl(q, k, v, inputs, kv_lens, q_lens, block_table, kernel._serving_dims(q, k, block_table))

        self.decode = torch.library.custom_op(f"attngen::{self.name}_decode", decode, mutates_args=())
        self.decode.register_fake(_fake_decode)
        self.forward = torch.library.custom_op(f"attngen::{self.name}_fwd", forward, mutates_args=())
        self.backward = torch.library.custom_op(f"attngen::{self.name}_bwd", backward, mutates_args=())
        self.forward.register_fake(_fake_forward)
        self.backward.register_fake(_fake_backward)
        self.forward.register_autograd(self._autograd, setup_context=_setup_context)

        # packed sequences (cu_seqlens): q, k, v, O, dO and the gradients in flash_attn's (total, H, D) layout, the
        # lse (Hq, total); the kernels see them as (1, H, total, D) views (Kernel._varlen)
        def varlen_forward(q: Tensor, k: Tensor, v: Tensor, inputs: list[Tensor], cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
                           max_seqlen_q: int, max_seqlen_k: int, dropout_p: float, seed: Tensor | None) -> tuple[Tensor, Tensor]:
            o, lse = kernel._forward_impl(*_heads_first(q, k, v), inputs, dropout_p, seed, None, (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k))
            return _tokens_first(o), lse.squeeze(0).contiguous()

        def varlen_backward(q: Tensor, k: Tensor, v: Tensor, o: Tensor, lse: Tensor, do: Tensor, dlse: Tensor | None, inputs: list[Tensor],
                            cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, dropout_p: float,
                            seed: Tensor | None) -> tuple[Tensor, Tensor, Tensor]:
            varlen = (cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k)
            dq, dk, dv, _ = kernel._backward_impl(*_heads_first(q, k, v, o), lse.unsqueeze(0), *_heads_first(do), None if dlse is None else dlse.unsqueeze(0),
                                                  inputs, dropout_p, seed, None, False, varlen)
            return _tokens_first(dq), _tokens_first(dk), _tokens_first(dv)

        self.varlen_forward = torch.library.custom_op(f"attngen::{self.name}_varlen_fwd", varlen_forward, mutates_args=())
        self.varlen_backward = torch.library.custom_op(f"attngen::{self.name}_varlen_bwd", varlen_backward, mutates_args=())
        self.varlen_forward.register_fake(_fake_varlen_forward)
        self.varlen_backward.register_fake(_fake_varlen_backward)
        self.varlen_forward.register_autograd(self._varlen_autograd, setup_context=_setup_varlen_context)

    def _autograd(self, ctx, do, dlse):
        q, k, v, o, lse, *rest = ctx.saved_tensors
        inputs, seed, block_mask = rest[:ctx.n_inputs], *_optional(rest[ctx.n_inputs:], ctx.has_seed, ctx.has_block_mask)
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv, grads = self.backward(q, k, v, o, lse, do, dlse, inputs, ctx.dropout_p, seed, block_mask, any(ctx.wanted))
        return dq, dk, dv, list(_as_input_grads(inputs, grads, ctx.wanted)), None, None, None

    def _varlen_autograd(self, ctx, do, dlse):
        q, k, v, o, lse, cu_q, cu_k, *rest = ctx.saved_tensors
        inputs, seed = rest[:ctx.n_inputs], (rest[ctx.n_inputs] if ctx.has_seed else None)
        if do is None:
            do = torch.zeros_like(o)
        dq, dk, dv = self.varlen_backward(q, k, v, o, lse, do, dlse, inputs, cu_q, cu_k, ctx.max_q, ctx.max_k, ctx.dropout_p, seed)
        return dq, dk, dv, [None] * ctx.n_inputs, None, None, None, None, None, None


def _setup_varlen_context(ctx, inputs, output) -> None:
    q, k, v, tensors, cu_q, cu_k, max_q, max_k, dropout_p, seed = inputs
    ctx.n_inputs, ctx.dropout_p, ctx.max_q, ctx.max_k, ctx.has_seed = len(tensors), dropout_p, max_q, max_k, seed is not None
    ctx.save_for_backward(q, k, v, *output, cu_q, cu_k, *tensors, *((seed,) if seed is not None else ()))


def _heads_first(*tensors: Tensor) -> tuple[Tensor, ...]:
    """Packed (total, H, D) tensors as the kernels' (1, H, total, D) views."""
    return tuple(t.permute(1, 0, 2).unsqueeze(0) for t in tensors)


def _tokens_first(t: Tensor) -> Tensor:
    """A kernel's (1, H, total, D) output as a (total, H, D) tensor (a view where the kernel wrote it so)."""
    return t.squeeze(0).transpose(0, 1).contiguous()


def _fake_varlen_forward(q, k, v, inputs, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, dropout_p, seed):
    return q.new_empty(q.shape), q.new_empty((q.shape[1], q.shape[0]), dtype=torch.float32)


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
    return q.new_empty(q.shape), q.new_empty(q.shape[:3], dtype=torch.float32)


def _fake_forward(q, k, v, inputs, dropout_p, seed, block_mask):
    return empty_like_layout(q), q.new_empty(q.shape[:3], dtype=torch.float32)  # O laid out as the kernels lay it out


def _fake_backward(q, k, v, o, lse, do, dlse, inputs, dropout_p, seed, block_mask, input_grads):
    grads = [t.new_empty(t.shape if input_grads else (0,)) for t in inputs if t.is_floating_point()]
    return empty_like_layout(q), empty_like_layout(k), empty_like_layout(v), grads


_AXES = ("b", "h", "q_idx", "kv_idx")  # the axes of a direct read's term buffer (B, H, Nq, Nk)


def _reduce_input_grads(spec: Spec, dims: _Dims, inputs: dict[str, torch.Tensor], reads, terms) -> dict[str, torch.Tensor]:
    """Each float input's gradient from the dQ kernel's terms, in a fixed order (deterministic). An input with
    no differentiable read in the score (read only by the mask, or not at all) gets zeros: the mask is
    piecewise constant."""
    grads = {name: torch.zeros(t.shape, device=t.device, dtype=torch.float64 if t.device.type == "cpu" else torch.float32)
             for name, t in inputs.items() if t.is_floating_point()}
    scope = Scope("score", SCORE_VARS, spec.inputs_by_name)
    index_inputs = {name: t.detach() for name, t in inputs.items() if not t.is_floating_point()}
    for g, term in zip(reads, terms):
        x = inputs[g.read.input]
        grad = grads[g.read.input]
        if g.kind == "direct":  # sum the term over the axes the read does not use, then place it
            _add_direct(g.read, term, grad)
            continue
        if g.kind == "uniform":  # one element per (b, h): the rows' sums
            term = term.sum(2)
        # uniform and scatter: evaluate the read's indices at every (b, h[, q_idx, kv_idx]) of the term
        env = {name: torch.arange(n, device=term.device).view([n if a == axis else 1 for a in range(term.dim())])
               for axis, (name, n) in enumerate(zip(_AXES, term.shape))}
        env |= {"q_len": dims.q_len, "kv_len": dims.kv_len}
        valid = torch.ones(term.shape, dtype=torch.bool, device=term.device)
        flat = torch.zeros(term.shape, dtype=torch.long, device=term.device)
        for i, size in zip(g.read.indices, x.shape):
            i = torch.as_tensor(evaluate(i, env, index_inputs, scope, torch.float64), device=term.device).long().broadcast_to(term.shape)
            valid &= (i >= 0) & (i < size)  # reads outside the input gave 0: no gradient
            flat = flat * size + i.clamp(0, size - 1)
        grad += _sum_by_element(flat[valid], term[valid], x.numel()).view(x.shape).to(grad)
    return {name: g.to(inputs[name].dtype) for name, g in grads.items()}


def _add_direct(read: Index, term: torch.Tensor, grad: torch.Tensor) -> None:
    """grad[read's indices] += the (B, H, Nq, Nk) term summed over the axes the read does not name."""
    used = [i.name for i in read.indices if isinstance(i, Var)]
    t = term.sum(dim=[a for a, name in enumerate(_AXES) if name not in used]) if len(used) < 4 else term
    t = t.permute([sorted(used, key=_AXES.index).index(name) for name in used])
    target, source = [], [slice(None)] * len(used)
    for i, size in zip(read.indices, grad.shape):
        if isinstance(i, Var):
            n = min(size, t.shape[used.index(i.name)])
            target.append(slice(0, n))
            source[used.index(i.name)] = slice(0, n)
        elif 0 <= i.value < size:
            target.append(i.value)
        else:
            return  # a constant index outside the input: read as 0, no gradient
    grad[tuple(target)] += t[tuple(source)].to(grad)


def _sum_by_element(flat: torch.Tensor, values: torch.Tensor, n: int) -> torch.Tensor:
    """out[j] = sum of values[flat == j] in float64, in index order (deterministic): CPU's index_add_ is a
    sequential loop. CUDA's index_add_ and scatter_add_ use atomics, and a GPU version built from a stable sort
    and a float64 cumsum was not bit-reproducible on the H100, so GPU terms are reduced on the host."""
    out = torch.zeros(n, dtype=torch.float64).index_add_(0, flat.cpu(), values.cpu().double())
    return out.to(values.device)


def compile(spec: Spec | str | os.PathLike, target: str | None = None, *, cache_dir: str | os.PathLike | None = None,
            classify: bool = True, backend: str | None = None, deterministic: bool | None = None) -> Kernel:
    """Parse, check, plan, render, cache and load a spec just in time (attngen.compile, with bundle=, can take
    prebuilt binaries instead). `spec` is a path, spec text, or a Spec; `target` overrides the spec's target (a
    name from `attngen targets`, or "auto"). `classify=False` builds kernels that visit and mask every tile (a
    baseline to measure tile classification against). `backend` overrides the spec's: auto, triton or gluon
    (the generator of each pass on sm_90; attngen/codegen/gluon/choice.py). `deterministic` overrides the spec's
    setting (False lets the backward add dQ in no fixed order where that is faster)."""
    spec_obj = read_spec(spec)
    if deterministic is not None:
        if not isinstance(deterministic, bool):
            raise InputError(f"deterministic must be True or False; got {deterministic!r}")
        spec_obj = dataclasses.replace(spec_obj, deterministic=deterministic)
    kernel_plan = make_plan(spec_obj, target, classify=classify)
    choice = choose_generator(spec_obj, kernel_plan, _backend(backend))
    key, source = build_source(kernel_plan)
    cache_path = Path(cache_dir) if cache_dir else None
    module = load_module(spec_obj.name, key, source, cache_path)
    kern = Kernel(spec_obj, kernel_plan, source, module_path(spec_obj.name, key, cache_path), module)
    kern.generator = choice
    if choice.gluon is not None:
        key, kern.gluon_source = build_gluon_source(choice.gluon)
        kern.gluon = load_module(f"{spec_obj.name}_gluon", key, kern.gluon_source, cache_path)
    return kern


@functools.lru_cache(maxsize=None)
def _is_sm90(device: torch.device) -> bool:
    """Gluon's kernels are Hopper's: a kernel planned for the H100 but called on another GPU (or the CPU) runs
    the Triton generator's forward, which Triton compiles for the device at hand."""
    return device.type == "cuda" and _capability(torch.cuda.current_device() if device.index is None else device.index) == (9, 0)


@functools.lru_cache(maxsize=None)
def _capability(index: int) -> tuple[int, int]:
    """A GPU's compute capability, asked once (every call of a kernel asks which generator's kernels can run)."""
    return torch.cuda.get_device_capability(index)


def _backend(backend: str | Backend | None) -> Backend | None:
    if backend is None or isinstance(backend, Backend):
        return backend
    try:
        return Backend(backend)
    except ValueError:
        raise InputError(f"backend must be one of {', '.join(b.value for b in Backend)}; got {backend!r}") from None
