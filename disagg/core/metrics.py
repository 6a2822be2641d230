"""Result tables shared by both backends, and the summary computed from them.

Every run writes three tables and a summary:
- requests: one row per request with its timestamps (seconds since the run's start);
- steps: one row per forward pass, or per run of `steps` identical decode passes
  (a decode node coalesces passes between batch changes; `duration_s` covers them all);
  `device_s` runs from the GPU reaching the pass's forward to its end (hw on CUDA: events
  around the forward, so gaps where the GPU waited for an eager pass's launches count; NaN on
  CPU; the simulator models device time only, so there it is `duration_s`), and
  `duration_s - device_s` is host time outside the forward (planning, inputs, sampling);
  `prefill_attn_pairs` and `decode_context` give the pass's shape as the cost models read it
  (`disagg.sim.costmodel.StepShape`): its chunks' attention pairs and its decodes' tokens in
  all (a run of passes: the first's), so a pass's time can be set against a model of it;
  on hw, `host_before_s` runs from a pass's start to the host beginning to launch its forward
  (the batch, its plan and inputs) and `launch_s` while the host launches it (on CUDA an eager
  forward's kernels, which the device runs meanwhile: about `device_s` where the pass waits
  on its launches; one graph replay; on the CPU the forward itself); NaN in the simulator;
- transfers: one row per request transfer (bytes, write operations, first post, last landing).
A hw run adds `hops`: when each request's control messages left and arrived (`queue_parts`
splits the queue by it).
Metrics, plots and notebooks read only these, so sim and hw results compare column by column.
The summary (summary.json) is `disagg.core.summary.Summary`; docs/metrics.md defines its fields.
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from disagg.core.request import Request, Status
from disagg.core.scheduler import Batch
from disagg.core.slo import Slo
from disagg.core.stats import goodput, standard_metrics
from disagg.core.summary import SCHEMA_VERSION, Summary
from disagg.errors import ConfigError

STEP_COLUMNS = [
    "node",
    "kind",
    "start_s",
    "duration_s",
    "steps",
    "batch_size",
    "decode_seqs",
    "tokens",
    "prefill_tokens",
    "device_s",
    "prefill_attn_pairs",
    "decode_context",
    "host_before_s",
    "launch_s",
    "chained",
]
TRANSFER_COLUMNS = [
    "request_id",
    "prefill_node",
    "decode_node",
    "bytes",
    "ops",
    "start_s",
    "end_s",
]


@dataclass(slots=True)
class Transfer:
    request_id: int
    prefill_node: int
    decode_node: int
    nbytes: float = 0.0
    ops: float = 0.0
    start_s: float = math.nan
    end_s: float = math.nan


@dataclass
class Recorder:
    """Collects step and transfer rows as a run goes (cheap appends, tables at the end)."""

    steps: list[tuple[Any, ...]] = field(default_factory=list)
    transfers: dict[int, Transfer] = field(default_factory=dict)

    def step(
        self,
        node: str,
        kind: str,
        start_s: float,
        duration_s: float,
        steps: int,
        batch_size: int,
        decode_seqs: int,
        tokens: int,
        prefill_tokens: int,
        device_s: float = math.nan,
        prefill_attn_pairs: float = math.nan,
        decode_context: float = math.nan,
        host_before_s: float = math.nan,
        launch_s: float = math.nan,
        chained: int = 0,
    ) -> None:
        """One pass (or `steps` identical decode passes); counts are per pass: sequences,
        decoding sequences, tokens (prefill tokens + decode queries), prefill tokens;
        `device_s`: the device's share of `duration_s` (see the module's docstring);
        `prefill_attn_pairs` and `decode_context` as `Batch`'s at the (first) pass;
        `host_before_s`, `launch_s` and `chained` as in `batch`."""
        counts = (steps, batch_size, decode_seqs, tokens, prefill_tokens)
        shape = (prefill_attn_pairs, decode_context)
        host = (host_before_s, launch_s, chained)
        self.steps.append((node, kind, start_s, duration_s, *counts, device_s, *shape, *host))

    def batch(
        self,
        node: str,
        kind: str,
        start_s: float,
        duration_s: float,
        batch: Batch,
        steps: int = 1,
        decode_qo: int = 1,
        device_s: float = math.nan,
        pairs: float | None = None,
        context: float | None = None,
        host_before_s: float = math.nan,
        launch_s: float = math.nan,
        chained: int = 0,
    ) -> None:
        """The row of `steps` passes of `batch`; each decoding sequence puts `decode_qo` query
        tokens into a pass (1 + draft tokens); `device_s` as in `step`; `pairs` and `context`:
        the first pass's `prefill_attn_pairs` and `decode_context` (None: `batch`'s now, which
        a caller that has not yet advanced its requests past these passes may leave); a hw
        pass's `host_before_s` (from its start to the host beginning to launch its forward)
        and `launch_s` (the host launching its forward), NaN where not measured; `chained`: how
        many of the passes were launched before the pass they follow was read
        (hw.latency.chain), their host time between passes hidden behind the device's."""
        chunks, d = batch.chunks, len(batch.decodes)
        prefill = sum(c.tokens for c in chunks) if chunks else 0  # batch.prefill_tokens, inlined
        rows, tokens = len(chunks) + d, prefill + d * decode_qo
        pairs = batch.prefill_attn_pairs if pairs is None else pairs
        context = batch.decode_context if context is None else context
        # the row of `step`, appended here: one per pass or run of passes
        self.steps.append(
            (
                node,
                kind,
                start_s,
                duration_s,
                steps,
                rows,
                d,
                tokens,
                prefill,
                device_s,
                pairs,
                context,
                host_before_s,
                launch_s,
                chained,
            )
        )

    def transfer(self, req: Request, nbytes: float, ops: float, start_s: float) -> None:
        t = self.transfers.get(req.id)
        if t is None:
            t = self.transfers[req.id] = Transfer(req.id, req.prefill_node, req.decode_node)
        t.nbytes += nbytes
        t.ops += ops
        t.start_s = start_s if math.isnan(t.start_s) else min(t.start_s, start_s)

    def landed(self, req_id: int, end_s: float) -> None:
        if req_id in self.transfers:
            self.transfers[req_id].end_s = end_s


