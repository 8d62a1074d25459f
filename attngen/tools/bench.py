"""`attngen bench`: time generated kernels against their peers on a GPU, in one process, on the same inputs.

Peers: FlexAttention (torch.compile(flex_attention)) with a mask_mod and score_mod derived from the same spec
(the reference's own expression evaluator, so any spec has its Flex twin) and a BlockMask from create_block_mask;
torch SDPA's flash and cuDNN backends where they express the variant (no mask or causal, no score
modification, no inputs). Every provider's output is checked against the float32 naive reference (first batch
entry, two heads) before it is timed; a provider that fails the check or raises is reported, not timed.
Timing: triton.testing.do_bench medians after warm-up; backward = median(forward + backward) - median(forward).
TFLOP/s count kept pairs only: forward = 4 B H Nq Nk d (kept fraction), backward = 2.5 x forward.
The bf16 8192^3 matrix product is timed in the same run (the card's ceiling).
"""
from __future__ import annotations

import io
import json
from dataclasses import replace
from pathlib import Path

import torch

from ..cache import write_atomic
from ..lang.expr import SCORE_VARS, Scope, variables
from ..lang.spec import Binary, DType, Spec, Var
from ..plan.planner import effective_mask
from ..plan.tune import describe, entries_at
from ..runtime import blocks
from ..runtime.evaluate import evaluate, sink_rows
from .reference import reference

CHECK_TOLERANCE = 3e-2  # max |out - reference| accepted before timing (bf16 outputs of unit-variance inputs)
_flex = None


def flex():
    """torch.compile(flex_attention), created once. FlexAttention recompiles per mask_mod/score_mod and shape;
    past the default limit of 8 recompiles it silently falls back to an unfused path that materializes the
    scores, so the limits are raised."""
    global _flex
    if _flex is None:
        from torch.nn.attention.flex_attention import flex_attention

        torch._dynamo.config.recompile_limit = 64
        torch._dynamo.config.cache_size_limit = 64
        _flex = torch.compile(flex_attention, dynamic=False)
    return _flex


def median_ms(fn) -> float:
    import triton

    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def time_fwd_bwd(fwd, q, k, v, do) -> tuple[float, float]:
    """(forward ms, backward ms) of fwd(q, k, v), q/k/v requiring grad, dO = do."""
    t_fwd = median_ms(lambda: fwd(q, k, v))

    def step():
        out = fwd(q, k, v)
        torch.autograd.grad(out, (q, k, v), do)

    t_all = median_ms(step)
    return t_fwd, max(t_all - t_fwd, 1e-9)


def measure(name: str, fn, q, k, v, do, error_of, fwd_flop: float) -> dict:
    """Check fn(q, k, v) first (error_of(out) is its max error against a reference; more than CHECK_TOLERANCE
    or any NaN fails), then time its forward and backward. A failure is reported in the result, not raised:
    one provider failing must not hide the others."""
    try:
        out = fn(q, k, v)
        err = error_of(out)
        assert err < CHECK_TOLERANCE and not torch.isnan(out).any(), f"{name}: max error {err} against the reference"
        torch.autograd.grad(out, (q, k, v), do)  # first backward outside the timing (compilation, `auto` tuning)
        t_fwd, t_bwd = time_fwd_bwd(fn, q, k, v, do)
        return {"fwd_ms": t_fwd, "bwd_ms": t_bwd, "max_err": err,
                "fwd_tflops": fwd_flop / t_fwd * 1e-9, "bwd_tflops": 2.5 * fwd_flop / t_bwd * 1e-9}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def sdpa(backend, q, k, v, causal: bool):
    from torch.nn.attention import sdpa_kernel

    with sdpa_kernel(backend):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=q.shape[1] != k.shape[1])


def matmul_tflops() -> float:
    """The bf16 8192^3 matrix product: the ceiling of this card, measured in the same run."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / median_ms(lambda: a @ b) * 1e-9


def versions() -> str:
    import triton

    return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"


# ---- peers derived from the spec --------------------------------------------------------------------------
def flex_mods(spec: Spec, inputs: dict, q_len: int, kv_len: int):
    """(mask_mod, score_mod) for FlexAttention computing the spec: the naive reference's evaluator applied to
    Flex's index tensors (either is None when the spec has no mask / no score modification). Flex's `score`
    is q.k * scale, as the spec's."""
    scope = Scope("score", SCORE_VARS, spec.inputs_by_name)
    mask = effective_mask(spec)

    def env(b, h, q_idx, kv_idx):
        return {"b": b, "h": h, "q_idx": q_idx, "kv_idx": kv_idx, "q_len": q_len, "kv_len": kv_len}

    def mask_mod(b, h, q_idx, kv_idx):
        return torch.as_tensor(evaluate(mask, env(b, h, q_idx, kv_idx), inputs, scope, torch.float32))

    def score_mod(score, b, h, q_idx, kv_idx):
        return torch.as_tensor(evaluate(spec.score, env(b, h, q_idx, kv_idx) | {"score": score}, inputs, scope, torch.float32)).to(score.dtype)

    return (mask_mod if mask is not None else None), (score_mod if spec.score is not None else None)


