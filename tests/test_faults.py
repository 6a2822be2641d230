"""Faults injected in the simulator (`[[faults]]`): what each does to requests and pages.

The simulator makes a fault happen; the core roles (the code the hw servers run) decide what
it does to requests, so these runs also exercise the roles' failure paths end to end. Every
run must end with each request finished or failed with a reason, and every living node's pages
back in its pool (`Sim.check_end`, which `run` calls, raises otherwise)."""

import json
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pandas as pd
import pytest

from disagg.config import build_experiment
from disagg.core.messenger import timeout_reason
from disagg.core.metrics import requests_table, transfers_table
from disagg.errors import ConfigError
from disagg.faults import attribute
from disagg.sim.cluster import Sim

TINY = Path(__file__).parent.parent / "experiments" / "tiny-disagg.toml"
# requests decode for about a second each: a node holds several when a fault hits it
LONG = [
    "workload.output_tokens.low=200",
    "workload.output_tokens.high=300",
    "hw.dead_after_s=0.5",
]


def simulate(
    faults: list[dict[str, Any]], *overrides: str, prefills: int = 1, decodes: int = 1
) -> tuple[Sim, pd.DataFrame]:
    data = tomllib.loads(TINY.read_text())
    data["cluster"]["prefill"]["nodes"], data["cluster"]["decode"]["nodes"] = prefills, decodes
    data["faults"] = faults
    sim = Sim(build_experiment(data, [*LONG, *overrides]))
    sim.run()
    return sim, requests_table(sim.requests.values())


def living_pools_empty(sim: Sim) -> bool:
    return all(n.pool.used_pages == 0 for n in sim.nodes if not n.dead)


def test_a_killed_decode_node_fails_only_its_own_requests_and_the_run_goes_on() -> None:
    sim, req = simulate([{"kind": "kill", "at_s": 1.0, "node": "decode1"}], decodes=2)
    failed = req[req.status == "failed"]
    assert len(failed) >= 2 and set(req.status) == {"finished", "failed"}
    assert (failed.fail_reason == "decode1 died (kill decode1 at 1 s)").all()
    assert (failed.decode_node == 1).all() and (failed.arrival_s < 1.0).all()
    later = req[req.arrival_s > 1.0]
    assert len(later) and (later.decode_node == 0).all() and (later.status == "finished").all()
    assert sim.fault_summary() == {
        "faults": [{"fault": "kill decode1 at 1 s", "requests_failed": len(failed)}]
    }
    assert sim.decodes[1].dead and living_pools_empty(sim)


def test_with_every_decode_node_dead_later_requests_fail_at_once() -> None:
    sim, req = simulate([{"kind": "kill", "at_s": 1.0, "node": "decode0"}])
    later, held = req[req.arrival_s > 1.0], req[req.arrival_s < 1.0]
    assert len(later) and (later.fail_reason == "no decode node is alive").all()
    assert (held.fail_reason == "decode0 died (kill decode0 at 1 s)").all()  # long outputs
    assert (req.status == "failed").all() and living_pools_empty(sim)


def test_a_killed_prefill_nodes_requests_are_retried_on_the_other() -> None:
    sim, req = simulate(
        [{"kind": "kill", "at_s": 1.0, "node": "prefill0"}],
        "workload.prompt_tokens.low=1000",
        "workload.prompt_tokens.high=2000",
        "workload.rate_per_s=40",
        "workload.num_requests=80",
        prefills=2,
    )
    assert (req.status == "finished").all()
    retried = req[req.attempts > 1]
    assert len(retried) >= 1 and (retried.prefill_node == 1).all()
    assert living_pools_empty(sim)


