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
        from interpreter_patches import skip_repeated_patches

        skip_repeated_patches()  # the interpreter without work its results do not depend on (interpreter_patches.py)
    # Each test session (and each xdist worker) writes generated modules to its own fresh cache.
    os.environ["ATTNGEN_CACHE_DIR"] = tempfile.mkdtemp(prefix="attngen-test-cache-")


# The longest tests on the CPU (2-5 minutes each on CI's 2 cores): run first, so that `pytest -n auto` does not leave
# one of them running alone at the end while the other workers are idle (xdist hands tests out in collection order)
LONGEST_FIRST = (
    "tests/test_distributed.py::test_context_parallel_matches_one_process_and_the_reference",
    "tests/test_tune.py::test_tuned_kernels_match_the_reference",
    "tests/test_numerics.py::test_variant[dropout_",
    "tests/test_tune.py::test_tuning_cache_is_reused_and_checked",
)


def pytest_collection_modifyitems(config, items):
    """The longest tests first (LONGEST_FIRST; the rest keep their order). Tests marked `interpreter` check the CPU
    path itself (Triton's interpreter, CPU tensors): under --device cuda triton is imported without
    TRITON_INTERPRET, so they are skipped there, saying why."""
    rank = {prefix: i for i, prefix in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: next((i for prefix, i in rank.items() if item.nodeid.startswith(prefix)), len(LONGEST_FIRST)))
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
