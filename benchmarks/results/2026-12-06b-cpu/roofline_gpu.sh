#!/usr/bin/env bash
# The roofline column of the five newest validates in pieces, replayed three ways (CPU, about a
# minute each): as their runs recorded the GPU (an H200 every time), with the GPU each ran on,
# and that with 0.4 ms a pass and no gap a layer. Writes /tmp/roof/{recorded,gpu,fixed}/NAME/.
#   bash benchmarks/results/2026-12-06b-cpu/roofline_gpu.sh && python roofline_cells.py
set -euo pipefail
R=benchmarks/results
for pair in 2026-12-05e-gpu/h100-pieces:H100-SXM 2026-12-05k-gpu/h100-c3:H100-SXM \
  2026-12-05m-gpu/h100:H100-SXM 2026-12-05h-gpu/h200-pieces:H200-SXM 2026-12-05j-gpu/h200-h3:H200-SXM; do
  src=${pair%%:*}; gpu=${pair##*:}; name=${src//\//_}
  for way in recorded gpu fixed; do
    d=/tmp/roof/$way/$name; rm -rf "$d"; mkdir -p "$d"; tar xJf "$R/$src/runs.tar.xz" -C "$d"
    v=$(dirname "$(find "$d" -maxdepth 2 -name profile.csv | head -1)")
    set -- --replay --out "$v"
    [ "$way" = recorded ] || set -- "$@" --sim-set "hardware.gpu=$gpu"
    [ "$way" = fixed ] && set -- "$@" --sim-set cost.step_overhead_s=0.0004 --sim-set cost.layer_overhead_s=0
    disagg validate "$@" --tolerance ttft_p50=5,ttft_p90=5,tpot_p50=3,tpot_p90=3,output_throughput=3 > "$d.log" 2>&1 \
      || grep -q "cells met" "$d.log"  # a missed tolerance exits 1; a failure has no verdict
  done
done
