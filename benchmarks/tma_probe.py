"""Pointer loads against tensor descriptors (TMA), and Triton's warp specialization, on the same kernels (GPU only).

For each spec, head dim and length (bf16, B = 16384 / N sequences, H = 2048 / d heads) the generated forward and
backward are built three ways from one plan: `ptr` (tl.load of pointer tiles, as before session 6), `tma`
(tl.make_tensor_descriptor in the kernel, tile loads by the copy engine) and `ws` (tma, and the forward's loop
over full tiles as tl.range(..., warp_specialize=True)). Each variant runs the planned tiles and a few others.
Every run's outputs are compared with the `ptr` variant's planned run first; a run that fails to build or
differs is reported, not timed.

    python benchmarks/tma_probe.py [--specs dense causal] [--dims 128] [--seq 4096 16384] [--variants ptr tma]
                                   [--parts fwd bwd] [--json OUT.json]
"""
import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from attngen.plan import plan as make_plan  # noqa: E402
from attngen.codegen.triton import build_source  # noqa: E402
from attngen.loader import load_module as _load  # noqa: E402
from harness import median_ms, save_results, shipped_spec, versions  # noqa: E402

VARIANTS = {"ptr": dict(tma=False), "tma": dict(tma=True), "ws": dict(tma=True, warp_specialize=True)}
FWD = [(128, 128, 8, 3), (128, 128, 8, 2), (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 4, 2), (64, 128, 4, 3)]
DKDV = [(32, 64, 4, 3), (64, 128, 8, 3), (64, 128, 8, 2), (32, 128, 4, 3), (64, 64, 4, 3), (32, 64, 4, 4), (32, 64, 4, 5),
        (64, 128, 8, 4), (64, 64, 4, 4)]
DQ = [(128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 3), (128, 32, 8, 3), (128, 64, 8, 4), (64, 64, 4, 4)]


def cfg(t):
    bm, bn, w, s = t
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--specs", nargs="+", default=["dense", "causal"])
    ap.add_argument("--dims", nargs="+", type=int, default=[128])
    ap.add_argument("--seq", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--variants", nargs="+", default=["ptr", "tma"])
    ap.add_argument("--parts", nargs="+", default=["fwd", "bwd"])
    ap.add_argument("--few", action="store_true", help="planned tiles and the first alternative only")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for name in args.specs:
        for d in args.dims:
            spec = shipped_spec(name, d)
            base = make_plan(spec, "auto")
            planned = base.tiles()
            modules = {}
            for var in args.variants:
                t0 = time.time()
                try:
                    modules[var] = _load(spec.name, *build_source(dataclasses.replace(base, **VARIANTS[var])))
                except Exception as exc:
                    print(f"{name} d={d} {var}: build failed: {exc}", flush=True)
            for n in args.seq:
                b, h = 16384 // n, 2048 // d
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
                ref_mod = _load(spec.name, *build_source(dataclasses.replace(base, tma=False)))
                o, lse = ref_mod.attention_forward(q, k, v)
                grads = ref_mod.attention_backward(q, k, v, o, lse, do, None)
                for var, mod in modules.items():
                    jobs = []
                    if "fwd" in args.parts:
                        fwd = [planned["fwd"]] + [cfg(t) for t in FWD if cfg(t) != planned["fwd"]]
                        jobs += [("fwd", {**planned, "fwd": c}) for c in (fwd[:2] if args.few else fwd)]
                    if "bwd" in args.parts:
                        kv = [planned["dkdv"]] + [cfg(t) for t in DKDV if cfg(t) != planned["dkdv"]]
                        qq = [planned["dq"]] + [cfg(t) for t in DQ if cfg(t) != planned["dq"]]
                        bwd = [("bwd", planned)] + [("bwd", {**planned, "dkdv": c}) for c in kv[1:]] + [("bwd", {**planned, "dq": c}) for c in qq[1:]]
                        jobs += bwd[:3] if args.few else bwd
                    for part, tiles in jobs:
                        t0 = time.time()
                        row = {"spec": name, "d": d, "N": n, "variant": var, "part": part,
                               "tiles": {key: tiles[key] for key in (("fwd",) if part == "fwd" else ("dkdv", "dq"))}}
                        try:
                            if part == "fwd":
                                out = mod.attention_forward(q, k, v, tiles=tiles)
                                want = (o, lse)
                                fn = lambda: mod.attention_forward(q, k, v, tiles=tiles)  # noqa: E731
                            else:
                                out = mod.attention_backward(q, k, v, o, lse, do, None, tiles=tiles)
                                want = grads
                                fn = lambda: mod.attention_backward(q, k, v, o, lse, do, None, tiles=tiles)  # noqa: E731
                            err = max((x.float() - y.float()).abs().max().item() for x, y in zip(out, want))
                            nan = any(torch.isnan(x).any().item() for x in out)
                            row |= {"max_err": err, "ok": err < 5e-2 and not nan}
                            if row["ok"]:
                                ms = median_ms(fn)
                                flop = 4 * b * h * n * n * d * (0.5 if name == "causal" else 1.0) * (1 if part == "fwd" else 2.5)
                                row |= {"ms": ms, "tflops": flop / ms * 1e-9}
                        except Exception as exc:  # a config that does not build or fit is a result
                            row |= {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
                        row["s"] = round(time.time() - t0, 1)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    print(versions())
    print("\nSUMMARY (TFLOP/s; planned tiles, then the best tiles of each variant)")
    keys = sorted({(r["spec"], r["d"], r["N"], r["part"]) for r in rows}, key=str)
    for key in keys:
        cells = []
        for var in args.variants:
            mine = [r for r in rows if (r["spec"], r["d"], r["N"], r["part"]) == key and r["variant"] == var and r.get("ms")]
            if not mine:
                cells.append(f"{var}: -")
                continue
            best = min(mine, key=lambda r: r["ms"])
            cells.append(f"{var}: {mine[0]['tflops']:.0f} planned, {best['tflops']:.0f} best {best['tiles']}")
        print(f"{key[0]} d={key[1]} N={key[2]} {key[3]}: " + " | ".join(cells), flush=True)
    if args.json:
        save_results(args.json, rows=rows)


if __name__ == "__main__":
    main()
