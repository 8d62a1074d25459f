"""attngen bench's peers: the FlexAttention twin derived from a spec computes the same attention as the
reference (eager FlexAttention runs on CPU), SDPA is used only where it expresses the spec, and the FLOP count's
kept fraction is exact. The timing itself needs a GPU (BENCHMARKS.md)."""
import json
import warnings
from pathlib import Path

import pytest
import torch

import attngen
from attngen.tools import bench
from attngen.tools import verify
from attngen.lang.check import load_spec
from attngen.tools.cli import main

ROOT = Path(__file__).parent.parent


@pytest.mark.parametrize("name", ["document", "alibi", "causal_softcap", "butterfly_blocks", "relative_bias", "prefix_lm"])
def test_flex_twin_matches_the_reference(name):
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    spec = load_spec((ROOT / "specs" / f"{name}.attn").read_text(), name)
    gen = torch.Generator().manual_seed(0)
    B, H, N = 2, 4, 192
    q, k, v = (torch.randn(B, H, N, spec.head_dim, generator=gen) for _ in range(3))
    inputs = verify.make_inputs(spec, B, H, N, N, "cpu", gen)
    mask_mod, score_mod = bench.flex_mods(spec, inputs, N, N)
    block_mask = create_block_mask(mask_mod, B, H, N, N, device="cpu", BLOCK_SIZE=64) if mask_mod else None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # eager FlexAttention warns that it is not compiled
        out = flex_attention(q, k, v, score_mod=score_mod, block_mask=block_mask)
    ref = attngen.reference(spec, q.double(), k.double(), v.double(), **inputs)
    assert not torch.isnan(out).any()
    assert (out.double() - ref).abs().max().item() < 1e-4


@pytest.mark.parametrize("text, expected", [
    ("head_dim = 32", {"attngen", "flex", "sdpa_flash", "sdpa_cudnn"}),
    ("head_dim = 32 score = 30.0 * tanh(score / 30.0)", {"attngen", "flex"}),  # a score modification: no SDPA
    ("head_dim = 32 dropout = 0.1", {"attngen"}),  # FlexAttention has no dropout; SDPA's pattern differs
    ("head_dim = 32 sparsity = runtime sparse_block = 64", {"attngen"}),
])
def test_providers_of_a_spec(text, expected):
    """The providers attngen bench (and benchmarks/profile_kernels.py) time for a spec, built without running any
    (no mask here: a BlockMask is built on the GPU)."""

    class Kernel:  # only .spec is read before a provider is called
        spec = load_spec(f"attention t {{ {text} }}")

    fns, failed = bench.providers(Kernel(), 128, {}, {}, 1, 2)
    assert set(fns) == expected and failed == {}


def test_sdpa_only_where_it_computes_the_spec():
    variant = {name: bench.sdpa_variant(load_spec((ROOT / "specs" / f"{name}.attn").read_text(), name))
               for name in ("dense", "causal", "sliding_window", "causal_softcap", "document", "causal_dropout")}
    assert variant == {"dense": False, "causal": True, "sliding_window": None, "causal_softcap": None, "document": None,
                       "causal_dropout": None}


def test_kept_fraction_is_exact():
    causal = load_spec("attention t { head_dim = 32 mask = q_idx >= kv_idx }")
    assert bench.kept_fraction(causal, {}, 2, 4, 300, 300, "cpu") == pytest.approx(301 / 600, abs=1e-12)
    docs = load_spec("attention t { head_dim = 32 input doc: int32[B, N] mask = doc[b, q_idx] == doc[b, kv_idx] }")
    doc = torch.tensor([[0] * 100 + [1] * 200, [0] * 300])
    assert bench.kept_fraction(docs, {"doc": doc}, 2, 4, 300, 300, "cpu") == pytest.approx((100**2 + 200**2 + 300**2) / (2 * 300**2))
    sparse = load_spec("attention t { head_dim = 32 mask = q_idx >= kv_idx sparsity = runtime sparse_block = 64 }")
    blocks = torch.zeros(1, 1, 4, 4, dtype=torch.bool)
    blocks[0, 0, 3, 0] = True  # queries 192..255, keys 0..63: every pair is causal
    blocks[0, 0, 1, 1] = True  # a diagonal block: 64 * 65 / 2 pairs
    assert bench.kept_fraction(sparse, {}, 1, 1, 256, 256, "cpu", blocks) == pytest.approx((64 * 64 + 64 * 65 / 2) / 256**2)


