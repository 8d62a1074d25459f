"""Timing helpers for the benchmark scripts (GPU only): attngen.tools.bench's, which `attngen bench` uses too.

Every provider is timed with triton.testing.do_bench medians after warm-up, in one process, on the same random
inputs. Backward = median(forward + backward) - median(forward).
"""
import dataclasses
import json
from pathlib import Path

from torch.nn.attention import SDPBackend

from attngen.tools.bench import matmul_tflops, measure, median_ms, sdpa, time_fwd_bwd, versions
from attngen.tools.bench import flex as _compiled_flex
from attngen.lang.check import load_spec
from attngen.lang.spec import DType

ROOT = Path(__file__).resolve().parent.parent

flex = _compiled_flex()
SDPA_FLASH = SDPBackend.FLASH_ATTENTION
SDPA_CUDNN = SDPBackend.CUDNN_ATTENTION



def shipped_spec(name: str, head_dim: int):
    """specs/NAME.attn in bf16 at `head_dim`: the configurations the sweeps and probes time."""
    return dataclasses.replace(load_spec((ROOT / "specs" / f"{name}.attn").read_text()), head_dim=head_dim, dtype=DType.BF16)


def save_results(path, **fields) -> None:
    """A run's JSON file: the versions line, then `fields` (rows, tables)."""
    Path(path).write_text(json.dumps({"versions": versions(), **fields}, indent=1))


__all__ = ["flex", "matmul_tflops", "measure", "median_ms", "sdpa", "time_fwd_bwd", "versions", "SDPA_FLASH", "SDPA_CUDNN",
           "shipped_spec", "save_results"]
