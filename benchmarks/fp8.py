"""FP8 attention (dtype = fp8) on the GPU: correctness, FlashAttention-3's accuracy experiment, speed.

    python benchmarks/fp8.py [--quick] [--out results.json]

1. Correctness: FP8 specs (dense, causal, sliding window at d = 128; causal, ALiBi at d = 64) with GQA, O and the
   lse against the float64 attention of the dequantized inputs; budget: twice the error of the naive model of the
   kernels' rounding (float64 attention with P rounded to e4m3, attngen.reference(..., fp8_p=True)) plus a floor.
2. Accuracy (FlashAttention-3's experiment, section 4.3 of its paper): Q, K, V standard normal plus, for 0.1 % of
   the entries, an independent normal term of standard deviation 10; RMSE of O against float64 attention of the
   unquantized inputs, for each quantization (per tensor, per head, per block of 128 tokens, each with and
   without the Hadamard rotation), and bf16 for scale.
3. Speed: the FP8 forward against attngen's bf16 forward (its default generator, and the Triton generator's),
   B * N = 16384, H * d = 2048, dense and causal; tiles swept around the plan; the V transpose's cost alone
   (the module's keys_contiguous, part of every FP8 call; torch's transpose for comparison).
"""
import argparse
import dataclasses
import json
import math
import os
from pathlib import Path

import torch
import triton

import attngen
from attngen import fp8
from attngen.check import load_spec
from attngen.spec import DType

ROOT = Path(__file__).resolve().parent.parent


def spec_text(mask, d, score=None, inputs=""):
    body = f"head_dim = {d}\n dtype = fp8\n{inputs}"
    if mask:
        body += f" mask = {mask}\n"
    if score:
        body += f" score = {score}\n"
    return "attention fp8_bench { " + body + "}"


def check(name, text, n=2048, heads=8, kv_heads=2, backend=None):
    kern = attngen.compile(text, backend=backend)
    d = kern.spec.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(1, heads, n, d, generator=gen, device="cuda")
    k, v = (torch.randn(1, kv_heads, n, d, generator=gen, device="cuda") for _ in range(2))
    inputs = {"slopes": torch.rand(heads, device="cuda") * 0.05} if "slopes" in text else {}
    q8, qd = fp8.quantize(q, "block", hadamard=True)
    k8, kd = fp8.quantize(k, "block", hadamard=True)
    v8, vd = fp8.quantize(v, "head")
    scales = {"q_descale": qd, "k_descale": kd, "v_descale": vd}
    with torch.no_grad():
        o, lse = kern(q8, k8, v8, return_lse=True, **scales, **inputs)
    ref, ref_lse = attngen.reference(kern, q8, k8, v8, dtype=torch.float64, return_lse=True, **scales, **inputs)
    naive = attngen.reference(kern, q8, k8, v8, dtype=torch.float64, fp8_p=True, **scales, **inputs)
    err = (o.double() - ref).abs().max().item()
    naive_err = (naive - ref).abs().max().item()
    bound = 2 * naive_err + 1e-2 * ref.abs().max().item()  # the floor: bf16 rounding of O
    finite = torch.isfinite(ref_lse)
    lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item()
    return {"spec": name, "generator": kern.generator.generator, "n": n, "err": err, "naive_err": naive_err, "bound": bound, "lse_err": lse_err,
            "nan": bool(torch.isnan(o).any()),
            "ok": err <= bound and lse_err <= 1e-4 * max(1.0, ref_lse[finite].abs().max().item()) and not torch.isnan(o).any()}


def outliers(n=4096, heads=8, d=128, seed=0):
    """FlashAttention-3's accuracy experiment: RMSE of O against float64 attention of the unquantized inputs."""
    gen = torch.Generator(device="cuda").manual_seed(seed)

    def sample():
        x = torch.randn(1, heads, n, d, generator=gen, device="cuda")
        spikes = torch.rand(x.shape, generator=gen, device="cuda") < 1e-3
        return x + spikes * torch.randn(x.shape, generator=gen, device="cuda") * 10

    q, k, v = sample(), sample(), sample()
    dense = attngen.compile(spec_text(None, d))
    ref = attngen.reference(dense, q.double(), k.double(), v.double(), dtype=torch.float64)
    rows = {}
    bf16 = attngen.compile(f"attention b {{ head_dim = {d} dtype = bf16 }}")
    with torch.no_grad():
        rows["bf16"] = _rmse(bf16(q.bfloat16(), k.bfloat16(), v.bfloat16()), ref)
        for gran in ("tensor", "head", "block"):
            for had in (False, True):
                q8, qd = fp8.quantize(q, gran, hadamard=had)
                k8, kd = fp8.quantize(k, gran, hadamard=had)
                v8, vd = fp8.quantize(v, "tensor" if gran == "tensor" else "head")
                o = dense(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd)
                rows[f"fp8 {gran}{' + hadamard' if had else ''}"] = _rmse(o, ref)
    return rows


def _rmse(o, ref):
    return (o.double() - ref).pow(2).mean().sqrt().item()


