"""Hugging Face transformers models on attngen kernels: an `attn_implementation` backed by compiled specs.

    import attngen.hf
    attngen.hf.register("attngen")     # specs chosen and compiled per call configuration
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="attngen")

`register` adds two functions under the name: an attention function to transformers' `AttentionInterface`
(what every attention layer calls) and a mask function to its `AttentionMaskInterface` (what the model calls
once per forward to build the mask its layers share). The mask function does not materialize a mask: it
recognizes the pattern transformers asks for and hands the layers a `Mask` (the padding as a (B, kv_len) bool
tensor, the ids of packed sequences as a (B, N) int32 tensor, the sliding window as a number). The attention
function then compiles (once per configuration) a spec with exactly that pattern:

    mask  = causal, aligned to the last query (q_idx + kv_len - q_len >= kv_idx; plain q_idx >= kv_idx when
            q_len == kv_len), [and within the sliding window], [and attention_mask[b, kv_idx] for padding],
            [and sequence[b, q_idx] == sequence[b, kv_idx] for packed sequences]
    score = [softcap * tanh(score / softcap)]      scale = the layer's `scaling`      dropout = [the layer's]
    sink  = [sinks[h], the layer's attention sinks (gpt-oss's s_aux), as `input sinks: fp32[H]`]

Anything else a model asks for (a non-causal or chunked mask, extra mask functions, a 4-D mask built
elsewhere, a static cache, position biases, returning the attention weights) is an
`UnsupportedAttention` error naming it; nothing falls back silently to another implementation.
"""
from __future__ import annotations

import inspect
import math
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from .errors import AttngenError
from .lang.spec import Spec
from .runtime.dtypes import SPEC_FLOAT_DTYPES

if TYPE_CHECKING:
    from .runtime import Kernel

try:
    from transformers import AttentionInterface, masking_utils
    from transformers.masking_utils import AttentionMaskInterface
except ImportError as err:
    raise ImportError("attngen.hf needs transformers >= 4.53 (its AttentionMaskInterface): pip install 'attngen[hf]'") from err

__all__ = ["register", "Mask", "AttentionFunction", "UnsupportedAttention", "PADDING_INPUT"]

# The input a user's spec declares (`input attention_mask: bool[B, N]`) to receive the model's padding mask.
PADDING_INPUT = "attention_mask"
# The input of packed sequences' ids in the specs register() compiles without a user spec.
SEQUENCE_INPUT = "sequence"
# The input of a layer's attention sinks (s_aux) in those specs.
SINK_INPUT = "sinks"

# transformers' own implementations, which register() must not replace
_BUILTIN = {"eager"} | set(AttentionInterface._global_mapping) | set(AttentionMaskInterface._global_mapping)


class UnsupportedAttention(AttngenError, NotImplementedError):
    """The model asks for attention that attngen.hf cannot run (the message says what)."""


@dataclass(frozen=True, eq=False)
class Mask:
    """The mask attngen's mask function gives a model's attention layers in place of a dense one: causal
    attention with the queries aligned to the last keys, restricted to `window` keys per query (the query's
    own included; None: no window), to the keys where `keep` (bool, (B, kv_len), True for real tokens) is True
    (None: no padding), and to pairs in one packed sequence, `sequence` ((B, N) int32 ids, queries and keys
    being the same N tokens; None: one sequence per row)."""

    keep: torch.Tensor | None
    window: int | None
    sequence: torch.Tensor | None = None


# The mask functions transformers builds (masking_utils) arrive as closures: causal_mask_function for full layers,
# sliding_window_causal_mask_function(W) = and_masks(sliding_window_overlay(W), causal_mask_function) for sliding
# ones, and for packed sequences (position_ids restarting within a row, no padding mask) one of these, its positions
# remapped to each sequence's own (remap_positions_for_packed_sequence, in recent transformers), and-ed with
# packed_sequence_mask_function(ids). Their code objects identify them; their closures hold the window and the ids.
# (Remapping changes nothing here: within a sequence, positions step by one as the indices do.)
def _code(make, *args):
    """The code object of the closures masking_utils' `make` returns (None where this transformers has no `make`)."""
    return None if make is None else make(*args).__code__


