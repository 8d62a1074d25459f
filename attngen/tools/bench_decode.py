"""`attngen bench --decode`: decoding against a key/value cache on a GPU, in one process, on the same inputs.

Serving's shape (defaults; --heads, --kv-heads, --head-dim, --queries change it): 32 query heads over 8
key/value heads, head_dim 128, bf16, one new token per sequence (and 16 with --queries 1 16: speculative
decoding), every sequence holding N keys (kv_lens = N), B sequences. Each spec is timed as given and, for a
contiguous spec, also over paged caches of 16- and 64-token pages (the same spec with `kv_layout = paged`), whose
block tables list every sequence's pages in a shuffled order. Peer: FlexAttention (torch.compile(flex_attention),
which takes its decoding kernel for short queries) with the spec's mask and score (a BlockMask where the mask is
not all-true), enable_gqa.

The work is reading K and V: bytes = B * Hkv * N * (d + value_dim) * itemsize (q, O and the table are under 0.1 % of
that; latent attention, V a view of K's first value_dim columns: B * Hkv * N * d * itemsize, the shared bytes once),
GB/s = bytes / time, and "% copy" = that rate over the device-to-device copy rate measured in the same run
(bytes read + written by a 4 GiB copy). Every provider's output is checked against the float32 reference (the
first sequence, every head) before it is timed; a failure is reported, not timed. Timing: do_bench medians of
  - "layers": L calls, each over its own cache (a model's layers: L = min(8, 4 GiB / bytes)), captured in one
    CUDA graph and replayed, over L. A serving loop captures a whole decode step, every layer, in one graph, so
    the graph's launch is paid once a step, not once a call; the caches are distinct so no call finds another's
    K and V in the L2 cache. The rates and the ratio to FlexAttention use this time.
  - "one": the call alone in a graph (the graph's launch, about 4.5 us on the H100, counted in every call);
  - "eager": the eager call, with the host's time per call, which small shapes are bound by.
"""
from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch

from ..cache import write_atomic
from ..kvcache import append
from ..lang.spec import KVLayout, Spec
from ..runtime.layout import leading_columns_of
from .bench import _matplotlib, flex, flex_mods, median_ms, report, versions

CHECK_TOLERANCE = 2e-2  # max |out - reference| of a bf16 output accepted before timing
PAGE_SIZES = (16, 64)
MAX_LAYERS = 8  # calls a timed graph holds, each over its own cache (a model's layers) ...
LAYER_BYTES = 4 << 30  # ... as many as fit in this many bytes of K and V


