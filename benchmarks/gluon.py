"""The Gluon generator on an sm_90 GPU: correctness of every spec it takes, then forward speed beside the Triton
generator, FlexAttention and SDPA (cuDNN, flash).

    python benchmarks/gluon.py [--quick] [--json OUT.json]

1. Every shipped spec the Gluon generator supports, and d=64 / fp16 / GQA / q_len != kv_len variants of some, is
   checked by attngen.verify against the float64 reference (forward and backward through Gluon, with
   deterministic = true and false; the error budget of `attngen check`), on CUDA_SHAPES (odd lengths, GQA, MQA,
   q_len != kv_len); three runs must give bit-identical O, dQ, dK and dV (deterministic = true; with false, dQ
   is added in no fixed order: its difference between runs is shown).
2. --forward: forward TFLOP/s (B*N = 16384, H*d = 2048, bf16, do_bench medians, warm-up first, one process):
   Gluon (ring of the plan's stages, and of 2), the Triton generator, FlexAttention with the spec's mask/score
   mods, SDPA cuDNN and flash where they express the spec.
3. --passes: forward and backward TFLOP/s through autograd (attngen.bench.bench_spec): Gluon both ways
   (deterministic = false), the Triton generator, FlexAttention, SDPA cuDNN and flash.
"""
import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import attngen  # noqa: E402
from attngen import verify  # noqa: E402
from attngen.dtypes import TORCH_DTYPES  # noqa: E402
from attngen.bench import make_case, providers, versions  # noqa: E402
from attngen.check import load_spec  # noqa: E402
from attngen.codegen.gluon import build_source  # noqa: E402
from attngen.loader import load_module  # noqa: E402
from attngen.spec import DType  # noqa: E402

CHECKED = ["dense", "causal", "causal_bottom_right", "causal_softcap", "local_window", "sliding_window", "strided_blocks",
           "alibi", "key_padding", "prefix_lm", "relative_bias"]
TIMED = ["dense", "causal", "sliding_window", "causal_softcap"]


def spec_of(name, **changes):
    return dataclasses.replace(load_spec((ROOT / "specs" / f"{name}.attn").read_text()), **changes)


def check(results, quick):
    cases = [(n, {}) for n in CHECKED] + [("causal", {"head_dim": 64}), ("dense", {"head_dim": 64}), ("causal", {"dtype": DType.FP16}),
                                          ("causal_bottom_right", {"head_dim": 128}), ("alibi", {"head_dim": 128}),
                                          ("key_padding", {"head_dim": 128})]
    shapes = verify.CUDA_SHAPES[:6] if quick else verify.CUDA_SHAPES
    for (name, changes), det in ((case, det) for case in cases for det in (True, False)):
        spec = spec_of(name, **changes)
        label = f"{name}" + "".join(f" {k}={getattr(v, 'value', v)}" for k, v in changes.items()) + ("" if det else " unordered")
        t0 = time.time()
        try:
            kern = attngen.compile(spec, backend="gluon", deterministic=det)
            assert kern.generator.backward == "gluon", kern.generator.describe()
            rows = [verify.check_one(kern, shape, "cuda", seed=i) for i, shape in enumerate(shapes)]
            dtype = TORCH_DTYPES[spec.dtype.value]
            q, k, v, do = (torch.randn(2, 8, 1000, spec.head_dim, device="cuda", dtype=dtype) for _ in range(4))
            k, v = k[:, :2].contiguous(), v[:, :2].contiguous()  # GQA: 4 query heads per key/value head
            inputs = verify.make_inputs(spec, 2, 8, 1000, 1000, "cuda", torch.Generator().manual_seed(1))
            runs = []
            for _ in range(3):
                leaves = [t.detach().requires_grad_() for t in (q, k, v)]
                o = kern(*leaves, **inputs)
                runs.append((o, *torch.autograd.grad(o, leaves, do)))
            same = [all(torch.equal(a, b) for b in others) for a, *others in zip(*runs)]  # O, dQ, dK, dV
            entry = {"spec": label, "ok": all(r.ok for r in rows), "deterministic": all(same) if det else same[0] and same[2] and same[3],
                     "dq_rerun_max_diff": max((r[1].float() - runs[0][1].float()).abs().max().item() for r in runs[1:]),
                     "worst": max(max(e / b for e, _, b in r.errors.values()) for r in rows), "s": time.time() - t0,
                     "table": verify.format_table(label, rows)}
        except Exception as exc:  # noqa: BLE001 (recorded, the other cases go on)
            entry = {"spec": label, "ok": False, "error": f"{type(exc).__name__}: {exc}"[:2000]}
        results["check"].append(entry)
        print(f"[check] {label}: {'ok' if entry['ok'] else 'FAILED'} {entry.get('error', '')[:300]} "
              f"worst err/bound {entry.get('worst', float('nan')):.3f} O,dK,dV rerun-identical {entry.get('deterministic')} "
              f"dQ rerun max diff {entry.get('dq_rerun_max_diff')}", flush=True)
        if not entry["ok"] and "table" in entry:
            print(entry["table"], flush=True)


