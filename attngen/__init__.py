"""attngen: a compiler for attention kernels.

    kern = attngen.compile("specs/causal.attn")   # a path, or spec text
    o = kern(q, k, v)                               # autograd works
    ref = attngen.reference(kern.spec, q, k, v)     # the naive, materialized reference

    attngen.install_import_hook()                   # `import pkg.causal` compiles pkg/causal.attn (attngen.importer)
    attngen.kvcache.append(k_cache, v_cache, k_new, v_new, lens, block_table)   # serving (README, "Serving")

Importing attngen does not import Triton: set TRITON_INTERPRET=1 before the first kernel call to run on CPU.
Hugging Face transformers models: `import attngen.hf` (attngen.hf.register).
"""
from .errors import AttngenError, BundleError, InputError, PlanError, SpecError, SpecSyntaxError
from .version import __version__ as __version__


def __getattr__(name):
    # Heavy pieces (torch, triton) load on first use, so `import attngen` stays cheap and the CLI can set
    # TRITON_INTERPRET before Triton is imported.
    if name == "compile":
        from .api import compile

        return compile
    if name == "Kernel":
        from .runtime import Kernel

        return Kernel
    if name in ("dropout_mask", "dropout_probability"):
        from .runtime import dropout

        return getattr(dropout, name)
    if name in ("load", "BundleWarning"):
        from . import aot

        return getattr(aot, name)
    if name in ("block_mask_from", "block_mask_from_dense"):
        from .runtime import blocks

        return getattr(blocks, name)
    if name == "reference":
        from .tools.reference import reference

        return reference
    if name == "TargetWarning":
        from .plan.planner import TargetWarning

        return TargetWarning
    if name in ("install_import_hook", "uninstall_import_hook"):
        from . import importer

        return getattr(importer, name)
    if name in ("kvcache", "fp8", "distributed"):  # serving's caches, FP8 quantization, context parallelism
        import importlib

        return importlib.import_module(f".{name}", __name__)  # (`from . import` would ask this function again)
    if name == "load_spec":
        from .lang.check import load_spec

        return load_spec
    raise AttributeError(f"module 'attngen' has no attribute {name!r}")


__all__ = [
    "AttngenError",
    "InputError",
    "PlanError",
    "SpecError",
    "SpecSyntaxError",
    "compile",
    "Kernel",
    "reference",
    "dropout_mask",
    "dropout_probability",
    "block_mask_from",
    "block_mask_from_dense",
    "load_spec",
    "kvcache",
    "fp8",
    "distributed",
    "install_import_hook",
    "uninstall_import_hook",
    "TargetWarning",
    "load",
    "BundleError",
    "BundleWarning",
]
