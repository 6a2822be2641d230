"""The capacity planner: bisection, the search space, a grid whose answer is known, the CLI.

The known grid: a toy model whose every forward pass costs 100 ms (a fixed step overhead, the
model's own work negligible), fixed 100-token prompts and 11-token outputs, near-regular
arrivals. A prefill node (token budget 100, one prompt per pass) prefills 10 requests/s. A decode
node holds 3 sequences and needs 10 passes (1 s) per request after the prefill's first token:
3 requests/s. So a 1P:dD cluster serves min(3d, 10) requests/s: 3, 6, 9, then 10 whatever the
decode nodes; per GPU (one per node) 1P3D is cheapest: 4 GPUs / 9 req/s = 0.44, against 0.5 for
1P2D and 1P4D.
"""

import json
import math
import tomllib
from pathlib import Path
from typing import Any

import pandas as pd
import pytest
from typer.testing import CliRunner

from disagg.cli import app
from disagg.config import build_experiment, load_experiment
from disagg.core.slo import Slo
from disagg.core.workload import generate
from disagg.errors import ConfigError
from disagg.plan import Options, Space, parse_vary, plan
from disagg.plan.bisect import bisect_rate
from disagg.plan.search import native_rate_per_s, offered
from disagg.plan.space import expand

TOY_TOML = """
name = "toy"
[model]
name = "tiny-gqa"
weight_dtype = "bf16"
[cluster]
mode = "disagg"
prefill = { nodes = 1, tp = 1, token_budget = 100, max_batch = 1 }
decode = { nodes = 1, tp = 1, max_batch = 3 }
[cost]
step_overhead_s = 0.1
layer_overhead_s = 0.0
[kv]
page_size = 16
[workload]
arrival = "gamma"
cv = 0.05
rate_per_s = 2.0
duration_s = 10
prompt_tokens = { dist = "fixed", value = 100 }
output_tokens = { dist = "fixed", value = 11 }
"""
TOY = build_experiment(tomllib.loads(TOY_TOML))
SLO = Slo.parse("ttft_ms=1000")
runner = CliRunner()


# ---- bisection --------------------------------------------------------------------------
def test_bisection_brackets_the_threshold_of_a_monotone_test_within_the_tolerance() -> None:
    for start in (0.3, 1.0, 100.0):  # from below (doubling) and from above (halving)
        found = bisect_rate(lambda r: r <= 7.3, start, rel_tol=0.01, max_probes=40)
        assert found.rate_per_s <= 7.3 < found.failed_per_s <= found.rate_per_s * 1.01
        assert all(ok == (r <= 7.3) for r, ok in found.probes)
        assert not found.pruned


def test_bisection_from_below_takes_the_probes_the_bracket_needs() -> None:
    # 1, 2, 4, 8 pass, 16 fails: the bracket [8, 16] is halved (geometric) until 16/8 = 2
    # shrinks to <= 1.05: log2(log(2)/log(1.05)) = 3.8, so 4 bisection probes, 9 in all
    found = bisect_rate(lambda r: r <= 10.0, 1.0, rel_tol=0.05, max_probes=40)
    assert [r for r, _ in found.probes[:5]] == [1.0, 2.0, 4.0, 8.0, 16.0]
    assert len(found.probes) == 9
    assert found.probes[5][0] == pytest.approx(math.sqrt(8 * 16))


def test_bisection_prunes_at_once_below_the_rate_it_must_reach_and_continues_above() -> None:
    pruned = bisect_rate(lambda r: r <= 7.3, 1.0, must_reach_per_s=8.0)
    assert pruned.pruned and pruned.probes == [(8.0, False)] and pruned.rate_per_s == 0
    passed = bisect_rate(lambda r: r <= 7.3, 1.0, rel_tol=0.01, max_probes=40, must_reach_per_s=5)
    assert not passed.pruned and passed.probes[:2] == [(5, True), (10, False)]
    assert passed.rate_per_s <= 7.3 < passed.failed_per_s <= passed.rate_per_s * 1.01


