"""Workloads: synthetic arrivals and lengths, trace readers, config validation."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from pydantic import ValidationError

from disagg.core import workload
from disagg.core.workload import (
    Arrival,
    LengthDist,
    WorkloadConfig,
    generate,
    read_azure_csv,
    read_mooncake_jsonl,
)
from disagg.errors import TraceError

DATA = Path(__file__).parent / "data"
AZURE_SAMPLE = DATA / "azure_sample.csv"
MOONCAKE_SAMPLE = DATA / "mooncake_sample.jsonl"
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens\n"
AZURE_ROW = "2023-11-16 18:15:46.6805900,374,44\n"
MOONCAKE_ROW = '{"timestamp": 100, "input_length": 10, "output_length": 2}\n'

FIXED_8 = {"dist": "fixed", "value": 8}


def config(**fields: Any) -> WorkloadConfig:
    """A WorkloadConfig with fixed lengths unless given, validated as the TOML loader would."""
    return WorkloadConfig.model_validate(
        {"prompt_tokens": FIXED_8, "output_tokens": FIXED_8} | fields
    )


def gaps_s(arrivals: list[Arrival]) -> np.ndarray:
    times = np.array([a.arrival_s for a in arrivals])
    return np.diff(times, prepend=0.0)


# -- synthetic arrivals --------------------------------------------------------------------------


def test_poisson_mean_rate_and_unit_cv() -> None:
    arrivals = generate(config(rate_per_s=50.0, num_requests=20_000), seed=1)
    gaps = gaps_s(arrivals)
    assert len(arrivals) == 20_000
    assert 1 / gaps.mean() == pytest.approx(50.0, rel=0.03)
    assert gaps.std() / gaps.mean() == pytest.approx(1.0, rel=0.05)


@pytest.mark.parametrize("cv", [0.5, 2.0])
def test_gamma_keeps_rate_and_has_requested_cv(cv: float) -> None:
    arrivals = generate(config(arrival="gamma", cv=cv, rate_per_s=10.0, num_requests=20_000), 7)
    gaps = gaps_s(arrivals)
    assert 1 / gaps.mean() == pytest.approx(10.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)


def test_arrivals_are_sorted_numbered_and_start_after_zero() -> None:
    arrivals = generate(config(arrival="gamma", cv=3.0, num_requests=1000), seed=3)
    times = [a.arrival_s for a in arrivals]
    assert [a.request_id for a in arrivals] == list(range(1000))
    assert times == sorted(times)
    assert times[0] > 0.0


def test_duration_cuts_arrivals_before_the_end() -> None:
    arrivals = generate(config(rate_per_s=100.0, duration_s=60.0), seed=2)
    assert all(a.arrival_s < 60.0 for a in arrivals)
    assert len(arrivals) == pytest.approx(6000, rel=0.05)
    assert arrivals[-1].arrival_s > 59.0


def test_duration_drawn_in_batches_continues_the_stream(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = config(rate_per_s=100.0, duration_s=60.0)
    whole = [a.arrival_s for a in generate(cfg, seed=2)]
    monkeypatch.setattr(workload, "_MAX_CHUNK", 1000)  # about 6 batches instead of one
    batched = [a.arrival_s for a in generate(cfg, seed=2)]
    assert batched == pytest.approx(whole, rel=1e-12)
    assert len(batched) == pytest.approx(6000, rel=0.05)


def test_count_and_duration_whichever_ends_first() -> None:
    by_count = generate(config(rate_per_s=10.0, duration_s=1000.0, num_requests=50), seed=4)
    by_time = generate(config(rate_per_s=10.0, duration_s=5.0, num_requests=10_000), seed=4)
    assert len(by_count) == 50
    assert by_count[-1].arrival_s < 1000.0
    assert 20 < len(by_time) < 100
    assert all(a.arrival_s < 5.0 for a in by_time)


def test_duration_shorter_than_first_gap_gives_no_requests() -> None:
    assert generate(config(rate_per_s=0.001, duration_s=0.001), seed=0) == []


def test_same_seed_same_workload_different_seed_differs() -> None:
    cfg = config(
        arrival="gamma",
        cv=2.0,
        num_requests=500,
        prompt_tokens={"dist": "lognormal", "mean": 800, "sigma": 1.0},
        output_tokens={"dist": "uniform", "low": 1, "high": 500},
    )
    assert generate(cfg, seed=11) == generate(cfg, seed=11)
    other = generate(cfg, seed=12)
    assert [a.arrival_s for a in other] != [a.arrival_s for a in generate(cfg, seed=11)]
    assert [a.prompt_tokens for a in other] != [a.prompt_tokens for a in generate(cfg, seed=11)]


def test_changing_the_rate_keeps_the_lengths() -> None:
    lengths = {"dist": "uniform", "low": 1, "high": 4000}
    slow = generate(config(rate_per_s=1.0, num_requests=100, prompt_tokens=lengths), seed=5)
    fast = generate(config(rate_per_s=9.0, num_requests=100, prompt_tokens=lengths), seed=5)
    assert [a.prompt_tokens for a in slow] == [a.prompt_tokens for a in fast]


def test_hundred_thousand_arrivals_are_numbered_sorted_and_reproducible() -> None:
    # Speed is measured by benchmarks/workload_speed.py, not here.
    cfg = config(
        arrival="gamma",
        num_requests=100_000,
        prompt_tokens={"dist": "lognormal", "mean": 1000, "sigma": 1.0},
        output_tokens={"dist": "uniform", "low": 10, "high": 300},
    )
    arrivals = generate(cfg, seed=0)
    times = np.array([a.arrival_s for a in arrivals])
    outputs = np.array([a.output_tokens for a in arrivals])
    assert len(arrivals) == 100_000
    assert [a.request_id for a in arrivals] == list(range(100_000))
    assert times[0] > 0.0
    assert np.all(np.diff(times) >= 0.0)
    assert times[-1] == pytest.approx(100_000 / 1.0, rel=0.01)  # n / rate; sigma is 0.3%
    assert outputs.min() == 10
    assert outputs.max() == 300
    assert min(a.prompt_tokens for a in arrivals) >= 1
    assert generate(cfg, seed=0) == arrivals


# -- lengths -------------------------------------------------------------------------------------


def lengths(dist: dict[str, Any], n: int = 20_000, seed: int = 0) -> np.ndarray:
    arrivals = generate(config(num_requests=n, prompt_tokens=dist), seed)
    return np.array([a.prompt_tokens for a in arrivals])


def test_fixed_lengths_are_the_value() -> None:
    arrivals = generate(config(num_requests=100, output_tokens={"value": 3}), seed=0)
    assert {a.prompt_tokens for a in arrivals} == {8}
    assert {a.output_tokens for a in arrivals} == {3}


def test_uniform_lengths_cover_both_bounds_inclusive() -> None:
    tokens = lengths({"dist": "uniform", "low": 5, "high": 15})
    assert tokens.min() == 5
    assert tokens.max() == 15
    assert set(tokens.tolist()) == set(range(5, 16))
    assert tokens.mean() == pytest.approx(10.0, rel=0.02)


def test_lognormal_lengths_have_the_requested_mean() -> None:
    tokens = lengths({"dist": "lognormal", "mean": 1000.0, "sigma": 0.5})
    assert tokens.mean() == pytest.approx(1000.0, rel=0.02)
    assert np.log(tokens).std() == pytest.approx(0.5, rel=0.03)
    assert tokens.min() >= 1


def test_lognormal_lengths_are_clipped_to_low_and_high() -> None:
    tokens = lengths({"dist": "lognormal", "mean": 100.0, "sigma": 2.0, "low": 20, "high": 400})
    assert tokens.min() == 20
    assert tokens.max() == 400


def test_lognormal_lengths_are_at_least_one() -> None:
    tokens = lengths({"dist": "lognormal", "mean": 2.0, "sigma": 2.0})
    assert tokens.min() == 1
    assert tokens.dtype == np.int64


# -- trace readers -------------------------------------------------------------------------------


def test_azure_sample_values() -> None:
    arrivals = read_azure_csv(AZURE_SAMPLE)
    assert len(arrivals) == 20
    assert arrivals[0] == Arrival(0, 0.0, 374, 44)
    assert arrivals[1] == Arrival(1, 0.22064, 1024, 12)
    assert arrivals[6] == Arrival(6, 2.319417, 33, 17)  # 7th fraction digit kept
    assert arrivals[17] == Arrival(17, 13.56941, 6000, 2)  # across the minute
    assert arrivals[-1] == Arrival(19, 16.11941, 2222, 18)
    assert [a.request_id for a in arrivals] == list(range(20))


def test_mooncake_sample_values() -> None:
    arrivals = read_mooncake_jsonl(MOONCAKE_SAMPLE)
    assert len(arrivals) == 20
    assert arrivals[0] == Arrival(0, 0.0, 6755, 500)
    assert arrivals[1] == Arrival(1, 0.0, 7319, 490)
    assert arrivals[2] == Arrival(2, 0.519, 512, 12)
    assert arrivals[-1] == Arrival(19, 25.268, 1, 1)


def test_traces_are_sorted_and_relative_to_the_earliest(tmp_path: Path) -> None:
    csv_path = tmp_path / "t.csv"
    csv_path.write_text(
        AZURE_HEADER + "2024-01-01 00:00:02.5,30,3\n2024-01-01 00:00:01,10,1\n"
        "2024-01-01 00:00:02.5,20,2\n"
    )
    jsonl_path = tmp_path / "t.jsonl"
    jsonl_path.write_text(
        '{"timestamp": 3000, "input_length": 30, "output_length": 3}\n\n'
        '{"timestamp": 1000.5, "input_length": 10, "output_length": 1}\n'
    )
    assert read_azure_csv(csv_path) == [
        Arrival(0, 0.0, 10, 1),
        Arrival(1, 1.5, 30, 3),  # ties keep file order
        Arrival(2, 1.5, 20, 2),
    ]
    assert read_mooncake_jsonl(jsonl_path) == [Arrival(0, 0.0, 10, 1), Arrival(1, 1.9995, 30, 3)]


AZURE_BAD = [
    ("2023-11-16 18:15:47.0,12\n", "GeneratedTokens is missing"),  # two cells: last missing
    ("2023-11-16 18:15:47.0,,5\n", "ContextTokens is missing"),
    ("2023-11-16 18:15:47.0,abc,5\n", "ContextTokens='abc' is not an integer"),
    ("2023-11-16 18:15:47.0,12.5,5\n", "ContextTokens='12.5' is not an integer"),
    ("2023-11-16 18:15:47.0,-3,5\n", "ContextTokens=-3 must be >= 1"),
    ("2023-11-16 18:15:47.0,0,5\n", "ContextTokens=0 must be >= 1"),
    ("2023-11-16 18:15:47.0,12,0\n", "GeneratedTokens=0 must be >= 1"),
    ("2023-13-16 18:15:47.0,12,5\n", "TIMESTAMP='2023-13-16 18:15:47.0' is not a timestamp"),
    ("yesterday,12,5\n", "TIMESTAMP='yesterday' is not a timestamp"),
]


@pytest.mark.parametrize(("row", "message"), AZURE_BAD)
def test_azure_bad_row_names_file_line_and_field(tmp_path: Path, row: str, message: str) -> None:
    path = tmp_path / "bad.csv"
    path.write_text(AZURE_HEADER + AZURE_ROW + row)
    with pytest.raises(TraceError) as err:
        read_azure_csv(path)
    assert f"bad.csv:3: {message}" in str(err.value)


def test_azure_header_without_a_column_is_an_error(tmp_path: Path) -> None:
    path = tmp_path / "bad.csv"
    path.write_text("TIMESTAMP,ContextTokens,Output\n" + AZURE_ROW)
    with pytest.raises(TraceError, match=r"bad\.csv:1: header lacks column\(s\) GeneratedTokens"):
        read_azure_csv(path)


MOONCAKE_BAD = [
    ('{"timestamp": 5, "output_length": 2}\n', "input_length is missing"),
    ('{"input_length": 5, "output_length": 2}\n', "timestamp is missing"),
    ('{"timestamp": 5, "input_length": "many", "output_length": 2}\n', "input_length='many'"),
    ('{"timestamp": 5, "input_length": 7.5, "output_length": 2}\n', "input_length=7.5 is not"),
    ('{"timestamp": 5, "input_length": true, "output_length": 2}\n', "input_length=True is not"),
    ('{"timestamp": 5, "input_length": 0, "output_length": 2}\n', "input_length=0 must be >= 1"),
    ('{"timestamp": 5, "input_length": 9, "output_length": 0}\n', "output_length=0 must be >= 1"),
    ('{"timestamp": 5, "input_length": 9, "output_length": -1}\n', "output_length=-1 must be"),
    ('{"timestamp": "noon", "input_length": 9, "output_length": 1}\n', "timestamp='noon' is not"),
    ('{"timestamp": NaN, "input_length": 9, "output_length": 1}\n', "timestamp=nan is not"),
    ('{"timestamp": 5, "input_length": 9,\n', "not valid JSON"),
    ("[5, 9, 1]\n", "expected a JSON object"),
]


@pytest.mark.parametrize(("line", "message"), MOONCAKE_BAD)
def test_mooncake_bad_line_names_file_line_and_field(
    tmp_path: Path, line: str, message: str
) -> None:
    path = tmp_path / "bad.jsonl"
    path.write_text(MOONCAKE_ROW + "\n" + line)  # the blank line still counts
    with pytest.raises(TraceError) as err:
        read_mooncake_jsonl(path)
    assert f"bad.jsonl:3: {message}" in str(err.value)


@pytest.mark.parametrize(("name", "text"), [("e.csv", AZURE_HEADER), ("e.jsonl", "\n\n")])
def test_empty_trace_is_an_error(tmp_path: Path, name: str, text: str) -> None:
    path = tmp_path / name
    path.write_text(text)
    read = read_azure_csv if name.endswith(".csv") else read_mooncake_jsonl
    with pytest.raises(TraceError, match="has no requests"):
        read(path)


def test_missing_trace_file_is_a_trace_error(tmp_path: Path) -> None:
    with pytest.raises(TraceError, match=r"nope\.csv: cannot open trace"):
        read_azure_csv(tmp_path / "nope.csv")


# -- traces through generate ---------------------------------------------------------------------


def test_generate_reads_a_trace_relative_to_base_dir() -> None:
    arrivals = generate(config(trace="azure_sample.csv"), seed=0, base_dir=DATA)
    assert arrivals == read_azure_csv(AZURE_SAMPLE)


def test_generate_uses_trace_format_over_the_extension(tmp_path: Path) -> None:
    path = tmp_path / "mooncake.txt"
    path.write_text(MOONCAKE_SAMPLE.read_text())
    arrivals = generate(config(trace=str(path), trace_format="mooncake"), seed=0)
    assert arrivals == read_mooncake_jsonl(MOONCAKE_SAMPLE)


def test_generate_scales_then_limits_a_trace() -> None:
    trace = str(MOONCAKE_SAMPLE)
    scaled = generate(config(trace=trace, time_scale=0.5), seed=0)
    assert scaled[-1] == Arrival(19, 12.634, 1, 1)
    by_time = generate(config(trace=trace, time_scale=0.5, duration_s=4.0), seed=0)
    assert [a.arrival_s for a in by_time] == [
        0.0,
        0.0,
        0.2595,
        0.834,
        1.259,
        1.7585,
        2.384,
        2.759,
        3.764,
    ]
    by_count = generate(config(trace=trace, num_requests=3), seed=0)
    assert by_count == read_mooncake_jsonl(MOONCAKE_SAMPLE)[:3]


# -- config validation ---------------------------------------------------------------------------

BAD_CONFIGS = [
    ({"rate_per_s": -2.0, "num_requests": 5}, "rate_per_s", "greater than 0"),
    ({"rate_per_s": 0, "num_requests": 5}, "rate_per_s", "greater than 0"),
    ({"rate_per_s": float("inf"), "num_requests": 5}, "rate_per_s", "finite"),
    ({"arrival": "gamma", "cv": 0, "num_requests": 5}, "cv", "greater than 0"),
    ({"arrival": "weibull", "num_requests": 5}, "arrival", "'poisson' or 'gamma'"),
    ({}, "", "needs duration_s or num_requests"),
    ({"duration_s": -1.0}, "duration_s", "greater than 0"),
    ({"num_requests": 0}, "num_requests", "greater than or equal to 1"),
    ({"num_requests": 5, "rate": 3}, "rate", "Extra inputs are not permitted"),
    ({"num_requests": 5, "trace_format": "azure"}, "", "trace_format='azure' is set but trace"),
    ({"num_requests": 5, "time_scale": 2.0}, "", "time_scale=2.0 only applies to a trace"),
    ({"trace": "t.parquet"}, "", "cannot tell the format of trace 't.parquet'"),
    ({"trace": "t.csv", "time_scale": 0}, "time_scale", "greater than 0"),
    ({"num_requests": 5, "prompt_tokens": {"dist": "fixed"}}, "prompt_tokens", "needs 'value'"),
    (
        {"num_requests": 5, "prompt_tokens": {"dist": "fixed", "value": 0}},
        "prompt_tokens.value",
        "greater than or equal to 1",
    ),
    (
        {"num_requests": 5, "prompt_tokens": {"dist": "uniform", "low": 9, "high": 3}},
        "prompt_tokens",
        "low must be <= high, got low=9, high=3",
    ),
    (
        {"num_requests": 5, "output_tokens": {"dist": "uniform", "low": 9}},
        "output_tokens",
        "dist='uniform' needs 'high'",
    ),
    (
        {"num_requests": 5, "output_tokens": {"dist": "uniform", "value": 9, "low": 1, "high": 2}},
        "output_tokens",
        "dist='uniform' does not take 'value' (got value=9); it takes low, high",
    ),
    (
        {"num_requests": 5, "output_tokens": {"dist": "lognormal", "mean": 100, "sigma": 0}},
        "output_tokens.sigma",
        "greater than 0",
    ),
    (
        {"num_requests": 5, "output_tokens": {"dist": "lognormal", "mean": 100}},
        "output_tokens",
        "dist='lognormal' needs 'sigma'",
    ),
    (
        {"num_requests": 5, "output_tokens": {"dist": "zipf", "value": 3}},
        "output_tokens.dist",
        "'fixed', 'uniform' or 'lognormal'",
    ),
]


@pytest.mark.parametrize(("fields", "loc", "message"), BAD_CONFIGS)
def test_bad_config_is_a_validation_error_naming_the_field(
    fields: dict[str, Any], loc: str, message: str
) -> None:
    with pytest.raises(ValidationError) as err:
        config(**fields)
    (error,) = err.value.errors()
    assert ".".join(str(part) for part in error["loc"]) == loc
    assert message in str(err.value)


def test_lengths_are_required() -> None:
    with pytest.raises(ValidationError, match="prompt_tokens"):
        WorkloadConfig.model_validate({"num_requests": 5, "output_tokens": FIXED_8})


def test_configs_are_frozen() -> None:
    cfg = config(num_requests=5)
    with pytest.raises(ValidationError, match="frozen"):
        cfg.rate_per_s = 3.0
    with pytest.raises(ValidationError, match="frozen"):
        LengthDist(value=3).value = 4


def test_synthetic_workload_needs_lengths_but_a_trace_does_not() -> None:
    with pytest.raises(ValidationError, match="needs prompt_tokens and output_tokens"):
        WorkloadConfig(duration_s=10)
    assert WorkloadConfig(trace="x.csv").prompt_tokens is None
