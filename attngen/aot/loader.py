"""attngen.load: a bundle checked, then its modules imported with each kernel launching the bundle's binaries;
or, where it cannot be used, the spec compiled just in time with a BundleWarning (see attngen/aot/__init__.py)."""
from __future__ import annotations

import types
import warnings
from dataclasses import dataclass, field
from pathlib import Path

from ..errors import BundleError
from .manifest import MANIFEST, BundleWarning, _verify_files, describe_miss, read_manifest, specialization_key
from .record import import_compiled, jit_kernels


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
            why = describe_miss(key, list(self.binaries))
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
    matching the build, the kernels launch the bundle's binaries with no compilation; otherwise (the checks are
    attngen/aot/__init__.py's) a BundleWarning says why and the spec is compiled just in time (its module cached in
    `cache_dir`, default the kernel cache), or, with strict=True, BundleError is raised. `kernel.bundle` tells what
    happened."""
    from ..codegen import versions
    from ..codegen.gluon import Choice, choose
    from ..codegen.gluon import build_source as build_gluon_source
    from ..codegen.triton import build_source
    from ..lang.canonical import spec_hash as hash_of
    from ..lang.check import load_spec
    from ..plan.planner import plan as make_plan
    from ..runtime import Kernel

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
    kern = Kernel(spec_obj, kernel_plan, source, module_path, module)
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
    """A bundled module, imported with real Triton kernels, each launching the bundle's binaries (see
    attngen/aot/__init__.py). A kernel the build never saw launched gets no binaries: it is never compiled silently."""
    from ..runtime import loader

    with loader.lock:
        module = import_compiled(name, path, text)
    jit = jit_kernels(module)
    unknown = sorted({k["kernel"] for k in kernels} - set(jit))
    if unknown:
        raise BundleError(f"{where}: the manifest lists kernel {unknown[0]!r}, which the module does not define")
    for fn_name, fn in jit.items():
        binaries = {k["key"]: (k["triton_hash"], {fname: str(directory / f["path"]) for fname, f in k["files"].items()})
                    for k in kernels if k["kernel"] == fn_name}
        _install(fn, binaries, where, strict, stats)
    return module


def _fallback(spec, target, directory: Path, entry: dict | None, reason: str, strict: bool, cache_dir=None):
    from ..runtime import compile as compile_spec

    where = f"bundle {directory}" + (f" ({entry['name']} for {entry['target']})" if entry else "")
    if strict:
        raise BundleError(f"{where} cannot be used: {reason} (strict=True)")
    warnings.warn(f"{where} not used: {reason}; compiling just in time", BundleWarning, stacklevel=3)
    kern = compile_spec(spec, target, cache_dir=cache_dir)
    kern.bundle = BundleInfo(directory, entry["name"] if entry else spec.name, entry["target"] if entry else str(target), False, reason, BundleStats())
    return kern
