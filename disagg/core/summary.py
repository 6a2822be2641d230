"""`summary.json`: a run's figures, versioned. docs/metrics.md defines every field.

    Summary.model_validate(summarize(...) | backend_keys).to_json()   # write_results does this
    Summary.read(raw, recompute)   # any version; an old one is brought up to date

Units are in the names (`_ms`, `_s`, `_bytes`), save vLLM's names for throughput
(`request_throughput`: requests per second, `*_throughput`: tokens per second). Latency
distributions are over the finished requests; throughput and goodput over the run's span
(`duration_s`: first arrival to last finish).

Schema versions: 0, files without `schema_version` (before this model): the `*_s_p50..p99`
percentiles, per-user TPS p50, transfers and counts. 1 adds the field-standard distributions
(mean, median, std, p90/p95/p99/p99.9 in ms), throughput, per-user TPS mean/p10/p90 and
goodput. A backend's own keys are typed optional sections below (None: that backend does not
write them); keys that no field names are kept as they are (extras), so a newer backend's
summary still reads.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from disagg.errors import ConfigError

SCHEMA_VERSION = 1

_WHAT = {
    "ttft": "time to first token (arrival to first token)",
    "tpot": "time per output token after the first, per request (one-token outputs left out)",
    "itl": "inter-token latency: a decoding sequence's wait per pass, over every sequence-pass",
    "e2e": "end-to-end latency (arrival to last token)",
    "queue": "queue delay (arrival to the request's first prefill pass)",
}
_STAT = {
    "mean": "mean",
    "median": "median",
    "std": "standard deviation (population)",
    "p90": "90th percentile",
    "p95": "95th percentile",
    "p99": "99th percentile",
    "p999": "99.9th percentile",
}


def _ms(stat: str, metric: str) -> Any:
    return Field(description=f"{_STAT[stat]} of the {_WHAT[metric]}, ms")


def _opt(description: str) -> Any:
    return Field(default=None, description=description)


class Summary(BaseModel):
    """A run's summary; see the module's docstring and docs/metrics.md."""

    model_config = ConfigDict(extra="allow")

    schema_version: int = Field(
        default=SCHEMA_VERSION, description="version of this schema (0: before it had one)"
    )
    # -- version 0 -------------------------------------------------------------------------
    ttft_s_p50: float = Field(description="TTFT median, s")
    ttft_s_p90: float = Field(description="TTFT 90th percentile, s")
    ttft_s_p99: float = Field(description="TTFT 99th percentile, s")
    tpot_s_p50: float = Field(description="TPOT median, s")
    tpot_s_p90: float = Field(description="TPOT 90th percentile, s")
    tpot_s_p99: float = Field(description="TPOT 99th percentile, s")
    itl_s_p50: float = Field(description="inter-token wait median (lower rank), s")
    itl_s_p90: float = Field(description="inter-token wait 90th percentile (lower rank), s")
    itl_s_p99: float = Field(description="inter-token wait 99th percentile (lower rank), s")
    itl_s_p999: float = Field(description="inter-token wait 99.9th percentile (lower rank), s")
    tps_per_user_p50: float = Field(description="median of 1 / TPOT, tokens/s (0 if none)")
    output_tps_per_gpu: float = Field(
        description="finished output tokens / simulated_s / gpus, tokens/s per GPU"
    )
    transfer_bytes_per_request: float = Field(description="mean KV bytes per transfer")
    transfer_ops_per_request: float = Field(description="mean write operations per transfer")
    transfer_s_p50: float = Field(description="median transfer time, first post to landing, s")
    completed: int = Field(description="requests finished")
    failed: int = Field(description="requests failed")
    unfinished: int = Field(description="requests neither finished nor failed")
    gpus: int = Field(description="GPUs in the cluster")
    simulated_s: float = Field(description="the last request's finish, s since the run's start")
    wall_s: float = Field(description="wall-clock time the run took, s")
    # -- version 1: field-standard distributions, ms ------------------------------------------
    mean_ttft_ms: float = _ms("mean", "ttft")
    median_ttft_ms: float = _ms("median", "ttft")
    std_ttft_ms: float = _ms("std", "ttft")
    p90_ttft_ms: float = _ms("p90", "ttft")
    p95_ttft_ms: float = _ms("p95", "ttft")
    p99_ttft_ms: float = _ms("p99", "ttft")
    p999_ttft_ms: float = _ms("p999", "ttft")
    mean_tpot_ms: float = _ms("mean", "tpot")
    median_tpot_ms: float = _ms("median", "tpot")
    std_tpot_ms: float = _ms("std", "tpot")
    p90_tpot_ms: float = _ms("p90", "tpot")
    p95_tpot_ms: float = _ms("p95", "tpot")
    p99_tpot_ms: float = _ms("p99", "tpot")
    p999_tpot_ms: float = _ms("p999", "tpot")
    mean_itl_ms: float = _ms("mean", "itl")
    median_itl_ms: float = _ms("median", "itl")
    std_itl_ms: float = _ms("std", "itl")
    p90_itl_ms: float = _ms("p90", "itl")
    p95_itl_ms: float = _ms("p95", "itl")
    p99_itl_ms: float = _ms("p99", "itl")
    p999_itl_ms: float = _ms("p999", "itl")
    mean_e2e_ms: float = _ms("mean", "e2e")
    median_e2e_ms: float = _ms("median", "e2e")
    std_e2e_ms: float = _ms("std", "e2e")
    p90_e2e_ms: float = _ms("p90", "e2e")
    p95_e2e_ms: float = _ms("p95", "e2e")
    p99_e2e_ms: float = _ms("p99", "e2e")
    p999_e2e_ms: float = _ms("p999", "e2e")
    mean_queue_ms: float = _ms("mean", "queue")
    median_queue_ms: float = _ms("median", "queue")
    std_queue_ms: float = _ms("std", "queue")
    p90_queue_ms: float = _ms("p90", "queue")
    p95_queue_ms: float = _ms("p95", "queue")
    p99_queue_ms: float = _ms("p99", "queue")
    p999_queue_ms: float = _ms("p999", "queue")
    # -- version 1: per-user speed, throughput, goodput ---------------------------------------
    mean_tps_per_user: float = Field(description="mean of 1 / TPOT per request, tokens/s")
    p10_tps_per_user: float = Field(description="10th percentile of 1 / TPOT, tokens/s")
    median_tps_per_user: float = Field(description="median of 1 / TPOT, tokens/s")
    p90_tps_per_user: float = Field(description="90th percentile of 1 / TPOT, tokens/s")
    duration_s: float = Field(description="the run's span: first arrival to last finish, s")
    total_input_tokens: int = Field(description="prompt tokens of the finished requests")
    total_output_tokens: int = Field(description="output tokens of the finished requests")
    request_throughput: float = Field(description="finished requests / duration_s, per s")
    input_throughput: float = Field(description="total_input_tokens / duration_s, tokens/s")
    output_throughput: float = Field(description="total_output_tokens / duration_s, tokens/s")
    total_token_throughput: float = Field(description="input + output tokens / duration_s")
    slo: str | None = _opt("the SLOs goodput was measured under, e.g. ttft_ms=500,tpot_ms=50")
    goodput_per_s: float | None = _opt("requests meeting every SLO / duration_s, per s")
    slo_met_fraction: float | None = _opt("fraction of all requests that met every SLO")
    # -- both backends ------------------------------------------------------------------------
    experiment: str | None = _opt("the experiment's name")
    faults: list[dict[str, Any]] | None = _opt("per fault: its label and the requests it failed")
    host_share_of_pass_time: float | None = _opt("passes' wall time outside the device span")
    # -- the simulator ------------------------------------------------------------------------
    nic_bytes_max: float | None = _opt("bytes sent by the busiest sending NIC")
    nic_busy_max: float | None = _opt("fraction of the run the busiest NIC was busy")
    gpu_shared_passes: int | None = _opt("passes that ran beside another node's on one GPU")
    gpu_shared_lost_s: float | None = _opt("what sharing it added to them (cluster.shared_gpu)")
    profile_passes: int | None = _opt("passes a measured profile costed (cost.source=profile)")
    profile_passes_extrapolated: int | None = _opt(
        "of them, passes beyond the profiled grid (extrapolated)"
    )
    # -- the hardware backend -----------------------------------------------------------------
    backend: str | None = _opt('"hw" for a hardware run')
    wire: str | None = _opt("the KV wire: tcp, cuda or verbs")
    node_settings: dict[str, dict[str, Any]] | None = _opt("per server: settings it ran with")
    passes_planned_ahead: int | None = _opt("passes planned while the previous one ran")
    graphs_captured_on_demand: int | None = _opt("CUDA graphs captured during the run")
    messages_before_start: int | None = _opt("control messages that came before the start")
    messages_dropped: int | None = _opt("control messages refused (servers and driver)")
    peers_declared_dead: int | None = _opt("peers the servers declared dead")
    faults_injected: int | None = _opt("faults the servers injected")
    pages_in_use: dict[str, int] | None = _opt("per server: KV pages still in use at the end")
    host_share_by_node: dict[str, float] | None = _opt("host_share_of_pass_time per server")
    queue_parts_ms: dict[str, float] | None = _opt("median of each part of the queue, ms")
    handoff_parts_ms: dict[str, float] | None = _opt("median of each part of the handoff, ms")
    stopped: str | None = _opt("why the run stopped early")
    startup_s: float | None = _opt("wall time from the run's start until every server was up")

    def fields(self) -> dict[str, Any]:
        """Every field and extra that is not None, by name."""
        return {k: v for k, v in self.model_dump().items() if v is not None}

    def to_json(self) -> str:
        """The JSON of summary.json: `fields()`, keys sorted, NaN written as NaN."""
        return json.dumps(self.fields(), indent=2, sort_keys=True) + "\n"

    @staticmethod
    def read(raw: dict[str, Any], recompute: Callable[[dict[str, Any]], dict[str, Any]]) -> Summary:
        """The summary from a summary.json's contents, of any version: one older than
        SCHEMA_VERSION gets the fields it lacks from `recompute(raw)` (the figures computed
        again from the run's tables), its own values kept."""
        version = int(raw.get("schema_version", 0))
        if version > SCHEMA_VERSION:
            raise ConfigError(f"summary.json: schema_version {version} is newer than this code")
        if version < SCHEMA_VERSION:
            raw = recompute(raw) | raw | {"schema_version": SCHEMA_VERSION}
        return Summary.model_validate(raw)


FIGURES = [
    name
    for name, f in Summary.model_fields.items()
    if f.annotation in (float, int, float | None, int | None) and name != "schema_version"
]
"""The fields that are one number, in the order above (`disagg sim compare --all` shows them)."""
