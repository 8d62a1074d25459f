"""The backward's dQ: its own kernel, or added by the dK/dV kernel with atomics (GPU only).

`KernelPlan.dq_atomics`: "none" is the two-kernel backward (dK/dV, then dQ; 7 matrix products per tile pair, no
atomics); "pointer" and "descriptor" let the dK/dV kernel also compute dS K and add it into a float32 dQ, with
pointer atomics or the copy engine's reduce-add (5 products). For each spec, head dim and length (bf16,
B = 16384 / N sequences, H = 2048 / d heads) this times the planned two-kernel backward and the atomic ones over a
few dK/dV tiles; every run's gradients are compared with the two-kernel backward's first, and a run that fails
to build or differs is reported, not timed.

    python benchmarks/dq_atomics_probe.py [--specs dense causal] [--dims 128] [--seq 4096 16384]
                                          [--modes none pointer descriptor] [--json OUT.json]
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
from attngen.render import build_source  # noqa: E402
from attngen.runtime import _load  # noqa: E402
from harness import median_ms, save_results, shipped_spec, versions  # noqa: E402

# dK/dV tiles (BLOCK_M queries, BLOCK_N keys, warps, stages) tried with atomics, after the planned ones: the atomic
# traffic falls with the key tile (one BLOCK_M x d addition per query tile per key tile)
ATOMIC_DKDV = {128: [(64, 128, 8, 2), (64, 128, 8, 3), (32, 128, 8, 3), (64, 64, 4, 2)],
               64: [(64, 128, 8, 2), (64, 128, 8, 3), (128, 128, 8, 2), (32, 128, 8, 3), (64, 64, 4, 2)]}


def cfg(t):
    bm, bn, w, s = t
    return {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}


def side_stream_dq(source: str) -> str:
    """The two-kernel backward with its dQ kernel launched on a second CUDA stream, so that it runs alongside
    the dK/dV kernel (both only read the inputs)."""
    start = source.index('    config = tiles["dq"]')
    end = source.index("        **config,\n    )\n", start) + len("        **config,\n    )\n")
    block = "".join("    " + line if line.strip() else line for line in source[start:end].splitlines(True))
    launch = "    main = torch.cuda.current_stream()\n    _SIDE.wait_stream(main)  # after the pre-pass\n    with torch.cuda.stream(_SIDE):\n" + block
    source = source[:start] + "    main.wait_stream(_SIDE)\n" + source[end:]
    at = source.index('    config = tiles["dkdv"]')
    return source[:at] + launch + source[at:] + "\n\n_SIDE = torch.cuda.Stream()\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--specs", nargs="+", default=["dense", "causal"])
    ap.add_argument("--dims", nargs="+", type=int, default=[128])
    ap.add_argument("--seq", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--modes", nargs="+", default=["none", "pointer", "descriptor"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for name in args.specs:
        for d in args.dims:
            spec = shipped_spec(name, d)
            base = make_plan(spec, "auto")
            planned = base.tiles()
            modules = {}
            for mode in dict.fromkeys(["none", *args.modes]):
                try:
                    key, source = build_source(dataclasses.replace(base, dq_atomics="none" if mode == "stream" else mode))
                    if mode == "stream":
                        key, source = key + "_stream", side_stream_dq(source)
                    modules[mode] = _load(spec.name, key, source)
                except Exception as exc:
                    print(f"{name} d={d} {mode}: build failed: {exc}", flush=True)
            for n in args.seq:
                b, h = 16384 // n, 2048 // d
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, do = (torch.randn(b, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
                o, lse = modules["none"].attention_forward(q, k, v)
                want = modules["none"].attention_backward(q, k, v, o, lse, do, None)
                for mode, mod in modules.items():
                    if mode not in args.modes:
                        continue
                    configs = [planned["dkdv"]] + ([] if mode == "none" else [cfg(t) for t in ATOMIC_DKDV.get(d, []) if cfg(t) != planned["dkdv"]])
                    for c in configs:
                        t0 = time.time()
                        tiles = {**planned, "dkdv": c}
                        row = {"spec": name, "d": d, "N": n, "mode": mode, "dkdv": c}
                        fn = lambda: mod.attention_backward(q, k, v, o, lse, do, None, tiles=tiles)  # noqa: E731
                        try:
                            got = fn()
                            err = max((x.float() - y.float()).abs().max().item() for x, y in zip(got, want))
                            nan = any(torch.isnan(x).any().item() for x in got)
                            row |= {"max_err": err, "ok": err < 5e-2 and not nan}
                            if row["ok"]:
                                ms = median_ms(fn)
                                flop = 2.5 * 4 * b * h * n * n * d * (0.5 if name == "causal" else 1.0)
                                row |= {"ms": ms, "tflops": flop / ms * 1e-9}
                        except Exception as exc:  # a config that does not build or fit is a result
                            row |= {"ok": False, "error": f"{type(exc).__name__}: {exc}"[:300]}
                        row["s"] = round(time.time() - t0, 1)
                        rows.append(row)
                        print(json.dumps(row), flush=True)
    print(versions())
    print("\nSUMMARY (backward TFLOP/s: the planned two-kernel backward, then the best dK/dV tiles of each atomic mode)")
    for key in sorted({(r["spec"], r["d"], r["N"]) for r in rows}, key=str):
        mine = [r for r in rows if (r["spec"], r["d"], r["N"]) == key and r.get("ms")]
        base = [r for r in mine if r["mode"] == "none"]
        cells = [f"none {base[0]['tflops']:.0f}" if base else "none -"]
        for mode in args.modes:
            if mode == "none":
                continue
            runs = [r for r in mine if r["mode"] == mode]
            if not runs:
                cells.append(f"{mode} -")
                continue
            best = min(runs, key=lambda r: r["ms"])
            c = best["dkdv"]
            ratio = f" ({base[0]['ms'] / best['ms']:.2f}x)" if base else ""
            cells.append(f"{mode} {best['tflops']:.0f}{ratio} at {c['BLOCK_M']}x{c['BLOCK_N']}/{c['num_warps']}w/{c['num_stages']}s")
        print(f"{key[0]} d={key[1]} N={key[2]}: " + " | ".join(cells), flush=True)
    if args.json:
        save_results(args.json, rows=rows)


if __name__ == "__main__":
    main()
