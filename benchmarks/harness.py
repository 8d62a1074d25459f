"""Timing helpers shared by the benchmark scripts (GPU only).

Every provider is timed with triton.testing.do_bench medians after warm-up, in one process, on the same random
inputs. Backward = median(forward + backward) - median(forward).
"""
import torch
import triton
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.nn.attention.flex_attention import flex_attention

# FlexAttention recompiles per mask_mod/score_mod and per shape; past the default limit of 8 recompiles it
# silently falls back to an unfused path that materializes the scores (see ../shared/NOTES.md).
torch._dynamo.config.recompile_limit = 64
torch._dynamo.config.cache_size_limit = 64
flex = torch.compile(flex_attention, dynamic=False)


def median_ms(fn) -> float:
    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def time_fwd_bwd(fwd, q, k, v, do) -> tuple[float, float]:
    """(forward ms, backward ms) of fwd(q, k, v), q/k/v requiring grad, dO = do."""
    t_fwd = median_ms(lambda: fwd(q, k, v))

    def step():
        out = fwd(q, k, v)
        torch.autograd.grad(out, (q, k, v), do)

    t_all = median_ms(step)
    return t_fwd, max(t_all - t_fwd, 1e-9)


def measure(name: str, fn, q, k, v, do, error_of, fwd_flop: float) -> dict:
    """Check fn(q, k, v) first (error_of(out) is its max error against a reference; more than 3e-2 or any NaN
    fails), then time its forward and backward. A failure is reported in the result, not raised: one provider
    failing must not hide the others."""
    try:
        out = fn(q, k, v)
        err = error_of(out)
        assert err < 3e-2 and not torch.isnan(out).any(), f"{name}: max error {err} against the reference"
        t_fwd, t_bwd = time_fwd_bwd(fn, q, k, v, do)
        return {"fwd_ms": t_fwd, "bwd_ms": t_bwd, "max_err": err,
                "fwd_tflops": fwd_flop / t_fwd * 1e-9, "bwd_tflops": 2.5 * fwd_flop / t_bwd * 1e-9}
    except Exception as exc:
        return {"error": f"{type(exc).__name__}: {exc}"[:300]}


def sdpa(backend, q, k, v, causal: bool):
    with sdpa_kernel(backend):
        return torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal)


SDPA_FLASH = SDPBackend.FLASH_ATTENTION
SDPA_CUDNN = SDPBackend.CUDNN_ATTENTION


def matmul_tflops() -> float:
    """The bf16 8192^3 matrix product: the ceiling of this card, measured in the same run."""
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    return 2 * 8192**3 / median_ms(lambda: a @ b) * 1e-9


def versions() -> str:
    return f"{torch.cuda.get_device_name()}, torch {torch.__version__}, triton {triton.__version__}"
