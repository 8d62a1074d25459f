"""Packed variable-length batches on the GPU: attngen's cu_seqlens path against FlexAttention's
document mask and attngen's own document-mask spec on the same packing.

bf16, head_dim 128, H = 16, 16384 tokens packed from random lengths 256-4096 (the last one cut at 16384), in
flash_attn's layout (total, H, D). Providers, all in this process on the same random inputs, each checked
against FlexAttention's output before it is timed:
  varlen        attngen.compile(specs/causal.attn)(q, k, v, cu_seqlens_q=, cu_seqlens_k=, max_seqlen_q=, ...)
  varlen_dense  the same with specs/dense.attn: full attention inside each sequence
  document      specs/document.attn (B = 1, N = 16384, doc ids): the mask-and-tile-class way
  flex          torch.compile(flex_attention) with a document mask (causal inside documents, or not)
and attngen's dense kernel over the whole 16384 x 16384 (B = 1) for proportionality: a packing whose kept pairs
are a fraction s of N^2 should take s x the dense time (the issue's target: within 1.15x). TFLOP/s count kept
pairs only: forward = 4 H d x pairs, backward = 2.5 x forward. Then, for one packing, the
forwards of both generators alone (without the call's checks) and the backward's tiles are timed.

    python benchmarks/varlen.py [--packings 3] [--json OUT.json]
"""
import argparse
import json
import sys
from pathlib import Path

import torch
from torch.nn.attention.flex_attention import create_block_mask

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))
import attngen  # noqa: E402
from harness import flex, measure, median_ms, save_results, shipped_spec, versions  # noqa: E402

H, D, TOTAL = 16, 128, 16384
BWD_TILES = [  # (dK/dV BLOCK_M, BLOCK_N, warps), (dQ BLOCK_M, BLOCK_N, warps)
    ((32, 64, 4), (128, 64, 8)), ((64, 64, 4), (64, 64, 4)), ((32, 128, 4), (128, 64, 8)), ((64, 128, 8), (128, 32, 8)),
    ((32, 64, 4), (64, 64, 4)),
]


