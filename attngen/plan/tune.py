"""Measured launch configurations: `block_m`, `block_n`, `num_warps`, `num_stages` = auto.

The plan derives every kernel's tiles from the target's on-chip memory (attngen/plan/planner.py); that is the default.
A spec that says `auto` for some of these keys is tuned instead, on the GPU, the first time a shape bucket is
called: starting from the derived configuration, a coordinate search times every configuration one step away
(a tile side halved or doubled, warps halved or doubled, one pipeline stage more or less, or a tile side and the
warps halved or doubled together; only the keys marked auto move, in every kernel of the pass), moves to the fastest if it beats the current one by MIN_GAIN, and
repeats for at most MAX_ROUNDS rounds. The forward kernel is tuned on the forward call; the two backward kernels
(dK/dV and dQ) together on the backward call, timing the whole backward.

A shape bucket is (pass, GPU name, batch * heads, query length, key length, rounded up to powers of two, the
query heads per key/value head, and whether dropout / input gradients are on). Winners are kept on disk, one
JSON file per generated module (its source's sha256: the spec, plan, templates and versions), written
atomically and merged with what other processes wrote; a file or entry that fails validation is ignored with a
TuneWarning and tuned again. Timing is triton.testing.do_bench's median on the call's own tensors; a
configuration that does not compile or does not fit (Triton's OutOfResources) is skipped.
"""
from __future__ import annotations

import copy
import hashlib
import json
import math
import sys
import threading
import time
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..cache import cache_dir, write_atomic
from .planner import KernelPlan

FORMAT = "attngen-tune/1"
PARAMS = {"block_m": "BLOCK_M", "block_n": "BLOCK_N", "num_warps": "num_warps", "num_stages": "num_stages"}
PASSES = {"fwd": ("fwd",), "bwd": ("dkdv", "dq")}
WARPS = (4, 8)  # 4: one warp group (Hopper's wgmma unit); 2 loses the warp-group instructions, 16 was never faster
STAGES = (1, 5)
MAX_ROUNDS = 6
MIN_GAIN = 0.02  # a move must be 2% faster: the H100's run-to-run spread of do_bench medians is about 1%

Config = dict[str, dict[str, int]]  # kernel -> {BLOCK_M, BLOCK_N, num_warps, num_stages}


class TuneWarning(UserWarning):
    """A tuning cache file or entry was unusable and is ignored (it is tuned again)."""


# ---- the search --------------------------------------------------------------------------------------------
def _key(config: Config) -> str:
    return json.dumps(config, sort_keys=True)