def with_sink(o: torch.Tensor, lse: torch.Tensor, sinks: torch.Tensor) -> torch.Tensor:
    """An attention output without a sink, and its row log-sum-exp (natural log), turned into the output with one:
    the sink joins each row's denominator, so O shrinks by exp(lse - logaddexp(lse, sink))."""
    return o * torch.exp(lse - torch.logaddexp(lse, sinks))[..., None].to(o.dtype)


def sdpa_variant(spec: Spec) -> bool | None:
    """is_causal for torch SDPA if it computes the spec (no mask: False, causal: True), else None."""
    if spec.score is not None or spec.sink is not None or spec.inputs or spec.dropout or spec.sparsity is not None:
        return None
    if spec.mask is None:
        return False
    if spec.mask == Binary(">=", Var("q_idx"), Var("kv_idx")):
        return True
    return None


def kept_fraction(spec: Spec, inputs: dict, batch: int, heads: int, q_len: int, kv_len: int, device,
                  block_mask: torch.Tensor | None = None) -> float:
    """Exact fraction of (b, h, q, kv) pairs the mask and a runtime block mask keep, counted in row chunks."""
    mask = effective_mask(spec)
    if mask is None and block_mask is None:
        return 1.0
    scope = Scope("mask", SCORE_VARS, spec.inputs_by_name)
    uses = variables(mask) if mask is not None else frozenset()
    per_b = "b" in uses or (block_mask is not None and block_mask.shape[0] > 1)
    per_h = "h" in uses or (block_mask is not None and block_mask.shape[1] > 1)
    bs = torch.arange(batch if per_b else 1, device=device).view(-1, 1, 1, 1)
    hs = torch.arange(heads if per_h else 1, device=device).view(1, -1, 1, 1)
    kv = torch.arange(kv_len, device=device).view(1, 1, 1, -1)
    kept = 0
    for start in range(0, q_len, 256):
        qi = torch.arange(start, min(start + 256, q_len), device=device).view(1, 1, -1, 1)
        shape = (bs.numel(), hs.numel(), qi.numel(), kv_len)
        env = {"b": bs, "h": hs, "q_idx": qi, "kv_idx": kv, "q_len": q_len, "kv_len": kv_len}
        keep = torch.ones((), dtype=torch.bool, device=device) if mask is None else torch.as_tensor(evaluate(mask, env, inputs, scope, torch.float32))
        keep = keep.broadcast_to(shape)
        if block_mask is not None:  # the block rows this chunk touches, as elements
            S = spec.sparse_block
            rows = block_mask[:, :, start // S: (start + qi.numel() - 1) // S + 1]
            keep = keep & blocks.expand(rows, S, start % S + qi.numel(), kv_len)[..., start % S:, :]
        kept += int(keep.sum())
    return kept / (bs.numel() * hs.numel() * q_len * kv_len)


def _slice_inputs(spec: Spec, inputs: dict, heads: int) -> dict:
    """The inputs of batch entry 0 and the first `heads` heads (dims declared B / H)."""
    out = {}
    for decl in spec.inputs:
        t = inputs[decl.name]
        index = tuple(slice(0, 1) if d == "B" else slice(0, heads) if d == "H" else slice(None) for d in decl.dims)
        out[decl.name] = t[index]
    return out


def random_documents(batch: int, n: int, gen: torch.Generator) -> torch.Tensor:
    """doc[b, i]: the document of token i, documents of 256-2048 tokens (the last one cut at n), int32: what packed
    training batches hold (the test data of attngen.verify.make_inputs has documents of about 16 tokens)."""
    rows = []
    for _ in range(batch):
        lengths = []
        while sum(lengths) < n:
            lengths.append(int(torch.randint(256, 2049, (1,), generator=gen)))
        rows.append(torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))[:n])
    return torch.stack(rows).to(torch.int32)


