"""Hardware counters of attngen's kernels and its peers' on one configuration, with Nsight Compute (GPU only).

    python benchmarks/profile_kernels.py [--specs dense causal] [--dims 128] [--seq 16384] [--fp8] [--source] [--out DIR]

runs itself under `ncu` (clocks left alone: --clock-control none), profiling one forward and one forward +
backward of each provider (attngen, FlexAttention, torch SDPA's cuDNN backend) after a warm-up that is not
profiled, and prints per kernel: duration, SM and memory throughput, tensor-pipe activity, registers, shared
memory, achieved occupancy, issue rate and the three largest warp stall reasons. The raw CSV is kept in DIR.
--fp8: instead, attngen's forward of each spec's mask (dense: none, causal) in FP8 (`dtype = fp8`, e4m3 inputs
with per-block descale factors, V's copy included) and in bf16, forward only (FP8 has no backward).
--source: also ncu's SourceCounters section (warp stalls per SASS line; in the CSV).
Run with --run to execute the profiled part alone (what ncu starts).
"""
import argparse
import csv
import io
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

SECTIONS = ["SpeedOfLight", "LaunchStats", "Occupancy", "ComputeWorkloadAnalysis", "WarpStateStats"]
# extra metrics, kept only where this ncu knows them (ncu refuses a run naming an unknown metric)
# (the H100 machine's ncu has no gmma-named pipe metric; warp-group products count in the hmma one)
WANTED = ["sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
          "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active",
          "sm__inst_executed_pipe_tensor_op_gmma.sum"]
STALLS = ["long_scoreboard", "short_scoreboard", "barrier", "wait", "math_pipe_throttle", "mio_throttle", "lg_throttle",
          "not_selected", "selected", "dispatch_stall", "membar", "sleeping", "no_instruction", "branch_resolving", "misc",
          "drain", "tex_throttle", "imc_miss"]


def run_providers(specs, dims, seqs):
    """Warm every provider up, then one forward and one forward + backward each between profiler start/stop."""
    import torch

    from attngen import compile as attn_compile
    from attngen.tools.bench import make_case, providers
    from harness import shipped_spec

    for name in specs:
        for d in dims:
            spec = shipped_spec(name, d)
            kern = attn_compile(spec)
            for n in seqs:
                q, k, v, do, inputs, extra = make_case(spec, n)
                fns, _ = providers(kern, n, inputs, extra, *q.shape[:2])
                for pname in ("attngen", "flex", "sdpa_cudnn"):
                    fn = fns.get(pname)
                    if fn is None:
                        continue
                    for _ in range(3):
                        torch.autograd.grad(fn(q, k, v), (q, k, v), do)
                    torch.cuda.synchronize()
                    print(f"profiling {name} d={d} N={n} {pname}", flush=True)
                    torch.cuda.profiler.start()
                    with torch.no_grad():
                        fn(q, k, v)
                    torch.autograd.grad(fn(q, k, v), (q, k, v), do)
                    torch.cuda.synchronize()
                    torch.cuda.profiler.stop()


