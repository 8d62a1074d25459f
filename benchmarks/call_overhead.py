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


def per_call_us(rows: dict, calls: int) -> dict:
    """Median host us per call of each function in rows {name: fn}, the rounds of every row interleaved (hosts
    drift: rows timed one after another were not comparable on the GPU machine)."""
    sync = torch.cuda.synchronize if args.device == "cuda" else (lambda: None)
    for fn in rows.values():
        for _ in range(min(1000, calls)):
            fn()
    rounds = {name: [] for name in rows}
    for _ in range(5):
        for name, fn in rows.items():
            sync()
            t = time.perf_counter()
            for _ in range(calls):
                fn()
            sync()
            rounds[name].append((time.perf_counter() - t) / calls * 1e6)
    return {name: statistics.median(r) for name, r in rounds.items()}


def _with_grad(grad: bool, fn):
    def run():
        with torch.set_grad_enabled(grad):  # about 1 us of the eager rows' time
            fn()
    return run


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
        what = "eager call (autograd.Function)" if grad else "eager call (no autograd node)"
        rows[f"{what}, grad={grad}"] = _with_grad(grad, lambda leaves=leaves: kern(*leaves))
        rows[f"custom op (torch.compile's), grad={grad}"] = _with_grad(grad, lambda leaves=leaves: ops.forward(*leaves, [], 0.0, None, None))
    if args.device == "cuda":
        rows["generated launcher alone"] = lambda: kern.module.attention_forward(q, k, v)
        if kern.gluon is not None:
            g = kern.gluon
            rows["Gluon launcher alone"] = lambda: g.attention_forward(q, k, v)
            # the launch itself, outputs allocated once: through attngen.launch and through Triton's JIT dispatch
            o, lse = torch.empty_like(q), torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
            grid = g.grid(n, 1, 1)
            rows["Gluon kernel: attngen.launch.Launcher"] = lambda: g._FORWARD(grid, *g.launch_args(q, k, v, o, lse))
            rows["Gluon kernel: Triton's JIT (fn[grid](...))"] = lambda: g._attn_fwd[grid](*g.launch_args(q, k, v, o, lse), **g._FORWARD.options)
    rows = per_call_us(rows, args.calls)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (no kernel runs: Nq = 0)"
    print(f"host time per call, us ({name}; torch {torch.__version__}; median of 5 interleaved rounds of {args.calls})")
    for what, us in rows.items():
        print(f"  {what:<45} {us:8.1f}")


if __name__ == "__main__":
    main()
