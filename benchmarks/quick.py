"""Baseline timing on a GPU: attngen against torch SDPA (flash and cuDNN backends) and FlexAttention.

bf16, head_dim 128, H = 16 heads, B * N = 16384 tokens; masks none and causal. Forward and backward timed
separately (backward = median(fwd+bwd) - median(fwd)) with triton.testing.do_bench medians after warm-up, all
providers in this process on the same random inputs, each checked against SDPA's output first.
TFLOP/s: forward = 4 B H N^2 d * (kept fraction), backward = 2.5 x forward.

    python benchmarks/quick.py [--json OUT.json]
"""
import argparse
import json
import os
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import attngen  # noqa: E402
from harness import SDPA_CUDNN, SDPA_FLASH, flex, matmul_tflops, measure, sdpa, versions  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = "cuda"
    H, D = 16, 128
    kernels = {"none": attngen.compile(ROOT / "specs" / "dense.attn"), "causal": attngen.compile(ROOT / "specs" / "causal.attn")}
    rows = []
    for N in (4096, 16384):
        B = 16384 // N
        for mask in ("none", "causal"):
            gen = torch.Generator(device=dev).manual_seed(N)
            q, k, v, do = (torch.randn(B, H, N, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4))
            for t in (q, k, v):
                t.requires_grad_()
            causal = mask == "causal"
            frac = (N + 1) / (2 * N) if causal else 1.0
            fwd_flop = 4 * B * H * N * N * D * frac
            block_mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, N, N, device=dev) if causal else None
            providers = {
                "attngen": lambda q, k, v, kern=kernels[mask]: kern(q, k, v),
                "flex": lambda q, k, v, bm=block_mask: flex(q, k, v, block_mask=bm),
                "sdpa_flash": lambda q, k, v, c=causal: sdpa(SDPA_FLASH, q, k, v, c),
                "sdpa_cudnn": lambda q, k, v, c=causal: sdpa(SDPA_CUDNN, q, k, v, c),
            }
            with torch.no_grad():
                ref = sdpa(SDPA_FLASH, q, k, v, causal).float()
            row = {"N": N, "B": B, "H": H, "d": D, "mask": mask}
            for name, fn in providers.items():
                row[name] = measure(name, fn, q, k, v, do, lambda out: (out.float() - ref).abs().max().item(), fwd_flop)
            rows.append(row)
            print(json.dumps(row), flush=True)
    mm = matmul_tflops()
    print(f"\nbf16 8192^3 matmul: {mm:.0f} TFLOP/s   ({versions()})")
    print(f"{'config':<18}" + "".join(f"{p:>16}" for p in ("attngen", "flex", "sdpa_flash", "sdpa_cudnn")) + f"{'vs flex':>14}{'vs cudnn':>14}")
    for row in rows:
        cells = []
        for p in ("attngen", "flex", "sdpa_flash", "sdpa_cudnn"):
            r = row.get(p, {})
            cells.append(f"{r['fwd_tflops']:6.0f} /{r['bwd_tflops']:5.0f}" if "fwd_tflops" in r else f"{'error':>13}")
        ratio = lambda p: (f"{row['attngen']['fwd_tflops'] / row[p]['fwd_tflops']:.2f}/{row['attngen']['bwd_tflops'] / row[p]['bwd_tflops']:.2f}"  # noqa: E731
                           if "fwd_tflops" in row.get("attngen", {}) and "fwd_tflops" in row.get(p, {}) else "-")
        print(f"{'N=' + str(row['N']) + ' ' + row['mask']:<18}" + "".join(f"{c:>16}" for c in cells) + f"{ratio('flex'):>14}{ratio('sdpa_cudnn'):>14}")
    if args.json:
        Path(args.json).write_text(json.dumps({"matmul_tflops": mm, "rows": rows}, indent=1))


if __name__ == "__main__":
    os.environ.setdefault("TORCHINDUCTOR_FX_GRAPH_CACHE", "1")
    main()
