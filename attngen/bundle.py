"""Ahead-of-time bundles: generated modules plus their GPU binaries, built on a machine without a GPU.

    attngen build specs/causal.attn --target h100 -o build      # any machine; no GPU, no CUDA toolkit
    kern = attngen.load("build")                                  # on the H100: no Triton compilation

A bundle is a directory: `manifest.json`, one readable module per (spec, target) (`causal_h100.py`, the
same file the JIT path caches) and the binaries of its kernels (`causal_h100/<kernel>-<hash>/` with the
.cubin, Triton's metadata .json and the .ptx). Where the spec's forward (or backward) is the Gluon generator's
on that target (attngen/codegen/gluon/choice.py decides, as for a just-in-time compile), the entry also holds
the Gluon module (`causal_h100_gluon.py`) and its kernels' binaries, under the entry's "gluon" key. Paths in
the manifest are relative: copy the directory anywhere. Every file's sha256 is in the manifest and is
checked on load.

What to compile. Triton compiles one binary per *specialization* of a kernel: argument types, which integer
arguments equal 1, which pointers and integers are divisible by 16, the constexpr values, warps and stages.
A build finds the specializations a spec really needs the way the GPU would: it imports the generated module
with real (not interpreted) Triton kernels, puts a recorder in place of each kernel, and calls the module's
own launchers (forward and backward; with and without dropout and input gradients where the spec has them)
on small CPU tensors at three sequence lengths whose strides fall in different divisibility classes (256,
200, 201), and its decode launcher with per-sequence lengths (programs of 16, 32 and 64 rows, the keys split
and not; a paged spec's only launcher). Packed sequences (cu_seqlens) are recorded once, where the spec takes them. A decode call without kv_lens, or with
q_lens, is compiled just in time. Triton's own binder specializes each recorded launch for the target's backend, as the JIT does
on the device; every distinct specialization is compiled with
`triton.compile(ASTSource(...), target=GPUTarget("cuda", arch, 32))` (GluonASTSource for a Gluon kernel), in
worker processes (a crash in LLVM cannot take the build down with it). The Gluon module's launchers are
recorded the same way, for the passes it renders.

How a load launches them. Triton's JIT, on a call it has no binary for, calls its kernel's `compile`
attribute. `load` points that attribute, for each kernel of the bundle's module, at a lookup in the bundle:
the JIT specializes the call as usual, and a specialization the bundle holds comes back as a
`CompiledKernel` made from the bundle's files, which the JIT then caches and launches: no compilation.
A specialization the bundle lacks (a tensor not 16-byte aligned, an int64 stride, a non-contiguous input)
is compiled just in time with a BundleWarning, or raises BundleError with strict=True.

Before that, `load` checks, in this order, and on the first failure warns and compiles the bundle's spec just
in time (strict=True: raises BundleError): every file's digest; that this attngen and Triton render
exactly the bundled module from the bundled spec (so the binaries were built from this code); Triton's
version; a CUDA device whose compute capability is the target's. torch's version is recorded but not
checked: the binaries do not depend on it.

A digest detects corruption and edits of single files, not a malicious bundle: whoever can rewrite the
binaries can rewrite the manifest. Loading a bundle runs its module's Python code: load bundles you trust,
as you would a Python package.

Uses two internals of Triton 3.6 (pinned): `triton.runtime.jit.create_function_from_signature` and
`JITFunction._pack_args` (the JIT's binder), and the `compile` attribute the JIT calls on a cache miss.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import sys
import tempfile
import time
import types
import warnings
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from .errors import AttngenError
from .spec import DType, KVLayout, LoopOrder

FORMAT = "attngen-bundle/1"
MANIFEST = "manifest.json"
SHAPES = ((2, 4, 2, 256, 256), (2, 4, 2, 200, 200), (1, 2, 1, 201, 201))  # (B, Hq, Hkv, Nq, Nk); see the module doc
# packed sequences (cu_seqlens): (query lengths, key lengths) per sequence, 4 query / 2 key-value heads; the totals
# (201 and 256) fall in different divisibility classes
PACKED = ((3, 70, 128), (4, 100, 152))
# Decode calls with per-sequence lengths (attngen/decode.py): programs of 16, 32 and 64 rows (a key/value head's
# query heads x the new tokens), with the keys split or not: (B, Hq, Hkv, Nq) over a cache of 256 keys
DECODE_SHAPES = ((2, 8, 2, 1), (1, 8, 1, 4), (1, 8, 1, 8))
KEEP_EXTENSIONS = ("cubin", "json", "ptx")  # the binary, Triton's metadata (both needed to launch), and the readable PTX
# Triton options that change the binary (the others are the backend's constants or build-machine paths)
OPTION_KEYS = ("arch", "num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid",
               "launch_pdl", "debug", "sanitize_overflow", "instrumentation_mode")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class BundleError(AttngenError):
    """A bundle cannot be built, or (strict=True) cannot be used as built."""


class BundleWarning(UserWarning):
    """A bundle was not used as built: kernels are compiled just in time instead (the message says why)."""


# ------------------------------------------------------------------------------------------------ specializations

def specialization_key(src, options: dict) -> str:
    """A canonical string of everything that selects a binary: the kernel, its argument types, constexpr
    values, divisibility attributes and the options in OPTION_KEYS. `src` is Triton's ASTSource, built by the
    build from a recorded launch and by Triton's JIT on the device from a real one: the same call gives the
    same key on both."""
    names = list(src.signature)

    def arg(path) -> str:
        return ".".join([names[path[0]]] + [str(i) for i in path[1:]])

    return json.dumps({
        "kernel": src.name,
        "signature": {k: str(v) for k, v in src.signature.items()},
        "constants": {arg(k): repr(v) for k, v in src.constants.items()},
        "attrs": {arg(k): v for k, v in src.attrs.items() if v},
        "options": {k: options.get(k) for k in OPTION_KEYS},
    }, sort_keys=True)


def _describe_miss(key: str, known: list[str]) -> str:
    """Which arguments of a call's specialization differ from the nearest one the bundle holds."""
    def say(part: str, value) -> str:
        if part == "attrs":
            return "divisible by 16" if value else "not known divisible by 16"
        if part == "constants":
            return "not a constant" if value is None else f"constant {value}"
        return repr(value)

    got = json.loads(key)
    best, diff = None, None
    for k in known:
        have = json.loads(k)
        d = []
        for part in ("signature", "constants", "attrs", "options"):
            for name in sorted(set(got[part]) | set(have[part])):
                if got[part].get(name) != have[part].get(name):
                    d.append(f"{name}: {say(part, got[part].get(name))} in this call, {say(part, have[part].get(name))} in the bundle")
        if diff is None or len(d) < len(diff):
            best, diff = k, d
    if best is None:
        return "the bundle has no binary of this kernel"
    return "differs in " + "; ".join(diff[:4]) + (f"; and {len(diff) - 4} more" if len(diff) > 4 else "")