def neighbours(config: Config, free: frozenset[str], limits: tuple[int, int]) -> list[Config]:
    """Every configuration one step from `config` in one parameter of one kernel (only the spec keys in `free`),
    and, when the warps are free, one tile side and the warps halved or doubled together: the same work per warp
    on a tile of another size. (On the H100 the best d=64 dK/dV tiles were such a pair of steps from the derived
    ones, 128x64 with 8 warps to 64x64 with 4: each single step was slower, so a one-step search stopped.)"""
    lo, hi = limits
    out = []

    def step(kernel: str, changes: dict[str, int]) -> None:
        new = copy.deepcopy(config)
        new[kernel].update(changes)
        out.append(new)

    for kernel, cfg in config.items():
        for key in sorted(free):
            param = PARAMS[key]
            v = cfg[param]
            if param.startswith("BLOCK"):
                options = [n for n in (v // 2, v * 2) if lo <= n <= hi]
            elif param == "num_warps":
                options = [n for n in (v // 2, v * 2) if WARPS[0] <= n <= WARPS[-1]]
            else:
                options = [n for n in (v - 1, v + 1) if STAGES[0] <= n <= STAGES[1]]
            for n in options:
                step(kernel, {param: n})
        if "num_warps" in free:
            w = cfg["num_warps"]
            for key in sorted(free & {"block_m", "block_n"}):
                param = PARAMS[key]
                for factor in (0.5, 2):
                    side, warps = int(cfg[param] * factor), int(w * factor)
                    if lo <= side <= hi and WARPS[0] <= warps <= WARPS[-1]:
                        step(kernel, {param: side, "num_warps": warps})
    return out


@dataclass
class SearchResult:
    best: Config
    best_ms: float
    start_ms: float
    tried: list[tuple[Config, float | None]] = field(default_factory=list)  # None: failed to compile or run


def search(measure: Callable[[Config], float | None], start: Config, free: frozenset[str], limits: tuple[int, int],
           max_rounds: int = MAX_ROUNDS, min_gain: float = MIN_GAIN) -> SearchResult:
    """Coordinate search from `start`: measure(config) is milliseconds, or None for a configuration that fails.
    The starting configuration must run."""
    start_ms = measure(start)
    if start_ms is None:
        raise RuntimeError(f"the derived configuration {start} does not run")
    result = SearchResult(start, start_ms, start_ms, [(start, start_ms)])
    seen = {_key(start)}
    for _ in range(max_rounds):
        round_best, round_ms = None, math.inf
        for cand in neighbours(result.best, free, limits):
            if _key(cand) in seen:
                continue
            seen.add(_key(cand))
            ms = measure(cand)
            result.tried.append((cand, ms))
            if ms is not None and ms < round_ms:
                round_best, round_ms = cand, ms
        if round_best is None or round_ms > result.best_ms * (1 - min_gain):
            break
        result.best, result.best_ms = round_best, round_ms
    return result


# ---- the disk cache ----------------------------------------------------------------------------------------
def up(n: int) -> int:
    """n rounded up to a power of two: the shape buckets' granularity."""
    return 1 << max(0, n - 1).bit_length()


def entries_at(entries: dict[str, dict], q_len: int) -> dict[str, dict]:
    """The entries of `entries` (bucket name -> entry) whose query length is q_len's bucket."""
    return {name: e for name, e in entries.items() if f" q{up(q_len)} " in name}


def bucket(phase: str, device_name: str, batch_heads: int, q_len: int, kv_len: int, group: int, flags: tuple[str, ...] = ()) -> str:
    return " ".join([phase, device_name, f"bh{up(batch_heads)}", f"q{up(q_len)}", f"kv{up(kv_len)}", f"g{group}", *flags])


def _valid_config(config, phase: str, limits: tuple[int, int]) -> bool:
    if not isinstance(config, dict) or set(config) != set(PASSES[phase]):
        return False
    for cfg in config.values():
        if not isinstance(cfg, dict) or set(cfg) != set(PARAMS.values()):
            return False
        if not all(type(v) is int for v in cfg.values()):
            return False
        for p in ("BLOCK_M", "BLOCK_N"):
            if not limits[0] <= cfg[p] <= limits[1] or cfg[p] & (cfg[p] - 1):
                return False
        if cfg["num_warps"] not in (1, 2, 4, 8, 16) or not 1 <= cfg["num_stages"] <= 8:
            return False
    return True


class Tuner:
    """The tuned configurations of one generated module: looked up per shape bucket, tuned on a miss."""

    def __init__(self, kernel_plan: KernelPlan, source: str, directory: Path | None = None, timer: Callable | None = None,
                 verbose: bool = True):
        self.plan = kernel_plan
        self.free = kernel_plan.spec.tune
        self.module_hash = hashlib.sha256(source.encode()).hexdigest()
        self.path = (directory or cache_dir() / "tune") / f"{kernel_plan.spec.name}_{self.module_hash[:20]}.json"
        self.timer = timer  # (fn, tiles) -> milliseconds of fn(), which runs `tiles`; None: do_bench on CUDA, no tuning elsewhere
        self.verbose = verbose
        self.entries: dict[str, dict] = {}
        self._loaded = False
        self._lock = threading.Lock()

    # -- file
    def _read(self) -> dict[str, dict]:
        """The valid entries on disk (a missing file: none; an unusable one: none, with a TuneWarning)."""
        try:
            data = json.loads(self.path.read_text(encoding="utf-8"))
        except FileNotFoundError:
            return {}
        except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
            warnings.warn(f"ignoring the tuning cache {self.path}: {err}", TuneWarning, stacklevel=4)
            return {}
        if not isinstance(data, dict) or data.get("format") != FORMAT or data.get("module") != self.module_hash \
                or not isinstance(data.get("entries"), dict):
            warnings.warn(f"ignoring the tuning cache {self.path}: not a {FORMAT} file of this module", TuneWarning, stacklevel=4)
            return {}
        entries = {}
        for name, entry in data["entries"].items():
            phase = name.split(" ", 1)[0]
            if phase in PASSES and isinstance(entry, dict) and _valid_config(entry.get("tiles"), phase, self.plan.tile_limits):
                entries[name] = entry
            else:
                warnings.warn(f"ignoring entry {name!r} of the tuning cache {self.path}: not a valid configuration", TuneWarning, stacklevel=4)
        return entries

    def _write(self, name: str, entry: dict) -> None:
        merged = self._read() | {name: entry}  # keep what other processes wrote since
        doc = {"format": FORMAT, "module": self.module_hash, "spec": self.plan.spec.name, "target": self.plan.target.name,
               "free": sorted(self.free), "entries": merged}
        try:
            write_atomic(self.path, json.dumps(doc, indent=1, sort_keys=True))
        except OSError as err:
            warnings.warn(f"cannot write the tuning cache {self.path} ({err}): the result is kept for this process only", TuneWarning, stacklevel=4)

    # -- lookup and tuning
    def tiles(self, phase: str, name: str, run: Callable[[Config], object], sync: Callable[[], None] = lambda: None) -> dict:
        """The full tiles= argument for the launchers in bucket `name`: from memory, the disk, or tuned now by
        timing run(tiles) (the launcher on the call's own tensors)."""
        with self._lock:
            if not self._loaded:
                self.entries.update(self._read())
                self._loaded = True
            entry = self.entries.get(name)
            if entry is None:
                entry = self._tune(phase, name, run, sync)
                self.entries[name] = entry
                self._write(name, entry)
            return self.plan.tiles() | entry["tiles"]

    def _tune(self, phase: str, name: str, run: Callable, sync: Callable) -> dict:
        from triton.testing import do_bench

        timer = self.timer or (lambda fn, tiles: do_bench(fn, warmup=10, rep=40, return_mode="median"))
        derived = self.plan.tiles()
        failures: list[str] = []

        def measure(config: Config) -> float | None:
            tiles = derived | config
            try:
                return float(timer(lambda: run(tiles), tiles))
            except Exception as exc:  # a configuration that does not compile or fit: skipped
                sync()  # a CUDA fault (not a compile error) is sticky: it surfaces here instead of being hidden
                failures.append(f"{type(exc).__name__}: {str(exc).splitlines()[0][:120] if str(exc) else ''}")
                return None

        t0 = time.perf_counter()
        if self.verbose:
            print(f"attngen: tuning {self.plan.spec.name} ({', '.join(sorted(self.free))} = auto) for {name} ...", file=sys.stderr, flush=True)
        result = search(measure, {k: derived[k] for k in PASSES[phase]}, self.free, self.plan.tile_limits)
        seconds = time.perf_counter() - t0
        if self.verbose:
            print(f"attngen: tuned in {seconds:.1f} s, {len(result.tried)} configurations ({len(failures)} failed): derived "
                  f"{result.start_ms:.3f} ms, tuned {result.best_ms:.3f} ms ({result.start_ms / result.best_ms:.2f}x): {describe(result.best)}",
                  file=sys.stderr, flush=True)
        return {"tiles": result.best, "derived_ms": result.start_ms, "tuned_ms": result.best_ms, "tried": len(result.tried),
                "failed": len(failures), "seconds": round(seconds, 1)}


def describe(config: Config) -> str:
    """`dkdv 64x128 w8 s3, dq 64x64 w4 s2`: BLOCK_M x BLOCK_N, warps, stages of each kernel."""
    return ", ".join(f"{k} {c['BLOCK_M']}x{c['BLOCK_N']} w{c['num_warps']} s{c['num_stages']}" for k, c in config.items())
