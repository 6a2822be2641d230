#!/usr/bin/env bash
# one call: set up, then two traced disaggregated runs on one GPU (light, medium load)
set -uo pipefail
G=$(nvidia-smi --query-gpu=name --format=csv,noheader|head -1); X=()
CALL_S=590 PREBUILD=llama-3.1-8b SKIP_BENCH=1 SKIP_TTFT=1 SKIP_TESTS=1 OUT=$OUT bash benchmarks/gpu_session.sh 0 0 >/dev/null 2>&1
echo "setup done at $SECONDS s: $G"
export PYTHONPATH=/tmp/site:$PWD DISAGG_WEIGHT_CACHE=$PWD/.weights FLASHINFER_CUDA_ARCH_LIST=9.0a PYTHONUNBUFFERED=1
R=$(mktemp -d)
for spec in 9.5:128:6:5 5.59:128:8:6; do
  IFS=: read -r rate n start len <<<"$spec"
  [ $SECONDS -lt 420 ] || { echo "no time for $rate"; break; }
  DISAGG_KERNEL_TRACE=$R/trace-$rate,$start,$len timeout 180 python3 -m disagg.cli hw run tmp_trace \
    --out "$R/run-$rate" --set workload.rate_per_s=$rate --set workload.num_requests=$n \
    --set hw.weight_cache=$PWD/.weights "${X[@]}" 2>&1 | tail -14
  ls -la "$R/trace-$rate"
  echo "run $rate done at $SECONDS s"
  python3 benchmarks/kernel_timeline.py "$R/trace-$rate" --out "$OUT/kernels-$rate.csv.gz"
  echo "extracted at $SECONDS s"
done
rm -rf "$R"/trace-*
tar -cJf "$OUT/runs.tar.xz" --exclude=trace.json -C "$R" .
ls -la $OUT