def fwd_ms(fn, q, k, v):
    import triton

    with torch.no_grad():
        fn(q, k, v)
        return triton.testing.do_bench(lambda: fn(q, k, v), warmup=25, rep=100, return_mode="median")


def time_forward(results, quick):
    seqs = [4096, 16384] if quick else [1024, 4096, 16384]
    for name in TIMED:
        for d in (128, 64):
            spec = spec_of(name, head_dim=d)
            gl = attngen.compile(spec, backend="gluon")
            tr = attngen.compile(spec, backend="triton")
            two = dataclasses.replace(gl.generator.gluon, stages=2)
            gl2 = load_module(f"{spec.name}_gluon2", *build_source(two))
            for seq in seqs:
                q, k, v, do, inputs, extra = make_case(spec, seq)
                batch, heads = q.shape[:2]
                fns, failed = providers(gl, seq, inputs, extra, batch, heads, triton=tr)
                fns["gluon_2stages"] = lambda q, k, v: gl2.attention_forward(q, k, v)[0]
                fns.pop("sdpa_flash", None) if quick else None
                kept = 0.5 if name != "dense" and "causal" in name else None
                row = {"spec": name, "d": d, "N": seq, "B": batch, "H": heads}
                ref = None
                for pname, fn in fns.items():
                    try:
                        with torch.no_grad():
                            out = fn(q, k, v)
                            out = out[0] if isinstance(out, tuple) else out
                        ref = out if ref is None else ref
                        err = (out.float() - ref.float()).abs().max().item()
                        ms = fwd_ms(fn, q, k, v)
                        row[pname] = {"ms": ms, "max_diff_vs_attngen": err, "nan": bool(torch.isnan(out).any())}
                    except Exception as exc:  # noqa: BLE001
                        row[pname] = {"error": f"{type(exc).__name__}: {exc}"[:300]}
                row.update({k: v for k, v in failed.items()})
                if name == "sliding_window":
                    kept = min(1.0, 1024 / seq) - (1024 * 1024 / 2) / (seq * seq)
                flop = 4 * batch * heads * seq * seq * d * (kept if kept is not None else 1.0)
                for pname in fns:
                    if "ms" in row.get(pname, {}):
                        row[pname]["tflops"] = flop / row[pname]["ms"] / 1e9
                results["timing"].append(row)
                cells = " ".join(f"{p}={row[p].get('tflops', 0):.0f}" for p in fns if p in row)
                print(f"[time] {name} d={d} N={seq}: {cells}", flush=True)