_AND_MASKS = _code(masking_utils.and_masks, masking_utils.causal_mask_function)
_OR_MASKS = _code(masking_utils.or_masks, masking_utils.causal_mask_function)
_WINDOW = _code(masking_utils.sliding_window_overlay, 1)
_PACKED = _code(getattr(masking_utils, "packed_sequence_mask_function", None), None)
_REMAPPED = _code(getattr(masking_utils, "remap_positions_for_packed_sequence", None), None, None)


def _is(fn, code) -> bool:
    return code is not None and getattr(fn, "__code__", None) is code


def _closure(fn) -> dict:
    return inspect.getclosurevars(fn).nonlocals


def _describe(mask_function) -> str:
    """A mask function as transformers composed it, e.g. and_masks(sliding_window_overlay, causal_mask_function)."""
    if _is(mask_function, _AND_MASKS) or _is(mask_function, _OR_MASKS):
        parts = ", ".join(_describe(f) for f in _closure(mask_function)["mask_functions"])
        return f"{'and' if _is(mask_function, _AND_MASKS) else 'or'}_masks({parts})"
    return getattr(mask_function, "__qualname__", repr(mask_function)).split(".<locals>")[0]


def _window(mask_function) -> int | None:
    """The window of causal_mask_function (None) or sliding_window_causal_mask_function(W) (W); ValueError for any
    other function."""
    if mask_function is masking_utils.causal_mask_function:
        return None
    parts = _closure(mask_function)["mask_functions"] if _is(mask_function, _AND_MASKS) else ()
    if len(parts) == 2 and parts[1] is masking_utils.causal_mask_function and _is(parts[0], _WINDOW):
        return _closure(parts[0])["sliding_window"]
    raise ValueError(mask_function)


def _pattern(mask_function) -> tuple[int | None, torch.Tensor | None]:
    """(the sliding window, the packed sequences' ids) of a mask function transformers built; UnsupportedAttention
    for any other pattern."""
    parts = _closure(mask_function)["mask_functions"] if _is(mask_function, _AND_MASKS) else ()
    try:
        if len(parts) == 2 and _is(parts[1], _PACKED):
            causal = _closure(parts[0])["mask_function"] if _is(parts[0], _REMAPPED) else parts[0]
            return _window(causal), _closure(parts[1])["packed_sequence_mask"]
        return _window(mask_function), None
    except ValueError:
        pass
    if mask_function is getattr(masking_utils, "bidirectional_mask_function", None):  # not in transformers 4.x
        raise UnsupportedAttention("attngen.hf runs causal attention; this model asks for a bidirectional (non-causal) mask")
    raise UnsupportedAttention(
        f"attngen.hf runs causal and sliding-window causal masks, with padding or packed sequences; this model asks for "
        f"another pattern: {_describe(mask_function)} (e.g. chunked attention, or an extra and/or mask function)")


def _mask(batch_size: int, kv_length: int, kv_offset: int = 0, mask_function=masking_utils.causal_mask_function,
          attention_mask: torch.Tensor | None = None, q_length: int | None = None, q_offset: int = 0,
          cache_position: torch.Tensor | None = None, **kwargs) -> Mask:
    """transformers' mask interface for attngen's name: the Mask of this pattern (see Mask). The queries are
    `q_length` tokens from position `q_offset` (older transformers pass their positions, `cache_position`), the
    keys `kv_length` tokens from `kv_offset`; `attention_mask` is the model's 2-D padding mask over every key
    seen so far (bool), or None."""
    window, sequence = _pattern(mask_function)
    if cache_position is not None:
        q_length, q_offset = cache_position.shape[0], int(cache_position[0])
    if isinstance(q_offset, torch.Tensor):
        raise UnsupportedAttention("attngen.hf does not run with a static cache (its queries' positions are a runtime "
                                   "tensor); use the default dynamic cache")
    if q_offset - kv_offset != kv_length - q_length:
        raise UnsupportedAttention(f"attngen.hf aligns the queries to the last keys; this cache places {q_length} queries "
                                   f"at position {q_offset} and {kv_length} keys at {kv_offset}")
    keep = None
    if attention_mask is not None:
        keep = attention_mask[:, kv_offset:kv_offset + kv_length].bool()
        if keep.shape[1] < kv_length:  # keys past the mask's end count as padding, as in transformers' own masks
            keep = torch.nn.functional.pad(keep, (0, kv_length - keep.shape[1]), value=False)
        if keep.all():
            keep = None
    if sequence is not None:  # ids count the sequences of a row from 0: all 0 is one sequence per row
        sequence = sequence.int() if sequence[:, -1].any() else None
    return Mask(keep, window, sequence)