def make_case(spec: Spec, seq: int, tokens: int = 16384, width: int = 2048, seed: int = 0):
    """Random CUDA inputs of one configuration, B = tokens // seq, H = width // head_dim: (q, k, v requiring grad,
    dO, the spec's inputs, the call's other keywords (block_mask, dropout)). An integer input of shape (B, N) is
    taken for document ids: documents of 256-2048 tokens (random_documents); other inputs as `attngen check`
    makes them."""
    from ..runtime.dtypes import TORCH_DTYPES
    from . import verify

    d = spec.head_dim
    batch, heads = max(1, tokens // seq), max(1, width // d)
    dtype = TORCH_DTYPES[spec.dtype.value]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    q, k, v, do = (torch.randn(batch, heads, seq, width, device="cuda", dtype=dtype, generator=gen) for width in (d, d, spec.dv, spec.dv))
    for t in (q, k, v):
        t.requires_grad_()
    inputs = verify.make_inputs(spec, batch, heads, seq, seq, "cuda", torch.Generator().manual_seed(seed))
    for decl in spec.inputs:
        if decl.dtype.startswith("int") and tuple(decl.dims) == ("B", "N"):
            inputs[decl.name] = random_documents(batch, seq, torch.Generator().manual_seed(seed)).to("cuda", TORCH_DTYPES[decl.dtype])
    block_mask_arg = inputs.pop("block_mask", None)
    extra = {"block_mask": block_mask_arg} if block_mask_arg is not None else {}
    if spec.dropout:
        extra["dropout_p"], extra["seed"] = spec.dropout, 1234
    return q, k, v, do, inputs, extra


def providers(kernel, seq: int, inputs: dict, extra: dict, batch: int, heads: int, derived=None, triton=None,
              gluon=None) -> tuple[dict, dict]:
    """The providers that compute `kernel`'s spec at one configuration, name -> fn(q, k, v): attngen (and, when
    given, `derived`: the same spec with the plan's own tiles; `gluon` and `triton`: the same spec through each
    code generator, Gluon's for both passes), FlexAttention with the spec's mask_mod /
    score_mod and BlockMask (not with dropout or runtime block sparsity), torch SDPA's flash and cuDNN backends
    where they express the spec. Also {name: {"error": ...}} for a provider that could not be set up."""
    from torch.nn.attention import SDPBackend
    from torch.nn.attention.flex_attention import create_block_mask

    spec = kernel.spec
    fns = {"attngen": lambda q, k, v: kernel(q, k, v, **extra, **inputs)}
    if derived is not None:
        fns["derived"] = lambda q, k, v: derived(q, k, v, **extra, **inputs)
    if gluon is not None:
        fns["gluon"] = lambda q, k, v: gluon(q, k, v, **extra, **inputs)
    if triton is not None:
        fns["triton"] = lambda q, k, v: triton(q, k, v, **extra, **inputs)
    failed = {}
    if not spec.dropout and spec.sparsity != "runtime":
        mask_mod, score_mod = flex_mods(spec, inputs, seq, seq)
        try:  # the BlockMask, built once (not timed), per batch entry / head only if the mask uses b / h
            bm = None
            if mask_mod is not None:
                uses = variables(effective_mask(spec))
                bm = create_block_mask(mask_mod, batch if "b" in uses else None, heads if "h" in uses else None, seq, seq,
                                       device="cuda", _compile=True)
            if spec.sink is None:
                fns["flex"] = lambda q, k, v: flex()(q, k, v, score_mod=score_mod, block_mask=bm)
            else:  # Flex has no sink: applied outside, from its row log-sum-exp
                sinks = sink_rows(spec, inputs, batch, heads, seq, seq, "cuda", torch.float32)
                fns["flex"] = lambda q, k, v: with_sink(*flex()(q, k, v, score_mod=score_mod, block_mask=bm, return_lse=True), sinks)
        except Exception as exc:  # reported in the table like a provider that fails its check
            failed["flex"] = {"error": f"create_block_mask: {type(exc).__name__}: {exc}"[:300]}
    causal = sdpa_variant(spec)
    if causal is not None:
        fns["sdpa_flash"] = lambda q, k, v: sdpa(SDPBackend.FLASH_ATTENTION, q, k, v, causal)
        fns["sdpa_cudnn"] = lambda q, k, v: sdpa(SDPBackend.CUDNN_ATTENTION, q, k, v, causal)
    return fns, failed


def bench_spec(kernel, seq: int, tokens: int = 16384, width: int = 2048, seed: int = 0, derived=None, triton=None,
               gluon=None) -> dict:
    """One configuration: B = tokens // seq, H = width // head_dim, every provider that expresses the spec.
    `derived`: the same spec with the plan's own tiles, timed beside a kernel whose tiles are tuned; `gluon`,
    `triton`: the spec through each code generator, timed beside the spec's own choice."""
    spec = kernel.spec
    d = spec.head_dim
    q, k, v, do, inputs, extra = make_case(spec, seq, tokens, width, seed)
    batch, heads = q.shape[:2]
    block_mask_arg = extra.get("block_mask")
    kept = kept_fraction(spec, inputs, batch, heads, seq, seq, "cuda", block_mask_arg)
    fwd_flop = 2 * batch * heads * seq * seq * (d + spec.dv) * kept  # q.k over head_dim, P V over value_dim
    small = _slice_inputs(spec, inputs, 2)
    ref_extra = dict(extra)
    if block_mask_arg is not None:
        ref_extra["block_mask"] = block_mask_arg[:1, :2]
    want = reference(spec, q[:1, :2].float(), k[:1, :2].float(), v[:1, :2].float(), **ref_extra, **small)

    def error_of(out):
        return (out[:1, :2].float() - want).abs().max().item()

    fns, failed = providers(kernel, seq, inputs, extra, batch, heads, derived, triton, gluon)
    row = {"spec": spec.name, "N": seq, "B": batch, "H": heads, "d": d, "dv": spec.dv, "dtype": spec.dtype.value, "kept": kept,
           "generator": kernel.generator.forward_at(seq), "backward": kernel.generator.backward_at(seq)} | failed
    for name, fn in fns.items():
        row[name] = measure(name, fn, q, k, v, do, error_of, fwd_flop)
    return row


PROVIDERS = ("attngen", "gluon", "triton", "derived", "flex", "sdpa_flash", "sdpa_cudnn")


def format_table(rows: list[dict], ceiling: float | None = None) -> str:
    """TFLOP/s forward / backward per provider, and the speed of attngen (the spec's own choice of generators)
    and of the Gluon generator over FlexAttention's, cuDNN's and the Triton generator's (and over the plan's
    derived tiles, when attngen's are tuned)."""
    providers = [p for p in PROVIDERS if any(p in row for row in rows)]
    ratios = [(a, b) for a in ("attngen", "gluon") if a in providers for b in ("flex", "sdpa_cudnn", "triton", "derived")
              if b in providers and not (a == "gluon" and b == "derived")]
    def cell(r):
        return f"{r['fwd_tflops']:5.0f} /{r['bwd_tflops']:5.0f}" if "fwd_tflops" in r else ("failed" if "error" in r else "-")

    def ratio(row, a, b):
        a, b = row.get(a, {}), row.get(b, {})
        if "fwd_tflops" in a and "fwd_tflops" in b:
            return f"{a['fwd_tflops'] / b['fwd_tflops']:.2f}/{a['bwd_tflops'] / b['bwd_tflops']:.2f}"
        return "-"

    label = {"sdpa_cudnn": "cudnn"}
    head = f"{'config':<34}" + "".join(f"{p:>14}" for p in providers) + "".join(f"{a + '/' + label.get(b, b):>18}" for a, b in ratios)
    notes = []
    if any(p in providers for p in ("gluon", "triton")):
        passes = sorted({f"{r['generator']}/{r.get('backward', 'triton')}" for r in rows})
        notes.append(f"attngen = the spec's own choice (forward/backward generator: {', '.join(passes)}); gluon = both passes "
                     "through the Gluon generator (deterministic = false); triton = both through the Triton generator")
    lines = ["TFLOP/s forward / backward (kept pairs only)" + (f"; bf16 8192^3 matmul {ceiling:.0f}" if ceiling else ""), *notes, head]
    for row in rows:
        name = f"{row['spec']} d={row['d']} N={row['N']} {row['dtype']}"
        lines.append(f"{name:<34}" + "".join(f"{cell(row.get(p, {})):>14}" for p in providers)
                     + "".join(f"{ratio(row, a, b):>18}" for a, b in ratios))
    for row in rows:
        for name, entry in sorted(row.get("tuned", {}).items()):
            lines.append(f"  {row['spec']} N={row['N']} tuned {name.split()[0]}: {describe(entry['tiles'])} "
                         f"({entry['derived_ms'] / entry['tuned_ms']:.2f}x the derived tiles in the tuner's timing, {entry['tried']} tried)")
    for row in rows:
        for p in providers:
            if "error" in row.get(p, {}):
                lines.append(f"  {row['spec']} N={row['N']} {p}: {row[p]['error']}")
    return "\n".join(lines)


def _matplotlib():
    """pyplot, with a backend that needs no display; RuntimeError with the install line if matplotlib is missing."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as err:
        raise RuntimeError("plots need matplotlib: pip install 'attngen[plot]' (or plot a saved --json later with "
                           "`attngen plot RESULTS.json -o OUT.png` on a machine that has it)") from err
    return plt


def plot(results: dict, path: str | Path) -> None:
    """Bar charts of a bench run ({"versions", "matmul_tflops", "rows"}, as --json writes): TFLOP/s of every
    provider per configuration, forward above and backward below, the matrix-product ceiling as a dashed line.
    Written atomically (a partial file never takes the name)."""
    plt = _matplotlib()
    rows = results.get("rows")
    if not rows:
        raise RuntimeError("no benchmark rows to plot")
    providers = [p for p in PROVIDERS if any("fwd_tflops" in row.get(p, {}) for row in rows)]
    labels = [f"{row['spec']}\nd={row['d']} N={row['N']}" for row in rows]
    width = 0.8 / max(1, len(providers))
    fig, axes = plt.subplots(2, 1, figsize=(max(8.0, 1.1 * len(rows) + 2), 8), sharex=True)
    for ax, phase in zip(axes, ("fwd", "bwd")):
        for i, name in enumerate(providers):
            xs = [j + (i - (len(providers) - 1) / 2) * width for j in range(len(rows))]
            ys = [row.get(name, {}).get(f"{phase}_tflops", 0.0) for row in rows]  # 0: failed or not applicable
            ax.bar(xs, ys, width, label=name)
        if results.get("matmul_tflops"):
            ax.axhline(results["matmul_tflops"], color="black", linestyle="--", linewidth=1, label="bf16 matmul ceiling")
        ax.set_ylabel(f"{'forward' if phase == 'fwd' else 'backward'} TFLOP/s")
        ax.grid(axis="y", alpha=0.3)
    axes[0].legend(ncol=min(6, len(providers) + 1), fontsize="small")
    axes[0].set_title(f"attngen bench: {results.get('versions', '')}", fontsize="small")
    axes[1].set_xticks(range(len(rows)), labels, rotation=45, ha="right", fontsize="small")
    fig.tight_layout()
    path = Path(path)
    image = io.BytesIO()
    try:
        fig.savefig(image, dpi=120, format=path.suffix[1:] or "png")  # the name's suffix picks the format; none: PNG
    finally:
        plt.close(fig)
    write_atomic(path, image.getvalue())


def tuned(spec: Spec) -> Spec:
    """The spec with block_m, block_n, num_warps and num_stages = auto (measured per shape: attngen/plan/tune.py)."""
    from ..lang.check import TUNABLE

    return replace(spec, tune=frozenset(TUNABLE), **{key: None for key in TUNABLE})


def _gpu_specs(paths: list[str], dtype: str | None, head_dims: list[int] | None):
    """The specs of the GPU commands: each file's spec (with `dtype` if given), or one per head dim in `head_dims`
    (named SPEC_dD). Checks first that a GPU is visible."""
    from ..lang.check import read_spec

    if not torch.cuda.is_available():
        raise RuntimeError("needs a CUDA GPU (timings of Triton's interpreter mean nothing)")
    for path in paths:
        base = read_spec(path)
        if dtype:
            base = replace(base, dtype=DType(dtype))
        for d in head_dims or [None]:
            if d is not None and not 16 <= d <= 256:
                raise RuntimeError(f"--head-dim {d}: head_dim must be in 16..256")
            yield base if d is None else replace(base, head_dim=d, name=f"{base.name}_d{d}")


def _generators(spec: Spec, kernel, compile_spec) -> tuple:
    """The spec through each code generator for both passes, to time beside the spec's own choice (`kernel`):
    (Gluon's, with deterministic = false, or None where it cannot render the spec for this GPU or where that is
    `kernel` already at every length; Triton's, or None where `kernel` is Triton's both ways)."""
    from ..errors import PlanError

    gen = kernel.generator
    try:
        ours = (gen.generator, gen.backward) == ("gluon", "gluon") and not gen.min_keys and not gen.bwd_min_keys
        gluon = None if ours else compile_spec(spec, backend="gluon", deterministic=False)
    except PlanError:
        gluon = None
    triton = compile_spec(spec, backend="triton") if (gen.generator, gen.backward) != ("triton", "triton") else None
    return gluon, triton


def run(paths: list[str], seqs: list[int], json_path: str | None = None, dtype: str | None = None, head_dims: list[int] | None = None,
        tune: bool = False, plot_path: str | None = None, progress=print) -> list[dict]:
    """The CLI's work: compile each spec for the live GPU (for each of `head_dims`, if given, instead of the spec's
    own; named SPEC_dD), time every configuration, print the table (and plot it to `plot_path`). `tune`:
    attngen's tiles are tuned (every key auto), and the plan's derived tiles are timed beside them."""
    from ..runtime import compile as compile_spec

    if plot_path:
        _matplotlib()  # before minutes of timing, not after
    rows = []
    for spec in _gpu_specs(paths, dtype, head_dims):
        kernel = compile_spec(tuned(spec) if tune else spec)
        derived = compile_spec(replace(spec, tune=frozenset())) if tune else None
        gluon, triton = _generators(spec, kernel, compile_spec)
        progress(f"[bench] {spec.name}: {kernel.generator.describe()}")
        for seq in seqs:
            progress(f"[bench] {spec.name} N={seq} ...")
            row = bench_spec(kernel, seq, derived=derived, triton=triton, gluon=gluon)
            if tune:
                row["tuned"] = entries_at(kernel.tuner.entries, seq)
            rows.append(row)
            progress("\n".join(format_table([row]).splitlines()[2:]))  # this row now: a run cut off keeps it
    results = {"versions": versions(), "matmul_tflops": matmul_tflops(), "rows": rows}
    report(results, f"\n{results['versions']}\n{format_table(rows, results['matmul_tflops'])}", json_path, plot, plot_path, progress)
    return rows


def report(results: dict, table: str, json_path: str | None, plot_fn, plot_path: str | None, progress) -> None:
    """A benchmark's end: the table, the results as JSON (atomically) and the plot, where asked for."""
    progress(table)
    if json_path:
        write_atomic(Path(json_path), json.dumps(results, indent=1))
    if plot_path:
        plot_fn(results, plot_path)
        progress(f"plot: {plot_path}")