def time_passes(results, specs, dims, seqs):
    """Forward and backward through autograd: attngen (Gluon both ways) beside every peer, in one process."""
    from attngen.bench import bench_spec

    for name in specs:
        for d in dims:
            spec = spec_of(name, head_dim=d)
            gl = attngen.compile(spec, backend="gluon", deterministic=False)
            tr = attngen.compile(spec, backend="triton")
            for seq in seqs:
                row = bench_spec(gl, seq, triton=tr)
                results["passes"].append(row)
                cells = " ".join(f"{p}={row[p]['fwd_tflops']:.0f}/{row[p]['bwd_tflops']:.0f}" if "fwd_tflops" in row.get(p, {})
                                 else f"{p}=ERR({row[p].get('error', '')[:80]})" for p in row if isinstance(row[p], dict))
                print(f"[passes] {name} d={d} N={seq}: {cells}", flush=True)


def passes_table(results):
    cols = ["attngen", "triton", "flex", "sdpa_cudnn", "sdpa_flash"]
    lines = ["forward / backward TFLOP/s through autograd (attngen = Gluon both ways, deterministic = false; triton = the Triton generator)",
             f"{'config':<28}" + "".join(f"{c:>14}" for c in cols) + f"{'bwd vs cudnn':>14}{'vs flex':>9}{'vs triton':>10}"]
    for r in results["passes"]:
        def tf(c, k):
            return r.get(c, {}).get(k)
        cells = "".join(f"{tf(c, 'fwd_tflops'):6.0f}/{tf(c, 'bwd_tflops'):<7.0f}" if tf(c, "bwd_tflops") else f"{'-':>14}" for c in cols)
        ratios = "".join(f"{tf('attngen', 'bwd_tflops') / tf(c, 'bwd_tflops'):{w}.2f}" if tf(c, "bwd_tflops") and tf("attngen", "bwd_tflops")
                         else f"{'-':>{w}}" for c, w in (("sdpa_cudnn", 14), ("flex", 9), ("triton", 10)))
        lines.append(f"{r['spec'] + ' d=' + str(r['d']) + ' N=' + str(r['N']):<28}{cells}{ratios}")
    return "\n".join(lines)


def table(results):
    cols = ["attngen", "gluon_2stages", "triton", "flex", "sdpa_cudnn", "sdpa_flash"]
    lines = ["forward TFLOP/s (attngen = Gluon, plan's ring; gluon_2stages = ring of 2; triton = the Triton generator)",
             f"{'config':<28}" + "".join(f"{c:>14}" for c in cols) + f"{'vs cudnn':>10}{'vs flex':>10}{'vs triton':>10}"]
    for r in results["timing"]:
        def tf(c):
            return r.get(c, {}).get("tflops")
        cells = "".join(f"{tf(c):14.0f}" if tf(c) else f"{'-':>14}" for c in cols)
        ratios = "".join(f"{tf('attngen') / tf(c):10.2f}" if tf(c) and tf("attngen") else f"{'-':>10}" for c in ("sdpa_cudnn", "flex", "triton"))
        lines.append(f"{r['spec'] + ' d=' + str(r['d']) + ' N=' + str(r['N']):<28}{cells}{ratios}")
    lines.append("checks: " + ", ".join(f"{c['spec']} {'ok' if c['ok'] else 'FAILED'}{'' if c.get('deterministic', True) else ' NONDET'}" for c in results["check"]))
    return "\n".join(lines)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", default=None)
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--forward", action="store_true", help="forward timing with the ring variants")
    ap.add_argument("--passes", nargs="*", default=None, help="forward and backward timing of these specs (default: dense causal)")
    ap.add_argument("--dims", nargs="*", type=int, default=[128, 64])
    ap.add_argument("--seq", nargs="*", type=int, default=[1024, 4096, 16384])
    args = ap.parse_args()
    results = {"versions": versions(), "device": torch.cuda.get_device_name(), "check": [], "timing": [], "passes": []}
    if not args.skip_check:
        check(results, args.quick)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    if args.forward:
        time_forward(results, args.quick)
    if args.passes is not None:
        time_passes(results, args.passes or ["dense", "causal"], args.dims, args.seq)
        print(passes_table(results))
    print(table(results))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
