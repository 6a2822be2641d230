"""Several nodes per role in the hw backend: 1 P : 2 D and 2 P : 1 D runs of real server
processes, each request's decode node (and, under parallel handoff, its prefill node) chosen by
the driver with the experiment's router, each decoder routing its own handoffs to a prefill
node with it otherwise. Tokens equal one colocated server's; requests spread as the router says;
a dead node fails only its own requests while its role has another.

CPU, float32, tiny-gqa, the tcp wire: at most five processes at once (the driver, and four
servers or fewer).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")

from test_sim import held_and_pairs

from disagg.config import build_experiment
from disagg.errors import ConfigError
from disagg.hw.driver import Driver, HwRun, run_hw

REQUESTS = 6


def experiment(cluster: dict, handoff: str = "decode-first") -> dict:
    """6 requests of 6-30 prompt tokens and 3-7 output tokens, routed round robin."""
    return {
        "name": "nodes",
        "seed": 5,
        "model": {"name": "tiny-gqa", "weight_dtype": "bf16"},
        "cluster": {"router": "round_robin", **cluster},
        "kv": {"page_size": 4, "layout": "HND"},
        "transfer": {"handoff": handoff},
        "workload": {
            "rate_per_s": 50,
            "num_requests": REQUESTS,
            "prompt_tokens": {"dist": "uniform", "low": 6, "high": 30},
            "output_tokens": {"dist": "uniform", "low": 3, "high": 7},
        },
    }


def disagg(prefills: int, decodes: int, handoff: str = "decode-first") -> dict:
    return experiment(
        {
            "mode": "disagg",
            "prefill": {"nodes": prefills, "tp": 1, "token_budget": 8},
            "decode": {"nodes": decodes, "tp": 1, "max_batch": 8},
        },
        handoff,
    )


def run(tmp_path: Path, name: str, data: dict, *sets: str) -> tuple[dict, HwRun]:
    exp = build_experiment(data, ["hw.wire=tcp", "kv.pages=64", *sets])
    return run_hw(exp, tmp_path / name, return_logits=True)


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> dict:
    group = {"nodes": 1, "tp": 1, "token_budget": 1000, "max_batch": 8}
    data = experiment({"mode": "colocated", "colocated": group})
    _, state = run(tmp_path_factory.mktemp("colocated"), "colocated", data)
    return state.finished


def assert_same_tokens(summary: dict, state: HwRun, reference: dict) -> None:
    assert summary["completed"] == REQUESTS and summary["failed"] == 0
    assert sorted(state.finished) == sorted(reference)
    for req_id, ref in reference.items():
        got = state.finished[req_id]
        assert got.status == ref.status == "finished"
        assert got.tokens == ref.tokens and len(got.tokens) >= 3
        np.testing.assert_allclose(got.logits, ref.logits, rtol=1e-4, atol=1e-4)


def placed(out: Path) -> pd.DataFrame:
    req = pd.read_parquet(out / "requests.parquet").sort_values("request_id")
    return req.reset_index(drop=True)


def assert_shapes_hold_every_token(out: Path, disagg: bool) -> None:
    """The steps table's shape columns (one row a pass here) hold what the simulator's do: the
    tokens of every decode pass and the attention pairs of every prompt (`held_and_pairs`);
    its host split is within each pass."""
    steps = pd.read_parquet(out / "steps.parquet")
    assert (steps.steps == 1).all()
    got = (steps.decode_context.sum(), steps.prefill_attn_pairs.sum())
    assert got == held_and_pairs(placed(out), disagg)
    # and where its host time went: before the forward's launch, then the launch (on the CPU
    # the forward itself), both within the pass; a chained pass's, before it (not measured)
    chained = steps.chained == 1
    before, launch = steps.host_before_s[~chained], steps.launch_s[~chained]
    assert (before > 0).all() and (launch > 0).all()
    assert (before + launch <= steps.duration_s[~chained] + 1e-6).all()
    assert steps.host_before_s[chained].isna().all() and steps.launch_s[chained].isna().all()
    ends = steps.start_s + steps.duration_s  # a node's rows do not overlap, chained or not
    for _, rows in steps.sort_values("start_s").groupby("node"):
        assert (rows.start_s.iloc[1:].to_numpy() >= ends[rows.index].iloc[:-1].to_numpy()).all()


def test_one_prefill_two_decodes_round_robin(reference: dict, tmp_path: Path) -> None:
    """The driver's round robin sends requests 0, 2, 4 to decode0 and 1, 3, 5 to decode1
    (arrival order is id order); the one prefill node serves them all, posting to both."""
    summary, state = run(tmp_path, "1p2d", disagg(1, 2))
    assert_same_tokens(summary, state, reference)
    req = placed(tmp_path / "1p2d")
    assert list(req.decode_node) == [0, 1, 0, 1, 0, 1]
    assert list(req.prefill_node) == [0] * REQUESTS
    assert [state.finished[i].decode_node for i in sorted(state.finished)] == [0, 1] * 3
    assert {n: r.submits for n, r in state.records.items()} == {
        "prefill0": 0,
        "decode0": 3,
        "decode1": 3,
    }
    xfers = pd.read_parquet(tmp_path / "1p2d" / "transfers.parquet")
    assert sorted(xfers.decode_node.value_counts().items()) == [(0, 3), (1, 3)]
    assert_shapes_hold_every_token(tmp_path / "1p2d", disagg=True)


def test_two_prefills_one_decode_the_decoder_routes(reference: dict, tmp_path: Path) -> None:
    """Decode-first handoff: the decoder's own round robin over the prefill nodes hands
    requests 0, 2, 4 to prefill0 and 1, 3, 5 to prefill1; each prefill node's transfers
    are the ones it was handed."""
    summary, state = run(tmp_path, "2p1d", disagg(2, 1))
    assert_same_tokens(summary, state, reference)
    req = placed(tmp_path / "2p1d")
    assert list(req.prefill_node) == [0, 1, 0, 1, 0, 1]
    assert list(req.decode_node) == [0] * REQUESTS
    xfers = pd.read_parquet(tmp_path / "2p1d" / "transfers.parquet").sort_values("request_id")
    assert list(xfers.prefill_node) == [0, 1, 0, 1, 0, 1]
    for name, ids in (("prefill0", {0, 2, 4}), ("prefill1", {1, 3, 5})):
        assert {t[0] for t in state.records[name].transfers} == ids


def test_two_prefills_parallel_handoff_the_driver_routes(reference: dict, tmp_path: Path) -> None:
    """Parallel handoff: the driver picks both nodes and sends each request to both; the
    decoder hands its pages to the prefill node the driver picked (else the prefill node
    holding the prompt would wait for a handoff that never comes)."""
    summary, state = run(tmp_path, "2p1d-par", disagg(2, 1, "parallel"))
    assert_same_tokens(summary, state, reference)
    req = placed(tmp_path / "2p1d-par")
    assert list(req.prefill_node) == [0, 1, 0, 1, 0, 1]
    assert {n: r.submits for n, r in state.records.items()} == {
        "prefill0": 3,
        "prefill1": 3,
        "decode0": REQUESTS,
    }


def test_two_colocated_nodes_round_robin(reference: dict, tmp_path: Path) -> None:
    group = {"nodes": 2, "tp": 1, "token_budget": 1000, "max_batch": 8}
    summary, state = run(tmp_path, "2c", experiment({"mode": "colocated", "colocated": group}))
    assert_same_tokens(summary, state, reference)
    req = placed(tmp_path / "2c")
    assert list(req.decode_node) == list(req.prefill_node) == [0, 1, 0, 1, 0, 1]
    assert_shapes_hold_every_token(tmp_path / "2c", disagg=False)


@pytest.mark.parametrize("mode", ["disagg", "colocated"])
def test_chained_passes_give_the_same_tokens(mode: str, reference: dict, tmp_path: Path) -> None:
    """hw.latency.chain: a decode pass launched before the pass it follows is read, its tokens
    that pass's samples on the device, gives the tokens and logits of passes launched one by
    one; the run chains some passes (all requests come within 0.1 s, then decode together).
    The servers warm up first, the generating ones a chained pair of passes too (`warm_chain`),
    which leaves the pages as they were."""
    group = {"nodes": 1, "tp": 1, "token_budget": 1000, "max_batch": 8}
    data = disagg(1, 1) if mode == "disagg" else experiment({"mode": mode, "colocated": group})
    summary, state = run(tmp_path, mode, data, "hw.latency.chain=true", "hw.warm_up=true")
    assert_same_tokens(summary, state, reference)
    assert all(s["warm_up_s"] > 0 for s in summary["node_settings"].values())
    steps = pd.read_parquet(tmp_path / mode / "steps.parquet")
    generating = steps[steps.node != "prefill0"]
    assert 0 < generating.chained.sum() < len(generating)
    assert_shapes_hold_every_token(tmp_path / mode, disagg=mode == "disagg")


def test_a_dead_decode_node_fails_only_its_own_requests(reference: dict, tmp_path: Path) -> None:
    """decode1 killed at the start: what reached it fails with the simulator's reason, the
    rest go to decode0 and finish with the reference's tokens, and the run ends normally."""
    data = disagg(1, 2)
    data["faults"] = [{"kind": "kill", "node": "decode1", "at_s": 0.0}]
    summary, state = run(tmp_path, "kill", data, "hw.dead_after_s=2")
    req = placed(tmp_path / "kill")
    failed = req[req.status != "finished"]
    assert set(failed.status) <= {"failed"}
    assert set(failed.fail_reason) <= {"decode1 died (kill decode1 at 0 s)"}
    assert set(failed.decode_node) <= {1}
    done = req[req.status == "finished"]
    assert len(done) >= REQUESTS - 1 and set(done.decode_node) == {0}
    for req_id in done.request_id:
        assert state.finished[req_id].tokens == reference[req_id].tokens
    assert "stopped" not in summary
    assert summary["faults"] == [{"fault": "kill decode1 at 0 s", "requests_failed": len(failed)}]


def test_a_dp_the_hw_backend_does_not_run_is_refused_naming_the_field() -> None:
    data = disagg(1, 2)
    data["cluster"]["decode"]["dp"] = 2
    with pytest.raises(ConfigError, match=r"cluster\.decode has nodes=2 tp=1 dp=2"):
        Driver(build_experiment(data))
