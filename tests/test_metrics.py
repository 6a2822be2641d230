"""The result tables' derived figures."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
from pydantic import ValidationError
from typer.testing import CliRunner

from disagg.cli import app
from disagg.core.metrics import (
    TRANSFER_COLUMNS,
    Recorder,
    handoff_parts,
    host_share,
    inter_token_latency,
    read_summary,
    requests_table,
    stalled_waits,
    steps_table,
    summarize,
    write_results,
)
from disagg.core.request import Request, Status
from disagg.core.slo import Slo
from disagg.core.stats import describe_ms, per_user_tps
from disagg.core.summary import FIGURES, SCHEMA_VERSION, Summary
from disagg.errors import ConfigError

OLD_RUNS = Path(__file__).parent / "data" / "hw-runs" / "gpu_tpot_2026-11-29d"


def test_host_share_counts_only_the_passes_whose_device_time_was_measured() -> None:
    """Wall time outside the device span, over the timed passes only: 2 of 10 ms here (the
    untimed pass is left out); NaN when nothing was timed or the column predates device_s."""
    steps = pd.DataFrame({"duration_s": [0.004, 0.006, 0.05], "device_s": [0.003, 0.005, math.nan]})
    assert host_share(steps) == pytest.approx(0.2)
    assert math.isnan(host_share(steps.iloc[2:]))
    assert math.isnan(host_share(steps.drop(columns="device_s")))


# -- hand-built tables ---------------------------------------------------------------------------


def step_rows(*rows: tuple[float, int, int, int]) -> pd.DataFrame:
    """A steps table from (duration_s, steps, decode_seqs, prefill_tokens) rows; the other
    columns are filler that the inter-token figures must not read."""
    recorder = Recorder()
    for i, (duration_s, steps, decode_seqs, prefill_tokens) in enumerate(rows):
        recorder.step(
            node="decode0",
            kind="mixed" if prefill_tokens and decode_seqs else "decode",
            start_s=float(i),
            duration_s=duration_s,
            steps=steps,
            batch_size=decode_seqs + (1 if prefill_tokens else 0),
            decode_seqs=decode_seqs,
            tokens=decode_seqs + prefill_tokens,
            prefill_tokens=prefill_tokens,
        )
    return steps_table(recorder)


def request(
    rid: int, arrival_s: float, output_tokens: int, status: Status, first_s: float, finish_s: float
) -> Request:
    r = Request(rid, arrival_s, prompt_tokens=100, output_tokens=output_tokens, status=status)
    r.first_token_s, r.finish_s = first_s, finish_s
    return r


NAN = math.nan
# id, arrival, output tokens, status, first token, finish:
#   r0: TTFT 0.5, TPOT (2.5 - 0.5) / 4 = 0.5
#   r1: TTFT 0.2, TPOT (3.2 - 1.2) / 10 = 0.2
#   r2: TTFT 1.0, one token so no TPOT
#   r3 failed, r4 still decoding (its first token is not a finished request's)
#   r5: TTFT 0.4, TPOT (3.9 - 3.4) / 2 = 0.25
REQUESTS = requests_table(
    [
        request(0, 0.0, 5, Status.FINISHED, 0.5, 2.5),
        request(1, 1.0, 11, Status.FINISHED, 1.2, 3.2),
        request(2, 2.0, 1, Status.FINISHED, 3.0, 4.0),
        request(3, 2.5, 7, Status.FAILED, NAN, NAN),
        request(4, 3.0, 9, Status.DECODING, 3.5, NAN),
        request(5, 3.0, 3, Status.FINISHED, 3.4, 3.9),
    ]
)
TRANSFERS = pd.DataFrame(
    [(0, 0, 1, 1000.0, 4.0, 1.0, 1.25), (1, 0, 1, 3000.0, 8.0, 2.0, 2.75)],
    columns=TRANSFER_COLUMNS,
)
# per-pass time and weight (passes x decoding sequences) of each row:
#   prefill only: no decodes, left out
#   10 ms x (1 pass x 2 seqs) = weight 2
#   4 identical passes in 80 ms: 20 ms each x (4 x 3) = weight 12
#   a mixed pass: 50 ms x (1 x 1) = weight 1
# sorted: 10 ms (cumulative 2/15), 20 ms (14/15), 50 ms (15/15)
STEPS = step_rows((0.3, 1, 0, 512), (0.01, 1, 2, 0), (0.08, 4, 3, 0), (0.05, 1, 1, 100))


def test_inter_token_latency_weights_passes_by_sequences_and_run_length() -> None:
    # p50: half of 15 = 7.5 is first reached at 20 ms; p90 13.5 too; p99 14.85 and p99.9 14.985
    # only by the mixed pass. Counting each row once (not 4 passes) would put p90 at 50 ms;
    # reading duration_s as one pass would give 80 ms.
    assert inter_token_latency(STEPS) == {
        "itl_s_p50": pytest.approx(0.02),
        "itl_s_p90": pytest.approx(0.02),
        "itl_s_p99": pytest.approx(0.05),
        "itl_s_p999": pytest.approx(0.05),
    }


def test_inter_token_latency_ignores_row_order() -> None:
    shuffled = STEPS.iloc[[3, 0, 2, 1]].reset_index(drop=True)
    assert inter_token_latency(shuffled) == inter_token_latency(STEPS)


def test_inter_token_p999_of_a_thousand_passes_is_the_999th() -> None:
    # 999 identical 10 ms passes of one sequence in one row, then one 500 ms stutter: 999 of the
    # 1000 waits are 10 ms, so p99.9 (the 999th smallest) is 10 ms and only the maximum is 500
    steps = step_rows((9.99, 999, 1, 0), (0.5, 1, 1, 0))
    itl = inter_token_latency(steps)
    assert itl["itl_s_p99"] == pytest.approx(0.01)
    assert itl["itl_s_p999"] == pytest.approx(0.01)
    # one more stutter: 998 of 1000 at 10 ms, then 400 and 500 ms: p99.9 is the 400 ms one
    steps = step_rows((9.98, 998, 1, 0), (0.5, 1, 1, 0), (0.4, 1, 1, 0))
    assert inter_token_latency(steps)["itl_s_p999"] == pytest.approx(0.4)


def test_inter_token_percentiles_of_ten_equal_weight_passes() -> None:
    # 10 ms .. 100 ms, one sequence each: p50 is the 5th (50 ms), p90 the 9th (90 ms), p99 and
    # p99.9 the 10th (100 ms); the same passes as one 2-sequence row each double every weight
    steps = step_rows(*[(0.01 * k, 1, 1, 0) for k in range(10, 0, -1)])
    expected = {"itl_s_p50": 0.05, "itl_s_p90": 0.09, "itl_s_p99": 0.1, "itl_s_p999": 0.1}
    assert inter_token_latency(steps) == pytest.approx(expected)
    doubled = step_rows(*[(0.01 * k, 1, 2, 0) for k in range(1, 11)])
    assert inter_token_latency(doubled) == pytest.approx(expected)


def test_a_sequence_kept_waiting_by_passes_without_decodes_waits_from_its_token_before() -> None:
    """A colocated node (colocated0) decodes r0 and r1 (0-10 ms; r4 finishes there), runs two
    prompts in passes of their own (10-60 ms: r2's first token; 60-110 ms: r3's), then decodes
    four (110-120 ms). r0 and r1 wait 120 - 10 = 110 ms for that token, r2 120 - 60 = 60 ms,
    r3 only the pass (10 ms). A decode node's run (decode0) keeps its pass times."""
    rec = Recorder()
    for node, start, took, seqs, prompt in [
        ("colocated0", 0.0, 0.01, 2, 0),
        ("colocated0", 0.01, 0.05, 0, 300),
        ("colocated0", 0.06, 0.05, 0, 300),
        ("colocated0", 0.11, 0.01, 4, 0),
        ("decode0", 0.0, 0.02, 1, 0),
    ]:
        rec.step(node=node, kind="mixed" if prompt else "decode", start_s=start, duration_s=took,
                 steps=1, batch_size=seqs or 1, decode_seqs=seqs, tokens=seqs + prompt,
                 prefill_tokens=prompt)  # fmt: skip
    steps = steps_table(rec)
    done = Status.FINISHED
    served = [
        request(0, 0.0, 9, done, 0.0, 1.0),
        request(1, 0.0, 9, done, 0.0, 1.0),
        request(2, 0.0, 9, done, 0.06, 1.0),
        request(3, 0.0, 9, done, 0.11, 1.0),
        request(4, 0.0, 2, done, 0.0, 0.01),
    ]
    for r in served:
        r.decode_node = 0  # colocated0's (and decode0's: it never stalls)
    requests = requests_table(served)
    waits, fewer = stalled_waits(steps, requests)
    assert waits == pytest.approx([0.11, 0.11, 0.06]) and fewer == {3: 3}
    # colocated0: 0.01 x 2 and 0.01 x (4 - 3), then 0.11, 0.11, 0.06; decode0: 0.02 x 1
    itl = inter_token_latency(steps, requests)
    assert itl == pytest.approx(
        {"itl_s_p50": 0.02, "itl_s_p90": 0.11, "itl_s_p99": 0.11, "itl_s_p999": 0.11}
    )
    assert inter_token_latency(steps)["itl_s_p90"] == pytest.approx(0.02)  # pass times alone
    two = steps.assign(decode_seqs=steps.decode_seqs.where(steps.index != 3, 2))
    assert stalled_waits(two, requests) == (pytest.approx([0.11, 0.11]), {3: 2})  # the earliest


