"""Host time per kernel call: the eager path (a torch.autograd.Function), the custom op that torch.compile
records (called directly), and, on a GPU, the generated launcher alone (the bare launch). Issue 17's target: a
call within 10 us of the bare launch.

    python benchmarks/call_overhead.py [--device cpu|cuda] [--calls 20000]

On the CPU (Triton's interpreter) the query length is 0, so no kernel runs and only the dispatch is timed; on
a GPU a tiny call (1 x 1 x 128 x 128, bf16) whose launch is host-bound. Medians of 5 rounds, after warm-up.
"""
import argparse
import os
import statistics
import sys
import time
from pathlib import Path

ap = argparse.ArgumentParser()
ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
ap.add_argument("--calls", type=int, default=20000)
args = ap.parse_args()
if args.device == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import attngen  # noqa: E402
from attngen.dtypes import TORCH_DTYPES  # noqa: E402


def per_call_us(fn, calls: int) -> float:
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for _ in range(min(1000, calls)):
        fn()
    rounds = []
    for _ in range(5):
        sync()
        t = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        rounds.append((time.perf_counter() - t) / calls * 1e6)
    return statistics.median(rounds)


def main():
    kern = attngen.compile(ROOT / "specs" / "causal.attn", "h100" if args.device == "cpu" else None)
    dtype = TORCH_DTYPES[kern.spec.dtype.value]
    n = 0 if args.device == "cpu" else 128
    q, k = torch.randn(1, 1, n, 128, device=args.device, dtype=dtype), torch.randn(1, 1, 128, 128, device=args.device, dtype=dtype)
    v = torch.randn_like(k)
    ops = kern._ops()
    rows = {}
    for grad in (True, False):
        leaves = [t.detach().requires_grad_(grad) for t in (q, k, v)]
        with torch.set_grad_enabled(grad):
            rows[f"eager call (autograd.Function), grad={grad}"] = per_call_us(lambda: kern(*leaves), args.calls)
            rows[f"custom op (torch.compile's), grad={grad}"] = per_call_us(lambda: ops.forward(*leaves, [], 0.0, None, None), args.calls)
    if args.device == "cuda":
        rows["generated launcher alone"] = per_call_us(lambda: kern.module.attention_forward(q, k, v), args.calls)
        if kern.gluon is not None:
            rows["Gluon launcher alone"] = per_call_us(lambda: kern.gluon.attention_forward(q, k, v), args.calls)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (no kernel runs: Nq = 0)"
    print(f"host time per call, us ({name}; torch {torch.__version__}; median of 5 rounds of {args.calls})")
    for what, us in rows.items():
        print(f"  {what:<45} {us:8.1f}")


if __name__ == "__main__":
    main()
