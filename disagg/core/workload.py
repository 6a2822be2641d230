"""Workloads: when requests arrive and how many tokens each reads and writes.

A workload is either synthetic (Poisson or gamma arrivals, fixed/uniform/lognormal lengths, drawn
from a seeded generator) or read from a trace file (the Azure LLM inference CSV or the Mooncake
JSONL format). Either way `generate` returns `Arrival`s sorted by time, numbered 0..n-1.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Literal, Self, TextIO

import numpy as np
from pydantic import BaseModel, ConfigDict, Field, model_validator

from disagg.errors import ConfigError, TraceError

TraceFormat = Literal["azure", "mooncake"]
TRACE_FORMAT_BY_SUFFIX: dict[str, TraceFormat] = {".csv": "azure", ".jsonl": "mooncake"}
_MAX_CHUNK = 1 << 20  # inter-arrival draws per batch when generating up to a duration


class LengthDist(BaseModel):
    """A distribution of token counts (every draw is an integer >= 1).

    - fixed: always `value`.
    - uniform: integers in [low, high], both inclusive.
    - lognormal: `mean` is the mean token count (not the mean of the log), `sigma` the standard
      deviation of the underlying normal; draws are rounded and clipped to [low or 1, high or
      unbounded], so clip bounds shift the realised mean.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    dist: Literal["fixed", "uniform", "lognormal"] = "fixed"
    value: int | None = Field(default=None, ge=1)
    low: int | None = Field(default=None, ge=1)
    high: int | None = Field(default=None, ge=1)
    mean: float | None = Field(default=None, ge=1, allow_inf_nan=False)
    sigma: float | None = Field(default=None, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _check_fields_of_dist(self) -> Self:
        needs: dict[str, tuple[str, ...]] = {
            "fixed": ("value",),
            "uniform": ("low", "high"),
            "lognormal": ("mean", "sigma"),
        }
        allowed = needs[self.dist] + (("low", "high") if self.dist == "lognormal" else ())
        for name in needs[self.dist]:
            if getattr(self, name) is None:
                raise ValueError(f"dist={self.dist!r} needs {name!r}")
        for name in ("value", "low", "high", "mean", "sigma"):
            if name not in allowed and getattr(self, name) is not None:
                raise ValueError(
                    f"dist={self.dist!r} does not take {name!r} (got {name}={getattr(self, name)});"
                    f" it takes {', '.join(allowed)}"
                )
        if self.low is not None and self.high is not None and self.low > self.high:
            raise ValueError(f"low must be <= high, got low={self.low}, high={self.high}")
        return self

    def sample(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` token counts, an int64 array of shape (n,), every entry >= 1."""
        if self.dist == "fixed":
            return np.full(n, self.value, dtype=np.int64)
        if self.dist == "uniform":
            assert self.low is not None  # narrows the type: the validator required it
            return rng.integers(self.low, self.high, size=n, endpoint=True, dtype=np.int64)
        assert self.mean is not None and self.sigma is not None  # as above
        mu = math.log(self.mean) - self.sigma**2 / 2
        tokens = np.rint(rng.lognormal(mu, self.sigma, size=n))
        return np.clip(tokens, self.low or 1, self.high).astype(np.int64)


class WorkloadConfig(BaseModel):
    """The `[workload]` table of an experiment file.

    Synthetic arrivals: `arrival` process at `rate_per_s` requests/s (gamma with coefficient of
    variation `cv` of the inter-arrival times; Poisson ignores `cv`), until `duration_s` seconds
    or `num_requests` requests, whichever ends first (at least one is needed). With `trace` set,
    arrivals and lengths come from the trace instead (`rate_per_s`, `cv`, `prompt_tokens` and
    `output_tokens` are then unused), timestamps are multiplied by `time_scale` (0.5 replays the
    trace twice as fast), and `duration_s`/`num_requests`, if set, cut it short.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    arrival: Literal["poisson", "gamma"] = "poisson"
    rate_per_s: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    cv: float = Field(default=1.0, gt=0, allow_inf_nan=False)
    duration_s: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    num_requests: int | None = Field(default=None, ge=1)
    prompt_tokens: LengthDist | None = None  # required without a trace
    output_tokens: LengthDist | None = None
    trace: str | None = None
    trace_format: TraceFormat | None = None
    time_scale: float = Field(default=1.0, gt=0, allow_inf_nan=False)

    @model_validator(mode="after")
    def _check_limits_and_trace(self) -> Self:
        if self.trace is None:
            if self.duration_s is None and self.num_requests is None:
                raise ValueError("a synthetic workload needs duration_s or num_requests (or both)")
            if self.prompt_tokens is None or self.output_tokens is None:
                raise ValueError("a synthetic workload needs prompt_tokens and output_tokens")
            if self.trace_format is not None:
                raise ValueError(f"trace_format={self.trace_format!r} is set but trace is not")
            if self.time_scale != 1.0:
                raise ValueError(f"time_scale={self.time_scale} only applies to a trace")
        elif self.trace_format is None and Path(self.trace).suffix not in TRACE_FORMAT_BY_SUFFIX:
            raise ValueError(
                f"cannot tell the format of trace {self.trace!r} from its extension"
                " (.csv is azure, .jsonl is mooncake): set trace_format"
            )
        return self

    @property
    def resolved_trace_format(self) -> TraceFormat | None:
        """The trace's format, given or inferred from the extension; None without a trace."""
        if self.trace is None:
            return None
        return self.trace_format or TRACE_FORMAT_BY_SUFFIX[Path(self.trace).suffix]


@dataclass(frozen=True, slots=True)
class Arrival:
    """One request: it arrives at `arrival_s` seconds after the workload starts."""

    request_id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int


def generate(
    cfg: WorkloadConfig,
    seed: int,
    base_dir: Path | None = None,
    max_context: int | None = None,
    model: str = "the model",
) -> list[Arrival]:
    """The workload's requests, sorted by arrival time and numbered 0..n-1.

    Synthetic workloads are drawn from `np.random.default_rng(seed)`, split into independent
    streams for arrival times, prompt and output lengths (so changing the rate keeps the lengths).
    The first arrival is at the first inter-arrival time, not at 0. A trace is read from
    `cfg.trace`, relative to `base_dir` when given and the path is relative; `seed` is unused.
    With `max_context` (the context of `model`, in tokens), a request whose prompt + output
    exceed it raises ConfigError (see `refuse_too_long`).
    """
    arrivals = _generate(cfg, seed, base_dir)
    if max_context is not None:
        source = "workload" if cfg.trace is None else f"workload.trace={cfg.trace!r}"
        refuse_too_long(arrivals, max_context, model, source)
    return arrivals


def refuse_too_long(arrivals: Sequence[Arrival], max_context: int, model: str, source: str) -> None:
    """Raise ConfigError naming the first of `arrivals` (from `source`) whose prompt + output
    exceed `model`'s context of `max_context` tokens, its lengths and how many are too long."""
    over = [a for a in arrivals if a.prompt_tokens + a.output_tokens > max_context]
    if not over:
        return
    a = over[0]
    raise ConfigError(
        f"{source}: request {a.request_id} ({len(over)} of {len(arrivals)} too long): "
        f"{a.prompt_tokens:,} prompt + {a.output_tokens:,} output = "
        f"{a.prompt_tokens + a.output_tokens:,} tokens exceed {model}'s context of "
        f"{max_context:,} tokens"
    )


def _generate(cfg: WorkloadConfig, seed: int, base_dir: Path | None) -> list[Arrival]:
    if cfg.trace is not None:
        return _from_trace(cfg, Path(cfg.trace), base_dir)
    times_rng, prompt_rng, output_rng = np.random.default_rng(seed).spawn(3)
    times = _arrival_times(cfg, times_rng)
    n = len(times)
    if cfg.prompt_tokens is None or cfg.output_tokens is None:  # the validator forbids it
        raise ValueError("a synthetic workload needs prompt_tokens and output_tokens")
    prompts = cfg.prompt_tokens.sample(prompt_rng, n)
    outputs = cfg.output_tokens.sample(output_rng, n)
    return _arrivals(times.tolist(), prompts.tolist(), outputs.tolist())


def _inter_arrivals(cfg: WorkloadConfig, rng: np.random.Generator, n: int) -> np.ndarray:
    """`n` inter-arrival gaps in seconds, mean 1/rate_per_s."""
    if cfg.arrival == "poisson":
        return rng.exponential(1.0 / cfg.rate_per_s, size=n)
    shape = 1.0 / cfg.cv**2
    return rng.gamma(shape, 1.0 / (cfg.rate_per_s * shape), size=n)


def _arrival_times(cfg: WorkloadConfig, rng: np.random.Generator) -> np.ndarray:
    """Arrival times in seconds, increasing, cut at num_requests and before duration_s."""
    if cfg.duration_s is None:
        assert cfg.num_requests is not None  # narrows the type: the validator required it
        return np.cumsum(_inter_arrivals(cfg, rng, cfg.num_requests))
    expected = cfg.rate_per_s * cfg.duration_s
    chunk = min(int(expected + 4 * math.sqrt(expected)) + 16, _MAX_CHUNK)
    if cfg.num_requests is not None:
        chunk = min(chunk, cfg.num_requests)
    parts: list[np.ndarray] = []
    drawn, start_s = 0, 0.0
    while start_s < cfg.duration_s and (cfg.num_requests is None or drawn < cfg.num_requests):
        part = start_s + np.cumsum(_inter_arrivals(cfg, rng, chunk))
        parts.append(part)
        drawn += chunk
        start_s = float(part[-1])
    times = np.concatenate(parts)
    return times[times < cfg.duration_s][: cfg.num_requests]


def _arrivals(times_s: list[float], prompts: list[int], outputs: list[int]) -> list[Arrival]:
    return [
        Arrival(i, t, p, o)
        for i, (t, p, o) in enumerate(zip(times_s, prompts, outputs, strict=True))
    ]


def _from_trace(cfg: WorkloadConfig, path: Path, base_dir: Path | None) -> list[Arrival]:
    if base_dir is not None and not path.is_absolute():
        path = base_dir / path
    read = read_azure_csv if cfg.resolved_trace_format == "azure" else read_mooncake_jsonl
    kept = [
        Arrival(a.request_id, a.arrival_s * cfg.time_scale, a.prompt_tokens, a.output_tokens)
        for a in read(path)
    ]
    if cfg.duration_s is not None:
        kept = [a for a in kept if a.arrival_s < cfg.duration_s]
    return kept[: cfg.num_requests]


# -- trace readers -------------------------------------------------------------------------------

AZURE_COLUMNS = ("TIMESTAMP", "ContextTokens", "GeneratedTokens")
_FRACTION = re.compile(r"\.(\d+)")


def read_azure_csv(path: str | Path) -> list[Arrival]:
    """Requests of an Azure LLM inference trace, a CSV with header
    `TIMESTAMP,ContextTokens,GeneratedTokens` and timestamps like `2023-11-16 18:15:46.6805900`.

    Arrival times are seconds after the earliest row (so the first arrival is at 0.0), kept to
    the nanosecond of the text. Raises TraceError naming file, line and field on a bad row.
    """
    path = Path(path)
    rows: list[tuple[int, int, int]] = []  # (time ns, prompt tokens, output tokens)
    with _open(path, encoding="utf-8-sig") as f:
        reader = csv.DictReader(f)
        missing = [c for c in AZURE_COLUMNS if c not in (reader.fieldnames or [])]
        if missing:
            raise TraceError(
                f"{path}:1: header lacks column(s) {', '.join(missing)}"
                f" (expected {','.join(AZURE_COLUMNS)}, got {reader.fieldnames})"
            )
        for row in reader:
            where = f"{path}:{reader.line_num}"
            for column in AZURE_COLUMNS:
                if row[column] is None or not row[column].strip():
                    raise TraceError(f"{where}: {column} is missing")
            rows.append(
                (
                    _timestamp_ns(row["TIMESTAMP"], f"{where}: TIMESTAMP"),
                    _tokens(row["ContextTokens"], f"{where}: ContextTokens"),
                    _tokens(row["GeneratedTokens"], f"{where}: GeneratedTokens"),
                )
            )
    return _sorted_arrivals(path, rows, 1e9)


def read_mooncake_jsonl(path: str | Path) -> list[Arrival]:
    """Requests of a Mooncake trace: one JSON object per line with `timestamp` (milliseconds),
    `input_length` and `output_length`; other keys (such as `hash_ids`) are ignored.

    Arrival times are seconds after the earliest request (so the first arrival is at 0.0).
    Raises TraceError naming file, line and field on a bad line; blank lines are skipped.
    """
    path = Path(path)
    rows: list[tuple[float, int, int]] = []  # (time ms, prompt tokens, output tokens)
    with _open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            where = f"{path}:{line_no}"
            try:
                record = json.loads(line)
            except json.JSONDecodeError as e:
                raise TraceError(f"{where}: not valid JSON ({e.msg})") from None
            if not isinstance(record, dict):
                raise TraceError(f"{where}: expected a JSON object, got {line.strip()[:60]!r}")
            for key in ("timestamp", "input_length", "output_length"):
                if key not in record:
                    raise TraceError(f"{where}: {key} is missing")
            rows.append(
                (
                    _timestamp_ms(record["timestamp"], f"{where}: timestamp"),
                    _tokens(record["input_length"], f"{where}: input_length"),
                    _tokens(record["output_length"], f"{where}: output_length"),
                )
            )
    return _sorted_arrivals(path, rows, 1e3)


def _open(path: Path, encoding: str) -> TextIO:
    try:
        return path.open(newline="", encoding=encoding)
    except OSError as e:
        raise TraceError(f"{path}: cannot open trace ({e.strerror})") from None


def _sorted_arrivals(
    path: Path, rows: Sequence[tuple[float, int, int]], per_second: float
) -> list[Arrival]:
    """A trace's (time, prompt, output) rows as arrivals: times in seconds after the earliest
    (`per_second` time units to a second), sorted (ties keep file order), numbered 0..n-1."""
    if not rows:
        raise TraceError(f"{path}: the trace has no requests")
    t0 = min(r[0] for r in rows)
    rebased = sorted([((t - t0) / per_second, p, o) for t, p, o in rows], key=lambda r: r[0])
    return _arrivals([r[0] for r in rebased], [r[1] for r in rebased], [r[2] for r in rebased])


def _tokens(value: object, where: str) -> int:
    """A token count >= 1 from a CSV cell or JSON value; `where` is "file:line: field"."""
    if isinstance(value, str):
        try:
            count = int(value.strip())
        except ValueError:
            raise TraceError(f"{where}={value!r} is not an integer") from None
    elif isinstance(value, int) and not isinstance(value, bool):
        count = value
    elif isinstance(value, float) and value.is_integer():
        count = int(value)
    else:
        raise TraceError(f"{where}={value!r} is not an integer")
    if count < 1:
        raise TraceError(f"{where}={count} must be >= 1 (every request reads and makes a token)")
    return count


def _timestamp_ns(text: str, where: str) -> int:
    """Nanoseconds since the epoch of an ISO-like timestamp with any number of fraction digits
    (naive times read as UTC); the fraction is parsed here since fromisoformat may reject 7."""
    match = _FRACTION.search(text)
    fraction_ns = 0
    whole = text.strip()
    if match is not None:
        fraction_ns = int(match.group(1)[:9].ljust(9, "0"))
        whole = (text[: match.start()] + text[match.end() :]).strip()
    try:
        stamp = datetime.fromisoformat(whole)
    except ValueError:
        raise TraceError(
            f"{where}={text!r} is not a timestamp like 2023-11-16 18:15:46.68"
        ) from None
    if stamp.tzinfo is None:
        stamp = stamp.replace(tzinfo=UTC)
    return int(stamp.timestamp()) * 1_000_000_000 + fraction_ns  # whole seconds: exact


def _timestamp_ms(value: object, where: str) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
        raise TraceError(f"{where}={value!r} is not a finite number of milliseconds")
    return float(value)