@dataclass(frozen=True)
class _Config:
    """Everything a compiled kernel depends on in a call."""

    head_dim: int
    dtype: str
    scale: float | None  # None: 1/sqrt(head_dim)
    aligned: bool  # q_len == kv_len: top-left causal, which the kernels run without NaN guards
    window: int | None
    softcap: float | None
    padding: bool
    packed: bool
    dropout: float
    sinks: bool = False  # a learned sink per head (gpt-oss's s_aux): input sinks: fp32[H]
    value_dim: int | None = None  # V's head dimension where it differs from q's and k's (DeepSeek-V3: 192 / 128)

    def spec_text(self) -> str:
        name = "_".join(["hf", "causal"] + [part for part, on in (
            (f"window{self.window}", self.window), ("softcap", self.softcap), ("padding", self.padding), ("packed", self.packed),
            ("dropout", self.dropout), ("sinks", self.sinks), (f"dv{self.value_dim}", self.value_dim)) if on])
        query = "q_idx" if self.aligned else "(q_idx + kv_len - q_len)"
        mask = [f"{query} >= kv_idx"]
        if self.window is not None:
            mask.append(f"{query} - kv_idx < {self.window}")
        lines = [f"head_dim = {self.head_dim}", f"dtype = {self.dtype}", f"scale = {'auto' if self.scale is None else repr(self.scale)}"]
        if self.value_dim is not None:
            lines.insert(1, f"value_dim = {self.value_dim}")
        if self.padding:
            lines.append(f"input {PADDING_INPUT}: bool[B, N]")
            mask.append(f"{PADDING_INPUT}[b, kv_idx]")
        if self.packed:
            lines.append(f"input {SEQUENCE_INPUT}: int32[B, N]")
            mask.append(f"{SEQUENCE_INPUT}[b, q_idx] == {SEQUENCE_INPUT}[b, kv_idx]")
        lines.append(f"mask = {' and '.join(mask)}")
        if self.softcap is not None:
            lines.append(f"score = {self.softcap!r} * tanh(score / {self.softcap!r})")
        if self.dropout:
            lines.append(f"dropout = {self.dropout!r}")
        if self.sinks:
            lines += [f"input {SINK_INPUT}: fp32[H]", f"sink = {SINK_INPUT}[h]"]
        return f"attention {name} {{\n" + "".join(f"    {line}\n" for line in lines) + "}\n"