def run_fp8(specs, dims, seqs):
    """Warm up, then one forward of attngen's FP8 kernel and one of its bf16 kernel (dense or causal by the spec's
    name) between profiler start/stop, B * N = 16384 and H * d = 2048 as `attngen bench` sizes them."""
    import torch

    from attngen import compile as attn_compile
    from attngen import fp8

    for name in specs:
        mask = {"dense": "", "causal": "mask = q_idx >= kv_idx"}.get(name)
        if mask is None:
            raise SystemExit(f"--fp8 takes the specs dense and causal, not {name!r}")
        for d in dims:
            kernels = {dt: attn_compile(f"attention {name}_{dt} {{ head_dim = {d} dtype = {dt} {mask} }}") for dt in ("fp8", "bf16")}
            for n in seqs:
                b, h = max(1, 16384 // n), max(1, 2048 // d)
                q, k, v = (torch.randn(b, h, n, d, device="cuda") for _ in range(3))
                (q8, qd), (k8, kd), (v8, vd) = fp8.quantize(q, "block"), fp8.quantize(k, "block"), fp8.quantize(v, "head")
                qb, kb, vb = q.bfloat16(), k.bfloat16(), v.bfloat16()
                calls = {"fp8": lambda: kernels["fp8"](q8, k8, v8, q_descale=qd, k_descale=kd, v_descale=vd),
                         "bf16": lambda: kernels["bf16"](qb, kb, vb)}
                with torch.no_grad():
                    for dt, call in calls.items():
                        for _ in range(3):
                            call()
                        torch.cuda.synchronize()
                        print(f"profiling {name} d={d} N={n} attngen {dt} ({kernels[dt].generator.generator})", flush=True)
                        torch.cuda.profiler.start()
                        call()
                        torch.cuda.synchronize()
                        torch.cuda.profiler.stop()


def known_metrics(ncu: str) -> list[str]:
    listing = subprocess.run([ncu, "--query-metrics", "--chip", "gh100"], capture_output=True, text=True).stdout
    names = {line.split()[0] for line in listing.splitlines() if line.strip()}
    metrics = [m for m in WANTED if m.split(".")[0] in names]
    for s in STALLS:
        base = f"smsp__average_warps_issue_stalled_{s}_per_issue_active"
        if base in names:
            metrics.append(base + ".ratio")
    return metrics


def summarize(text: str) -> str:
    """One line per profiled kernel from ncu's --csv --page details output."""
    rows = list(csv.DictReader(io.StringIO(text[text.index('"ID"'):])))
    kernels: dict[str, dict] = {}
    for r in rows:
        kernels.setdefault(r["ID"], {"name": r["Kernel Name"]})[r["Metric Name"]] = r["Metric Value"]
    out = []
    for kid, m in kernels.items():
        stalls = sorted(((float(v.replace(",", "")), key.split("stalled_")[1].split("_per_issue")[0])
                         for key, v in m.items() if key.startswith("smsp__average_warps_issue_stalled_") and v not in ("", "n/a")),
                        reverse=True)[:3]

        def get(*keys):
            for key in keys:
                if key in m:
                    return m[key]
            return "-"

        out.append(" | ".join([
            m["name"][:40], get("Duration"), get("Compute (SM) Throughput"), get("Memory Throughput"),
            get("sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active",
                "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
            get("Registers Per Thread"), get("Dynamic Shared Memory Per Block", "Shared Memory Configuration Size"),
            get("Achieved Occupancy"), get("Issue Slots Busy", "Issued Ipc Active"),
            ", ".join(f"{name} {val:.1f}" for val, name in stalls),
        ]))
    head = "kernel | duration | SM % | memory % | tensor pipe % | regs | dyn. smem | occupancy % | issue | top stalls (cycles per issue)"
    return "\n".join([head] + out)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--specs", nargs="+", default=["dense", "causal"])
    ap.add_argument("--dims", nargs="+", type=int, default=[128])
    ap.add_argument("--seq", nargs="+", type=int, default=[16384])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--fp8", action="store_true", help="attngen's FP8 and bf16 forwards instead of the providers")
    ap.add_argument("--source", action="store_true", help="also ncu's SourceCounters section (stalls per SASS line)")
    ap.add_argument("--run", action="store_true", help="the profiled program itself (ncu starts this)")
    args = ap.parse_args()
    if args.run:
        (run_fp8 if args.fp8 else run_providers)(args.specs, args.dims, args.seq)
        return
    ncu = os.environ.get("NCU", "ncu")
    metrics = known_metrics(ncu)
    cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--csv", "--page", "details",
           *[a for s in SECTIONS + (["SourceCounters"] if args.source else []) for a in ("--section", s)],
           *(["--metrics", ",".join(metrics)] if metrics else []),
           sys.executable, __file__, "--run", "--specs", *args.specs, "--dims", *map(str, args.dims), "--seq", *map(str, args.seq),
           *(["--fp8"] if args.fp8 else [])]
    print(" ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    Path(args.out, "ncu_details.csv").write_text(proc.stdout)
    Path(args.out, "ncu_stderr.txt").write_text(proc.stderr)
    if proc.returncode != 0 or '"ID"' not in proc.stdout:
        print(proc.stdout[-3000:], proc.stderr[-3000:])
        sys.exit(proc.returncode or 1)
    progress = [line for line in proc.stdout.splitlines() if line.startswith("profiling")]
    print("\n".join(progress))
    table = summarize(proc.stdout)
    Path(args.out, "ncu_summary.txt").write_text(table + "\n")
    print(table)


if __name__ == "__main__":
    main()