# ------------------------------------------------------------------------------------------------ importing

def _exec_module(name: str, path: Path, source: str) -> types.ModuleType:
    """Import `source` as module `name` with file `path` (Triton reads kernels' source through the file)."""
    module = types.ModuleType(name)
    module.__file__ = str(path)
    sys.modules[name] = module
    exec(compile(source, str(path), "exec"), module.__dict__)
    return module


def _import_compiled(name: str, path: Path, source: str) -> types.ModuleType:
    """The module with real Triton kernels (JITFunction), even in a process that runs the interpreter."""
    import triton

    with triton.knobs.runtime.scope():
        triton.knobs.runtime.interpret = False
        return _exec_module(name, path, source)


def _kernels(module) -> dict:
    from triton.runtime.jit import JITFunction

    return {name: fn for name, fn in vars(module).items() if isinstance(fn, JITFunction)}


# ------------------------------------------------------------------------------------------------ recording

@dataclass
class _Launch:
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
            self.sink.append(_Launch(self.fn.__name__, signature, constexprs, attrs, opts, key))

        return launch


class _Recording:
    """`with _Recording(module, arch) as sink:` the module's kernels are recorders while the block runs; `sink`
    collects the launches."""

    def __init__(self, module, arch: int):
        from triton.backends.compiler import GPUTarget
        from triton.compiler import make_backend

        self.module, self.backend, self.sink = module, make_backend(GPUTarget("cuda", arch, 32)), []
        self.originals = _kernels(module)

    def __enter__(self) -> list:
        for name, fn in self.originals.items():
            setattr(self.module, name, _Recorder(fn, self.backend, self.sink))
        return self.sink

    def __exit__(self, *exc) -> None:
        for name, fn in self.originals.items():
            setattr(self.module, name, fn)


def _unique(sink: list[_Launch]) -> list[_Launch]:
    unique: dict[str, _Launch] = {}
    for launch in sink:
        unique.setdefault(launch.key, launch)
    return list(unique.values())


def _calls(spec):
    """(shape, q, k, v, inputs) of the recorded calls: CPU tensors of each of SHAPES, with the spec's inputs."""
    import torch

    from .dtypes import TORCH_DTYPES
    from .verify import make_inputs

    dtype = TORCH_DTYPES[spec.dtype.value]
    for B, Hq, Hkv, Nq, Nk in SHAPES:
        gen = torch.Generator().manual_seed(0)
        q, k, v = (torch.randn(B, h, n, spec.head_dim, generator=gen).to(dtype) for h, n in ((Hq, Nq), (Hkv, Nk), (Hkv, Nk)))
        yield (B, Hq, Hkv, Nq, Nk), q, k, v, make_inputs(spec, B, Hq, Nq, Nk, "cpu", gen)


def record_launches(kernel_plan, module, arch: int) -> list[_Launch]:
    """Every distinct specialization the module's launchers ask for (see the module doc), for sm_`arch`."""
    import torch

    from .runtime import Kernel, _Dims

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
                extra = kern._extra(*kern._dropout_args(p, seed, q.device), block_mask, _Dims(*shape), q.device)
                o, lse = module.attention_forward(q, k, v, *tensors, **extra)
                for input_grads in ([False, True] if kernel_plan.read_grads else [False]) if not fp8 else ():
                    grads = {"input_grads": True} if input_grads else {}
                    module.attention_backward(q, k, v, o, lse, torch.randn_like(o), None, *tensors, **grads, **extra)
        for q, k, v, varlen, tensors, dims in _packed_calls(spec) if takes_packed(spec) else ():
            for p, seed in ([(spec.dropout, 1), (0.0, 1)] if spec.dropout > 0.0 else [(None, None)]):
                extra = kern._extra(*kern._dropout_args(p, seed, q.device), None, dims, q.device)
                o, lse = module.attention_forward(q, k, v, *tensors, **extra, varlen=varlen)
                module.attention_backward(q, k, v, o, lse, torch.randn_like(o), None, *tensors, **extra, varlen=varlen)
    return _unique(sink)