def test_inter_token_latency_without_decode_passes_is_nan() -> None:
    itl = inter_token_latency(step_rows((0.3, 1, 0, 512)))
    assert set(itl) == {"itl_s_p50", "itl_s_p90", "itl_s_p99", "itl_s_p999"}
    assert all(math.isnan(v) for v in itl.values())


def test_summarize_hand_computed_tables() -> None:
    s = summarize(REQUESTS, STEPS, TRANSFERS, gpus=2, wall_s=7.5)
    # finished TTFTs sorted 0.2, 0.4, 0.5, 1.0, linear percentiles: p50 at rank 1.5 = 0.45,
    # p90 at rank 2.7 = 0.5 + 0.7 * 0.5, p99 at rank 2.97 = 0.5 + 0.97 * 0.5
    assert s["ttft_s_p50"] == pytest.approx(0.45)
    assert s["ttft_s_p90"] == pytest.approx(0.85)
    assert s["ttft_s_p99"] == pytest.approx(0.985)
    # TPOTs 0.2, 0.25, 0.5 (r2's NaN dropped): p90 at rank 1.8 = 0.25 + 0.8 * 0.25
    assert s["tpot_s_p50"] == pytest.approx(0.25)
    assert s["tpot_s_p90"] == pytest.approx(0.45)
    assert s["tpot_s_p99"] == pytest.approx(0.495)
    assert s["tps_per_user_p50"] == pytest.approx(4.0)  # median of 1/TPOT: 2, 4, 5 (mean 3.67)
    # 5 + 11 + 1 + 3 finished output tokens over the last finish (4.0 s) on 2 GPUs
    assert s["simulated_s"] == 4.0
    assert s["output_tps_per_gpu"] == pytest.approx(20 / 4.0 / 2)
    assert s["itl_s_p50"] == pytest.approx(0.02)
    assert s["itl_s_p999"] == pytest.approx(0.05)
    assert s["transfer_bytes_per_request"] == 2000.0
    assert s["transfer_ops_per_request"] == 6.0
    assert s["transfer_s_p50"] == pytest.approx(0.5)  # median of 0.25 and 0.75 s
    assert (s["completed"], s["failed"], s["unfinished"]) == (4, 1, 1)
    assert (s["gpus"], s["wall_s"]) == (2, 7.5)


