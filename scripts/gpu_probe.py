"""Where does a GPU check spend its time? Compile, kernel run, float64 reference, naive reference."""
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import attngen  # noqa: E402
from attngen import verify  # noqa: E402

for name in ("causal", "alibi"):
    t0 = time.time()
    kern = attngen.compile(f"specs/{name}.attn")
    o = kern(*(torch.randn(1, 2, 64, kern.spec.head_dim, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3)),
             **verify.make_inputs(kern.spec, 1, 2, 64, 64, "cuda", torch.Generator().manual_seed(0)))
    o.sum().backward()
    torch.cuda.synchronize()
    print(f"{name}: compile + first fwd/bwd {time.time() - t0:.1f}s", flush=True)
    for shape in verify.CUDA_SHAPES:
        t0 = time.time()
        r = verify.check_one(kern, shape, "cuda")
        torch.cuda.synchronize()
        print(f"  {shape} {time.time() - t0:.2f}s ok={r.ok} " + " ".join(f"{k}={e:.2e}/{b:.2e}" for k, (e, _, b) in r.errors.items()), flush=True)
