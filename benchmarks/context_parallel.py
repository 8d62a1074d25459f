"""Context parallelism on several GPUs of one host (NCCL): correctness and strong scaling.

    torchrun --nproc-per-node 2 benchmarks/context_parallel.py [--seq 131072] [--big 524288] [--methods ring ulysses hybrid]
                                                               [--ulysses-size 2] [--kv-heads 16] [--out results.json]

1. Correctness, bf16: every rank's shard of O, dQ, dK, dV (gathered) against the one-GPU kernel and the float64
   reference (N = 4096; the reference's budget as in attngen.tools.verify), causal / window / documents / ALiBi / a
   relative bias with grouped-query heads (ALiBi's slopes and the bias table with their gradients), both layouts; at
   the largest length, O against the float64 reference on sampled rows.
2. Strong scaling, causal, d = 128, H = 16, bf16: the one-GPU kernel (rank 0 alone; the default generators, and
   the Triton generator's) against context_parallel on every GPU (zigzag) with the same kernels, forward and
   forward + backward; the same ring with its transfers replaced by local copies (the exposed communication is
   the difference) and one key/value shard's transfer alone; with --methods, Ulysses and hybrid (--ulysses-size
   ranks a sub-group) beside the ring, and their correctness checks too.
3. A long sequence (--big) forward and backward once on every GPU, with each rank's peak memory.

Timing: fixed iteration counts on every rank (the ranks must call the same collectives), CUDA events around each
iteration, medians; every rank starts an iteration at a barrier.
"""
import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

import attngen
import attngen.distributed as cp
from attngen.distributed import ring as ring_module
from attngen.runtime.shard import shard_kernel
from attngen.tools import verify
from attngen.tools.verify import _bound

ROOT = Path(__file__).resolve().parent.parent
SPECS = ROOT / "specs"


def log(*args):
    if dist.get_rank() == 0:
        print(*args, flush=True)


