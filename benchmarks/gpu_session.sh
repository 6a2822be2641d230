#!/usr/bin/env bash
# One device call on the lent H200 machine: install the carried wheels, build FlashInfer's
# kernels once, run the GPU tests of the two-process backend, then the TTFT benchmark.
#   bash benchmarks/gpu_session.sh [PREFILL_GPU] [DECODE_GPU]      (results under $OUT)
set -uo pipefail
P=${1:-0}; D=${2:-0}; OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0a
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
python3 tools/flashinfer_prebuild.py 2>&1 | tail -20 | tee "$OUT/prebuild.log"
[ -n "${SKIP_TESTS:-}" ] || timeout 240 python3 -m pytest -q -x tests/test_hw_disagg.py -k gpu -p no:cacheprovider 2>&1 \
  | tail -25 | tee "$OUT/gpu_tests.log"
timeout 300 python3 benchmarks/gpu_ttft.py --prefill-device "$P" --decode-device "$D" \
  --spacing-s 3 --out "$OUT/ttft" 2>&1 | tail -30 | tee "$OUT/ttft.log"
cp "$OUT"/ttft/gpu_ttft.md "$OUT"/ 2>/dev/null; true
