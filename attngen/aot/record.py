"""What a bundle compiles: the specializations a spec's kernels need, found by calling the generated modules' own
launchers on small CPU tensors while each kernel is a recorder (see attngen/aot/__init__.py)."""
from __future__ import annotations

import sys
import types
from dataclasses import dataclass
from pathlib import Path

from ..lang.spec import DType, KVLayout, LoopOrder
from .manifest import specialization_key

SHAPES = ((2, 4, 2, 256, 256), (2, 4, 2, 200, 200), (1, 2, 1, 201, 201))  # (B, Hq, Hkv, Nq, Nk); see attngen/aot/__init__.py
# packed sequences (cu_seqlens): (query lengths, key lengths) per sequence, 4 query / 2 key-value heads; the totals
# (201 and 256) fall in different divisibility classes
PACKED = ((3, 70, 128), (4, 100, 152))
# Decode calls with per-sequence lengths (attngen/plan/decode.py): programs of 16, 32 and 64 rows (a key/value head's
# query heads x the new tokens), with the keys split or not: (B, Hq, Hkv, Nq) over a cache of 256 keys
DECODE_SHAPES = ((2, 8, 2, 1), (1, 8, 1, 4), (1, 8, 1, 8))


def _exec_module(name: str, path: Path, source: str) -> types.ModuleType:
    """Import `source` as module `name` with file `path` (Triton reads kernels' source through the file)."""
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def import_compiled(name: str, path: Path, source: str) -> types.ModuleType:
    """The module with real Triton kernels (JITFunction), even in a process that runs the interpreter."""
    import triton

    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        return _exec_module(name, path, source)


def jit_kernels(module) -> dict:
    from triton.runtime.jit import JITFunction

    return {name: fn for name, fn in vars(module).items() if isinstance(fn, JITFunction)}


@dataclass
class Launch:
    kernel: str
    signature: dict
    constexprs: dict
    attrs: dict
    options: dict
    key: str


class _Recorder:
    """Stands in for a kernel: `kernel[grid](*args, **kwargs)` records the specialization Triton's JIT
    would compile for those arguments on `target`, and launches nothing."""

    def __init__(self, fn, backend, sink: list):
        from triton.runtime.jit import create_function_from_signature

        self.fn, self.backend, self.sink = fn, backend, sink
        self.binder = create_function_from_signature(fn.signature, fn.params, backend)

    def __getitem__(self, grid):
        import triton
        from triton.compiler import ASTSource

        def launch(*args, **kwargs):
            kwargs["debug"] = kwargs.get("debug", self.fn.debug) or triton.knobs.runtime.debug  # as JITFunction.run
            kwargs["instrumentation_mode"] = triton.knobs.compilation.instrumentation_mode
            bound, specialization, options = self.binder(*args, **kwargs)
            options, signature, constexprs, attrs = self.fn._pack_args(self.backend, kwargs, bound, specialization, options)
            opts = dict(options.__dict__)
            key = specialization_key(ASTSource(self.fn, signature, constexprs, attrs), opts)
            self.sink.append(Launch(self.fn.__name__, signature, constexprs, attrs, opts, key))

        return launch


class _Recording:
    """`with _Recording(module, arch) as sink:` the module's kernels are recorders while the block runs; `sink`
    collects the launches."""

    def __init__(self, module, arch: int):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.module, self.backend, self.sink = module, make_backend(GPUTarget("cuda", arch, 32)), []
        self.originals = jit_kernels(module)

    def __enter__(self) -> list:
        for name, fn in self.originals.items():
            setattr(self.module, name, _Recorder(fn, self.backend, self.sink))
        return self.sink

    def __exit__(self, *exc) -> None:
        for name, fn in self.originals.items():
            setattr(self.module, name, fn)


def _unique(sink: list[Launch]) -> list[Launch]:
    unique: dict[str, Launch] = {}
    for launch in sink:
        unique.setdefault(launch.key, launch)
    return list(unique.values())


def _calls(spec):
    """(shape, q, k, v, inputs) of the recorded calls: CPU tensors of each of SHAPES, with the spec's inputs."""
    import torch

    from ..runtime.dtypes import TORCH_DTYPES
    from ..runtime.samples import make_inputs

    dtype = TORCH_DTYPES[spec.dtype.value]
    for B, Hq, Hkv, Nq, Nk in SHAPES:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, h, n, d, generator=gen).to(dtype) for h, n, d in ((Hq, Nq, spec.head_dim), (Hkv, Nk, spec.head_dim), (Hkv, Nk, spec.dv)))
        yield (B, Hq, Hkv, Nq, Nk), q, k, v, make_inputs(spec, B, Hq, Nq, Nk, "cpu", gen)


