"""Timing helpers for the benchmark scripts (GPU only): attngen.bench's, which `attngen bench` uses too.

Every provider is timed with triton.testing.do_bench medians after warm-up, in one process, on the same random
inputs. Backward = median(forward + backward) - median(forward).
"""
from torch.nn.attention import SDPBackend

from attngen.bench import matmul_tflops, measure, median_ms, sdpa, time_fwd_bwd, versions
from attngen.bench import flex as _compiled_flex

flex = _compiled_flex()
SDPA_FLASH = SDPBackend.FLASH_ATTENTION
SDPA_CUDNN = SDPBackend.CUDNN_ATTENTION

__all__ = ["flex", "matmul_tflops", "measure", "median_ms", "sdpa", "time_fwd_bwd", "versions", "SDPA_FLASH", "SDPA_CUDNN"]
