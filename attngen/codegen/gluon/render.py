"""render(gluon plan) -> the source of a Gluon module (the forward with FlashAttention-3's schedule), from the
templates in templates/gluon/. The expressions are codegen/expr.py's, lowered for the Triton generator's q-outer forward
(the same fragments), their names translated by lower.py."""
from __future__ import annotations

from dataclasses import dataclass

from ...lang import expr as ex
from ...lang.canonical import format_spec
from ...lang.spec import DType
from .. import Templates, versions
from ..lowering import BiasCode, KernelCode, SinkCode, bias_of, key_part_affine, lower_bias, lower_for_kernel, lower_sink
from ..tiles import lower_tile_class
from .lower import helpers as gluon_helpers
from .lower import translate
from .plan import M_PER_WARPGROUP, GluonPlan, entry_regs

LOG2E = 1.4426950408889634
# The input pre-pass's chunk for the Gluon kernels' tiles (64 or 128 indices, starting at multiples of 64 outside a
# context-parallel shard): a tile covers at most TILE_SPAN chunks (a shard's may cover more: then unknown, partial)
TILE_CHUNK = 64
TILE_SPAN = 2
TEMPLATES = Templates("gluon", "module.py.jinja")


@dataclass(frozen=True)
class _Input:
    name: str
    dtype: str
    ndim: int