def test_summarize_with_nothing_finished() -> None:
    requests = REQUESTS[REQUESTS.status != "finished"]
    s = summarize(requests, step_rows(), TRANSFERS.iloc[:0], gpus=4, wall_s=1.0)
    assert math.isnan(s["ttft_s_p50"]) and math.isnan(s["tpot_s_p99"])
    assert math.isnan(s["itl_s_p999"])
    assert s["simulated_s"] == 0.0
    assert s["output_tps_per_gpu"] == 0.0
    assert s["tps_per_user_p50"] == 0.0
    assert s["transfer_bytes_per_request"] == 0.0
    assert (s["completed"], s["failed"], s["unfinished"]) == (0, 1, 1)


# -- field-standard figures (vLLM's names, ms) ---------------------------------------------------


def test_describe_ms_of_four_values() -> None:
    # 100, 200, 400, 900 ms: mean 400; median between 200 and 400; deviations -300, -200, 0,
    # 500 give a population variance of 380000 / 4; p99 at rank 3 * 0.99 = 2.97 lies 0.97 of
    # the way from 400 to 900
    d = describe_ms([0.9, 0.1, math.nan, 0.4, 0.2], "ttft")  # order and NaN do not matter
    assert d == pytest.approx(
        {
            "mean_ttft_ms": 400.0,
            "median_ttft_ms": 300.0,
            "std_ttft_ms": math.sqrt(95000.0),
            "p90_ttft_ms": 400 + 0.7 * 500,
            "p95_ttft_ms": 400 + 0.85 * 500,
            "p99_ttft_ms": 400 + 0.97 * 500,
            "p999_ttft_ms": 400 + 0.997 * 500,
        }
    )


