#!/usr/bin/env bash
# A validate replayed with its middle-load disaggregated run (the first hardware run) added to
# its calibration, so that the shared GPU's shares and extra are fitted on it too (in sample).
#   bash benchmarks/results/2026-12-07e-cpu/insample.sh VALIDATE_DIR OUT_DIR
# VALIDATE_DIR: a validate directory (a runs.tar.xz unpacked); OUT_DIR: where the copy goes.
set -euo pipefail
src=$1; out=$2
rm -rf "$out"; mkdir -p "$(dirname "$out")"; cp -r "$src" "$out"
mid=$(ls -d "$out"/hw/disagg-*rps | awk -F'disagg-' '{print $NF, $0}' | sort -g | sed -n 2p | cut -d' ' -f2)
echo "the calibration gets $(basename "$mid")"
cp -r "$mid" "$out/calibration/$(basename "$mid")"
disagg validate --replay --out "$out" \
  --tolerance ttft_p50=5,ttft_p90=5,tpot_p50=3,tpot_p90=3,output_throughput=3
