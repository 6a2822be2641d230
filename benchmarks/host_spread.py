"""How a server's host time per pass moves from run to run on one machine, and with what: the
server's cores (`hw.latency.cores_per_server`), the driver's (`hw.latency.driver_cores`), where
they begin (`hw.latency.first_core`), the run's place in the session, and a device profile in
this process before it (as `disagg validate` profiles before its runs).

Runs the experiment `--rounds` times over each setting (`--cores` x `--driver-cores` x
`--first-core`), in turn, each run a fresh set of servers on a workload of its own seed (the
same seeds in every setting; `--same-seed`: the experiment's seed in every run).
`--profile-before K` profiles the model in this process before round K, over the grid validate
would use. Each run's host time per decode pass (wall less device) is fitted as validate's loop
calibration does (`loop_costs`), and its median taken over the decode passes of at least
`--at-batch` sequences; beside it, the median time the host took to launch a pass with a prompt
chunk (`launch_s`). Each row also says when the run started (s after the first), the host's
1-minute load average then, the mean CPU clock the host reports, and the CPU seconds the driver
spent serving it. Writes `host_spread.csv` (a
row per run, after each run) and `host_spread.md` (per setting and per round).

    python benchmarks/host_spread.py experiments/qwen3moe-h200-colocated.toml --device cuda:0 \\
        --rounds 4 --rate 32.9 --requests 120 --cores 2 --driver-cores 0,2 --same-seed \\
        --profile-before 2 --out runs/host-spread
"""

from __future__ import annotations

import argparse
import os
import resource
import time
from pathlib import Path

import numpy as np
import pandas as pd

from disagg.config import Experiment, load_experiment
from disagg.hw.driver import hw_experiment, run_hw
from disagg.validate import Options, loop_costs, measure_profile
from disagg.validate_passes import pass_gaps

FITTED = ("host_s", "host_per_seq_s", "host_chunk_s")  # loop_costs' decode fit, in seconds


def cpu_mhz(path: Path = Path("/proc/cpuinfo")) -> float:
    """The mean clock the host reports over its cores (NaN where it does not)."""
    try:
        clocks = [float(line.split(":")[1]) for line in path.read_text().splitlines()
                  if line.startswith("cpu MHz")]  # fmt: skip
    except OSError:
        return float("nan")
    return float(np.mean(clocks)) if clocks else float("nan")


def host_at(steps: pd.DataFrame, at_batch: int) -> float:
    """The median host time (s) of the decode passes of at least `at_batch` sequences that have
    device times; NaN if none."""
    timed = steps[steps.device_s.notna() & (steps.prefill_tokens == 0)]
    big = timed[timed.batch_size >= at_batch]
    return float((big.duration_s - big.device_s).median()) if len(big) else float("nan")


def chunk_launch(steps: pd.DataFrame) -> float:
    """The median time (s) the host took to launch a pass with a prompt chunk; NaN where the
    steps table says none (the CPU, or a table from before `launch_s`)."""
    if "launch_s" not in steps:
        return float("nan")
    return float(steps[steps.prefill_tokens > 0].launch_s.median())


