"""render(plan) -> Triton source text, from the Jinja templates in templates/triton/.

Templates receive only plan values (ints, enums, floats printed with repr) and code fragments lowered by
attngen/codegen/expr.py; no spec text reaches them.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from ...lang import expr as ex
from ...lang.canonical import format_spec
from ...lang.spec import DType, Expr, KVLayout, LoopOrder
from ...plan.planner import KernelPlan
from .. import Templates, versions
from ..expr import HELPERS
from ..lowering import lower_for_kernel, lower_sink
from ..tiles import lower_tile_class

LOG2E = 1.4426950408889634
TEMPLATES = Templates("triton", "module.py.jinja")


@dataclass(frozen=True)
class _Input:
    name: str
    ndim: int


def context(plan: KernelPlan) -> dict:
    """Everything the templates see."""
    spec = plan.spec
    helpers: set[str] = set()
    q_outer = plan.loop_order is LoopOrder.Q_OUTER
    pos = plan.global_positions
    # with a static block pattern's lists (KernelPlan.block_lists) the training kernels visit kept blocks only, where the
    # pattern keeps every pair: they see the spec's own mask; the decode kernels, which walk no lists, see both
    train = dataclasses.replace(plan, mask=spec.mask) if plan.block_lists else plan
    fwd = lower_for_kernel(train, frozenset({"kv_idx", "score"} if q_outer else {"q_idx", "score"}), False, helpers, global_positions=pos)
    dkdv = lower_for_kernel(train, frozenset({"q_idx", "h", "score"}), True, helpers, global_positions=pos)
    dq = lower_for_kernel(train, frozenset({"kv_idx", "score"}), True, helpers, want_read_grads=True, global_positions=pos)
    decode = lower_for_kernel(plan, frozenset({"kv_idx", "score"}), False, helpers)  # h and q_idx: one per row, set once
    sink = lower_sink(plan, "sink_rows", helpers)
    tile_class = None
    if train.mask is not None and plan.classify:
        scope = ex.Scope("mask", ex.MASK_VARS, spec.inputs_by_name)
        tile_class = lower_tile_class(train.mask, scope)
        if tile_class is not None:
            helpers |= tile_class.helpers
    # plain training calls (nothing but q, k, v and the inputs) keep their launches' arguments by call signature and
    # replay them (attngen.runtime.launch.Recipe); calls whose launchers make tensors of their own (TMA copies, the
    # inputs' pre-pass summaries, dropout seeds, FP8 copies) or take block lists decide again at every call
    lists = spec.sparsity == "runtime" or plan.block_lists
    recorded = not (plan.tma or spec.dropout > 0.0 or lists or plan.dtype is DType.FP8
                    or (tile_class is not None and bool(tile_class.bounds)))
    return {
        "name": spec.name,
        "spec_hash": plan.spec_hash,
        "spec_lines": format_spec(spec).splitlines(),
        "versions": versions(),
        "target": plan.target,
        "plan": plan,
        "loop_order": plan.loop_order.value,
        "scale": repr(float(plan.scale)),
        "qk_scale_log2": repr(float(plan.scale) * LOG2E),
        "has_mask": train.mask is not None,
        "classify": plan.classify,
        "has_score": plan.score is not None,
        "sink": sink,  # the sink's code (SinkCode), or None
        "has_dropout": plan.spec.dropout > 0.0,
        # the kernels walk lists of kept blocks (blocks=): runtime block sparsity's, or a static pattern's
        "block_lists": lists,
        "pattern_lists": plan.block_lists,
        "guard_rows": plan.may_mask_rows,
        "positions": plan.global_positions,
        "fp8": plan.dtype is DType.FP8,
        "kv_fp8": spec.kv_dtype is DType.FP8,
        "kv_up": ".to(q.dtype)" if spec.kv_dtype is DType.FP8 else "",  # FP8 caches: read as e4m3, widened for the products
        # what a shard's kernels add to the row and key indices to make them positions in the whole sequence
        "q_pos": " + q_offset" if plan.global_positions else "",
        "kv_pos": " + kv_offset" if plan.global_positions else "",
        "pad_d": plan.head_dim_pad != plan.head_dim,
        # the training kernels take q.k in two products (q_lead / q_tail ...): KernelPlan.head_tail
        "head_split": plan.head_tail > 0,
        "head_tail_padded": plan.head_tail_pad != plan.head_tail,
        # V and O have value_dim columns of their own (offs_dv, VALUE_DIM): the templates say so only then
        "split_v": plan.value_dim != plan.head_dim,
        "pad_dv": plan.value_dim_pad != plan.value_dim,
        "odv": "offs_dv" if plan.value_dim != plan.head_dim else "offs_d",  # the column offsets of V, O, dO and dV tiles
        "dv_pad": "VALUE_DIM_PAD" if plan.value_dim != plan.head_dim else "HEAD_DIM_PAD",
        "tma": plan.tma,
        "recorded": recorded,
        "bwd_recorded": recorded and not dq.read_grads,  # (the terms of input gradients: buffers made per call)
        "warp_specialize": plan.warp_specialize,
        # float32 specs ask for exact float32 products: Triton's default for fp32 dots is TF32 on the GPU.
        "dot_args": ', input_precision="ieee"' if plan.dtype is DType.FP32 else "",
        "inputs": [_Input(i.name, len(i.dims)) for i in spec.inputs],
        "helpers": [HELPERS[h] for h in sorted(helpers)],
        "fwd": fwd,
        "dkdv": dkdv,
        "dq": dq,
        "tile_class": tile_class,
        # a block pattern leaves holes (empty tiles) inside the range of tiles a row visits: the loops skip them
        # (not where they walk its lists)
        "skip_holes": tile_class is not None and isinstance(spec.sparsity, Expr) and not plan.block_lists,
        "decode_code": decode,
        # runtime block masks are not read by the decode kernels
        "has_decode": spec.sparsity != "runtime",
        "paged": spec.kv_layout is KVLayout.PAGED,
        "k_tail": plan.decode_tail > 0,  # the decode kernels read K in two parts (head_dim above 256: MLA)
        "page_size": spec.page_size,
        # whether the tile classes may differ between query heads: then a decode program takes the union over its heads
        "mask_uses_h": plan.mask is not None and "h" in ex.variables(plan.mask),
        # the input pre-pass summarizes chunks of the smallest tile size; the largest tile spans tile_span chunks
        "tile_chunk": plan.tile_limits[0],
        "tile_span": plan.tile_limits[1] // plan.tile_limits[0],
    }


def build_source(plan: KernelPlan) -> tuple[str, str]:
    """(cache key, generated source) of a plan. The key covers the spec, the plan, the templates and the
    attngen/triton/torch versions."""
    from ...cache import cache_key

    source = render(plan)
    ver = versions()
    key = cache_key(format_spec(plan.spec), repr(plan), TEMPLATES.digest(), ver["attngen"], ver["triton"], ver["torch"])
    return key, source


def build_dropout_source() -> tuple[str, str]:
    """(cache key, source) of the module behind attngen.dropout_mask: the keep pattern alone."""
    from ...cache import cache_key

    ver = versions()
    source = TEMPLATES.render("dropout_module.py.jinja", {"versions": ver})
    return cache_key("dropout", TEMPLATES.digest(), ver["attngen"], ver["triton"], ver["torch"]), source


def render(plan: KernelPlan) -> str:
    """The generated module's source text."""
    return TEMPLATES.render("module.py.jinja", context(plan))

