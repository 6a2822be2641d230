"""Give the colocated calibration runs of a validate directory from before the steps table's
shape columns their `prefill_attn_pairs` and `decode_context`, rebuilt from the requests
table, in place:

    python benchmarks/results/2026-12-05-cpu/rebuild_shapes.py VALIDATE_DIR... [--runs]

`--runs`: its colocated validation runs (`hw/colocated-*`) too, for `passes.md`'s column of
each pass at its own shape.

- Chunks: a colocated server prefills first come, first served, so each pass with a prompt
  chunk takes its `prefill_tokens` from the requests in order of their prefill start, each
  piece after what came before of its prompt. Checked: the pass that takes a request's last
  prompt token ends at its `prefill_end_s` (within 0.2 ms in every run here).
- Decodes: a request decodes in every pass from its first token to its finish, holding its
  prompt, its first token and one token for every pass with decodes since. Checked: the
  requests so counted are each pass's `decode_seqs` in every pass here.
"""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pandas as pd

from disagg.core.scheduler import chunk_attn_pairs


def rebuild(run: Path) -> tuple[int, float, float]:
    """Fill `run`'s steps table; (requests prefilled, largest gap of a request's last chunk
    pass's end to its prefill end in s, share of decode passes whose count matches)."""
    steps = pd.read_parquet(run / "steps.parquet")
    req = pd.read_parquet(run / "requests.parquet")
    order = steps.sort_values("start_s", kind="stable").index
    queue = list(req.sort_values(["prefill_start_s", "arrival_s"]).itertuples())
    done = {r.request_id: 0 for r in queue}
    pairs = pd.Series(0.0, index=steps.index)
    context = pd.Series(0.0, index=steps.index)
    decode_starts = steps.loc[order].query("decode_seqs > 0").start_s.to_numpy()
    ends: dict[int, float] = {}
    head, matched = 0, []
    for i in order:
        row = steps.loc[i]
        left = int(row.prefill_tokens)
        while left > 0:
            r = queue[head]
            take = min(left, int(r.prompt_tokens) - done[r.request_id])
            pairs[i] += chunk_attn_pairs(done[r.request_id], take)
            done[r.request_id] += take
            left -= take
            if done[r.request_id] == r.prompt_tokens:
                ends[r.request_id] = row.start_s + row.duration_s
                head += 1
        if row.decode_seqs > 0:
            t = row.start_s + 1e-4  # a request whose first token came with this pass is not in it
            on = req[(req.first_token_s <= t) & (req.finish_s > t)]
            since = np.searchsorted(decode_starts, t) - np.searchsorted(
                decode_starts, on.first_token_s.to_numpy() - 1e-4
            )
            context[i] = float((on.prompt_tokens.to_numpy() + 1 + since).sum())
            matched.append(len(on) == row.decode_seqs)
    steps["prefill_attn_pairs"], steps["decode_context"] = pairs, context
    steps.to_parquet(run / "steps.parquet")
    prefill_end = req.set_index("request_id").prefill_end_s
    gap = max(abs(end - prefill_end[k]) for k, end in ends.items())
    return len(ends), gap, float(np.mean(matched))


def main() -> None:
    runs = "--runs" in sys.argv
    for out in (Path(a) for a in sys.argv[1:] if a != "--runs"):
        found = sorted(out.glob("calibration/*rps"))
        found += sorted(out.glob("hw/colocated-*")) if runs else []
        for run in found:
            if not run.name.startswith("disagg-"):
                n, gap, matched = rebuild(run)
                print(
                    f"{run}: {n} requests, last chunk to prefill end within {gap * 1e3:.2f} ms, "
                    f"decode counts matched in {matched:.1%} of passes"
                )


if __name__ == "__main__":
    main()