def requests_table(requests: Iterable[Request]) -> pd.DataFrame:
    rows = [
        {
            "request_id": r.id,
            "arrival_s": r.arrival_s,
            "prompt_tokens": r.prompt_tokens,
            "output_tokens": r.output_tokens,
            "prefill_node": r.prefill_node,
            "decode_node": r.decode_node,
            "prefill_start_s": r.prefill_start_s,
            "prefill_end_s": r.prefill_end_s,
            "ready_s": r.ready_s,
            "first_token_s": r.first_token_s,
            "finish_s": r.finish_s,
            "ttft_s": r.ttft_s,
            "tpot_s": r.tpot_s,
            "status": str(r.status),
            "attempts": r.attempts,
            "fail_reason": r.fail_reason,
        }
        for r in sorted(requests, key=lambda r: r.id)
    ]
    return pd.DataFrame(rows)


def steps_table(rec: Recorder) -> pd.DataFrame:
    return pd.DataFrame(rec.steps, columns=STEP_COLUMNS)


def transfers_table(rec: Recorder) -> pd.DataFrame:
    rows = [
        (t.request_id, t.prefill_node, t.decode_node, t.nbytes, t.ops, t.start_s, t.end_s)
        for t in sorted(rec.transfers.values(), key=lambda t: t.request_id)
    ]
    return pd.DataFrame(rows, columns=TRANSFER_COLUMNS)


def _pcts(values: pd.Series, name: str) -> dict[str, float]:
    v = values.dropna().to_numpy(dtype=float)
    if len(v) == 0:
        return {f"{name}_p{p}": math.nan for p in (50, 90, 99)}
    return {f"{name}_p{p}": float(np.percentile(v, p)) for p in (50, 90, 99)}


