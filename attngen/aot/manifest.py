"""A bundle's manifest: its format, the digest of every file, the key of each binary (specialization_key), and the
checks every field gets before a load reads it."""
from __future__ import annotations

import hashlib
import json
import re
from pathlib import Path

from ..errors import BundleError

FORMAT = "attngen-bundle/1"
MANIFEST = "manifest.json"
KEEP_EXTENSIONS = ("cubin", "json", "ptx")  # the binary, Triton's metadata (both needed to launch), and the readable PTX
# Triton options that change the binary (the others are the backend's constants or build-machine paths)
OPTION_KEYS = ("arch", "num_warps", "num_stages", "num_ctas", "maxnreg", "enable_fp_fusion", "launch_cooperative_grid",
               "launch_pdl", "debug", "sanitize_overflow", "instrumentation_mode")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


class BundleWarning(UserWarning):
    """A bundle was not used as built: kernels are compiled just in time instead (the message says why)."""


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


def describe_miss(key: str, known: list[str]) -> str:
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
