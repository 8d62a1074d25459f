"""A/B test of two template directories on the GPU: the same plans rendered from each, outputs compared, the
forward and the backward timed alternately, in the order A B, B A, A B, ... (--rounds; the minimum of each is kept).
The order turns each round: in a fixed order A, B, A, B the second measured lost up to 7 % on long backwards
against an identical first (an A/A test on the H100, 2026-11-26).

    python benchmarks/ab_templates.py --a OLD_TEMPLATES_DIR | --a-tree OLD_TREE [--b templates/triton] [--generator triton|gluon]
                                      [--specs dense causal] [--dims 128 64] [--seq 4096 16384] [--json OUT.json]

Declared inputs: specs/document.attn's document ids as `attngen bench` draws them (256-2048 tokens), other inputs `attngen check`'s random
values (not runtime block sparsity); TFLOP/s count kept pairs. A static block pattern's lists (KernelPlan.block_lists)
go to each module whose Triton launchers take them (an older tree's classify the pattern's tiles instead).

For a change outside the templates (the expressions' lowering, the plan), --a-tree DIR renders A with another
attngen tree instead (DIR holding its attngen/ and templates/, e.g. `git archive HEAD attngen templates | tar -x -C
DIR`), in a process of its own.

Keep A as a copy of the templates before a change (e.g. `git archive HEAD templates/triton | tar -x -C /tmp/a`, then
--a /tmp/a/templates/triton); the device machine has no git history, so copy A into a folder that travels.
With --generator gluon (B defaults to templates/gluon) the Gluon modules are compared: their forwards, and their
backwards where both have one (the Gluon templates before 2026-11-25 held only the forward, in forward.py.jinja).
"""
import argparse
import hashlib
import importlib
import inspect
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from attngen.codegen import Templates  # noqa: E402
from attngen.codegen.gluon import plan_gluon  # noqa: E402
from attngen.codegen.gluon.render import context as gluon_context  # noqa: E402
from attngen.plan.planner import plan as make_plan  # noqa: E402
from attngen.runtime.blocks import pattern_lists  # noqa: E402
from attngen.runtime.loader import load_module as _load  # noqa: E402
from attngen.tools import verify  # noqa: E402
from harness import median_ms, save_results, shipped_spec, versions  # noqa: E402
from attngen.tools.bench import kept_fraction, random_documents  # noqa: E402

triton_render = importlib.import_module("attngen.codegen.triton.render")  # (the package's `render` is its render function)


def module_from(templates: Path, plan, generator: str = "triton"):
    """The generated module of `plan` rendered from `templates` (the cache key covers the templates' digest)."""
    if generator == "triton":
        triton_render.TEMPLATES = Templates("triton", "module.py.jinja", directory=templates)
        return _load(plan.spec.name, *triton_render.build_source(plan))
    main = "module.py.jinja" if (templates / "module.py.jinja").is_file() else "forward.py.jinja"
    source = Templates("gluon", main, directory=templates).render(main, gluon_context(plan_gluon(plan)))
    return _load(f"{plan.spec.name}_gluon", hashlib.sha256(source.encode()).hexdigest(), source)


_TREE_RENDER = """
import sys
sys.path.insert(0, sys.argv[1])
from attngen.lang.check import load_spec
from attngen.plan.planner import plan
spec = plan(load_spec(sys.stdin.read()), "auto")
if sys.argv[2] == "triton":
    from attngen.codegen.triton import build_source
    sys.stdout.write(build_source(spec)[1])
else:
    from attngen.codegen.gluon import plan_gluon, render
    sys.stdout.write(render(plan_gluon(spec)))
"""