def decode_waits(
    steps: pd.DataFrame, requests: pd.DataFrame | None = None
) -> tuple[pd.Series, pd.Series]:
    """(per-pass time in s, weight) of each row that carries decodes: a row of `steps` identical
    passes with `decode_seqs` decoding sequences is that many waits of `duration_s / steps`,
    one per sequence per pass (each a token, or with draft tokens the chunk a pass accepts).
    With `requests`, a sequence that passes without decodes kept waiting (a prefill-first
    scheduler's) waits from its token before them to the end of the pass that carries it on
    (`stalled_waits`), not that pass's time alone."""
    dec = steps[steps.decode_seqs > 0]
    wait, weight = dec.duration_s / dec.steps, dec.steps * dec.decode_seqs
    if requests is None or dec.empty:
        return wait, weight
    stalled, fewer = stalled_waits(steps, requests)
    if not stalled:
        return wait, weight
    weight = weight - pd.Series(fewer, dtype=float).reindex(weight.index, fill_value=0.0)
    return (
        pd.concat([wait, pd.Series(stalled, dtype=float)], ignore_index=True),
        pd.concat([weight, pd.Series(1.0, index=range(len(stalled)))], ignore_index=True),
    )


def stalled_waits(
    steps: pd.DataFrame, requests: pd.DataFrame
) -> tuple[list[float], dict[Any, int]]:
    """The waits of the decoding sequences that passes without decodes kept waiting, and per
    steps row after such passes, how many of its first pass's sequences those are. A request of
    a node (its `decode_node` is the node's number) that had its first token before the last
    of those passes began, and had not finished when it ended, waits from its token before them
    (the end of the node's last pass that carried decodes, or its first token if later) to the
    end of the first pass that carries decodes again: at most that pass's `decode_seqs` of
    them, the earliest first. A node that runs only passes with decodes, or none, has none."""
    waits: list[float] = []
    fewer: dict[Any, int] = {}
    started = requests[requests.first_token_s.notna()]
    for node, rows in steps.groupby("node", sort=False):
        number = re.fullmatch(r"[a-z_]+(\d+)", str(node))  # colocated0: the colocated node 0
        rows = rows.sort_values("start_s", kind="stable")
        carries = rows.decode_seqs.to_numpy() > 0
        if carries.all() or not carries.any() or number is None:
            continue
        mine = started[started.decode_node == int(number[1])].sort_values("first_token_s")
        first = mine.first_token_s.to_numpy(float)
        finish = mine.finish_s.fillna(math.inf).to_numpy(float)
        start, took = rows.start_s.to_numpy(float), rows.duration_s.to_numpy(float)
        end, first_pass = start + took, took / rows.steps.to_numpy(float)
        seqs = rows.decode_seqs.to_numpy(int)
        carrying = np.flatnonzero(carries)
        after = np.flatnonzero(carries[1:] & ~carries[:-1]) + 1  # after passes without decodes
        before = np.searchsorted(carrying, after) - 1  # the last pass with decodes before
        last_end = np.where(before >= 0, end[carrying[np.maximum(before, 0)]], -math.inf)
        active: list[int] = []  # requests past their first token, not seen to finish
        joined = 0
        for k, since in zip(after.tolist(), last_end.tolist(), strict=True):
            while joined < len(first) and first[joined] <= start[k - 1]:
                active.append(joined)
                joined += 1
            active = [i for i in active if finish[i] > end[k - 1]]
            kept = active[: seqs[k]]
            waits += [start[k] + first_pass[k] - max(first[i], since) for i in kept]
            if kept:
                fewer[rows.index[k]] = len(kept)
    return waits, fewer


def inter_token_latency(
    steps: pd.DataFrame, requests: pd.DataFrame | None = None
) -> dict[str, float]:
    """Percentiles of the pass time each decoding sequence waits for its next token(s): every
    pass that carries decodes (decode-only or mixed with prefill), weighted by the sequences it
    carries. A prefill that shares a pass with decodes shows up here as stutter; with
    `requests`, so does one that keeps them waiting in a pass of its own (`decode_waits`). The
    p-th percentile is the smallest wait with at least p of the weight at or below it."""
    return itl_percentiles(*decode_waits(steps, requests))


