"""What a validate's profile says of one request's prefill (its chunks alone) and its share of
decode passes at the full batch, the colocated capacity validate sets the loads by
(`disagg.validate_plan.capacity_per_s`), and a disaggregated capacity on one GPU split half
and half between the two servers (the default weights, `cluster.decode_share`):

    python half_split_capacity.py VALIDATE_DIR...   # unpacked runs.tar.xz
"""

import sys
from pathlib import Path

from disagg.config import load_experiment
from disagg.validate_plan import request_seconds

if len(sys.argv) < 2:
    sys.exit(__doc__)
for d in map(Path, sys.argv[1:]):
    colocated = load_experiment(sorted((d / "hw").glob("colocated-*"))[0])
    prefill_s, decode_s = request_seconds(colocated, d / "profile.csv")
    cap, split = 1 / (prefill_s + decode_s), 0.5 / max(prefill_s, decode_s)
    print(
        f"{d}: a request's prefill {prefill_s * 1e3:.1f} ms, its decode {decode_s * 1e3:.1f}"
        f" ms; colocated capacity {cap:.3g} req/s (its top load {0.85 * cap:.3g}); the GPU"
        f" split half and half {split:.3g} (85%: {0.85 * split:.3g})"
    )