def module_from_tree(tree: Path, spec, generator: str = "triton"):
    """The generated module of `spec` rendered by the attngen tree `tree` (code and templates), in a subprocess."""
    import subprocess
    from attngen.lang.canonical import format_spec

    source = subprocess.run([sys.executable, "-c", _TREE_RENDER, str(tree), generator], input=format_spec(spec), text=True,
                            capture_output=True, check=True).stdout
    return _load(f"{spec.name}_{generator}_a", hashlib.sha256(source.encode()).hexdigest(), source)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--a", type=Path, help="the templates of A (this generator's folder)")
    ap.add_argument("--a-tree", type=Path, help="instead of --a: an attngen tree (attngen/, templates/) rendering A")
    ap.add_argument("--b", default=None, type=Path, help="default: templates/GENERATOR")
    ap.add_argument("--generator", choices=("triton", "gluon"), default="triton")
    ap.add_argument("--specs", nargs="+", default=["dense", "causal"])
    ap.add_argument("--dims", nargs="+", type=int, default=[128, 64])
    ap.add_argument("--seq", nargs="+", type=int, default=[4096, 16384])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    args.b = args.b or ROOT / "templates" / args.generator
    if (args.a is None) == (args.a_tree is None):
        ap.error("give one of --a and --a-tree")
    rows = []
    for name in args.specs:
        for d in args.dims:
            spec = shipped_spec(name, d)
            plan = make_plan(spec, "auto")
            a = module_from(args.a.resolve(), plan, args.generator) if args.a else module_from_tree(args.a_tree.resolve(), spec, args.generator)
            mods = {"A": a, "B": module_from(args.b.resolve(), plan, args.generator)}
            parts = ("fwd", "bwd") if all(hasattr(m, "attention_backward") for m in mods.values()) else ("fwd",)
            for n in args.seq:
                bsz, h = 16384 // n, 2048 // d
                g = torch.Generator(device="cuda").manual_seed(0)
                q, k, v, do = (torch.randn(bsz, h, n, d, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(4))
                # a spec's declared inputs: the document ids `attngen bench` draws, else attngen check's random values
                given = ({"doc": random_documents(bsz, n, torch.Generator().manual_seed(0)).cuda()} if name == "document" else
                         verify.make_inputs(spec, bsz, h, n, n, "cuda", torch.Generator().manual_seed(0)))
                given = {i.name: given[i.name] for i in spec.inputs}
                inputs = tuple(given.values())
                flop = 4 * bsz * h * n * n * d * kept_fraction(spec, given, bsz, h, n, n, "cuda")
                # a static block pattern's lists, for a module whose Triton kernels walk them (KernelPlan.block_lists)
                lists = pattern_lists(spec, bsz, h, n, n, "cuda") if args.generator == "triton" and plan.block_lists else None
                extra = {key: {"blocks": lists} if lists is not None and "blocks" in inspect.signature(mod.attention_forward).parameters else {}
                         for key, mod in mods.items()}
                outs = {}
                for key, mod in mods.items():
                    o, lse = mod.attention_forward(q, k, v, *inputs, **extra[key])
                    outs[key] = (o, lse) + (tuple(mod.attention_backward(q, k, v, o, lse, do, None, *inputs, **extra[key])) if "bwd" in parts else ())
                err = max((x.float() - y.float()).abs().max().item() for x, y in zip(outs["A"], outs["B"]))
                nan = any(torch.isnan(x).any().item() for x in outs["B"])
                times = {(key, part): [] for key in mods for part in parts}
                for r in range(args.rounds):
                    for key, mod in (list(mods.items()) if r % 2 == 0 else list(mods.items())[::-1]):
                        o, lse = outs[key][:2]
                        times[key, "fwd"].append(median_ms(lambda: mod.attention_forward(q, k, v, *inputs, **extra[key])))
                        if "bwd" in parts:
                            times[key, "bwd"].append(median_ms(lambda: mod.attention_backward(q, k, v, o, lse, do, None, *inputs, **extra[key])))
                row = {"spec": name, "d": d, "N": n, "max_diff": err, "nan": nan}
                for part, mult in (("fwd", 1.0), ("bwd", 2.5))[:len(parts)]:
                    a, b = min(times["A", part]), min(times["B", part])
                    row |= {f"{part}_A_tflops": mult * flop / a * 1e-9, f"{part}_B_tflops": mult * flop / b * 1e-9, f"{part}_B_over_A": a / b}
                rows.append(row)
                print(json.dumps(row), flush=True)
    print(versions())
    print("\nSUMMARY (TFLOP/s A -> B, speed-up B/A)")
    for r in rows:
        bwd = f"bwd {r['bwd_A_tflops']:.0f} -> {r['bwd_B_tflops']:.0f} ({r['bwd_B_over_A']:.3f}x); " if "bwd_A_tflops" in r else ""
        print(f"{r['spec']} d={r['d']} N={r['N']}: fwd {r['fwd_A_tflops']:.0f} -> {r['fwd_B_tflops']:.0f} ({r['fwd_B_over_A']:.3f}x), "
              f"{bwd}max diff {r['max_diff']:.2e}{' NaN!' if r['nan'] else ''}", flush=True)
    if args.json:
        save_results(args.json, rows=rows)


if __name__ == "__main__":
    main()
