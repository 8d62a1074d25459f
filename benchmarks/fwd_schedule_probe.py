"""Two changes to the forward's loop body, measured on a hand-written copy of the generated dense forward (GPU only).

- FMA: the row maximum is taken on the raw products and the scale folded into the exponent's argument,
  p = exp2(qk * C - m) (one fused multiply-add per score) instead of s = qk * C; p = exp2(s - m) (two).
- PIPE: the product for the next key tile, S_{j+1} = Q K_{j+1}^T, is issued before the softmax of tile j, so the
  tensor cores work on it while the softmax runs (FlashAttention-3's intra-warpgroup overlap, written in the
  source; Triton's wgmma lowering waits for a product only where it is first used).

Dense attention (no mask), bf16, N divisible by the key tile; outputs are compared with the generated kernel's.

    python benchmarks/fwd_schedule_probe.py [--dims 128 64] [--seq 4096 16384] [--json OUT.json]
"""
import argparse
import dataclasses
import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from attngen.plan import plan as make_plan  # noqa: E402
from attngen.codegen.triton import build_source  # noqa: E402
from attngen.loader import load_module as _load  # noqa: E402
from harness import median_ms, save_results, shipped_spec, versions  # noqa: E402


@triton.jit
def _step(qk, v, m_i, l_i, acc, qk_scale, FMA: tl.constexpr):
    """One key tile of the online softmax: the new (acc, l_i, m_i)."""
    if FMA:
        m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
        p = tl.math.exp2(qk * qk_scale - m_ij[:, None])
    else:
        s = qk * qk_scale
        m_ij = tl.maximum(m_i, tl.max(s, 1))
        p = tl.math.exp2(s - m_ij[:, None])
    alpha = tl.math.exp2(m_i - m_ij)
    acc = acc * alpha[:, None]
    acc = tl.dot(p.to(v.dtype), v, acc)
    return acc, l_i * alpha + tl.sum(p, 1), m_ij


@triton.jit
def _fwd(Q, K, V, Out, LSE, stride_b, stride_h, stride_m, num_heads, n, qk_scale,
         D: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FMA: tl.constexpr, PIPE: tl.constexpr):
    start_m = tl.program_id(0)
    off_bh = tl.program_id(1)
    b = off_bh // num_heads
    h = off_bh % num_heads
    base = b * stride_b + h * stride_h
    offs_m = start_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, D)
    q = tl.load(Q + base + offs_m[:, None] * stride_m + offs_d[None, :])
    k_ptrs = K + base + offs_n[:, None] * stride_m + offs_d[None, :]
    v_ptrs = V + base + offs_n[:, None] * stride_m + offs_d[None, :]
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    if PIPE:
        qk = tl.dot(q, tl.trans(tl.load(k_ptrs)))
        for start_n in range(0, n - BLOCK_N, BLOCK_N):
            # the next tile's product first: it runs on the tensor cores during this tile's softmax
            qk_next = tl.dot(q, tl.trans(tl.load(k_ptrs + (start_n + BLOCK_N) * stride_m)))
            acc, l_i, m_i = _step(qk, tl.load(v_ptrs + start_n * stride_m), m_i, l_i, acc, qk_scale, FMA)
            qk = qk_next
        acc, l_i, m_i = _step(qk, tl.load(v_ptrs + (n - BLOCK_N) * stride_m), m_i, l_i, acc, qk_scale, FMA)
    else:
        for start_n in range(0, n, BLOCK_N):
            qk = tl.dot(q, tl.trans(tl.load(k_ptrs + start_n * stride_m)))
            acc, l_i, m_i = _step(qk, tl.load(v_ptrs + start_n * stride_m), m_i, l_i, acc, qk_scale, FMA)
    acc = acc / l_i[:, None]
    tl.store(LSE + off_bh * n + offs_m, m_i + tl.math.log2(l_i))
    tl.store(Out + base + offs_m[:, None] * stride_m + offs_d[None, :], acc.to(Out.dtype.element_ty))


def run(q, k, v, bm, bn, w, s, fma, pipe):
    b, h, n, d = q.shape
    o = torch.empty_like(q)
    lse = torch.empty((b, h, n), device=q.device, dtype=torch.float32)
    _fwd[(n // bm, b * h)](q, k, v, o, lse, q.stride(0), q.stride(1), q.stride(2), h, n, d ** -0.5 * 1.4426950408889634,
                           D=d, BLOCK_M=bm, BLOCK_N=bn, FMA=fma, PIPE=pipe, num_warps=w, num_stages=s)
    return o, lse


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", nargs="+", type=int, default=[128, 64])
    ap.add_argument("--seq", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for d in args.dims:
        spec = shipped_spec("dense", d)
        plan = dataclasses.replace(make_plan(spec, "auto"), tma=False)
        gen = _load(spec.name, *build_source(plan))
        tiles = plan.tiles()["fwd"]
        configs = [(tiles["BLOCK_M"], tiles["BLOCK_N"], tiles["num_warps"], tiles["num_stages"])]
        configs += [c for c in ((128, 128, 8, 2), (128, 64, 8, 3), (128, 64, 8, 2), (128, 128, 8, 3)) if c not in configs]
        for n in args.seq:
            bsz, h = 16384 // n, 2048 // d
            g = torch.Generator(device="cuda").manual_seed(0)
            q, k, v = (torch.randn(bsz, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(3))
            o, lse = gen.attention_forward(q, k, v)
            flop = 4 * bsz * h * n * n * d
            ms = median_ms(lambda: gen.attention_forward(q, k, v))
            rows.append({"d": d, "N": n, "kernel": "generated", "tiles": configs[0], "ms": ms, "tflops": flop / ms * 1e-9})
            print(json.dumps(rows[-1]), flush=True)
            for (bm, bn, w, s), fma, pipe in itertools.product(configs, (False, True), (False, True)):
                row = {"d": d, "N": n, "kernel": f"fma={int(fma)} pipe={int(pipe)}", "tiles": (bm, bn, w, s)}
                try:
                    out = run(q, k, v, bm, bn, w, s, fma, pipe)
                    err = max((x.float() - y.float()).abs().max().item() for x, y in zip(out, (o, lse)))
                    row["max_err"] = err
                    if err < 2e-2 and not torch.isnan(out[0]).any():
                        t = median_ms(lambda: run(q, k, v, bm, bn, w, s, fma, pipe))
                        row |= {"ms": t, "tflops": flop / t * 1e-9}
                except Exception as exc:
                    row["error"] = f"{type(exc).__name__}: {exc}"[:200]
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(versions())
    print("\nSUMMARY (TFLOP/s, forward, dense)")
    for d, n in sorted({(r["d"], r["N"]) for r in rows}):
        mine = [r for r in rows if (r["d"], r["N"]) == (d, n) and r.get("tflops")]
        gen = next(r for r in mine if r["kernel"] == "generated")
        parts = [f"generated {gen['tflops']:.0f}"]
        for kern in sorted({r["kernel"] for r in mine} - {"generated"}):
            best = max((r for r in mine if r["kernel"] == kern), key=lambda r: r["tflops"])
            parts.append(f"{kern}: {best['tflops']:.0f} {best['tiles']}")
        print(f"d={d} N={n}: " + " | ".join(parts), flush=True)
    if args.json:
        save_results(args.json, rows=rows)


if __name__ == "__main__":
    main()
