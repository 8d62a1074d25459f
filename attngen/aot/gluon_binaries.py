"""Gluon kernels compiled for sm_90 without a GPU (triton.compile with a GPUTarget): what the CPU tests check
and what ahead-of-time builds would ship."""
from __future__ import annotations

from types import ModuleType

ARCH = 90


def specialize(fn, args: tuple, options: dict) -> tuple[dict, dict, dict, dict]:
    """(signature, constexprs, attrs, options) that Triton's JIT would compile `fn` with for these arguments on
    sm_90: the same binder, so pointer alignment (which decides, e.g., whether atomics are vectorized) and the
    arguments equal to 1 are specialized exactly as on the GPU."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    backend = make_backend(GPUTarget("cuda", ARCH, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    kwargs = dict(options, debug=fn.debug or triton.knobs.runtime.debug, instrumentation_mode=triton.knobs.compilation.instrumentation_mode)
    bound, specialization, opts = binder(*args, **kwargs)
    opts, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound, specialization, opts)
    return signature, constexprs, attrs, dict(opts.__dict__)


def compile_kernel(fn, args: tuple, options: dict):
    """`fn` (a gluon.jit function) compiled for sm_90 for a call with `args` (CPU tensors stand in for the GPU's:
    only their types, shapes of descriptors and alignment matter)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.experimental.gluon._runtime import GluonASTSource

    signature, constexprs, attrs, opts = specialize(fn, args, options)
    source = GluonASTSource(fn=fn, signature=signature, constexprs=constexprs, attrs=attrs)
    return triton.compile(source, target=GPUTarget("cuda", ARCH, 32), options=opts)