def takes_packed(spec) -> bool:
    """Whether calls with packed sequences (cu_seqlens) can run this spec's kernels (runtime.Kernel._varlen refuses
    the rest)."""
    return (spec.loop_order is LoopOrder.Q_OUTER and spec.sparsity != "runtime" and spec.kv_layout is KVLayout.CONTIGUOUS
            and spec.dtype is not DType.FP8 and spec.kv_dtype is None)


def _packed_calls(spec):
    """(q, k, v as the runtime hands them to a module, varlen, the spec's inputs, their sizes) of packed sequences:
    (1, H, total rows, D) views of (total rows, H, D) CPU tensors, for each of PACKED."""
    import torch

    from .dtypes import TORCH_DTYPES
    from .runtime import _Dims
    from .verify import make_inputs

    dtype = TORCH_DTYPES[spec.dtype.value]
    for q_lens, kv_lens in ((PACKED[0], PACKED[1]), (PACKED[1], PACKED[1])):
        gen = torch.Generator().manual_seed(0)
        cu = [torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32) for lens in (q_lens, kv_lens)]
        q = torch.randn(sum(q_lens), 4, spec.head_dim, generator=gen).to(dtype)
        k, v = (torch.randn(sum(kv_lens), 2, spec.head_dim, generator=gen).to(dtype) for _ in range(2))
        dims = _Dims(len(q_lens), 4, 2, max(q_lens), max(kv_lens))
        inputs = make_inputs(spec, dims.batch, 4, dims.q_len, dims.kv_len, "cpu", gen)
        yield (*(t.permute(1, 0, 2).unsqueeze(0) for t in (q, k, v)), (cu[0], cu[1], dims.q_len, dims.kv_len),
               [inputs[d.name] for d in spec.inputs], dims)


