"""Probe of the Gluon backward in progress (issue 16): variants of it timed as raw launchers beside the Triton
generator's backward and cuDNN's (SDPA, through autograd), on the same inputs. Delete it once the Gluon backward
is settled and BENCHMARKS.md has the numbers.

    python benchmarks/gluon_bwd_probe.py [--specs dense causal] [--dims 128 64] [--seq 4096 16384] [--json OUT.json]

Variants: `base` (the template), `stages2` (a ring of 2 Q/dO stages), `red` (dQ added by `red.global.add.f32`,
which does not wait for the old value, instead of Triton's atomic_add, which compiles to `atom` and waits). dK
and dV of every variant must equal base's bit for bit (same arithmetic); dQ within float32 rounding (the
order of the atomic additions). Measured on the H100, 2026-11-25 (BENCHMARKS.md): base 0.66-0.81x the Triton
backward; the variants of that run (lse/delta loaded under the products, dQ per key half at d=64) are gone.
"""
import argparse
import dataclasses
import hashlib
import json
import sys
from pathlib import Path

import torch
import triton

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
import attngen  # noqa: E402
from attngen.check import load_spec  # noqa: E402
from attngen.codegen.gluon import render  # noqa: E402
from attngen.loader import load_module  # noqa: E402

RED = ("""            gl.atomic_add(dq_ptrs, dq, mask=gl.expand_dims(rows < q_len, 1), sem="relaxed")""",
       """            dq_addr = gl.where(gl.expand_dims(rows < q_len, 1), dq_ptrs.to(gl.int64, bitcast=True), 0)
            gl.inline_asm_elementwise("{ .reg .pred p; setp.ne.u64 p, $1, 0; @p red.global.add.f32 [$1], $2; mov.u32 $0, 0; }",
                                      "=r,l,f", [dq_addr, dq], dtype=gl.int32, is_pure=False, pack=1)""")


def variant_sources(spec):
    kern = attngen.compile(spec, backend="gluon", deterministic=False)
    gp = kern.generator.gluon
    base = render(gp)
    assert RED[0] in base, "the template's dQ addition changed: update RED"
    return kern, {"base": base, "stages2": render(dataclasses.replace(gp, bwd_stages=2)), "red": base.replace(*RED)}


def ms(fn):
    fn()
    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--specs", nargs="*", default=["dense", "causal"])
    ap.add_argument("--dims", nargs="*", type=int, default=[128, 64])
    ap.add_argument("--seq", nargs="*", type=int, default=[4096, 16384])
    args = ap.parse_args()
    rows = []
    for name in args.specs:
        for d in args.dims:
            spec = dataclasses.replace(load_spec((ROOT / "specs" / f"{name}.attn").read_text()), head_dim=d)
            kern, sources = variant_sources(spec)
            modules = {v: load_module(f"{spec.name}_{v}_probe", hashlib.sha256(src.encode()).hexdigest(), src) for v, src in sources.items()}
            causal = "causal" in name
            for seq in args.seq:
                batch, heads = 16384 // seq, 2048 // d
                gen = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, do = (torch.randn(batch, heads, seq, d, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
                o, lse = modules["base"].attention_forward(q, k, v)
                flop = 2.5 * 4 * batch * heads * seq * seq * d * (0.5 if causal else 1.0)
                row = {"spec": name, "d": d, "N": seq}
                ref = modules["base"].attention_backward(q, k, v, o, lse, do, None)
                for vname, mod in modules.items():
                    got = mod.attention_backward(q, k, v, o, lse, do, None)
                    t = ms(lambda: mod.attention_backward(q, k, v, o, lse, do, None))
                    row[vname] = {"ms": t, "tflops": flop / t * 1e-9, "dk_dv_identical": bool(torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])),
                                  "dq_max_diff": (got[0].float() - ref[0].float()).abs().max().item(),
                                  "nan": bool(any(torch.isnan(g).any() for g in got))}
                t = ms(lambda: kern.module.attention_backward(q, k, v, o, lse, do, None))
                row["triton"] = {"ms": t, "tflops": flop / t * 1e-9}
                leaves = [x.detach().requires_grad_() for x in (q, k, v)]
                from torch.nn.attention import SDPBackend, sdpa_kernel
                with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
                    out = torch.nn.functional.scaled_dot_product_attention(*leaves, is_causal=causal)
                t = ms(lambda: torch.autograd.grad(out, leaves, do, retain_graph=True))
                row["cudnn"] = {"ms": t, "tflops": flop / t * 1e-9}
                rows.append(row)
                print(f"[probe] {name} d={d} N={seq}: " + " ".join(f"{k}={v['tflops']:.0f}" for k, v in row.items() if isinstance(v, dict)), flush=True)
    cols = [c for c in ("base", "stages2", "red", "triton", "cudnn") if any(c in r for r in rows)]
    print("backward TFLOP/s (raw launchers; cudnn through autograd)")
    print(f"{'config':<22}" + "".join(f"{c:>11}" for c in cols) + f"{'base/cudnn':>12}{'base/triton':>12}  checks")
    for r in rows:
        cells = "".join(f"{r[c]['tflops']:11.0f}" if c in r else f"{'-':>11}" for c in cols)
        checks = " ".join(f"{c}:{'ok' if r[c]['dk_dv_identical'] and not r[c]['nan'] else 'DIFF'}({r[c]['dq_max_diff']:.1e})" for c in cols if c in r and "dk_dv_identical" in r[c])
        print(f"{r['spec'] + ' d=' + str(r['d']) + ' N=' + str(r['N']):<22}{cells}{r['base']['tflops'] / r['cudnn']['tflops']:12.2f}"
              f"{r['base']['tflops'] / r['triton']['tflops']:12.2f}  {checks}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                                               "triton": triton.__version__, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
