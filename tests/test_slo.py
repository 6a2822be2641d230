"""SLOs and goodput against hand-computed requests tables."""

import math

import pandas as pd
import pytest

from disagg.core.slo import Slo, goodput_per_s
from disagg.errors import ConfigError


def table() -> pd.DataFrame:
    nan = math.nan
    return pd.DataFrame(
        {
            "status": ["finished", "finished", "finished", "failed", "finished"],
            "arrival_s": [0.0, 1.0, 2.0, 3.0, 4.0],
            "ttft_s": [0.2, 0.6, 0.3, nan, 0.1],
            "tpot_s": [0.04, 0.02, 0.08, nan, nan],  # the last had one output token
            "finish_s": [1.0, 3.0, 4.5, nan, 4.2],
        }
    )


def test_parse_reads_each_bound_and_prints_back() -> None:
    slo = Slo.parse("ttft_ms=500, tpot_ms=50")
    assert (slo.ttft_ms, slo.tpot_ms, slo.e2e_ms) == (500.0, 50.0, None)
    assert str(slo) == "ttft_ms=500,tpot_ms=50"


@pytest.mark.parametrize(
    ("text", "said"),
    [
        ("ttft=500", r"'ttft=500' is not NAME=MS"),
        ("ttft_ms", r"'ttft_ms' is not NAME=MS"),
        ("tpot_ms=fast", r"tpot_ms='fast' is not a number"),
        ("e2e_ms=0", r"e2e_ms=0 must be a positive bound"),
        ("", r"'' is not NAME=MS"),
    ],
)
def test_a_bad_slo_names_the_part(text: str, said: str) -> None:
    with pytest.raises(ConfigError, match=said):
        Slo.parse(text)


def test_met_needs_a_finished_request_within_every_bound() -> None:
    req = table()
    # ttft 200/600/300/-/100 ms; tpot 40/20/80/-/- ms; e2e 1000/2000/2500/-/200 ms
    assert Slo.parse("ttft_ms=500").met(req).tolist() == [True, False, True, False, True]
    assert Slo.parse("tpot_ms=50").met(req).tolist() == [True, True, False, False, True]
    assert Slo.parse("e2e_ms=2000").met(req).tolist() == [True, True, False, False, True]
    both = Slo.parse("ttft_ms=500,tpot_ms=50")
    assert both.met(req).tolist() == [True, False, False, False, True]


def test_goodput_counts_the_requests_that_met_per_second() -> None:
    req = table()
    assert goodput_per_s(req, Slo.parse("ttft_ms=500,tpot_ms=50"), 4.0) == 0.5  # 2 in 4 s
    assert goodput_per_s(req, Slo(), 5.0) == 0.8  # no bound: every finished request
    assert goodput_per_s(req, Slo(), 0.0) == 0.0