def test_describe_ms_of_nothing_is_nan() -> None:
    d = describe_ms([math.nan], "e2e")
    assert set(d) == {f"{s}_e2e_ms" for s in ("mean", "median", "std", "p90", "p95", "p99", "p999")}
    assert all(math.isnan(v) for v in d.values())


def test_weighted_figures_equal_those_of_the_repeated_list() -> None:
    rng = np.random.default_rng(7)
    for _ in range(50):
        n = int(rng.integers(1, 12))
        values = rng.choice([0.01, 0.02, 0.05, 0.3], size=n) + rng.random(n) * 1e-3
        counts = rng.integers(0, 9, size=n)
        if counts.sum() == 0:
            continue
        expected = {
            f"{s}_x_ms": v
            for s, v in (
                ("mean", np.mean(np.repeat(values, counts)) * 1e3),
                ("median", np.median(np.repeat(values, counts)) * 1e3),
                ("std", np.std(np.repeat(values, counts)) * 1e3),
            )
        }
        for name, q in (("p90", 90), ("p95", 95), ("p99", 99), ("p999", 99.9)):
            expected[f"{name}_x_ms"] = np.percentile(np.repeat(values, counts) * 1e3, q)
        assert describe_ms(values, "x", counts) == pytest.approx(expected, rel=1e-12)


def test_per_user_tps_p10_is_the_speed_nine_in_ten_users_beat() -> None:
    # TPOTs 0.1, 0.1, 0.2, 0.3 s: 10, 10, 5, 3.33 tokens/s; p10 at rank 0.3 of 3.33 .. 5
    tps = per_user_tps([0.1, 0.2, math.nan, 0.3, 0.1])
    assert tps == pytest.approx(
        {
            "mean_tps_per_user": (10 + 10 + 5 + 10 / 3) / 4,
            "p10_tps_per_user": 10 / 3 + 0.3 * (5 - 10 / 3),
            "median_tps_per_user": 7.5,
            "p90_tps_per_user": 10.0,
        }
    )


def timed(
    rid: int, arrival_s: float, prefill_s: float, first_s: float, finish_s: float, out: int
) -> Request:
    r = Request(rid, arrival_s, prompt_tokens=100, output_tokens=out, status=Status.FINISHED)
    r.prefill_start_s, r.first_token_s, r.finish_s = prefill_s, first_s, finish_s
    return r


# id, arrival, first prefill pass, first token, finish, output tokens:
#   TTFT 300, 100, 600, 400 ms; TPOT 1.0/10, 0.4/4, 1.0/5, 0.6/2 = 100, 100, 200, 300 ms;
#   E2E 1300, 500, 1600, 1000 ms; queue 100, 0, 400, 200 ms; r4 failed and counts in none
FOUR = requests_table(
    [
        timed(0, 0.0, 0.1, 0.3, 1.3, 11),
        timed(1, 1.0, 1.0, 1.1, 1.5, 5),
        timed(2, 2.0, 2.4, 2.6, 3.6, 6),
        timed(3, 3.0, 3.2, 3.4, 4.0, 3),
        Request(4, 3.5, prompt_tokens=100, output_tokens=9, status=Status.FAILED),
    ]
)