@pytest.mark.parametrize("node", ["decode0", "prefill0"])
def test_a_node_stopped_past_its_peers_death_time_loses_nothing(node: str) -> None:
    """Its peer declares it dead and gives its transfers up; when it resumes, stale messages
    and retries meet (the core paths of issue 17's stall-and-resume bugs)."""
    stop = {"kind": "stop", "at_s": 1.0, "node": node, "for_s": 2.0}
    sim, req = simulate(
        [stop], "workload.rate_per_s=40", "workload.num_requests=80", "transfer.timeout_s=0.5"
    )
    assert set(req.status) <= {"finished", "failed"}
    assert (req[req.status == "failed"].fail_reason != "").all()
    assert living_pools_empty(sim) and not any(n.dead for n in sim.nodes)
    during = req[(req.arrival_s > 1.0) & (req.arrival_s < 3.0) & (req.status == "finished")]
    assert len(during) and (during.first_token_s >= 3.0).all()  # nothing moved until resumed
    if node == "prefill0":  # the decoder gave its transfers up, and retried them
        assert (req.attempts > 1).any()


def test_a_nic_down_past_the_timeout_cancels_and_retries_transfers() -> None:
    nic_down = {"kind": "nic_down", "at_s": 1.0, "node": "prefill0", "nic": 0, "for_s": 1.5}
    sim, req = simulate([nic_down], "transfer.timeout_s=0.3", "transfer.max_attempts=2")
    hit = req[req.attempts > 1]
    assert len(hit) >= 1
    failed = req[req.status == "failed"]
    assert failed.fail_reason.str.startswith(timeout_reason(0.3)).all()
    assert living_pools_empty(sim)


def test_a_degraded_nic_slows_the_transfers_that_cross_it() -> None:
    window = {"at_s": 1.0, "node": "prefill0", "nic": 0, "for_s": 0.5}
    plain = simulate([])[0]
    slow = simulate([{"kind": "nic_degrade", "gbps": 0.01, **window}])[0]

    def took(sim: Sim) -> pd.Series:
        x = transfers_table(sim.rec)
        inside = x[(x.start_s >= 1.0) & (x.start_s < 1.4)]
        return (inside.end_s - inside.start_s).median()

    # (a transfer ends when the decoder counts it, after its pass in flight: plain ~ a pass)
    assert took(slow) > 10 * took(plain)


def test_a_dropped_connection_fails_the_writes_in_flight_which_are_retried() -> None:
    drops = [
        {"kind": "drop_connection", "at_s": 0.5 + 0.05 * i, "node": "prefill0", "peer": "decode0"}
        for i in range(20)
    ]
    sim, req = simulate(drops, "workload.rate_per_s=40", "workload.num_requests=80")
    assert (req.status == "finished").all()
    assert (req.attempts > 1).any() and living_pools_empty(sim)


def test_delayed_control_messages_delay_first_tokens_by_as_much() -> None:
    delay = {"kind": "delay_control", "at_s": 0.0, "node": "decode0", "delay_s": 0.2, "for_s": 60}
    plain, slow = simulate([])[1], simulate([delay])[1]
    # the handoff (decode -> prefill) is late by the delay; nothing else crosses the plane
    extra = slow.ttft_s - plain.ttft_s
    assert extra.median() == pytest.approx(0.2, abs=0.02)


def test_a_decode_role_holds_its_requests_in_its_messenger_or_scheduler() -> None:
    """len(DecodeRole), the router's load, counts the role's requests: between events each of
    them waits, is inbound, ready or running, once, through retries, cancels, stops, dropped
    connections and a prefill node's death."""
    faults = [
        {"kind": "stop", "at_s": 0.5, "node": "decode0", "for_s": 1.0},
        {"kind": "nic_down", "at_s": 1.0, "node": "prefill0", "nic": 0, "for_s": 1.0},
        {"kind": "drop_connection", "at_s": 2.5, "node": "prefill1", "peer": "decode1"},
        {"kind": "kill", "at_s": 3.0, "node": "prefill0"},
    ]
    data = tomllib.loads(TINY.read_text())
    data["cluster"]["prefill"]["nodes"], data["cluster"]["decode"]["nodes"] = 2, 2
    data["faults"] = faults
    overrides = ["workload.rate_per_s=40", "workload.num_requests=200", "transfer.timeout_s=0.3"]
    sim = Sim(build_experiment(data, [*LONG, *overrides]))
    checks = 0
    while sim.env.peek() < 10.0:
        sim.env.run(until=sim.env.now + 0.01)
        for node in sim.decodes:
            role = node.role
            m, s = role.messenger, role.scheduler
            held = [r.id for r, _ in m.waiting] + [i.req.id for i in m.inbound.values()]
            held += [r.id for r in s.ready] + [r.id for r in s.running]
            assert sorted(held) == sorted(role.requests) and len(role) == len(held)
            checks += len(held)
    assert checks > 1000 and sim.finished == 200
    assert any(r.attempts > 1 for r in sim.requests.values())  # some were retried