def record_launches(kernel_plan, module, arch: int) -> list[Launch]:
    """Every distinct specialization the module's launchers ask for (see attngen/aot/__init__.py), for sm_`arch`."""
    import torch

    from ..runtime import Kernel
    from ..runtime.checks import Dims, dropout_args

    spec = kernel_plan.spec
    kern = Kernel(spec, kernel_plan, "", Path(module.__file__), module)
    with _Recording(module, arch) as sink:
        fp8 = spec.dtype is DType.FP8  # a forward only, never the decode kernels
        if hasattr(module, "attention_decode") and not fp8:
            _record_decode(spec, module)
        for shape, q, k, v, inputs in _calls(spec) if spec.kv_layout is not KVLayout.PAGED else ():
            block_mask = inputs.pop("block_mask", None)
            tensors = [inputs[d.name] for d in spec.inputs]
            # dropout on and off (evaluation); the seed is a tensor the kernels read
            for p, seed in ([(spec.dropout, 1), (0.0, 1)] if spec.dropout > 0.0 else [(None, None)]):
                extra = kern._extra(*dropout_args(spec, p, seed, q.device), block_mask, Dims(*shape), q.device)
                extra |= kern.lists.of_pattern(Dims(*shape), q.device)  # a static block pattern's lists (KernelPlan.block_lists)
                o, lse = module.attention_forward(q, k, v, *tensors, **extra)
                for input_grads in ([False, True] if kernel_plan.read_grads or spec.sink is not None else [False]) if not fp8 else ():
                    grads = {"input_grads": True} if input_grads and kernel_plan.read_grads else {}
                    if input_grads and spec.sink is not None:  # the pre-pass writing each row's gradient of its sink
                        grads["sink_grads"] = torch.empty(lse.shape, device=lse.device, dtype=torch.float32)
                    module.attention_backward(q, k, v, o, lse, torch.randn_like(o), None, *tensors, **grads, **extra)
        for q, k, v, varlen, tensors, dims in _packed_calls(spec) if takes_packed(spec) else ():
            for p, seed in ([(spec.dropout, 1), (0.0, 1)] if spec.dropout > 0.0 else [(None, None)]):
                extra = kern._extra(*dropout_args(spec, p, seed, q.device), None, dims, q.device) | kern.lists.of_pattern(dims, q.device)
                o, lse = module.attention_forward(q, k, v, *tensors, **extra, varlen=varlen)
                for sink_grads in ([None, torch.empty(lse.shape, device=lse.device, dtype=torch.float32)] if spec.sink is not None else [None]):
                    grads = {} if sink_grads is None else {"sink_grads": sink_grads}  # with a sink: its gradients' pre-pass too
                    module.attention_backward(q, k, v, o, lse, torch.randn_like(o), None, *tensors, **grads, **extra, varlen=varlen)
    return _unique(sink)


def takes_packed(spec) -> bool:
    """Whether calls with packed sequences (cu_seqlens) can run this spec's kernels (runtime/packed.py refuses
    the rest)."""
    return (spec.loop_order is LoopOrder.Q_OUTER and spec.sparsity != "runtime" and spec.kv_layout is KVLayout.CONTIGUOUS
            and spec.dtype is not DType.FP8 and spec.kv_dtype is None)


def _packed_calls(spec):
    """(q, k, v as the runtime hands them to a module, varlen, the spec's inputs, their sizes) of packed sequences:
    (1, H, total rows, D) views of (total rows, H, D) CPU tensors, for each of PACKED."""
    import torch

    from ..runtime.checks import Dims
    from ..runtime.dtypes import TORCH_DTYPES
    from ..runtime.samples import make_inputs

    dtype = TORCH_DTYPES[spec.dtype.value]
    for q_lens, kv_lens in ((PACKED[0], PACKED[1]), (PACKED[1], PACKED[1])):
        gen = torch.Generator().manual_seed(0)
        cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32) for lens in (q_lens, kv_lens)]
        q = torch.randn(sum(q_lens), 4, spec.head_dim, generator=gen).to(dtype)
        k, v = (torch.randn(sum(kv_lens), 2, d, generator=gen).to(dtype) for d in (spec.head_dim, spec.dv))
        dims = Dims(len(q_lens), 4, 2, max(q_lens), max(kv_lens))
        inputs = make_inputs(spec, dims.batch, 4, dims.q_len, dims.kv_len, "cpu", gen)
        yield (*(t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v)), (cu[0], cu[1], dims.q_len, dims.kv_len),
               [inputs[d.name] for d in spec.inputs], dims)