class AttentionFunction:
    """The attention function register() adds to transformers: fn(module, query, key, value, attention_mask,
    scaling=None, dropout=0.0, **kwargs) -> (output (B, N, H, D), None), with query (B, H, N, D) and key, value
    (B, H_kv, N_kv, D) (grouped-query attention runs as such: no repeated heads).

    Without a spec, `kernels` holds the kernel compiled for each configuration seen (head_dim, dtype, scaling,
    window, softcap, padding, packed sequences, dropout): `fn.kernels[...].source` is its generated code."""

    def __init__(self, spec: Spec | str | os.PathLike | None = None, target: str | None = None):
        self.target = target
        self.kernel = None if spec is None else _user_kernel(spec, target)
        self.kernels: dict[_Config, Kernel] = {}

    def __repr__(self) -> str:
        what = f"spec {self.kernel.spec.name!r}" if self.kernel is not None else f"{len(self.kernels)} configuration(s) compiled"
        return f"<attngen.hf.AttentionFunction {what}>"

    def __call__(self, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                 attention_mask, scaling: float | None = None, dropout: float = 0.0, **kwargs) -> tuple[torch.Tensor, None]:
        _refuse(kwargs)
        if isinstance(attention_mask, Mask):
            keep, window, sequence = attention_mask.keep, attention_mask.window, attention_mask.sequence
            asked = kwargs.get("sliding_window")
            if asked is not None and asked != window:
                raise UnsupportedAttention(f"the layer asks for a sliding window of {asked} tokens, but the model's mask has "
                                           f"{'none' if window is None else window}")
        elif attention_mask is None:  # no mask built (the model's mask function did not run): causal, window from the layer
            causal = kwargs.get("is_causal")
            if not (getattr(module, "is_causal", True) if causal is None else causal):
                raise UnsupportedAttention("attngen.hf runs causal attention; this layer is not causal (is_causal=False)")
            keep, window, sequence = None, kwargs.get("sliding_window"), None
        else:
            raise UnsupportedAttention(
                f"attngen.hf takes the masks of its own mask function (a {Mask.__module__}.Mask); this layer got a "
                f"{type(attention_mask).__name__}{' of shape ' + str(tuple(attention_mask.shape)) if hasattr(attention_mask, 'shape') else ''}: "
                f"a prepared mask (e.g. a 4-D mask passed to the model) is not supported; pass the 2-D padding mask")
        p = float(dropout) if module.training else 0.0  # as transformers' eager attention: dropout only in training
        softcap = kwargs.get("softcap")
        sinks = kwargs.get("s_aux")  # gpt-oss: a learned logit per query head joins every row's softmax
        if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (query.shape[1],)):
            raise UnsupportedAttention(f"attngen.hf takes attention sinks (s_aux) as one value per query head, ({query.shape[1]},); "
                                       f"this layer passes {tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}")
        if self.kernel is not None:
            kernel = self.kernel
            _check_user_spec(kernel.spec, scaling, window, softcap, keep is not None, sequence is not None, sinks is not None)
            if keep is None and PADDING_INPUT in kernel.spec.inputs_by_name:  # no padding: every key is a token
                keep = torch.ones(key.shape[0], key.shape[2], dtype=torch.bool, device=key.device)
        else:
            kernel = self._kernel(self._config(query, key, value, scaling, window, softcap, keep is not None, sequence is not None, p,
                                               sinks is not None))
        inputs = {name: t for name, t in ((PADDING_INPUT, keep), (SEQUENCE_INPUT, sequence)) if t is not None}
        if sinks is not None:  # in float32, as the spec declares them (the cast passes the gradient on to the model's)
            inputs[SINK_INPUT] = sinks.float()
        out = kernel(query, key, value, dropout_p=p, **inputs)
        return out.transpose(1, 2).contiguous(), None

    def _config(self, query, key, value, scaling, window, softcap, padding: bool, packed: bool, dropout: float, sinks: bool) -> _Config:
        head_dim, value_dim = query.shape[-1], value.shape[-1]
        if key.shape[-1] != head_dim:
            raise UnsupportedAttention(f"attngen runs attention whose queries and keys have one head dimension; got {head_dim} and {key.shape[-1]}")
        for what, d in (("head dimensions", head_dim), ("value head dimensions", value_dim)):
            if not 16 <= d <= 256:
                raise UnsupportedAttention(f"attngen runs {what} 16..256; this model's is {d}")
        if query.dtype not in SPEC_FLOAT_DTYPES:
            raise UnsupportedAttention(f"attngen runs float32, float16 and bfloat16 attention; this model's is {query.dtype}")
        for what, x in (("scaling", scaling), ("softcap", softcap)):
            if x is not None and not (0.0 < float(x) < math.inf):
                raise UnsupportedAttention(f"{what} must be a positive number; this layer passes {x!r}")
        if window is not None and (not isinstance(window, int) or window < 1):
            raise UnsupportedAttention(f"a sliding window must be a positive number of tokens; this model's is {window!r}")
        return _Config(head_dim, SPEC_FLOAT_DTYPES[query.dtype], None if scaling is None else float(scaling), query.shape[2] == key.shape[2],
                       window, None if softcap is None else float(softcap), padding, packed, dropout, sinks,
                       None if value_dim == head_dim else value_dim)

    def _kernel(self, config: _Config) -> Kernel:
        kernel = self.kernels.get(config)
        if kernel is None:
            from .api import compile

            kernel = self.kernels[config] = compile(config.spec_text(), self.target)
        return kernel


def _refuse(kwargs: dict) -> None:
    """The keyword arguments of transformers' attention calls that would change the result and that attngen cannot honour."""
    if kwargs.get("output_attentions"):
        raise UnsupportedAttention("attngen never materializes the attention weights: output_attentions=True is not supported "
                                   "(use attn_implementation='eager' to inspect them)")
    if kwargs.get("position_bias") is not None:
        raise UnsupportedAttention("attngen.hf does not support a position bias tensor")