def tune_report(paths: list[str], seqs: list[int], json_path: str | None = None, dtype: str | None = None,
                head_dims: list[int] | None = None, progress=print) -> list[dict]:
    """`attngen tune`: tune each spec (every key auto) at each length on the live GPU, filling the tuning cache,
    and print the derived against the tuned configuration as the tuner timed them."""
    from ..runtime import compile as compile_spec

    rows = []
    for spec in _gpu_specs(paths, dtype, head_dims):
        kernel = compile_spec(tuned(spec))
        for seq in seqs:
            progress(f"[tune] {spec.name} N={seq} ...")
            q, k, v, do, inputs, extra = make_case(spec, seq)
            torch.autograd.grad(kernel(q, k, v, **extra, **inputs), (q, k, v), do)
            row = {"spec": spec.name, "N": seq, "B": q.shape[0], "H": q.shape[1], "d": spec.head_dim, "dtype": spec.dtype.value,
                   "derived": kernel.plan.tiles(), "entries": entries_at(kernel.tuner.entries, seq)}
            rows.append(row)
    lines = [f"\n{versions()}", f"{'config':<34}{'fwd derived -> tuned ms':>26}{'bwd derived -> tuned ms':>26}  tuned tiles"]
    for row in rows:
        cells, tiles = [], []
        for phase in ("fwd", "bwd"):
            e = next((e for n, e in row["entries"].items() if n.startswith(phase + " ")), None)
            cells.append(f"{e['derived_ms']:.3f} -> {e['tuned_ms']:.3f} ({e['derived_ms'] / e['tuned_ms']:.2f}x)" if e else "-")
            tiles.append(describe(e["tiles"]) if e else "-")
        lines.append(f"{row['spec'] + ' N=' + str(row['N']):<34}{cells[0]:>26}{cells[1]:>26}  {'; '.join(tiles)}")
    progress("\n".join(lines))
    if json_path:
        write_atomic(Path(json_path), json.dumps({"versions": versions(), "rows": rows}, indent=1))
    return rows
