"""Host time per kernel call: the eager path (a torch.autograd.Function), the custom op that torch.compile
records (called directly), and, on a GPU, the generated launcher alone (the bare launch).

On a GPU also the two ways torch.library offers (which keeps the launch overhead lowest), no
grad: attngen's `custom_op` (attngen.runtime.autograd.Ops) and a `triton_op` whose body launches the Triton generator's
forward kernel through `wrap_triton` (which Inductor can trace into, emitting the launch in its own code), each
called directly and inside a `torch.compile(fullgraph=True)` function, beside that kernel's launcher alone.

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
from attngen.runtime.dtypes import TORCH_DTYPES  # noqa: E402


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
            # the launch itself, outputs allocated once: through attngen.runtime.launch and through Triton's JIT dispatch
            o, lse = torch.empty_like(q), torch.empty(q.shape[:3], device=q.device, dtype=torch.float32)
            grid = g.grid(n, 1, 1)
            rows["Gluon kernel: attngen.runtime.launch.Launcher"] = lambda: g._FORWARD(grid, *g.launch_args(q, k, v, o, lse))
            rows["Gluon kernel: Triton's JIT (fn[grid](...))"] = lambda: g._attn_fwd[grid](*g.launch_args(q, k, v, o, lse), **g._FORWARD.options)
    if args.device == "cuda":
        rows.update(_custom_op_against_triton_op(q, k, v))
    rows = per_call_us(rows, args.calls)
    name = torch.cuda.get_device_name() if args.device == "cuda" else "CPU (no kernel runs: Nq = 0)"
    print(f"host time per call, us ({name}; torch {torch.__version__}; median of 5 interleaved rounds of {args.calls})")
    for what, us in rows.items():
        print(f"  {what:<45} {us:8.1f}")


def _custom_op_against_triton_op(q, k, v) -> dict:
    """Rows (no grad) for custom_op against triton_op, both around a forward of the same spec: attngen's op calls
    the kernel `auto` chose (the Gluon one on an H100); the triton_op launches the Triton generator's forward, since
    Inductor's path for a user-defined kernel re-emits it under @triton.jit and reads its TTIR through Triton's own
    front end, which Gluon kernels are not written for. The launchers alone are the bare launches to compare with."""
    import triton
    from torch.library import triton_op, wrap_triton

    kern = attngen.compile(ROOT / "specs" / "causal.attn")
    plain = attngen.compile(ROOT / "specs" / "causal.attn", backend="triton")
    m, config = plain.module, plain.module.TILES["fwd"]

    @triton_op("attngen_call_overhead::causal_forward", mutates_args=())
    def forward(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        batch, heads, n, _ = q.shape
        o = torch.empty_like(q)
        lse = torch.empty((batch, heads, n), device=q.device, dtype=torch.float32)
        grid = (triton.cdiv(n, config["BLOCK_M"]), batch * heads)
        wrap_triton(m._attn_fwd)[grid](q, k, v, o, lse, lse, lse, n, *q.stride(), *k.stride(), *v.stride(), *o.stride()[:3],
                                       heads, heads // k.shape[1], n, k.shape[2], VARLEN=False, **config)
        return o

    op = torch.ops.attngen_call_overhead.causal_forward
    assert torch.equal(op(q, k, v), plain(q, k, v))  # the triton_op computes the Triton generator's forward
    compiled_custom = torch.compile(lambda q, k, v: kern(q, k, v), fullgraph=True)
    compiled_triton = torch.compile(lambda q, k, v: op(q, k, v), fullgraph=True)
    no_grad = lambda fn: _with_grad(False, fn)  # noqa: E731
    return {
        "Triton generator's launcher alone": no_grad(lambda: m.attention_forward(q, k, v)),
        "triton_op (Triton kernel), called directly": no_grad(lambda: op(q, k, v)),
        "custom op, in torch.compile(fullgraph)": no_grad(lambda: compiled_custom(q, k, v)),
        "triton_op, in torch.compile(fullgraph)": no_grad(lambda: compiled_triton(q, k, v)),
    }


if __name__ == "__main__":
    main()