def compile_module(module: ModuleType, dtype, batch: int = 1, heads: int = 2, kv_heads: int = 1, q_len: int = 130,
                   kv_len: int = 200, varlen: bool = True) -> dict:
    """The module's kernels (forward, and backward and its pre-pass where the module has them) compiled for sm_90
    from the signatures of a call on CPU tensors of these sizes (descriptors carry only their block shape and
    layout in the signature, and the sizes are never specialized: one binary serves every size), and with
    `varlen` their packed-sequence specializations ("... varlen"; not for runtime block sparsity, which takes
    none), and the forward's persistent form where the module has one ("_attn_fwd persistent"); for a spec with
    dropout, the forward and backward with it compiled in too ("... dropout", "... varlen dropout", "_attn_fwd
    persistent dropout"), and the backward's persistent form where the module's calls take one ("_attn_bwd
    persistent", "... varlen persistent", and with dropout "... persistent dropout"). {kernel name: CompiledKernel}."""
    import torch

    from ..runtime.dtypes import TORCH_DTYPES

    d = int(module.HEAD_DIM.value)
    if hasattr(module, "keys_contiguous"):  # an FP8 module: e4m3 inputs, a forward only
        dtype = torch.float8_e4m3fn
        q = torch.zeros(batch, heads, q_len, d, dtype=dtype)
        k = torch.zeros(batch, kv_heads, kv_len, d, dtype=dtype)
        o = torch.empty(q.shape, dtype=torch.bfloat16)
        lse = torch.empty(batch, heads, q_len, dtype=torch.float32)
        inputs = [torch.zeros([4] * ndim, dtype=TORCH_DTYPES[kind]) for _, kind, ndim in module.INPUTS]
        vt = torch.zeros(batch, kv_heads, d, -(-kv_len // 32) * 32, dtype=dtype)  # keys_contiguous(v)'s layout (only shapes matter)
        args = module.launch_args(q, k, vt, o, lse, *inputs)
        return {"_attn_fwd": compile_kernel(module._attn_fwd, args, {"num_warps": 4, "maxnreg": module.FWD_MAXNREG})}
    q = torch.empty(batch, heads, q_len, d, dtype=dtype)
    k = torch.empty(batch, kv_heads, kv_len, d, dtype=dtype)
    dv = module.VALUE_DIM.value if hasattr(module, "VALUE_DIM") else d  # V's and O's columns (a value_dim of the spec's own)
    v = k if dv == d else torch.empty(batch, kv_heads, kv_len, dv, dtype=dtype)
    o = torch.empty(batch, heads, q_len, dv, dtype=dtype)
    lse = torch.empty(batch, heads, q_len, dtype=torch.float32)
    inputs = [torch.zeros([4] * ndim, dtype=TORCH_DTYPES[kind]) for _, kind, ndim in module.INPUTS]  # only their types matter
    warps = {"num_warps": 4, "maxnreg": module.MAXNREG}  # the backward's
    fwd_warps = {"num_warps": 4, "maxnreg": module.FWD_MAXNREG}
    dq = torch.empty(q.shape, dtype=torch.float32)
    # runtime block sparsity: lists of kept blocks (only their type matters); such specs take no packed sequences
    extra: dict = {"blocks": (torch.zeros(batch, heads, 2, 3, dtype=torch.int32),) * 2} if hasattr(module, "SPARSE_BLOCK") else {}
    # the input pre-pass's summaries, of each input's element type (booleans as int8): made here, not by its kernel
    if hasattr(module, "BOUNDS"):
        kinds = [torch.int8 if t.dtype == torch.bool else t.dtype for t in inputs]
        extra["bounds"] = [torch.zeros(2, 4, 4, dtype=kinds[index]) for index, _ in module.BOUNDS]
    varlen = varlen and "blocks" not in extra
    backward = hasattr(module, "attention_backward")  # else a forward-only module (a head dim the Gluon backward does not take)
    stats = module.bwd_stats(batch, heads, q_len, "cpu") if backward else None
    order = module.bwd_order(batch, heads, q_len, kv_len, "cpu") if backward else None
    # (name, tensors of each kernel's launch: plain, and with VARLEN as packed (rows, H, D) tensors)
    calls = [("", (q, k, v, o, dq), {})]
    if varlen:  # packed sequences (cu_seqlens): the same kernels with VARLEN = True
        qp, kp, vp, op = (t[0].transpose(0, 1).contiguous() for t in (q, k, v, o))
        cu = torch.zeros(batch + 1, dtype=torch.int32)
        calls.append((" varlen", (qp, kp, vp, op, torch.empty(qp.shape, dtype=torch.float32)), {"varlen": (cu, cu, q_len, kv_len)}))
    # dropout compiled in (p > 0): the seed is a tensor the kernels read
    dropout, on = module.dropout_args(0.1, torch.tensor([2**40 + 7]), q.device) if hasattr(module, "dropout_args") else (None, None)
    kernels = {}
    if getattr(module, "PERSISTENT_FORWARD", False):  # the forward's persistent form (short calls, not packed)
        kernels["_attn_fwd persistent"] = compile_kernel(module._attn_fwd, module.launch_args(q, k, v, o, lse, *inputs, persistent=True, **extra),
                                                         fwd_warps | {"PERSISTENT": True})
    # the backward's forms: a program per work item, and persistent (a program per SM) where calls take it
    bwd_forms = {"": {}} | ({" persistent": {"PERSISTENT": True}} if getattr(module, "PERSISTENT_BACKWARD_MAX_KEYS", 0) else {})
    for tail, (q_, k_, v_, o_, dq_), packed in calls:
        flag = {"VARLEN": True} if packed else {}
        kernels[f"_attn_fwd{tail}"] = compile_kernel(module._attn_fwd, module.launch_args(q_, k_, v_, o_, lse, *inputs, **packed, **extra), fwd_warps | flag)
        if backward:
            for form, on_form in bwd_forms.items():
                kernels[f"_attn_bwd{tail}{form}"] = compile_kernel(module._attn_bwd, module.bwd_launch_args(q_, k_, k_, o_, stats, order, dq_, k_, k_,
                                                                                                           *inputs, **packed, **extra), warps | flag | on_form)
            kernels[f"_bwd_delta{tail}"] = compile_kernel(module._bwd_delta, module.delta_launch_args(o_, o_, lse, None, stats, order, k_, *inputs,
                                                                                                    dq=dq_, **packed, **extra), {"num_warps": 4} | flag)
        if dropout is not None:
            kernels[f"_attn_fwd{tail} dropout"] = compile_kernel(module._attn_fwd, module.launch_args(q_, k_, v_, o_, lse, *inputs, dropout=dropout,
                                                                                                       **packed, **extra), fwd_warps | flag | on)
            for form, on_form in bwd_forms.items() if backward else ():
                kernels[f"_attn_bwd{tail}{form} dropout"] = compile_kernel(
                    module._attn_bwd, module.bwd_launch_args(q_, k_, k_, o_, stats, order, dq_, k_, k_, *inputs, dropout=dropout, **packed, **extra),
                    warps | flag | on | on_form)
    if getattr(module, "PERSISTENT_FORWARD", False) and dropout is not None:
        kernels["_attn_fwd persistent dropout"] = compile_kernel(module._attn_fwd, module.launch_args(q, k, v, o, lse, *inputs, dropout=dropout,
                                                                                                      persistent=True, **extra),
                                                                 fwd_warps | {"PERSISTENT": True} | on)
    return kernels


def ptxas_report(kernel) -> dict:
    """Registers per thread and spilled bytes of a compiled kernel, from `ptxas -v` (Triton's own ptxas) over its
    PTX: a loaded kernel's n_regs needs a GPU; this does not."""
    import re
    import subprocess
    import tempfile
    from pathlib import Path

    from triton.backends.nvidia.compiler import get_ptxas

    ptxas = get_ptxas(ARCH).path
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "kernel.ptx"
        src.write_text(kernel.asm["ptx"])
        out = subprocess.run([ptxas, "-v", "--gpu-name", "sm_90a", str(src), "-o", str(Path(tmp) / "kernel.cubin")],
                             capture_output=True, text=True, check=True).stderr
    regs = re.search(r"Used (\d+) registers", out)
    spills = re.findall(r"(\d+) bytes spill (?:stores|loads)", out)
    return {"registers": int(regs.group(1)) if regs else None, "spill_bytes": sum(int(x) for x in spills)}


def main(argv: list[str] | None = None) -> int:
    """python -m attngen.codegen.gluon.binaries MODULE.py [bf16|fp16 ...]: compile a generated Gluon module's
    kernels for sm_90 and print one JSON line per kernel and dtype (shared memory, registers, spills,
    setmaxnreg budgets, instructions seen). Run in its own process: under TRITON_INTERPRET=1 Triton's library
    functions are interpreter objects, which Gluon cannot compile."""
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
        for kernel_name, kernel in compile_module(module, {"bf16": torch.bfloat16, "fp16": torch.float16}[name]).items():
            ptx = kernel.asm["ptx"]
            print(json.dumps({"kernel": kernel_name, "dtype": name, "shared": kernel.metadata.shared,
                              **ptxas_report(kernel),
                              "setmaxnreg": sorted(set(re.findall(r"setmaxnreg\.\w+\.sync\.aligned\.u32\s+(\d+)", ptx))),
                              "wgmma": "wgmma.mma_async" in ptx, "tma": "cp.async.bulk.tensor" in ptx,
                              "atomics": sorted(set(re.findall(r"\b(?:red|atom)\.[\w.]+", ptx))),
                              "tma_reduce": sorted(set(re.findall(r"cp\.reduce\.async\.bulk[\w.:]*", ptx))),
                              "cubin_bytes": len(kernel.asm["cubin"])}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
