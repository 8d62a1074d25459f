"""What the in-kernel tile classification costs: the same kernels with the classifier's vector width
(TILES_PER_STEP, tiles classified per loop step) changed, on masks where programs visit few tiles (GPU only).

bf16, d=128, H=16, N=16384, B=1; sliding window 1024 and documents of 256-2048 tokens (as benchmarks/masks.py).

    python benchmarks/tile_range_cost.py [--widths 64 256 1024]
"""
import argparse
import dataclasses
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
from attngen.plan import plan as make_plan  # noqa: E402
from attngen.codegen.triton import build_source  # noqa: E402
from attngen.loader import load_module as _load  # noqa: E402
from attngen.runtime import Kernel  # noqa: E402
from harness import time_fwd_bwd, versions  # noqa: E402
from masks import spec_of  # noqa: E402
from attngen.bench import random_documents  # noqa: E402

H, D, N = 16, 128, 16384


def kernel_with_width(spec, width: int) -> Kernel:
    p = make_plan(spec)
    key, source = build_source(p)
    default = "TILES_PER_STEP = tl.constexpr(256)"
    assert default in source
    source = source.replace(default, f"TILES_PER_STEP = tl.constexpr({width})")
    module = _load(spec.name, f"{key}_w{width}", source)
    return Kernel(spec, p, source, Path(module.__file__), module)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--widths", type=int, nargs="+", default=[64, 256, 1024])
    args = ap.parse_args()
    gen = torch.Generator(device="cuda").manual_seed(0)
    q, k, v, do = (torch.randn(1, H, N, D, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(4))
    for t in (q, k, v):
        t.requires_grad_()
    doc = random_documents(1, N, torch.Generator().manual_seed(N)).cuda()
    for name, inputs in (("sliding_window", {}), ("document", {"doc": doc})):
        spec = dataclasses.replace(spec_of(name), target="h100")
        base = None
        for width in args.widths:
            kern = kernel_with_width(spec, width)
            out = kern(q, k, v, **inputs)
            base = out if base is None else base
            assert torch.equal(out, base), "the classifier's width must not change the result"
            t_fwd, t_bwd = time_fwd_bwd(lambda q, k, v: kern(q, k, v, **inputs), q, k, v, do)
            print(f"{name:<15} TILES_PER_STEP={width:<5} fwd {t_fwd:.3f} ms  bwd {t_bwd:.3f} ms", flush=True)
    print(versions())


if __name__ == "__main__":
    main()