def _record_decode(spec, module) -> None:
    """The decode launcher's calls with per-sequence lengths (DECODE_SHAPES), split in 1 and 2 runs."""
    import torch

    from ..plan.decode import block_rows
    from ..runtime.dtypes import TORCH_DTYPES
    from ..runtime.samples import make_inputs

    dtype = TORCH_DTYPES[spec.dtype.value]
    paged = spec.kv_layout is KVLayout.PAGED
    for B, Hq, Hkv, Nq in DECODE_SHAPES:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(B, Hq, Nq, spec.head_dim, generator=gen).to(dtype)
        if paged:
            pages = 256 // spec.page_size
            k, v = (torch.randn(B * pages, spec.page_size, Hkv, d, generator=gen).to(dtype) for d in (spec.head_dim, spec.dv))
            table = {"block_table": torch.arange(B * pages, dtype=torch.int32).view(B, pages)}
        else:
            k, v = (torch.randn(B, Hkv, 256, d, generator=gen).to(dtype) for d in (spec.head_dim, spec.dv))
            table = {}
        inputs = make_inputs(spec, B, Hq, Nq, 256, "cpu", gen)
        tensors = [inputs[d.name] for d in spec.inputs]
        # latent attention (K read in two parts): V as a view of K's first columns, as MLA passes it, and V of its own
        for v_arg in (v, k[..., :spec.dv]) if hasattr(module, "TAIL_DIM") else (v,):
            for splits in (1, 2):
                module.attention_decode(q, k, v_arg, *tensors, kv_lens=torch.full((B,), 200, dtype=torch.int32),
                                        block_r=block_rows(Hq // Hkv * Nq), num_splits=splits, **table)


def record_gluon_launches(kernel_plan, choice, module, arch: int) -> list[Launch]:
    """The specializations a Gluon module's launchers ask for: its forward, and its backward where `choice`
    has the Gluon generator render it. Their sizes are never specialized and the descriptors carry only their
    block shapes, so the shapes add nothing but a check that they agree."""
    import torch

    from ..runtime.blocks import block_lists

    spec = kernel_plan.spec
    # dropout on and off (evaluation); the seed is a tensor the kernels read
    seed = torch.tensor([2**40 + 1])
    dropouts = [{"dropout_p": spec.dropout, "seed": seed}, {"dropout_p": 0.0, "seed": seed}] if spec.dropout > 0.0 else [{}]
    with _Recording(module, arch) as sink:
        for (B, Hq, _, Nq, Nk), q, k, v, inputs in _calls(spec):
            block_mask = inputs.pop("block_mask", None)  # runtime block sparsity: the lists the kernels walk
            sparse = {} if block_mask is None else {"blocks": block_lists(block_mask, spec.sparse_block, B, Hq, Nq, Nk, q.device)}
            tensors = [inputs[d.name] for d in spec.inputs]
            for extra in dropouts:
                o, lse = module.attention_forward(q, k, v, *tensors, **extra, **sparse)
                if getattr(module, "PERSISTENT_FORWARD", False):  # both forms of the forward: each call length takes one
                    module.attention_forward(q, k, v, *tensors, **extra, **sparse, persistent=not module.takes_persistent(k.shape[2]))
                if choice.backward == "gluon":
                    module.attention_backward(q, k, v, o, lse, torch.randn_like(o), None, *tensors, **extra, **sparse)
                    if getattr(module, "PERSISTENT_BACKWARD_MAX_KEYS", 0):  # both forms of the backward: each call length takes one
                        module.attention_backward(q, k, v, o, lse, torch.randn_like(o), None, *tensors, **extra, **sparse,
                                                  persistent=not module.takes_persistent_backward(k.shape[2]))
        for q, k, v, varlen, tensors, _ in _packed_calls(spec) if takes_packed(spec) else ():
            for extra in dropouts:
                o, lse = module.attention_forward(q, k, v, *tensors, **extra, varlen=varlen)
                if choice.backward == "gluon":
                    module.attention_backward(q, k, v, o, lse, torch.randn_like(o), None, *tensors, **extra, varlen=varlen)
                    if getattr(module, "PERSISTENT_BACKWARD_MAX_KEYS", 0):
                        module.attention_backward(q, k, v, o, lse, torch.randn_like(o), None, *tensors, **extra, varlen=varlen,
                                                  persistent=not module.takes_persistent_backward(varlen[3]))
    return _unique(sink)