def test_summarize_gives_the_field_standard_figures_of_hand_built_tables() -> None:
    s = summarize(FOUR, STEPS, TRANSFERS, gpus=2, wall_s=1.0)
    assert s["schema_version"] == SCHEMA_VERSION
    # TTFT 100, 300, 400, 600: mean and median 350, deviations +-250 and +-50
    assert s["mean_ttft_ms"] == pytest.approx(350.0)
    assert s["median_ttft_ms"] == pytest.approx(350.0)
    assert s["std_ttft_ms"] == pytest.approx(math.sqrt((2 * 250**2 + 2 * 50**2) / 4))
    assert s["p99_ttft_ms"] == pytest.approx(400 + 0.97 * 200)
    assert s["p99_ttft_ms"] == pytest.approx(1e3 * s["ttft_s_p99"])  # the same definition
    # TPOT 100, 100, 200, 300
    assert s["mean_tpot_ms"] == pytest.approx(175.0)
    assert s["median_tpot_ms"] == pytest.approx(150.0)
    assert s["std_tpot_ms"] == pytest.approx(math.sqrt((2 * 75**2 + 25**2 + 125**2) / 4))
    assert s["p90_tpot_ms"] == pytest.approx(200 + 0.7 * 100)
    # E2E 500, 1000, 1300, 1600; queue 0, 100, 200, 400
    assert s["mean_e2e_ms"] == pytest.approx(1100.0)
    assert s["median_e2e_ms"] == pytest.approx(1150.0)
    assert s["p99_e2e_ms"] == pytest.approx(1300 + 0.97 * 300)
    assert s["mean_queue_ms"] == pytest.approx(175.0)
    assert s["median_queue_ms"] == pytest.approx(150.0)
    assert s["p999_queue_ms"] == pytest.approx(200 + 0.997 * 200)
    assert s["p10_tps_per_user"] == pytest.approx(10 / 3 + 0.3 * (5 - 10 / 3))
    # the span runs from the first arrival (0 s) to the last finish (4 s): 4 finished, 400
    # prompt and 25 output tokens
    assert s["duration_s"] == pytest.approx(4.0)
    assert (s["completed"], s["total_input_tokens"], s["total_output_tokens"]) == (4, 400, 25)
    assert s["request_throughput"] == pytest.approx(1.0)
    assert s["input_throughput"] == pytest.approx(100.0)
    assert s["output_throughput"] == pytest.approx(6.25)
    assert s["total_token_throughput"] == pytest.approx(106.25)
    assert "goodput_per_s" not in s and "slo" not in s


def test_itl_in_ms_is_the_pooled_list_of_sequence_passes() -> None:
    # STEPS: 2 waits of 10 ms, 12 of 20 ms, 1 of 50 ms (15 in all; ranks 0..14); the mean is
    # per wait, p95 at rank 13.3 lies 0.3 of the way from 20 to 50 ms
    s = summarize(FOUR, STEPS, TRANSFERS, gpus=2, wall_s=1.0)
    mean = (2 * 10 + 12 * 20 + 50) / 15
    assert s["mean_itl_ms"] == pytest.approx(mean)
    assert s["median_itl_ms"] == pytest.approx(20.0)
    assert s["std_itl_ms"] == pytest.approx(
        math.sqrt((2 * (10 - mean) ** 2 + 12 * (20 - mean) ** 2 + (50 - mean) ** 2) / 15)
    )
    assert s["p90_itl_ms"] == pytest.approx(20.0)
    assert s["p95_itl_ms"] == pytest.approx(20 + 0.3 * 30)
    assert s["p99_itl_ms"] == pytest.approx(20 + 0.86 * 30)
    assert s["p999_itl_ms"] == pytest.approx(20 + 0.986 * 30)


def test_goodput_under_an_slo() -> None:
    # ttft <= 350 and tpot <= 150 ms: r0 (300, 100) and r1 (100, 100) meet it; r2 and r3 are
    # late to the first token; r4 failed. 2 over the 4 s span; 2 of the 5 requests
    s = summarize(FOUR, STEPS, TRANSFERS, 2, 1.0, Slo.parse("ttft_ms=350,tpot_ms=150"))
    assert s["slo"] == "ttft_ms=350,tpot_ms=150"
    assert s["goodput_per_s"] == pytest.approx(0.5)
    assert s["slo_met_fraction"] == pytest.approx(0.4)
    loose = summarize(FOUR, STEPS, TRANSFERS, 2, 1.0, Slo.parse("e2e_ms=5000"))
    assert loose["goodput_per_s"] == pytest.approx(loose["request_throughput"])


