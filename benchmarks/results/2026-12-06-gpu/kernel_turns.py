"""How two servers on one GPU take turns, from a kernel timeline (`kernel_timeline.py`) and its
hw run's steps: a turn is a run of one server's kernels and copies with none of the other's.

    python kernel_turns.py KERNELS.csv.gz RUN_DIR [--out FILE.md]

- the prefill's turns: how many a chunk pass takes, how long one lasts by the chunk's tokens;
- whether a prefill turn preempts the decoder (a decode kernel runs across it) or comes in a
  gap of the decoder's (nothing of the decoder's queued), how long the decoder ran before one
  that preempts it, and the switch between two turns;
- per decode pass, by batch: its length and device time, and the prefill turns inside it;
- where each chunk pass's last turn fell: preempting the decoder or in its gap, and the end of
  the decode pass nearest the prefill's end stamp;
- per decode cycle, by batch: the prefill's turns, preempting or in the decoder's gaps.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np
import pandas as pd


def turns(k: pd.DataFrame) -> tuple[pd.DataFrame, float, float]:
    """The GPU rows inside both servers' windows, as turns (node, start, end, ops)."""
    g = k[k.kind.isin(["kernel", "memcpy", "memset"])].sort_values("start_ms")
    lo, hi = g.groupby("node").start_ms.min().max(), g.groupby("node").end_ms.max().min()
    g = g[(g.start_ms > lo) & (g.end_ms < hi)].reset_index(drop=True)
    t = g.groupby((g.node != g.node.shift()).cumsum().rename("turn")).agg(
        node=("node", "first"),
        start=("start_ms", "min"),
        end=("end_ms", "max"),
        ops=("node", "size"),
    )
    # a prefill turn preempts the decoder when a decode op began before it and ends after it
    d = g[g.node == "decode0"]
    ds, de = d.start_ms.to_numpy(), d.end_ms.to_numpy()
    first = np.searchsorted(ds, t.start.to_numpy()) - 1
    open_end = np.maximum.accumulate(de)[np.maximum(first, 0)]
    t["preempts"] = (t.node == "prefill0") & (first >= 0) & (open_end > t.end.to_numpy())
    return t.reset_index(drop=True), lo, hi


BATCHES = [0, 8, 16, 24, 32, 48, 64, 256]


