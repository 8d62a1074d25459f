"""`auto` launch configurations (attngen/plan/tune.py): the search, the spec keys, the disk cache, and tuned kernels
checked against the float64 reference. On the CPU the interpreter's times mean nothing, so the tests give the
tuner a timer that prefers chosen configurations (still running each one); with --device cuda the real timer runs."""
import json
import math
import warnings

import pytest
import torch

import attngen
from attngen.tools import verify
from attngen.lang.canonical import format_spec
from attngen.lang.check import load_spec
from attngen.errors import SpecError
from attngen.plan.planner import plan
from attngen.plan.tune import PASSES, TuneWarning, neighbours, search

AUTO = "block_m = auto block_n = auto num_warps = auto num_stages = auto"
START = {"fwd": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 2}}


def bowl(best):
    """A cost with its minimum at `best` (log2 distance per parameter), as do_bench times would look."""
    def cost(config):
        c = config["fwd"]
        return 1.0 + sum(abs(math.log2(c[p] / best[p])) if p != "num_stages" else abs(c[p] - best[p]) for p in c)
    return cost


def test_search_walks_to_the_fastest_configuration():
    best = {"BLOCK_M": 128, "BLOCK_N": 16, "num_warps": 8, "num_stages": 4}
    r = search(bowl(best), START, frozenset({"block_m", "block_n", "num_warps", "num_stages"}), (16, 128), max_rounds=10)
    assert r.best == {"fwd": best}
    assert r.start_ms == bowl(best)(START) and r.best_ms == 1.0
    assert len({json.dumps(c, sort_keys=True) for c, _ in r.tried}) == len(r.tried)  # nothing timed twice


def test_search_moves_only_the_auto_keys_and_stays_in_limits():
    best = {"BLOCK_M": 128, "BLOCK_N": 16, "num_warps": 8, "num_stages": 4}
    r = search(bowl(best), START, frozenset({"block_n"}), (32, 64), max_rounds=10)
    assert r.best == {"fwd": dict(START["fwd"], BLOCK_N=32)}  # 16 is below the limit; the other keys are fixed
    for config, _ in r.tried:
        c = config["fwd"]
        assert (c["BLOCK_M"], c["num_warps"], c["num_stages"]) == (64, 4, 2) and 32 <= c["BLOCK_N"] <= 64


def test_search_skips_failures_and_keeps_the_start_without_a_real_gain():
    def measure(config):
        c = config["fwd"]
        if c["num_stages"] > 2:
            return None  # e.g. OutOfResources
        return 1.0 if c == START["fwd"] else 0.995  # 0.5% better: under MIN_GAIN, noise
    r = search(measure, START, frozenset({"num_stages", "num_warps"}), (16, 128))
    assert r.best == START and any(ms is None for _, ms in r.tried)
    with pytest.raises(RuntimeError, match="derived configuration"):
        search(lambda c: None, START, frozenset({"block_m"}), (16, 128))


def test_neighbours_are_one_step_or_a_tile_side_with_the_warps():
    start = {"dkdv": {"BLOCK_M": 32, "BLOCK_N": 128, "num_warps": 4, "num_stages": 1},
             "dq": {"BLOCK_M": 16, "BLOCK_N": 64, "num_warps": 8, "num_stages": 5}}
    got = neighbours(start, frozenset({"block_m", "block_n", "num_warps", "num_stages"}), (16, 128))
    changes = sorted(tuple(sorted((k, p, c[k][p]) for k in c for p in c[k] if c[k][p] != start[k][p])) for c in got)
    single = [("dkdv", "BLOCK_M", 16), ("dkdv", "BLOCK_M", 64), ("dkdv", "BLOCK_N", 64), ("dkdv", "num_warps", 8),
              ("dkdv", "num_stages", 2), ("dq", "BLOCK_M", 32), ("dq", "BLOCK_N", 32), ("dq", "BLOCK_N", 128),
              ("dq", "num_warps", 4), ("dq", "num_stages", 4)]
    # warps stay in 4..8 and sides in 16..128: dkdv (4 warps) can only double both (BLOCK_N 128 cannot), dq (8 warps)
    # only halve both (BLOCK_M 16 cannot)
    paired = [(("dkdv", "BLOCK_M", 64), ("dkdv", "num_warps", 8)), (("dq", "BLOCK_N", 32), ("dq", "num_warps", 4))]
    assert changes == sorted([(c,) for c in single] + [tuple(sorted(p)) for p in paired])
    assert len(got) == len(changes)
    only_tiles = neighbours(start, frozenset({"block_m", "block_n"}), (16, 128))
    assert all(c[k]["num_warps"] == start[k]["num_warps"] for c in only_tiles for k in c)  # warps not free: no pairs


