"""The result tables' derived figures."""

from __future__ import annotations

import math

import pandas as pd
import pytest

from disagg.core.metrics import (
    TRANSFER_COLUMNS,
    Recorder,
    host_share,
    inter_token_latency,
    requests_table,
    steps_table,
    summarize,
)
from disagg.core.request import Request, Status


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