def test_summary_round_trips_through_summary_json(tmp_path: Path) -> None:
    summary = summarize(FOUR, STEPS, TRANSFERS, 2, 1.5, Slo.parse("tpot_ms=150"))
    summary |= {"experiment": "four", "nic_busy_max": 0.25, "a_newer_backend_key": [1, 2]}
    write_results(tmp_path, FOUR, STEPS, TRANSFERS, summary)
    raw = json.loads((tmp_path / "summary.json").read_text())
    assert raw == summary  # every key, extras too; no None-valued optional sections
    assert read_summary(tmp_path).fields() == summary
    assert read_summary(tmp_path).goodput_per_s == pytest.approx(0.5)  # r0, r1 (r3's 300 ms)
    # with another SLO, goodput is computed again from the requests; the rest is as stored
    again = read_summary(tmp_path, Slo.parse("ttft_ms=450"))
    assert (again.slo, again.goodput_per_s, again.slo_met_fraction) == ("ttft_ms=450", 0.75, 0.6)
    assert again.wall_s == 1.5


def test_nan_figures_survive_the_round_trip(tmp_path: Path) -> None:
    failed = FOUR[FOUR.status == "failed"]
    write_results(
        tmp_path,
        failed,
        step_rows(),
        TRANSFERS.iloc[:0],
        summarize(failed, step_rows(), TRANSFERS.iloc[:0], 1, 1.0),
    )
    s = read_summary(tmp_path)
    assert math.isnan(s.mean_ttft_ms) and math.isnan(s.p999_itl_ms)
    assert (s.completed, s.failed, s.request_throughput, s.duration_s) == (0, 1, 0.0, 0.0)


def test_every_field_is_described_and_typed() -> None:
    schema = Summary.model_json_schema()["properties"]
    assert set(schema) == set(Summary.model_fields)
    missing = [k for k, v in schema.items() if not v.get("description")]
    assert missing == []
    assert "p999_ttft_ms" in FIGURES and "node_settings" not in FIGURES and "slo" not in FIGURES


def test_a_summary_of_the_wrong_type_is_refused_naming_the_field(tmp_path: Path) -> None:
    summary = summarize(FOUR, STEPS, TRANSFERS, 2, 1.0) | {"completed": "many"}
    with pytest.raises(ValidationError, match="completed"):
        write_results(tmp_path, FOUR, STEPS, TRANSFERS, summary)


