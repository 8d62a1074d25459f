"""attngen bench's peers: the FlexAttention twin derived from a spec computes the same attention as the
reference (eager FlexAttention runs on CPU), SDPA is used only where it expresses the spec, and the FLOP count's
kept fraction is exact. The timing itself needs a GPU (BENCHMARKS.md)."""
import warnings
from pathlib import Path

import pytest
import torch

import attngen
from attngen import bench, verify
from attngen.check import load_spec
from attngen.cli import main

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
    assert "vs derived" in table and "2.00/1.00" in table and "tuned fwd: fwd 128x64 w8 s3 (2.00x" in table
