"""Sweep tile sizes, warps and pipeline stages around the derived plan, one kernel at a time (GPU only).

For each spec (bf16, d=128, H=16, one sequence of N tokens) the forward, the dK/dV kernel and the dQ kernel
are varied separately: a forward config is timed on attention_forward; a dK/dV or dQ config on the whole
attention_backward with the other kernel left as planned (so differences between rows are that kernel's).
Every config's outputs are compared with the planned kernels' first. Prints the planned time and the best.

    python benchmarks/sweep.py [--seq 16384] [--specs causal sliding_window] [--json OUT.json]
"""
import argparse
import dataclasses
import itertools
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import attngen  # noqa: E402
from attngen.codegen.triton import build_source  # noqa: E402
from attngen.loader import load_module as _load  # noqa: E402
from harness import median_ms, save_results, shipped_spec, versions  # noqa: E402

H, D = 16, 128
FWD = [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=s)
       for bm, bn, w, s in itertools.product((64, 128), (64, 128), (4, 8), (2, 3, 4)) if not (bm == 64 and w == 8)]
DKDV = [dict(bwd_block_m=bm, bwd_block_n=bn, bwd_num_warps=w, bwd_num_stages=s)
        for bm, bn, w, s in itertools.product((32, 64), (64, 128), (4, 8), (2, 3, 4)) if not (bn == 64 and w == 8)]
DQ = [dict(dq_block_m=bm, dq_block_n=bn, dq_num_warps=w, dq_num_stages=s)
      for bm, bn, w, s in itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3)) if not (bm == 64 and w == 8)]


def load(plan):
    return _load(plan.spec.name, *build_source(plan))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--seq", type=int, default=16384)
    ap.add_argument("--specs", nargs="+", default=["causal", "sliding_window"])
    ap.add_argument("--parts", nargs="+", default=["fwd", "dkdv", "dq"])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    n, dev = args.seq, "cuda"
    results = []
    for name in args.specs:
        spec = shipped_spec(name, D)
        base = attngen.compile(spec)
        gen = torch.Generator(device=dev).manual_seed(0)
        q, k, v, do = (torch.randn(1, H, n, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4))
        o, lse = base.module.attention_forward(q, k, v)
        grads = base.module.attention_backward(q, k, v, o, lse, do, None)
        for part, configs in (("fwd", FWD), ("dkdv", DKDV), ("dq", DQ)):
            if part not in args.parts:
                continue
            planned = {key: getattr(base.plan, key) for key in configs[0]}
            rows = []
            for cfg in [planned] + [c for c in configs if c != planned]:
                t0 = time.time()
                try:
                    mod = load(dataclasses.replace(base.plan, **cfg))
                    if part == "fwd":
                        out = mod.attention_forward(q, k, v)
                        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(out, (o, lse)))
                        ms = median_ms(lambda: mod.attention_forward(q, k, v))
                    else:
                        out = mod.attention_backward(q, k, v, o, lse, do, None)
                        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(out, grads))
                        ms = median_ms(lambda: mod.attention_backward(q, k, v, o, lse, do, None))
                    ok = err < 5e-2
                except Exception as exc:  # an out-of-resources config is a result, not a crash
                    ms, err, ok = float("inf"), float("nan"), False
                    cfg = {**cfg, "error": f"{type(exc).__name__}: {exc}"[:200]}
                rows.append({"spec": name, "N": n, "part": part, **cfg, "ms": ms, "max_err": err, "ok": ok, "build_s": time.time() - t0})
                print(json.dumps(rows[-1]), flush=True)
            results += rows
            good = [r for r in rows if r["ok"]]
            best = min(good, key=lambda r: r["ms"])
            cfg_str = lambda r: " ".join(f"{k.split('_', 1)[-1] if k.startswith(('bwd_', 'dq_')) else k}={r[k]}" for k in configs[0])  # noqa: E731
            print(f"SUMMARY {name} N={n} {part}: planned {rows[0]['ms']:.3f} ms ({cfg_str(rows[0])}); "
                  f"best {best['ms']:.3f} ms ({cfg_str(best)}); planned/best = {rows[0]['ms'] / best['ms']:.2f}", flush=True)
    print(versions())
    if args.json:
        save_results(args.json, rows=results)


if __name__ == "__main__":
    main()
