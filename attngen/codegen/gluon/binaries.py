"""Gluon kernels compiled for sm_90 without a GPU (triton.compile with a GPUTarget): what the CPU tests check
and what ahead-of-time builds would ship."""
from __future__ import annotations

from types import ModuleType


def compile_forward(module: ModuleType, dtype, batch: int = 1, heads: int = 2, kv_heads: int = 1, q_len: int = 130, kv_len: int = 200):
    """The module's _attn_fwd compiled for sm_90 from the signature of a call on CPU tensors of these sizes
    (descriptors carry only their block shape and layout in the signature: one binary serves every size)."""
    import torch
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource
    from triton.runtime.jit import mangle_type

    d = int(module.HEAD_DIM.value)
    q = torch.empty(batch, heads, q_len, d, dtype=dtype)
    k = torch.empty(batch, kv_heads, kv_len, d, dtype=dtype)
    o = torch.empty_like(q)
    lse = torch.empty(batch, heads, q_len, dtype=torch.float32)
    args = module.launch_args(q, k, k, o, lse)
    fn = module._attn_fwd
    signature = {name: mangle_type(a) for name, a in zip(fn.arg_names, args)}
    source = GluonASTSource(fn=fn, signature=signature, constexprs={})
    return triton.compile(source, target=GPUTarget("cuda", 90, 32), options={"num_warps": 4, "maxnreg": module.MAXNREG})