def speed(quick=False):
    from triton.testing import do_bench

    rows = []
    for causal in (False, True):
        mask = "q_idx >= kv_idx" if causal else None
        f8 = attngen.compile(spec_text(mask, 128))
        f8_triton = attngen.compile(spec_text(mask, 128), backend="triton")
        bf = attngen.compile(f"attention b {{ head_dim = 128 dtype = bf16 {'mask = q_idx >= kv_idx' if causal else ''} }}")
        bf_triton = attngen.compile(f"attention b {{ head_dim = 128 dtype = bf16 {'mask = q_idx >= kv_idx' if causal else ''} }}", backend="triton")
        for n in ((4096,) if quick else (4096, 16384)):
            b, h = 16384 // n, 16
            q, k, v = (torch.randn(b, h, n, 128, device="cuda") for _ in range(3))
            q8, qd = fp8.quantize(q, "block")
            k8, kd = fp8.quantize(k, "block")
            v8, vd = fp8.quantize(v, "head")
            qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
            flops = 4 * b * h * n * n * 128 * (0.5 if causal else 1.0)
            blocks = tuple(fp8.descale_blocks(nm, x, b, hh, h, n, q.device, pb) for nm, x, hh, pb in
                           (("q", qd, h, True), ("k", kd, h, True), ("v", vd, h, False)))
            row = {"causal": causal, "n": n, "batch": b, "heads": h}
            with torch.no_grad():
                row["bf16_ms"] = do_bench(lambda: bf(qb, kb, vb))
                row["bf16_generator"] = bf.generator.generator
                row["bf16_triton_ms"] = do_bench(lambda: bf_triton(qb, kb, vb))
                row["fp8_ms"] = do_bench(lambda: f8(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd))
                row["fp8_generator"] = f8.generator.generator
                row["fp8_triton_ms"] = do_bench(lambda: f8_triton(q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd))
                row["v_transpose_ms"] = do_bench(lambda: f8_triton.module.keys_contiguous(v8))  # inside fp8_ms
                row["torch_transpose_ms"] = do_bench(lambda: v8.transpose(2, 3).contiguous())
                sweep = {}
                for bm, bn, w, st in ((128, 128, 8, 3), (128, 128, 8, 4), (64, 128, 4, 3)):
                    tiles = dict(f8_triton.plan.tiles())
                    tiles["fwd"] = {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": st}
                    try:
                        sweep[f"{bm}x{bn} w{w} s{st}"] = do_bench(lambda: f8_triton.module.attention_forward(q8, k8, v8, descales=blocks, tiles=tiles))
                    except Exception as e:  # out of shared memory and the like
                        sweep[f"{bm}x{bn} w{w} s{st}"] = repr(e)[:120]
                row["fp8_sweep_ms"] = sweep
            for key in ("bf16_ms", "bf16_triton_ms", "fp8_ms", "fp8_triton_ms"):
                row[key.replace("_ms", "_tflops")] = flops / row[key] / 1e9
            best = min((t, c) for c, t in sweep.items() if isinstance(t, float))
            row["fp8_best"] = {"config": best[1], "ms": best[0], "tflops": flops / best[0] / 1e9}
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/fp8.json")
    args = ap.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    cases = [("dense d128", spec_text(None, 128)), ("causal d128", spec_text("q_idx >= kv_idx", 128)),
             ("window d128", spec_text("q_idx >= kv_idx and q_idx - kv_idx < 256", 128)), ("causal d64", spec_text("q_idx >= kv_idx", 64)),
             ("alibi d64", spec_text("q_idx >= kv_idx", 64, "score - slopes[h] * (q_idx - kv_idx)", " input slopes: fp32[H]\n")),
             ("alibi d128", spec_text("q_idx >= kv_idx", 128, "score - slopes[h] * (q_idx - kv_idx)", " input slopes: fp32[H]\n"))]
    # d = 128: both generators (the Gluon FP8 forward is written for 128); d = 64: the Triton generator's
    results["check"] = [check(name, text, backend=backend) for name, text in cases
                        for backend in (("gluon", "triton") if "d128" in name else (None,))]
    for r in results["check"]:
        print(json.dumps(r), flush=True)
    results["outliers"] = outliers()
    print(json.dumps(results["outliers"]), flush=True)
    results["speed"] = speed(args.quick)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print("\n== summary ==")
    for r in results["check"]:
        print(f"check {r['spec']:<12} {r['generator']:<7} ok={r['ok']} err {r['err']:.2e} (naive fp8 {r['naive_err']:.2e}, bound {r['bound']:.2e}) lse {r['lse_err']:.1e}")
    print("outliers RMSE: " + ", ".join(f"{k} {v:.2e}" for k, v in results["outliers"].items()))
    for r in results["speed"]:
        print(f"{'causal' if r['causal'] else 'dense '} N={r['n']:<6} bf16 ({r['bf16_generator']}) {r['bf16_tflops']:.0f} TFLOP/s, bf16 triton {r['bf16_triton_tflops']:.0f}, "
              f"fp8 ({r['fp8_generator']}) {r['fp8_tflops']:.0f} ({r['fp8_tflops'] / r['bf16_tflops']:.2f}x), fp8 triton {r['fp8_triton_tflops']:.0f}, best fp8 triton tiles {r['fp8_best']['config']} {r['fp8_best']['tflops']:.0f} "
              f"({r['fp8_best']['tflops'] / r['bf16_tflops']:.2f}x); V transpose {r['v_transpose_ms'] * 1000:.0f} us (torch's {r['torch_transpose_ms'] * 1000:.0f})")


if __name__ == "__main__":
    main()
