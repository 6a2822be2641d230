"""Service-level objectives and goodput: the requests per second that meet every objective.

    Slo.parse("ttft_ms=500,tpot_ms=50")      # from the command line (--slo)
    slo.met(requests)                       # one bool per row of a requests table
    goodput_per_s(requests, slo, duration_s)

A request meets the objectives when it finished and each of its metrics is at or below the
bound: `ttft_ms` (time to first token), `tpot_ms` (time per output token after the first),
`e2e_ms` (arrival to last token). A bound left out is not checked; a metric a request lacks
(TPOT of a one-token output) meets it.
"""

from __future__ import annotations

import math

import pandas as pd
from pydantic import BaseModel, ConfigDict, Field

from disagg.core.request import Status
from disagg.errors import ConfigError


class Slo(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    ttft_ms: float | None = Field(default=None, gt=0)
    tpot_ms: float | None = Field(default=None, gt=0)
    e2e_ms: float | None = Field(default=None, gt=0)

    @staticmethod
    def parse(text: str) -> Slo:
        """`NAME=MS[,NAME=MS...]` with NAME one of ttft_ms, tpot_ms, e2e_ms; ConfigError naming
        the part that is not."""
        names = tuple(Slo.model_fields)
        values: dict[str, float] = {}
        for part in (p.strip() for p in text.split(",")):
            name, eq, value = part.partition("=")
            name = name.strip()
            if not eq or name not in names:
                raise ConfigError(f"--slo {text!r}: {part!r} is not NAME=MS with NAME in {names}")
            try:
                values[name] = float(value)
            except ValueError:
                raise ConfigError(f"--slo {text!r}: {name}={value!r} is not a number") from None
            if not values[name] > 0 or math.isinf(values[name]):
                raise ConfigError(f"--slo {text!r}: {name}={value} must be a positive bound")
        return Slo(**values)

    def __str__(self) -> str:
        return ",".join(f"{k}={v:g}" for k, v in self.model_dump().items() if v is not None)

    def met(self, requests: pd.DataFrame) -> pd.Series:
        """One bool per request: finished, and within every bound given."""
        ok = requests.status == str(Status.FINISHED)
        e2e_s = requests.finish_s - requests.arrival_s
        for bound_ms, value_s in (
            (self.ttft_ms, requests.ttft_s),
            (self.tpot_ms, requests.tpot_s),
            (self.e2e_ms, e2e_s),
        ):
            if bound_ms is not None:
                ok &= value_s.isna() | (value_s * 1e3 <= bound_ms)
        return ok


def goodput_per_s(requests: pd.DataFrame, slo: Slo, duration_s: float) -> float:
    """Requests per second that met every objective, over `duration_s` (the run's span)."""
    if duration_s <= 0:
        return 0.0
    return float(slo.met(requests).sum()) / duration_s
