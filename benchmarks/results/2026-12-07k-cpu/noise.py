"""How much of the replays' misses the hardware's own noise explains (2026-12-07k): over
replayed validates of one model (two hardware runs a cell), each cell's (mode, load,
metric):

- sigma_hw: one hardware run's spread, from the two runs' ratio (E[log(a/b)^2] = 2 sigma^2);
- exact: the misses expected of a simulator exactly on the hardware's mean, judged on the
  mean of two runs (error sigma_hw / sqrt 2), over all the validates;
- bias and sd: the mean and the spread of log(sim/hw) over the validates;
- sd_sim: the part of sd beyond the hardware's noise in the mean of two runs;
- missed: those counted; no_bias: those expected with the bias taken away (error sd);
  bias_only: those expected with the bias and the hardware's noise alone (sd_sim 0);
and the chance that an exact simulator meets every cell of one validate.

    python benchmarks/results/2026-12-07k-cpu/noise.py VALIDATE_DIR...

Each directory holds a replayed validate's fidelity.csv and hw_spread.csv."""

import math
import re
import sys

import numpy as np
import pandas as pd

TOLERANCE = {"ttft_s_p50": 5, "ttft_s_p90": 5, "tpot_s_p50": 3, "tpot_s_p90": 3}
TOLERANCE["output_throughput"] = 3
LOADS = ("light", "middle", "top")


def cells(where: str) -> pd.DataFrame:
    """One validate's cells: mode, load, metric, log(sim/hw) and log(high/low) of its runs."""
    fid = pd.read_csv(f"{where}/fidelity.csv").merge(pd.read_csv(f"{where}/hw_spread.csv"))
    fid = fid[fid.metric.isin(TOLERANCE)].copy()
    fid["mode"] = fid.run.str.split("-").str[0]
    rps = fid.run.map(lambda r: float(re.findall(r"[\d.]+(?=rps)", r)[0]))
    fid["load"] = [LOADS[int(i) - 1] for i in rps.groupby(fid["mode"]).rank(method="dense")]
    fid["err"] = np.log(fid.sim_profile / fid.hw)
    fid["pair"] = np.log(fid.high / fid.low)
    return fid[["mode", "load", "metric", "err", "pair"]]


def missed(err: pd.Series, tol: float) -> int:
    """How many of `err` (log sim/hw) miss a tolerance of `tol` percent, as validate judges."""
    return int((abs(np.exp(err) - 1) > tol / 100 + 1e-12).sum())


def p_miss(tol: float, sd: float, bias: float = 0.0) -> float:
    """The chance that N(bias, sd), as log sim/hw, misses a tolerance of `tol` percent."""
    low, high = math.log(1 - tol / 100) - bias, math.log(1 + tol / 100) - bias
    if sd == 0:
        return float(not low <= 0 <= high)
    return (2 + math.erf(low / (sd * math.sqrt(2))) - math.erf(high / (sd * math.sqrt(2)))) / 2


def cell(g: pd.DataFrame, tol: float) -> dict[str, float]:
    """One cell's row over the validates (module doc)."""
    sigma_hw, bias, sd, n = math.sqrt((g.pair**2).mean() / 2), g.err.mean(), g.err.std(), len(g)
    noise = sigma_hw / math.sqrt(2)  # of the mean of two runs
    return {
        "n": n,
        "sigma_hw": sigma_hw,
        "bias": bias,
        "sd": sd,
        "sd_sim": math.sqrt(max(sd**2 - noise**2, 0.0)),
        "missed": missed(g.err, tol),
        "exact": n * p_miss(tol, noise),
        "no_bias": n * p_miss(tol, sd),
        "bias_only": n * p_miss(tol, noise, bias),
    }


runs = pd.concat([cells(d) for d in sys.argv[1:]])
by = runs.groupby(["mode", "load", "metric"], sort=False)
table = pd.DataFrame({key: cell(g, TOLERANCE[key[2]]) for key, g in by}).T
total = table[["missed", "exact", "no_bias", "bias_only"]].sum()
all_met = (1 - table.exact / table.n).prod()  # an exact simulator's, in one validate
print(
    f"{len(sys.argv) - 1} validates, {len(runs)} cells, missed: {total.missed:.0f} as replayed, "
    f"{total.exact:.1f} exact, {total.no_bias:.1f} without the bias, "
    f"{total.bias_only:.1f} with the bias alone; an exact simulator meets every cell of a "
    f"validate with chance {all_met:.2f}"
)
print(table.round(4).to_markdown())
