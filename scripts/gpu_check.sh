#!/usr/bin/env bash
# Run on the lent H100 (device tool): installs the carried wheels (lark, pytest-xdist, execnet), then checks every spec against the
# float64 reference in its own dtype (check; the tests cover all three dtypes), runs the test suite on CUDA (tests), or times the
# kernels against SDPA and FlexAttention (bench), or tile classification on/off against FlexAttention (masks). Output goes to $OUT.
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda)" | tee -a "$OUT/device.txt"
case "${1:-check}" in
  check) python3 -m attngen check specs/*.attn --device cuda 2>&1 | tee "$OUT/check.txt" ;;
  # test_wheel builds a wheel, which needs PyPI (hatchling): the GPU machine has no network.
  # Triton compiles on the CPU: 8 workers share the GPU (pytest-xdist and execnet are carried as wheels).
  # Failures are also appended to $OUT/failures.txt as they happen (a run cut off at its limit keeps them).
  tests) ATTNGEN_FAILURE_LOG=$OUT/failures.txt python3 -m pytest -q -n 8 --device cuda -p no:cacheprovider -p no:benchmark \
           "${@:2}" 2>&1 | tee "$OUT/pytest.txt" ;;
  bench) python3 benchmarks/quick.py --json "$OUT/quick.json" 2>&1 | tee "$OUT/quick.txt" ;;
  masks) python3 benchmarks/masks.py "${@:2}" --json "$OUT/masks.json" 2>&1 | tee "$OUT/masks.txt" ;;
  cli-bench) python3 -m attngen bench "${@:2}" --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" ;;
  sparse) python3 benchmarks/sparse_dropout.py --json "$OUT/sparse_dropout.json" 2>&1 | tee "$OUT/sparse_dropout.txt" ;;
  tune) python3 -m attngen tune "${@:2}" --json "$OUT/tune.json" 2>&1 | tee "$OUT/tune.txt" ;;
  gluon) python3 benchmarks/gluon.py "${@:2}" --json "$OUT/gluon.json" 2>&1 | tee "$OUT/gluon.txt" ;;
  sweep) python3 benchmarks/sweep.py "${@:2}" --json "$OUT/sweep.json" > "$OUT/sweep.txt" 2>&1; grep SUMMARY "$OUT/sweep.txt" ;;
  *) echo "usage: $0 [check|tests [pytest args]|bench|masks [--seq N...]|sparse|cli-bench SPEC... [--seq N...]|tune SPEC... [--seq N...]|sweep [--specs ...]|gluon [--quick]]"; exit 2 ;;
esac