def _record_decode(spec, module) -> None:
    """The decode launcher's calls with per-sequence lengths (DECODE_SHAPES), split in 1 and 2 runs."""
    import torch

    from .decode import block_rows
    from .dtypes import TORCH_DTYPES
    from .verify import make_inputs

    dtype = TORCH_DTYPES[spec.dtype.value]
    paged = spec.kv_layout is KVLayout.PAGED
    for B, Hq, Hkv, Nq in DECODE_SHAPES:
        gen = torch.Generator().manual_seed(0)
        q = torch.randn(B, Hq, Nq, spec.head_dim, generator=gen).to(dtype)
        if paged:
            pages = 256 // spec.page_size
            k = torch.randn(B * pages, spec.page_size, Hkv, spec.head_dim, generator=gen).to(dtype)
            table = {"block_table": torch.arange(B * pages, dtype=torch.int32).view(B, pages)}
        else:
            k = torch.randn(B, Hkv, 256, spec.head_dim, generator=gen).to(dtype)
            table = {}
        inputs = make_inputs(spec, B, Hq, Nq, 256, "cpu", gen)
        tensors = [inputs[d.name] for d in spec.inputs]
        for splits in (1, 2):
            module.attention_decode(q, k, k, *tensors, kv_lens=torch.full((B,), 200, dtype=torch.int32), block_r=block_rows(Hq // Hkv * Nq),
                                    num_splits=splits, **table)


def record_gluon_launches(kernel_plan, choice, module, arch: int) -> list[_Launch]:
    """The specializations a Gluon module's launchers ask for: its forward, and its backward where `choice`
    has the Gluon generator render it. Their sizes are never specialized and the descriptors carry only their
    block shapes, so the shapes add nothing but a check that they agree."""
    import torch

    from .blocks import block_lists

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


# ------------------------------------------------------------------------------------------------ compiling

_worker_modules: dict[str, types.ModuleType] = {}


def _worker_init() -> None:
    """Compiler processes run real Triton even when the parent runs the interpreter (TRITON_INTERPRET=1 makes
    Triton's own library functions interpreted at import, which the compiler cannot use)."""
    os.environ.pop("TRITON_INTERPRET", None)


def _compile_job(module_path: str, module_name: str, launch: _Launch, arch: int) -> tuple[str, dict[str, bytes], int]:
    """In a worker process: compile one recorded specialization; (Triton's hash, {file name: bytes}, shared bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    module = _worker_modules.get(module_path)
    if module is None:
        module = _worker_modules[module_path] = _import_compiled(module_name, Path(module_path), Path(module_path).read_text(encoding="utf-8"))
    fn = getattr(module, launch.kernel)  # a real JITFunction: _worker_init turned the interpreter off
    source_class = GluonASTSource if fn.is_gluon() else ASTSource
    compiled = triton.compile(source_class(fn, launch.signature, launch.constexprs, launch.attrs),
                              target=GPUTarget("cuda", arch, 32), options=launch.options)
    files = {}
    for fname, fpath in compiled.metadata_group.items():
        if fname.rsplit(".", 1)[-1] in KEEP_EXTENSIONS and not fname.startswith("__grp__"):
            files[fname] = Path(fpath).read_bytes()
    return compiled.hash, files, int(compiled.metadata.shared)


class _Progress:
    """A one-line progress bar on a terminal; one line per step otherwise (CI logs)."""

    def __init__(self, total: int, enabled: bool, stream=None):
        self.total, self.done, self.enabled = total, 0, enabled
        self.stream = stream or sys.stderr
        self.tty = self.stream.isatty()
        self.start = time.monotonic()

    def step(self, what: str) -> None:
        self.done += 1
        if not self.enabled:
            return
        elapsed = time.monotonic() - self.start
        if self.tty:
            width = 24
            filled = width * self.done // max(1, self.total)
            self.stream.write(f"\r[{'#' * filled}{'.' * (width - filled)}] {self.done}/{self.total} kernels {elapsed:5.0f}s  {what[:60]:<60}")
            if self.done == self.total:
                self.stream.write("\n")
        else:
            self.stream.write(f"[{self.done}/{self.total}] {what} ({elapsed:.0f}s)\n")
        self.stream.flush()


# ------------------------------------------------------------------------------------------------ building

@dataclass
class _Job:
    entry: dict
    plan: object
    source: str
    launches: list = field(default_factory=list)
    choice: object = None  # codegen.gluon.Choice: which generator renders each pass
    gluon_source: str | None = None  # the Gluon module, where the choice takes Gluon
    gluon_launches: list = field(default_factory=list)


def _sha256(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def _entry_files(entry: dict) -> list[tuple[str, str]]:
    """(relative path, sha256) of every file of a manifest entry: its module, its kernels' files, then the same
    of its Gluon module where it has one."""
    files = [(entry["module"]["path"], entry["module"]["sha256"])] + [
        (f["path"], f["sha256"]) for k in entry["kernels"] for f in k["files"].values()]
    gluon = entry.get("gluon")
    if gluon is not None:
        files += [(gluon["module"]["path"], gluon["module"]["sha256"])] + [
            (f["path"], f["sha256"]) for k in gluon["kernels"] for f in k["files"].values()]
    return files


def _plan_summary(p) -> dict:
    return {
        "loop_order": p.loop_order.value,
        "forward": {"block_m": p.block_m, "block_n": p.block_n, "num_warps": p.num_warps, "num_stages": p.num_stages},
        "backward_dkdv": {"block_m": p.bwd_block_m, "block_n": p.bwd_block_n, "num_warps": p.bwd_num_warps, "num_stages": p.bwd_num_stages},
        "backward_dq": {"block_m": p.dq_block_m, "block_n": p.dq_block_n, "num_warps": p.dq_num_warps, "num_stages": p.dq_num_stages},
    }


def read_manifest(directory: Path) -> dict:
    path = Path(directory) / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise BundleError(f"{directory} is not an attngen bundle: it has no {MANIFEST} (build one with `attngen build SPEC --target NAME -o DIR`)") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise BundleError(f"{path}: unreadable manifest ({err})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or not isinstance(manifest.get("entries"), list):
        raise BundleError(f"{path}: not a {FORMAT} manifest (format {manifest.get('format') if isinstance(manifest, dict) else None!r})")
    if not all(isinstance(manifest.get(f), str) for f in ("attngen", "triton")):
        raise BundleError(f"{path}: the versions of attngen and triton that built it must be strings")
    for entry in manifest["entries"]:
        for fld in ("name", "target", "arch", "spec", "spec_hash", "module", "kernels"):
            if not isinstance(entry, dict) or fld not in entry:
                raise BundleError(f"{path}: an entry lacks {fld!r}")
        if not all(isinstance(entry[f], str) for f in ("name", "target", "spec", "spec_hash")) or type(entry["arch"]) is not int:
            raise BundleError(f"{path}: an entry's name, target, spec and spec_hash must be strings and its arch an integer")
        where = f"{path}: entry {entry['name']!r} for {entry['target']!r}"
        gluon = entry.get("gluon")
        if gluon is not None and not (isinstance(gluon, dict) and gluon.get("forward") in ("gluon", "triton") and gluon.get("backward") in ("gluon", "triton")):
            raise BundleError(f"{where} has a malformed 'gluon' section")
        for part, section in (("", entry), (" (Gluon)", gluon)) if gluon is not None else (("", entry),):
            if not _is_file_record(section.get("module")):
                raise BundleError(f"{where}{part}: its module must be {{\"path\": ..., \"sha256\": ...}}")
            kernels = section.get("kernels")
            if not (isinstance(kernels, list) and all(isinstance(k, dict) and all(isinstance(k.get(f), str) for f in ("kernel", "key", "triton_hash"))
                                                      and isinstance(k.get("files"), dict) and all(_is_file_record(f) for f in k["files"].values())
                                                      for k in kernels)):
                raise BundleError(f"{where}{part}: its kernels must be a list of {{\"kernel\", \"key\", \"triton_hash\": strings, "
                                  f"\"files\": {{file: {{\"path\", \"sha256\"}}}}}}")
        for rel, _ in _entry_files(entry):
            if not isinstance(rel, str) or Path(rel).is_absolute() or ".." in Path(rel).parts:
                raise BundleError(f"{path}: file path {rel!r} leaves the bundle directory")
        if not _NAME.match(entry["name"]) or not _NAME.match(entry["target"].replace("-", "_")):
            raise BundleError(f"{path}: bad entry name {entry['name']!r} / target {entry['target']!r}")
    return manifest


def _is_file_record(record) -> bool:
    return isinstance(record, dict) and isinstance(record.get("path"), str) and isinstance(record.get("sha256"), str)


def build(specs, targets: list[str], out_dir, *, jobs: int | None = None, binaries: bool = True, progress: bool = True) -> dict:
    """Build a bundle in `out_dir`: every spec (path, text or Spec) for every target name. Returns the
    manifest. Everything is planned before anything is compiled, and the directory is replaced only when the
    whole build succeeded (entries of an existing bundle in `out_dir` for other spec/target pairs are kept)."""
    from . import __version__
    from .canonical import format_spec
    from .check import read_spec
    from .errors import PlanError
    from .plan import plan as make_plan
    from .codegen import versions
    from .codegen.gluon import build_source as build_gluon_source
    from .codegen.gluon import choose
    from .codegen.triton import build_source

    out_dir = Path(out_dir)
    spec_objs = [read_spec(s) for s in specs]
    names = [s.name for s in spec_objs]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise BundleError(f"two specs are named {dup[0]!r}: a bundle holds one spec per name")
    if not targets:
        raise BundleError("no target: name at least one (--target h100; `attngen targets` lists them)")
    if any(t.strip().lower() in ("", "auto") for t in targets):
        raise BundleError("a bundle is built for named GPUs (--target h100; `attngen targets` lists them): `auto` means the live GPU, "
                          "which a build does not have")
    work: list[_Job] = []
    seen: set = set()
    for spec in spec_objs:
        for target in dict.fromkeys(t.strip().lower() for t in targets):
            try:
                p = make_plan(spec, target)
            except PlanError as err:
                text = str(err)  # (the plan's message starts with the spec's name, which the file stands for here)
                raise PlanError(f"{spec.filename or spec.name} for {target}: {text.removeprefix(spec.name + ': ')}") from None
            if binaries and p.target.arch < 75:
                raise BundleError(f"{spec.name} for {target}: Triton {versions()['triton']} compiles for compute capability 7.5 "
                                  f"and newer; {p.target.full_name} is {p.target.arch / 10:.1f}")
            if (spec.name, p.target.name) in seen:  # two spellings of one GPU
                continue
            seen.add((spec.name, p.target.name))
            _, source = build_source(p)
            entry = {
                "name": spec.name, "target": p.target.name, "arch": p.target.arch, "gpu": p.target.full_name,
                "spec_hash": p.spec_hash, "spec": format_spec(spec), "plan": _plan_summary(p),
                "module": {"path": f"{spec.name}_{p.target.name}.py", "sha256": _sha256(source.encode())},
                "kernels": [],
            }
            job = _Job(entry, p, source, choice=choose(spec, p))
            if job.choice.gluon is not None:
                _, job.gluon_source = build_gluon_source(job.choice.gluon)
                entry["gluon"] = {
                    "module": {"path": f"{spec.name}_{p.target.name}_gluon.py", "sha256": _sha256(job.gluon_source.encode())},
                    "forward": job.choice.generator, "backward": job.choice.backward, "kernels": [],
                }
            work.append(job)

    out_dir = out_dir.resolve()  # `-o .` and a link to a bundle: the directory itself is replaced
    old = _existing_bundle(out_dir, {(j.entry["name"], j.entry["target"]) for j in work})
    try:
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.build-", dir=out_dir.parent))
        os.chmod(staging, 0o777 & ~_umask())  # mkdtemp makes it 0700: the bundle gets a directory's usual mode
    except OSError as err:
        raise BundleError(f"cannot write the bundle next to {out_dir}: {err.strerror} ({err.filename})") from None
    try:
        for job in work:
            path = staging / job.entry["module"]["path"]
            path.write_text(job.source, encoding="utf-8")
            if job.gluon_source is not None:
                (staging / job.entry["gluon"]["module"]["path"]).write_text(job.gluon_source, encoding="utf-8")
            if binaries:
                module = _import_compiled(f"attngen_build_{job.entry['name']}_{job.entry['arch']}_{os.getpid()}", path, job.source)
                job.launches = record_launches(job.plan, module, job.entry["arch"])
                if job.gluon_source is not None:
                    gluon_path = staging / job.entry["gluon"]["module"]["path"]
                    gluon = _import_compiled(f"attngen_build_{job.entry['name']}_{job.entry['arch']}_gluon_{os.getpid()}", gluon_path, job.gluon_source)
                    job.gluon_launches = record_gluon_launches(job.plan, job.choice, gluon, job.entry["arch"])
        _compile_all(work, staging, jobs, progress)
        entries = [j.entry for j in work]
        if old is not None:  # keep the old bundle's other entries, files included
            replaced = {(e["name"], e["target"]) for e in entries}
            for e in old["entries"]:
                if (e["name"], e["target"]) not in replaced:
                    for rel, _ in _entry_files(e):
                        (staging / rel).parent.mkdir(parents=True, exist_ok=True)
                        shutil.copy2(out_dir / rel, staging / rel)
                    entries.append(e)
        ver = versions()
        manifest = {
            "format": FORMAT,
            "attngen": __version__, "triton": ver["triton"], "torch": ver["torch"],
            "created": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "entries": sorted(entries, key=lambda e: (e["name"], e["target"])),
        }
        (staging / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n", encoding="utf-8")
        _swap(staging, out_dir)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return manifest


def _compile_all(work: list[_Job], staging: Path, jobs: int | None, progress: bool) -> None:
    """Compile every job's launches (in `jobs` worker processes) and write the files into `staging`."""
    tasks = [(job, launch, False) for job in work for launch in job.launches]
    tasks += [(job, launch, True) for job in work for launch in job.gluon_launches]
    if not tasks:
        return
    bar = _Progress(len(tasks), progress)
    jobs = max(1, min(jobs or os.cpu_count() or 1, len(tasks)))
    import multiprocessing

    with ProcessPoolExecutor(max_workers=jobs, mp_context=multiprocessing.get_context("spawn"), initializer=_worker_init) as pool:
        futures = []
        for job, launch, gluon in tasks:
            module = job.entry["gluon"]["module"] if gluon else job.entry["module"]
            name = f"attngen_bundle_build_{job.entry['name']}" + ("_gluon" if gluon else "")
            futures.append(pool.submit(_compile_job, str(staging / module["path"]), name, launch, job.entry["arch"]))
        for (job, launch, gluon), future in zip(tasks, futures):
            what = f"{job.entry['name']} for {job.entry['target']}: {launch.kernel}" + (" (Gluon)" if gluon else "")
            try:
                triton_hash, files, shared = future.result()
            except BrokenProcessPool:
                raise BundleError(f"{what}: the compiler process died (an LLVM/ptxas crash for sm_{job.entry['arch']})") from None
            except Exception as err:  # Triton's compile errors carry the kernel source position
                raise BundleError(f"{what}: Triton could not compile it for sm_{job.entry['arch']}: {err}") from err
            limit = job.plan.target.smem_per_block
            if shared > limit:
                raise BundleError(f"{what} needs {shared} bytes of shared memory; {job.plan.target.full_name} has {limit} per block "
                                  f"(lower block_m / block_n in the spec)")
            rel_dir = f"{job.entry['name']}_{job.entry['target']}/{'gluon_' if gluon else ''}{launch.kernel}-{triton_hash[:16]}"
            (staging / rel_dir).mkdir(parents=True, exist_ok=True)
            entry_files = {}
            for fname, data in sorted(files.items()):
                (staging / rel_dir / fname).write_bytes(data)
                entry_files[fname] = {"path": f"{rel_dir}/{fname}", "sha256": _sha256(data)}
            (job.entry["gluon"]["kernels"] if gluon else job.entry["kernels"]).append({
                "kernel": launch.kernel, "key": launch.key, "triton_hash": triton_hash, "shared": shared,
                "num_warps": launch.options["num_warps"], "num_stages": launch.options["num_stages"], "files": entry_files,
            })
            bar.step(what)


def _existing_bundle(out_dir: Path, building: set) -> dict | None:
    """The manifest of the bundle already in `out_dir` (None: nothing there), checked before anything is
    compiled: a directory that holds anything but a bundle's files is refused (a rebuild replaces the directory,
    so a file its manifest does not list would be lost), as is a bundle whose kept entries' files are damaged."""
    if not out_dir.exists():
        return None
    if not out_dir.is_dir():
        raise BundleError(f"{out_dir} exists and is not a directory")
    if not (out_dir / MANIFEST).exists():
        if any(out_dir.iterdir()):
            raise BundleError(f"{out_dir} exists and is not an attngen bundle (no {MANIFEST}); remove it or choose another -o")
        return None
    old = read_manifest(out_dir)
    listed = {MANIFEST} | {rel for e in old["entries"] for rel, _ in _entry_files(e)}
    foreign = sorted(p.relative_to(out_dir).as_posix() for p in out_dir.rglob("*") if not p.is_dir() and p.relative_to(out_dir).as_posix() not in listed)
    if foreign:
        raise BundleError(f"{out_dir} holds {foreign[0]!r}" + (f" and {len(foreign) - 1} more files" if len(foreign) > 1 else "") +
                          f", which its {MANIFEST} does not list: a build replaces the whole directory; move them or choose another -o")
    for e in old["entries"]:
        if (e["name"], e["target"]) not in building:  # kept: its files are copied into the new bundle
            damaged = _verify_files(out_dir, e)[1]
            if damaged is not None:
                raise BundleError(f"{out_dir}: its entry {e['name']} for {e['target']}, which this build would keep, is damaged: {damaged}; "
                                  f"rebuild that entry too or remove the bundle")
    return old


def _umask() -> int:
    """The process's umask, read without changing it where Linux tells it (os.umask would, for every thread)."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("Umask:"):
                return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _swap(staging: Path, out_dir: Path) -> None:
    """Put the finished bundle in place of `out_dir` (two renames; the old one is removed after)."""
    try:
        if not out_dir.exists():
            os.rename(staging, out_dir)
            return
        trash = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
    except OSError as err:
        raise BundleError(f"cannot put the bundle in place at {out_dir}: {err.strerror}") from None
    try:
        os.rename(out_dir, trash / "old")
    except OSError as err:
        shutil.rmtree(trash, ignore_errors=True)
        raise BundleError(f"cannot replace {out_dir}: {err.strerror} (is it the current directory of a process, or a mount point?)") from None
    os.rename(staging, out_dir)
    shutil.rmtree(trash, ignore_errors=True)


# ------------------------------------------------------------------------------------------------ loading

@dataclass
class BundleStats:
    """What a loaded bundle did: kernels launched from its binaries, and compiled just in time (misses)."""

    loaded: int = 0
    compiled: int = 0
    misses: list = field(default_factory=list)


@dataclass
class BundleInfo:
    path: Path
    name: str
    target: str
    used: bool  # False: the bundle could not be used (reason) and the kernel was compiled just in time
    reason: str | None
    stats: BundleStats


class _PrebuiltCompile:
    """Replaces a JITFunction's `compile` (what its JIT calls on a cache miss): the bundle's binary for the
    call's specialization, else (strict=False) Triton's compile."""

    def __init__(self, where: str, binaries: dict, strict: bool, fallback, stats: BundleStats):
        self.where, self.binaries, self.strict, self.fallback, self.stats = where, binaries, strict, fallback, stats

    def __call__(self, src, target=None, options=None, **kwargs):
        from triton.compiler import CompiledKernel

        key = specialization_key(src, options or {})
        found = self.binaries.get(key)
        if found is None:
            why = _describe_miss(key, list(self.binaries))
            self.stats.misses.append(f"{src.name}: {why}")
            msg = f"{self.where}: no prebuilt binary of {src.name} for this call ({why})"
            if self.strict:
                raise BundleError(msg + "; strict=True, so not compiling it")
            warnings.warn(msg + "; compiling it just in time", BundleWarning, stacklevel=2)
            self.stats.compiled += 1
            return self.fallback(src, target=target, options=options, **kwargs)
        triton_hash, files = found
        self.stats.loaded += 1
        return CompiledKernel(src, files, triton_hash)


def _install(fn, binaries: dict, where: str, strict: bool, stats: BundleStats) -> None:
    """Make `fn`'s JIT take binaries from the bundle, on the current device and on any device used later
    (Triton sets `fn.compile` when it first sees a device)."""
    from triton.runtime import driver

    make_binder = fn.device_caches.default_factory

    def binder_then_install():
        entry = make_binder()  # sets fn.compile to Triton's compile
        if not isinstance(fn.compile, _PrebuiltCompile):
            fn.compile = _PrebuiltCompile(where, binaries, strict, fn.compile, stats)
        return entry

    fn.device_caches.default_factory = binder_then_install
    fn.device_caches[driver.active.get_current_device()]  # noqa: B018  (a fresh module: creates the binder, installs)
    assert isinstance(fn.compile, _PrebuiltCompile), "the kernel had run before the bundle was installed"


def _verify_files(directory: Path, entry: dict) -> tuple[dict[str, str] | None, str | None]:
    """({relative path: text} of the entry's modules, None) if every file matches its digest, else (None, what
    is wrong)."""
    modules = {entry["module"]["path"]} | ({entry["gluon"]["module"]["path"]} if entry.get("gluon") else set())
    texts = {}
    for rel, digest in _entry_files(entry):
        try:
            data = (directory / rel).read_bytes()
        except OSError as err:
            return None, f"{rel} is missing or unreadable ({err.strerror})"
        if _sha256(data) != digest:
            return None, f"{rel} does not match its sha256 in the manifest (modified or corrupted)"
        if rel in modules:
            texts[rel] = data.decode("utf-8")
    return texts, None


def _device_arch() -> tuple[int | None, str]:
    import torch

    if not torch.cuda.is_available():
        return None, "no CUDA device is visible"
    major, minor = torch.cuda.get_device_capability()
    return major * 10 + minor, torch.cuda.get_device_name()


def _choose(manifest: dict, directory: Path, name: str | None, spec_hash: str | None, arch: int | None, target: str | None) -> dict:
    entries = manifest["entries"]
    if spec_hash is not None:
        entries = [e for e in entries if e["spec_hash"] == spec_hash]
        if not entries:
            raise LookupError(f"{directory} has no build of this spec (sha256 {spec_hash[:16]}); it holds "
                              + ", ".join(sorted({e["name"] for e in manifest["entries"]})))
    elif name is not None:
        entries = [e for e in entries if e["name"] == name]
        if not entries:
            raise BundleError(f"{directory} has no spec named {name!r}; it holds " + ", ".join(sorted({e["name"] for e in manifest["entries"]})))
    elif len({e["name"] for e in entries}) > 1:
        raise BundleError(f"{directory} holds several specs ({', '.join(sorted({e['name'] for e in entries}))}): name one, "
                          f"attngen.load(dir, name)")
    if not entries:
        raise BundleError(f"{directory} is an empty bundle")
    if target is not None:
        named = [e for e in entries if e["target"] == target.lower()]
        if not named:
            raise BundleError(f"{directory} has no build for target {target!r}; it has " + ", ".join(sorted({e["target"] for e in entries})))
        return named[0]
    # the live GPU's architecture, else the target the spec names, else the first
    return next((e for e in entries if e["arch"] == arch), None) or next(
        (e for e in entries if f"target = {e['target']}\n" in e["spec"]), entries[0])


def load(directory, name: str | None = None, *, strict: bool = False, spec=None, target: str | None = None, cache_dir=None):
    """The Kernel of bundle `directory` (built by `attngen build -o DIR`): spec `name` (needed when the
    bundle holds several), or the entry of `spec` (used by attngen.compile(..., bundle=DIR)); the build for
    `target` (a name), else the one for the live GPU's architecture. On a GPU
    matching the build, the kernels launch the bundle's binaries with no compilation; otherwise (see the
    module doc for the checks) a BundleWarning says why and the spec is compiled just in time (its module cached in
    `cache_dir`, default the kernel cache), or, with strict=True, BundleError is raised. `kernel.bundle` tells what
    happened."""
    from . import runtime
    from .canonical import spec_hash as hash_of
    from .check import load_spec
    from .codegen import versions
    from .codegen.gluon import Choice, choose
    from .codegen.gluon import build_source as build_gluon_source
    from .codegen.triton import build_source
    from .plan import plan as make_plan

    directory = Path(directory).resolve()
    manifest = read_manifest(directory)
    arch, device = _device_arch()
    wanted_hash = hash_of(spec) if spec is not None else None
    try:
        entry = _choose(manifest, directory, name, wanted_hash, arch, None if target in (None, "auto") else target)
    except LookupError as err:  # compile(spec, bundle=...): the bundle lacks this spec
        return _fallback(spec, target, directory, None, str(err), strict, cache_dir)
    spec_obj = spec if spec is not None else load_spec(entry["spec"], f"{directory / MANIFEST} ({entry['name']})")
    where = f"bundle {directory} ({entry['name']} for {entry['target']})"

    texts, reason = _verify_files(directory, entry)
    kernel_plan = source = choice = None
    gluon = entry.get("gluon")
    if spec is None and hash_of(spec_obj) != entry["spec_hash"]:
        # the bundle's own spec is what would be compiled just in time: edited, it is no spec to fall back on
        raise BundleError(f"{where}: the manifest's spec text does not match its spec_hash (edited or corrupted); rebuild the bundle")
    if reason is None:
        kernel_plan = make_plan(spec_obj, entry["target"])
        _, source = build_source(kernel_plan)
        choice = choose(spec_obj, kernel_plan)
        rebuilt = (f"this attngen {versions()['attngen']} / triton {versions()['triton']} generates a different module for the spec "
                   f"than the bundle's (built by attngen {manifest['attngen']} / triton {manifest['triton']}); rebuild the bundle")
        if source != texts[entry["module"]["path"]]:
            reason = rebuilt
        elif gluon is not None and (choice.gluon is None or (choice.generator, choice.backward) != (gluon["forward"], gluon["backward"])):
            reason = (f"the bundle renders the forward with {gluon['forward']} and the backward with {gluon['backward']}; this attngen "
                      f"chooses {choice.describe()}; rebuild the bundle")
        elif gluon is not None and build_gluon_source(choice.gluon)[1] != texts[gluon["module"]["path"]]:
            reason = rebuilt.replace("a different module", "a different Gluon module")
    if reason is None and manifest["triton"] != versions()["triton"]:
        reason = f"built for triton {manifest['triton']}, this is triton {versions()['triton']}"
    if reason is None and arch is None:
        reason = device
    if reason is None and arch != entry["arch"]:
        have = ", ".join(f"{e['target']} (sm_{e['arch']})" for e in manifest["entries"] if e["name"] == entry["name"])
        reason = f"this GPU ({device}) is sm_{arch}; the bundle has {entry['name']} for {have}"
    if reason is not None:  # compile just in time: for the live GPU if there is one, else for the bundle's target
        return _fallback(spec_obj, target or ("auto" if arch is not None else entry["target"]), directory, entry, reason, strict, cache_dir)

    stats = BundleStats()
    tag = f"{entry['name']}_{entry['target'].replace('-', '_')}"
    module_path = directory / entry["module"]["path"]
    module = _import_with_binaries(f"attngen_bundle_{tag}_{entry['module']['sha256'][:12]}", module_path, texts[entry["module"]["path"]],
                                   entry["kernels"], directory, where, strict, stats)
    kern = runtime.Kernel(spec_obj, kernel_plan, source, module_path, module)
    kern.tuner = None  # `auto` tiles are not tuned from a bundle: it holds the derived tiles' binaries, others would compile
    kern.bundle = BundleInfo(directory, entry["name"], entry["target"], True, None, stats)
    if gluon is None:
        kern.generator = Choice("triton", "loaded from an ahead-of-time bundle that holds only the Triton generator's kernels"
                                + ("" if choice.gluon is None else f" (built before bundles held Gluon kernels; this attngen would take {choice.describe()})"))
        return kern
    kern.gluon_source = texts[gluon["module"]["path"]]
    kern.gluon = _import_with_binaries(f"attngen_bundle_{tag}_gluon_{gluon['module']['sha256'][:12]}", directory / gluon["module"]["path"],
                                       kern.gluon_source, gluon["kernels"], directory, where + " (Gluon)", strict, stats)
    kern.generator = choice
    return kern


def _import_with_binaries(name: str, path: Path, text: str, kernels: list[dict], directory: Path, where: str, strict: bool,
                          stats: BundleStats) -> types.ModuleType:
    """A bundled module, imported with real Triton kernels, each launching the bundle's binaries (see the
    module doc). A kernel the build never saw launched gets no binaries: it is never compiled silently."""
    from . import loader

    with loader.lock:
        module = _import_compiled(name, path, text)
    jit = _kernels(module)
    unknown = sorted({k["kernel"] for k in kernels} - set(jit))
    if unknown:
        raise BundleError(f"{where}: the manifest lists kernel {unknown[0]!r}, which the module does not define")
    for fn_name, fn in jit.items():
        binaries = {k["key"]: (k["triton_hash"], {fname: str(directory / f["path"]) for fname, f in k["files"].items()})
                    for k in kernels if k["kernel"] == fn_name}
        _install(fn, binaries, where, strict, stats)
    return module


def _fallback(spec, target, directory: Path, entry: dict | None, reason: str, strict: bool, cache_dir=None):
    from . import runtime

    where = f"bundle {directory}" + (f" ({entry['name']} for {entry['target']})" if entry else "")
    if strict:
        raise BundleError(f"{where} cannot be used: {reason} (strict=True)")
    warnings.warn(f"{where} not used: {reason}; compiling just in time", BundleWarning, stacklevel=3)
    kern = runtime.compile(spec, target, cache_dir=cache_dir)
    kern.bundle = BundleInfo(directory, entry["name"] if entry else spec.name, entry["target"] if entry else str(target), False, reason, BundleStats())
    return kern
