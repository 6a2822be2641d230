"""How a colocated server's passes with a prompt chunk grow with their decodes' context, past
what the profile cost model says.

    python benchmarks/mixed_context.py VALIDATE_DIR [--profile CSV] [--host]

For every pass with a prompt chunk in a validate directory's colocated runs (`hw/colocated-*`
and the calibration runs), the pass's shape comes from the steps table (rebuilt from the
requests table where the table predates the shape columns: `with_context`). Against the
cost model on the profile (the validate's own, or `--profile`) with the calibration's chunk
offsets, a least-squares line gives the device time the passes took beyond it, per 10,000
tokens of context past the profile's mixed rows (the shortest prompt a decode), on the
calibration runs and on the validation runs apart. Prints one line per group and the
medians by context.

`--host` fits each of those runs' decode passes' host time (wall less device) instead, by
least squares against their batch and their context: what a pass costs the server's Python
per sequence and per 10,000 tokens (its pages), which validate's loop calibration (batch
only) does not tell apart.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import numpy as np
import pandas as pd

from disagg.core.scheduler import chunk_attn_pairs
from disagg.sim.costmodel import ProfileCost, StepShape


def with_context(run: Path) -> pd.DataFrame:
    """The run's steps table, by start, with `context` (the tokens its decodes hold in all)
    and `pairs` (its chunks' attention pairs): the table's own shape columns where it has
    them; a table from before them has its decodes' context rebuilt from the requests table
    (each request decoding at the pass's start holds its prompt, its first token and one more
    for every pass with decodes since its first token) and its chunks read at no context."""
    steps = pd.read_parquet(run / "steps.parquet").sort_values("start_s", ignore_index=True)
    if "decode_context" in steps:
        return steps.assign(context=steps.decode_context, pairs=steps.prefill_attn_pairs)
    reqs = pd.read_parquet(run / "requests.parquet")
    with_decodes = steps[steps.decode_seqs > 0].start_s.to_numpy()
    context = []
    for start in steps.start_s:
        t = start + 1e-4  # a request whose first token came with this pass is not in it
        on = reqs[(reqs.first_token_s <= t) & (reqs.finish_s > t)]
        since = np.searchsorted(with_decodes, t) - np.searchsorted(
            with_decodes, on.first_token_s.to_numpy() - 1e-4
        )
        context.append(float((on.prompt_tokens.to_numpy() + 1 + since).sum()))
    pairs = [chunk_attn_pairs(0, int(n)) for n in steps.prefill_tokens]
    return steps.assign(context=context, pairs=pairs)


def passes(run: Path, cost: ProfileCost) -> pd.DataFrame:
    """The run's passes with a chunk: tokens, decodes, their context, hw and model device ms."""
    steps = with_context(run)
    rows = []
    for p in steps[steps.prefill_tokens > 0].itertuples():
        n, d, k = int(p.prefill_tokens), int(p.decode_seqs), p.context
        shape = StepShape(n, p.pairs, decode_seqs=d, decode_context=k)
        model = cost.step_time(shape) - cost.host_s(True, d)  # the pass's device time
        rows.append((run.name, n, d, k, p.device_s * 1e3, model * 1e3))
    return pd.DataFrame(rows, columns=["run", "tokens", "decodes", "context", "hw_ms", "model_ms"])


def host_fit(run: Path) -> str:
    """A line on the run's decode passes' host time (wall less device) fitted by least squares
    against their batch and their context: fixed, per sequence, per 10,000 tokens."""
    steps = with_context(run)
    d = steps[(steps.prefill_tokens == 0) & steps.device_s.notna()]
    host = (d.duration_s - d.device_s).to_numpy() * 1e3
    x = np.c_[np.ones(len(d)), d.batch_size, d.context / 1e4]
    (fixed, per_seq, per_10k), *_ = np.linalg.lstsq(x, host, rcond=None)
    return (
        f"{run.parent.name}/{run.name}: {len(d)} decode passes, host {fixed:.3f} ms "
        f"{per_seq:+.4f} ms a sequence {per_10k:+.3f} ms per 10,000 tokens"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("validate", type=Path)
    ap.add_argument("--profile", type=Path, help="default: the validate's profile.csv")
    ap.add_argument("--host", action="store_true", help="fit the decode passes' host time instead")
    args = ap.parse_args()
    out: Path = args.validate
    runs = sorted(out.glob("hw/colocated-*")) + sorted(
        d for d in out.glob("calibration/*rps") if not d.name.startswith("disagg-")
    )
    if args.host:
        for run in runs:
            print(host_fit(run))
        return
    costs = json.loads((out / "calibration" / "calibration.json").read_text())
    offsets = [tuple(x) for x in costs.get("profile_chunk_offsets", [])]
    profile = args.profile or out / "profile.csv"
    cost = ProfileCost(profile, chunk_offsets=offsets)
    shortest = int(pd.read_csv(profile).query("kind == 'mixed'").context.min())
    df = pd.concat([passes(run, cost) for run in runs], ignore_index=True)
    df["beyond_ms"] = df.hw_ms - df.model_ms
    df["past"] = df.context - df.decodes * shortest
    for group, g in df.groupby(df.run.str.startswith("colocated-")):
        x = np.c_[np.ones(len(g)), g.past / 1e4]
        (icept, slope), *_ = np.linalg.lstsq(x, g.beyond_ms, rcond=None)
        name = "validation" if group else "calibration"
        print(
            f"{name}: {len(g)} passes, beyond the model {icept:+.3f} ms "
            f"{slope:+.3f} ms per 10,000 tokens of context past {shortest} a decode"
        )
    bins = pd.cut(df.context, [-1, 1, 2e4, 5e4, 8e4, 1.2e5, np.inf])
    print(df.groupby(bins, observed=True)[["hw_ms", "model_ms", "beyond_ms"]].median().round(2))


if __name__ == "__main__":
    main()
