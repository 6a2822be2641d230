"""`disagg validate`: the sim/hw ratios and tolerances (hand-built summaries, exact values), the
plan of what it runs, and one small end-to-end run of the real backend on this CPU."""

from __future__ import annotations

import json
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import pytest

from disagg import validate
from disagg.config import load_experiment
from disagg.core.metrics import ttft_parts
from disagg.errors import ConfigError
from disagg.fidelity import (
    COLUMNS,
    OWN_HOST_COLUMNS,
    REPEAT_COLUMNS,
    SPREAD_COLUMNS,
    fidelity_table,
    judge,
    markdown,
    median_summary,
    near_range,
    own_host_markdown,
    own_host_table,
    parse_tolerances,
    past_saturation,
    plot_passes,
    queue_growth,
    repeat_markdown,
    repeat_table,
    spread_markdown,
    spread_table,
    ttft_parts_markdown,
    widest_spreads,
)
from disagg.validate import (
    calibration_run,
    control_hop,
    least_smoothed,
    loop_costs,
    own_host,
    start_parts,
)
from disagg.validate_passes import (
    PASS_COLUMNS,
    after_chunk,
    beside_chunk,
    chunk_offsets,
    graph_ranges,
    graph_scales,
    has_shapes,
    idle_hops,
    pass_gaps,
    pass_offsets,
    pass_table,
    shape_device,
    since_chunk,
)
from disagg.validate_plan import (
    capacity_per_s,
    log_grid,
    other_mode,
    plan_runs,
    profile_grid,
    request_seconds,
    run_kind,
    with_schedulers,
)

EXPERIMENTS = Path(__file__).parent.parent / "experiments"
TINY = EXPERIMENTS / "tiny-disagg.toml"

HW = {
    "ttft_s_p50": 0.100,
    "ttft_s_p90": 0.200,
    "tpot_s_p50": 0.010,
    "tpot_s_p90": 0.020,
    "itl_s_p99": 0.040,
    "output_throughput": 1000.0,
}
PROFILE = {
    "ttft_s_p50": 0.104,
    "ttft_s_p90": 0.150,
    "tpot_s_p50": 0.0097,
    "tpot_s_p90": 0.021,
    "itl_s_p99": 0.040,
    "output_throughput": 990.0,
}
ROOFLINE = {k: 2 * v for k, v in HW.items()}


def runs() -> dict[str, dict[str, dict[str, float]]]:
    slow = {"hw": HW | {"tpot_s_p50": 0.0}, "sim_profile": PROFILE, "sim_roofline": ROOFLINE}
    return {"a": {"hw": HW, "sim_profile": PROFILE, "sim_roofline": ROOFLINE}, "b": slow}


