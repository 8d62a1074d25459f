"""Random values for a spec's declared inputs (and a runtime block mask): the inputs of `attngen check`, the
benchmarks and the tests, and of the calls an ahead-of-time build records."""
from __future__ import annotations

import torch

from .dtypes import TORCH_DTYPES


def make_inputs(spec, batch: int, heads: int, q_len: int, kv_len: int, device, generator: torch.Generator) -> dict:
    """Random values for the spec's declared inputs (test data, not a model of any real use):
    1-D integer inputs (lengths) uniform in [0, kv_len]; longer integer inputs (document ids) sorted runs
    of about 16 tokens; floats standard normal; booleans fair coins."""
    out = {}
    sizes = {"B": batch, "H": heads}
    n = max(q_len, kv_len)
    for decl in spec.inputs:
        shape = tuple(d if isinstance(d, int) else sizes.get(d, n) for d in decl.dims)
        kind = decl.dtype
        if kind == "bool":
            t = torch.rand(shape, generator=generator) < 0.5
        elif kind.startswith("int"):
            if len(shape) == 1:
                t = torch.randint(0, kv_len + 1, shape, generator=generator)
            else:
                t = torch.randint(0, max(1, shape[-1] // 16) + 1, shape, generator=generator).sort(dim=-1).values
            t = t.to(TORCH_DTYPES[kind])
        else:
            t = torch.randn(shape, generator=generator).to(TORCH_DTYPES[kind])
        out[decl.name] = t.to(device)
    if spec.sparsity == "runtime":  # random kept blocks, shared by the batch, with one query block row empty
        S = spec.sparse_block
        bm = torch.rand(1, heads, -(-q_len // S), -(-kv_len // S), generator=generator) < 0.6
        if bm.shape[2] > 1:
            bm[:, 0, 1] = False
        out["block_mask"] = bm.to(device)
    return out