def copy_rate() -> float:
    """Device-to-device copy rate in GB/s (bytes read + written), the card's bandwidth ceiling."""
    src = torch.empty(1 << 31, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    ms = median_ms(lambda: dst.copy_(src))
    del src, dst
    return 2 * (1 << 31) / ms * 1e-6


def _graph(fn) -> torch.cuda.CUDAGraph:
    """fn captured in a CUDA graph (after a warm-up on a side stream), as a serving loop runs its decode steps:
    replays time the GPU's work without the host's per-call time."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph


def _paged(k: torch.Tensor, v: torch.Tensor, page_size: int, gen: torch.Generator):
    """k, v (B, Hkv, N, D) as pages of caches in a shuffled order: (k_cache, v_cache, table), written by
    kvcache.append one sequence at a time (temporaries of one sequence's size). A v that is a view of k's first
    columns (latent attention) stays one: v_cache is then the same view of k_cache."""
    B, hkv, n, d = k.shape
    per_seq = -(-n // page_size)
    table = torch.randperm(B * per_seq, generator=gen, device="cpu").view(B, per_seq).to(device="cuda", dtype=torch.int32)
    k_cache, v_cache = (torch.empty(B * per_seq, page_size, hkv, x.shape[3], device="cuda", dtype=k.dtype) for x in (k, v))
    if leading_columns_of(v, k):
        v_cache = k_cache[..., :v.shape[3]]
    start = torch.zeros(1, dtype=torch.int32, device="cuda")
    for b in range(B):
        append(k_cache, v_cache, k[b:b + 1], v[b:b + 1], start, table[b:b + 1])
    return k_cache, v_cache, table


def decode_row(kernels: dict, spec: Spec, batch: int, keys: int, queries: int, heads: int, kv_heads: int, copy_gbs: float,
               flex_too: bool = True) -> dict:
    """One configuration: every provider checked, then timed (see the module doc)."""
    from .reference import reference

    gen = torch.Generator(device="cuda").manual_seed(0)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[spec.dtype.value]
    d, dv = spec.head_dim, spec.dv
    # latent attention (a key tile read in two parts, KernelPlan.decode_tail): V is K's first value_dim columns, a
    # view of the one cache, whose bytes count once
    latent = any(kern.plan.decode_tail for kern in kernels.values())
    nbytes = batch * kv_heads * keys * (d if latent else d + dv) * dtype.itemsize
    layers = max(1, min(MAX_LAYERS, LAYER_BYTES // nbytes))
    q = torch.randn(batch, heads, queries, d, device="cuda", dtype=dtype, generator=gen)
    if latent:
        caches = [(c, c[..., :dv]) for c in (torch.randn(batch, kv_heads, keys, d, device="cuda", dtype=dtype, generator=gen) for _ in range(layers))]
    else:
        caches = [tuple(torch.randn(batch, kv_heads, keys, x, device="cuda", dtype=dtype, generator=gen) for x in (d, dv)) for _ in range(layers)]
    lens = torch.full((batch,), keys, dtype=torch.int32, device="cuda")
    row = {"spec": spec.name, "B": batch, "N": keys, "Nq": queries, "Hq": heads, "Hkv": kv_heads, "d": d, "bytes": nbytes, "copy_gbs": copy_gbs,
           "layers": layers}
    k, v = caches[0]
    ref = reference(spec, q[:1].float(), k[:1].float(), v[:1].float())

    def rates(ms: float) -> dict:
        return {"ms": ms, "gbs": nbytes / ms * 1e-6, "copy_pct": 100 * nbytes / ms * 1e-6 / copy_gbs}

    def timed(name, calls):
        """calls: one call a layer, calls[0] over the checked cache."""
        try:
            with torch.no_grad():
                out = calls[0]()
                err = (out[:1].float() - ref).abs().max().item()
                assert err < CHECK_TOLERANCE and not torch.isnan(out).any(), f"max error {err} against the reference"
                eager = median_ms(calls[0])
                one = median_ms(_graph(calls[0]).replay)
                step = median_ms(_graph(lambda: [call() for call in calls]).replay)
            row[name] = {**rates(step / len(calls)), "one": rates(one), "eager_ms": eager, "max_err": err}
        except Exception as exc:  # one provider failing must not hide the others
            row[name] = {"error": f"{type(exc).__name__}: {exc}"[:300]}

    for name, kern in kernels.items():
        if kern.spec.kv_layout is KVLayout.PAGED and 1.1 * nbytes * layers > torch.cuda.mem_get_info()[0]:
            row[name] = {"error": f"skipped: paged copies of the {nbytes * layers / 2**30:.1f} GiB of K and V do not fit beside them"}
        elif kern.spec.kv_layout is KVLayout.PAGED:  # each layer's K and V through its own shuffled table
            paged = [_paged(k, v, kern.spec.page_size, torch.Generator().manual_seed(1 + i)) for i, (k, v) in enumerate(caches)]
            timed(name, [lambda kern=kern, c=c: kern(q, c[0], c[1], block_table=c[2], kv_lens=lens) for c in paged])
            del paged
        else:
            timed(name, [lambda kern=kern, c=c: kern(q, c[0], c[1], kv_lens=lens) for c in caches])
    if flex_too:
        from torch.nn.attention.flex_attention import create_block_mask

        mask_mod, score_mod = flex_mods(spec, {}, queries, keys)
        block_mask = None
        if mask_mod is not None:
            block_mask = create_block_mask(mask_mod, None, None, queries, keys, device="cuda")
        timed("flex", [lambda c=c: flex()(q, c[0], c[1], score_mod=score_mod, block_mask=block_mask, enable_gqa=heads != kv_heads)
                       for c in caches])
    return row


def _providers(spec: Spec, compile_spec) -> dict:
    """attngen's kernels to time: the spec, and for a contiguous spec the same over paged caches."""
    kernels = {"attngen": compile_spec(spec)}
    if spec.kv_layout is KVLayout.CONTIGUOUS:
        for page in PAGE_SIZES:
            kernels[f"paged{page}"] = compile_spec(replace(spec, kv_layout=KVLayout.PAGED, page_size=page, name=f"{spec.name}_paged{page}"))
    return kernels


def format_table(rows: list[dict]) -> str:
    """Per provider: the time a call, its K/V read rate (GB/s) and % of the copy rate in a graph of the row's layers
    (see the module doc), then one call a graph, then eager."""
    names = [n for n in ("attngen", *(f"paged{p}" for p in PAGE_SIZES), "flex") if any(n in r for r in rows)]
    head = f"{'spec':<22}{'B':>4}{'N':>8}{'Nq':>4}{'L':>3}" + "".join(f"{n + ' us GB/s %copy | one | eager':>43}" for n in names) + f"{'vs flex':>9}"
    lines = [head, "-" * len(head)]
    for r in rows:
        cells = []
        for n in names:
            x = r.get(n, {})
            cells.append(f"{x['ms'] * 1e3:8.1f} {x['gbs']:6.0f} {x['copy_pct']:5.1f}% | {x['one']['ms'] * 1e3:7.1f} {x['one']['copy_pct']:5.1f}% | "
                         f"{x['eager_ms'] * 1e3:6.1f}" if "ms" in x else f"{'error' if 'error' in x else '-':>41}")
        a, f = r.get("attngen", {}), r.get("flex", {})
        vs = f"{f['ms'] / a['ms']:8.2f}x" if "ms" in a and "ms" in f else f"{'-':>9}"
        lines.append(f"{r['spec']:<22}{r['B']:>4}{r['N']:>8}{r['Nq']:>4}{r.get('layers', 1):>3}" + "".join(f"{c:>43}" for c in cells) + vs)
    errors = [f"  {r['spec']} B={r['B']} N={r['N']} Nq={r['Nq']} {n}: {r[n]['error']}" for r in rows for n in names if "error" in r.get(n, {})]
    return "\n".join(lines + (["errors:"] + errors if errors else []))


def plot(results: dict, path: str | Path) -> None:
    """GB/s against the number of keys, one panel per (batch, queries), a line per provider (solid: in a graph of
    the row's layers; dotted: one call a graph), the copy rate dashed."""
    import io

    plt = _matplotlib()
    rows = results["rows"]
    panels = sorted({(r["B"], r["Nq"]) for r in rows})
    names = [n for n in ("attngen", *(f"paged{p}" for p in PAGE_SIZES), "flex") if any("gbs" in r.get(n, {}) for r in rows)]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 4), squeeze=False)
    for ax, (batch, nq) in zip(axes[0], panels):
        mine = sorted((r for r in rows if (r["B"], r["Nq"]) == (batch, nq)), key=lambda r: r["N"])
        for i, n in enumerate(names):
            pts = [(r["N"], r[n]["gbs"]) for r in mine if "gbs" in r.get(n, {})]
            if pts:
                color = f"C{i}"
                ax.plot(*zip(*pts), marker="o", color=color, label=n)
                ax.plot(*zip(*[(r["N"], r[n]["one"]["gbs"]) for r in mine if "gbs" in r.get(n, {})]), linestyle=":", color=color)
        ax.axhline(results["copy_gbs"], color="black", linestyle="--", linewidth=1, label="copy rate")
        ax.set_xscale("log", base=2)
        ax.set_title(f"B={batch}, {nq} quer{'y' if nq == 1 else 'ies'}", fontsize="small")
        ax.set_xlabel("keys per sequence")
        ax.set_ylabel("K/V read, GB/s")
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize="small")
    fig.suptitle(f"attngen bench --decode: {results.get('versions', '')}\nsolid: a call in a graph of a step's layers, each over its own "
                 "cache; dotted: a call alone in a graph", fontsize="small")
    fig.tight_layout()
    image = io.BytesIO()
    try:
        fig.savefig(image, dpi=120, format=Path(path).suffix[1:] or "png")
    finally:
        plt.close(fig)
    write_atomic(Path(path), image.getvalue())


