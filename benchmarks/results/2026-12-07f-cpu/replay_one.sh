#!/usr/bin/env bash
# One replayed run of a validate again, with overrides; its TTFT p50 / p90, TPOT p50 / p90 and
# the prefill server's busy time (the sum of its passes) over the mean of the hardware's two
# runs (2026-12-07f). WT: the tree to run (default: this checkout); env vars pass through
# (e.g. the oracle's NARROW and MAXOV, oracle_by_decodes.patch).
#   bash benchmarks/results/2026-12-07f-cpu/replay_one.sh VALIDATE_DIR RUN TAG [--set K=V ...]
set -euo pipefail
v=$(realpath "$1"); run=$2; tag=$3; shift 3
here=$(cd "$(dirname "$0")/../../.." && pwd)
out=${TMPDIR:-/tmp}/replay_one/$tag/$run; rm -rf "$out"; mkdir -p "$(dirname "$out")"
(cd "${WT:-$here}" && PYTHONPATH="${WT:-$here}" python -m disagg.cli sim run "$v/sim-profile/$run" \
  --quiet --out "$out" "$@" >/dev/null)
python - "$v" "$run" "$out" <<'PY'
import sys

import numpy as np
import pandas as pd

where, run, out = sys.argv[1:]


def cells(d):
    r = pd.read_parquet(f"{d}/requests.parquet")
    s = pd.read_parquet(f"{d}/steps.parquet")
    busy = s[s.node.str.startswith("prefill")].duration_s.sum()
    return [*(np.percentile(r[c], q) for c in ("ttft_s", "tpot_s") for q in (50, 90)), busy]


hw = np.mean([cells(f"{where}/{side}/{run}") for side in ("hw", "hw-2")], axis=0)
print(run, "ttft p50 p90, tpot p50 p90, busy:", " ".join(f"{a / b:.3f}" for a, b in zip(cells(out), hw)))
PY