def test_bisection_that_never_passes_stops_at_the_floor_or_the_probe_budget() -> None:
    found = bisect_rate(lambda r: False, 1.0, min_per_s=0.1, max_probes=40)
    assert found.rate_per_s == 0 and [r for r, _ in found.probes] == [1, 0.5, 0.25, 0.125]
    assert len(bisect_rate(lambda r: False, 1.0, max_probes=3).probes) == 3


# ---- the search space -------------------------------------------------------------------
def test_space_holds_every_node_split_within_the_budget_in_both_modes() -> None:
    cands = expand(TOY, Space(max_gpus=4)).candidates
    labels = [c.label for c in cands]
    assert labels == ["C1", "C2", "C3", "C4", "1P1D", "1P2D", "1P3D", "2P1D", "2P2D", "3P1D"]
    c2 = cands[1].exp.cluster
    # a colocated node lends the decode pool's batch and the prefill pool's token budget
    assert c2.mode == "colocated" and c2.colocated.nodes == 2
    assert (c2.colocated.max_batch, c2.colocated.token_budget, c2.colocated.tp) == (3, 100, 1)
    assert [c.gpus for c in cands] == [1, 2, 3, 4, 2, 3, 4, 3, 4, 4]


def test_varied_settings_apply_to_their_mode_only() -> None:
    space = Space(max_gpus=2, vary=(parse_vary("transfer.policy=layerwise,whole"),))
    labels = [c.label for c in expand(TOY, space).candidates]
    assert labels == ["C1", "C2", "1P1D transfer.policy=layerwise", "1P1D transfer.policy=whole"]


def test_configurations_that_do_not_fit_are_skipped_with_the_reason() -> None:
    space = Space(max_gpus=2, modes=("disagg",), vary=(parse_vary("kv.memory_fraction=0.9,0.01"),))
    found = expand(TOY, space)
    assert [c.label for c in found.candidates] == ["1P1D kv.memory_fraction=0.9"]
    assert [label for label, _ in found.skipped] == ["1P1D kv.memory_fraction=0.01"]
    assert "does not fit on H200-SXM" in found.skipped[0][1]