def test_bench_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the command would run the benchmark")
    assert main(["bench", str(ROOT / "specs" / "causal.attn"), "--seq", "128"]) == 1
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_tune_needs_a_gpu_and_bench_tune_times_the_derived_tiles_beside(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU: the command would tune")
    assert main(["tune", str(ROOT / "specs" / "causal.attn"), "--seq", "128"]) == 1
    assert "attngen tune: needs a CUDA GPU" in capsys.readouterr().err
    spec = bench.tuned(load_spec((ROOT / "specs" / "causal.attn").read_text(), "causal"))
    assert spec.tune == {"block_m", "block_n", "num_warps", "num_stages"} and spec.block_m is None
    row = {"spec": "causal", "d": 128, "N": 4096, "dtype": "bf16",
           "attngen": {"fwd_tflops": 400.0, "bwd_tflops": 300.0}, "derived": {"fwd_tflops": 200.0, "bwd_tflops": 300.0},
           "tuned": {"fwd x": {"tiles": {"fwd": {"BLOCK_M": 128, "BLOCK_N": 64, "num_warps": 8, "num_stages": 3}},
                               "derived_ms": 2.0, "tuned_ms": 1.0, "tried": 9}}}
    table = bench.format_table([row])
    assert "attngen/derived" in table and "2.00/1.00" in table and "tuned fwd: fwd 128x64 w8 s3 (2.00x" in table


def test_bench_table_shows_both_generators_side_by_side():
    """With the spec through each generator timed beside its own choice, the table has a column per generator and
    the speed of attngen and of Gluon over FlexAttention, cuDNN and the Triton generator."""
    def timed(fwd, bwd):
        return {"fwd_tflops": fwd, "bwd_tflops": bwd}

    row = {"spec": "causal", "d": 128, "N": 4096, "dtype": "bf16", "generator": "gluon", "backward": "triton",
           "attngen": timed(600.0, 400.0), "gluon": timed(600.0, 500.0), "triton": timed(400.0, 400.0),
           "flex": timed(300.0, 250.0), "sdpa_cudnn": timed(600.0, 500.0)}
    table = bench.format_table([row])
    head = table.splitlines()[2].split()
    assert head == ["config", "attngen", "gluon", "triton", "flex", "sdpa_cudnn", "attngen/flex", "attngen/cudnn", "attngen/triton",
                    "gluon/flex", "gluon/cudnn", "gluon/triton"]
    assert "forward/backward generator: gluon/triton" in table
    assert table.splitlines()[3].split()[-6:] == ["2.00/1.60", "1.00/0.80", "1.50/1.00", "2.00/2.00", "1.00/1.00", "1.50/1.25"]


def _bench_results():
    """A bench --json document as attngen bench writes it: one provider failed its check, one does not apply."""
    def timed(fwd, bwd):
        return {"fwd_ms": 1.0, "bwd_ms": 2.0, "max_err": 1e-3, "fwd_tflops": fwd, "bwd_tflops": bwd}

    rows = [{"spec": "causal", "N": n, "B": 16384 // n, "H": 16, "d": 128, "dtype": "bf16", "kept": 0.5,
             "attngen": timed(400.0 + n / 100, 330.0), "flex": timed(380.0, 350.0),
             "sdpa_flash": {"error": "AssertionError: max error 0.5 against the reference"}}
            for n in (1024, 4096)]
    return {"versions": "H100 (synthetic)", "matmul_tflops": 690.0, "rows": rows}


def test_plot_draws_a_png_atomically(tmp_path):
    plt = pytest.importorskip("matplotlib.pyplot")  # an extra of the test install: skipped only outside it
    out = tmp_path / "bench.png"
    bench.plot(_bench_results(), out)
    data = out.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 10_000
    assert [p.name for p in tmp_path.iterdir()] == ["bench.png"]  # no temporary file left behind
    assert not plt.get_fignums()  # the figure was closed
    bench.plot(_bench_results(), tmp_path / "chart")  # no suffix: PNG
    assert (tmp_path / "chart").read_bytes()[:4] == b"\x89PNG"
    with pytest.raises(RuntimeError, match="no benchmark rows"):
        bench.plot({"rows": []}, tmp_path / "empty.png")
    assert not (tmp_path / "empty.png").exists()


def test_plot_command_reads_bench_json(tmp_path, capsys):
    pytest.importorskip("matplotlib")
    results = tmp_path / "bench.json"
    results.write_text(json.dumps(_bench_results()))
    assert main(["plot", str(results), "-o", str(tmp_path / "out.svg")]) == 0
    assert (tmp_path / "out.svg").read_text().lstrip().startswith("<?xml")
    (tmp_path / "other.json").write_text(json.dumps({"versions": "x"}))
    assert main(["plot", str(tmp_path / "other.json"), "-o", str(tmp_path / "x.png")]) == 1
    assert "not an `attngen bench --json` file" in capsys.readouterr().err
    assert main(["plot", str(tmp_path / "missing.json")]) == 1
    assert "cannot read" in capsys.readouterr().err
    (tmp_path / "numbers.json").write_text(json.dumps({"rows": [1, 2]}))  # rows that are not records
    assert main(["plot", str(tmp_path / "numbers.json"), "-o", str(tmp_path / "x.png")]) == 1
    assert "malformed row" in capsys.readouterr().err
    assert not (tmp_path / "x.png").exists()


def test_bench_plot_fails_before_timing_without_matplotlib(monkeypatch, capsys):
    """--plot checks for matplotlib first: no minutes of timing before the error."""
    import builtins

    real_import = builtins.__import__

    def no_matplotlib(name, *args, **kwargs):
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    monkeypatch.setattr(bench, "_gpu_specs", lambda *a: pytest.fail("timing started before the matplotlib check"))
    assert main(["bench", "specs/causal.attn", "--plot", "x.png"]) == 1
    assert "pip install 'attngen[plot]'" in capsys.readouterr().err


def _decode_results():
    """An `attngen bench --decode` document as it is written: attngen in a graph of 4 layers (and alone), one
    paged layout failed, FlexAttention beside."""
    def timed(ms, one_ms):
        return {"ms": ms, "gbs": 1e9 / ms * 1e-6, "copy_pct": 100 * (1e9 / ms * 1e-6) / 3000.0,
                "one": {"ms": one_ms, "gbs": 1e9 / one_ms * 1e-6, "copy_pct": 100 * (1e9 / one_ms * 1e-6) / 3000.0}, "eager_ms": 0.1}

    rows = [{"spec": "decode_causal", "B": 1, "N": n, "Nq": 1, "layers": 4, "copy_gbs": 3000.0,
             "attngen": timed(0.5, 0.6), "paged16": {"error": "AssertionError: max error 0.5"}, "flex": timed(0.75, 0.8)}
            for n in (8192, 32768)]
    return {"versions": "H100 (synthetic)", "copy_gbs": 3000.0, "rows": rows}


def test_decode_table_gives_layered_and_single_call_rates_and_the_ratio_to_flex(tmp_path):
    from attngen.tools import bench_decode

    table = bench_decode.format_table(_decode_results()["rows"])
    line = table.splitlines()[2].split()
    # 1 GB in 0.5 ms = 2000 GB/s = 66.7 % of 3000; alone 0.6 ms = 55.6 %; FlexAttention 0.75 / 0.5 = 1.50x
    assert line[:5] == ["decode_causal", "1", "8192", "1", "4"] and line[5:9] == ["500.0", "2000", "66.7%", "|"] and line[9:11] == ["600.0", "55.6%"]
    assert line[-1] == "1.50x" and "error" in line
    assert "paged16: AssertionError: max error 0.5" in table
    pytest.importorskip("matplotlib.pyplot")
    out = tmp_path / "decode.png"
    bench_decode.plot(_decode_results(), out)
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