def context(gp: GluonPlan) -> dict:
    """Everything the template sees. Raises lower.Untranslatable for code with no Gluon counterpart."""
    plan = gp.base
    spec = plan.spec
    names = [i.name for i in spec.inputs]
    helpers: set[str] = set()
    pos = plan.global_positions  # a context-parallel shard's kernels: the expressions see the whole sequence's lengths
    # a score modification that is a separable bias (lang.analysis.separable_bias) is added as one: its key part per key, its
    # row part in the log-sum-exp (the forward's epilogue and the backward's pre-pass); the other lowerings then
    # carry the mask alone
    bias = None
    if bias_of(plan) is not None:
        def part(kind: str, rows: str, ref: str, inner_vars: frozenset[str], prefix: str) -> BiasCode:
            low = lower_bias(plan, kind, rows, ref, inner_vars, helpers, prefix)
            return BiasCode([translate(x) for x in low.outer], [translate(x) for x in low.inner], translate(low.code))

        # the forward's key part: an affine one as a tile's first key's value plus a vector of the offsets (the same
        # every tile, made once an item), any other one key by key
        affine = key_part_affine(plan)
        bias = {"fwd_key": None if affine else part("key", "", "q_ref", frozenset({"kv_idx", "score"}), "fbias_"),
                "fwd_tile": part("tile", "j * BLOCK_N", "q_ref", frozenset({"kv_idx", "score"}), "ftile_") if affine else None,
                "fwd_step": part("step", "offs_n", "q_ref", frozenset(), "fstep_") if affine else None,
                "fwd_row": part("row", "offs_m", "q_ref", frozenset(), "frow_"),
                "bwd_key": part("key", "", "q_lo", frozenset({"q_idx", "h", "score"}), "bbias_"),
                "delta_row": part("row", "offs_r", "q_ref", frozenset(), "brow_")}
    fwd = lower_for_kernel(plan, frozenset({"kv_idx", "score"}), False, helpers, global_positions=pos, want_score=bias is None)
    # as the Triton dK/dV kernel's, but with sums of positions converted to float leaf by leaf (codegen.expr.FLOAT_POSITIONS)
    dkdv = lower_for_kernel(plan, frozenset({"q_idx", "h", "score"}), True, helpers, global_positions=pos, positions_leafwise=True,
                            want_score=bias is None)
    sink = lower_sink(plan, "sink_rows", helpers)  # the sink of each of a warpgroup's rows, where its softmax starts
    if sink is not None:
        sink = SinkCode([translate(x) for x in sink.stmts], translate(sink.code))
    tile_class = None
    if plan.mask is not None and plan.classify:
        # inputs read at q_idx or kv_idx are bounded by the pre-pass's chunks, read one by one (the tiles are scalars
        # in most of the kernels): every tile starts at a multiple of TILE_CHUNK and covers at most TILE_SPAN chunks
        tile_class = lower_tile_class(plan.mask, ex.Scope("mask", ex.MASK_VARS, spec.inputs_by_name), span=TILE_SPAN)
        if tile_class is not None:
            helpers |= tile_class.helpers
            tile_class = type(tile_class)([translate(s) for s in tile_class.stmts], translate(tile_class.may_drop),
                                          translate(tile_class.may_keep), tile_class.helpers, tile_class.params, tile_class.bounds)
    class_bits = bool(tile_class and tile_class.bounds) and not gp.class_piece and spec.sparsity != "runtime"
    return {
        "name": spec.name,
        "spec_hash": plan.spec_hash,
        "spec_lines": format_spec(spec).splitlines(),
        "versions": versions(),
        "target": plan.target,
        "plan": plan,
        "gp": gp,
        "m_per_wg": M_PER_WARPGROUP,
        "maxnreg": entry_regs(2),  # the backward's (two consumer warpgroups); the forward's: gp.fwd_maxnreg
        "scale": repr(float(plan.scale)),
        "qk_scale_log2": repr(float(plan.scale) * LOG2E),
        "has_mask": plan.mask is not None,
        "has_score": plan.score is not None and bias is None,  # a score modification lowered per score
        "bias": bias,  # or added as a separable bias: its parts' code
        "bias_mma": gp.bias_mma,  # the forward's affine key part added by the tensor cores
        "bsmem": ", bias_smem" if gp.bias_mma else "",
        "has_dropout": spec.dropout > 0.0,
        "sink": sink,  # the sink's code (SinkCode), or None
        "runtime_sparsity": spec.sparsity == "runtime",  # the kernels walk lists of kept blocks (attngen/runtime/blocks.py)
        "sparse_block": spec.sparse_block,
        "deterministic": spec.deterministic,  # dQ's additions in a fixed order
        "guard_rows": plan.may_mask_rows,
        "positions": pos,
        "fp8": spec.dtype is DType.FP8,
        # V and O have value_dim columns of their own (VALUE_DIM), q.k is over head_dim: the templates say so only then
        "split_v": plan.value_dim != plan.head_dim,
        # q.k over a head_dim that is no power of two (192): Q's and K's tiles in two parts, the tail's width here
        "qk_tail": gp.qk_tail,
        "tdesc": ", qt_desc, kt_desc" if gp.qk_tail else "",  # the tail parts' descriptors and shared memory
        "tsmem": ", qt_smem, kt_smem" if gp.qk_tail else "",
        # O leaves through Q's (first) tile seen as VALUE_DIM columns where it is not that wide
        "o_reinterpret": plan.value_dim != plan.head_dim - gp.qk_tail,
        "vdim": "VALUE_DIM" if plan.value_dim != plan.head_dim else "HEAD_DIM",
        # the columns where a head's V and O start in rows layouts (a multiple of HEAD_DIM in kv_at, q_at)
        "v_col": "kv_at[2] // HEAD_DIM * VALUE_DIM" if plan.value_dim != plan.head_dim else "kv_at[2]",
        "o_col": "q_at[2] // HEAD_DIM * VALUE_DIM" if plan.value_dim != plan.head_dim else "q_at[2]",
        # what a shard's kernels add to the row and key indices to make them positions in the whole sequence
        "q_pos": " + q_offset" if pos else "",
        "kv_pos": " + kv_offset" if pos else "",
        "mask": translate(fwd.mask),
        "score": translate(fwd.score),
        "inner": [translate(s) for s in fwd.inner],
        "outer": [translate(s) for s in fwd.outer],
        "helpers": gluon_helpers(helpers),
        "tile_class": tile_class,
        "tile_chunk": TILE_CHUNK,
        # the pre-pass summaries: (index of the input among the declared ones, axis), in the order of the parameters
        "bounds": [(names.index(bnd.input), bnd.axis, bnd.param) for bnd in tile_class.bounds] if tile_class else [],
        # the backward's tile classes read those summaries (global loads): its partitions keep the classes of a range's
        # first CLASS_BITS tiles as bits (class_bits); with dQ in a fixed order the pre-pass, which classifies every
        # pair to count the ranks, writes each pair's class word and the partitions read it (class_words)
        "class_bits": class_bits,
        "class_words": class_bits and spec.deterministic,
        "skip_empty": gp.skip_empty and tile_class is not None,  # the forward skips the holes of a block pattern
        "persistent": gp.persistent,  # the forward: a program per SM taking work items (plan.py)
        "inputs": [_Input(i.name, i.dtype, len(i.dims)) for i in spec.inputs],
        "dkdv": KernelCode([translate(s) for s in dkdv.outer], [translate(s) for s in dkdv.inner], translate(dkdv.mask),
                           translate(dkdv.score), translate(dkdv.dscore), []),
    }


def render(gp: GluonPlan) -> str:
    return TEMPLATES.render("module.py.jinja", context(gp))


def build_source(gp: GluonPlan) -> tuple[str, str]:
    """(cache key, generated source): the key covers the spec, both plans, the Gluon templates and the versions."""
    from ...cache import cache_key

    source = render(gp)
    ver = versions()
    key = cache_key("gluon", format_spec(gp.base.spec), repr(gp), TEMPLATES.digest(), ver["attngen"], ver["triton"], ver["torch"])
    return key, source