@pytest.mark.parametrize(
    ("space", "message"),
    [
        (lambda: Space(max_gpus=1, modes=("disagg",)), "the smallest of the search space needs 2"),
        (lambda: Space(max_gpus=4, modes=("split",)), "--modes 'split'"),
        (lambda: Space(max_gpus=0), "--max-gpus 0"),
        (
            lambda: Space(max_gpus=1, vary=(parse_vary("kv.memory_fraction=0.01"),)),
            "none of the 1 configurations within --max-gpus 1 can run",
        ),
    ],
)
def test_an_empty_space_or_one_over_budget_is_an_error(space: object, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        expand(TOY, space())  # type: ignore[operator]


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("transfer.policy", "expected KEY=V1,V2"),
        ("cluster.decode.nodes=1,2", "--decode-nodes"),
        ("workload.rate_per_s=1,2", "the planner's search"),
        ("cluster.decode.tpp=4", "cluster.decode has no setting 'tpp'"),
    ],
)
def test_bad_vary_options_name_the_problem(text: str, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        expand(TOY, Space(max_gpus=2, vary=(parse_vary(text),)))


def test_an_slo_without_a_latency_bound_on_queueing_is_refused() -> None:
    with pytest.raises(ConfigError, match="bound ttft_ms or e2e_ms"):
        Options(Slo.parse("tpot_ms=50"))


# ---- the known grid ---------------------------------------------------------------------
def decode_grid(
    tmp_path: Path,
    prune: str = "none",
    jobs: int = 1,
    decode: tuple[int, ...] = (1, 2, 3, 4),
    **kw: Any,
) -> pd.DataFrame:
    space = Space(max_gpus=5, modes=("disagg",), prefill_nodes=(1,), decode_nodes=decode, **kw)
    opts = Options(SLO, probe_s=20, prune=prune, jobs=jobs)  # type: ignore[arg-type]
    return plan(TOY, space, opts, tmp_path).table.set_index("label")


def test_goodput_grows_with_decode_nodes_until_the_prefill_node_saturates(tmp_path: Path) -> None:
    df = decode_grid(tmp_path)
    assert (df.status == "ok").all()
    for d, label in enumerate(["1P1D", "1P2D", "1P3D", "1P4D"], start=1):
        expected = min(3 * d, 10)  # see the module docstring
        assert 0.85 * expected <= df.goodput_per_s[label] <= 1.03 * expected, label
    assert df.index[df.winner].tolist() == ["1P3D"]
    assert df.index[df.on_front].tolist() == ["1P1D", "1P2D", "1P3D", "1P4D"]
    assert (df.tpot_ms_p90 < 101).all()  # one 100 ms pass per token
    files = {p.name for p in tmp_path.iterdir()}
    assert files == {"plan.csv", "plan.png", "winner.json"}
    winner = load_experiment(tmp_path / "winner.json")
    assert (winner.cluster.prefill.nodes, winner.cluster.decode.nodes) == (1, 3)
    assert winner.workload.rate_per_s == df.rate_per_s["1P3D"]
    assert winner.workload.duration_s == 20  # the probe that decided


def test_cost_pruning_settles_in_one_probe_what_cannot_beat_the_best_per_gpu(
    tmp_path: Path,
) -> None:
    df = decode_grid(tmp_path, prune="cost")
    # 1P4D would need 5/4 of 1P3D's goodput (about 10.5 req/s) to beat it; the prefill node
    # caps it at 10
    assert df.status.tolist() == ["ok", "ok", "ok", "pruned"] and df.probes["1P4D"] == 1
    assert df.bound_per_s["1P4D"] == pytest.approx(5 / 4 * df.goodput_per_s["1P3D"])
    assert df.index[df.winner].tolist() == ["1P3D"]


def test_front_pruning_skips_configurations_a_cheaper_one_beats(tmp_path: Path) -> None:
    # a decode node of one sequence serves 1 req/s: with 2 or 3 decode nodes it still cannot
    # beat 1P1D's ~3 req/s on fewer GPUs
    vary = (parse_vary("cluster.decode.max_batch=3,1"),)
    df = decode_grid(tmp_path, prune="front", decode=(1, 2, 3), vary=vary)
    status = {str(k).replace(" cluster.decode.max_batch=", "/"): v for k, v in df.status.items()}
    assert status == {"1P1D/3": "ok", "1P1D/1": "ok", "1P2D/3": "ok", "1P2D/1": "pruned",
                      "1P3D/3": "ok", "1P3D/1": "pruned"}  # fmt: skip
    assert df.probes[df.status == "pruned"].tolist() == [1, 1]
    assert df.index[df.winner].tolist() == ["1P3D cluster.decode.max_batch=3"]


def test_parallel_search_gives_the_same_table_as_a_serial_one(tmp_path: Path) -> None:
    serial = decode_grid(tmp_path / "serial", prune="cost", decode=(1, 2))
    parallel = decode_grid(tmp_path / "parallel", prune="cost", jobs=2, decode=(1, 2))
    pd.testing.assert_frame_equal(serial, parallel)


def test_an_slo_no_configuration_meets_is_an_error_naming_the_best_found(tmp_path: Path) -> None:
    # the first token needs a prefill pass: 100 ms, over a 50 ms bound at any rate
    space = Space(max_gpus=3, modes=("disagg",))
    opts = Options(Slo.parse("ttft_ms=50"), probe_s=5, max_probes=3)
    with pytest.raises(ConfigError, match=r"no configuration keeps up .* The best found: 1P1D"):
        plan(TOY, space, opts, tmp_path)
    assert set(pd.read_csv(tmp_path / "plan.csv").status) == {"none"}
    # halving stops where a probe's 5 s would offer fewer than 10 requests: 2 req/s
    lowest = Options(Slo.parse("ttft_ms=50"), probe_s=5, prune="none")
    with pytest.raises(ConfigError, match="at 2 req/s"):
        plan(TOY, Space(max_gpus=2, modes=("disagg",)), lowest, tmp_path)
    assert pd.read_csv(tmp_path / "plan.csv").probes.tolist() == [1]


# ---- the command line -------------------------------------------------------------------
def test_plan_command_writes_a_winner_that_sim_run_accepts(tmp_path: Path) -> None:
    base = tmp_path / "toy.toml"
    base.write_text(TOY_TOML)
    out = tmp_path / "plan"
    args = ["plan", str(base), "--slo", "ttft_ms=1000", "--max-gpus", "3", "--modes", "disagg"]
    args += ["--jobs", "1", "--out", str(out), "--quiet"]  # probes as long as the base: 10 s
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "Pareto front" in res.output and "fewest GPUs per goodput: 1P2D" in res.output
    df = pd.read_csv(out / "plan.csv")
    assert df.label.tolist() == ["1P1D", "1P2D", "2P1D"]
    assert json.loads((out / "winner.json").read_text())["cluster"]["decode"]["nodes"] == 2
    run = runner.invoke(app, ["sim", "run", str(out / "winner.json"), "--out", str(tmp_path / "r")])
    assert run.exit_code == 0, run.output
    # the winner is the probe that decided: simulated again, it keeps up as reported
    req = pd.read_parquet(tmp_path / "r" / "requests.parquet")
    assert SLO.met(req).mean() >= 0.9
    assert SLO.met(req).sum() / 10 == pytest.approx(df.goodput_per_s[df.winner].item(), rel=0.1)


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (["--slo", "ttft=3"], "--slo 'ttft=3'"),
        (["--prune", "some"], "--prune 'some'"),
        (["--decode-nodes", "1,x"], "--decode-nodes '1,x'"),
        (["--max-gpus", "1", "--modes", "disagg"], "no configuration fits --max-gpus 1"),
        (["--slo", "ttft_ms=50", "--probe-s", "5"], "no configuration keeps up"),
    ],
)
def test_plan_command_rejects_bad_options_with_exit_2(
    tmp_path: Path, extra: list[str], message: str
) -> None:
    base = tmp_path / "toy.toml"
    base.write_text(TOY_TOML)
    res = runner.invoke(app, ["plan", str(base), "--out", str(tmp_path / "p"), *extra])
    assert res.exit_code == 2 and message in res.output, res.output


