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


def main(argv: list[str] | None = None) -> int:
    """python -m attngen.codegen.gluon.binaries MODULE.py [bf16|fp16 ...]: compile a generated Gluon module's
    forward for sm_90 and print one JSON line per dtype (shared memory, setmaxnreg budgets, instructions seen).
    Run in its own process: under TRITON_INTERPRET=1 Triton's library functions are interpreter objects, which
    Gluon cannot compile."""
    import importlib.util
    import json
    import re
    import sys
    from pathlib import Path

    import torch

    argv = sys.argv[1:] if argv is None else argv
    path = Path(argv[0])
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[path.stem] = module
    spec.loader.exec_module(module)
    for name in argv[1:] or ["bf16"]:
        kernel = compile_forward(module, {"bf16": torch.bfloat16, "fp16": torch.float16}[name])
        ptx = kernel.asm["ptx"]
        print(json.dumps({"dtype": name, "shared": kernel.metadata.shared,
                          "setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))),
                          "wgmma": "wgmma.mma_async" in ptx, "tma": "cp.async.bulk.tensor" in ptx, "cubin_bytes": len(kernel.asm["cubin"])}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
