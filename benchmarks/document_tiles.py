"""The forward of a document mask (packed documents of 256-2048 tokens, causal inside each, as benchmarks/masks.py)
at several tile configurations, d=128, bf16, B*N = 16384, H = 16 (GPU only). Outputs are compared with the
planned tiles' run first.

    python benchmarks/document_tiles.py
"""
import json
import sys
from pathlib import Path
ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT)); sys.path.insert(0, str(ROOT / "benchmarks"))
import torch
from attngen.plan import plan as make_plan
from attngen.codegen.triton import build_source
from attngen.loader import load_module as _load
from harness import median_ms, versions
from masks import spec_of
from attngen.bench import random_documents
spec = spec_of("document")
p = make_plan(spec, "auto")
mod = _load(spec.name, *build_source(p))
planned = p.tiles()
FWD = [(128, 128, 8, 3), (128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (64, 128, 4, 3), (64, 32, 4, 3), (128, 32, 4, 3), (64, 64, 4, 4)]
print(versions(), planned["fwd"])
for n in (4096, 16384):
    b = 16384 // n
    gen = torch.Generator(device="cuda").manual_seed(n)
    q, k, v = (torch.randn(b, 16, n, 128, device="cuda", dtype=torch.bfloat16, generator=gen) for _ in range(3))
    doc = random_documents(b, n, torch.Generator().manual_seed(n)).cuda()
    want, _ = mod.attention_forward(q, k, v, doc)
    for bm, bn, w, s in FWD:
        tiles = {**planned, "fwd": {"BLOCK_M": bm, "BLOCK_N": bn, "num_warps": w, "num_stages": s}}
        try:
            out, _ = mod.attention_forward(q, k, v, doc, tiles=tiles)
            err = (out.float() - want.float()).abs().max().item()
            ms = median_ms(lambda: mod.attention_forward(q, k, v, doc, tiles=tiles))
            print(json.dumps({"N": n, "fwd": [bm, bn, w, s], "ms": round(ms, 4), "err": err}), flush=True)
        except Exception as e:
            print(n, (bm, bn, w, s), "failed", str(e)[:200], flush=True)