def test_a_trace_is_probed_at_a_rate_by_replaying_it_faster() -> None:
    data = Path(__file__).parent / "data"
    trace = TOY.updated(f"workload.trace={data / 'azure_sample.csv'}")
    arrivals = generate(trace.workload, trace.seed)
    native = native_rate_per_s(trace)
    span_s = arrivals[-1].arrival_s - arrivals[0].arrival_s
    assert len(arrivals) > 5 and native == pytest.approx((len(arrivals) - 1) / span_s)
    twice = offered(trace, 2 * native, None)
    assert twice.workload.time_scale == pytest.approx(0.5)
    fast = generate(twice.workload, trace.seed)  # 20 requests, all of the trace, in 10 s
    assert len(fast) == 20 > len(arrivals)
    assert [a.arrival_s for a in fast[: len(arrivals)]] == pytest.approx(
        [a.arrival_s / 2 for a in arrivals]
    )


def test_a_colocated_base_lends_its_nodes_to_both_disagg_pools() -> None:
    base = load_experiment(Path(__file__).parent.parent / "experiments" / "r1-colocated.toml")
    cands = expand(base, Space(max_gpus=16, modes=("disagg",))).candidates
    assert [(c.label, c.gpus) for c in cands] == [("1P1D", 16)]
    pools = cands[0].exp.cluster
    for pool in (pools.prefill, pools.decode):
        assert (pool.nodes, pool.tp, pool.max_batch, pool.token_budget) == (1, 8, 256, 8192)


def test_plan_command_reports_the_configurations_it_skipped(tmp_path: Path) -> None:
    base = tmp_path / "toy.toml"
    base.write_text(TOY_TOML)
    args = ["plan", str(base), "--slo", "ttft_ms=1000", "--modes", "disagg", "--quiet"]
    args += ["--vary", "kv.memory_fraction=0.9,0.01", "--jobs", "1", "--out", str(tmp_path / "p")]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "1 configurations to search, 1 skipped" in res.output
    assert "skipped 1P1D kv.memory_fraction=0.01: cluster.prefill: tiny-gqa does not fit" in (
        res.output.replace("\n", " ")
    )
    df = pd.read_csv(tmp_path / "p" / "plan.csv")
    assert df.status.tolist() == ["ok", "skipped"]