def itl_percentiles(wait_s: pd.Series, weight_s: pd.Series) -> dict[str, float]:
    """`inter_token_latency` of the waits `decode_waits` gives."""
    names = {500: "p50", 900: "p90", 990: "p99", 999: "p999"}  # per mille
    if wait_s.empty:
        return {f"itl_s_{n}": math.nan for n in names.values()}
    per_pass = wait_s.to_numpy(float)
    weight = weight_s.to_numpy(float)
    order = np.argsort(per_pass, kind="stable")
    # compared in whole numbers, exactly: as fractions, 99.9 / 100 rounds above 999 / 1000 and
    # p99.9 of 1000 passes would skip to the slowest
    cum_x1000 = np.cumsum(weight[order]) * 1000
    total = float(weight.sum())
    last = len(per_pass) - 1
    return {
        f"itl_s_{n}": float(per_pass[order][min(int(np.searchsorted(cum_x1000, q * total)), last)])
        for q, n in names.items()
    }


def host_share(steps: pd.DataFrame) -> float:
    """The fraction of the passes' wall time spent outside their device span (planning, inputs,
    sampling, the server's loop), over the passes whose device time was measured; NaN when
    none was (CPU runs, or tables from before `device_s`)."""
    if "device_s" not in steps:
        return math.nan
    timed = steps[steps.device_s.notna()]
    wall = float(timed.duration_s.sum())
    return 1 - float(timed.device_s.sum()) / wall if wall > 0 else math.nan


def queue_parts(requests: pd.DataFrame, hops: pd.DataFrame, parallel: bool) -> pd.DataFrame:
    """Each request's queue (arrival to its first prefill pass) split by its hops, in
    seconds, indexed by request id: the driver's lateness (`late`: arrival to sent), the hop to
    the node the request enters (`to_entry`: the decoder, or the colocated server), the
    decoder's handling until it hands the request on (`at_decoder`), the hop to the prefill
    node (`to_prefill`: from the decoder, or from the driver under `parallel` handoff), and
    the wait there until the pass (`prefill_wait`). NaN where a run has no such part."""
    role = hops.node.str.rstrip("0123456789")
    t = hops.assign(role=role).groupby(["request_id", "role", "event"]).t_s.min().unstack([1, 2])

    def at(key: tuple[str, str]) -> pd.Series:
        return t[key] if key in t else pd.Series(math.nan, index=t.index)

    sent, handed = at(("driver", "sent")), at(("decode", "handed_off"))
    entry = at(("decode", "received")).fillna(at(("colocated", "received")))
    at_prefill = at(("prefill", "received"))
    r = requests.set_index("request_id").reindex(t.index)
    return pd.DataFrame(
        {
            "late": sent - r.arrival_s,
            "to_entry": entry - sent,
            "at_decoder": handed - entry,
            "to_prefill": at_prefill - (sent if parallel else handed),
            "prefill_wait": r.prefill_start_s - at_prefill.fillna(entry),
        }
    )


def handoff_parts(requests: pd.DataFrame, hops: pd.DataFrame) -> pd.DataFrame:
    """Each disaggregated request's handoff (its prefill's end to its KV ready at the decoder)
    split by its decoder's `landed` stamp, in seconds, indexed by request id: the KV's last
    bytes and their immediate on their way (`to_decoder`: the prefill's end to the last
    immediate reaching the decoder's wire), and the wait until the decoder took it between
    its passes (`until_taken`). Empty for a run without `landed` stamps (colocated, or older)."""
    landed = hops[hops.event == "landed"].groupby("request_id").t_s.min()
    r = requests.set_index("request_id").reindex(landed.index)
    return pd.DataFrame({"to_decoder": landed - r.prefill_end_s, "until_taken": r.ready_s - landed})


def ttft_parts(requests: pd.DataFrame) -> pd.DataFrame:
    """Each finished request's TTFT in its parts, in seconds, indexed by request id: the queue
    (`queue`: arrival to its first prefill pass), the prefill (`prefill`: that pass's start to
    its last one's end), the handoff (`handoff`: to its KV ready at the decoder; 0 colocated,
    where the prefill's last pass gives the first token) and the first token (`first`: ready to
    the first token). They sum to its TTFT."""
    r = requests[requests.status == "finished"].set_index("request_id")
    ready = r.ready_s.fillna(r.prefill_end_s)
    return pd.DataFrame(
        {
            "queue": r.prefill_start_s - r.arrival_s,
            "prefill": r.prefill_end_s - r.prefill_start_s,
            "handoff": ready - r.prefill_end_s,
            "first": r.first_token_s - ready,
        }
    )


