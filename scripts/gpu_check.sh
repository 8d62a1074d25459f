#!/usr/bin/env bash
# On a GPU machine without network access (torch and triton installed, lark not): installs the wheels carried in
# .whl/ (lark, pytest-xdist, execnet), then
#   check            checks every shipped spec against the float64 reference in its own dtype (`attngen check`)
#   tests [ARGS]     runs the test suite on CUDA (`pytest --device cuda`; ARGS go to pytest)
#   bench [ARGS]     `attngen bench` (ARGS: specs and options; default dense and causal at head_dim 128 and 64)
#   decode [ARGS]    `attngen bench --decode`
#   varlen | fp8 | sparse    the suites in benchmarks/ (packed sequences, FP8, block sparsity and dropout)
# Everything it prints also goes to $OUT (default /tmp/out).
set -uo pipefail
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD PYTHONUNBUFFERED=1
OUT=${OUT:-/tmp/out}; mkdir -p "$OUT"
nvidia-smi --query-gpu=name,driver_version --format=csv,noheader | tee "$OUT/device.txt"
python3 -c "import torch, triton; print('torch', torch.__version__, 'triton', triton.__version__, 'cuda', torch.version.cuda, 'cudnn', torch.backends.cudnn.version())" | tee -a "$OUT/device.txt"
case "${1:-check}" in
  check) python3 -m attngen check specs/*.attn --device cuda 2>&1 | tee "$OUT/check.txt" ;;
  # Triton compiles on the CPU: 8 workers share the GPU. Failures are also appended to $OUT/failures.txt as they
  # happen (a run cut off at its time limit keeps them).
  tests) ATTNGEN_FAILURE_LOG=$OUT/failures.txt python3 -m pytest -q -n 8 --device cuda -p no:cacheprovider -p no:benchmark \
           "${@:2}" 2>&1 | tee "$OUT/pytest.txt" ;;
  bench) if [ $# -gt 1 ]; then args=("${@:2}"); else args=(specs/dense.attn specs/causal.attn --head-dim 128 64); fi
         python3 -m attngen bench "${args[@]}" --json "$OUT/bench.json" 2>&1 | tee "$OUT/bench.txt" ;;
  decode) python3 -m attngen bench --decode "${@:2}" --json "$OUT/decode.json" 2>&1 | tee "$OUT/decode.txt" ;;
  varlen) python3 benchmarks/varlen.py "${@:2}" 2>&1 | tee "$OUT/varlen.txt" ;;
  fp8) python3 benchmarks/fp8.py "${@:2}" 2>&1 | tee "$OUT/fp8.txt" ;;
  sparse) python3 benchmarks/sparse_dropout.py "${@:2}" 2>&1 | tee "$OUT/sparse_dropout.txt" ;;
  *) echo "usage: $0 [check | tests [pytest args] | bench [specs and options] | decode [options] | varlen | fp8 | sparse]"; exit 2 ;;
esac
