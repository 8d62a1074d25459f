"""The forward at each head dim through both generators, against SDPA's cuDNN and flash kernels (the
Gluon generator's head dims). bf16, B * N = 16384 tokens, H * d = 2048; dense and causal; every provider in this
process on the same random inputs, checked against the float32 reference (first batch entry, two heads) before
it is timed. Forward / backward ms and TFLOP/s; a head dim without a Gluon backward runs the Triton one (the
`gluon` column's backward says which).

    python benchmarks/head_dims.py [--dims 64 128 256] [--seq 4096 16384] [--json OUT.json]
"""
import argparse
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import attngen  # noqa: E402
from harness import SDPA_CUDNN, SDPA_FLASH, measure, save_results, sdpa, versions  # noqa: E402


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dims", type=int, nargs="+", default=[64, 128, 256])
    ap.add_argument("--seq", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for d in args.dims:
        for causal in (False, True):
            mask = "mask = q_idx >= kv_idx" if causal else ""
            text = f"attention d{d} {{ head_dim = {d} dtype = bf16 {mask} }}"
            kerns = {"gluon": attngen.compile(text, backend="gluon"), "triton": attngen.compile(text, backend="triton")}
            for n in args.seq:
                batch, heads = max(1, 16384 // n), 2048 // d
                gen = torch.Generator(device="cuda").manual_seed(n + d)
                q, k, v, do = (torch.randn(batch, heads, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
                for t in (q, k, v):
                    t.requires_grad_()
                ref = attngen.reference(kerns["triton"].spec, q[:1, :2].float(), k[:1, :2].float(), v[:1, :2].float())
                err = lambda out: (out[:1, :2].float() - ref).abs().max().item()  # noqa: E731
                flop = 4 * batch * heads * n * n * d * (0.5 if causal else 1.0)
                row = {"d": d, "N": n, "causal": causal, "gluon_backward": kerns["gluon"].generator.backward}
                for name, kern in kerns.items():
                    row[name] = measure(name, lambda q, k, v, kern=kern: kern(q, k, v), q, k, v, do, err, flop)
                for name, backend in (("cudnn", SDPA_CUDNN), ("flash", SDPA_FLASH)):
                    row[name] = measure(name, lambda q, k, v, backend=backend: sdpa(backend, q, k, v, causal), q, k, v, do, err, flop)
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(f"\n{versions()}; bf16, B*N = 16384, H*d = 2048; TFLOP/s forward / backward (gluon's backward: its generator)")
    names = ("gluon", "triton", "cudnn", "flash")
    print(f"{'config':<22}" + "".join(f"{p:>16}" for p in names) + f"{'gluon/triton':>14}{'gluon/cudnn':>13}")
    for r in rows:
        cell = lambda x: f"{x['fwd_tflops']:6.0f} /{x['bwd_tflops']:5.0f}" if "fwd_ms" in x else f"{'error':>13}"  # noqa: E731
        ratio = lambda a, b: f"{r[b]['fwd_ms'] / r[a]['fwd_ms']:.2f}/{r[b]['bwd_ms'] / r[a]['bwd_ms']:.2f}" if "fwd_ms" in r[a] and "fwd_ms" in r[b] else "-"  # noqa: E731
        name = f"d={r['d']} N={r['N']} {'causal' if r['causal'] else 'dense'} ({r['gluon_backward'][0]})"
        print(f"{name:<22}" + "".join(f"{cell(r[p]):>16}" for p in names) + f"{ratio('gluon', 'triton'):>14}{ratio('gluon', 'cudnn'):>13}")
    for r in rows:
        for p in names:
            if "error" in r[p]:
                print(f"ERROR d={r['d']} N={r['N']} {p}: {r[p]['error']}")
    if args.json:
        save_results(args.json, rows=rows)


if __name__ == "__main__":
    main()
