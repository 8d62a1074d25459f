"""What tile classification buys (issue 3): masked attention with and without it, against FlexAttention.

bf16, head_dim 128, H = 16, B * N = 16384 tokens. Masks: causal, sliding window 1024 (causal), packed
documents (random lengths 256-2048, causal inside each document). Providers, all in this process on the same
random inputs, each checked against the float32 naive reference on the first batch entry and two heads:
  attngen        the kernels as generated (empty tiles skipped, full tiles unmasked, inputs pre-passed), through
                 the generators `auto` chose (on sm_90 the Gluon generator's at head_dim 128)
  triton         the same spec through the Triton generator (backend = "triton"), where auto chose Gluon
  attngen_off    with --off: the spec built with attngen.compile(..., classify=False): every tile visited and masked
  flex           torch.compile(flex_attention) with create_block_mask of the same mask
and attngen without a mask (dense) for the proportionality check: a mask keeping a fraction s of the pairs
should take <= 1.2 s of the dense time (plus one tile row). TFLOP/s count only kept pairs:
forward = 4 B H N^2 d s, backward = 2.5 x forward.

    python benchmarks/masks.py [--seq 4096 16384] [--off] [--json OUT.json]
"""
import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import attngen  # noqa: E402
from attngen.bench import kept_fraction, random_documents  # noqa: E402
from attngen.check import load_spec  # noqa: E402
from attngen.spec import DType  # noqa: E402
from harness import flex, matmul_tflops, measure, median_ms, time_fwd_bwd, versions  # noqa: E402

H, D = 16, 128
WINDOW = 1024


def spec_of(name: str):
    spec = load_spec((ROOT / "specs" / f"{name}.attn").read_text(), f"specs/{name}.attn")
    return dataclasses.replace(spec, head_dim=D, dtype=DType.BF16)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, nargs="+", default=[16384])
    ap.add_argument("--json", default=None)
    ap.add_argument("--off", action="store_true", help="also time the kernels built with classify=False")
    args = ap.parse_args()
    dev = "cuda"
    specs = {"causal": spec_of("causal"), "window": spec_of("sliding_window"), "document": spec_of("document")}
    dense = attngen.compile(spec_of("dense"))
    rows = []
    for n in args.seq:
        batch = max(1, 16384 // n)
        gen = torch.Generator(device=dev).manual_seed(n)
        q, k, v, do = (torch.randn(batch, H, n, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        doc = random_documents(batch, n, torch.Generator().manual_seed(n)).to(dev)
        t_dense = time_fwd_bwd(lambda q, k, v: dense(q, k, v), q, k, v, do)
        mask_mods = {
            "causal": lambda b, h, qi, ki: qi >= ki,
            "window": lambda b, h, qi, ki: (qi >= ki) & (qi - ki < WINDOW),
            "document": lambda b, h, qi, ki: (doc[b, qi] == doc[b, ki]) & (qi >= ki),
        }
        for name, spec in specs.items():
            inputs = {"doc": doc} if name == "document" else {}
            kern = attngen.compile(spec)
            twin = attngen.compile(spec, backend="triton") if kern.generator.generator == "gluon" else None
            kern_off = attngen.compile(spec, classify=False) if args.off else None
            block_mask = create_block_mask(mask_mods[name], batch if name == "document" else None, None, n, n, device=dev)
            kept = kept_fraction(spec, inputs, batch, H, n, n, dev)
            fwd_flop = 4 * batch * H * n * n * D * kept
            providers = {"attngen": lambda q, k, v: kern(q, k, v, **inputs)}
            if twin is not None:
                providers["triton"] = lambda q, k, v: twin(q, k, v, **inputs)
            if kern_off is not None:
                providers["attngen_off"] = lambda q, k, v: kern_off(q, k, v, **inputs)
            providers["flex"] = lambda q, k, v, bm=block_mask: flex(q, k, v, block_mask=bm)
            ref = attngen.reference(spec, q[:1, :2].float(), k[:1, :2].float(), v[:1, :2].float(),
                                    **{key: t[:1] for key, t in inputs.items()})
            row = {"N": n, "B": batch, "H": H, "d": D, "mask": name, "kept": kept, "generators": f"{kern.generator.generator} / {kern.generator.backward}",
                   "dense_fwd_ms": t_dense[0], "dense_bwd_ms": t_dense[1]}
            if name == "document":  # the input pre-pass alone: per-chunk min/max of doc
                row["prepass_ms"] = median_ms(lambda: kern.module._bounds_of(doc, 1))
            for pname, fn in providers.items():
                row[pname] = measure(pname, fn, q, k, v, do, lambda out: (out[:1, :2].float() - ref).abs().max().item(), fwd_flop)
            rows.append(row)
            print(json.dumps(row), flush=True)
    mm = matmul_tflops()
    print(f"\nbf16 8192^3 matmul: {mm:.0f} TFLOP/s   ({versions()})")
    print("ms fwd / bwd; 'vs triton', 'vs off' and 'vs flex' = speed-up of attngen (fwd/bwd); 'time/s·dense' = attngen time over the"
          " kept fraction of the dense time (fwd/bwd; target <= 1.2); generators: attngen's forward / backward")
    shown = [p for p in ("attngen", "triton", "attngen_off", "flex") if any(p in row for row in rows)]
    head = f"{'config':<17}{'kept':>6}{'generators':>16}" + "".join(f"{p:>16}" for p in shown) + "".join(f"{'vs ' + p.split('_')[-1]:>12}" for p in shown[1:])
    print(head + f"{'time/s·dense':>14}")
    for row in rows:
        cells = []
        for p in shown:
            r = row.get(p, {})
            cells.append(f"{r['fwd_ms']:6.2f} /{r['bwd_ms']:6.2f}" if "fwd_ms" in r else f"{'error':>13}")

        def ratio(p):
            a, b = row.get("attngen", {}), row.get(p, {})
            return f"{b['fwd_ms'] / a['fwd_ms']:.2f}/{b['bwd_ms'] / a['bwd_ms']:.2f}" if "fwd_ms" in a and "fwd_ms" in b else "-"
        a = row.get("attngen", {})
        prop = (f"{a['fwd_ms'] / (row['kept'] * row['dense_fwd_ms']):.2f}/{a['bwd_ms'] / (row['kept'] * row['dense_bwd_ms']):.2f}"
                if "fwd_ms" in a else "-")
        print(f"{'N=' + str(row['N']) + ' ' + row['mask']:<17}{row['kept']:6.3f}{row['generators']:>16}" + "".join(f"{c:>16}" for c in cells)
              + "".join(f"{ratio(p):>12}" for p in shown[1:]) + f"{prop:>14}")
    for row in rows:
        if "prepass_ms" in row:
            print(f"N={row['N']} document: input pre-pass {row['prepass_ms'] * 1e3:.1f} us "
                  f"({100 * row['prepass_ms'] / row['attngen']['fwd_ms']:.2f}% of the forward)" if "fwd_ms" in row.get("attngen", {}) else "")
    if args.json:
        Path(args.json).write_text(json.dumps({"matmul_tflops": mm, "versions": versions(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
