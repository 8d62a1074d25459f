"""The disk cache: keyed by everything that changes the source, written atomically, checked on load."""
import os
import threading
from pathlib import Path

import pytest

import attngen
from attngen import cache
from attngen.lang.check import load_spec
from attngen.plan.planner import plan
from attngen.codegen.triton import build_source
from attngen.codegen.triton.render import TEMPLATES

ROOT = Path(__file__).parent.parent


def test_cache_dir_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("ATTNGEN_CACHE_DIR", str(tmp_path / "c"))
    assert cache.cache_dir() == tmp_path / "c"
    monkeypatch.delenv("ATTNGEN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert cache.cache_dir() == tmp_path / "x" / "attngen"


def test_key_changes_with_spec_target_and_plan():
    a = plan(load_spec("attention t { head_dim = 64 }"), "h100")
    b = plan(load_spec("attention t { head_dim = 64 mask = q_idx >= kv_idx }"), "h100")
    c = plan(load_spec("attention t { head_dim = 64 }"), "a100")
    d = plan(load_spec("attention t { head_dim = 64 block_m = 16 }"), "h100")
    keys = {build_source(p)[0] for p in (a, b, c, d)}
    assert len(keys) == 4
    assert build_source(a)[0] == build_source(plan(load_spec("attention t {\n head_dim = 64 # same\n}"), "h100"))[0]


def test_key_covers_the_templates(monkeypatch):
    p = plan(load_spec("attention t { head_dim = 64 }"), "h100")
    key = build_source(p)[0]
    monkeypatch.setattr(TEMPLATES, "digest", lambda: "edited")
    assert build_source(p)[0] != key


def test_store_writes_once_and_rewrites_corruption(tmp_path):
    path = cache.store("t", "ab" * 32, "print('x')\n", tmp_path)
    assert path.read_text() == "print('x')\n"
    mtime = path.stat().st_mtime_ns
    assert cache.store("t", "ab" * 32, "print('x')\n", tmp_path) == path and path.stat().st_mtime_ns == mtime
    path.write_text("print('tampered')\n")
    cache.store("t", "ab" * 32, "print('x')\n", tmp_path)
    assert path.read_text() == "print('x')\n"
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary files left behind


def test_failed_write_leaves_nothing(tmp_path, monkeypatch):
    target = tmp_path / "m.py"

    def boom(*a, **k):
        raise OSError("disk full")

    monkeypatch.setattr(os, "replace", boom)
    with pytest.raises(OSError):
        cache.write_atomic(target, "x" * 1000)
    assert list(tmp_path.iterdir()) == []


def test_concurrent_writers_never_expose_a_partial_file(tmp_path):
    target = tmp_path / "m.py"
    texts = ["a" * 200_000, "b" * 200_000]
    seen = []

    def write(t):
        for _ in range(20):
            cache.write_atomic(target, t)

    def read():
        for _ in range(200):
            if target.exists():
                seen.append(target.read_text())

    threads = [threading.Thread(target=write, args=(t,)) for t in texts] + [threading.Thread(target=read)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(s in texts for s in seen)


def test_cache_dir_is_where_the_module_goes_even_when_imported_before(tmp_path):
    """compile(..., cache_dir=B) after compile(..., cache_dir=A) of the same spec in one process: the module is
    imported once, but written into B too, and kern.path is B's file; a bundle's just-in-time fallback uses
    cache_dir as well (it dropped it)."""
    import warnings

    import attngen.aot as bundle

    a, b, c = tmp_path / "a", tmp_path / "b", tmp_path / "c"
    first = attngen.compile(ROOT / "specs" / "causal.attn", "h100", cache_dir=a)
    second = attngen.compile(ROOT / "specs" / "causal.attn", "h100", cache_dir=b)
    assert first.module is second.module
    assert first.path.parent == a and second.path.parent == b and second.path.read_text() == first.path.read_text()
    bundle.build([ROOT / "specs" / "dense.attn"], ["h100"], tmp_path / "bt", binaries=False, progress=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", attngen.BundleWarning)  # no GPU here: the bundle is not used
        kern = attngen.compile(ROOT / "specs" / "dense.attn", bundle=tmp_path / "bt", cache_dir=c)
    assert kern.bundle.used is False and kern.path.parent == c and kern.path.is_file()