def test_faults_are_deterministic() -> None:
    faults = [
        {"kind": "stop", "at_s": 0.5, "node": "decode0", "for_s": 1.0},
        {"kind": "kill", "at_s": 1.2, "node": "decode1"},
    ]
    a = simulate(faults, decodes=2)[1]
    b = simulate(faults, decodes=2)[1]
    pd.testing.assert_frame_equal(a, b)


def test_attribute_counts_failures_from_each_fault_to_the_next() -> None:
    data = tomllib.loads(TINY.read_text())
    data["faults"] = [
        {"kind": "kill", "at_s": 5.0, "node": "decode0"},
        {"kind": "stop", "at_s": 1.0, "node": "prefill0", "for_s": 1.0},
    ]
    exp = build_experiment(data)
    rows = attribute(exp.faults, [0.5, 1.0, 2.0, 4.99, 5.0, 9.0])
    assert rows == [
        {"fault": "stop prefill0 at 1 s", "requests_failed": 3},
        {"fault": "kill decode0 at 5 s", "requests_failed": 2},
    ]


@pytest.mark.parametrize(
    ("fault", "message"),
    [
        ({"kind": "kill", "at_s": 1, "node": "decode3"}, r"faults\[0\].node='decode3' is not"),
        (
            {"kind": "nic_down", "at_s": 1, "node": "decode0", "for_s": 1},
            r"faults\[0\].node='decode0': NIC faults are on prefill nodes",
        ),
        (
            {"kind": "drop_connection", "at_s": 1, "node": "decode0", "peer": "prefill0"},
            r"drop_connection is from a prefill node to a decode node",
        ),
        ({"kind": "stop", "at_s": 1, "node": "decode0"}, r"faults.0.stop.for_s"),
        ({"kind": "explode", "at_s": 1, "node": "decode0"}, r"'explode'"),
    ],
)
def test_a_bad_fault_is_a_config_error_naming_it(fault: dict[str, Any], message: str) -> None:
    data = tomllib.loads(TINY.read_text())
    data["faults"] = [fault]
    with pytest.raises(ConfigError, match=message):
        build_experiment(data)


def test_a_nic_the_node_lacks_is_a_config_error() -> None:
    data = tomllib.loads(TINY.read_text())
    data["faults"] = [{"kind": "nic_down", "at_s": 1, "node": "prefill0", "nic": 99, "for_s": 1}]
    with pytest.raises(ConfigError, match=r"nic=99 of prefill0, whose nodes have \d+ NICs"):
        Sim(build_experiment(data))


def test_sim_run_honours_the_faults_of_an_experiment_file(tmp_path: Path) -> None:
    exp = tmp_path / "faulty.toml"
    exp.write_text(
        TINY.read_text()
        + '\n[[faults]]\nkind = "kill"\nat_s = 1.0\nnode = "decode0"\n'
        + "\n[hw]\ndead_after_s = 0.5\n"
    )
    out = tmp_path / "run"
    done = subprocess.run(
        [sys.executable, "-m", "disagg.cli", "sim", "run", str(exp), "--out", str(out), "--quiet"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    summary = json.loads((out / "summary.json").read_text())
    req = pd.read_parquet(out / "requests.parquet")
    failed = int((req.status == "failed").sum())
    assert failed >= 1 and summary["faults"] == [
        {"fault": "kill decode0 at 1 s", "requests_failed": failed}
    ]
    assert done.returncode == 1 and "Traceback" not in done.stderr  # requests failed: exit 1
