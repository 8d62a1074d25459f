"""Ahead-of-time bundles: generated modules plus their GPU binaries, built on a machine without a GPU.

record.py finds the specializations a spec needs, build.py compiles them and writes the bundle, manifest.py
describes and checks it, loader.py loads it.

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
from ..errors import BundleError
from .build import build
from .loader import BundleInfo, BundleStats, load
from .manifest import BundleWarning, read_manifest

__all__ = ["BundleError", "BundleInfo", "BundleStats", "BundleWarning", "build", "load", "read_manifest"]
