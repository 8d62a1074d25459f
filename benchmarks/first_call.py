"""First call of a kernel in a fresh process: an ahead-of-time bundle (built on a CPU machine) vs just-in-time
compilation vs FlexAttention. Run on the GPU:

    python benchmarks/first_call.py --bundle build/aot --json first_call.json

For each spec of the bundle (its build for this GPU), each in a new Python process with empty Triton,
Inductor and attngen caches:
  bundle    attngen.load(DIR, name, strict=True): any Triton compilation would raise; compilations are also
            counted (a wrapper on triton.compile)
  jit       attngen.compile(spec): Triton compiles the kernels (empty Triton cache)
  jit-warm  the same in another new process that finds the first one's Triton disk cache
  flex      torch.compile(flex_attention) with the spec's mask_mod/score_mod (attngen.tools.bench.flex_mods), empty
            Inductor cache (only for specs without inputs)
Each child times: the import of attngen + torch, kernel creation (load / compile), the first forward and the
first backward (synchronized), then a warm forward+backward for scale. The bundle child and the jit child
also save O and the gradients of a fixed input; the parent compares them (bundle vs JIT, bit for bit) and
checks the bundle kernel against the float64 reference over verify's CUDA shapes, strict (no compilation).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

B, H, N = 1, 16, 4096


def child(mode: str, bundle_dir: str, name: str, spec_text: str, save: str | None) -> dict:
    t0 = time.perf_counter()
    import torch
    import triton
    import triton.compiler

    import attngen

    compiles = []
    real = triton.compiler.compile

    def counting(src, *args, **kwargs):  # every Triton compilation in this process (the JIT calls this)
        compiles.append(getattr(src, "name", "?"))
        return real(src, *args, **kwargs)

    triton.compiler.compile = counting
    t_import = time.perf_counter() - t0
    spec = attngen.load_spec(spec_text, name)
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (torch.randn(B, H, N, spec.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen).requires_grad_() for _ in range(3))
    do = torch.randn(B, H, N, spec.head_dim, device="cuda", dtype=torch.bfloat16, generator=gen)
    from attngen.runtime.samples import make_inputs

    inputs = make_inputs(spec, B, H, N, N, "cuda", torch.Generator().manual_seed(1))
    extra = {"seed": 7} if spec.dropout else {}
    torch.cuda.synchronize()

    t1 = time.perf_counter()
    if mode == "bundle":
        kern = attngen.load(bundle_dir, name, strict=True)
        fn = lambda: kern(q, k, v, **inputs, **extra)  # noqa: E731
    elif mode.startswith("jit"):
        kern = attngen.compile(spec, "auto")
        fn = lambda: kern(q, k, v, **inputs, **extra)  # noqa: E731
    else:
        from attngen.tools import bench

        fl = bench.flex()
        mask_mod, score_mod = bench.flex_mods(spec, inputs, N, N)
        from torch.nn.attention.flex_attention import create_block_mask

        block_mask = create_block_mask(mask_mod, None, None, N, N, device="cuda") if mask_mod else None
        fn = lambda: fl(q, k, v, score_mod=score_mod, block_mask=block_mask)  # noqa: E731
    torch.cuda.synchronize()
    t_create = time.perf_counter() - t1

    t2 = time.perf_counter()
    o = fn()
    torch.cuda.synchronize()
    t_fwd = time.perf_counter() - t2
    profile = None
    if os.environ.get("FIRST_CALL_PROFILE") and mode == "bundle":  # where the first backward's time goes
        import cProfile
        import io
        import pstats

        profile = cProfile.Profile()
        profile.enable()
    t3 = time.perf_counter()
    grads = torch.autograd.grad(o, (q, k, v), do)
    torch.cuda.synchronize()
    t_bwd = time.perf_counter() - t3
    if profile is not None:
        profile.disable()
        text = io.StringIO()
        pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(30)
        sys.stderr.write(text.getvalue())
    n_first = len(compiles)

    t4 = time.perf_counter()
    for _ in range(3):
        o2 = fn()
        torch.autograd.grad(o2, (q, k, v), do)
    torch.cuda.synchronize()
    t_warm = (time.perf_counter() - t4) / 3
    if save:
        torch.save({"o": o.detach().cpu(), "grads": [g.cpu() for g in grads]}, save)
    out = {"mode": mode, "spec": name, "import_s": t_import, "create_s": t_create, "first_fwd_s": t_fwd, "first_bwd_s": t_bwd,
           "warm_fwd_bwd_s": t_warm, "triton_compiles": n_first, "compiled": sorted(set(compiles))}
    if mode == "bundle":
        out["bundle_used"] = kern.bundle.used
        out["binaries_loaded"] = kern.bundle.stats.loaded
        # the bundle kernel against the float64 reference over verify's CUDA shapes, still strict (no compiling)
        from attngen.tools import verify

        ok, refused = 0, []
        for shape in verify.CUDA_SHAPES:
            try:
                ok += verify.check_one(kern, shape, "cuda").ok
            except attngen.BundleError as err:  # a specialization the bundle lacks (strict: not compiled)
                refused.append(f"{shape}: {str(err)[-160:]}")
        out["reference_checks"] = f"{ok}/{len(verify.CUDA_SHAPES)} ok" + (f", {len(refused)} refused" if refused else "")
        out["refused"] = refused
        out["triton_compiles_after_checks"] = len(compiles)
    return out


def run_child(mode: str, args, name: str, spec_text: str, env_extra: dict, save: str | None) -> dict:
    env = {**os.environ, **env_extra}
    cmd = [sys.executable, __file__, "--child", mode, "--bundle", args.bundle, "--name", name, "--spec-text", spec_text] + (["--save", save] if save else [])
    t = time.perf_counter()
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    wall = time.perf_counter() - t
    if proc.returncode != 0:
        return {"mode": mode, "spec": name, "error": proc.stderr[-3000:]}
    if os.environ.get("FIRST_CALL_PROFILE") and mode == "bundle":
        print(proc.stderr[-12000:], flush=True)
    res = json.loads(proc.stdout.strip().splitlines()[-1])
    res["process_wall_s"] = wall
    return res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--bundle", required=True)
    ap.add_argument("--json", default=None)
    ap.add_argument("--child", default=None)
    ap.add_argument("--name", default=None)
    ap.add_argument("--spec-text", default=None)
    ap.add_argument("--save", default=None)
    ap.add_argument("--only", nargs="+", default=None, help="these specs of the bundle only")
    ap.add_argument("--modes", nargs="+", default=["bundle", "jit", "jit-warm", "flex"], help="which first calls to time")
    args = ap.parse_args()
    if args.child:
        print(json.dumps(child(args.child, args.bundle, args.name, args.spec_text, args.save)))
        return

    import torch

    from attngen.aot import read_manifest

    manifest = read_manifest(Path(args.bundle))
    major, minor = torch.cuda.get_device_capability()
    entries = [e for e in manifest["entries"] if e["arch"] == major * 10 + minor and (not args.only or e["name"] in args.only)]
    print(f"bundle {args.bundle}: built {manifest['created']} with attngen {manifest['attngen']}, triton {manifest['triton']}, "
          f"torch {manifest['torch']}; here torch {torch.__version__}, {torch.cuda.get_device_name()}", flush=True)
    rows = []
    work = Path(tempfile.mkdtemp(prefix="first-call-"))
    for e in entries:
        name, spec_text = e["name"], e["spec"]
        fresh = lambda tag: {"TRITON_CACHE_DIR": str(work / f"{name}-{tag}-triton"), "ATTNGEN_CACHE_DIR": str(work / f"{name}-{tag}-attngen"),  # noqa: E731
                             "TORCHINDUCTOR_CACHE_DIR": str(work / f"{name}-{tag}-inductor")}
        res = {}
        if "bundle" in args.modes:
            res["bundle"] = run_child("bundle", args, name, spec_text, fresh("bundle"), str(work / f"{name}-bundle.pt"))
        if "jit" in args.modes:
            res["jit"] = run_child("jit", args, name, spec_text, fresh("jit"), str(work / f"{name}-jit.pt"))
        if "jit-warm" in args.modes:
            res["jit-warm"] = run_child("jit-warm", args, name, spec_text, fresh("jit") | {"ATTNGEN_CACHE_DIR": str(work / f"{name}-jit2-attngen")}, None)
        if "flex" in args.modes and "input " not in spec_text and "dropout" not in spec_text and "sparsity = runtime" not in spec_text:
            res["flex"] = run_child("flex", args, name, spec_text, fresh("flex"), None)
        if "error" not in res.get("bundle", {"error": 1}) and "error" not in res.get("jit", {"error": 1}):
            a, b = torch.load(work / f"{name}-bundle.pt"), torch.load(work / f"{name}-jit.pt")
            same = torch.equal(a["o"], b["o"]) and all(torch.equal(x, y) for x, y in zip(a["grads"], b["grads"]))
            res["bundle"]["identical_to_jit"] = same
            res["bundle"]["max_diff_vs_jit"] = max((x.float() - y.float()).abs().max().item() for x, y in zip([a["o"]] + a["grads"], [b["o"]] + b["grads"]))
        for r in res.values():
            rows.append(r)
            print(json.dumps(r), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, indent=1))
    print(f"\nfirst call in a fresh process (B={B} H={H} N={N} bf16), seconds; compiles = Triton compilations in that process")
    print(f"{'spec':<22}{'mode':<10}{'import':>8}{'create':>8}{'1st fwd':>9}{'1st bwd':>9}{'total':>8}{'warm':>8}{'compiles':>10}  notes")
    for r in rows:
        if "error" in r:
            print(f"{r['spec']:<22}{r['mode']:<10}  ERROR {r['error'].strip().splitlines()[-1][:100]}")
            continue
        total = r["create_s"] + r["first_fwd_s"] + r["first_bwd_s"]
        note = ""
        if r["mode"] == "bundle" and "identical_to_jit" in r:
            note = (f"loaded {r['binaries_loaded']} binaries; {'bit-identical to JIT' if r.get('identical_to_jit') else 'diff vs JIT %.3g' % r.get('max_diff_vs_jit', float('nan'))}; "
                    f"reference {r['reference_checks']}, compiles after checks {r['triton_compiles_after_checks']}")
        print(f"{r['spec']:<22}{r['mode']:<10}{r['import_s']:8.2f}{r['create_s']:8.2f}{r['first_fwd_s']:9.2f}{r['first_bwd_s']:9.2f}{total:8.2f}"
              f"{r['warm_fwd_bwd_s'] * 1e3:6.1f}ms{r['triton_compiles']:10d}  {note}")


if __name__ == "__main__":
    main()
