#!/usr/bin/env bash
# One device call on a lent H200 machine: install the carried wheels, build FlashInfer's kernels
# once, run the kernel/wire benchmark, the TTFT benchmark, then the GPU tests.
#   bash benchmarks/gpu_session.sh [PREFILL_GPU] [DECODE_GPU]      (results under $OUT)
# The working tree with .whl is past the device tool's 64 MiB: `bash benchmarks/device_tree.sh
# slim` before a session's calls leaves the records' tarballs and figures out of it, and
# `bash benchmarks/device_tree.sh full` after them puts them back.
# BENCH_ARGS='--only copy transfer' passes arguments to gpu_bench.py;
# SKIP_BENCH=1, SKIP_TTFT=1, SKIP_TESTS=1 leave a part out; TPOT=1 adds gpu_tpot.py (two GPUs:
# decode TPOT under a prefill stream, about 5 min); HOP=1 adds control_hop.py (one control hop,
# ZeroMQ and a plain socket, pinned or not: about 2 min, no kernels needed, so
# `PREBUILD=none SKIP_BENCH=1 SKIP_TTFT=1 SKIP_TESTS=1 HOP=1` runs it on a fresh machine alone);
# PREBUILD=none skips the kernel build (a warm
# machine keeps it in /tmp/site); DISAGG_REPEATS=N requests per prompt length in gpu_ttft.py;
# TESTS='EXPR' picks the GPU tests (pytest -k; default: every GPU test); SPACING=S seconds
# between gpu_ttft.py's requests (default 3); TTFT_PROMPTS=2048,8192 picks its prompt lengths;
# TTFT_ENVS='A=1;B=0 C=1' runs gpu_ttft.py once more per ';'-separated set of environment
# settings (e.g. TTFT_ENVS='DISAGG_SPIN=1'), each into its own table gpu_ttft_N.md.
# MOE=1 adds the MoE runs (PREBUILD=llama-3.1-8b,qwen3-30b-a3b builds their kernels):
# moe_bench.py, a profile of the cut Qwen3-30B-A3B, qwen3moe-h200-1p3d against its colocated
# twin on the one GPU, and both replayed in the simulator (roofline and profile), about 5 min
# (MOE_BENCH=0 leaves moe_bench.py out).
# CPUSPREAD=1 adds benchmarks/process_spread.py before the benchmarks and validate (about 1 min,
# no GPU): how fast the host's cores 0-1 run one pure host workload in six fresh processes, two
# 2 s windows each, which moved by a quarter to a half on a lent H100's host (2026-12-05k).
# SPREAD=1 adds benchmarks/host_spread.py (SPREAD_ARGS: its flags; SPREAD_TIMEOUT: seconds,
# default 300; SPREAD_EXP: its experiment, default experiments/llama8b-h200.toml): a server's
# host time per pass, run to run, by its cores and the driver's, and after a profile. VALIDATE_TIMEOUT caps validate's seconds; it never gets more than the call has left.
# VALIDATE=1 adds `disagg validate experiments/llama8b-h200.toml` (VALIDATE_ARGS adds flags;
# VALIDATE_EXP=experiments/qwen3moe-h200-colocated.toml validates that one instead, with
# PREBUILD=qwen3-30b-a3b: the MoE model through validate). VALIDATE_OUT=runs/validate-NAME puts
# its directory in the checkout, which a warm machine keeps between calls: a validate longer
# than one call goes on in the next with VALIDATE_ARGS="... --resume" (the same other flags).
# VALIDATE_ARGS="... --schedulers prefill_first,decode_priority" adds the colocated schedulers
# (about 300 s more for Llama at 128 requests a run). Every *_ARGS is read as a shell reads a
# command line, quotes and all: VALIDATE_ARGS="--set 'hw.latency.prefill_graphs=[256,512]'".
# Two GPUs, two calls: `bash benchmarks/gpu_session.sh 0 1`, then at once (machine still warm)
# `PREBUILD=none SKIP_BENCH=1 SKIP_TTFT=1 SKIP_TESTS=1 TPOT=1 bash benchmarks/gpu_session.sh 0 1`.
# SHARE=1 adds benchmarks/shared_gpu.py --run (SHARE_ARGS: its flags, e.g. '--rate 5.4
# --requests 64 --variants eager-layerwise,pieces-whole'): the disaggregated twin of
# experiments/llama8b-h200.toml on one GPU, its prefill eager or in pieces, its KV sent layer
# by layer or whole, and how its two servers slowed each other (all four: about 4 min, a guess
# not yet timed on a GPU).
# PIECES=1 adds benchmarks/prefill_pieces.py (about 1 min): a pass with a prompt chunk launched
# op by op against in hw.latency.prefill_graphs' pieces, launch / device / wall by its tokens.
# PYSPY=1 adds a py-spy sample of a colocated Llama run at the validate's top load (carry
# py-spy's wheel in .whl; PYSPY_ARGS replaces the run's flags): pyspy_host.md says where each
# pass's host time goes, by function and line (benchmarks/pyspy_host.py); and host_pass.csv,
# a decode pass's prepare by batch, FlashInfer's plan with the device idle, behind a running
# kernel, and staged as hw.latency.overlap plans (benchmarks/host_pass.py).
# Servers keep the weights they draw in .weights/ (DISAGG_WEIGHT_CACHE; git ignores it, a warm
# machine keeps it between calls), so each later server of the model and seed reads them.
# gpu.txt also holds the host's cores (lscpu -e), and each one's interrupts and time (/proc/stat:
# irq, softirq, steal) at the start and the end.
# The device tool returns at most 8 files from $OUT: the runs' own tables go into one tarball
# (without their trace.json, which `disagg trace RUN_DIR` writes again).
set -uo pipefail
P=${1:-0}; D=${2:-0}; OUT=${OUT:-runs/gpu}; mkdir -p "$OUT"
RUNS=$(mktemp -d); LOG="$OUT/session.log"
export PYTHONUNBUFFERED=1 FLASHINFER_CUDA_ARCH_LIST=9.0a
# a warm machine keeps /tmp/site, with the kernels prebuilt into FlashInfer's package: keep it
[ -d /tmp/site/flashinfer ] || python3 -m pip install -q --no-index --no-deps --no-compile \
  --no-cache-dir --upgrade --target /tmp/site .whl/*.whl || exit 1
export PYTHONPATH=/tmp/site:$PWD DISAGG_WEIGHT_CACHE=${DISAGG_WEIGHT_CACHE:-$PWD/.weights}
# a *_ARGS variable's words as a shell reads a command line: quotes group a word and go, and
# nothing is run or globbed (--set 'hw.latency.prefill_graphs=[256,512]' is one flag's value)
words() { python3 -c 'import shlex, sys; sys.stdout.write("".join(w + "\n" for w in shlex.split(sys.argv[1])))' "$1"; }
for V in BENCH_ARGS SPREAD_ARGS VALIDATE_ARGS PYSPY_ARGS SHARE_ARGS; do  # a quote left open stops the session
  words "${!V:-}" >/dev/null 2>&1 || { echo "$V: a quote is not closed: ${!V}" | tee -a "$LOG"; exit 2; }
done
mapfile -t BENCH_FLAGS < <(words "${BENCH_ARGS:-}")
mapfile -t SPREAD_FLAGS < <(words "${SPREAD_ARGS:-}")
mapfile -t VALIDATE_FLAGS < <(words "${VALIDATE_ARGS:-}")
mapfile -t SHARE_FLAGS < <(words "${SHARE_ARGS:-}")
mapfile -t PYSPY_FLAGS < <(words "${PYSPY_ARGS:---set workload.rate_per_s=9.52 --set workload.num_requests=128 --set hw.latency.cores_per_server=2}")
nvidia-smi --query-gpu=index,name,memory.total,driver_version --format=csv | tee "$OUT/gpu.txt"
nvidia-smi topo -m >>"$OUT/gpu.txt" 2>&1
# the host's cores (which share a physical core), the interrupts each has taken and its time,
# at the start and again at the end: whether the servers' pinned cores are the ones the host's
# interrupts, or its hypervisor (steal), take time from
irqs() { awk -v when="$1" 'NR == 1 { n = NF; next }
  { for (i = 2; i <= n + 1; i++) if ($i ~ /^[0-9]+$/) s[i - 2] += $i }
  END { printf "interrupts per CPU, %s:", when; for (i = 0; i < n; i++) printf " %d:%d", i, s[i]; print "" }' \
  /proc/interrupts >>"$OUT/gpu.txt" 2>&1
  grep '^cpu' /proc/stat >>"$OUT/gpu.txt"; }  # jiffies: user nice system idle iowait irq softirq steal
lscpu -e >>"$OUT/gpu.txt" 2>&1; irqs "at the start"
[ "${PREBUILD:-}" = none ] || python3 tools/flashinfer_prebuild.py \
  --models "${PREBUILD:-llama-3.1-8b,deepseek-v3}" 2>&1 | tail -20 | tee -a "$LOG"
# the host's cores, no GPU: how fast one host workload runs, process by process (about 1 min)
[ -z "${CPUSPREAD:-}" ] || timeout 120 python3 benchmarks/process_spread.py --procs 6 --windows 2 \
  --window-s 2 --out "$OUT/process_spread.md" 2>&1 | tail -4 | tee -a "$LOG"
[ -n "${SKIP_BENCH:-}" ] || timeout 300 python3 benchmarks/gpu_bench.py "${BENCH_FLAGS[@]}" --prefill-device "$P" \
  --decode-device "$D" --out "$RUNS/bench" 2>&1 | cut -c1-600 | tail -20 | tee -a "$LOG"
cp "$RUNS"/bench/bench.md "$RUNS"/bench/bench.json "$OUT"/ 2>/dev/null
TTFT_ARGS=(--prefill-device "$P" --decode-device "$D" --spacing-s "${SPACING:-3}")
[ -z "${TTFT_PROMPTS:-}" ] || TTFT_ARGS+=(--prompts "$TTFT_PROMPTS")
[ -n "${SKIP_TTFT:-}" ] || timeout 300 python3 benchmarks/gpu_ttft.py "${TTFT_ARGS[@]}" \
  --out "$RUNS/ttft" 2>&1 | tail -60 | tee -a "$LOG"
cp "$RUNS"/ttft/gpu_ttft.md "$OUT"/ 2>/dev/null
N=0; IFS=';' read -ra SETS <<<"${TTFT_ENVS:-}"
for SET in "${SETS[@]}"; do
  N=$((N + 1)); echo "gpu_ttft.py with $SET" | tee -a "$LOG"
  env $SET timeout 300 python3 benchmarks/gpu_ttft.py "${TTFT_ARGS[@]}" --out "$RUNS/ttft_$N" \
    2>&1 | tail -60 | tee -a "$LOG"
  cp "$RUNS/ttft_$N/gpu_ttft.md" "$OUT/gpu_ttft_$N.md" 2>/dev/null
done
[ -z "${HOP:-}" ] || timeout 300 python3 benchmarks/control_hop.py --prompts 16,2048 --count 60 \
  --latency off --pin off,on --out "$RUNS/hop" 2>&1 | tail -20 | tee -a "$LOG"
cp "$RUNS"/hop/control_hop.md "$OUT"/ 2>/dev/null
[ -z "${SHARE:-}" ] || timeout "${SHARE_TIMEOUT:-400}" python3 benchmarks/shared_gpu.py \
  --run experiments/llama8b-h200.toml --device "cuda:$D" "${SHARE_FLAGS[@]}" --out "$RUNS/share" \
  2>&1 | grep -v -e '^|' -e CudaIPCTypes | tail -12 | tee -a "$LOG"  # each variant's TTFT line
[ -z "${SHARE:-}" ] || { cp "$RUNS"/share/shared_gpu.md "$OUT"/ 2>/dev/null
  tar -cJf "$OUT/share.tar.xz" --exclude=trace.json -C "$RUNS" share; }
[ -z "${PIECES:-}" ] || timeout 300 python3 benchmarks/prefill_pieces.py --device "$D" \
  --out "$RUNS/pieces" 2>&1 | tail -16 | tee -a "$LOG"
cp "$RUNS"/pieces/prefill_pieces.md "$OUT"/ 2>/dev/null
[ -z "${TPOT:-}" ] || timeout 400 python3 benchmarks/gpu_tpot.py --prefill-device "$P" \
  --decode-device "$D" --out "$RUNS/tpot" 2>&1 | tail -20 | tee -a "$LOG"
cp "$RUNS"/tpot/gpu_tpot.md "$RUNS"/tpot/gpu_tpot*.png "$OUT"/ 2>/dev/null
if [ -n "${MOE:-}" ]; then
  M=experiments/qwen3moe-h200; SIM=(--set hardware.nic=NVLink-H200)
  [ "${MOE_BENCH:-1}" = 0 ] || timeout 240 python3 benchmarks/moe_bench.py --device "cuda:$D" --out "$OUT" 2>&1 | tail -14 | tee -a "$LOG"
  timeout 150 python3 -m disagg.cli hw profile --model qwen3-30b-a3b --layers 12 \
    --device "cuda:$D" --out "$RUNS/moe/profile.csv" 2>&1 | tail -3 | tee -a "$LOG"
  for MODE in 1p3d colocated; do
    timeout 200 python3 -m disagg.cli hw run "$M-$MODE.toml" --wire cuda --prefill-device "cuda:$P" \
      --decode-device "cuda:$D" --out "$RUNS/moe/hw-$MODE" 2>&1 | tail -30 | tee -a "$LOG"
    timeout 60 python3 -m disagg.cli sim run "$RUNS/moe/hw-$MODE" "${SIM[@]}" \
      --out "$RUNS/moe/sim-$MODE" 2>&1 | tail -3 | tee -a "$LOG"
    timeout 60 python3 -m disagg.cli sim run "$RUNS/moe/hw-$MODE" "${SIM[@]}" \
      --set "cost.source=profile:$RUNS/moe/profile.csv" --out "$RUNS/moe/simprof-$MODE" 2>&1 \
      | tail -3 | tee -a "$LOG"
  done
  tar -cJf "$OUT/moe.tar.xz" --exclude=trace.json -C "$RUNS" moe
fi
[ -z "${SPREAD:-}" ] || timeout "${SPREAD_TIMEOUT:-300}" python3 benchmarks/host_spread.py \
  "${SPREAD_EXP:-experiments/llama8b-h200.toml}" --device "cuda:$D" "${SPREAD_FLAGS[@]}" --out "$RUNS/spread" 2>&1 \
  | tail -20 | tee -a "$LOG"
cp "$RUNS"/spread/host_spread.md "$RUNS"/spread/host_spread.csv "$OUT"/ 2>/dev/null
if [ -n "${PYSPY:-}" ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/pyspy .whl/py_spy-*.whl
  mkdir -p "$RUNS/pyspy"
  timeout 300 /tmp/pyspy/bin/py-spy record --subprocesses --idle --nonblocking --format raw -r 250 \
    -o "$RUNS/pyspy/raw.txt" -- python3 -m disagg.cli hw run experiments/llama8b-h200.toml \
    --decode-device "cuda:$D" --out "$RUNS/pyspy/run" "${PYSPY_FLAGS[@]}" 2>&1 | tail -12 | tee -a "$LOG"
  pkill -f "disagg.cli hw run" && echo "py-spy left its run behind: stopped" | tee -a "$LOG"
  python3 benchmarks/pyspy_host.py "$RUNS/pyspy/raw.txt" --rate 250 --run "$RUNS/pyspy/run" \
    --top 40 --out "$OUT/pyspy_host.md" 2>&1 | head -30 | tee -a "$LOG"
  timeout 120 python3 benchmarks/host_pass.py --device "cuda:$D" --out "$OUT" 2>&1 | tail -8 \
    | tee -a "$LOG"
fi
if [ -n "${VALIDATE:-}" ]; then
  # what is left of the call (CALL_S, default 590 s) less 15 s for the tarball, at most
  # VALIDATE_TIMEOUT: a validate cut short still comes back, and goes on with --resume
  VT=$(( ${CALL_S:-590} - SECONDS - 15 )); VT=$(( ${VALIDATE_TIMEOUT:-$VT} < VT ? ${VALIDATE_TIMEOUT:-$VT} : VT ))
  VALIDATE_OUT=${VALIDATE_OUT:-$RUNS/validate}
  echo "validate: ${VT} s of the call left" | tee -a "$LOG"
  timeout "$(( VT > 1 ? VT : 1 ))" python3 -m disagg.cli validate "${VALIDATE_EXP:-experiments/llama8b-h200.toml}" \
    --device "cuda:$D" --out "$VALIDATE_OUT" "${VALIDATE_FLAGS[@]}" 2>&1 | grep -v CudaIPCTypes | tee -a "$LOG"
  tar -cJf "$OUT/validate.tar.xz" --exclude='*.parquet.tmp' --exclude=trace.json -C "$(dirname "$VALIDATE_OUT")" "$(basename "$VALIDATE_OUT")"
fi
[ -n "${SKIP_TESTS:-}" ] || timeout 300 python3 -m pytest -q -x -p no:cacheprovider \
  tests/test_hw_attention.py tests/test_hw_runner.py tests/test_hw_disagg.py tests/test_hw_model.py \
  tests/test_hw_transport_cuda.py tests/test_hw_moe.py tests/test_kvcache.py tests/test_hw_profile.py \
  tests/test_hw_tp_cuda.py tests/test_hw_overlap.py tests/test_hw_pieces.py -k "${TESTS:-gpu or flashinfer or cuda}" 2>&1 | tee "$OUT/pytest.log" | tail -25 | tee -a "$LOG"
tar -cJf "$OUT/runs.tar.xz" --exclude='*.parquet.tmp' --exclude=trace.json -C "$RUNS" . 2>/dev/null
irqs "at the end"
true