def one_run(exp: Experiment, where: Path, at_batch: int) -> dict[str, object]:
    """Run `exp` into `where`; its row of host_spread.csv (without the run's place)."""
    load1 = os.getloadavg()[0]
    mhz = cpu_mhz()
    before = resource.getrusage(resource.RUSAGE_SELF)
    summary, _ = run_hw(exp, where)
    after = resource.getrusage(resource.RUSAGE_SELF)
    steps = pd.read_parquet(where / "steps.parquet")
    costs = loop_costs([steps])
    return {
        "load1": load1,
        "cpu_mhz": mhz,
        "driver_cpu_s": (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime),
        "serving_s": summary["wall_s"] - summary["startup_s"],
        **{key: costs.get(f"profile_{key}", float("nan")) for key in FITTED},
        f"host_b{at_batch}_s": host_at(steps, at_batch),
        "chunk_launch_s": chunk_launch(steps),
        "pass_gap_s": float(pass_gaps(steps).median()),
        "tpot_p50_s": summary["tpot_s_p50"],
        "pinned": " ".join(f"{node}:{s['cores']}" for node, s in summary["node_settings"].items()),
        "driver": summary["driver_cores"],
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("experiment", type=Path)
    ap.add_argument("--device", default="cuda:0")
    ap.add_argument("--rounds", type=int, default=4)
    ap.add_argument("--rate", type=float, default=4.0)
    ap.add_argument("--requests", type=int, default=24)
    ap.add_argument("--cores", default="0,2", help="cores per server, each setting (0: unpinned)")
    ap.add_argument("--driver-cores", default="0", help="the driver's cores, each setting")
    ap.add_argument("--first-core", default="0", help="where the pinned cores begin, each setting")
    ap.add_argument("--same-seed", action="store_true", help="the experiment's seed every run")
    ap.add_argument("--profile-before", type=int, default=None, metavar="ROUND")
    ap.add_argument("--at-batch", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("runs/host-spread"))
    a = ap.parse_args()
    base = load_experiment(
        a.experiment,
        [
            f"hw.prefill_device={a.device}",
            f"hw.decode_device={a.device}",
            f"workload.rate_per_s={a.rate}",
            f"workload.num_requests={a.requests}",
        ],
    )
    settings = [
        (int(cores), int(driver), int(first))
        for cores in a.cores.split(",")
        for driver in a.driver_cores.split(",")
        for first in a.first_core.split(",")
    ]
    a.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict[str, object]] = []
    began = time.monotonic()
    for i in range(a.rounds):
        if i == a.profile_before:
            took = time.monotonic()
            measure_profile([base], Options(device=a.device), a.out / "profile.csv")
            print(f"profile before round {i}: {time.monotonic() - took:.1f} s", flush=True)
        for cores, driver, first in settings:
            seed = base.seed if a.same_seed else base.seed + 10 + i
            exp = hw_experiment(
                base.updated(
                    f"seed={seed}",
                    f"hw.latency.cores_per_server={cores}",
                    f"hw.latency.driver_cores={driver}",
                    f"hw.latency.first_core={first}",
                )
            )
            started = time.monotonic() - began
            where = a.out / f"round{i}-cores{cores}-driver{driver}-first{first}"
            row = one_run(exp, where, a.at_batch)
            rows.append({"round": i, "cores_per_server": cores, "driver_cores": driver,
                         "first_core": first,
                         "profiled": a.profile_before is not None and i >= a.profile_before,
                         "seed": seed, "t_s": started, **row})  # fmt: skip
            df = pd.DataFrame(rows)
            df.to_csv(a.out / "host_spread.csv", index=False)  # after each run: a cut call keeps it
            print(df.tail(1).to_string(index=False, header=len(rows) == 1), flush=True)
    timed = [*FITTED, f"host_b{a.at_batch}_s", "chunk_launch_s"]
    ms = df.assign(**{c: df[c] * 1e3 for c in timed})
    by_setting = ms.groupby(["cores_per_server", "driver_cores", "first_core"])[timed].agg(
        ["median", "min", "max"]
    )
    by_round = ms.groupby("round")[[*timed, "load1", "cpu_mhz", "driver_cpu_s"]].median()
    text = (
        f"# Host time per decode pass (ms), {a.rounds} rounds, {a.requests} requests at "
        f"{a.rate:g} req/s{', one seed' if a.same_seed else ''}"
        + (f", profiled before round {a.profile_before}" if a.profile_before is not None else "")
        + f"\n\nPer setting (cores per server, driver's cores, first core):\n\n```\n"
        f"{by_setting.round(4).to_string()}\n```\n\nPer round (medians over its settings):\n\n"
        f"```\n{by_round.round(4).to_string()}\n```\n"
    )
    (a.out / "host_spread.md").write_text(text)
    print(text)


if __name__ == "__main__":
    main()