def test_tolerances_parse_by_name_or_summary_key() -> None:
    got = parse_tolerances(" ttft_p50=5, tpot_s_p90=3%,output_throughput=0.0001 ,")
    assert got == {"ttft_s_p50": 5.0, "tpot_s_p90": 3.0, "output_throughput": 0.0001}
    assert parse_tolerances(None) == {} == parse_tolerances("")


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("ttft_p50", r"--tolerance 'ttft_p50': expected METRIC=PERCENT"),
        ("ttft_p99=5", r"--tolerance 'ttft_p99': unknown metric; known: ttft_p50, ttft_p90"),
        ("tpot_p50=fast", r"--tolerance tpot_p50='fast': give a percentage >= 0"),
        ("tpot_p50=-1", r"--tolerance tpot_p50='-1': give a percentage >= 0"),
        ("tpot_p50=nan", r"--tolerance tpot_p50='nan': give a percentage >= 0"),
    ],
)
def test_a_bad_tolerance_is_an_error_naming_it(text: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        parse_tolerances(text)


def test_the_table_has_a_row_per_run_and_metric_with_each_backends_value() -> None:
    table = fidelity_table(runs())
    assert list(table.columns) == COLUMNS == ["run", "metric", "hw", "sim_profile", "sim_roofline"]
    assert list(table.run) == ["a"] * 6 + ["b"] * 6
    assert list(table.metric[:6]) == list(HW)
    row = table.iloc[2]
    assert (row.run, row.metric, row.hw, row.sim_profile, row.sim_roofline) == (
        "a",
        "tpot_s_p50",
        0.010,
        0.0097,
        0.020,
    )
    missing = fidelity_table({"c": {"hw": {"ttft_s_p50": 1.0}}})
    assert missing.hw.iloc[0] == 1.0 and missing.sim_profile.isna().all()


def test_tolerances_are_judged_on_the_profile_replay() -> None:
    """|sim/hw - 1| within the percent; an error equal to the tolerance meets it (0.97 against
    3%, despite float rounding); no ratio (hw 0) misses."""
    tol = {"ttft_s_p50": 5.0, "tpot_s_p50": 3.0, "tpot_s_p90": 3.0, "output_throughput": 1.0}
    verdicts = judge(fidelity_table(runs()), tol)
    cells = [(v.run, v.metric, v.met) for v in verdicts]
    assert cells == [
        ("a", "ttft_s_p50", True),  # 1.04
        ("a", "tpot_s_p50", True),  # 0.97: exactly 3%
        ("a", "tpot_s_p90", False),  # 1.05
        ("a", "output_throughput", True),  # 0.99
        ("b", "ttft_s_p50", True),
        ("b", "tpot_s_p50", False),  # hw 0: no ratio
        ("b", "tpot_s_p90", False),
        ("b", "output_throughput", True),
    ]
    assert [v.ratio for v in verdicts[:4]] == pytest.approx([1.04, 0.97, 1.05, 0.99], abs=1e-12)
    assert math.isnan(verdicts[5].ratio)
    assert str(verdicts[2]) == "a tpot_s_p90: sim/hw 1.05, tolerance 3%"
    assert str(verdicts[5]) == "b tpot_s_p50: no ratio, tolerance 3%"


def test_the_markdown_gives_each_ratio_and_each_verdict() -> None:
    table = fidelity_table(runs())
    text = markdown(table, judge(table, {"ttft_s_p90": 10.0}))
    assert "| run | TTFT p50 | TTFT p90 | TPOT p50 | TPOT p90 | ITL p99 | output tok/s |" in text
    assert "| a | 1.04 / 2 | 0.75 / 2 | 0.97 / 2 | 1.05 / 2 | 1 / 2 | 0.99 / 2 |" in text
    assert "| b | 1.04 / 2 | 0.75 / 2 | - / - | 1.05 / 2 | 1 / 2 | 0.99 / 2 |" in text
    assert "0 of 2 cells met." in text
    assert "| a | ttft_s_p90 | 0.75 | 25 | 10 | **no** | - |" in text
    assert "None given" in markdown(table, [])


def timed_requests(rows: list[tuple[float, ...]], failed: int = 0) -> pd.DataFrame:
    """Requests (arrival, prefill start, prefill end, ready, first token), finished, and
    `failed` more with NaN times."""
    cols = ["arrival_s", "prefill_start_s", "prefill_end_s", "ready_s", "first_token_s"]
    df = pd.DataFrame(rows + [(0.0, *[math.nan] * 4)] * failed, columns=cols)
    df["status"] = ["finished"] * len(rows) + ["failed"] * failed
    df["ttft_s"] = df.first_token_s - df.arrival_s
    return df.rename_axis("request_id").reset_index()


def test_where_ttft_goes_splits_each_runs_mean_ttft_into_parts_that_sum_to_it() -> None:
    """Disaggregated: queued 0.1 s and 0.3 s, prefilled 0.3 s and 0.1 s, KV ready 0.01 s and
    0.03 s after, first token 0.04 s and 0.02 s later; a failed request counts in no part.
    Colocated (no ready time: the prefill's last pass gives the first token): queued 0.02 s,
    prefilled 0.05 s; its handoff and first token are 0 in both and show as -."""
    hw = timed_requests([(1.0, 1.1, 1.4, 1.41, 1.45), (2.0, 2.3, 2.4, 2.43, 2.45)], failed=1)
    sim = timed_requests([(1.0, 1.1, 1.3, 1.30, 1.35), (2.0, 2.2, 2.4, 2.41, 2.45)])
    parts = ttft_parts(hw)
    assert list(parts.index) == [0, 1]
    assert parts.to_numpy() == pytest.approx(
        np.array([[0.1, 0.3, 0.01, 0.04], [0.3, 0.1, 0.03, 0.02]])
    )
    assert parts.sum(axis=1).to_numpy() == pytest.approx(hw.ttft_s[:2].to_numpy())
    colocated = timed_requests([(0.0, 0.02, 0.07, math.nan, 0.07)])
    text = ttft_parts_markdown(
        {
            "disagg": {"hw": hw, "sim_profile": sim},
            "colocated": {"hw": colocated, "sim_profile": colocated},
            "hw only": {"hw": hw},
        }
    )
    assert "| run | TTFT | queue | prefill | handoff | first token | queue growth |" in text
    assert (
        "| disagg | 450.0 / 400.0 | 200.0 / 150.0 | 200.0 / 200.0 | 20.0 / 5.0 | 30.0 / 45.0 "
        "| - / - |" in text  # too few requests for quarters
    )
    assert "| colocated | 70.0 / 70.0 | 20.0 / 20.0 | 50.0 / 50.0 | - | - | - / - |" in text
    assert "hw only" not in text


def test_queue_growth_is_the_last_quarters_mean_queue_over_the_first_quarters_by_arrival() -> None:
    """Eight finished requests, listed out of arrival order, queued 10, 20, 30, ... 80 ms in
    the order they arrived, and a failed one: the first quarter by arrival waited 15 ms on
    average, the last 75, so the queue grew 5 times; a run that keeps up, 1; one with no
    queue in its first quarter, or too few requests for quarters, NaN."""
    order = [3, 0, 7, 5, 1, 6, 2, 4]  # request i arrives order[i]-th
    rows = [(t, t + 0.01 * (t + 1), t + 0.2, math.nan, t + 0.2) for t in map(float, order)]
    assert queue_growth(timed_requests(rows, failed=1)) == pytest.approx(5.0)
    steady = [(t, t + 0.02, t + 0.2, math.nan, t + 0.2) for t in map(float, order)]
    assert queue_growth(timed_requests(steady)) == pytest.approx(1.0)
    idle = [(t, t + 0.01 * t, t + 0.2, math.nan, t + 0.2) for t in map(float, order)]
    assert math.isnan(queue_growth(timed_requests(idle[:5])))  # one request a quarter, none queued
    assert math.isnan(queue_growth(timed_requests(steady[:3])))


def test_a_run_whose_hardware_queue_grows_three_times_or_more_is_told_past_saturation() -> None:
    """The hardware queue grows 5 times (10 to 80 ms by arrival) in runs "a" and "c", the
    replay's of "a" twice (10 to 20 ms); "b" keeps up (20 ms throughout): "a" and "c" are past
    saturation, "c" with no replay to set beside it; "b" is not."""
    times = [float(t) for t in range(8)]
    growing = timed_requests([(t, t + 0.01 * (t + 1), t + 0.2, math.nan, t + 0.2) for t in times])
    queues = [0.01, 0.01, 0.015, 0.015, 0.015, 0.015, 0.02, 0.02]
    twice = timed_requests([(t, t + queues[int(t)], t + 0.2, math.nan, t + 0.2) for t in times])
    steady = timed_requests([(t, t + 0.02, t + 0.2, math.nan, t + 0.2) for t in times])
    lines = past_saturation(
        {
            "a": {"hw": growing, "sim_profile": twice},
            "b": {"hw": steady, "sim_profile": growing},
            "c": {"hw": growing},
        }
    )
    assert [line.split(":")[0] for line in lines] == ["a", "c"]
    assert "grew 5.00 times" in lines[0] and "(the replay's 2.00)" in lines[0]
    assert "replay" not in lines[1]


def test_a_miss_near_the_range_of_its_hw_runs_is_told_apart_from_one_beyond_it() -> None:
    """Cell "a" run three times: TPOT p90 20-20.6 ms (sim 21: 1.05 of the median, a miss at 3%,
    but under 20.6 x 1.03 = 21.2) is near the runs' range; TTFT p90 180-220 ms (sim 150, below
    180 x 0.9 = 162 at 10%) is beyond it. Cell "b", run once, has no range."""
    table = fidelity_table(runs())
    verdicts = judge(table, {"ttft_s_p90": 10.0, "tpot_s_p90": 3.0})
    spread = spread_table(
        {"a": [HW, HW | {"tpot_s_p90": 0.0206, "ttft_s_p90": 0.18}, HW | {"ttft_s_p90": 0.22}]}
    )
    near = {(v.run, v.metric): near_range(table, v, spread) for v in verdicts}
    assert near == {
        ("a", "ttft_s_p90"): False,
        ("a", "tpot_s_p90"): True,
        ("b", "ttft_s_p90"): None,
        ("b", "tpot_s_p90"): None,
    }
    text = markdown(table, verdicts, spread)
    assert "0 of 4 cells met. 1 of the 2 cells run more than once were within" in text
    assert "| a | tpot_s_p90 | 1.05 | 5 | 3 | **no** | yes |" in text
    assert "| a | ttft_s_p90 | 0.75 | 25 | 10 | **no** | no |" in text
    assert "| b | tpot_s_p90 | 1.05 | 5 | 3 | **no** | - |" in text


def test_a_calibration_runs_ratios_stand_beside_its_validation_runs_with_the_gap() -> None:
    """Run "a" again on another seed: TTFT p50 the same (gap 0), TPOT p50 0.97 -> 1.0 (gap
    0.03); a metric the validation run has no ratio of (b's TPOT p50, hw 0) gives no row. Then
    "a" alone with TTFT p50 0.52 against 1.04: its row, and the largest gaps."""
    again = {
        "a": {"hw": HW | {"ttft_s_p50": 0.1}, "sim_profile": PROFILE | {"tpot_s_p50": 0.01}},
        "b": {"hw": HW, "sim_profile": PROFILE},
    }
    got = repeat_table(fidelity_table(runs()), fidelity_table(again))
    assert list(got.columns) == REPEAT_COLUMNS
    by = got.set_index(["run", "metric"])
    assert by.loc[("a", "ttft_s_p50")].tolist() == pytest.approx([1.04, 1.04, 0.0])
    assert by.loc[("a", "tpot_s_p50")].tolist() == pytest.approx([1.0, 0.97, 0.03])
    assert ("b", "tpot_s_p50") not in by.index and len(got) == 2 * len(HW) - 1
    del again["b"]
    again["a"]["hw"] = HW | {"ttft_s_p50": 0.2}  # sim/hw 0.52 against 1.04
    text = repeat_markdown(repeat_table(fidelity_table(runs()), fidelity_table(again)))
    assert (
        "| a | 0.52 / 1.04 | 0.75 / 0.75 | 1 / 0.97 | 1.05 / 1.05 | 1 / 1 | 0.99 / 0.99 |" in text
    )
    assert "Largest gap: TTFT p50 0.520, TTFT p90 0.000, TPOT p50 0.030," in text


def test_each_runs_own_host_time_replay_stands_beside_the_calibrated_one() -> None:
    """Replayed with its own host time, run "a" is exact (1 everywhere) and "b" too where it
    has a ratio (its hw TPOT p50 is 0). Judged on TPOT p50 (3%) and TTFT p90 (5%): with their
    own host time a's two and b's TTFT p90 meet, calibrated only a's TPOT p50 (0.97: 3%)."""
    own = {run: {"hw": HW, "sim_profile": HW} for run in ("a", "b")}
    own["b"]["hw"] = HW | {"tpot_s_p50": 0.0}
    got = own_host_table(fidelity_table(runs()), fidelity_table(own))
    assert list(got.columns) == OWN_HOST_COLUMNS and len(got) == 2 * len(HW)
    by = got.set_index(["run", "metric"])
    assert by.loc[("a", "tpot_s_p50")].tolist() == pytest.approx([1.0, 0.97])
    assert by.loc[("a", "ttft_s_p90")].tolist() == pytest.approx([1.0, 0.75])
    assert by.loc[("b", "tpot_s_p50")].isna().all()
    fits = {
        "calibration": {"profile_host_s": 6e-4, "profile_host_per_seq_s": 6.5e-5},
        "a": {"profile_host_s": 7.8e-4, "profile_host_per_seq_s": 9.1e-5},
    }
    text = own_host_markdown(got, {"tpot_s_p50": 3.0, "ttft_s_p90": 5.0}, fits)
    assert "| a | 1 / 1.04 | 1 / 0.75 | 1 / 0.97 | 1 / 1.05 | 1 / 1 | 1 / 0.99 |" in text
    said = "Within the tolerances: 3 of 4 cells with each run's own host time, 1 calibrated."
    assert said in text
    assert "| calibration | 0.6 | 0.065 | nan |" in text  # ms; no chunk part fitted
    assert "| a | 0.78 | 0.091 | nan |" in text
    assert "chained pass" not in text
    # a fit of chained passes (hw.latency.chain) adds their two columns to every row
    fits["a"] |= {"profile_chain_s": 4.5e-5, "profile_chain_per_seq_s": 1.1e-6}
    text = own_host_markdown(got, {"tpot_s_p50": 3.0, "ttft_s_p90": 5.0}, fits)
    assert "| calibration | 0.6 | 0.065 | nan | nan | nan |" in text
    assert "| a | 0.78 | 0.091 | nan | 0.045 | 0.0011 |" in text
    # and one of a mixed pass's own line, its two columns before the chained pass's
    fits["calibration"] |= {"profile_host_mixed_s": 1.3e-3, "profile_host_mixed_per_seq_s": 3e-5}
    text = own_host_markdown(got, {"tpot_s_p50": 3.0, "ttft_s_p90": 5.0}, fits)
    assert "mixed pass | mixed, per decode | chained pass |" in text
    assert "| calibration | 0.6 | 0.065 | nan | 1.3 | 0.03 | nan | nan |" in text


def test_a_cell_run_more_than_once_is_judged_on_its_median_and_its_spread_is_told() -> None:
    """Three runs of cell "a": TPOT p50 10, 12 and 11 ms give the median 11 ms and a spread of
    12 / 10 - 1 = 0.2; TTFT p50 missing from one run is the median of the other two; a metric
    no run has is NaN. Cell "b", run once, has no spread."""
    a = [HW, HW | {"tpot_s_p50": 0.012, "ttft_s_p50": 0.3}, HW | {"tpot_s_p50": 0.011}]
    del a[2]["ttft_s_p50"]
    median = median_summary(a)
    assert median["tpot_s_p50"] == pytest.approx(0.011)
    assert median["ttft_s_p50"] == pytest.approx((0.1 + 0.3) / 2)
    assert median["output_throughput"] == 1000.0
    assert math.isnan(median_summary([{}])["tpot_s_p50"])
    spread = spread_table({"a": a, "b": [HW]})
    assert list(spread.columns) == SPREAD_COLUMNS and set(spread.run) == {"a"}
    by = spread.set_index("metric")
    assert by.loc["tpot_s_p50", ["runs", "low", "high"]].tolist() == [3, 0.010, 0.012]
    assert by.spread["tpot_s_p50"] == pytest.approx(0.2)
    assert by.loc["ttft_s_p50", ["runs", "spread"]].tolist() == [2, pytest.approx(2.0)]
    assert by.spread["output_throughput"] == 0
    text = spread_markdown(spread)
    assert "run 3 times on one workload" in text
    assert "| a | 2 | 0 | 0.2 | 0 | 0 | 0 |" in text
    assert widest_spreads(spread).startswith("TTFT p50 2.000, TTFT p90 0.000, TPOT p50 0.200")


def test_a_replay_fits_the_shares_again_on_the_calibrations_shared_run(tmp_path: Path) -> None:
    """A calibration with a disaggregated run on a shared GPU (simulated here at decode share
    0.3 and prefill share 0.85) has its shares fitted again against its colocated-slot runs
    (the same experiment on GPUs of their own: each pass alone) and written to share.json;
    without such a run, share.json is read as it is, and without either there are none."""
    from disagg.core.metrics import steps_table
    from disagg.sim.cluster import Sim
    from disagg.validate import calibration_shares

    disagg = other_mode(
        load_experiment(EXPERIMENTS / "llama8b-h200.toml", ["workload.duration_s=20"])
    )
    cal = tmp_path / "calibration"
    for name, exp in (
        ("20rps", disagg),
        (
            "disagg-20rps",
            disagg.updated(
                "cluster.shared_gpu=true", "cluster.decode_share=0.3", "cluster.prefill_share=0.85"
            ),
        ),
    ):
        sim = Sim(exp)
        sim.run()
        (cal / name).mkdir(parents=True)
        steps_table(sim.rec).to_parquet(cal / name / "steps.parquet")
        (cal / name / "summary.json").write_text("{}")
    (cal / "share.json").write_text(json.dumps({"decode_share": 0.5}))  # an earlier fit's
    fitted = calibration_shares(cal)
    assert list(fitted) == ["decode_share", "prefill_share"]
    assert list(fitted.values()) == pytest.approx([0.3, 0.85], rel=0.01)
    assert json.loads((cal / "share.json").read_text()) == fitted
    (cal / "disagg-20rps" / "summary.json").unlink()  # a run cut short: share.json as it is
    assert calibration_shares(cal) == fitted
    assert calibration_shares(tmp_path / "none") == {}


def simulated_calibration(cal: Path, data: dict[str, Any], runs: dict[str, list[str]]) -> None:
    """Calibration runs under `cal`, each the experiment `data` with its settings simulated:
    the steps, an empty summary and the experiment of each run NAME in `cal/NAME`."""
    from disagg.config import build_experiment
    from disagg.core.metrics import steps_table
    from disagg.sim.cluster import Sim

    for name, settings in runs.items():
        exp = build_experiment(data, settings)
        sim = Sim(exp)
        sim.run()
        (cal / name).mkdir(parents=True)
        steps_table(sim.rec).to_parquet(cal / name / "steps.parquet")
        (cal / name / "summary.json").write_text("{}")
        (cal / name / "experiment.json").write_text(exp.model_dump_json())


def test_a_replay_fits_the_decode_scale_on_the_calibrations_shared_run(tmp_path: Path) -> None:
    """A calibration whose shared run's decode node ran at decode scale 0.8 (simulated on a
    profile: 10 ms + 0.1 us per cached token a decode pass) gives 0.8 back, as the replays'
    loop cost: against the profile at each pass's shape, and, for a steps table without the
    shapes, within 1% against its colocated run's decode passes; without a shared run, none."""
    from disagg.validate import calibration_decode_scale

    profile = tmp_path / "profile.csv"
    rows = [f"prefill,{n},1,0,{n * 2e-6}" for n in (256, 1024)]
    rows += [f"decode,{b},{b},{c},{0.01 + b * c * 1e-7}" for b in (1, 8) for c in (256, 1024)]
    profile.write_text("kind,tokens,batch,context,duration_s\n" + "\n".join(rows) + "\n")
    one_gpu = {"nodes": 1, "tp": 1}
    data = {
        "model": {"name": "tiny-gqa"},
        "cluster": {"mode": "disagg", "prefill": one_gpu, "decode": one_gpu},
        "cost": {"source": f"profile:{profile}"},
        "workload": {
            "rate_per_s": 4,
            "num_requests": 40,
            "prompt_tokens": {"dist": "uniform", "low": 64, "high": 1024},
            "output_tokens": {"dist": "uniform", "low": 16, "high": 64},
        },
    }
    cal = tmp_path / "calibration"
    on_profile = [f"cost.source=profile:{profile}"]
    assert calibration_decode_scale(cal, on_profile) == {}
    shared = ["cluster.shared_gpu=true", "cost.profile_decode_scale=0.8"]
    simulated_calibration(cal, data, {"4rps": [], "disagg-4rps": shared})
    said: list[str] = []
    fitted = calibration_decode_scale(cal, on_profile, said.append)
    assert fitted == {"profile_decode_scale": pytest.approx(0.8, rel=1e-9)}
    of = "of the profile's at their shape"
    assert said == [f"decode server: its passes beside no prefill took 0.800 {of}"]
    shared = cal / "disagg-4rps" / "steps.parquet"
    pd.read_parquet(shared).drop(columns=["decode_context"]).to_parquet(shared)
    said.clear()
    fitted = calibration_decode_scale(cal, on_profile, said.append)
    assert fitted["profile_decode_scale"] == pytest.approx(0.8, rel=0.01)
    scale = fitted["profile_decode_scale"]
    assert said == [
        f"decode server: its passes beside no prefill took {scale:.3f} of a colocated one's"
    ]
    (cal / "disagg-4rps" / "summary.json").unlink()  # a shared run cut short: none
    assert calibration_decode_scale(cal, on_profile) == {}


def test_a_replay_fits_the_decode_servers_own_graph_scales(tmp_path: Path) -> None:
    """A shared run whose decode node replays graphs of 1-16 (the profile's graph_batch) and
    ran at decode scale 0.9 and graph scales of its own, 0.8 at batch 1 and 1.1 at 8 (held in
    their graphs, 1 in the others): the fit gives the scale back (the median pass's, 0.9),
    and over it each graph range's factor at its passes' median batch (the graph of 4's at
    3, the graph of 8's at 5: its passes of 5-7 sequences)."""
    from disagg.validate import calibration_decode_scale

    profile = tmp_path / "profile.csv"
    rows = [f"prefill,{n},1,0,{n * 2e-6},0,0" for n in (256, 1024)]
    rows += [
        f"decode,{b},{b},{c},{0.01 + b * c * 1e-7},0,{b}"
        for b in (1, 2, 4, 8, 16)
        for c in (256, 1024)
    ]
    columns = "kind,tokens,batch,context,duration_s,host_s,graph_batch"
    profile.write_text(columns + "\n" + "\n".join(rows) + "\n")
    one_gpu = {"nodes": 1, "tp": 1}
    lengths = {"prompt_tokens": {"dist": "uniform", "low": 64, "high": 1024}}
    lengths["output_tokens"] = {"dist": "uniform", "low": 16, "high": 64}
    data = {
        "model": {"name": "tiny-gqa"},
        "cluster": {"mode": "disagg", "prefill": one_gpu, "decode": one_gpu},
        "cost": {"source": f"profile:{profile}"},
        "workload": {"rate_per_s": 8, "num_requests": 60, **lengths},
    }
    own = ["cost.profile_decode_scale=0.9", "cost.profile_decode_graph_scales=[[1, 0.8], [8, 1.1]]"]
    cal = tmp_path / "calibration"
    simulated_calibration(cal, data, {"8rps": [], "disagg-8rps": ["cluster.shared_gpu=true", *own]})
    said: list[str] = []
    fitted = calibration_decode_scale(cal, [f"cost.source=profile:{profile}"], said.append)
    assert fitted["profile_decode_scale"] == pytest.approx(0.9, rel=1e-9)
    points = fitted["profile_decode_graph_scales"]
    assert [x for p in points for x in p] == pytest.approx([1, 0.8, 2, 1, 3, 1, 5, 1.1], rel=1e-9)
    by_batch = "0.800 at 1, 1.000 at 2, 1.000 at 3, 1.100 at 5"
    assert (
        said[1]
        == f"decode server: its passes beside no prefill, over that, by their batch: {by_batch}"
    )


def test_the_search_takes_the_trough_of_a_ragged_error_not_its_dips() -> None:
    """Over [0, 1] in 20 steps: a V whose least is on the grid (0.3) comes back exactly. A
    parabola with its least at 0.42, rippled by +-0.002 from one grid point to the next, has
    its grid's least in a dip at 0.45; the parabola through the five around it, 0.35-0.55,
    has its least within 0.01 of 0.42 (0.411). An error that only rises from 0 is least at 0.
    The last x tried is the one returned."""
    tried: list[float] = []

    def at(f: Callable[[float], float]) -> Callable[[float], float]:
        return lambda x: tried.append(x) or f(x)

    assert least_smoothed(at(lambda x: abs(x - 0.3)), (0.0, 1.0)) == pytest.approx((0.3, 0.0))
    assert len(tried) == 22 and tried[-1] == pytest.approx(0.3)

    def ragged(x: float) -> float:
        return (x - 0.42) ** 2 + 0.002 * (-1) ** round(x / 0.05)

    grid = np.linspace(0.0, 1.0, 21)
    assert grid[np.argmin([ragged(x) for x in grid])] == pytest.approx(0.45)
    x, err = least_smoothed(at(ragged), (0.0, 1.0))
    assert x == pytest.approx(0.42, abs=0.01) and err == ragged(x) and tried[-1] == x
    assert least_smoothed(lambda x: x, (0.0, 1.0)) == (0.0, 0.0)
    # a replay with no metrics errs by inf: next to one, the grid's least stands
    assert least_smoothed(lambda x: math.inf if x > 0.9 else abs(x - 0.95), (0.0, 1.0)) == (
        pytest.approx(0.9),
        pytest.approx(0.05),
    )


@pytest.mark.parametrize(
    ("rule", "settings"),
    [
        ("round robin", ["cluster.switch_s=0.005"]),
        ("turns", ["cluster.turn_slice_s=0.00215", "cluster.switch_s=0.0002"]),
        # a prefill share well below 1: no fixed extra per chunk pass mimics it; one shaped by
        # the passes' time alone may (below)
        ("weights", ["cluster.decode_share=0.3", "cluster.prefill_share=0.6"]),
        (
            "chunk extra",
            ["cluster.decode_share=0.4", "cluster.prefill_share=1.0", "cluster.chunk_extra_s=0.02"],
        ),
    ],
)
def test_the_replays_get_the_rule_that_replays_the_shared_run_closer(
    tmp_path: Path, rule: str, settings: list[str]
) -> None:
    """A calibration whose shared run was simulated under one rule of the shared GPU has the
    four rules fitted on it (the turns rule at its measured slice) and replays it under
    each: the one it ran under replays it closest, and goes to share.json; the round robin's
    and the turns rule's switch costs and the chunk extra are
    found again within 10% (the summary's percentiles move in steps, so costs near them
    replay it as closely), the shares within 1%, and the decode share the same beside every
    chunk (its shape within 2% of 1). Its decode passes are all narrow: no wide factor."""
    from typer.testing import CliRunner

    from disagg.cli import app
    from disagg.validate import TURN_SLICE_S, WEIGHTS, calibration_shares, read_shares

    disagg = other_mode(
        load_experiment(EXPERIMENTS / "llama8b-h200.toml", ["workload.duration_s=20"])
    )
    cal = tmp_path / "calibration"
    exp = tmp_path / "disagg.json"
    exp.write_text(disagg.model_dump_json())
    for name, extra in (("20rps", []), ("disagg-20rps", ["cluster.shared_gpu=true", *settings])):
        sets = [a for s in extra for a in ("--set", s)]
        res = CliRunner().invoke(app, ["sim", "run", str(exp), *sets, "--out", str(cal / name)])
        assert res.exit_code == 0, res.output
    said: list[str] = []
    fitted = calibration_shares(cal, [], said.append)
    assert said[0].startswith("shared GPU: mean |log sim/hw| on disagg-20rps: weights ")
    errors = dict(re.findall(r"(weights|chunk extra|round robin|turns) ([0-9.]+)", said[0]))
    assert len(errors) == 4
    best = min(errors, key=lambda r: float(errors[r]))
    assert best == rule or (rule, best) == ("weights", "chunk extra")
    if best != rule:
        # a prefill share below 1 slows a chunk pass in proportion to its time alone: an extra
        # shaped by that time can replay it as closely, its factors rising with it
        assert float(errors["weights"]) < 0.01
        factors = [f for _, f in fitted["chunk_extra_shape"]]
        assert factors == sorted(factors) and factors[-1] == 1.0 and factors[0] < 0.5
    elif rule == "round robin":
        assert list(fitted) == ["switch_s"]
        assert fitted["switch_s"] == pytest.approx(0.005, rel=0.1)
        assert float(errors["round robin"]) < 0.005
    elif rule == "turns":
        assert list(fitted) == ["turn_slice_s", "switch_s"]
        assert fitted["turn_slice_s"] == TURN_SLICE_S
        # a switch 1% off replays this run 0.01 apart: the search takes the least of the
        # trough, not of one replay (`least_smoothed`)
        assert fitted["switch_s"] == pytest.approx(0.0002, rel=0.02)
        assert float(errors["turns"]) < 0.01
    elif rule == "weights":
        assert list(fitted.values()) == pytest.approx([0.3, 0.6], rel=0.01)
    else:
        shapes = ["decode_share_wide", "chunk_extra_shape", "chunk_extra_wide"]
        shapes += ["decode_share_shape"]
        assert list(fitted) == [*WEIGHTS, *shapes, "chunk_extra_s"]
        share_wide, shape, wide, beside = (fitted.pop(name) for name in shapes)
        assert list(fitted.values()) == pytest.approx([0.4, 1.0, 0.02], rel=0.1)
        assert fitted["decode_share"] == pytest.approx(0.4, rel=0.01)
        # the same extra at every size, and one decode share beside all: the shapes flat;
        # no decode pass of this run has more than 16 sequences, nor was one chained, so no
        # wide factor of either (1)
        assert all(f == pytest.approx(1.0, abs=0.1) for _, f in shape)
        assert wide == share_wide == 1.0
        assert all(f == pytest.approx(1.0, abs=0.02) for _, f in beside)
        fitted |= dict(zip(shapes, (share_wide, shape, wide, beside), strict=True))
    assert read_shares(cal / "share.json") == fitted
    for rule_dir in ("weights", "chunk-extra", "round-robin", "turns"):
        assert (cal / rule_dir / "disagg-20rps" / "summary.json").exists()


def test_the_shares_are_fitted_on_the_shared_runs_at_both_loads_together(tmp_path: Path) -> None:
    """measure_share's runs at the highest and the lowest load (here 4 and 1.5 req/s, named
    disagg-20rps and disagg-5rps), both simulated under decode share 0.4 and a chunk extra of
    20 ms: the fit replays both (in order of load, the highest first) and finds the extra
    again within 10% on the two together, the decode share (from the highest load's passes)
    within 1%."""
    from typer.testing import CliRunner

    from disagg.cli import app
    from disagg.validate import calibration_runs, calibration_shares

    disagg = other_mode(
        load_experiment(EXPERIMENTS / "llama8b-h200.toml", ["workload.duration_s=20"])
    )
    cal, exp = tmp_path / "calibration", tmp_path / "disagg.json"
    exp.write_text(disagg.model_dump_json())
    rule = ["cluster.shared_gpu=true", "cluster.decode_share=0.4", "cluster.prefill_share=1.0"]
    rule.append("cluster.chunk_extra_s=0.02")
    runs = {"20rps": [], "disagg-5rps": [*rule, "workload.rate_per_s=1.5"], "disagg-20rps": rule}
    for name, extra in runs.items():
        sets = [a for s in extra for a in ("--set", s)]
        res = CliRunner().invoke(app, ["sim", "run", str(exp), *sets, "--out", str(cal / name)])
        assert res.exit_code == 0, res.output
    (cal / "disagg-9rps").mkdir()  # a shared run cut short, without a summary: not one
    shared, alone = calibration_runs(cal)
    assert [d.name for d in shared] == ["disagg-20rps", "disagg-5rps"]
    assert [d.name for d in alone] == ["20rps"]
    said: list[str] = []
    fitted = calibration_shares(cal, [], said.append)
    assert said[0].startswith("shared GPU: mean |log sim/hw| on disagg-20rps and disagg-5rps: ")
    assert fitted["chunk_extra_s"] == pytest.approx(0.02, rel=0.1)
    assert fitted["decode_share"] == pytest.approx(0.4, rel=0.01)
    for name in ("disagg-20rps", "disagg-5rps"):
        assert (cal / "chunk-extra" / name / "summary.json").exists()


def test_decode_passes_beside_another_nodes_chunk_pass_are_a_kind_of_their_own() -> None:
    """A prefill node's chunk passes at 0-100 and 200-300 ms; a decoder's passes that overlap
    one (50-60, 250-260, 290-310 ms) are beside a chunk, and so is a third node's (50-60),
    those between (120-130, 310-320) not; on one node nothing is. pass_table ranges them
    apart: the beside ones 12 ms of device time, the others 6."""
    steps = pd.DataFrame(
        {
            "node": ["prefill0", "prefill0", *["decode0"] * 5, "colocated0"],
            "start_s": [0.0, 0.2, 0.05, 0.12, 0.25, 0.29, 0.31, 0.05],
            "duration_s": [0.1, 0.1, 0.01, 0.01, 0.01, 0.02, 0.01, 0.01],
            "prefill_tokens": [512, 512, 0, 0, 0, 0, 0, 0],
            "batch_size": [1, 1, 4, 4, 4, 4, 4, 4],
            "device_s": [0.09, 0.09, 0.012, 0.006, 0.012, 0.012, 0.006, 0.006],
        }
    )
    beside = [False, False, True, False, True, True, False, True]
    assert list(beside_chunk(steps)) == beside
    alone = steps.assign(node="colocated0")  # one node: nothing is beside another's chunk
    assert not beside_chunk(alone).any()
    t = pass_table(steps, steps)
    assert list(t.kind) == ["chunk", "decode", "decode beside chunk"]
    assert list(t.hw_n) == [2, 2, 4]
    assert list(t.hw_device_s) == pytest.approx([0.09, 0.006, 0.012])


def test_a_runs_start_is_told_by_its_slowest_server_in_each_part() -> None:
    nodes = {
        "prefill0": {"build_s": 9.14, "capture_s": 0.0, "warm_up_s": 0.31},
        "decode0": {"build_s": 8.0, "capture_s": 1.25, "warm_up_s": None},
    }
    said = start_parts({"node_settings": nodes})
    assert said == " (build 9.1 s, graphs 1.2 s, warm-up 0.3 s)"
    nodes["prefill0"]["weights_read"] = [0, 10]  # it drew them and kept them
    nodes["decode0"]["weights_read"] = [10, 10]
    said = start_parts({"node_settings": nodes})
    assert said == " (build 9.1 s, graphs 1.2 s, warm-up 0.3 s, weights read 0 of 10)"
    assert start_parts({"node_settings": {"colocated0": {"cores": "0,1"}}}) == ""  # older runs


def test_a_calibration_run_has_a_workload_of_its_own_and_the_runs_weights() -> None:
    exp = load_experiment(TINY).updated("seed=4")
    run = calibration_run(exp, 9, 2.5)
    assert (run.seed, run.weight_seed, run.workload.rate_per_s) == (9, 4, 2.5)
    assert exp.weight_seed == 4 and exp.model.weight_seed is None


def test_pass_gaps_are_each_nodes_idle_time_between_its_passes() -> None:
    steps = pd.DataFrame(
        {
            "node": ["a", "b", "a", "a", "b"],
            "start_s": [0.0, 0.5, 1.25, 3.0, 0.75],
            "duration_s": [1.0, 0.125, 0.5, 1.0, 0.25],
        }
    )
    # a: 0-1, 1.25-1.75, 3-4 -> gaps 0.25, 1.25; b: 0.5-0.625, 0.75-1 -> gap 0.125
    assert sorted(pass_gaps(steps)) == [0.125, 0.25, 1.25]


def _hops(rows: list[tuple[int, str, str, float]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["request_id", "node", "event", "t_s"])


def _passes(rows: list[tuple[str, float, float]]) -> pd.DataFrame:
    return pd.DataFrame(rows, columns=["node", "start_s", "duration_s"])


def test_idle_hops_are_the_messages_a_server_took_between_its_passes() -> None:
    hops = _hops(
        [
            (2, "driver", "sent", 3.0),  # disaggregated: two hops, both between passes
            (2, "decode0", "received", 3.0008),
            (2, "decode0", "handed_off", 3.001),
            (2, "prefill0", "received", 3.0016),
            (2, "prefill0", "pages", 3.0017),  # not a send
            (0, "driver", "sent", 1.0),  # between colocated0's passes
            (0, "colocated0", "received", 1.0007),
            (1, "driver", "sent", 2.0),  # taken at the end of the pass it met
            (1, "colocated0", "received", 2.05),
            (3, "driver", "sent", 4.0),  # a pass began before it was taken
            (3, "colocated0", "received", 4.003),
        ]
    )
    steps = _passes(
        [
            ("colocated0", 0.5, 0.4),
            ("colocated0", 1.001, 0.049),
            ("colocated0", 1.99, 0.059),
            ("colocated0", 4.001, 0.001),
            ("decode0", 2.5, 0.4),
            ("prefill0", 3.5, 0.1),
        ]
    )
    assert sorted(idle_hops(hops, steps)) == pytest.approx([0.0006, 0.0007, 0.0008])


def test_the_control_hop_is_the_median_of_the_runs_idle_hops(tmp_path: Path) -> None:
    runs = []
    for k, took in enumerate([(0.5e-3, 0.6e-3, 0.7e-3), (0.9e-3, 1.1e-3, 2e-3)]):
        hops = [
            (i, n, e, t)
            for i, d in enumerate(took)
            for n, e, t in [("driver", "sent", float(i)), ("colocated0", "received", i + d)]
        ]
        runs.append(tmp_path / f"run{k}")
        runs[-1].mkdir()
        _hops(hops).to_parquet(runs[-1] / "hops.parquet")
        _passes([("colocated0", i + 0.5, 0.1) for i in range(3)]).to_parquet(
            runs[-1] / "steps.parquet"
        )
    assert control_hop(runs) == (pytest.approx(0.8e-3), 6)
    assert control_hop(runs[:1]) is None  # three hops: too few to say
    assert control_hop([tmp_path / "none"]) is None  # no hops table (an older run)


def test_loop_costs_fit_a_mixed_pass_its_own_line_over_its_decodes_by_hand() -> None:
    """Decode passes: host 1 ms + 0.1 ms a sequence; passes with a chunk (alone, and beside
    2, 4 and 8 decodes) 2 ms + 0.3 ms a decode; each followed by a gap of 0.4 ms. A mixed
    pass's line: 2.4 ms + 0.3 ms a decode. A pass with a chunk's fixed part is as without
    it: the median of its loop time less 0.1 ms a sequence (2.3, 2.7, 3.1 and 3.9 ms)."""
    shapes = [(1, 1), (2, 2), (3, 2), (4, 4), (5, 4), (1, 0), (9, 8), (8, 8), (2, 2)]  # (batch,
    # decodes): a pass with a chunk where the batch holds more than its decodes
    host = [2e-3 + 3e-4 * d if b > d else 1e-3 + 1e-4 * b for b, d in shapes]
    device = [0.01 + 0.001 * k for k in range(len(shapes))]
    duration = [d + h for d, h in zip(device, host, strict=True)]
    starts = np.cumsum([0.0, *(d + 4e-4 for d in duration[:-1])])
    steps = pd.DataFrame(
        {
            "node": "colocated0",
            "start_s": starts,
            "duration_s": duration,
            "device_s": device,
            "batch_size": [b for b, _ in shapes],
            "decode_seqs": [d for _, d in shapes],
            "prefill_tokens": [500 * (b - d) for b, d in shapes],
        }
    )
    assert loop_costs([steps]) == {
        "profile_pass_overhead_s": 0.0,
        "profile_host_s": pytest.approx(1.4e-3),
        "profile_host_per_seq_s": pytest.approx(1e-4),
        "profile_host_chunk_s": pytest.approx(2.9e-3),
        "profile_host_mixed_s": pytest.approx(2.4e-3),
        "profile_host_mixed_per_seq_s": pytest.approx(3e-4),
    }
    # fewer than `least` mixed passes: a pass with a chunk's fixed part alone
    assert "profile_host_mixed_s" not in loop_costs([steps], least=4)


def test_loop_costs_fit_host_time_and_the_gap_after_each_pass_by_hand(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Decode passes: host 1 ms + 0.1 ms per sequence; chunk passes: 3 ms + 0.1 per sequence;
    the gap to the next pass 0.4 ms + 0.01 ms per sequence, but 5 ms once (the loop waited for
    work). Loop time, the host's and the gap's: 1.4 ms + 0.11 ms per sequence a decode pass,
    3.4 ms + 0.11 per sequence a chunk pass. `own_host` fits the same on runs' directories;
    without device times (the CPU) the median gap is the only cost."""
    batch = [1, 2, 4, 8, 3, 2, 5]
    prefill = [0, 0, 0, 0, 500, 0, 0]
    host = [(3e-3 if p else 1e-3) + 1e-4 * b for b, p in zip(batch, prefill, strict=True)]
    gaps = [4e-4 + 1e-5 * b for b in batch]
    gaps[2] = 5e-3  # idle: beyond BUSY_GAP_S, its pass is not fitted
    device = [0.01, 0.02, 0.03, 0.04, 0.05, 0.02, 0.03]
    duration = [d + h for d, h in zip(device, host, strict=True)]
    start, starts = 0.0, []
    for d, gap in zip(duration, gaps, strict=True):
        starts.append(start)
        start += d + gap
    steps = pd.DataFrame(
        {
            "node": "colocated0",
            "start_s": starts,
            "duration_s": duration,
            "device_s": device,
            "batch_size": batch,
            "decode_seqs": [b - (p > 0) for b, p in zip(batch, prefill, strict=True)],
            "prefill_tokens": prefill,
        }
    )
    # two runs, each on its own clock from 0: no gap between them (the first one's last pass,
    # of batch 8, has no next pass and is not fitted either)
    first, second = steps.iloc[:4], steps.iloc[4:].assign(start_s=lambda d: d.start_s - 1.0)
    costs = loop_costs([first, second])
    fitted = {
        "profile_pass_overhead_s": 0.0,
        "profile_host_s": pytest.approx(1.4e-3),
        "profile_host_chunk_s": pytest.approx(3.4e-3),
        "profile_host_per_seq_s": pytest.approx(1.1e-4),
    }
    assert costs == fitted
    cpu = steps.assign(device_s=math.nan)
    # the median of the six gaps: 0.41, 0.42, 0.42, 0.43, 0.48 and 5 ms
    assert loop_costs([cpu]) == {"profile_pass_overhead_s": pytest.approx(4.25e-4)}
    dirs = [tmp_path / "run", tmp_path / "run-2", tmp_path / "cpu"]
    for where, table in zip(dirs, [first, second, cpu], strict=True):
        where.mkdir()
        table.to_parquet(where / "steps.parquet")
    assert own_host(dirs[:2]) == {}  # three decode passes fitted: too few of their own
    monkeypatch.setattr(validate, "MIN_OWN_PASSES", 3)
    assert own_host(dirs[:2]) == costs
    assert own_host(dirs[2:]) == {}
    # runs that say when each forward was launched: the median part of the loop time before
    # it (0.2, 0.25, 0.5, 0.6 and 0.9 of the fitted passes' loop time; NaN: not measured)
    loop = [t - d + g for t, d, g in zip(duration, device, gaps, strict=True)]
    share = [0.2, 0.25, 0.9, 0.9, 0.5, 0.6, 0.9]  # the third and last passes are not fitted
    timed = steps.assign(host_before_s=[x * t for x, t in zip(share, loop, strict=True)])
    assert loop_costs([timed])["profile_host_before"] == pytest.approx(0.5)
    assert "profile_host_before" not in loop_costs([timed.assign(host_before_s=math.nan)])
    # chained passes (hw.latency.chain) are not fitted with the rest: their host time ran
    # before them, and a decode pass of 5 ms more loop time would move the line (one chained
    # pass is too few for a line of their own)
    chained = second.assign(chained=[0, 1, 0])
    chained.loc[5, "device_s"] = device[5] - 5e-3
    assert loop_costs([first.assign(chained=0), chained]) == fitted
    assert loop_costs([first, chained.assign(chained=0)]) != fitted


def test_loop_costs_fit_the_chained_passes_apart_by_hand() -> None:
    """Three decode passes launched after the pass before was read, 1 ms of host time + 0.1
    ms a sequence each, then five chained ones (hw.latency.chain), back to back, of 0.05 ms +
    0.001 ms a sequence beyond their device time (the last, with no pass after it, is not
    fitted): a line each."""
    batch = [1, 2, 3, 1, 2, 4, 8, 8]
    chained = [0, 0, 0, 1, 1, 1, 1, 1]
    pairs = zip(batch, chained, strict=True)
    loop = [(5e-5 + 1e-6 * b) if c else (1e-3 + 1e-4 * b) for b, c in pairs]
    device = [0.01 + 1e-3 * b for b in batch]
    duration = [d + x for d, x in zip(device, loop, strict=True)]
    steps = pd.DataFrame(
        {
            "node": "decode0",
            "start_s": np.concatenate([[0.0], np.cumsum(duration)[:-1]]),
            "duration_s": duration,
            "device_s": device,
            "batch_size": batch,
            "decode_seqs": batch,
            "prefill_tokens": 0,
            "chained": chained,
        }
    )
    costs = loop_costs([steps])
    assert costs["profile_host_s"] == pytest.approx(1e-3)
    assert costs["profile_host_per_seq_s"] == pytest.approx(1e-4)
    assert costs["profile_chain_s"] == pytest.approx(5e-5)
    assert costs["profile_chain_per_seq_s"] == pytest.approx(1e-6)
    assert "profile_chain_s" not in loop_costs([steps.assign(chained=0)])


def test_own_host_on_a_shared_gpu_fits_the_passes_that_met_no_other_nodes(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A decode server beside a prefill server on one GPU: its passes alone take 1 ms of host
    time + 0.1 ms a sequence; those beside a prefill pass wait 6 ms more for the GPU outside
    their device events, which a fit over every pass takes for host time. `own_host` of a run
    whose experiment says the GPU was shared fits the passes alone; the prefill server's chunk
    passes all met a decode pass, so its fit leaves the chunk's host time to the calibration."""
    batch = [1, 2, 3, 4, 5, 6, 7, 8]
    beside = [False, False, True, True, False, True, False, False]
    device = 5e-3
    starts, start, wall = [], 0.0, []
    for b, met in zip(batch, beside, strict=True):
        wall.append(device + 1e-3 + 1e-4 * b + (6e-3 if met else 0.0))
        starts.append(start)
        start += wall[-1] + 2e-4  # the next pass 0.2 ms after
    decode = pd.DataFrame(
        {"node": "decode0", "start_s": starts, "duration_s": wall, "device_s": device}
    ).assign(batch_size=batch, decode_seqs=batch, prefill_tokens=0)
    # one prefill pass over the third and fourth decode passes (and the gap between them)
    first, last = starts[2] + 1e-3, starts[3] + wall[3] - 1e-3
    prefill = pd.DataFrame(
        {"node": "prefill0", "start_s": [first], "duration_s": [last - first]}
    ).assign(device_s=0.9 * (last - first), batch_size=1, decode_seqs=0, prefill_tokens=2048)
    # the sixth decode pass meets a prefill pass too
    more = prefill.assign(start_s=starts[5] + 1e-3, duration_s=wall[5] - 2e-3)
    steps = pd.concat([decode, prefill, more], ignore_index=True)
    run = tmp_path / "disagg"
    run.mkdir()
    steps.to_parquet(run / "steps.parquet")
    monkeypatch.setattr(validate, "MIN_OWN_PASSES", 4)  # the 4 alone with a pass after them
    pooled = own_host([run])  # no experiment.json: not known to share a GPU
    assert pooled["profile_host_s"] > 2e-3
    (run / "experiment.json").write_text(json.dumps({"cluster": {"shared_gpu": True}}))
    assert own_host([run]) == {
        "profile_pass_overhead_s": 0.0,
        "profile_host_s": pytest.approx(1.2e-3),  # 1 ms + the 0.2 ms gap
        "profile_host_per_seq_s": pytest.approx(1e-4),
    }
    (run / "experiment.json").write_text(json.dumps({"cluster": {"shared_gpu": False}}))
    assert own_host([run]) == pooled
    monkeypatch.setattr(validate, "MIN_OWN_PASSES", 5)  # one more than those 4
    (run / "experiment.json").write_text(json.dumps({"cluster": {"shared_gpu": True}}))
    assert own_host([run]) == {}


def test_the_loop_costs_of_repeated_calibration_runs_are_the_median_of_their_fits(
    tmp_path: Path,
) -> None:
    """Three repeats of a calibration at two loads (`loop_runs`: RATErps, then RATErps-k), the
    second repeat's server processes twice as slow on the host: each cost is the median of
    the three repeats' fits, the first's and third's, not a fit pooled over all six runs. The
    calibration's colocated runs are found by repeat (`calibration_runs`, `by_repeat`) among
    its other directories; a fourth repeat cut short, one run finished and one without its
    summary, is left out of the repeats."""
    from disagg.validate import (
        by_repeat,
        calibration_runs,
        loop_repeat,
        loop_runs,
        repeat_loop_costs,
    )

    def run(batches: list[int], slow: float) -> pd.DataFrame:
        host = [slow * (1e-3 + 1e-4 * b) for b in batch_list(batches)]
        device = [0.01] * len(host)
        starts = np.cumsum([0.0, *[d + h + 4e-4 for d, h in zip(device, host, strict=True)]])
        return pd.DataFrame(
            {
                "node": "colocated0",
                "start_s": starts[:-1],
                "duration_s": [d + h for d, h in zip(device, host, strict=True)],
                "device_s": device,
                "batch_size": batch_list(batches),
                "decode_seqs": batch_list(batches),
                "prefill_tokens": 0,
            }
        )

    def batch_list(batches: list[int]) -> list[int]:
        return [b for b in batches for _ in range(3)]

    cal = tmp_path / "calibration"
    repeats = loop_runs(cal, [2.5, 10.0], 3)
    assert [[d.name for d in dirs] for dirs in repeats] == [
        ["2.5rps", "10rps"],
        ["2.5rps-2", "10rps-2"],
        ["2.5rps-3", "10rps-3"],
    ]
    cut = loop_runs(cal, [2.5, 10.0], 4)[3]
    for k, dirs in enumerate([*repeats, cut], 1):
        for where, batches in zip(dirs, ([1, 2, 4], [8, 16, 32]), strict=True):
            where.mkdir(parents=True)
            run(batches, 2.0 if k == 2 else 1.0).to_parquet(where / "steps.parquet")
            if where != cut[1]:
                (where / "summary.json").write_text("{}")
    for other in ("disagg-10rps", "weights", "round-robin"):
        (cal / other).mkdir()
    _, alone = calibration_runs(cal)
    finished = [*(d for dirs in repeats for d in dirs), cut[0]]
    assert sorted(d.name for d in alone) == sorted(d.name for d in finished)
    assert by_repeat(alone) == [sorted(dirs) for dirs in repeats]
    assert [loop_repeat(n) for n in ("10rps", "10rps-3", "disagg-10rps", "weights")] == [
        1,
        3,
        None,
        None,
    ]
    costs = repeat_loop_costs(by_repeat(alone))
    fast = loop_costs([pd.read_parquet(d / "steps.parquet") for d in repeats[0]])
    assert costs == {k: pytest.approx(v) for k, v in fast.items()}
    assert costs["profile_host_per_seq_s"] == pytest.approx(1e-4)
    assert costs["profile_host_s"] == pytest.approx(1.4e-3)  # 1 ms host + the 0.4 ms gap
    pooled = loop_costs([pd.read_parquet(d / "steps.parquet") for d in alone])
    assert pooled["profile_host_per_seq_s"] > 1.2e-4  # the slow repeat pulls a pooled fit


def test_passes_compare_each_range_of_chunk_tokens_and_of_batch_with_the_replay() -> None:
    """Eight chunk passes of 100-800 tokens in four ranges of two: the run's device time is the
    replay's + 10 ms in the smallest range, + 5 / 0 / -3 ms in the others (the replay's passes
    of a range need not be the run's); host time 2 ms on the run, 1 on the replay, and on the
    run a gap of 0.5 ms to the next pass (loop time 2.5 ms), but 10 ms after its second decode
    pass (the loop waited: 2 ms) and none after its last. Two decode passes of batch 4 and
    one of batch 8: ranges of one batch size each."""
    tokens = [100, 200, 300, 400, 500, 600, 700, 800]
    beyond = [0.01, 0.01, 0.005, 0.005, 0.0, 0.0, -0.003, -0.003]
    replayed = [0.02 + 1e-5 * n for n in tokens]
    device = [r + b for r, b in zip(replayed, beyond, strict=True)] + [0.006, 0.007, 0.009]
    duration = [d + 0.002 for d in device]
    gaps = [5e-4] * 9 + [0.01, 0.0]
    hw = pd.DataFrame(
        {
            "node": "colocated0",
            "start_s": np.cumsum([0.0, *(d + g for d, g in zip(duration, gaps, strict=True))])[:-1],
            "prefill_tokens": [*tokens, 0, 0, 0],
            "batch_size": [1] * 8 + [4, 4, 8],
            "device_s": device,
            "duration_s": duration,
        }
    )
    sim_device = [*replayed[::-1], 0.0065, 0.0085]
    sim_duration = [d + 0.001 for d in sim_device]
    sim = pd.DataFrame(
        {
            "node": "colocated0",
            "start_s": np.cumsum([0.0, *sim_duration])[:-1],
            "prefill_tokens": [*tokens[::-1], 0, 0],
            "batch_size": [1] * 8 + [4, 8],
            "device_s": sim_device,
            "duration_s": sim_duration,
        }
    )
    t = pass_table(hw, sim)
    assert list(t.columns) == PASS_COLUMNS
    chunk, decode = t[t.kind == "chunk"], t[t.kind == "decode"]
    # ranges [100, 275), [275, 450), [450, 625), [625, 800]: medians of each side's passes
    assert list(chunk["size"]) == [150, 350, 550, 750]
    assert list(chunk.hw_n) == list(chunk.sim_n) == [2, 2, 2, 2]
    assert list(chunk.hw_device_s - chunk.sim_device_s) == pytest.approx([0.01, 0.005, 0, -0.003])
    assert list(chunk.hw_loop_s) == pytest.approx([0.0025] * 4)
    assert list(chunk.sim_loop_s) == pytest.approx([0.001] * 4)
    # batch quantiles 4, 4, 4, 6, 8: ranges [4, 6) and [6, 8]
    assert list(decode["size"]) == [4, 8] and list(decode.hw_n) == [2, 1]
    assert list(decode.hw_loop_s) == pytest.approx([0.00225, 0.002])
    assert list(decode.hw_device_s) == pytest.approx([0.0065, 0.009])
    assert list(decode.sim_device_s) == pytest.approx([0.0065, 0.0085])
    assert chunk_offsets(hw, sim) == [
        [150, pytest.approx(0.01)],
        [350, pytest.approx(0.005)],
        [550, pytest.approx(0.0)],
        [750, pytest.approx(-0.003)],
    ]
    # two runs' tables one after the other (each on its own clock, the index of each): the same
    assert chunk_offsets(pd.concat([hw, hw]), pd.concat([sim, sim])) == chunk_offsets(hw, sim)
    assert chunk_offsets(hw.assign(device_s=math.nan), sim) == []  # the CPU: no device times
    assert pass_table(hw.assign(device_s=math.nan), sim).empty


def test_since_chunk_is_the_time_since_the_nodes_last_chunk_pass_ended() -> None:
    """Two nodes' passes interleaved: each pass's time since its own node's last pass with a
    prompt chunk ended (inf before the first), a chunk pass's since the one before it."""
    steps = pd.DataFrame(
        {
            "node": ["colocated0", "colocated1", "colocated0", "colocated1", "colocated0"],
            "start_s": [1.0, 0.0, 1.05, 0.3, 1.08],
            "duration_s": [0.04, 0.2, 0.02, 0.01, 0.01],
            "prefill_tokens": [100, 0, 0, 50, 200],
        },
        index=[10, 11, 12, 13, 14],
    )
    since = since_chunk(steps)
    assert list(since.index) == [10, 11, 12, 13, 14]
    assert since.to_list() == pytest.approx([math.inf, math.inf, 0.01, math.inf, 0.04])


def test_after_chunk_is_each_range_of_time_against_the_passes_long_after(tmp_path: Path) -> None:
    """Twenty chunk passes, each followed by decode passes every 10 ms for 300 ms (from 1 ms
    after it) whose device
    time is the profile's at their shape x 1.01 x (1 + f), f falling from +3% as the chunk
    pass ends to 0 at 200 ms: per range of the time since, f at the median time, and 0 at
    200 ms (the passes from 200 ms on ran 1.01 x the profile: the reference, so the 1% is not
    the lift's). A decode node's passes, and a pass of several, are not read; the CPU (no
    device times) and too few passes long after fit none."""
    from disagg.sim.costmodel import StepShape, make_cost_model

    rows = [f"prefill,{n},1,0,{0.01 + n * 1e-5},0.001" for n in (100, 1000)]
    rows += [
        f"decode,{b},{b},{c},{0.005 + b * c * 1e-8},0.001" for b in (1, 8) for c in (100, 3000)
    ]
    csv = tmp_path / "profile.csv"
    csv.write_text("\n".join(["kind,tokens,batch,context,duration_s,host_s", *rows]) + "\n")
    exp = load_experiment(EXPERIMENTS / "llama8b-h200.toml", [f"cost.source=profile:{csv}"])
    cost = make_cost_model(exp, exp.cluster.colocated, "colocated")

    def lift(s: float) -> float:
        return 0.03 * max(0.0, 1 - s / 0.2)

    table = []
    for k in range(20):
        t0 = k * 1.0
        table.append(("colocated0", t0, 0.05, 1, 500, 0, 0.0, math.nan))
        for i in range(30):
            batch, context = 1 + i % 8, 500.0 * (1 + i % 8)
            shaped = cost.step_time(StepShape(0, 0.0, batch, context)) - cost.host_s(False, batch)
            since = 0.001 + 0.01 * i
            device = shaped * 1.01 * (1 + lift(since))
            table.append(("colocated0", t0 + 0.05 + since, 0.009, 1, 0, batch, context, device))
        table.append(("decode0", t0 + 0.06, 0.009, 1, 0, 4, 2000.0, 1.0))  # another kind of node
        table.append(("colocated0", t0 + 0.55, 0.02, 2, 0, 4, 2000.0, 1.0))  # two passes
    columns = ["node", "start_s", "duration_s", "steps", "prefill_tokens", "decode_seqs"]
    steps = pd.DataFrame(table, columns=[*columns, "decode_context", "device_s"])
    steps = steps.assign(batch_size=steps.decode_seqs, prefill_attn_pairs=0.0)
    times = [0.001, 0.011, 0.021, 0.031, 0.046, 0.066, 0.096, 0.156]
    fitted = after_chunk([steps], exp)
    assert [t for t, _ in fitted] == pytest.approx([*times, 0.2])
    assert [f for _, f in fitted] == pytest.approx([*map(lift, times), 0.0])
    # two runs, each on its own clock: as one (read together, their passes would interleave)
    again = after_chunk([steps, steps.assign(start_s=steps.start_s + 0.005)], exp)
    assert np.ravel(again).tolist() == pytest.approx(np.ravel(fitted).tolist())
    assert after_chunk([steps.assign(device_s=math.nan)], exp) == []  # the CPU
    assert after_chunk([steps[steps.start_s % 1.0 < 0.24]], exp) == []  # 19 passes long after


def test_graph_scales_are_the_passes_long_after_a_chunk_pass_by_their_batch(
    tmp_path: Path,
) -> None:
    """A profile of decode graphs of 1, 8 and 32: their batches in ranges (0, 1]; the graph of
    8's in quarters (1, 2], (2, 4], (4, 6], (6, 8]; the graph of 32's (8, 14], ..., (26, 32].
    Passes 250 ms or more after a chunk pass: 40 of 5-6 sequences at the profile's time at
    their shape, 40 of 17-20 at 1.06 or 1.08 x it alternately, 40 of 27-30 at 1.02 x, 10 of
    one sequence (too few). Passes soon after the chunk pass ran twice as long and are not
    read. So (5.5, 1.0), (18.5, 1.07), (28.5, 1.02). The CPU (no device times) fits none."""
    from disagg.sim.costmodel import StepShape, make_cost_model

    assert graph_ranges([1, 8, 32]) == [
        *((0, 1), (1, 2), (2, 4), (4, 6), (6, 8)),
        *((8, 14), (14, 20), (20, 26), (26, 32)),
    ]
    rows = ["prefill,512,1,0,0.01,0.001,0"]
    rows += [
        f"decode,{b},{b},{c},{0.005 + b * c * 1e-8},0.001,{b}"
        for b in (1, 8, 32)
        for c in (100, 3000)
    ]
    csv = tmp_path / "profile.csv"
    header = "kind,tokens,batch,context,duration_s,host_s,graph_batch"
    csv.write_text("\n".join([header, *rows]) + "\n")
    exp = load_experiment(EXPERIMENTS / "llama8b-h200.toml", [f"cost.source=profile:{csv}"])
    cost = make_cost_model(exp, exp.cluster.colocated, "colocated")
    table = [("colocated0", 0.0, 0.05, 500, 0, 0.0, math.nan)]
    passes = [(5 + i % 2, 1.0) for i in range(40)] + [(1, 1.0)] * 10
    passes += [(17 + i % 4, 1.06 if i % 2 else 1.08) for i in range(40)]
    passes += [(27 + i % 4, 1.02) for i in range(40)]
    for i, (batch, factor) in enumerate(passes):
        context = 1000.0 * batch
        shaped = cost.step_time(StepShape(0, 0.0, batch, context)) - cost.host_s(False, batch)
        table.append(("colocated0", 0.3 + 0.02 * i, 0.01, 0, batch, context, shaped * factor))
        table.append(("colocated0", 0.06 + i * 1e-5, 1e-6, 0, 5, 5000.0, 1.0))  # soon after
    columns = ["node", "start_s", "duration_s", "prefill_tokens", "decode_seqs"]
    steps = pd.DataFrame(table, columns=[*columns, "decode_context", "device_s"])
    steps = steps.assign(batch_size=steps.decode_seqs, prefill_attn_pairs=0.0, steps=1)
    assert np.ravel(graph_scales([steps], exp)).tolist() == pytest.approx(
        [5.5, 1.0, 18.5, 1.07, 28.5, 1.02]
    )
    assert graph_scales([steps.assign(device_s=math.nan)], exp) == []


def test_pass_offsets_set_each_pass_against_the_profile_at_its_own_shape(tmp_path: Path) -> None:
    """Eight chunk passes of 100-800 tokens in four ranges of two, each after some cached
    context and beside some decodes (their shapes in the steps table), took the profile's
    device time for that shape + 10 / 5 / 0 / -3 ms: those are the offsets. The profile's
    chunks cost more after context, so a fit that read every chunk at no context (or without
    its decodes) would find others; a table without shapes has none to fit."""
    from disagg.core.scheduler import chunk_attn_pairs
    from disagg.sim.costmodel import StepShape, make_cost_model

    rows = [
        f"prefill,{n},1,{c},{0.01 + n * 1e-5 + c * 4e-6},0.001"
        for n in (100, 1000)
        for c in (0, 2000)
    ]
    rows += [
        f"decode,{b},{b},{c},{0.005 + b * c * 1e-8},0.001" for b in (1, 8) for c in (100, 3000)
    ]
    csv = tmp_path / "profile.csv"
    csv.write_text("\n".join(["kind,tokens,batch,context,duration_s,host_s", *rows]) + "\n")
    host = ["cost.profile_host_s=0.001", "cost.profile_host_chunk_s=0.002"]
    host += ["cost.profile_host_per_seq_s=0.0001"]
    host += ["hw.latency.prefill_graphs=[]"]  # each chunk at its own tokens, not its piece's
    exp = load_experiment(EXPERIMENTS / "llama8b-h200.toml", [f"cost.source=profile:{csv}", *host])
    cost = make_cost_model(exp, exp.cluster.colocated, "colocated")
    tokens = [100, 200, 300, 400, 500, 600, 700, 800]
    start = [0, 1500, 0, 900, 2000, 0, 300, 1000]
    decodes = [0, 3, 1, 0, 5, 2, 0, 4]
    context = [0.0, 3000.0, 400.0, 0.0, 9000.0, 2500.0, 0.0, 6000.0]
    beyond = [0.01, 0.01, 0.005, 0.005, 0.0, 0.0, -0.003, -0.003]
    pairs = [chunk_attn_pairs(c, n) for c, n in zip(start, tokens, strict=True)]
    shapes = [StepShape(*x) for x in zip(tokens, pairs, decodes, context, strict=True)]
    device = [
        cost.step_time(x) - cost.host_s(True, d) + b
        for x, d, b in zip(shapes, decodes, beyond, strict=True)
    ]
    steps = pd.DataFrame(
        {
            "node": "colocated0",
            "steps": 1,
            "prefill_tokens": [*tokens, 0],
            "decode_seqs": [*decodes, 4],
            "device_s": [*device, 0.006],
            "prefill_attn_pairs": [*pairs, 0.0],
            "decode_context": [*context, 800.0],
        }
    )
    assert has_shapes(steps)
    assert pass_offsets(steps, exp) == [
        [150, pytest.approx(0.01)],
        [350, pytest.approx(0.005)],
        [550, pytest.approx(0.0, abs=1e-12)],
        [750, pytest.approx(-0.003)],
    ]
    unread = steps.assign(prefill_attn_pairs=[chunk_attn_pairs(0, n) for n in [*tokens, 0]])
    assert pass_offsets(unread, exp) != pass_offsets(steps, exp)
    assert pass_offsets(steps.assign(device_s=math.nan), exp) == []  # the CPU
    # in pieces of 256, 512 and 1024 tokens each pass is read at the chunk it is costed at,
    # its piece less its decodes: 253, 256 | 507, 511 | 512, 1020 | 1022, 1024 by range
    pieces = exp.updated("hw.latency.prefill_graphs=[256,512,1024]")
    assert [n for n, _ in pass_offsets(steps, pieces)] == [254.5, 509.0, 766.0, 1023.0]
    assert not has_shapes(steps.drop(columns="decode_context"))
    assert not has_shapes(steps.assign(prefill_attn_pairs=math.nan))


@pytest.mark.parametrize("mode", ["colocated", "disagg"])
def test_a_runs_passes_at_their_own_shapes_take_the_profiles_time(
    mode: str, tmp_path: Path
) -> None:
    """A simulated run on the profile, read as a run to replay: each one-pass row's device
    time at its own shape (on its node's model: colocated, prefill or decode) is the device
    time the run gave it; a row of several passes has none, nor has a table without shapes.
    The pass table's medians by range are those of the rows."""
    from disagg.core.metrics import steps_table
    from disagg.sim.cluster import Sim

    rows = [
        f"prefill,{n},1,{c},{0.01 + n * 2e-5 + c * 4e-6},0" for n in (256, 2048) for c in (0, 2048)
    ]
    rows += [
        f"decode,{b},{b},{c},{0.005 + b * c * 1e-8},0" for b in (1, 8, 64) for c in (500, 3000)
    ]
    rows += [
        f"mixed,{n},{b},500,{0.02 + n * 2e-5 + b * 1e-4},0" for n in (256, 2048) for b in (1, 8)
    ]
    csv = tmp_path / "profile.csv"
    csv.write_text("\n".join(["kind,tokens,batch,context,duration_s,host_s", *rows]) + "\n")
    exp = load_experiment(
        EXPERIMENTS / "llama8b-h200.toml",
        [
            f"cost.source=profile:{csv}",
            "cost.profile_host_s=0.001",
            "cost.profile_decode_scale=0.97",
            "workload.num_requests=30",
        ],
    )
    exp = exp if exp.cluster.mode == mode else other_mode(exp)
    sim = Sim(exp)
    sim.run()
    steps = steps_table(sim.rec)
    got = shape_device(steps, exp)
    one = steps.steps == 1
    assert set(steps.node.str.rstrip("0123456789")) == (
        {"colocated"} if mode == "colocated" else {"prefill", "decode"}
    )
    assert got[one].to_numpy() == pytest.approx(steps.device_s[one].to_numpy(), rel=1e-9)
    assert got[~one].isna().all() and (~one).any()
    assert shape_device(steps.drop(columns="decode_context"), exp).isna().all()
    t = pass_table(steps.assign(shape_device_s=got)[one], steps)  # as a hw run's: a pass a row
    assert list(t.shape_device_s) == pytest.approx(list(t.hw_device_s), rel=1e-9)
    assert pass_table(steps, steps).shape_device_s.isna().all()
    assert pass_table(steps, steps).hw_before_s.isna().all()  # the simulator does not split it
    before = np.where(steps.prefill_tokens > 0, 0.003, 0.001)  # a chunk pass's, a decode's
    t = pass_table(steps.assign(host_before_s=before)[one], steps)
    assert list(t.hw_before_s) == [0.003 if k == "chunk" else 0.001 for k in t.kind]
    png = plot_passes({"run": steps.assign(shape_device_s=got)}, tmp_path / "passes.png")
    assert png == tmp_path / "passes.png" and png.read_bytes()[:4] == b"\x89PNG"
    cpu = steps.assign(shape_device_s=got, device_s=math.nan)  # no device times: no picture
    assert plot_passes({"run": cpu, "old": steps}, tmp_path / "none.png") is None
    assert not (tmp_path / "none.png").exists()


def test_log_grid_keeps_both_ends_without_repeats() -> None:
    assert log_grid(1, 16, 3) == (1, 4, 16)
    assert log_grid(1, 2, 5) == (1, 2)
    assert log_grid(30, 30, 3) == (30,)
    assert log_grid(1, 64, 1) == (64,)


def test_the_plan_runs_each_mode_at_each_load_on_a_grid_the_workload_reaches() -> None:
    disagg = load_experiment(TINY, ["workload.num_requests=4"])
    coloc = other_mode(disagg)
    assert coloc.cluster.mode == "colocated" and coloc.name == "tiny-disagg-colocated"
    assert coloc.cluster.colocated.token_budget == 64 and coloc.cluster.colocated.max_batch == 16
    back = other_mode(coloc).cluster
    assert (back.mode, back.prefill.token_budget, back.decode.max_batch) == ("disagg", 64, 16)
    runs = plan_runs([disagg, coloc], [2.0, 7.5])
    assert [r.label for r in runs] == [
        "disagg-2rps",
        "disagg-7.5rps",
        "colocated-2rps",
        "colocated-7.5rps",
    ]
    assert [r.exp.workload.rate_per_s for r in runs] == [2.0, 7.5, 2.0, 7.5]
    with pytest.raises(ConfigError, match="experiments share a name"):
        plan_runs([disagg, disagg.updated("seed=3")], [1.0])
    from disagg.core.workload import generate

    arrivals = generate(disagg.workload, disagg.seed)
    prompts = [a.prompt_tokens for a in arrivals]
    grid = profile_grid([disagg, coloc], 3)
    assert grid.prefill_tokens == log_grid(min(prompts), min(64, max(prompts)), 3)
    last = 64 * ((max(prompts) - 1) // 64)  # the longest prompt's last chunk, after its others
    assert grid.prefill_context == ((0, last) if last else (0,))
    assert grid.decode_batch == (1, 2, 4)  # at most the 4 requests
    assert grid.decode_context == (min(prompts),)
    # while it decodes a request passes through its prompt plus 0, 1/4, 1/2, 3/4 of its output
    both = [*arrivals, *generate(coloc.workload, coloc.seed)]
    quarters = [a.prompt_tokens + a.output_tokens * q // 4 for a in both for q in range(4)]
    assert grid.decode_mix == tuple(sorted(quarters))
    assert grid.mixed == tuple(
        (n, b, min(prompts)) for n in grid.prefill_tokens for b in log_grid(1, 4, 3)
    )


def test_each_colocated_scheduler_asked_for_runs_as_a_kind_of_its_own() -> None:
    """--schedulers prefill_first,decode_priority: the colocated experiment once more under
    each, labelled by it; the chunked experiments' grid is kept, and prefill-first's whole
    prompts, longer than the 64-token budget, add prefill passes up to the longest."""
    disagg = load_experiment(TINY, ["workload.num_requests=6"])
    exps = with_schedulers([disagg], ["prefill_first", "decode_priority"])
    kinds = ["disagg", "colocated-prefill_first", "colocated-decode_priority"]
    assert [run_kind(e) for e in exps] == kinds
    assert [e.name for e in exps[1:]] == [
        "tiny-disagg-colocated-prefill_first",
        "tiny-disagg-colocated-decode_priority",
    ]
    policy = exps[2].cluster.colocated.scheduler
    assert policy is not None and policy.model_dump() == {
        "name": "decode_priority",
        "chunk_with_decodes": 256,
    }
    both = [disagg, other_mode(disagg)]
    assert with_schedulers(both, []) == both and run_kind(both[1]) == "colocated"
    labels = [r.label for r in plan_runs(with_schedulers(both, ["prefill_first"]), [5.0])]
    assert labels == ["disagg-5rps", "colocated-5rps", "colocated-prefill_first-5rps"]

    from disagg.core.workload import generate

    longest = max(a.prompt_tokens for a in generate(disagg.workload, disagg.seed))
    assert longest > 64
    chunked, whole = profile_grid(both, 3), profile_grid([*both, exps[1]], 3)
    assert whole.prefill_tokens == chunked.prefill_tokens + log_grid(64, longest, 3)[1:]
    assert (whole.prefill_context, whole.mixed) == (chunked.prefill_context, chunked.mixed)
    assert profile_grid([exps[2]], 3).prefill_tokens == profile_grid([both[1]], 3).prefill_tokens
    # decode priority's chunks of 20 beside decodes: a last chunk after more cached tokens
    short = both[1].updated(
        'cluster.colocated.scheduler={"name": "decode_priority", "chunk_with_decodes": 20}'
    )
    prompts = [a.prompt_tokens for a in generate(disagg.workload, disagg.seed)]
    after = {max(n * ((p - 1) // n) for p in prompts) for n in (64, 20)}
    assert profile_grid([short], 3).prefill_context == tuple(sorted({0, *after}))
    assert len(profile_grid([short], 3).prefill_context) == 3


@pytest.mark.parametrize(
    ("name", "said"),
    [
        (
            "fifo",
            "--schedulers 'fifo': cluster.colocated.scheduler.name: 'fifo' schedules "
            "prefill nodes, not colocated",
        ),
        ("nope", "--schedulers 'nope': unknown scheduler policy 'nope'; known: fifo"),
        ("chunked", "--schedulers 'chunked': a colocated run has that policy already"),
    ],
)
def test_a_scheduler_that_is_unknown_not_colocated_or_there_already_is_refused(
    name: str, said: str
) -> None:
    with pytest.raises(ConfigError, match=re.escape(said)):
        disagg = load_experiment(TINY)
        with_schedulers([disagg, other_mode(disagg)], [name])
    twice = "--schedulers 'prefill_first': a colocated run has that policy already"
    with pytest.raises(ConfigError, match=re.escape(twice)):
        with_schedulers([load_experiment(TINY)], ["prefill_first", "prefill_first"])


def test_a_scheduler_runs_at_the_settings_given_after_its_name() -> None:
    """decode_priority at its default and at chunk_with_decodes=8: two kinds, the second
    labelled with the setting it changes; the default given again is the first once more."""
    tiny = load_experiment(TINY, ["workload.num_requests=6"])
    texts = ["decode_priority", "decode_priority:chunk_with_decodes=8"]
    exps = with_schedulers([tiny], texts)
    policy = exps[2].cluster.colocated.scheduler
    assert policy is not None and policy.model_dump()["chunk_with_decodes"] == 8
    assert exps[2].name == "tiny-disagg-colocated-decode_priority.chunk_with_decodes=8"
    assert [r.label for r in plan_runs(exps, [5.0])] == [
        "disagg-5rps",
        "colocated-decode_priority-5rps",
        "colocated-decode_priority.chunk_with_decodes=8-5rps",
    ]
    # its chunks of 8 beside decodes: a last chunk after a multiple of 8 cached tokens
    from disagg.core.workload import generate

    prompts = [a.prompt_tokens for a in generate(tiny.workload, tiny.seed)]
    assert max(8 * ((p - 1) // 8) for p in prompts) in profile_grid([exps[2]], 3).prefill_context
    again = "--schedulers 'decode_priority:chunk_with_decodes=256': a colocated run has that"
    with pytest.raises(ConfigError, match=re.escape(again)):
        with_schedulers([tiny], ["decode_priority", "decode_priority:chunk_with_decodes=256"])


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("decode_priority:chunk_with_decodes=0", "chunk_with_decodes: Input should be greater"),
        ("decode_priority:chunk_with_decodes=many", "chunk_with_decodes: Input should be a valid"),
        ("decode_priority:chunk=8", "chunk: Extra inputs are not permitted"),
        ("prefill_first:chunk_with_decodes=8", "chunk_with_decodes: Extra inputs are not"),
        ("decode_priority:chunk_with_decodes", "'chunk_with_decodes': give each setting once"),
        ("decode_priority:name=chunked", "'name=chunked': give each setting once, as :KEY=VALUE"),
    ],
)
def test_a_bad_scheduler_setting_is_refused_by_name(text: str, said: str) -> None:
    with pytest.raises(
        ConfigError, match=re.escape(f"--schedulers {text!r}: ") + ".*" + re.escape(said)
    ):
        with_schedulers([load_experiment(TINY)], [text])


def test_decode_passes_are_profiled_at_every_power_of_two_of_the_batch(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A decode pass runs in the CUDA graph of the next power of two, so the decode axis gets
    1, 2, 4, 8, ... up to the batch limit (16) besides its log grid (1, 4, 16 at 3 points; 1,
    3, 6, 16 at 4). An MoE pass's time follows the experts its rows pick, padding rows too, so
    an MoE model's axis has every batch up to MOE_EVERY_BATCH as well. The mixed passes, which
    run eagerly, keep the log grid's batches, and an MoE model's the powers of two between its
    second point and the last (8 between 4 and 16)."""
    import disagg.validate_plan

    dense = load_experiment(TINY, ["workload.num_requests=40"])
    moe = dense.updated("model.name=tiny-moe")
    assert moe.model.spec.is_moe and not dense.model.spec.is_moe
    assert profile_grid([dense], 3).decode_batch == (1, 2, 4, 8, 16)
    assert profile_grid([moe], 3).decode_batch == tuple(range(1, 17))
    assert {b for _, b, _ in profile_grid([dense], 3).mixed} == {1, 4, 16}
    assert {b for _, b, _ in profile_grid([moe], 3).mixed} == {1, 4, 8, 16}
    assert profile_grid([dense], 4).decode_batch == (1, 2, 3, 4, 6, 8, 16)
    monkeypatch.setattr(disagg.validate_plan, "MOE_EVERY_BATCH", 5)
    assert profile_grid([moe], 3).decode_batch == (1, 2, 3, 4, 5, 8, 16)


def test_each_piece_up_to_the_largest_chunk_is_a_chunk_of_the_grid() -> None:
    """A pass replays the piece of the next size up (hw.latency.prefill_graphs), so each size
    up to the largest chunk is profiled as a chunk; the mixed passes keep the log grid's."""
    plain = load_experiment(TINY, ["workload.num_requests=40"])
    top = max(profile_grid([plain], 3).prefill_tokens)
    pieces = plain.updated(f"hw.latency.prefill_graphs=[8, 16, {top}, {2 * top}]")
    grid, log = profile_grid([pieces], 3), profile_grid([plain], 3)
    assert grid.prefill_tokens == tuple(sorted({8, 16, *log.prefill_tokens}))
    assert grid.mixed == log.mixed
    # prompts of 16-40 tokens in a budget of 64: a pass packs them up to 64, so the budget
    # is a chunk, and each piece up to the one that holds it (48 and 80, not 160)
    short = plain.updated('workload.prompt_tokens={"dist": "uniform", "low": 16, "high": 40}')
    assert max(profile_grid([short], 3).prefill_tokens) == 64
    assert max(log_grid(16, 40, 3)) == 40
    pieced = short.updated("hw.latency.prefill_graphs=[8, 48, 80, 160]")
    assert {8, 48, 64, 80} <= set(profile_grid([pieced], 3).prefill_tokens)
    assert 160 not in profile_grid([pieced], 3).prefill_tokens


def test_the_capacity_is_the_requests_one_server_keeps_up_with_by_the_profile(
    tmp_path: Path,
) -> None:
    """64-token prompts in one 64-token chunk (4 ms), 10 output tokens each in passes of the
    full batch of 4 (2 ms a pass, at any context): 4 + 10 * 2 / 4 = 9 ms a request."""
    csv = tmp_path / "p.csv"
    rows = ["kind,tokens,batch,context,duration_s", "prefill,16,1,0,0.001", "prefill,64,1,0,0.004"]
    rows += [f"decode,{b},{b},{c},0.002" for b in (1, 4) for c in (10, 100)]
    csv.write_text("\n".join(rows) + "\n")
    exp = load_experiment(
        TINY,
        [
            "workload.num_requests=4",
            'workload.prompt_tokens={"dist": "fixed", "value": 64}',
            'workload.output_tokens={"dist": "fixed", "value": 10}',
        ],
    )
    colocated = other_mode(exp)
    assert request_seconds(colocated, csv) == pytest.approx((0.004, 0.005), rel=1e-12)
    assert capacity_per_s(colocated, csv) == pytest.approx(1 / 0.009, rel=1e-12)


def _md_ratios(text: str) -> dict[str, list[tuple[float, float]]]:
    first = text.split("\n## ")[0]  # the main table's section, not the repeats'
    rows = [line for line in first.splitlines() if line.startswith("| ") and " / " in line]
    out = {}
    for line in rows:
        cells = [c.strip() for c in line.strip("|").split("|")]
        pairs = [c.split(" / ") for c in cells[1:]]
        out[cells[0]] = [(float(p), float(q)) for p, q in pairs]
    return out


def test_validate_on_this_cpu_writes_the_report_and_exits_by_the_tolerance(
    tmp_path: Path,
) -> None:
    """The tiny model, disaggregated and colocated, at two loads of four requests: every
    (run, metric) has its row, fidelity.md's ratios are sim/hw of the csv, the plots are there;
    a tolerance of 1000% is met (exit 0), one of 0.0001% is not (exit 1, each miss named)."""
    pytest.importorskip("torch")
    pytest.importorskip("zmq")
    from typer.testing import CliRunner

    from disagg.cli import app

    common = ["--requests", "4", "--grid-points", "2", "--set", "hw.wire=tcp"]
    out = tmp_path / "met"
    loose = "ttft_p50=1000,tpot_p50=1000,output_throughput=1000"
    res = CliRunner().invoke(
        app,
        [
            "validate",
            str(TINY),
            *common,
            "--rates",
            "20,60",
            "--out",
            str(out),
            "--tolerance",
            loose,
        ],
    )
    assert res.exit_code == 0, res.output
    for stage in (
        "profile: tiny-gqa",
        "hw run 4/4: colocated-60rps",
        "replay 4/4: colocated-60rps (roofline)",
    ):
        assert stage in res.output
    took = re.search(
        r"hw run 1/4: disagg-20rps took ([\d.]+) s, ([\d.]+) s of it to start", res.output
    )
    ran = json.loads((out / "hw" / "disagg-20rps" / "summary.json").read_text())
    assert took is not None and took[1] == f"{ran['wall_s']:.1f}"
    assert took[2] == f"{ran['startup_s']:.1f}" and 0 < ran["startup_s"] < ran["wall_s"]
    assert "shared GPU" not in res.output  # the CPU's servers share no GPU: no share measured
    assert "12 of 12 cells met" in res.output
    table = pd.read_csv(out / "fidelity.csv")
    labels = ["disagg-20rps", "disagg-60rps", "colocated-20rps", "colocated-60rps"]
    assert list(table.columns) == COLUMNS
    assert [(r, m) for r, m in zip(table.run, table.metric, strict=True)] == [
        (r, m) for r in labels for m in HW
    ]
    assert table[["hw", "sim_profile", "sim_roofline"]].notna().all().all()
    ratios = _md_ratios((out / "fidelity.md").read_text())
    assert list(ratios) == labels
    for run, g in table.groupby("run"):
        want = list(zip(g.sim_profile / g.hw, g.sim_roofline / g.hw, strict=True))
        assert ratios[run] == [
            (pytest.approx(p, rel=6e-4), pytest.approx(q, rel=6e-4)) for p, q in want
        ]
    # the colocated calibration runs are the colocated runs' twins, on seeds of their own:
    # each replayed on the profile, its sim/hw beside the run's
    assert "same mode and load, another seed: sim/hw moves by up to TTFT p50" in res.output
    repeats = pd.read_csv(out / "repeat.csv")
    assert list(dict.fromkeys(repeats.run)) == ["colocated-20rps", "colocated-60rps"]
    for run, g in repeats.groupby("run"):
        twin = out / "calibration" / run.removeprefix("colocated-")
        hw = json.loads((twin / "summary.json").read_text())
        sim = json.loads((out / "sim-repeat" / run / "summary.json").read_text())
        assert g.calibration.tolist() == pytest.approx([sim[m] / hw[m] for m in g.metric])
        mine = table[table.run == run].set_index("metric")
        assert g.validation.tolist() == pytest.approx(
            [mine.sim_profile[m] / mine.hw[m] for m in g.metric]
        )
        assert g.gap.tolist() == pytest.approx((g.calibration - g.validation).tolist())
    assert "## Same mode and load, another seed" in (out / "fidelity.md").read_text()
    # the pass-by-pass comparison: on the CPU no pass has a device time, so no rows
    assert list(pd.read_csv(out / "passes.csv").columns) == ["run", *PASS_COLUMNS]
    assert (out / "passes.md").read_text().startswith("# Passes: device time")
    for name in ("fidelity_ratios.png", "fidelity_cdfs.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        assert (out / name).stat().st_size > 10_000
    profiled = pd.read_csv(out / "profile.csv")
    assert set(profiled.kind) == {"prefill", "decode", "mixed"} and (profiled.duration_s > 0).all()
    ran = json.loads((out / "hw" / "colocated-20rps" / "experiment.json").read_text())
    assert ran["hardware"]["gpu"]["name"] == "cpu-measured"  # the replays' device
    replayed = json.loads((out / "sim-profile" / "disagg-60rps" / "experiment.json").read_text())
    assert replayed["cost"]["source"] == f"profile:{(out / 'profile.csv').resolve()}"
    # the profile replay's summary counts the passes it costed, and those beyond its grid
    costed = json.loads((out / "sim-profile" / "disagg-60rps" / "summary.json").read_text())
    assert 0 <= costed["profile_passes_extrapolated"] <= costed["profile_passes"]
    assert costed["profile_passes"] > 0
    roofline = json.loads((out / "sim-roofline" / "disagg-60rps" / "summary.json").read_text())
    assert roofline.get("profile_passes") is None
    # the serving loop's gap between passes, from colocated runs of their own workloads (the
    # next seeds) at the lowest and the highest load, goes into the profile replays
    loops = [out / "calibration" / f"{rate}rps" for rate in (20, 60)]
    for i, where in enumerate(loops, 1):
        calibrated = json.loads((where / "experiment.json").read_text())
        assert calibrated["cluster"]["mode"] == "colocated"
        assert calibrated["seed"] == ran["seed"] + i
        assert calibrated["workload"]["rate_per_s"] == (20, 60)[i - 1]
        assert len(pd.read_parquet(where / "requests.parquet")) == 4
    assert "serving loop (runs of their own at 20 and 60 req/s)" in res.output
    # the control plane's hop on these runs, where they took enough between passes, goes into
    # every replay (else the simulator's default)
    hop = control_hop(loops)
    for source in ("sim-profile", "sim-roofline"):
        took = json.loads((out / source / "disagg-60rps" / "experiment.json").read_text())
        assert took["transfer"]["control_latency_s"] == (1e-4 if hop is None else hop[0])
    assert ("control plane, on its runs: a request's message takes" in res.output) == bool(hop)
    loop = json.loads((out / "calibration" / "calibration.json").read_text())
    gaps = pd.concat([pass_gaps(pd.read_parquet(where / "steps.parquet")) for where in loops])
    # on the CPU passes have no device time: the gap only, the profile's host_s (0) kept
    assert loop == {"profile_pass_overhead_s": max(0.0, float(gaps.median()))}
    assert replayed["cost"]["profile_pass_overhead_s"] == loop["profile_pass_overhead_s"]
    assert replayed["cost"]["profile_host_s"] is None
    assert (
        json.loads((out / "sim-roofline" / "disagg-60rps" / "experiment.json").read_text())["cost"][
            "profile_pass_overhead_s"
        ]
        == 0
    )

    # --replay redoes the replays and the report from the directory alone: the same table
    res = CliRunner().invoke(app, ["validate", "--replay", "--out", str(out), "--tolerance", loose])
    assert res.exit_code == 0, res.output
    pd.testing.assert_frame_equal(pd.read_csv(out / "fidelity.csv"), table)
    # and so does a validate cut short before the loop's fit: its costs come from its runs
    fit = (out / "calibration" / "calibration.json").read_text()
    (out / "calibration" / "calibration.json").unlink()
    res = CliRunner().invoke(app, ["validate", "--replay", "--out", str(out), "--tolerance", loose])
    assert res.exit_code == 0, res.output
    assert "serving loop, on its runs: " in res.output
    pd.testing.assert_frame_equal(pd.read_csv(out / "fidelity.csv"), table)
    (out / "calibration" / "calibration.json").write_text(fit)
    # no decode share measured here; one measured on a GPU goes into every replay (which, its
    # servers not sharing one, simulate as before)
    assert not (out / "calibration" / "share.json").exists()
    shared = {"decode_share": 0.3, "prefill_share": 0.8, "other": 1}  # "other": not a share
    (out / "calibration" / "share.json").write_text(json.dumps(shared))
    res = CliRunner().invoke(app, ["validate", "--replay", "--out", str(out), "--tolerance", loose])
    assert res.exit_code == 0, res.output
    for source in ("sim-profile", "sim-roofline"):
        replayed = json.loads((out / source / "disagg-60rps" / "experiment.json").read_text())
        assert replayed["cluster"]["decode_share"] == 0.3
        assert replayed["cluster"]["prefill_share"] == 0.8
    pd.testing.assert_frame_equal(pd.read_csv(out / "fidelity.csv"), table)

    # --resume after a run cut short: the profile, the calibration and every hw run with its
    # summary are kept; the run without one is done again, and only it (with a weight cache
    # now, which changes no stage)
    before = json.loads((out / "hw" / "disagg-20rps" / "summary.json").read_text())
    (out / "hw" / "colocated-60rps" / "summary.json").unlink()
    again = ["validate", str(TINY), *common, "--rates", "20,60", "--out", str(out)]
    cache = tmp_path / "weights"
    res = CliRunner().invoke(app, [*again, "--resume"], env={"DISAGG_WEIGHT_CACHE": str(cache)})
    assert res.exit_code == 0, res.output
    redone = json.loads((out / "hw" / "colocated-60rps" / "summary.json").read_text())
    assert redone["node_settings"]["colocated0"]["weights_read"] == [0, 10]
    assert len(list(cache.glob("*.bin"))) == 10
    for said in (
        f"profile: kept {(out / 'profile.csv').resolve()}",
        "serving loop (runs of their own at 20 and 60 req/s): ",
        "hw run 1/4: disagg-20rps (disagg, 20 req/s), kept",
        "hw run 3/4: colocated-20rps (colocated, 20 req/s), kept",
    ):
        assert said in res.output
    assert "hw run 4/4: colocated-60rps (colocated, 60 req/s)\n" in res.output
    assert ", kept" in res.output.split("serving loop")[1].splitlines()[0]
    assert json.loads((out / "hw" / "disagg-20rps" / "summary.json").read_text()) == before
    assert (out / "hw" / "colocated-60rps" / "summary.json").exists()
    assert list(pd.read_csv(out / "fidelity.csv").run) == list(table.run)
    # resuming with other options, or where nothing ran, is refused, naming why
    res = CliRunner().invoke(app, [*again, "--resume", "--grid-points", "3"])
    assert res.exit_code == 2 and "was validated with grid_points 2, not 3" in res.output
    res = CliRunner().invoke(app, [*again[:-1], str(tmp_path / "none"), "--resume"])
    assert res.exit_code == 2 and "holds no validate run to resume" in res.output
    res = CliRunner().invoke(app, ["validate", "--out", str(out), "--replay", "--resume"])
    assert res.exit_code == 2 and "--replay and --resume: give one" in res.output

    # two experiments given: each as it is, by mode; a tolerance nothing meets
    coloc = tmp_path / "coloc.json"
    coloc.write_text(other_mode(load_experiment(TINY)).model_dump_json())
    out = tmp_path / "missed"
    args = ["validate", str(TINY), str(coloc), *common, "--rates", "40", "--out", str(out)]
    res = CliRunner().invoke(app, [*args, "--tolerance", "tpot_p50=0.0001"])
    assert res.exit_code == 1, res.output
    assert "missed: disagg-40rps tpot_s_p50: sim/hw" in res.output
    assert "missed: colocated-40rps tpot_s_p50: sim/hw" in res.output
    assert "0 of 2 cells met" in res.output
    assert "**no**" in (out / "fidelity.md").read_text()


def test_validate_runs_each_cell_again_on_its_workload_and_judges_the_median(
    tmp_path: Path,
) -> None:
    """--hw-runs 2, one load of three requests: each cell's second run is on the first's
    workload (its seed) under hw-2/, the table's hw value is the two runs' median, and the
    spread between them is in hw_spread.csv and fidelity.md; --resume redoes only a second run
    cut short. With --calibration-runs 2 the loop calibration's run is run twice, and its
    repeats take turns with the cells' runs: the first, every cell once, the second, every
    cell again."""
    pytest.importorskip("torch")
    pytest.importorskip("zmq")
    from typer.testing import CliRunner

    from disagg.cli import app

    out = tmp_path / "twice"
    args = ["validate", str(TINY), "--requests", "3", "--grid-points", "2", "--set", "hw.wire=tcp"]
    args += ["--rates", "40", "--hw-runs", "2", "--calibration-runs", "2", "--out", str(out)]
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "serving loop (runs of their own at 40 req/s, 2 times each)" in res.output
    for name in ("40rps", "40rps-2"):  # the loop calibration's run and its repeat
        assert (out / "calibration" / name / "summary.json").exists()
    assert "hw run 2/2: colocated-40rps (colocated, 40 req/s), again (2 of 2)" in res.output
    turns = [
        "serving loop: runs of their own at 40 req/s (1 of 2)\n",
        "hw run 1/2: disagg-40rps (disagg, 40 req/s)\n",
        "hw run 2/2: colocated-40rps (colocated, 40 req/s)\n",
        "serving loop: runs of their own at 40 req/s (2 of 2)\n",
        "hw run 1/2: disagg-40rps (disagg, 40 req/s), again (2 of 2)\n",
        "hw run 2/2: colocated-40rps (colocated, 40 req/s), again (2 of 2)\n",
        "serving loop (runs of their own at 40 req/s, 2 times each)",
    ]
    at = [res.output.index(line) for line in turns]
    assert at == sorted(at), res.output
    assert "the same run again: hw moves by up to TTFT p50" in res.output
    table = pd.read_csv(out / "fidelity.csv").set_index(["run", "metric"])
    spread = pd.read_csv(out / "hw_spread.csv")
    assert list(dict.fromkeys(spread.run)) == ["disagg-40rps", "colocated-40rps"]
    for label in ("disagg-40rps", "colocated-40rps"):
        first, second = (out / d / label for d in ("hw", "hw-2"))
        ran = [json.loads((d / "experiment.json").read_text()) for d in (first, second)]
        assert ran[0]["seed"] == ran[1]["seed"] and ran[0]["workload"] == ran[1]["workload"]
        both = [json.loads((d / "summary.json").read_text()) for d in (first, second)]
        for key in HW:
            values = sorted(s[key] for s in both)
            assert table.hw[(label, key)] == pytest.approx(sum(values) / 2)
            row = spread[(spread.run == label) & (spread.metric == key)].iloc[0]
            assert [row.runs, row.low, row.high] == [2, *map(pytest.approx, values)]
            assert row.spread == pytest.approx(values[1] / values[0] - 1)
    assert "## The same run again (hw)" in (out / "fidelity.md").read_text()
    (out / "hw-2" / "colocated-40rps" / "summary.json").unlink()
    res = CliRunner().invoke(app, [*args, "--resume"])
    assert res.exit_code == 0, res.output
    assert "hw run 2/2: colocated-40rps (colocated, 40 req/s), kept" in res.output
    assert "hw run 1/2: disagg-40rps (disagg, 40 req/s), again (2 of 2), kept" in res.output
    assert "colocated-40rps (colocated, 40 req/s), again (2 of 2)\n" in res.output
    assert (out / "hw-2" / "colocated-40rps" / "summary.json").exists()


def test_validate_measures_each_colocated_scheduler_asked_for(tmp_path: Path) -> None:
    """--schedulers prefill_first,decode_priority:chunk_with_decodes=16 at one load of six
    requests: a colocated run under each beside the two modes, each replayed; prefill-first's
    passes with prompts carry no decodes on either backend, decode-priority's carry chunks of
    16 tokens at most beside decodes, and the profile reaches the longest whole prompt."""
    pytest.importorskip("torch")
    pytest.importorskip("zmq")
    from typer.testing import CliRunner

    from disagg.cli import app

    out = tmp_path / "policies"
    args = ["validate", str(TINY), "--requests", "6", "--grid-points", "2", "--rates", "1000"]
    policies = "prefill_first,decode_priority:chunk_with_decodes=16"
    args += ["--schedulers", policies, "--set", "hw.wire=tcp"]
    res = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert res.exit_code == 0, res.output
    assert "hw run 3/4: colocated-prefill_first-1000rps (colocated, 1000 req/s)" in res.output
    table = pd.read_csv(out / "fidelity.csv")
    priority = "colocated-decode_priority.chunk_with_decodes=16"
    kinds = ["disagg", "colocated", "colocated-prefill_first", priority]
    assert list(dict.fromkeys(table.run)) == [f"{k}-1000rps" for k in kinds]
    assert np.isfinite(table.sim_profile).all() and (table.sim_profile > 0).all()
    label = "colocated-prefill_first-1000rps"
    ran = json.loads((out / "hw" / label / "experiment.json").read_text())
    assert ran["cluster"]["colocated"]["scheduler"] == {"name": "prefill_first"}
    for steps in (out / "hw" / label, out / "sim-profile" / label):
        passes = pd.read_parquet(steps / "steps.parquet")
        with_prompts = passes[passes.prefill_tokens > 0]
        assert len(with_prompts) and (with_prompts.decode_seqs == 0).all()
        assert (passes.decode_seqs > 0).any()
        beside = pd.read_parquet(steps.parent / f"{priority}-1000rps" / "steps.parquet")
        beside = beside[(beside.prefill_tokens > 0) & (beside.decode_seqs > 0)]
        assert len(beside) and beside.prefill_tokens.max() <= 16
    prompts = pd.read_parquet(out / "hw" / label / "requests.parquet").prompt_tokens
    profiled = pd.read_csv(out / "profile.csv")
    assert profiled[profiled.kind == "prefill"].tokens.max() == prompts.max() > 64
    res = CliRunner().invoke(app, ["validate", "--replay", "--schedulers", "prefill_first"])
    assert res.exit_code == 2 and "give no experiments or policies" in res.output


def test_validate_runs_an_moe_model_whose_prompts_each_fit_one_chunk(tmp_path: Path) -> None:
    """tiny-moe, prompts of 40 tokens in chunks of 64, arriving faster than they are served: the
    profile has prefill rows at context 0 only (of 40 tokens and of the budget, which a pass of
    packed prompts fills), and decode rows at every batch (an MoE model's, up to
    MOE_EVERY_BATCH). A pass holding two prompts splits the second, and the replays cost its
    rest after cached tokens, beyond the grid (on the H200 such a profile priced that at
    infinity and the run ended in 'KV pages leaked')."""
    pytest.importorskip("torch")
    pytest.importorskip("zmq")
    from typer.testing import CliRunner

    from disagg.cli import app

    out = tmp_path / "moe"
    overrides = ["model.name=tiny-moe", 'workload.prompt_tokens={"dist": "fixed", "value": 40}']
    overrides += ["hw.wire=tcp"]
    args = ["validate", str(TINY), "--requests", "12", "--grid-points", "2", "--rates", "1000"]
    args += [arg for o in overrides for arg in ("--set", o)]
    res = CliRunner().invoke(app, [*args, "--out", str(out)])
    assert res.exit_code == 0, res.output
    profiled = pd.read_csv(out / "profile.csv")
    assert set(profiled[profiled.kind == "prefill"].context) == {0}
    assert set(profiled[profiled.kind == "prefill"].tokens) == {40, 64}
    assert sorted(set(profiled[profiled.kind == "decode"].batch)) == list(range(1, 13))
    table = pd.read_csv(out / "fidelity.csv")
    assert set(table.run) == {"colocated-1000rps", "disagg-1000rps"}
    assert np.isfinite(table.sim_profile).all() and (table.sim_profile > 0).all()
    report = (out / "fidelity.md").read_text()
    assert "## Passes beyond the profiled grid" in report
    beyond = 0  # which run splits a prompt follows the servers' timing: at least one does
    for run in sorted(table.run.unique()):
        costed = json.loads((out / "sim-profile" / run / "summary.json").read_text())
        n, passes = costed["profile_passes_extrapolated"], costed["profile_passes"]
        assert 0 <= n < passes
        assert n == 0 or f"| {run} | {n:,} of {passes:,} | {n / passes:.1%} |" in report
        beyond += n
    assert beyond > 0


@pytest.mark.parametrize(
    ("args", "said"),
    [
        # DP attention runs on the CPU's rank processes (test_hw_dp): R1's weights do not fit
        ([str(EXPERIMENTS / "r1-disagg-dp8.toml")], "deepseek-r1 weights (61 layers) needs"),
        ([str(EXPERIMENTS / "r1-disagg-1p3d.toml")], "deepseek-r1 weights (61 layers) needs"),
        ([str(TINY), "--tolerance", "ttft_p50=x"], "--tolerance ttft_p50='x'"),
        ([str(TINY), "--tolerance", "goodput=3"], "--tolerance 'goodput': unknown metric"),
        ([str(TINY), "--rates", "2,fast"], "--rates '2,fast': give comma-separated"),
        ([str(TINY), "--rates", "0,nan"], "--rates '0,nan': give request rates > 0"),
        ([str(TINY), "--schedulers", "fcfs"], "--schedulers 'fcfs': cluster.colocated.scheduler"),
        (
            [str(TINY), "--schedulers", "decode_priority:chunk_with_decodes=-1"],
            "--schedulers 'decode_priority:chunk_with_decodes=-1': scheduler policy",
        ),
        (["--replay"], "not a validate directory (needs hw/ runs and profile.csv)"),
        ([str(TINY), "--replay"], "--replay replays the runs in --out: give no experiments"),
    ],
)
def test_validate_refuses_bad_input_naming_it(args: list[str], said: str, tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("zmq")
    from typer.testing import CliRunner

    from disagg.cli import app

    res = CliRunner().invoke(app, ["validate", *args, "--out", str(tmp_path / "o")])
    assert res.exit_code == 2, res.output
    assert said in " ".join(res.output.split()), res.output


def test_chunk_offsets_are_fitted_on_the_runs_without_stale_ones(tmp_path: Path) -> None:
    """Serving runs whose chunk passes (600 tokens, one request at a time) ran 5 ms longer on
    the device than the profile says: the offsets fitted on them are +5 ms, whatever offsets
    the costs carried before; with the runs' own profile they are 0. So pass by pass, and on
    the replays of a steps table without the passes' shapes."""
    from disagg.core.metrics import steps_table
    from disagg.sim.cluster import Sim
    from disagg.validate import fit_chunk_offsets, fit_decode_passes

    def profile(name: str, extra_s: float) -> Path:
        rows = [f"prefill,{n},1,0,{n / 512e3 + extra_s},0" for n in (256, 512, 1024)]
        rows += [
            f"decode,{b},{b},{c},{0.01 + b * c * 1e-7},0" for b in (1, 8) for c in (1000, 3000)
        ]
        path = tmp_path / name
        path.write_text("\n".join(["kind,tokens,batch,context,duration_s,host_s", *rows]) + "\n")
        return path

    plain, slow = profile("plain.csv", 0.0), profile("slow.csv", 0.005)
    exp = load_experiment(
        EXPERIMENTS / "llama8b-h200.toml",
        [
            "cluster.colocated.tp=1",
            f"cost.source=profile:{slow}",
            "hw.latency.prefill_graphs=[]",  # each chunk at its own tokens, not its piece's
            "workload.rate_per_s=0.5",
            "workload.num_requests=3",
            'workload.prompt_tokens={"dist": "fixed", "value": 600}',
            'workload.output_tokens={"dist": "fixed", "value": 5}',
        ],
    )
    run = tmp_path / "run"
    run.mkdir()
    sim = Sim(exp)
    sim.run()
    steps_table(sim.rec).to_parquet(run / "steps.parquet")
    (run / "experiment.json").write_text(exp.model_dump_json())
    stale = {"profile_pass_overhead_s": 0.0, "profile_chunk_offsets": [[600.0, -0.1]]}
    old = tmp_path / "old"  # the same run, its steps table without the passes' shapes
    old.mkdir()
    steps = steps_table(sim.rec)
    steps.drop(columns=["prefill_attn_pairs", "decode_context"]).to_parquet(old / "steps.parquet")
    (old / "experiment.json").write_text(exp.model_dump_json())
    for where in (run, old):  # pass by pass, and on the replays
        fitted = fit_chunk_offsets([where], plain, stale)
        assert fitted["profile_pass_overhead_s"] == 0.0
        assert [n for n, _ in fitted["profile_chunk_offsets"]] == [600.0]
        assert [o for _, o in fitted["profile_chunk_offsets"]] == pytest.approx([0.005])
        again = fit_chunk_offsets([where], slow, stale)["profile_chunk_offsets"]
        assert [o for _, o in again] == pytest.approx([0.0], abs=1e-12)
    assert (old / "replay").exists() and not (run / "replay").exists()
    # its decode passes ran as runs of four (none alone): no graph scales or lift after a
    # chunk pass to fit, and none kept from before
    lifted = stale | {"profile_after_chunk": [[0.0, 0.1], [0.2, 0.0]]}
    lifted |= {"profile_graph_scales": [[8.0, 1.1]]}
    assert fit_decode_passes([run], plain, lifted) == stale
