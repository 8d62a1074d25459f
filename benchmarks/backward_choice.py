"""The measurements behind `auto`'s choice of backward (attngen.codegen.gluon.choice): for each kind of spec the
choice rules name, the backward through the Gluon generator with dQ added in a fixed order (deterministic = true,
the default), in no fixed order (deterministic = false), and through the Triton generator, on the same inputs in
one process (bf16, H * d = 2048, B * N = 16384; backward ms through autograd, `do_bench` medians, the forward's
time taken off).

    python benchmarks/backward_choice.py [--quick] [--only SPEC ...] [--json OUT.json]

Cases: dense and causal by length, head_dim 64 and 128; a sliding window of 1024
(band masks); documents of 256-2048 tokens (tile classes from the input pre-pass); random 128 x 128 blocks kept
with probability 1/2 and 1/4, B=2 N=8192 (runtime block sparsity). Each provider's output is checked against the
float32 naive reference on one batch entry and two heads before it is timed.
"""
import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import attngen  # noqa: E402
from attngen.lang.check import load_spec  # noqa: E402
from attngen.lang.spec import DType  # noqa: E402
from harness import measure, versions  # noqa: E402
from attngen.tools.bench import random_documents  # noqa: E402
from sparse_dropout import random_blocks  # noqa: E402


def spec_of(name: str, d: int):
    spec = load_spec((ROOT / "specs" / f"{name}.attn").read_text(), f"specs/{name}.attn")
    return dataclasses.replace(spec, head_dim=d, dtype=DType.BF16)


def cases(quick: bool):
    """(spec name, head_dim, N, batch, label)."""
    out = [("dense", 128, n, 16384 // n, "") for n in ((1024, 4096) if quick else (1024, 2048, 4096))]
    out += [("causal", 128, n, 16384 // n, "") for n in ((1024, 4096) if quick else (1024, 2048, 4096))]
    if not quick:
        out += [(name, 64, n, 16384 // n, "") for name in ("dense", "causal") for n in (1024, 4096)]
    out += [("sliding_window", 128, n, 16384 // n, "") for n in (4096, 16384)]
    out += [("document", 128, n, 16384 // n, "") for n in (4096, 16384)]
    out += [("block_sparse_runtime", 128, 8192, 2, f"1/{inv}") for inv in (2, 4)]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="fewer lengths and no head_dim 64")
    ap.add_argument("--only", nargs="+", default=None, help="only these cases' specs (e.g. document)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    rows = []
    for name, d, n, batch, label in cases(args.quick):
        if args.only and name not in args.only:
            continue
        h = 2048 // d
        gen = torch.Generator(device="cuda").manual_seed(n + d)
        q, k, v, do = (torch.randn(batch, h, n, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
        for t in (q, k, v):
            t.requires_grad_()
        inputs = {}
        if name == "document":
            inputs["doc"] = random_documents(batch, n, torch.Generator().manual_seed(n)).cuda()
        if name == "block_sparse_runtime":
            inputs["block_mask"] = random_blocks(1 / int(label[2:]), torch.Generator().manual_seed(int(label[2:]))).cuda()
        spec = spec_of(name, d)
        auto = attngen.compile(spec).generator  # the generators auto gives a call of n keys
        kerns = {"ordered": attngen.compile(spec, backend="gluon"),
                 "unordered": attngen.compile(dataclasses.replace(spec, deterministic=False), backend="gluon"),
                 "triton": attngen.compile(spec, backend="triton")}
        ref = attngen.reference(kerns["triton"], q[:1, :2].float(), k[:1, :2].float(), v[:1, :2].float(),
                                **{key: t[:1, :2] if key == "block_mask" else t[:1] for key, t in inputs.items()})
        row = {"spec": name, "d": d, "N": n, "B": batch, "H": h, "case": label,
               "auto": "{} / {}".format(*(pick(n) for pick in (auto.forward_at, auto.backward_at)))}
        for key, kern in kerns.items():
            r = measure(key, lambda q, k, v, kern=kern: kern(q, k, v, **inputs), q, k, v, do,
                        lambda out: (out[:1, :2].float() - ref).abs().max().item(), 1.0)
            row[key] = {x: r[x] for x in ("fwd_ms", "bwd_ms", "max_err", "error") if x in r}
        rows.append(row)
        print(json.dumps(row), flush=True)
    print(f"\n{versions()}")
    print("backward ms: Gluon with dQ in a fixed order / in no fixed order / the Triton generator; each Gluon one as the Triton one's"
          " time over its own (> 1: faster)")
    print(f"{'case':<34}{'ordered':>9}{'unordered':>11}{'triton':>9}{'ord÷tri':>9}{'unord÷tri':>11}   auto")
    for row in rows:
        t = {key: row[key].get("bwd_ms") for key in ("ordered", "unordered", "triton")}
        label = f"{row['spec']} d={row['d']} N={row['N']} {row['case']}".strip()
        cells = "".join(f"{t[key]:>9.3f}" if t[key] else f"{'error':>9}" for key in ("ordered", "unordered", "triton"))
        ratios = "".join(f"{t['triton'] / t[key]:>10.2f}" if t[key] and t["triton"] else f"{'-':>10}" for key in ("ordered", "unordered"))
        print(f"{label:<34}{cells}{ratios}   {row['auto']}")
    if args.json:
        Path(args.json).write_text(json.dumps({"versions": versions(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
