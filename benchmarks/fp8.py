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
4. Decoding from FP8 key/value caches (kv_dtype = fp8) against bf16 caches, contiguous and paged, CUDA graphs.
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
from attngen.tools import verify
from attngen.lang.check import load_spec
from attngen.lang.spec import DType

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
    # Q and K per 128-token block with the Hadamard rotation, V per head; the spec's inputs as `attngen check` makes them
    o, lse, ref, ref_lse, naive = verify.fp8_case(kern, (1, heads, kv_heads, n, n), "cuda")
    err = (o.double() - ref).abs().max().item()
    naive_err = (naive - ref).abs().max().item()
    bound = 2 * naive_err + 1e-2 * ref.abs().max().item()  # the floor: bf16 rounding of O
    finite = torch.isfinite(ref_lse)
    lse_err = (lse.double()[finite] - ref_lse[finite]).abs().max().item()
    return {"spec": name, "generator": kern.generator.generator, "n": n, "err": err, "naive_err": naive_err, "bound": bound, "lse_err": lse_err,
            "nan": bool(torch.isnan(o).any()),
            # the lse: FP8 products accumulate with fewer bits than float32 on Hopper (14, DeepSeek-V3's report measured on
            # the H800), so the scores carry about 1e-4 relative error; 2e-3 of the largest |lse| bounds what that does
            "ok": err <= bound and lse_err <= 2e-3 * max(1.0, ref_lse[finite].abs().max().item()) and not torch.isnan(o).any()}


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