def test_search_takes_a_tile_and_warps_step_together():
    """The optimum two single steps away, each single step slower (as d=64 dK/dV on the H100): reached."""
    start = {"fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}}
    times = {(128, 8): 1.0, (64, 8): 1.2, (128, 4): 1.3, (64, 4): 0.9}

    def measure(config):
        c = config["fwd"]
        return times.get((c["BLOCK_M"], c["num_warps"]), 2.0) + (0 if (c["BLOCK_N"], c["num_stages"]) == (64, 3) else 1.0)
    r = search(measure, start, frozenset({"block_m", "block_n", "num_warps", "num_stages"}), (16, 128))
    assert r.best == {"fwd": {"BLOCK_M": 64, "BLOCK_N": 64, "num_warps": 4, "num_stages": 3}} and r.best_ms == 0.9


def test_spec_keys():
    spec = load_spec("attention t { head_dim = 64 num_warps = 8 num_stages = 2 block_n = auto }")
    assert spec.tune == frozenset({"block_n"}) and spec.num_warps == 8
    assert "block_n = auto" in format_spec(spec) and "num_warps = 8" in format_spec(spec)
    assert load_spec(format_spec(spec)) == spec
    p = plan(spec, "h100")
    assert (p.num_warps, p.num_stages) == (8, 2)  # fixed values are the forward's
    assert "tuned on the GPU (auto): block_n" in p.describe()
    assert load_spec("attention t { head_dim = 64 }").tune == frozenset()
    with pytest.raises(SpecError, match="num_warps = 3 must be a power of two"):
        load_spec("attention t { head_dim = 64 num_warps = 3 }")
    with pytest.raises(SpecError, match="num_stages = 9 is out of range; expected 1..8"):
        load_spec("attention t { head_dim = 64 num_stages = 9 }")
    with pytest.raises(SpecError, match=r"num_stages must be an integer in 1..8 or auto"):
        load_spec("attention t { head_dim = 64 num_stages = fast }")


def test_input_pre_pass_accepts_every_tile_the_tuner_may_try():
    p = plan(load_spec(f"attention t {{ head_dim = 32 input doc: int32[B, N] mask = doc[b, q_idx] == doc[b, kv_idx] {AUTO} }}"), "h100")
    assert p.tile_limits == (16, 128)
    src = attngen.compile(p.spec, "h100").source
    assert "TILE_CHUNK = tl.constexpr(16)" in src and "TILE_SPAN = tl.constexpr(8)" in src
    sparse = plan(load_spec(f"attention t {{ head_dim = 32 sparsity = runtime sparse_block = 32 {AUTO} }}"), "h100")
    assert sparse.tile_limits == (16, 32)  # a tile never straddles two sparse blocks


# Preferred by the fake timer on the CPU: far from the derived tiles in every kernel.
PREFER = {"fwd": {"BLOCK_M": 16, "BLOCK_N": 32}, "dkdv": {"BLOCK_M": 16, "BLOCK_N": 32}, "dq": {"BLOCK_M": 16, "BLOCK_N": 32}}


def _timer(record):
    def timer(fn, tiles):
        fn()  # the configuration really runs (a broken one raises and is skipped)
        record.append(tiles)
        return 1.0 + sum(abs(math.log2(tiles[k][p] / v)) for k, want in PREFER.items() for p, v in want.items())
    return timer


SPECS = {
    "causal_dropout": f"attention t {{ head_dim = 32 dtype = fp32 dropout = 0.2 mask = q_idx >= kv_idx {AUTO} }}",
    "document_bias_grad": f"attention t {{ head_dim = 32 dtype = fp32 input doc: int32[B, N] input kb: fp32[B, N] "
                          f"mask = doc[b, q_idx] == doc[b, kv_idx] score = score + kb[b, kv_idx] {AUTO} }}",
    "runtime_blocks_kv_outer": f"attention t {{ head_dim = 32 dtype = fp32 loop_order = kv_outer sparsity = runtime sparse_block = 32 {AUTO} }}",
}


@pytest.mark.slow  # 10-40 s each on 2 cores: the tuner runs every candidate tiling in the interpreter
@pytest.mark.parametrize("name", sorted(SPECS))
def test_tuned_kernels_match_the_reference(name, device, tmp_path):
    spec = load_spec(SPECS[name])
    if device == "cuda":
        spec = load_spec(SPECS[name].replace("fp32", "bf16"))
    kern = attngen.compile(spec, "h100" if device == "cpu" else None)
    kern.tuner.path = tmp_path / "tune.json"
    tried = []
    if device == "cpu":
        kern.tuner.timer = _timer(tried)
    shape = (1, 2, 1, 24, 37) if device == "cpu" else (2, 4, 2, 1000, 1000)  # (grouped heads, partial tiles: every candidate runs)
    r = verify.check_one(kern, shape, device)
    assert r.ok, verify.format_table(name, [r])
    entries = kern.tuner.entries
    assert sorted(n.split()[0] for n in entries) == ["bwd", "fwd"]
    for n, e in entries.items():
        assert set(e["tiles"]) == set(PASSES[n.split()[0]]) and e["tuned_ms"] <= e["derived_ms"]
        if device == "cpu":  # the search reached the timer's preference wherever the limits allow
            lo, hi = kern.plan.tile_limits
            for k, cfg in e["tiles"].items():
                for p, v in PREFER[k].items():
                    assert cfg[p] == min(hi, max(lo, v)), (n, k, cfg)
    if device == "cpu":
        assert len(tried) > 10
    on_disk = json.loads(kern.tuner.path.read_text())
    assert on_disk["entries"] == json.loads(json.dumps(entries))


@pytest.mark.slow  # about 10 s: tunes, then runs the tuned kernels in the interpreter
def test_tuning_cache_is_reused_and_checked(tmp_path):
    text = f"attention t {{ head_dim = 16 dtype = fp32 mask = q_idx >= kv_idx {AUTO} }}"
    first = attngen.compile(text, "h100")
    first.tuner.path = tmp_path / "t.json"
    first.tuner.timer = _timer([])
    q, k, v = (torch.randn(1, 1, 40, 16, requires_grad=True) for _ in range(3))
    first(q, k, v).sum().backward()
    assert sorted(n.split()[0] for n in first.tuner.entries) == ["bwd", "fwd"]
    assert [p.name for p in tmp_path.iterdir()] == ["t.json"]  # written atomically: no temporary file left

    def fresh(timer):
        kern = attngen.compile(text, "h100")
        kern.tuner = type(first.tuner)(kern.plan, kern.source, timer=timer)
        kern.tuner.path = tmp_path / "t.json"
        return kern

    def never(fn, tiles):
        raise AssertionError("tuned again although the cache holds this bucket")

    again = fresh(never)
    out = again(q, k, v)
    assert again.tuner.entries == first.tuner.entries
    want = attngen.reference(again, *(t.detach().double() for t in (q, k, v)))
    assert not out.isnan().any() and (out.double() - want).abs().max() < 1e-5

    # a corrupt file, a file of another module, and an entry with an impossible tile: ignored, tuned again
    data = json.loads((tmp_path / "t.json").read_text())
    bad_entry = json.loads(json.dumps(data))
    name = next(n for n in bad_entry["entries"] if n.startswith("fwd"))
    bad_entry["entries"][name]["tiles"]["fwd"]["BLOCK_M"] = 48
    other = dict(data, module="0" * 64)
    for content, message in (("{ not json", "ignoring the tuning cache"), (json.dumps(other), "not a attngen-tune/1 file of this module"),
                             (json.dumps(bad_entry), f"ignoring entry {name!r}")):
        (tmp_path / "t.json").write_text(content)
        tried = []
        kern = fresh(_timer(tried))
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            kern(q, k, v)
        assert any(issubclass(w.category, TuneWarning) and message in str(w.message) for w in caught), [str(w.message) for w in caught]
        assert tried, "not tuned again"
        assert kern.tuner.entries[name]["tiles"]["fwd"]["BLOCK_M"] == 16

