#!/usr/bin/env bash
# A calibration run's replay under the turns rule again, with overrides (turn_slice_s,
# switch_s); its TTFT p50 / p90, TPOT p50 / p90, the prefill server's busy time, its median
# full chunk and the median decode pass over the calibration run's own (2026-12-07f).
#   bash benchmarks/results/2026-12-07f-cpu/turns_replay.sh VALIDATE_DIR/calibration RUN TAG \
#     --set cluster.turn_slice_s=0.004 --set cluster.switch_s=0.0001
set -euo pipefail
c=$(realpath "$1"); run=$2; tag=$3; shift 3
here=$(cd "$(dirname "$0")/../../.." && pwd)
out=${TMPDIR:-/tmp}/turns_replay/$tag/$run; rm -rf "$out"; mkdir -p "$(dirname "$out")"
(cd "$here" && python -m disagg.cli sim run "$c/turns/$run" --quiet --out "$out" "$@" >/dev/null)
python - "$c/$run" "$out" <<'PY'
import sys

import numpy as np
import pandas as pd


def cells(d):
    r = pd.read_parquet(f"{d}/requests.parquet")
    s = pd.read_parquet(f"{d}/steps.parquet")
    prefill = s[s.node.str.startswith("prefill")]
    decode = s[s.node.str.startswith("decode")]
    return [
        *(np.percentile(r[c], q) for c in ("ttft_s", "tpot_s") for q in (50, 90)),
        prefill.duration_s.sum(),
        prefill[prefill.prefill_tokens == 2048].duration_s.median(),
        decode.duration_s.median(),
    ]


names = "ttft p50, p90, tpot p50, p90, busy, full chunk, decode pass"
print(sys.argv[1].split("/")[-1], f"{names}:", " ".join(f"{a / b:.3f}" for a, b in zip(cells(sys.argv[2]), cells(sys.argv[1]))))
PY
