"""The profile cost model's host time per pass and fixed per-pass cost, against hand arithmetic
on small hand-written tables (the interpolation itself: tests/test_costmodel.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, cast

import pandas as pd
import pytest

from disagg.config import build_experiment
from disagg.core.metrics import host_share, requests_table, steps_table
from disagg.errors import ConfigError
from disagg.sim.cluster import Sim
from disagg.sim.costmodel import (
    ProfileCost,
    RooflineCost,
    StepShape,
    make_cost_model,
    padded_chunk,
)

# prefill: 1 ms per 512 tokens; decode: 10 ms + 0.1 us per cached token of the batch.
# host_s medians: prefill 0.4 ms (of 0.2, 0.4, 0.9), decode 0.25 ms (of 0.1, 0.3, 0.5, 0.2)
PREFILL = [(512, 0.001, 0.0002), (1024, 0.002, 0.0004), (2048, 0.004, 0.0009)]
DECODE = [(1, 1000, 0.0001), (1, 3000, 0.0003), (8, 1000, 0.0005), (8, 3000, 0.0002)]
# a mixed pass of a 1024-token chunk beside 8 decodes of 2000: 4 ms under its two parts
# (2 ms + 11.6 ms), with 0.6 ms of host time
MIXED = "mixed,1024,8,2000,0.0096,0.0006"


def table(tmp_path: Path, mixed: bool = True, host: bool = True) -> Path:
    rows = [f"prefill,{n},1,0,{t},{h}" for n, t, h in PREFILL]
    rows += [f"decode,{b},{b},{c},{0.01 + b * c * 1e-7},{h}" for b, c, h in DECODE]
    rows += [MIXED] if mixed else []
    if not host:
        rows = [r.rsplit(",", 1)[0] for r in rows]
    header = "kind,tokens,batch,context,duration_s" + (",host_s" if host else "")
    path = tmp_path / "profile.csv"
    path.write_text("\n".join([header, *rows]) + "\n")
    return path


def prefill(n: int) -> StepShape:
    return StepShape(prefill_tokens=n, prefill_attn_pairs=n * (n + 1) / 2)


DECODE_8 = StepShape(decode_seqs=8, decode_context=16000)
MIXED_PASS = StepShape(
    prefill_tokens=512, prefill_attn_pairs=512 * 513 / 2, decode_seqs=1, decode_context=1000
)


def test_each_kind_of_pass_adds_the_median_host_time_of_its_rows(tmp_path: Path) -> None:
    c = ProfileCost(table(tmp_path))
    assert (c.prefill_host_s, c.decode_host_s, c.mixed_host_s) == pytest.approx(
        (0.0004, 0.00025, 0.0006)
    )
    # 768 tokens: halfway from 1 to 2 ms on the device
    assert c.step_time(prefill(768)) == pytest.approx(0.0015 + 0.0004)
    assert c.step_time(DECODE_8) == pytest.approx(0.01 + 16000e-7 + 0.00025)
    # the mixed rows' offset is of device time alone: 9.6 - (2 + 11.6) ms
    assert c.mixed_offset_s == pytest.approx(-0.004)
    # 512-token chunk (1 ms) + one decode of 1000 (10.1 ms) - 4 ms, + the mixed host time
    assert c.step_time(MIXED_PASS) == pytest.approx(0.001 + 0.0101 - 0.004 + 0.0006)
    assert c.step_time(StepShape()) == 0.0  # no pass, no host time


def test_the_decode_line_carries_the_host_time_so_merged_passes_match(tmp_path: Path) -> None:
    c = ProfileCost(table(tmp_path), pass_overhead_s=0.002)
    a, b = c.decode_line(8)
    assert (a, b) == pytest.approx((0.01 + 0.00025 + 0.002, 1e-7))
    assert a + b * 16000 == pytest.approx(c.step_time(DECODE_8))


def test_a_fixed_cost_per_pass_is_added_to_every_pass(tmp_path: Path) -> None:
    c = ProfileCost(table(tmp_path), pass_overhead_s=0.002)
    assert c.step_time(prefill(768)) == pytest.approx(0.0015 + 0.0004 + 0.002)
    assert c.step_time(MIXED_PASS) == pytest.approx(0.0071 + 0.0006 + 0.002)


def test_a_mixed_pass_without_mixed_rows_pays_the_larger_host_time(tmp_path: Path) -> None:
    c = ProfileCost(table(tmp_path, mixed=False))
    assert c.mixed_host_s == pytest.approx(0.0004)  # prefill's, above decode's 0.25 ms
    assert c.step_time(MIXED_PASS) == pytest.approx(0.001 + 0.0101 + 0.0004)


def test_a_table_without_host_s_costs_device_time_only(tmp_path: Path) -> None:
    c = ProfileCost(table(tmp_path, host=False))
    assert (c.prefill_host_s, c.decode_host_s, c.mixed_host_s) == (0.0, 0.0, 0.0)
    assert c.step_time(prefill(768)) == pytest.approx(0.0015)
    assert c.step_time(DECODE_8) == pytest.approx(0.0116)


def test_bad_host_times_and_overheads_are_refused_naming_them(tmp_path: Path) -> None:
    path = table(tmp_path)
    path.write_text(path.read_text().replace("0.0009", "-0.0009"))
    with pytest.raises(ConfigError, match=r"host_s -0.0009: give seconds >= 0"):
        ProfileCost(path)
    with pytest.raises(ConfigError, match=r"pass_overhead_s -1.0: give seconds >= 0"):
        ProfileCost(table(tmp_path), pass_overhead_s=-1.0)


def test_a_simulated_request_pays_the_host_time_on_every_pass(tmp_path: Path) -> None:
    """One request at a time: with 1 ms more host time on every row, each request's TTFT (one
    prefill pass) and TPOT (one decode pass per token) grow by exactly 1 ms."""
    base, slower = [timings(sim) for sim in (host_run(tmp_path, 0.0), host_run(tmp_path, 0.001))]
    assert len(base) == 3
    for (ttft, tpot), (ttft2, tpot2) in zip(base, slower, strict=True):
        assert ttft2 - ttft == pytest.approx(0.001, abs=1e-9)
        assert tpot2 - tpot == pytest.approx(0.001, abs=1e-9)


def test_a_replay_records_the_host_time_outside_the_device_time(tmp_path: Path) -> None:
    """With 1 ms of host time on every row, each steps row's device time is its duration less
    1 ms per pass, and the host share is their ratio (as a hw run's)."""
    steps = steps_table(host_run(tmp_path, 0.001).rec)
    assert set(steps.kind) == {"mixed", "decode"}  # chunk-only passes are "mixed" when colocated
    host = steps.duration_s - steps.device_s
    assert host.to_list() == pytest.approx((0.001 * steps.steps).to_list(), abs=1e-12)
    share = (0.001 * steps.steps).sum() / steps.duration_s.sum()
    assert host_share(steps) == pytest.approx(share)
    assert host_share(steps_table(host_run(tmp_path, 0.0).rec)) == 0.0


def timings(sim: Sim) -> list[tuple[float, float]]:
    req = requests_table(sim.requests.values())
    return list(zip(req.ttft_s, req.tpot_s, strict=True))


def host_run(tmp_path: Path, host_s: float) -> Sim:
    """A finished colocated Sim of three requests, one at a time, on a profile whose every
    row has `host_s` of host time."""
    rows = [f"prefill,{n},1,0,{t},{host_s}" for n, t, _ in PREFILL]
    rows += [f"decode,{b},{b},{c},{0.01 + b * c * 1e-7},{host_s}" for b, c, _ in DECODE]
    path = tmp_path / f"host-{host_s}.csv"
    path.write_text("kind,tokens,batch,context,duration_s,host_s\n" + "\n".join(rows))
    return one_at_a_time({"mode": "colocated", "colocated": {"nodes": 1, "tp": 1}}, path)


def one_at_a_time(cluster: dict[str, Any], profile: Path, **cost: float) -> Sim:
    """A finished Sim of three requests of 600 + 5 tokens, one at a time, of tiny-gqa on
    `cluster` and `profile` (with `cost` settings)."""
    data = {
        "model": {"name": "tiny-gqa"},
        "cluster": cluster,
        "cost": {"source": f"profile:{profile}", **cost},
        "workload": {
            "rate_per_s": 0.5,
            "num_requests": 3,
            "prompt_tokens": {"dist": "fixed", "value": 600},
            "output_tokens": {"dist": "fixed", "value": 5},
        },
    }
    sim = Sim(build_experiment(data))
    sim.run()
    return sim


def test_the_host_part_of_a_pass_is_its_host_time_and_overhead(tmp_path: Path) -> None:
    c = ProfileCost(table(tmp_path), pass_overhead_s=0.002, run_host=(0.001, 0.003, 0.0001))
    assert c.host_s(False, 8) == pytest.approx(0.001 + 8 * 0.0001 + 0.002)
    assert c.host_s(True, 1) == pytest.approx(0.003 + 2 * 0.0001 + 0.002)
    assert c.host_s(True, 0) == pytest.approx(0.003 + 0.0001 + 0.002)
    # the same parts that step_time adds to the device time
    device = 0.01 + 16000e-7
    assert c.step_time(DECODE_8) - c.host_s(False, 8) == pytest.approx(device)
    exp = build_experiment({"model": {"name": "llama-3.1-8b"}})
    roofline = make_cost_model(exp, exp.cluster.prefill)
    assert isinstance(roofline, RooflineCost)
    assert roofline.host_s(True, 3) == 0.0  # it models the device alone


def test_host_time_measured_on_a_run_replaces_the_tables_and_grows_with_the_batch(
    tmp_path: Path,
) -> None:
    """run_host: 1 ms per decode pass, 3 ms per pass with a chunk, 0.1 ms per sequence."""
    c = ProfileCost(table(tmp_path), run_host=(0.001, 0.003, 0.0001))
    assert c.step_time(DECODE_8) == pytest.approx(0.01 + 16000e-7 + 0.001 + 8 * 0.0001)
    assert c.decode_line(8)[0] == pytest.approx(0.01 + 0.001 + 8 * 0.0001)
    # the chunk counts as one sequence beside its one decode
    assert c.step_time(MIXED_PASS) == pytest.approx(0.001 + 0.0101 - 0.004 + 0.003 + 2 * 0.0001)
    assert c.step_time(prefill(768)) == pytest.approx(0.0015 + 0.003 + 0.0001)
    with pytest.raises(ConfigError, match="run_host"):
        ProfileCost(table(tmp_path), run_host=(0.001, -1.0, 0.0))


def test_a_mixed_pass_has_its_own_host_line_over_its_decodes_where_given(tmp_path: Path) -> None:
    """run_host as above, and a mixed pass 2 ms + 0.3 ms a decode: a chunk beside decodes
    costs that line, a chunk alone 3 ms + 0.1 ms (one sequence) as before, a decode pass the
    same; from the experiment's [cost] fields too."""
    own = ProfileCost(table(tmp_path), run_host=(0.001, 0.003, 0.0001, 0.002, 0.0003))
    plain = ProfileCost(table(tmp_path), run_host=(0.001, 0.003, 0.0001))
    assert own.host_s(True, 4) == pytest.approx(0.002 + 4 * 0.0003)
    assert plain.host_s(True, 4) == pytest.approx(0.003 + 5 * 0.0001)
    assert own.host_s(True, 0) == plain.host_s(True, 0) == pytest.approx(0.003 + 0.0001)
    assert own.host_s(False, 8) == plain.host_s(False, 8)
    assert own.step_time(MIXED_PASS) - plain.step_time(MIXED_PASS) == pytest.approx(
        0.002 + 0.0003 - (0.003 + 2 * 0.0001)
    )
    data = {
        "model": {"name": "tiny-gqa"},
        "cluster": {"mode": "colocated", "colocated": {"nodes": 1, "tp": 1}},
        "cost": {"source": f"profile:{table(tmp_path)}"},
    }
    fields = ["profile_host_s=0.001", "profile_host_chunk_s=0.003", "profile_host_per_seq_s=1e-4"]
    mixed = ["profile_host_mixed_s=0.002", "profile_host_mixed_per_seq_s=3e-4"]
    exp = build_experiment(data, [f"cost.{f}" for f in [*fields, *mixed]])
    cost = make_cost_model(exp, exp.cluster.colocated)
    assert isinstance(cost, ProfileCost) and cost.run_host == own.run_host
    with pytest.raises(ConfigError, match="give 3 or 5 times"):
        ProfileCost(table(tmp_path), run_host=(0.001, 0.003, 0.0001, 0.002))


def test_the_mixed_offset_interpolates_over_the_chunk_and_the_decodes(tmp_path: Path) -> None:
    """Offsets measured at (2 decodes, 512 tokens) -2 ms, (2, 2048) -4 ms, (8, 512) -1 ms and
    (8, 2048) -3 ms: between them, linear in the chunk, then in the decodes; held beyond."""

    def parts(n: int, b: int) -> float:  # the table's prefill and decode parts at context 1000
        return n / 512 * 0.001 + 0.01 + b * 1000 * 1e-7

    rows = [(512, 2, -0.002), (2048, 2, -0.004), (512, 8, -0.001), (2048, 8, -0.003)]
    path = table(tmp_path, mixed=False)
    with path.open("a") as f:
        f.writelines(f"mixed,{n},{b},1000,{parts(n, b) + off},0\n" for n, b, off in rows)
    c = ProfileCost(path)
    assert c.mixed_offset(2, 512) == pytest.approx(-0.002)
    assert c.mixed_offset(2, 1280) == pytest.approx(-0.003)  # halfway in the chunk
    assert c.mixed_offset(5, 1280) == pytest.approx(-0.0025)  # and halfway in the decodes
    assert c.mixed_offset(32, 4096) == pytest.approx(-0.003)  # held beyond both
    assert c.mixed_offset_s == pytest.approx(-0.0025)  # the median of the four


def test_the_mixed_offset_follows_the_decodes_own_time_between_batches(tmp_path: Path) -> None:
    """An MoE-like decode part: 5, 8, 10 and 11 ms at 1, 2, 4 and 8 sequences (each new one
    activates experts of its own, then fewer). Beside a 512-token chunk, 1 decode costs its two
    parts and 8 decodes 6 ms under them. 4 decodes take 5/6 of the decode time's rise from 1 to
    8, so 5/6 of the offset (-5 ms), not 3/7 of it as by their count."""
    decode = {1: 0.005, 2: 0.008, 4: 0.010, 8: 0.011}
    rows = [f"prefill,{n},1,0,{t},0" for n, t, _ in PREFILL]
    rows += [f"decode,{b},{b},1000,{t},0" for b, t in decode.items()]
    rows += ["mixed,512,1,1000,0.006,0", f"mixed,512,8,1000,{0.001 + 0.011 - 0.006},0"]
    path = tmp_path / "moe.csv"
    path.write_text("\n".join(["kind,tokens,batch,context,duration_s,host_s", *rows]) + "\n")
    c = ProfileCost(path)
    assert c.mixed_offset(1, 512) == pytest.approx(0.0)
    assert c.mixed_offset(4, 512) == pytest.approx(-0.005)
    assert c.mixed_offset(2, 512) == pytest.approx(-0.003)  # 3/6 of the rise
    assert c.mixed_offset(16, 512) == pytest.approx(-0.006)  # held beyond


def test_chunk_offsets_are_interpolated_over_the_chunk_and_held_beyond(tmp_path: Path) -> None:
    """(100 tokens, +10 ms), (1000 tokens, -2 ms): +4 ms halfway, the ends held beyond."""
    c = ProfileCost(table(tmp_path), chunk_offsets=[(100, 0.01), (1000, -0.002)])
    assert c.chunk_offset(550) == pytest.approx(0.004)
    assert (c.chunk_offset(50), c.chunk_offset(4000)) == (0.01, -0.002)
    plain = ProfileCost(table(tmp_path))
    offset = 0.01 - (768 - 100) / 900 * 0.012
    assert c.step_time(prefill(768)) == pytest.approx(plain.step_time(prefill(768)) + offset)
    # a mixed pass gets it beside its mixed offset; a decode pass does not
    assert c.step_time(MIXED_PASS) == pytest.approx(
        plain.step_time(MIXED_PASS) + c.chunk_offset(512)
    )
    assert c.step_time(DECODE_8) == plain.step_time(DECODE_8)
    assert c.decode_line(8) == plain.decode_line(8)


def test_chunk_offsets_come_from_the_experiment_and_bad_ones_are_refused(tmp_path: Path) -> None:
    data = {
        "model": {"name": "tiny-gqa"},
        "cluster": {"mode": "colocated", "colocated": {"nodes": 1, "tp": 1}},
        "cost": {"source": f"profile:{table(tmp_path)}"},
    }
    exp = build_experiment(data, ["cost.profile_chunk_offsets=[[100.0, 0.01], [1000.0, -0.002]]"])
    cost = make_cost_model(exp, exp.cluster.colocated)
    assert isinstance(cost, ProfileCost) and cost.chunk_offset(550) == pytest.approx(0.004)
    with pytest.raises(ConfigError, match=r"chunk_offsets \[\(1000.0, 0.01\), \(100.0, 0.0\)\]"):
        ProfileCost(table(tmp_path), chunk_offsets=[(1000.0, 0.01), (100.0, 0.0)])
    with pytest.raises(ConfigError, match="tokens > 0 increasing"):
        ProfileCost(table(tmp_path), chunk_offsets=[(0, 0.01)])


def test_the_decode_scale_multiplies_the_device_time_of_the_decodes_alone(tmp_path: Path) -> None:
    """decode_scale 0.9: a decode pass's device time (10 ms + 1.6 ms for its 16,000 cached
    tokens) and both terms of its line times 0.9, its host time as it was; a chunk pass as it
    was. An experiment's `cost.profile_decode_scale` goes to a decode node's cost model only."""
    host = 0.001 + 8 * 0.0001
    c = ProfileCost(table(tmp_path), run_host=(0.001, 0.003, 0.0001), decode_scale=0.9)
    assert c.step_time(DECODE_8) == pytest.approx(0.9 * (0.01 + 16000e-7) + host)
    assert c.decode_line(8) == pytest.approx((0.9 * 0.01 + host, 0.9 * 1e-7))
    assert c.step_time(prefill(768)) == pytest.approx(0.0015 + 0.003 + 0.0001)
    with pytest.raises(ConfigError, match=r"decode_scale 0\.0"):
        ProfileCost(table(tmp_path), decode_scale=0.0)
    cost = {"source": f"profile:{table(tmp_path)}", "profile_decode_scale": 0.9}
    one_gpu = {"nodes": 1, "tp": 1}
    cluster = {"mode": "disagg", "prefill": one_gpu, "decode": one_gpu}
    exp = build_experiment({"model": {"name": "tiny-gqa"}, "cluster": cluster, "cost": cost})
    scales = {
        role: cast(ProfileCost, make_cost_model(exp, exp.cluster.decode, role)).decode_scale
        for role in ("decode", "prefill", "colocated")
    }
    assert scales == {"decode": 0.9, "prefill": 1.0, "colocated": 1.0}


def test_a_simulated_decode_node_runs_its_passes_at_the_decode_scale(tmp_path: Path) -> None:
    """One request at a time on a profile without host time: at decode scale 0.5 each
    request's TPOT (one decode pass a token) is half of what it is at 1, its prefill as long."""
    cluster = {"mode": "disagg", "prefill": {"tp": 1}, "decode": {"tp": 1}}
    no_host = table(tmp_path, host=False)
    runs = [
        requests_table(
            one_at_a_time(cluster, no_host, profile_decode_scale=scale).requests.values()
        )
        for scale in (1.0, 0.5)
    ]
    base, fast = runs
    assert len(base) == 3
    assert fast.tpot_s.to_list() == pytest.approx((0.5 * base.tpot_s).to_list(), rel=1e-9)
    prefill_s = [r.prefill_end_s - r.prefill_start_s for r in runs]
    assert prefill_s[1].to_list() == pytest.approx(prefill_s[0].to_list(), rel=1e-9)


def graph_table(tmp_path: Path, graphs: bool = True) -> Path:
    """Decode passes of 10 / 11 / 12.5 / 14 ms at batches 1 / 4 / 6 / 8, plus 0.1 us per cached
    token of the batch, at two contexts each; batch 6 replayed the graph of 8 (graph_batch)."""
    fixed = {1: 0.010, 4: 0.011, 6: 0.0125, 8: 0.014}
    graph = {1: 1, 4: 4, 6: 8, 8: 8}
    rows = ["prefill,512,1,0,0.001,0,0"]
    rows += [
        f"decode,{b},{b},{c},{a + b * c * 1e-7},0,{graph[b]}"
        for b, a in fixed.items()
        for c in (1000, 3000)
    ]
    path = tmp_path / "graphs.csv"
    lines = ["kind,tokens,batch,context,duration_s,host_s,graph_batch", *rows]
    if not graphs:
        lines = [line.rsplit(",", 1)[0] for line in lines]
    path.write_text("\n".join(lines) + "\n")
    return path


def test_a_decode_pass_in_a_cuda_graph_costs_the_rows_its_graph_ran(tmp_path: Path) -> None:
    """5 decodes of 5,000 cached tokens in all: in a server that replays graphs, the rows that
    ran in its graph, the graph of 8 (the smallest row that filled its graph at or above 5;
    batch 6 replayed 8's and is not one): 6 and 8, held below 6: 12.5 + 0.5 ms; 7 decodes
    between them, 13.25 ms; 2 decodes, in the graph of 4, 4's line (1 is the graph before).
    In a server that does not, or with a table that does not say which graph a row
    replayed, interpolated between 4 and 6: 11 + 1/2 x 1.5 + 0.5 ms. A mixed pass runs
    eagerly and interpolates. Above the largest graph a pass is itself."""
    five = StepShape(decode_seqs=5, decode_context=5000)
    padded = ProfileCost(graph_table(tmp_path), graphs=True)
    assert [padded.graph_batch(b) for b in (1, 2, 4, 5, 7, 8, 9)] == [1, 4, 4, 8, 8, 8, 9]
    assert [list(padded.graph_rows(b)) for b in (1, 2, 5, 8, 9)] == [
        [1],
        [4],
        [6, 8],
        [6, 8],
        [1, 4, 6, 8],
    ]
    assert padded.step_time(five) == pytest.approx(0.013)
    assert padded.decode_line(5) == pytest.approx((0.0125, 1e-7))
    assert padded.decode_line(7) == pytest.approx((0.01325, 1e-7))
    assert padded.decode_line(2) == pytest.approx((0.011, 1e-7))
    eager = 0.01175 + 0.0005
    assert ProfileCost(graph_table(tmp_path)).step_time(five) == pytest.approx(eager)
    no_column = ProfileCost(graph_table(tmp_path, graphs=False), graphs=True)
    assert no_column.step_time(five) == pytest.approx(eager)
    mixed = StepShape(512, 512 * 513 / 2, decode_seqs=5, decode_context=5000)
    assert padded.step_time(mixed) == pytest.approx(0.001 + eager)
    # a hw server replays decode graphs on one GPU a rank, and never on a prefill server
    one = {"nodes": 1, "tp": 1}
    cluster = {"mode": "disagg", "prefill": one, "decode": one}
    cost = {"source": f"profile:{graph_table(tmp_path)}"}
    exp = build_experiment({"model": {"name": "tiny-gqa"}, "cluster": cluster, "cost": cost})
    tp2 = exp.cluster.decode.model_copy(update={"tp": 2})
    models = [
        make_cost_model(exp, exp.cluster.decode, "decode"),
        make_cost_model(exp, exp.cluster.decode, "colocated"),
        make_cost_model(exp, exp.cluster.prefill, "prefill"),
        make_cost_model(exp, tp2, "decode"),
    ]
    assert [cast(ProfileCost, m).graph_batch(5) for m in models] == [8, 8, 5, 5]


def test_a_mixed_pass_measured_at_two_contexts_grows_with_its_decodes_context(
    tmp_path: Path,
) -> None:
    """A 1024-token chunk beside 8 decodes ran 4 ms under its two parts at 2,000 tokens a
    decode (16,000 in all) and 0.8 ms under at 4,000 (32,000): 0.2 us more per token of the
    decodes' context. So the offset at no context is -4 - 3.2 = -7.2 ms, and the same pass at
    3,000 tokens a decode costs 2 (chunk) + 12.4 (decodes) - 7.2 + 4.8 = 12.0 ms. Measured at
    one context, the slope is 0 and the offset as measured (-4 ms)."""
    rows = [f"prefill,{n},1,0,{t},0" for n, t, _ in PREFILL]
    rows += [f"decode,{b},{b},{c},{0.01 + b * c * 1e-7},0" for b, c, _ in DECODE]
    rows += ["mixed,1024,8,2000,0.0096,0", "mixed,1024,8,4000,0.0144,0"]
    path = tmp_path / "two.csv"
    path.write_text("\n".join(["kind,tokens,batch,context,duration_s,host_s", *rows]) + "\n")
    c = ProfileCost(path)
    assert c.mixed_context_s == pytest.approx(2e-7)
    assert c.mixed_offset(8, 1024) == pytest.approx(-0.0072)
    three = StepShape(1024, 1024 * 1025 / 2, decode_seqs=8, decode_context=24000)
    assert c.step_time(three) == pytest.approx(0.012)
    one = ProfileCost(table(tmp_path))
    assert one.mixed_context_s == 0.0 and one.mixed_offset(8, 1024) == pytest.approx(-0.004)


def pieces_table(tmp_path: Path) -> Path:
    """Chunks profiled at 300, 700 and 2048 tokens (1, 2, 4 ms; after 2,048 cached: 1.5, 2.5,
    6 ms) by a server that ran them in pieces of 512, 1024 and 2048 tokens."""
    rows = [f"prefill,{n},1,0,{t},0" for n, t in ((300, 0.001), (700, 0.002), (2048, 0.004))]
    rows += [f"prefill,{n},1,2048,{t},0" for n, t in ((300, 0.0015), (700, 0.0025), (2048, 0.006))]
    rows += [f"decode,{b},{b},{c},{0.01 + b * c * 1e-7},0" for b, c, _ in DECODE]
    path = tmp_path / "pieces.csv"
    path.write_text("\n".join(["kind,tokens,batch,context,duration_s,host_s", *rows]) + "\n")
    return path


def test_a_chunk_in_a_piece_costs_the_piece_at_its_own_attention(tmp_path: Path) -> None:
    """In pieces of 512, 1024 and 2048 tokens a pass is padded to the next size up, and so
    were the profile's: its 300- and 700-token rows are the 512 and 1024 pieces. A 1,235-token
    chunk costs the 2048 piece (4 ms), not 2 + 535/1348 x 2 ms between 700 and 2048; a 450-token
    chunk after 2,048 cached tokens costs the 512 piece at the context that gives 512 rows its
    attention pairs: 450 x 2048 + 450 x 451 / 2 = 1,023,075 pairs, 1,023,075 / 512 - 256.5 =
    1,741.7 cached, 1 + 0.5 x 1,741.7 / 2048 ms. A chunk beside decodes fills its piece less
    the decode rows; a pass no piece holds runs eagerly, costed at its own tokens."""
    pieces = ProfileCost(pieces_table(tmp_path), pieces=[1024, 512, 2048])
    plain = ProfileCost(pieces_table(tmp_path))
    assert pieces.step_time(prefill(1235)) == pytest.approx(0.004)
    assert plain.step_time(prefill(1235)) == pytest.approx(0.002 + 535 / 1348 * 0.002)
    after = StepShape(prefill_tokens=450, prefill_attn_pairs=450 * 2048 + 450 * 451 / 2)
    cached = (450 * 2048 + 450 * 451 / 2) / 512 - 256.5
    assert pieces.step_time(after) == pytest.approx(0.001 + 0.0005 * cached / 2048)
    assert pieces.step_time(prefill(512)) == pytest.approx(0.001)  # the 300 row, read at 512
    assert [padded_chunk([512, 1024, 2048], n, d) for n, d in [(900, 24), (2040, 16)]] == [
        1000,
        2040,  # 2,056 rows: past every piece
    ]
    # eager at 3,000 tokens: the curve's last segment, 1024 to 2048, extended
    assert pieces.step_time(prefill(3000)) == pytest.approx(0.004 + 952 / 1024 * 0.002)
    cluster = {"mode": "colocated", "colocated": {"nodes": 1, "tp": 1}}
    data = {"model": {"name": "tiny-gqa"}, "cluster": cluster}
    data["cost"] = {"source": f"profile:{pieces_table(tmp_path)}"}
    exp = build_experiment(data, ["hw.latency.prefill_graphs=[2048, 512, 1024]"])
    cost = make_cost_model(exp, exp.cluster.colocated, "colocated")
    assert isinstance(cost, ProfileCost) and cost.pieces == [512, 1024, 2048]


def test_a_decode_pass_after_a_chunk_pass_runs_longer_until_the_lift_fades(
    tmp_path: Path,
) -> None:
    """after_chunk (0 s, +20%), (20 ms, 0): a decode pass that begins 5 ms after its node's
    last chunk pass ended runs 15% longer on the device, its host time as it was; from 20 ms
    on, and on a node that has run no chunk pass, as profiled. Bad points are refused."""
    host = 0.001 + 8 * 0.0001
    lift = [(0.0, 0.2), (0.02, 0.0)]
    c = ProfileCost(table(tmp_path), run_host=(0.001, 0.003, 0.0001), after_chunk=lift)
    assert c.fades_s == 0.02
    assert [c.after_chunk(s) for s in (0.0, 0.005, 0.02, 1.0)] == pytest.approx([0.2, 0.15, 0, 0])
    assert c.decode_line(8, 0.005) == pytest.approx((1.15 * 0.01 + host, 1.15 * 1e-7))
    assert c.decode_line(8, 0.02) == c.decode_line(8) == pytest.approx((0.01 + host, 1e-7))
    assert ProfileCost(table(tmp_path)).fades_s == 0.0  # none: every pass as profiled
    with pytest.raises(ConfigError, match=r"after_chunk \[\(0.02, 0.1\), \(0.01, 0.0\)\]"):
        ProfileCost(table(tmp_path), after_chunk=[(0.02, 0.1), (0.01, 0.0)])
    with pytest.raises(ConfigError, match="fractions > -1"):
        ProfileCost(table(tmp_path), after_chunk=[(0.0, -1.0), (0.01, 0.0)])


def test_a_colocated_node_runs_its_decode_passes_after_a_chunk_pass_one_by_one(
    tmp_path: Path,
) -> None:
    """One request at a time on a colocated node, no host time, `cost.profile_after_chunk`
    (0 s, +20%), (20 ms, 0): its first decode pass (context 601 tokens) begins as the chunk
    pass ends and runs 1.2 x its profiled time d1; the second begins 1.2 d1 (about 12 ms)
    after it, and runs 0.2 (1 - 1.2 d1 / 20 ms) longer; the other two begin 20 ms or more
    after it and run as profiled, as one run of two passes. Each request's prefill is as
    long as without the lift."""
    no_host = table(tmp_path, host=False)
    cluster = {"mode": "colocated", "colocated": {"tp": 1}}
    lifted = one_at_a_time(cluster, no_host, profile_after_chunk=[[0.0, 0.2], [0.02, 0.0]])
    a, b = ProfileCost(no_host, graphs=True).decode_line(1)
    d = [a + b * (600 + k) for k in (1, 2, 3, 4)]
    first = 1.2 * d[0]
    second = (1 + 0.2 * (1 - first / 0.02)) * d[1]
    steps = steps_table(lifted.rec)
    decodes = steps[steps.prefill_tokens == 0]
    assert list(decodes.steps) == [1, 1, 2] * 3
    assert list(decodes.duration_s[:3]) == pytest.approx([first, second, d[2] + d[3]], rel=1e-9)
    plain = one_at_a_time(cluster, no_host)
    prefill_s = [
        requests_table(s.requests.values()).eval("prefill_end_s - prefill_start_s")
        for s in (lifted, plain)
    ]
    assert prefill_s[0].to_list() == pytest.approx(prefill_s[1].to_list(), rel=1e-9)


def test_graph_scales_multiply_a_decode_pass_in_its_graph_by_its_batch(tmp_path: Path) -> None:
    """Graphs of 1, 4 and 8; graph_scales (3, 1.05), (5, 1.2), (7, 1.1). A decode-only pass of
    6 sequences replays the graph of 8, whose points are 5 and 7: 1.15 x its row's device
    time (12.5 ms + 0.1 us a cached token), its host time as it was; 5 and 8 take 1.2 and 1.1
    (held), 2 and 4 the graph of 4's 1.05, 1 (a graph without points) and 9 (beyond the
    graphs, eager) 1. A mixed pass, and a server without graphs, run as profiled. Both a
    colocated and a decode node's cost model have the experiment's scales. A factor of 0 is
    refused."""
    run_host = (0.001, 0.003, 0.0001)
    points = [(3, 1.05), (5, 1.2), (7, 1.1)]
    c = ProfileCost(graph_table(tmp_path), run_host=run_host, graphs=True, graph_scales=points)
    plain = ProfileCost(graph_table(tmp_path), run_host=run_host, graphs=True)
    scales = [c.graph_scale(b) for b in (1, 2, 4, 5, 6, 8, 9)]
    assert scales == pytest.approx([1.0, 1.05, 1.05, 1.2, 1.15, 1.1, 1.0])
    host = 0.001 + 6 * 0.0001
    assert c.decode_line(6) == pytest.approx((1.15 * 0.0125 + host, 1.15 * 1e-7))
    six = StepShape(decode_seqs=6, decode_context=6000.0)
    assert c.step_time(six) == pytest.approx(1.15 * (0.0125 + 6000e-7) + host)
    assert c.decode_line(1) == plain.decode_line(1)
    mixed = StepShape(512, 512 * 513 / 2, 6, 6000.0)
    assert c.step_time(mixed) == plain.step_time(mixed)
    eager = ProfileCost(graph_table(tmp_path), run_host=run_host, graph_scales=points)
    assert eager.graph_scale(6) == 1.0
    with pytest.raises(ConfigError, match=r"graph_scales \[\(8, 0.0\)\]: give factors > 0"):
        ProfileCost(graph_table(tmp_path), graph_scales=[(8, 0.0)])
    cost = {"source": f"profile:{graph_table(tmp_path)}", "profile_graph_scales": points}
    one_gpu = {"nodes": 1, "tp": 1}
    cluster = {"mode": "disagg", "prefill": one_gpu, "decode": one_gpu}
    exp = build_experiment({"model": {"name": "tiny-gqa"}, "cluster": cluster, "cost": cost})
    by_role = {
        role: cast(ProfileCost, make_cost_model(exp, exp.cluster.decode, role)).graph_scale(6)
        for role in ("colocated", "decode")
    }
    assert by_role == {"colocated": pytest.approx(1.15), "decode": pytest.approx(1.15)}


def chain_run(
    tmp_path: Path,
    chain: bool,
    chain_cost: tuple[float, float] = (0.0, 0.0),
    arrivals: tuple[tuple[float, int], ...] = ((0, 10), (40, 3)),
) -> Sim:
    """A finished colocated Sim on a profile whose every pass has 1 ms of host time: decode
    passes take 10 ms on the device at any context, a 600-token prompt 1.171875 ms (between
    512 and 1,024 tokens: 1 and 2 ms). Its requests' (ms, output tokens), each of 600 prompt
    tokens: `arrivals`, by default request 0 (600 + 10 tokens) at 0 and request 1 (600 + 3)
    at 40 ms, while request 0 decodes alone. `chain_cost`: a chained pass's time beyond its
    device time, fixed and per sequence (cost.profile_chain_s, _per_seq_s)."""
    rows = [f"prefill,{n},1,0,{n / 512e3},0.001" for n in (512, 1024)]
    rows += [f"decode,{b},{b},{c},0.01,0.001" for b in (1, 8) for c in (1000, 3000)]
    profile = tmp_path / "flat.csv"
    profile.write_text("kind,tokens,batch,context,duration_s,host_s\n" + "\n".join(rows))
    trace = tmp_path / "two.jsonl"
    lines = [{"timestamp": ms, "output_length": n} for ms, n in arrivals]
    trace.write_text("".join(json.dumps({**r, "input_length": 600}) + "\n" for r in lines))
    data = {
        "model": {"name": "tiny-gqa"},
        "cluster": {"mode": "colocated", "colocated": {"nodes": 1, "tp": 1}},
        "cost": {
            "source": f"profile:{profile}",
            "profile_chain_s": chain_cost[0],
            "profile_chain_per_seq_s": chain_cost[1],
        },
        "workload": {"trace": str(trace)},
        "hw": {"latency": {"chain": chain}},
    }
    sim = Sim(build_experiment(data))
    sim.run()
    return sim


def test_a_chained_pass_runs_without_its_host_time_and_a_newcomer_waits_one_pass_more(
    tmp_path: Path,
) -> None:
    """Hand arithmetic (`chain_run`), from request 0's prefill start (the control hop): its
    prompt's pass takes 2.171875 ms with the host time. Unchained, its decode passes take 11
    ms each; request 1 comes during the fourth (35.17-46.17 ms) and its prompt starts when
    that ends. Chained, the first decode pass after the prompt's takes 11 ms and the rest 10;
    request 1 comes during the fourth (33.17-43.17), which has launched the fifth behind it,
    so its prompt starts at 53.17. Request 0's TPOT is 11 ms unchained, and chained less 1 ms
    on each pass but the first until request 1 joins."""
    tpot = []
    for chain, joins_ms in ((False, 2.171875 + 4 * 11), (True, 2.171875 + 11 + 4 * 10)):
        sim = chain_run(tmp_path, chain)
        req = requests_table(sim.requests.values()).set_index("request_id")
        hop = req.prefill_start_s[0]
        assert req.prefill_start_s[1] - hop == pytest.approx(joins_ms / 1e3, abs=1e-12)
        # chained: request 0's passes 2-5; after request 1's prompt, the second and third
        assert steps_table(sim.rec).chained.sum() == (4 + 2 if chain else 0)
        tpot.append(req.tpot_s[0])
    # request 0's 9 tokens after its first: 6 of their passes 1 ms shorter
    assert tpot[0] - tpot[1] == pytest.approx(6e-3 / 9, abs=1e-12)


def test_a_chained_pass_takes_the_chain_cost_beyond_its_device_time(tmp_path: Path) -> None:
    """`chain_run` with a chained pass costing 0.5 ms + 0.1 ms a sequence beyond its device
    time: request 0's chained passes alone take 10.6 ms, so request 1 comes during the fourth
    (34.37-44.97 ms after request 0's prefill start), which has launched the fifth, and its
    prompt starts at 2.171875 + 11 + 4 x 10.6 ms. Request 0's TPOT grows by what its six
    chained passes took more, five alone (0.6 ms) and one beside request 1 (0.7 ms), over its
    9 tokens; the device time of the rows of chained passes is the profile's 10 ms a pass."""
    plain, costly = chain_run(tmp_path, True), chain_run(tmp_path, True, (5e-4, 1e-4))
    req = requests_table(costly.requests.values()).set_index("request_id")
    joined = req.prefill_start_s[1] - req.prefill_start_s[0]
    assert joined == pytest.approx((2.171875 + 11 + 4 * 10.6) / 1e3, abs=1e-12)
    steps = steps_table(costly.rec)
    chained = steps[steps.chained > 0]  # rows of passes run alike: 5, 2 and 1 of them
    assert chained[["steps", "chained", "decode_seqs"]].values.tolist() == [
        [5, 4, 1],
        [2, 1, 2],
        [1, 1, 1],
    ]
    assert chained.device_s.to_list() == pytest.approx([0.05, 0.02, 0.01], abs=1e-12)
    base = requests_table(plain.requests.values()).tpot_s[0]
    assert req.tpot_s[0] - base == pytest.approx((5 * 0.6 + 0.7) / 9e3, abs=1e-12)


def test_a_newcomer_joins_the_pass_after_the_one_chained_without_it(tmp_path: Path) -> None:
    """Chained, a request that comes while a pass runs whose loop has launched the next
    without it joins the pass after that one, as a hw server's loop, hearing it once the
    pass in flight ends, takes it into the next it launches. So no prompt waits longer than
    the pass in flight (at most a prompt's pass with decodes: 12.17 ms, `chain_run`), the one
    chained behind it and the control hop, however long the decodes beside it have left: here
    24 requests, one every 37 ms, of 2 to 30 tokens, some of them coming during the last pass
    of a run (a request finishing), whose continuation is launched before they come (before
    this was so, four waited 26.5-41 ms for the run after it)."""
    arrivals = tuple((37 * i, 2 + 7 * i % 29) for i in range(24))
    sim = chain_run(tmp_path, True, arrivals=arrivals)
    req = requests_table(sim.requests.values())
    assert (req.status == "finished").all()
    waited = req.prefill_start_s - req.arrival_s - sim.control_latency_s
    assert waited.max() <= 2 * 12.171875e-3
    assert steps_table(sim.rec).chained.sum() > 0


def disagg_chain(profile: Path, chain: bool, shared: bool) -> Sim:
    """A finished 1P:1D Sim of 40 requests at 30 req/s on `profile`, chaining or not, its two
    nodes on one shared GPU or not."""
    data = {
        "model": {"name": "tiny-gqa"},
        "cluster": {
            "mode": "disagg",
            "shared_gpu": shared,
            "prefill": {"nodes": 1, "tp": 1},
            "decode": {"nodes": 1, "tp": 1, "max_batch": 8},
        },
        "cost": {"source": f"profile:{profile}"},
        "workload": {
            "rate_per_s": 30,
            "num_requests": 40,
            "prompt_tokens": {"dist": "uniform", "low": 200, "high": 900},
            "output_tokens": {"dist": "uniform", "low": 5, "high": 40},
        },
        "hw": {"latency": {"chain": chain}},
    }
    sim = Sim(build_experiment(data))
    sim.run()
    return sim


@pytest.mark.parametrize("shared", [False, True])
def test_a_chaining_decode_node_loses_nothing_and_decodes_faster(
    tmp_path: Path, shared: bool
) -> None:
    """Chained, a decode node finishes every request, frees every page and runs a pass for
    every token as unchained; some of its passes are chained, the same seed gives the same
    tables, and TPOT p50 is shorter (the profile's decode passes carry 0.25 ms of host time)."""
    profile = table(tmp_path)
    runs = {c: disagg_chain(profile, c, shared) for c in (False, True)}
    again = disagg_chain(profile, True, shared)
    for sim in (*runs.values(), again):
        req = requests_table(sim.requests.values())
        assert len(req) == 40 and (req.status == "finished").all()
        assert all(n.pool.used_pages == 0 for n in (*sim.prefills, *sim.decodes))
        steps = steps_table(sim.rec)
        decode = steps[steps.node == "decode0"]
        assert (decode.steps * decode.decode_seqs).sum() == req.output_tokens.sum()
    steps = steps_table(runs[True].rec)
    assert 0 < steps[steps.node == "decode0"].chained.sum() < steps.steps.sum()
    assert steps_table(runs[False].rec).chained.sum() == 0
    pd.testing.assert_frame_equal(steps, steps_table(again.rec))
    tpot = {c: requests_table(s.requests.values()).tpot_s.median() for c, s in runs.items()}
    assert tpot[True] < tpot[False]