def summarize(
    requests: pd.DataFrame,
    steps: pd.DataFrame,
    transfers: pd.DataFrame,
    gpus: int,
    wall_s: float,
    slo: Slo | None = None,
) -> dict[str, Any]:
    """The fields of `Summary` (disagg/core/summary.py, docs/metrics.md) that the tables give:
    latencies over the finished requests, throughput over the run's span, inter-token waits
    from the steps, transfers, counts; goodput when `slo` is given. Backends add their own."""
    done = requests[requests.status == str(Status.FINISHED)]
    simulated_s = float(requests.finish_s.max()) if len(done) else 0.0
    out: dict[str, Any] = {"schema_version": SCHEMA_VERSION}
    out |= _pcts(done.ttft_s, "ttft_s")
    out |= _pcts(done.tpot_s, "tpot_s")
    out["tps_per_user_p50"] = float(np.median(1 / done.tpot_s.dropna())) if len(done) else 0.0
    tokens = float(done.output_tokens.sum())
    out["output_tps_per_gpu"] = tokens / simulated_s / gpus if simulated_s else 0.0
    waits = decode_waits(steps, requests)  # a node's stalls are found once, for both uses
    out |= itl_percentiles(*waits)
    out["transfer_bytes_per_request"] = float(transfers.bytes.mean()) if len(transfers) else 0.0
    out["transfer_ops_per_request"] = float(transfers.ops.mean()) if len(transfers) else 0.0
    out["transfer_s_p50"] = (
        float((transfers.end_s - transfers.start_s).median()) if len(transfers) else 0.0
    )
    out["completed"] = len(done)
    out["failed"] = int((requests.status == str(Status.FAILED)).sum())
    out["unfinished"] = len(requests) - out["completed"] - out["failed"]
    out["gpus"] = gpus
    out["simulated_s"] = simulated_s
    out["wall_s"] = wall_s
    return out | standard_metrics(requests, *waits, slo=slo)


def write_results(
    out_dir: Path,
    requests: pd.DataFrame,
    steps: pd.DataFrame,
    transfers: pd.DataFrame,
    summary: dict[str, Any],
) -> None:
    """Write the tables and `summary.json`: `summary` validated as a `Summary` (pydantic's
    ValidationError names a field that is not of its type), written with its keys sorted."""
    out_dir.mkdir(parents=True, exist_ok=True)
    requests.to_parquet(out_dir / "requests.parquet", index=False)
    steps.to_parquet(out_dir / "steps.parquet", index=False)
    transfers.to_parquet(out_dir / "transfers.parquet", index=False)
    (out_dir / "summary.json").write_text(Summary.model_validate(summary).to_json())


def read_results(run_dir: Path) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame, dict[str, Any]]:
    """The three tables and the summary of a run directory."""
    for name in ("requests.parquet", "steps.parquet", "transfers.parquet", "summary.json"):
        if not (run_dir / name).exists():
            raise ConfigError(f"{run_dir} is not a run directory: {name} is missing")
    return (
        pd.read_parquet(run_dir / "requests.parquet"),
        pd.read_parquet(run_dir / "steps.parquet"),
        pd.read_parquet(run_dir / "transfers.parquet"),
        json.loads((run_dir / "summary.json").read_text()),
    )


def read_summary(run_dir: Path, slo: Slo | None = None) -> Summary:
    """A run directory's summary, brought up to `SCHEMA_VERSION` from its tables if it is
    older; with `slo`, goodput is computed again from the requests under that SLO."""
    requests, steps, transfers, raw = read_results(run_dir)

    def recompute(old: dict[str, Any]) -> dict[str, Any]:
        if "gpus" not in old or "wall_s" not in old:
            raise ConfigError(f"{run_dir}/summary.json: no gpus or wall_s to recompute it from")
        return summarize(requests, steps, transfers, int(old["gpus"]), float(old["wall_s"]))

    summary = Summary.read(raw, recompute)
    if slo is None:
        return summary
    return Summary.model_validate(summary.model_dump() | goodput(requests, slo))
