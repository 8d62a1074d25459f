"""Test set-up: which device the numerics run on, Triton's interpreter for CPU, a private kernel cache.

    pytest                      # CPU: kernels run in Triton's interpreter (TRITON_INTERPRET=1), fp32 and fp16
    pytest --device cuda        # the same tests on a GPU, bf16 included
"""
import os
import tempfile

import pytest


def pytest_addoption(parser):
    parser.addoption("--device", choices=("cpu", "cuda"), default="cpu", help="where the kernels run (cpu: Triton's interpreter)")


def pytest_configure(config):
    if config.getoption("--device") == "cpu":
        os.environ["TRITON_INTERPRET"] = "1"  # must be set before triton is imported
    # Each test session (and each xdist worker) writes generated modules to its own fresh cache.
    os.environ["ATTNGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="attngen-test-cache-")


def pytest_collection_modifyitems(config, items):
    """Tests marked `interpreter` check the CPU path itself (Triton's interpreter, CPU tensors): under --device cuda
    triton is imported without TRITON_INTERPRET, so they are skipped there, saying why."""
    if config.getoption("--device") == "cuda":
        skip = pytest.mark.skip(reason="a test of the CPU path (Triton's interpreter), which --device cuda leaves off")
        for item in items:
            if "interpreter" in item.keywords:
                item.add_marker(skip)


def pytest_runtest_logreport(report):
    """With ATTNGEN_FAILURE_LOG set, append each failure's report as it happens (for runs that may be cut off)."""
    path = os.environ.get("ATTNGEN_FAILURE_LOG")
    if path and report.failed:
        with open(path, "a", encoding="utf-8") as f:
            f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext}\n\n")


@pytest.fixture(scope="session")
def device(request) -> str:
    dev = request.config.getoption("--device")
    if dev == "cuda":
        import torch

        assert torch.cuda.is_available(), "--device cuda but no CUDA device is visible"
    return dev


@pytest.fixture(scope="session")
def dtypes(device) -> tuple[str, ...]:
    """Element types the shape matrices check. bf16 on the CPU runs the spec's float32 kernels (Triton's interpreter
    has no bf16 arithmetic; runtime.Kernel._twin), which fp32 covers; test_numerics.py checks that path in bf16
    against the float64 reference (test_bf16_specs_are_exact_on_every_device). On the GPU all three."""
    return ("fp32", "fp16", "bf16") if device == "cuda" else ("fp32", "fp16")


@pytest.fixture(scope="session")
def target(device) -> str:
    return "auto" if device == "cuda" else "h100"
