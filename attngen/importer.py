"""Import-time kernels: `.attn` files import as modules, compiled and autograd-wrapped by the import.

    import attngen
    attngen.install_import_hook()
    from myproj.attention import causal_softcap       # myproj/attention/causal_softcap.attn
    o = causal_softcap.attention(q, k, v)             # the compiled kernel (attngen.Kernel)

The hook is a finder at the end of `sys.meta_path`: Python's own finders look first, so a module that exists
as Python code of the same name (`causal_softcap.py`, a package or a directory `causal_softcap/`, an extension
module) is imported as usual and the `.attn` file beside it is ignored. Only when nothing else is found does the
hook look for `<name>.attn` in the parent package's directories (every portion of a namespace package), or on
`sys.path` for a top-level module. The module it returns has

    attention, kernel   the compiled kernel (one object): attention(q, k, v, **inputs), autograd-wrapped
    spec, plan, source  its Spec, KernelPlan and generated Triton source
    __file__            the .attn file

`importlib.reload(module)` reads the file again and recompiles it. An error in the spec is raised by the import
(SpecSyntaxError, SpecError: file:line:col and the offending line); a reload that fails leaves the module's
previous kernel in place.
"""
from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

from .errors import AttngenError

SUFFIX = ".attn"


class AttnLoader(importlib.abc.Loader):
    """Compiles one .attn file into the module being imported (or reloaded)."""

    def __init__(self, finder: AttnFinder, path: str):
        self.finder = finder
        self.path = path

    def exec_module(self, module: ModuleType) -> None:
        from .api import compile

        try:
            kernel = compile(Path(self.path), self.finder.target, cache_dir=self.finder.cache_dir)
        except AttngenError as err:
            if self.path in str(err):  # SpecError, SpecSyntaxError (file:line:col), an unreadable file
                raise
            raise type(err)(f"{self.path}: {err}") from None  # PlanError and the like name no file
        module.attention = module.kernel = kernel
        module.spec, module.plan, module.source = kernel.spec, kernel.plan, kernel.source
        module.__doc__ = f"The attngen kernel of {self.path} (spec {kernel.spec.name!r}), compiled at import time."


class AttnFinder(importlib.abc.MetaPathFinder):
    """Finds `<name>.attn` for modules no other finder found. `target` and `cache_dir` are passed to
    attngen.compile for every module it loads (target None: the spec's own target, `auto` by default: the
    current GPU, or h100 for CPU tensors)."""

    def __init__(self, target: str | None = None, cache_dir: str | os.PathLike | None = None):
        self.target = target
        self.cache_dir = cache_dir

    def find_spec(self, fullname: str, path=None, target: ModuleType | None = None):
        name = fullname.rpartition(".")[2]
        for entry in sys.path if path is None else path:
            candidate = os.path.join(entry or os.curdir, name + SUFFIX)
            if os.path.isfile(candidate):
                origin = os.path.abspath(candidate)
                return importlib.util.spec_from_file_location(fullname, origin, loader=AttnLoader(self, origin))
        return None


def install_import_hook(target: str | None = None, cache_dir: str | os.PathLike | None = None) -> AttnFinder:
    """Make `.attn` files importable (see the module's docstring); returns the finder. Installing again does not
    add a second finder: it sets the options of the one installed, for the imports and reloads that follow."""
    for finder in sys.meta_path:
        if isinstance(finder, AttnFinder):
            finder.target, finder.cache_dir = target, cache_dir
            return finder
    finder = AttnFinder(target, cache_dir)
    sys.meta_path.append(finder)
    return finder


def uninstall_import_hook() -> None:
    """Remove the finder: later imports of .attn files fail as for any missing module (modules already imported
    stay in sys.modules, but cannot be reloaded)."""
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, AttnFinder)]