def run(paths: list[str], seqs: list[int], batches: list[int], queries: list[int], heads: int = 32, kv_heads: int = 8,
        head_dim: int = 128, json_path: str | None = None, plot_path: str | None = None, progress=print) -> list[dict]:
    """The CLI's work: each spec (default: causal attention of the new tokens over their sequence's cache) at
    every (batch, keys, queries), attngen's layouts and FlexAttention, then the table and the plot."""
    from ..lang.check import load_spec, read_spec
    from ..runtime import compile as compile_spec

    if not torch.cuda.is_available():
        raise RuntimeError("needs a CUDA GPU (timings of Triton's interpreter mean nothing)")
    if plot_path:
        _matplotlib()
    specs = [read_spec(p) for p in paths] or [load_spec(f"attention decode_causal {{ head_dim = {head_dim} dtype = bf16 "
                                                        f"mask = q_idx + kv_len - q_len >= kv_idx }}")]
    copy_gbs = copy_rate()
    progress(f"[bench --decode] device-to-device copy: {copy_gbs:.0f} GB/s")
    rows = []
    for spec in specs:
        kernels = _providers(spec, compile_spec)
        for nq in queries:
            for batch in batches:
                for keys in seqs:
                    progress(f"[bench --decode] {spec.name} B={batch} N={keys} Nq={nq} ...")
                    rows.append(decode_row(kernels, spec, batch, keys, nq, heads, kv_heads, copy_gbs))
                    progress(format_table(rows[-1:]).splitlines()[-1])
                    torch.cuda.empty_cache()
    results = {"versions": versions(), "copy_gbs": copy_gbs, "rows": rows}
    report(results, f"\n{results['versions']}; copy rate {copy_gbs:.0f} GB/s; K/V bytes over time; bf16, Hq={heads}, Hkv={kv_heads}; "
           f"L: calls a graph, each over its own cache (one: a call alone in a graph)\n"
           f"{format_table(rows)}", json_path, plot, plot_path, progress)
    return rows
