"""The on-disk cache of generated modules (Triton's JIT needs real source files to read).

Key = sha256 of (canonical spec, plan, template bytes, attngen/triton/torch versions). Files are written
atomically (a temporary file in the same directory, then os.replace), so a crash or a concurrent writer
never leaves a half-written module. On load the file's bytes are compared with the freshly rendered source;
a mismatch (a corrupted or edited entry) is rewritten, never imported.
"""
from __future__ import annotations

import hashlib
import os
import tempfile
from pathlib import Path

from .errors import AttngenError


def cache_dir() -> Path:
    """ATTNGEN_CACHE_DIR, else $XDG_CACHE_HOME/attngen, else ~/.cache/attngen."""
    env = os.environ.get("ATTNGEN_CACHE_DIR")
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "attngen"


def cache_key(*parts: str) -> str:
    h = hashlib.sha256()
    for part in parts:
        h.update(part.encode())
        h.update(b"\0")
    return h.hexdigest()


def write_atomic(path: Path, data: str | bytes) -> None:
    """Write `data` (text as UTF-8, or bytes) to `path` so that readers see either the old file or the whole new one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode("utf-8") if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def module_path(name: str, key: str, directory: Path | None = None) -> Path:
    """Where the cached module for `key` lives in `directory` (default: cache_dir())."""
    return (directory or cache_dir()) / f"{name}_{key[:20]}.py"


def store(name: str, key: str, source: str, directory: Path | None = None) -> Path:
    """The path of the cached module for `key`, (re)written if missing or not byte-identical to `source`."""
    directory = directory or cache_dir()
    path = module_path(name, key, directory)
    try:
        if path.is_file() and path.read_text(encoding="utf-8") == source:
            return path
    except (OSError, UnicodeDecodeError):
        pass  # unreadable or corrupt: rewrite below
    try:
        write_atomic(path, source)
    except OSError as err:
        raise AttngenError(f"cannot write the kernel cache at {directory} ({err}); set ATTNGEN_CACHE_DIR to a writable directory") from err
    return path
