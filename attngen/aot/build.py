"""`attngen build`: a bundle planned, recorded and compiled for named GPUs in worker processes, then put in place of
the output directory whole (see attngen/aot/__init__.py)."""
from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
import types
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

from ..errors import BundleError
from .manifest import FORMAT, KEEP_EXTENSIONS, MANIFEST, _entry_files, _plan_summary, _sha256, _verify_files, read_manifest
from .record import Launch, import_compiled, record_gluon_launches, record_launches

_worker_modules: dict[str, types.ModuleType] = {}


def _worker_init() -> None:
    """Compiler processes run real Triton even when the parent runs the interpreter (TRITON_INTERPRET=1 makes
    Triton's own library functions interpreted at import, which the compiler cannot use)."""
    os.environ.pop("TRITON_INTERPRET", None)


def _compile_job(module_path: str, module_name: str, launch: Launch, arch: int) -> tuple[str, dict[str, bytes], int]:
    """In a worker process: compile one recorded specialization; (Triton's hash, {file name: bytes}, shared bytes)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.experimental.gluon._runtime import GluonASTSource

    module = _worker_modules.get(module_path)
    if module is None:
        module = _worker_modules[module_path] = import_compiled(module_name, Path(module_path), Path(module_path).read_text(encoding="utf-8"))
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


@dataclass
class _Job:
    entry: dict
    plan: object
    source: str
    launches: list = field(default_factory=list)
    choice: object = None  # codegen.gluon.Choice: which generator renders each pass
    gluon_source: str | None = None  # the Gluon module, where the choice takes Gluon
    gluon_launches: list = field(default_factory=list)


def build(specs, targets: list[str], out_dir, *, jobs: int | None = None, binaries: bool = True, progress: bool = True) -> dict:
    """Build a bundle in `out_dir`: every spec (path, text or Spec) for every target name. Returns the
    manifest. Everything is planned before anything is compiled, and the directory is replaced only when the
    whole build succeeded (entries of an existing bundle in `out_dir` for other spec/target pairs are kept)."""
    from ..codegen import versions
    from ..codegen.gluon import build_source as build_gluon_source
    from ..codegen.gluon import choose
    from ..codegen.triton import build_source
    from ..errors import PlanError
    from ..lang.canonical import format_spec
    from ..lang.check import read_spec
    from ..plan.planner import plan as make_plan
    from ..version import __version__

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
                module = import_compiled(f"attngen_build_{job.entry['name']}_{job.entry['arch']}_{os.getpid()}", path, job.source)
                job.launches = record_launches(job.plan, module, job.entry["arch"])
                if job.gluon_source is not None:
                    gluon_path = staging / job.entry["gluon"]["module"]["path"]
                    gluon = import_compiled(f"attngen_build_{job.entry['name']}_{job.entry['arch']}_gluon_{os.getpid()}", gluon_path, job.gluon_source)
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