def cycles(t: pd.DataFrame, lo: float, hi: float, run: Path) -> list[str]:
    """The prefill's turns per decode cycle (a decode pass's start to the next one's), by the
    decode batch: how many, how many preempted the decoder, how many came in its gaps."""
    s = pd.read_parquet(run / "steps.parquet")
    s = s.assign(a=s.start_s * 1e3, b=(s.start_s + s.duration_s) * 1e3)
    dec = s[(s.node == "decode0") & (s.a > lo) & (s.b < hi)].sort_values("a")
    p = t[t.node == "prefill0"]
    rows = []
    for (a, b, n), nxt in zip(
        dec[["a", "b", "batch_size"]].itertuples(index=False), dec.a.iloc[1:], strict=False
    ):
        inside = p[(p.start >= a) & (p.start < nxt)]
        if len(inside):
            rows.append((n, nxt - a, b - a, len(inside), int(inside.preempts.sum())))
    c = pd.DataFrame(rows, columns=["batch", "cycle", "pass", "turns", "preempting"])
    c["in_gaps"] = c.turns - c.preempting
    g = c.groupby(pd.cut(c.batch, BATCHES), observed=True)
    lines = [
        "| decode batch | cycles | cycle ms | pass ms | prefill turns | preempting | in gaps |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for b, x in g:
        lines.append(
            f"| {b} | {len(x)} | {x.cycle.median():.2f} | {x['pass'].median():.2f} | "
            f"{x.turns.median():g} | {x.preempting.median():g} | {x.in_gaps.median():g} |"
        )
    return lines


def report(kernels: Path, run: Path) -> list[str]:
    t, lo, hi = turns(pd.read_csv(kernels))
    steps = pd.read_parquet(run / "steps.parquet")
    steps = steps.assign(a=steps.start_s * 1e3, b=(steps.start_s + steps.duration_s) * 1e3)
    steps = steps[(steps.a > lo) & (steps.b < hi)]
    pre = steps[(steps.node == "prefill0") & (steps.prefill_tokens > 0)]
    p = t[t.node == "prefill0"].copy()
    p["tokens"] = 0
    p["pass_end"] = np.nan
    for r in pre.itertuples():
        inside = (p.start >= r.a) & (p.end <= r.b + 0.5)
        p.loc[inside, "tokens"] = r.prefill_tokens
        p.loc[inside, "pass_end"] = r.b
    p = p[p.tokens > 0]
    prev_end = t.end.shift().reindex(p.index)
    p["switch_ms"] = p.start - prev_end
    # the decoder's run before a preempting turn: since the prefill's turn before it
    pt = p.sort_values("start")
    ran = (pt.start - (pt.end.shift())).where(pt.preempts)
    out = [
        f"window {lo / 1e3:.2f}-{hi / 1e3:.2f} s: {len(pre)} chunk passes, {len(p)} prefill turns",
        "",
        "| chunk tokens | passes | turns a pass (median) | turn ms p10 / p50 / p90 | preempting |",
        "|---:|---:|---:|---:|---:|",
    ]
    for tokens, g in p.groupby("tokens"):
        q = g.end.sub(g.start).quantile([0.1, 0.5, 0.9]).round(3).tolist()
        per = g.groupby("pass_end").size().median()
        passes = g.pass_end.nunique()
        out.append(
            f"| {tokens} | {passes} | {per:g} | {q[0]} / {q[1]} / {q[2]} "
            f"| {g.preempts.mean():.2f} |"
        )
    q = ran.dropna().quantile([0.1, 0.5, 0.9]).round(3).tolist()
    s = p.switch_ms.quantile([0.1, 0.5, 0.9]).round(3).tolist()
    out += [
        "",
        f"- the decoder's run (its device time and one switch) before a preempting turn, ms "
        f"p10 / p50 / p90: {q}",
        f"- the switch into a prefill turn, ms: {s}",
        "",
        "Decode passes by batch: beside a chunk pass (prefill turns inside) or not",
        "",
        "| batch | beside | passes | ms (median) | device ms | prefill turns inside |",
        "|---|---|---:|---:|---:|---:|",
    ]
    dec = steps[steps.node == "decode0"]
    starts = p.start.to_numpy()
    n_in = [((starts >= a) & (starts < b)).sum() for a, b in zip(dec.a, dec.b, strict=True)]
    dec = dec.assign(turns_in=n_in, beside=np.array(n_in) > 0)
    bins = pd.cut(dec.batch_size, [0, 4, 8, 16, 24, 32, 48, 64, 256])
    for (b, beside), g in dec.groupby([bins, "beside"], observed=True):
        out.append(
            f"| {b} | {'yes' if beside else 'no'} | {len(g)} | {g.duration_s.median() * 1e3:.2f} "
            f"| {g.device_s.median() * 1e3:.2f} | {np.median(g.turns_in):g} |"
        )
    last = p.sort_values("start").groupby("pass_end").tail(1)
    ends = dec.b.to_numpy()
    near = [ends[np.argmin(np.abs(ends - e))] - e for e in last.pass_end]
    out += [
        "",
        f"Each chunk pass's last turn: preempting the decoder {last.preempts.mean():.2f}, in its "
        f"gap {1 - last.preempts.mean():.2f}; the decode pass end nearest the prefill's end "
        f"stamp, ms after it: median {np.median(near):.2f}, within 1 ms "
        f"{np.mean(np.abs(near) < 1):.2f} ({len(last)} passes)",
        "",
        "The prefill's turns per decode cycle (a decode pass's start to the next one's)",
        "",
    ]
    return out + cycles(t, lo, hi, run)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("kernels", type=Path)
    ap.add_argument("run", type=Path)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    text = "\n".join(report(a.kernels, a.run)) + "\n"
    if a.out:
        a.out.write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