def timed(fn, iters=5, warmup=2):
    """Median milliseconds of fn() over `iters` runs after `warmup`, the same count on every rank."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        dist.barrier()
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def randn(*shape, gen):
    return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.bfloat16)


SEED = 1234


def check(name, layout, n, heads=8, kv_heads=2, backend=None, method="ring", ulysses_size=None):
    """CP against the one-GPU kernel and the float64 reference at n tokens, the gradients of the spec's float inputs
    (ALiBi's slopes, a relative bias's table) included. backend="gluon": both passes of the shards through the Gluon
    generator at any length (under auto, short chunks take the Triton backward; input gradients always do)."""
    kern = attngen.compile(SPECS / f"{name}.attn", backend=backend)
    how = {} if method == "ring" else {"method": method, "ulysses_size": ulysses_size if method == "hybrid" else None}
    drop = {"seed": SEED} if kern.spec.dropout else {}
    ref_drop = {"dropout_p": kern.spec.dropout, "seed": SEED} if kern.spec.dropout else {}
    d = kern.spec.head_dim
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, do = randn(1, heads, n, d, gen=gen), randn(1, heads, n, d, gen=gen)
    k, v = randn(1, kv_heads, n, d, gen=gen), randn(1, kv_heads, n, d, gen=gen)
    inputs = verify.make_inputs(kern.spec, 1, heads, n, n, "cuda", torch.Generator().manual_seed(1))
    trained = [nm for nm, t in inputs.items() if t.is_floating_point()]  # summed over the ranks: the same on each
    for nm in trained:
        inputs[nm].requires_grad_()
    leaves = [cp.shard(t, layout).requires_grad_() for t in (q, k, v)]
    o = cp.context_parallel(kern, *leaves, layout=layout, **how, **drop, **inputs)
    o.backward(cp.shard(do, layout))
    got = [cp.unshard(t.detach(), layout) for t in (o, *(x.grad for x in leaves))] + [inputs[nm].grad for nm in trained]
    for nm in trained:
        inputs[nm] = inputs[nm].detach().requires_grad_()
    shards = shard_kernel(kern).generator
    row = {"spec": name, "backend": backend or "auto", "layout": layout, "method": method, "n": n,
           "nan": any(bool(torch.isnan(t).any()) for t in got), "shard_generators": [shards.generator, shards.backward]}
    if dist.get_rank() == 0:
        full = [t.clone().requires_grad_() for t in (q, k, v)] + [inputs[nm] for nm in trained]
        one = kern(*full[:3], **drop, **inputs)
        one_grads = torch.autograd.grad(one, full, do)
        wide = [t.double().requires_grad_() for t in (q, k, v)] + [inputs[nm].detach().double().requires_grad_() for nm in trained]
        ref = attngen.reference(kern, *wide[:3], dtype=torch.float64, **ref_drop, **{**inputs, **dict(zip(trained, wide[3:]))})
        ref_grads = torch.autograd.grad(ref, wide, do.double())
        del wide
        narrow = [t.clone().requires_grad_() for t in (q, k, v)] + [inputs[nm].detach().clone().requires_grad_() for nm in trained]
        naive = attngen.reference(kern, *narrow[:3], dtype=torch.bfloat16, **ref_drop, **{**inputs, **dict(zip(trained, narrow[3:]))})
        naive_grads = torch.autograd.grad(naive, narrow, do)
        ok = not row["nan"]
        names = ("o", "dq", "dk", "dv", *(f"d{nm}" for nm in trained))
        factors, terms_of = (2, 3, 3, 3, *(3 for _ in trained)), (0.0, 1.0, 1.0, 1.0, *(float(n) for _ in trained))
        for what, g, og, rg, ng, factor, terms in zip(names, got, (one, *one_grads), (ref, *ref_grads), (naive, *naive_grads), factors,
                                                       terms_of):
            err, _, bound = _bound(g.float(), ng.detach().float(), rg.detach(), factor, terms)
            one_err, _, _ = _bound(og.detach().float(), ng.detach().float(), rg.detach(), factor, terms)
            row[what] = {"err": err, "bound": bound, "one_gpu_err": one_err}
            ok = ok and err <= bound
        row["ok"] = ok
        del ref, ref_grads, naive, naive_grads
    torch.cuda.empty_cache()
    return row


def sampled_rows(kern, q, k, v, o, rows):
    """Max error of O's sampled rows against float64 attention of those rows (causal: keys up to the row)."""
    scale = kern.plan.scale
    group = q.shape[1] // k.shape[1]
    worst = 0.0
    for h in range(q.shape[1]):
        qs = q[0, h, rows].double()
        s = qs @ k[0, h // group].double().T * scale
        pos = torch.arange(k.shape[2], device=q.device)
        s = s.masked_fill(pos[None, :] > torch.as_tensor(rows, device=q.device)[:, None], float("-inf"))
        ref = torch.softmax(s, -1) @ v[0, h // group].double()
        worst = max(worst, (o[0, h, rows].double() - ref).abs().max().item())
    return worst


def scaling(n, heads=16, d=128, layout="zigzag", kv_heads=None, methods=("ring",), ulysses_size=2):
    kern = attngen.compile(SPECS / "causal.attn")
    triton_kern = attngen.compile(SPECS / "causal.attn", backend="triton")
    gen = torch.Generator(device="cuda").manual_seed(0)
    kv_heads = kv_heads or heads
    q, do = (randn(1, heads, n, d, gen=gen) for _ in range(2))
    k, v = (randn(1, kv_heads, n, d, gen=gen) for _ in range(2))
    flops = 4 * n * n * heads * d / 2  # causal forward: half the pairs
    row = {"n": n, "heads": heads, "kv_heads": kv_heads, "head_dim": d, "layout": layout, "world": dist.get_world_size()}

    # one GPU: rank 0 alone, the others wait at the barrier
    if dist.get_rank() == 0:
        for label, kk in (("one_gpu", kern), ("one_gpu_triton", triton_kern)):
            leaves = [t.clone().requires_grad_() for t in (q, k, v)]
            fwd = _local_timed(lambda: kk(q, k, v))
            both = _local_timed(lambda: torch.autograd.grad(kk(*leaves), leaves, do))
            row[label] = {"fwd_ms": fwd, "fwd_bwd_ms": both, "generator": kk.generator.generator, "bwd_generator": kk.generator.backward}
        del leaves
    dist.barrier()
    torch.cuda.empty_cache()

    shards = [cp.shard(t, layout) for t in (q, k, v, do)]
    del q, k, v, do
    leaves = [t.clone().requires_grad_() for t in shards[:3]]

    def passes(kk, **how):
        """(forward, forward + backward) of context_parallel through kernel kk, as callables to time."""
        def fwd():
            with torch.no_grad():
                cp.context_parallel(kk, *shards[:3], layout=layout, **how)

        def fwd_bwd():
            o = cp.context_parallel(kk, *leaves, layout=layout, **how)
            torch.autograd.grad(o, leaves, shards[3])

        return fwd, fwd_bwd

    for method in methods:  # Ulysses and hybrid beside the ring (which the rows below time)
        if method != "ring":
            how = {"method": method, "ulysses_size": ulysses_size if method == "hybrid" else None}
            row[f"cp_{method}"] = dict(zip(("fwd_ms", "fwd_bwd_ms"), map(timed, passes(kern, **how))))
    fwd, fwd_bwd = passes(kern)
    row["cp"] = {"fwd_ms": timed(fwd), "fwd_bwd_ms": timed(fwd_bwd)}
    generators = shard_kernel(kern).generator
    row["cp"]["shard_generators"] = [generators.generator, generators.backward]
    row["cp_triton"] = dict(zip(("fwd_ms", "fwd_bwd_ms"), map(timed, passes(triton_kern))))
    # the same ring with every transfer replaced by a local copy: compute and merges only
    real = ring_module._Ring.send_recv
    ring_module._Ring.send_recv = lambda self, tensors: ring_module._Done([t.clone() for t in tensors])
    try:
        row["cp_no_comm"] = {"fwd_ms": timed(fwd), "fwd_bwd_ms": timed(fwd_bwd)}
    finally:
        ring_module._Ring.send_recv = real
    ring = ring_module._Ring(None)
    kv = [shards[1].contiguous(), shards[2].contiguous()]
    row["kv_transfer_ms"] = timed(lambda: ring.send_recv(kv).wait())
    row["kv_shard_bytes"] = sum(t.numel() * t.element_size() for t in kv)
    for key in ("one_gpu", "one_gpu_triton"):
        if key in row:
            row[key]["fwd_tflops"] = flops / row[key]["fwd_ms"] / 1e9
    row["cp"]["fwd_tflops_total"] = flops / row["cp"]["fwd_ms"] / 1e9
    return row


def _local_timed(fn, iters=5, warmup=2):
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        torch.cuda.synchronize()
        start, stop = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        stop.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(stop))
    return statistics.median(times)


def long_run(n, heads=16, d=128, layout="zigzag"):
    """One forward and backward at n tokens over every GPU; peak memory per rank; sampled rows of O checked."""
    kern = attngen.compile(SPECS / "causal.attn")
    world, rank = dist.get_world_size(), dist.get_rank()
    local = n // world
    gen = torch.Generator(device="cuda").manual_seed(rank)
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    q, k, v, do = (randn(1, heads, local, d, gen=gen) for _ in range(4))
    inputs_bytes = sum(t.numel() * t.element_size() for t in (q, k, v, do))
    leaves = [t.requires_grad_() for t in (q, k, v)]
    dist.barrier()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    o = cp.context_parallel(kern, *leaves, layout=layout)
    torch.cuda.synchronize()
    t1 = time.perf_counter()
    grads = torch.autograd.grad(o, leaves, do)
    torch.cuda.synchronize()
    t2 = time.perf_counter()
    nan = any(bool(torch.isnan(t).any()) for t in (o, *grads))
    peak = torch.cuda.max_memory_allocated()
    return {"n": n, "rank": rank, "fwd_s": t1 - t0, "bwd_s": t2 - t1, "peak_gib": peak / 2**30, "inputs_gib": inputs_bytes / 2**30, "nan": nan}


def long_check(n, heads=4, d=128, layout="zigzag"):
    """O at n tokens over every GPU against float64 on 64 sampled rows of the whole sequence."""
    kern = attngen.compile(SPECS / "causal.attn")
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v = (randn(1, heads, n, d, gen=gen) for _ in range(3))
    with torch.no_grad():
        o = cp.unshard(cp.context_parallel(kern, *(cp.shard(t, layout) for t in (q, k, v)), layout=layout), layout)
        rows = sorted(torch.randint(0, n, (64,), generator=torch.Generator().manual_seed(2)).tolist()) + [0, n - 1]
        err = sampled_rows(kern, q, k, v, o, rows)
        one = kern(q, k, v) if dist.get_rank() == 0 else None
        one_err = sampled_rows(kern, q, k, v, one, rows) if one is not None else None
    return {"n": n, "heads": heads, "max_err_sampled_rows": err, "one_gpu_max_err": one_err, "nan": bool(torch.isnan(o).any())}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seq", type=int, nargs="*", default=[131072], help="strong-scaling lengths")
    ap.add_argument("--big", type=int, default=524288, help="the long run's length (0: skip)")
    ap.add_argument("--check-len", type=int, default=262144, help="sampled-row check length (0: skip)")
    ap.add_argument("--no-check", action="store_true", help="skip the correctness part")
    ap.add_argument("--methods", nargs="+", default=["ring"], choices=["ring", "ulysses", "hybrid"])
    ap.add_argument("--ulysses-size", type=int, default=2, help="hybrid: ranks per Ulysses sub-group")
    ap.add_argument("--kv-heads", type=int, default=16, help="strong scaling: key/value heads (16 query heads)")
    ap.add_argument("--out", default=os.environ.get("OUT", ".") + "/context_parallel.json")
    args = ap.parse_args()
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
    results = {"versions": {"torch": torch.__version__, "gpu": torch.cuda.get_device_name(), "world": dist.get_world_size(),
                            "nccl": ".".join(map(str, torch.cuda.nccl.version()))}}
    if not args.no_check:
        results["check"] = []
        cases = [(name, None) for name in ("causal", "sliding_window", "document", "alibi", "relative_bias")]
        cases += [(name, "gluon") for name in ("causal", "sliding_window", "alibi", "causal_dropout")]
        for name, backend in cases:
            for layout in ("contiguous", "zigzag"):
                row = check(name, layout, 4096, backend=backend)
                results["check"].append(row)
                log("check", json.dumps(row))
        for method in args.methods:  # the other methods, zigzag
            for name in ("causal", "sliding_window", "document", "alibi", "relative_bias", "causal_dropout") if method != "ring" else ():
                row = check(name, "zigzag", 4096, method=method, ulysses_size=args.ulysses_size)
                results["check"].append(row)
                log("check", json.dumps(row))
        if args.check_len:
            results["long_check"] = long_check(args.check_len)
            log("long_check", json.dumps(results["long_check"]))
    results["scaling"] = []
    for n in args.seq:
        row = scaling(n, kv_heads=args.kv_heads, methods=args.methods, ulysses_size=args.ulysses_size)
        results["scaling"].append(row)
        log("scaling", json.dumps(row))
    if args.big:
        row = long_run(args.big)
        rows = [None] * dist.get_world_size()
        dist.all_gather_object(rows, row)
        results["long_run"] = rows
        log("long_run", json.dumps(rows))
    if dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results, indent=1))
        print("\n== summary ==")
        for r in results.get("check", []):
            print(f"check {r['spec']:<15}{r['backend']:<6}{r['layout']:<11}{r['method']:<8}{'/'.join(r['shard_generators']):<14} ok={r.get('ok')} " + " ".join(
                f"{w} {r[w]['err']:.2e}/{r[w]['bound']:.2e}" for w in ("o", "dq", "dk", "dv") if w in r))
        for r in results["scaling"]:
            one, tri, c, nc = r.get("one_gpu", {}), r.get("one_gpu_triton", {}), r["cp"], r["cp_no_comm"]
            print(f"N={r['n']} world={r['world']}: 1 GPU ({one.get('generator')}) fwd {one.get('fwd_ms', 0):.1f} ms fwd+bwd {one.get('fwd_bwd_ms', 0):.1f}; "
                  f"1 GPU triton fwd {tri.get('fwd_ms', 0):.1f} fwd+bwd {tri.get('fwd_bwd_ms', 0):.1f}; CP fwd {c['fwd_ms']:.1f} fwd+bwd {c['fwd_bwd_ms']:.1f}; "
                  f"no comm fwd {nc['fwd_ms']:.1f} fwd+bwd {nc['fwd_bwd_ms']:.1f}; kv transfer {r['kv_transfer_ms']:.2f} ms")
            ct = r["cp_triton"]
            print(f"   CP shards {'/'.join(c['shard_generators'])}; CP with the Triton generator fwd {ct['fwd_ms']:.1f} fwd+bwd {ct['fwd_bwd_ms']:.1f}")
            for method in args.methods:
                if method != "ring" and "one_gpu" in r:
                    m = r[f"cp_{method}"]
                    print(f"   {method}: fwd {m['fwd_ms']:.1f} fwd+bwd {m['fwd_bwd_ms']:.1f}; / one_gpu: fwd {m['fwd_ms'] / one['fwd_ms']:.3f}  "
                          f"fwd+bwd {m['fwd_bwd_ms'] / one['fwd_bwd_ms']:.3f}")
            for cp_key, key in (("cp", "one_gpu"), ("cp_triton", "one_gpu_triton")):
                if key in r:
                    print(f"   {cp_key} / {key}: fwd {r[cp_key]['fwd_ms'] / r[key]['fwd_ms']:.3f}  fwd+bwd {r[cp_key]['fwd_bwd_ms'] / r[key]['fwd_bwd_ms']:.3f}")
        if "long_check" in results:
            print("long check", results["long_check"])
        for r in results.get("long_run", []):
            print("long run", r)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