def _user_kernel(spec: Spec | str | os.PathLike, target: str | None) -> Kernel:
    """A user's spec as the whole attention of every layer: checked for what a transformers model can supply."""
    from .api import compile

    kernel = compile(spec, target)
    other = [d.name for d in kernel.spec.inputs if d.name != PADDING_INPUT]
    if other:
        raise UnsupportedAttention(f"the spec {kernel.spec.name!r} declares input(s) {', '.join(other)}, which a transformers model "
                                   f"cannot supply (only `input {PADDING_INPUT}: bool[B, N]`, the padding mask)")
    padding = kernel.spec.inputs_by_name.get(PADDING_INPUT)
    if padding is not None and (padding.dtype != "bool" or len(padding.dims) != 2):
        raise UnsupportedAttention(f"the spec {kernel.spec.name!r} declares {PADDING_INPUT!r} as {padding.dtype}{list(padding.dims)}; the "
                                   f"padding mask is bool[B, N] (True for the tokens)")
    if kernel.spec.sparsity == "runtime":
        raise UnsupportedAttention(f"the spec {kernel.spec.name!r} has sparsity = runtime, whose block_mask a transformers model cannot supply")
    return kernel


def _check_user_spec(spec: Spec, scaling, window, softcap, padding: bool, packed: bool, sinks: bool = False) -> None:
    """A user's spec replaces the model's mask and score; what the model asks for beyond them must not be lost."""
    if scaling is not None and not math.isclose(spec.softmax_scale, scaling, rel_tol=1e-9):
        raise UnsupportedAttention(f"the layer scales scores by {scaling!r}, the spec {spec.name!r} by {spec.softmax_scale!r}: set "
                                   f"`scale = {scaling!r}` in the spec")
    if window is not None:
        raise UnsupportedAttention(f"the layer asks for a sliding window of {window} tokens, which the spec {spec.name!r} cannot be "
                                   f"checked to apply; use register() without a spec")
    if softcap is not None:
        raise UnsupportedAttention(f"the layer asks for softcap={softcap!r}, which the spec {spec.name!r} cannot be checked to "
                                   f"apply; use register() without a spec")
    if packed:
        raise UnsupportedAttention(f"the batch packs several sequences per row (position_ids restart), which the spec "
                                   f"{spec.name!r} cannot be checked to keep apart; use register() without a spec")
    if sinks:
        raise UnsupportedAttention(f"the layer has attention sinks (s_aux), which the spec {spec.name!r} cannot be checked to apply; "
                                   f"use register() without a spec")
    if padding and PADDING_INPUT not in spec.inputs_by_name:
        raise UnsupportedAttention(f"the model's inputs are padded, but the spec {spec.name!r} does not declare "
                                   f"`input {PADDING_INPUT}: bool[B, N]` to receive the padding mask")


def register(name: str, spec: Spec | str | os.PathLike | None = None, *, target: str | None = None) -> AttentionFunction:
    """Register attngen under `name` with transformers (its AttentionInterface and AttentionMaskInterface), so that
    `from_pretrained(..., attn_implementation=name)` or `from_config(cfg, attn_implementation=name)` runs every
    attention layer of the model through attngen kernels, forward and backward.

    Without `spec`, each call configuration compiles its own spec (see the module's docstring): causal, padding
    from the model's attention_mask, packed sequences, the layer's sliding window, softcap, scaling, and dropout
    in training (as transformers' eager attention: the layer's dropout applies only while module.training). With
    `spec` (a path, spec text or Spec), that spec is the attention of every layer: its mask and score replace the
    model's causal mask; it receives the padding mask if it declares `input attention_mask: bool[B, N]` (a padded
    call is an error otherwise), and a layer asking for a sliding window, softcap or another scale, or a batch of
    packed sequences, is an error.
    `target` is passed to attngen.compile (None: the spec's own, auto by default). Registering a name again
    replaces its functions; transformers' own names (eager, sdpa, flash_attention_2, ...) are refused.
    Returns the attention function (its `kernels` show what was compiled)."""
    if not isinstance(name, str) or not name:
        raise ValueError(f"name must be a non-empty string, got {name!r}")
    if name in _BUILTIN:
        raise ValueError(f"{name!r} is one of transformers' own attention implementations; choose another name")
    fn = AttentionFunction(spec, target)
    AttentionInterface.register(name, fn)
    AttentionMaskInterface.register(name, _mask)
    return fn
