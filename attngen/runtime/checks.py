"""The checks of a call against its spec: the tensors' shapes, element types and devices, the declared inputs,
dropout's arguments and a runtime block mask; an InputError names what the spec expected. A call's sizes are
a Dims."""
from __future__ import annotations

from typing import NamedTuple

import torch

from ..errors import InputError
from ..lang.expr import input_reads
from ..lang.ranges import MAX_EXTENT
from ..lang.spec import Spec, Var
from ..plan.planner import effective_mask
from .dtypes import TORCH_DTYPES


class Dims(NamedTuple):
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


def dims_of(q: torch.Tensor, k: torch.Tensor, varlen=None) -> Dims:
    """The call's sizes; with packed sequences (q, k as (1, H, total rows, D) views, varlen = (cu_seqlens_q,
    cu_seqlens_k, max_seqlen_q, max_seqlen_k)): the number of sequences and the longest lengths."""
    if varlen is not None:
        return Dims(varlen[0].numel() - 1, q.shape[1], k.shape[1], varlen[2], varlen[3])
    return Dims(q.shape[0], q.shape[1], k.shape[1], q.shape[2], k.shape[2])


def direct_indices(spec: Spec) -> list[tuple[str, int, str]]:
    """(input, axis, variable) for every input dimension the spec indexes with a bare b, h, q_idx or kv_idx."""
    found = []
    for e in input_reads(effective_mask(spec), spec.score):
        for axis, idx in enumerate(e.indices):
            if isinstance(idx, Var) and idx.name in ("b", "h", "q_idx", "kv_idx") and (e.input, axis, idx.name) not in found:
                found.append((e.input, axis, idx.name))
    return found


def check_heads(Hq: int, Hkv: int) -> None:
    """A call's heads (check_all's check, and the reference's): at least one each, Hq a multiple of Hkv."""
    if Hq == 0 or Hkv == 0:
        raise InputError(f"q has {Hq} heads and k, v have {Hkv}: each needs at least one head")
    if Hq % Hkv:
        raise InputError(f"query heads ({Hq}) must be a multiple of key/value heads ({Hkv})")


def check_input_names(spec, inputs: dict, extra: frozenset = frozenset()) -> None:
    """A call's declared inputs by name (check_all's check, and the reference's): none unknown (but `extra`),
    none missing."""
    declared = [d.name for d in spec.inputs]
    unknown = sorted(set(inputs) - set(declared) - extra)
    if unknown:
        raise InputError(f"unexpected argument(s) {', '.join(unknown)}; {spec.name!r} declares inputs: {', '.join(declared) or 'none'}")
    for decl in spec.inputs:
        if decl.name not in inputs:
            raise InputError(f"missing input {decl.name!r} (declared `input {decl.name}: {decl.dtype}[{', '.join(map(str, decl.dims))}]`)")


def check_call(kernel, q, k, v, inputs: dict) -> tuple[Dims, list[torch.Tensor]]:
    """The call's sizes and its declared inputs in order; an InputError for anything the spec does not allow.
    (The device is checked where the work starts, Kernel._forward_impl: torch.compile cannot trace that check.)
    What the checks read is each tensor's shape, element type and device and the inputs' names, so a call
    alike in those to one that passed skips them (a third of the checks' host time). Not while torch.compile
    traces the call: it runs the checks once per graph, and the memo would only add guards."""
    if torch.compiler.is_compiling():
        return check_all(kernel, q, k, v, inputs)
    try:
        key = (q.shape, k.shape, v.shape, q.dtype, k.dtype, v.dtype, q.device, k.device, v.device,
               *[(name, t.shape, t.dtype, t.device) for name, t in inputs.items()])
    except AttributeError:  # not tensors: the checks below say which
        key = None
    dims = kernel._passed.get(key)
    if dims is not None:
        return dims, [inputs[d.name] for d in kernel.spec.inputs]
    dims, ordered = check_all(kernel, q, k, v, inputs)
    if key is not None:
        if len(kernel._passed) >= 256:  # many shapes (lengths varying call by call): start again
            kernel._passed.clear()
        kernel._passed[key] = dims
    return dims, ordered