def packing(seed: int) -> list[int]:
    """Random lengths 256-4096 summing to TOTAL (the last one cut)."""
    gen, lengths = torch.Generator().manual_seed(seed), []
    while sum(lengths) < TOTAL:
        lengths.append(int(torch.randint(256, 4097, (1,), generator=gen)))
    lengths[-1] -= sum(lengths) - TOTAL
    return lengths


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--packings", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    dev = "cuda"
    causal, dense_varlen = attngen.compile(shipped_spec("causal", D)), attngen.compile(shipped_spec("dense", D))
    document = attngen.compile(shipped_spec("document", D))
    dense = attngen.compile(shipped_spec("dense", D))
    print(versions(), "| generators:", causal.generator.generator, document.generator.generator, flush=True)
    rows, sweeps = [], []
    gen = torch.Generator(device=dev).manual_seed(0)
    q4, k4, v4, do4 = (torch.randn(1, H, TOTAL, D, device=dev, dtype=torch.bfloat16, generator=gen) for _ in range(4))
    packed = [t[0].transpose(0, 1).contiguous() for t in (q4, k4, v4, do4)]  # (total, H, D)
    for t in (*packed[:3], q4, k4, v4):
        t.requires_grad_()
    qp, kp, vp, dop = packed

    def as4(out):  # packed (total, H, D) -> (1, H, total, D)
        return out.transpose(0, 1)[None]

    t_dense = measure("dense", lambda q, k, v: dense(q, k, v), q4, k4, v4, do4, lambda o: 0.0, 4 * H * D * TOTAL ** 2)
    print("dense N=16384:", {k: round(v, 4) for k, v in t_dense.items()}, flush=True)
    for seed in range(args.packings):
        lengths = packing(seed)
        cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32, device=dev)
        longest = max(lengths)
        doc = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths)).to(dev, torch.int32)[None]
        pairs = {"causal": sum(n * (n + 1) // 2 for n in lengths), "dense": sum(n * n for n in lengths)}
        for kind in ("causal", "dense"):
            causal_in = kind == "causal"
            mask = (lambda b, h, i, j: (doc[0, i] == doc[0, j]) & (i >= j)) if causal_in else (lambda b, h, i, j: doc[0, i] == doc[0, j])
            block_mask = create_block_mask(mask, None, None, TOTAL, TOTAL, device=dev)
            with torch.no_grad():
                want = flex(q4, k4, v4, block_mask=block_mask).float()

            def error_of(out, want=want):
                out = out if out.dim() == 4 else as4(out)
                return (out.float() - want).abs().max().item()

            kern = causal if causal_in else dense_varlen
            providers = {
                "varlen": (lambda q, k, v, kern=kern: kern(q, k, v, cu_seqlens_q=cu, cu_seqlens_k=cu, max_seqlen_q=longest,
                                                           max_seqlen_k=longest), (qp, kp, vp, dop)),
                "flex": (lambda q, k, v, bm=block_mask: flex(q, k, v, block_mask=bm), (q4, k4, v4, do4)),
            }
            if causal_in:
                providers["document"] = (lambda q, k, v: document(q, k, v, doc=doc), (q4, k4, v4, do4))
            flop = 4 * H * D * pairs[kind]
            row = {"packing": seed, "mask": kind, "sequences": len(lengths), "longest": longest,
                   "fraction": pairs[kind] / TOTAL ** 2}
            for name, (fn, tensors) in providers.items():
                row[name] = measure(name, fn, *tensors, error_of, flop)
            for phase in ("fwd", "bwd"):
                if "error" not in row["varlen"]:
                    row[f"{phase}_vs_dense_share"] = row["varlen"][f"{phase}_ms"] / (row["fraction"] * t_dense[f"{phase}_ms"])
            rows.append(row)
            print(json.dumps(row), flush=True)
            if seed == 0:  # the packed kernels' tiles: what the planned ones leave
                varlen = (cu, cu, longest, longest)
                mod = kern.module
                base = kern.plan.tiles()
                qv, kv, vv = (t.detach().transpose(0, 1)[None] for t in (qp, kp, vp))
                o, lse = mod.attention_forward(qv, kv, vv, varlen=varlen)
                forwards = {"triton": lambda: mod.attention_forward(qv, kv, vv, varlen=varlen)}
                if kern.gluon is not None:
                    forwards["gluon"] = lambda: kern.gluon.attention_forward(qv, kv, vv, varlen=varlen)
                for gen_name, run in forwards.items():  # the kernels alone, without the call's checks
                    err = (run()[0].float() - o.float()).abs().max().item()
                    ms = median_ms(run)
                    sweeps.append({"mask": kind, "forward": gen_name, "ms": ms, "tflops": flop / ms * 1e-9, "err": err})
                    print(json.dumps(sweeps[-1]), flush=True)
                dov = dop.transpose(0, 1)[None]
                ref = mod.attention_backward(qv, kv, vv, o, lse, dov, None, varlen=varlen)
                for (am, an, aw), (bm, bn, bw) in BWD_TILES:
                    tiles = {**base, "dkdv": {"BLOCK_M": am, "BLOCK_N": an, "num_warps": aw, "num_stages": 3},
                             "dq": {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": bw, "num_stages": 3}}
                    try:
                        got = mod.attention_backward(qv, kv, vv, o, lse, dov, None, varlen=varlen, tiles=tiles)
                        err = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, ref))
                        ms = median_ms(lambda: mod.attention_backward(qv, kv, vv, o, lse, dov, None, varlen=varlen, tiles=tiles))
                        sweeps.append({"mask": kind, "dkdv": [am, an, aw], "dq": [bm, bn, bw], "ms": ms,
                                       "tflops": 2.5 * flop / ms * 1e-9, "err": err})
                    except Exception as exc:
                        sweeps.append({"mask": kind, "dkdv": [am, an, aw], "dq": [bm, bn, bw], "error": str(exc)[:200]})
                    print(json.dumps(sweeps[-1]), flush=True)
    if args.json:
        save_results(args.json, dense=t_dense, rows=rows, sweeps=sweeps)
    print("\npacking mask    seqs  longest  fwd TFLOP/s: varlen doc flex  | bwd: varlen doc flex | varlen/flex fwd bwd | vs dense share fwd bwd")
    for r in rows:
        def tf(name, phase):
            p = r.get(name)
            return f"{p[phase + '_tflops']:6.0f}" if p and "error" not in p else "     -"
        def ratio(phase):
            a, b = r["varlen"], r["flex"]
            return f"{b[phase + '_ms'] / a[phase + '_ms']:5.2f}" if "error" not in a and "error" not in b else "    -"
        print(f"{r['packing']:7d} {r['mask']:7s} {r['sequences']:4d} {r['longest']:8d}  {tf('varlen', 'fwd')} {tf('document', 'fwd')} "
              f"{tf('flex', 'fwd')} | {tf('varlen', 'bwd')} {tf('document', 'bwd')} {tf('flex', 'bwd')} | {ratio('fwd')} {ratio('bwd')} | "
              f"{r.get('fwd_vs_dense_share', 0):5.2f} {r.get('bwd_vs_dense_share', 0):5.2f}")
    for r in rows:
        for name in ("varlen", "document", "flex"):
            if name in r and "error" in r[name]:
                print(r["packing"], r["mask"], name, r[name]["error"])


if __name__ == "__main__":
    main()