def decode(quick=False):
    """FP8 key/value caches (kv_dtype = fp8) against bf16 ones: one new token, B = 8, 32 query heads over 8 key/value
    heads, d = 128, contiguous and paged (16-token pages), CUDA-graph replays; the error against float64 attention
    of the unquantized values."""
    from triton.testing import do_bench

    from attngen import kvcache
    from attngen.tools.bench_decode import _graph

    rows = []
    for layout in ("contiguous", "paged"):
        extra = " kv_layout = paged page_size = 16" if layout == "paged" else ""
        bf = attngen.compile(f"attention dec {{ head_dim = 128 dtype = bf16{extra} }}")
        f8 = attngen.compile(f"attention dec8 {{ head_dim = 128 dtype = bf16 kv_dtype = fp8{extra} }}")
        for n in ((8192,) if quick else (8192, 32768)):
            b, hq, hkv = 8, 32, 8
            gen = torch.Generator(device="cuda").manual_seed(0)
            q = torch.randn(b, hq, 1, 128, generator=gen, device="cuda").bfloat16()
            k, v = (torch.randn(b, hkv, n, 128, generator=gen, device="cuda") for _ in range(2))
            ks, vs = (x.abs().amax((0, 2, 3)).float() / 448 for x in (k, v))
            lens = torch.full((b,), n, dtype=torch.int32, device="cuda")
            zero = torch.zeros(b, dtype=torch.int32, device="cuda")
            caches = {}
            for name, dt in (("bf16", torch.bfloat16), ("fp8", torch.float8_e4m3fn)):
                scales = {"k_descale": ks, "v_descale": vs} if dt != torch.bfloat16 else {}
                if layout == "paged":
                    pages = n // 16
                    kc = torch.zeros(b * pages, 16, hkv, 128, device="cuda", dtype=dt)
                    vc = torch.zeros_like(kc)
                    table = {"block_table": torch.arange(b * pages, dtype=torch.int32, device="cuda").view(b, pages)}
                else:
                    kc = torch.zeros(b, hkv, n, 128, device="cuda", dtype=dt)
                    vc = torch.zeros_like(kc)
                    table = {}
                src_k, src_v = (k, v) if scales else (k.bfloat16(), v.bfloat16())
                kvcache.append(kc, vc, src_k, src_v, zero, table.get("block_table"), **scales)
                caches[name] = (kc, vc, table, scales)
            row = {"layout": layout, "keys": n, "batch": b}
            exact = attngen.reference(bf, q.double(), k.double(), v.double(), kv_lens=lens, dtype=torch.float64)
            with torch.no_grad():
                for name, kern in (("bf16", bf), ("fp8", f8)):
                    kc, vc, table, scales = caches[name]
                    out = kern(q, kc, vc, kv_lens=lens, **table, **scales)
                    row[f"{name}_err"] = (out.double() - exact).abs().max().item()
                    graph = _graph(lambda: kern(q, kc, vc, kv_lens=lens, **table, **scales))
                    row[f"{name}_us"] = do_bench(graph.replay) * 1000
                    row[f"{name}_gbs"] = 2 * kc.numel() * kc.element_size() / (row[f"{name}_us"] * 1e-6) / 1e9
            row["speedup"] = row["bf16_us"] / row["fp8_us"]
            # the FP8 cache's decode tiles around the plan's (those were measured for bf16 caches)
            from attngen.plan.decode import decode_shape

            shape = decode_shape(f8.plan, b, hq, hkv, 1, n)
            kc, vc, table, scales = caches["fp8"]
            kv_scales = tuple(x[None, :].expand(b, hkv).contiguous() for x in (ks, vs))
            sweep = {}
            with torch.no_grad():
                for bn, st, w in ((64, 4, 4), (128, 2, 4), (128, 3, 4), (128, 4, 4), (128, 3, 8), (256, 2, 4), (256, 2, 8), (256, 3, 8)):
                    tiles = dict(f8.plan.tiles())
                    tiles["decode"] = {"BLOCK_N": bn, "num_warps": w, "num_stages": st}
                    try:
                        sweep[f"{bn} s{st} w{w}"] = do_bench(lambda: f8.module.attention_decode(
                            q, kc, vc, kv_lens=lens, block_r=shape.block_r, num_splits=shape.splits, tiles=tiles, kv_scales=kv_scales, **table)) * 1000
                    except Exception as e:
                        sweep[f"{bn} s{st} w{w}"] = repr(e)[:100]
            row["fp8_sweep_us"] = sweep
            rows.append(row)
            print(json.dumps(row), flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--decode-only", action="store_true", help="only part 4")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/fp8.json")
    args = ap.parse_args()
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__}
    cases = [("dense d128", spec_text(None, 128)), ("causal d128", spec_text("q_idx >= kv_idx", 128)),
             ("window d128", spec_text("q_idx >= kv_idx and q_idx - kv_idx < 256", 128)), ("causal d64", spec_text("q_idx >= kv_idx", 64)),
             ("alibi d64", spec_text("q_idx >= kv_idx", 64, "score - slopes[h] * (q_idx - kv_idx)", " input slopes: fp32[H]\n")),
             ("alibi d128", spec_text("q_idx >= kv_idx", 128, "score - slopes[h] * (q_idx - kv_idx)", " input slopes: fp32[H]\n"))]
    # d = 128: both generators (the Gluon FP8 forward is written for 128); d = 64: the Triton generator's
    results["check"] = [] if args.decode_only else [check(name, text, backend=backend) for name, text in cases
                        for backend in (("gluon", "triton") if "d128" in name else (None,))]
    for r in results["check"]:
        print(json.dumps(r), flush=True)
    results["outliers"] = {} if args.decode_only else outliers()
    print(json.dumps(results["outliers"]), flush=True)
    results["speed"] = [] if args.decode_only else speed(args.quick)
    results["decode"] = decode(args.quick)
    Path(args.out).write_text(json.dumps(results, indent=1))
    print("\n== summary ==")
    for r in results["check"]:
        print(f"check {r['spec']:<12} {r['generator']:<7} ok={r['ok']} err {r['err']:.2e} (naive fp8 {r['naive_err']:.2e}, bound {r['bound']:.2e}) lse {r['lse_err']:.1e}")
    print("outliers RMSE: " + ", ".join(f"{k} {v:.2e}" for k, v in results["outliers"].items()))
    for r in results["decode"]:
        print(f"decode {r['layout']:<10} N={r['keys']:<6} bf16 cache {r['bf16_us']:.0f} us ({r['bf16_gbs']:.0f} GB/s, err {r['bf16_err']:.1e}), "
              f"fp8 cache {r['fp8_us']:.0f} us ({r['fp8_gbs']:.0f} GB/s, err {r['fp8_err']:.1e}): {r['speedup']:.2f}x; fp8 tiles (eager) "
              + ", ".join(f"{c} {t:.0f}" if isinstance(t, float) else f"{c} fail" for c, t in r["fp8_sweep_us"].items()))
    for r in results["speed"]:
        print(f"{'causal' if r['causal'] else 'dense '} N={r['n']:<6} bf16 ({r['bf16_generator']}) {r['bf16_tflops']:.0f} TFLOP/s, bf16 triton {r['bf16_triton_tflops']:.0f}, "
              f"fp8 ({r['fp8_generator']}) {r['fp8_tflops']:.0f} ({r['fp8_tflops'] / r['bf16_tflops']:.2f}x), fp8 triton {r['fp8_triton_tflops']:.0f}, best fp8 triton tiles {r['fp8_best']['config']} {r['fp8_best']['tflops']:.0f} "
              f"({r['fp8_best']['tflops'] / r['bf16_tflops']:.2f}x); V transpose {r['v_transpose_ms'] * 1000:.0f} us (torch's {r['torch_transpose_ms'] * 1000:.0f})")


if __name__ == "__main__":
    main()