def check_all(kernel, q, k, v, inputs: dict, varlen=None, paged_kv: tuple[int, int] | None = None) -> tuple[Dims, list[torch.Tensor]]:
    """check_call's checks. With packed sequences (varlen), q, k, v are (1, H, total rows, D) views and the batch
    and lengths the expressions and inputs see are the number of sequences and the longest ones. paged_kv =
    (key/value heads, keys per sequence): k and v are pages of a cache (checked by the caller)."""
    spec = kernel.spec
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise InputError(f"{name} must be 4-D (batch, heads, tokens, head_dim), got shape {tuple(t.shape)}")
        if name == "v" and t.shape[-1] != spec.dv:
            raise InputError(f"v has {t.shape[-1]} columns, the spec says value_dim = {spec.dv}" if spec.value_dim is not None else
                             f"v has head_dim {t.shape[-1]}, the spec says {spec.head_dim} (a spec with `value_dim = N` takes V of N columns)")
        if name != "v" and t.shape[-1] != spec.head_dim:
            raise InputError(f"{name} has head_dim {t.shape[-1]}, the spec says {spec.head_dim}")
        setting = spec.kv_dtype if name != "q" and spec.kv_dtype is not None else spec.dtype
        want = TORCH_DTYPES[setting.value]
        if t.dtype != want:
            key = "dtype" if setting is spec.dtype else "kv_dtype"
            raise InputError(f"{name} is {t.dtype}, the spec {spec.name!r} says {key} = {setting.value} ({want})")
        if t.device != q.device:
            raise InputError(f"q, k, v must be on one device; {name} is on {t.device}, q on {q.device}")
    B, Hq, Nq, _ = q.shape
    if k.shape[:3] != v.shape[:3]:
        raise InputError(f"k and v must have the same batch, heads and tokens, got {tuple(k.shape)} and {tuple(v.shape)}")
    if paged_kv is not None:
        Hkv, Nk = paged_kv
    elif k.shape[0] != B:
        raise InputError(f"q has batch {B}, k and v have {k.shape[0]}")
    else:
        Hkv, Nk = k.shape[1], k.shape[2]
    check_heads(Hq, Hkv)
    for what, n in (("batch size", B), ("number of query heads", Hq), ("query length", Nq), ("key length", Nk)):
        if n >= MAX_EXTENT:  # the integer analysis of the spec's expressions (lang/ranges.py) assumes less
            raise InputError(f"the {what} is {n}; attngen supports at most {MAX_EXTENT - 1} (2**30 - 1)")
    dims = dims_of(q, k, varlen) if paged_kv is None else Dims(B, Hq, Hkv, Nq, Nk)

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
    check_direct_indices(kernel._direct_indices, dims, dict(zip(declared, ordered)))
    return dims, ordered


def check_direct_indices(direct: list[tuple[str, int, str]], dims: Dims, tensors: dict[str, torch.Tensor]) -> None:
    """An input dimension indexed directly by q_idx (kv_idx, b, h) must cover every value it takes."""
    limits = {"q_idx": ("q_len", dims.q_len), "kv_idx": ("kv_len", dims.kv_len), "b": ("batch", dims.batch), "h": ("query heads", dims.heads)}
    for name, axis, var in direct:
        what, n = limits[var]
        size = tensors[name].shape[axis]
        if size < n:
            raise InputError(f"input {name!r} is indexed by {var} on dimension {axis}, which has size {size}; {var} goes up to {n - 1} ({what} = {n})")


def check_block_mask(spec: Spec, block_mask) -> None:
    if spec.sparsity != "runtime" and block_mask is not None:
        raise InputError(f"block_mask given, but the spec {spec.name!r} does not say `sparsity = runtime`")
    if spec.sparsity == "runtime" and block_mask is None:
        raise InputError(f"the spec {spec.name!r} has sparsity = runtime: pass block_mask= (bool, (B or 1, H or 1, "
                         f"ceil(Nq / {spec.sparse_block}), ceil(Nk / {spec.sparse_block}))), e.g. from attngen.block_mask_from")


def dropout_args(spec: Spec, dropout_p: float | None, seed, device: torch.device) -> tuple[float, torch.Tensor | None]:
    """(the dropout probability, the seed as a one-element int64 tensor on `device`, which the kernels read
    there); (0.0, None) for a spec without dropout. `seed`: an int (the pattern is fixed; captured in a CUDA
    graph, every replay draws it), a one-element int64 tensor (read at each launch: a CUDA graph replays with
    its value then), or None: drawn on `device` from torch's generator, a tensor op that torch.compile records
    and that CUDA graphs replay with a fresh value, so each step draws a new pattern."""
    if spec.dropout == 0.0:
        if dropout_p:
            raise InputError(f"dropout_p={dropout_p}, but the spec {spec.name!r} has no dropout: set `dropout = p` in "
                             f"the spec (the dropout path is compiled only then)")
        return 0.0, None
    p = spec.dropout if dropout_p is None else dropout_p
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