def test_a_summary_newer_than_the_code_is_a_clear_error(tmp_path: Path) -> None:
    write_results(tmp_path, FOUR, STEPS, TRANSFERS, summarize(FOUR, STEPS, TRANSFERS, 2, 1.0))
    raw = json.loads((tmp_path / "summary.json").read_text()) | {"schema_version": 99}
    (tmp_path / "summary.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match="schema_version 99 is newer"):
        read_summary(tmp_path)


def test_an_old_summary_gets_the_new_figures_from_its_tables(tmp_path: Path) -> None:
    """A hardware run from before schema_version: its own values kept, the rest computed
    from its tables."""
    old = json.loads((OLD_RUNS / "disagg-2rps" / "summary.json").read_text())
    assert "schema_version" not in old and "mean_ttft_ms" not in old
    s = read_summary(OLD_RUNS / "disagg-2rps")
    assert s.schema_version == SCHEMA_VERSION
    assert {k: v for k, v in s.fields().items() if k in old} == old
    req = pd.read_parquet(OLD_RUNS / "disagg-2rps" / "requests.parquet")
    assert s.mean_ttft_ms == pytest.approx(1e3 * req.ttft_s.mean(), rel=1e-12)
    assert s.median_ttft_ms == pytest.approx(1e3 * old["ttft_s_p50"], rel=1e-12)
    span = req.finish_s.max() - req.arrival_s.min()
    assert s.request_throughput == pytest.approx(79 / span, rel=1e-12)
    assert s.goodput_per_s is None


def test_compare_shows_old_and_new_runs_side_by_side_with_goodput(tmp_path: Path) -> None:
    new = tmp_path / "new"
    write_results(new, FOUR, STEPS, TRANSFERS, summarize(FOUR, STEPS, TRANSFERS, 2, 1.0))
    old = tmp_path / "disagg-2rps"
    shutil.copytree(OLD_RUNS / "disagg-2rps", old)
    res = CliRunner().invoke(
        app, ["sim", "compare", str(old), str(new), "--slo", "ttft_ms=350,tpot_ms=150"]
    )
    assert res.exit_code == 0, res.output
    assert "goodput under the SLO ttft_ms=350,tpot_ms=150" in res.output
    rows = {
        line.split("│")[1].strip(): line.split("│")[2:4]
        for line in res.output.splitlines()
        if line.count("│") == 4
    }
    assert [v.strip() for v in rows["goodput (requests/s)"]][1] == "0.5"
    assert [v.strip() for v in rows["TTFT mean (ms)"]] == [
        f"{read_summary(old).mean_ttft_ms:,.1f}",
        "350.0",
    ]
    assert "p999_ttft_ms" not in res.output
    res = CliRunner().invoke(app, ["sim", "compare", str(old), str(new), "--all"])
    assert res.exit_code == 0 and "p999_ttft_ms" in res.output
    # nothing written into the old run: it is read as it is
    assert json.loads((old / "summary.json").read_text()) == json.loads(
        (OLD_RUNS / "disagg-2rps" / "summary.json").read_text()
    )


def test_a_bad_slo_is_an_error_naming_it() -> None:
    res = CliRunner().invoke(
        app, ["sim", "compare", str(OLD_RUNS / "disagg-2rps"), "--slo", "ttft=1"]
    )
    assert res.exit_code == 2 and "--slo 'ttft=1'" in res.output


def test_sim_run_with_an_slo_writes_goodput_into_summary_json(tmp_path: Path) -> None:
    experiment = Path(__file__).parent.parent / "experiments" / "tiny-disagg.toml"
    out = tmp_path / "run"
    args = ["sim", "run", str(experiment), "--out", str(out), "--slo", "ttft_ms=12"]
    res = CliRunner().invoke(app, [*args, "--quiet"])
    assert res.exit_code == 0, res.output
    summary = json.loads((out / "summary.json").read_text())
    req = pd.read_parquet(out / "requests.parquet")
    met = int((req.ttft_s * 1e3 <= 12).sum())
    assert 0 < met < len(req)  # a bound that some requests meet and some miss
    span = req.finish_s.max() - req.arrival_s.min()
    assert summary["schema_version"] == SCHEMA_VERSION and summary["slo"] == "ttft_ms=12"
    assert summary["goodput_per_s"] == pytest.approx(met / span, rel=1e-12)
    assert summary["slo_met_fraction"] == pytest.approx(met / len(req), rel=1e-12)


def test_an_old_summary_without_its_counts_cannot_be_brought_up_to_date(tmp_path: Path) -> None:
    shutil.copytree(OLD_RUNS / "colocated-2rps", tmp_path / "run")
    raw = json.loads((tmp_path / "run" / "summary.json").read_text())
    del raw["gpus"]
    (tmp_path / "run" / "summary.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError, match=r"summary\.json: no gpus or wall_s"):
        read_summary(tmp_path / "run")


def test_the_handoff_splits_at_the_landing_of_the_kvs_last_immediate() -> None:
    requests = pd.DataFrame(
        {"request_id": [4, 5, 6], "prefill_end_s": [1.0, 2.0, 3.0], "ready_s": [1.01, 2.003, 3.5]}
    )
    hops = pd.DataFrame(
        {
            "request_id": [4, 5, 4, 6],
            "node": ["decode0", "decode0", "prefill0", "driver"],
            "event": ["landed", "landed", "pages", "sent"],  # 6: no landing stamped (older)
            "t_s": [1.004, 2.0025, 0.5, 2.9],
        }
    )
    parts = handoff_parts(requests, hops)
    assert list(parts.index) == [4, 5]
    assert parts.to_decoder.tolist() == pytest.approx([0.004, 0.0025])
    assert parts.until_taken.tolist() == pytest.approx([0.006, 0.0005])
