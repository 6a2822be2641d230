"""A disaggregated run over a real wire between two real processes gives the colocated run's
tokens and logits: the KV pages, immediates and metadata arrive intact and complete.

CPU, float32, tiny models, the tcp wire (what CI runs). Batches differ between the two runs
(the decoder runs the last prompt token as a decode step), so logits agree to float32 rounding
and the greedy tokens exactly.
"""

from __future__ import annotations

import json
import os
import struct
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")

import torch

from disagg.config import build_experiment, load_experiment
from disagg.core.metrics import handoff_parts, queue_parts
from disagg.errors import ConfigError
from disagg.hw import latency
from disagg.hw.batch import Seq
from disagg.hw.decode import ColocatedServer, DecodeServer
from disagg.hw.driver import HwRun, run_hw
from disagg.hw.prefill import PrefillServer
from disagg.settings import LatencyConfig
from disagg.sim.cluster import Sim


def experiment(
    model: str, mode: str, layout: str, budget: int, handoff: str = "decode-first"
) -> dict:
    return {
        "name": f"{model}-{mode}",
        "seed": 5,
        "model": {"name": model, "weight_dtype": "bf16"},
        "cluster": {"mode": mode, **groups(mode, budget)},
        "kv": {"page_size": 4, "layout": layout},
        "transfer": {"handoff": handoff},
        "workload": {
            "rate_per_s": 50,
            "num_requests": 5,
            "prompt_tokens": {"dist": "uniform", "low": 6, "high": 30},
            "output_tokens": {"dist": "uniform", "low": 3, "high": 7},
        },
    }


def groups(mode: str, budget: int) -> dict:
    """One node of each group the mode runs (a group it does not run is an error)."""
    if mode == "colocated":
        return {"colocated": {"nodes": 1, "tp": 1, "token_budget": budget, "max_batch": 8}}
    return {
        "prefill": {"nodes": 1, "tp": 1, "token_budget": budget},
        "decode": {"nodes": 1, "tp": 1, "max_batch": 8},
    }


def tiny_file(tmp_path: Path, **workload: int) -> Path:
    """The disaggregated tiny-gqa experiment as a file, for the command-line tests."""
    data = experiment("tiny-gqa", "disagg", "HND", 8)
    data["workload"] |= workload
    path = tmp_path / "e.json"
    path.write_text(json.dumps(data))
    return path


def run(tmp_path: Path, name: str, data: dict) -> tuple[dict, HwRun]:
    exp = build_experiment(data, ["hw.wire=tcp", "kv.pages=128"])
    return run_hw(exp, tmp_path / name, return_logits=True)


@pytest.fixture(scope="module", params=["tiny-gqa", "tiny-mla"])
def colocated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    model = request.param
    tmp = tmp_path_factory.mktemp(model)
    _, state = run(tmp, "colocated", experiment(model, "colocated", "HND", 1000))
    return model, state.finished


def decode_server(*overrides: str) -> DecodeServer:
    """A real decode server of the tiny model on this CPU, not started: its control socket is
    connected to a driver and a prefill server that are not there (messages queue unsent)."""
    from disagg.hw.protocol import NodeConfig

    data = experiment("tiny-gqa", "disagg", "HND", 64)
    exp = build_experiment(data, ["kv.pages=64", *overrides]).model_dump(mode="json")
    server = DecodeServer(NodeConfig("decode", 0, exp, "tcp://127.0.0.1:1"))
    server.control.connect("prefill0", "tcp://127.0.0.1:2")
    return server


def submit(server: DecodeServer, req_id: int, tokens: int = 40) -> None:
    from disagg.hw.protocol import Submit

    server.on_message(Submit(req_id, 0.0, tuple(range(tokens)), 4))


@pytest.mark.parametrize("spin", [False, True])
def test_an_idle_server_waits_in_its_poll_unless_told_to_spin(spin: bool) -> None:
    """A turn of an idle server's loop waits up to 2 ms for a control message (which wakes it
    at once); one whose KV is inbound over a wire without a wake-up fd (here: none announced)
    polls every 200 us; with hw.latency.spin every turn polls without waiting."""
    from disagg.hw.transport import make_transport

    server = decode_server(f"hw.latency.spin={str(spin).lower()}")
    server.wire = make_transport("tcp", endpoint="decode0")  # its wake-up fd left unused
    waits: list[float] = []
    recv = server.control.recv
    server.control.recv = lambda t, fd=None: waits.append(t) or recv(0.0, fd)  # type: ignore[method-assign]
    try:
        server.tick()
        submit(server, 1)
        assert len(server.role.messenger.inbound) == 1
        server.tick()
    finally:
        server.wire.close()
        server.control.close()
    assert waits == ([0.0, 0.0] if spin else [0.002, 200e-6])


def test_cpu_latency_is_held_when_asked_and_a_refusal_is_said(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """hw.latency.cpu_latency_us writes its microseconds as one int32 to the PM QoS file and
    keeps it open; a host without it (or without the right) is told, and the server runs on.
    DISAGG_CPU_LATENCY_US sets it, and a bad value is an error naming the variable."""
    monkeypatch.setitem(latency._cpu_latency, "held", "not asked")  # this process's, restored
    qos = tmp_path / "qos"
    qos.write_bytes(b"")
    assert latency.hold_cpu_latency(25, str(qos)) == "25 us"
    assert struct.unpack("i", qos.read_bytes()) == (25,)
    missing = tmp_path / "none"
    said = latency.hold_cpu_latency(0, str(missing))
    assert said == f"refused: {missing}: No such file or directory"
    assert said in capsys.readouterr().err
    assert latency.held()["cpu_latency"] == said
    monkeypatch.setenv("DISAGG_CPU_LATENCY_US", "fast")
    with pytest.raises(ConfigError, match=r"DISAGG_CPU_LATENCY_US=fast(.|\n)*cpu_latency_us"):
        build_experiment({})
    monkeypatch.setenv("DISAGG_CPU_LATENCY_US", " 0 ")
    assert build_experiment({}).hw.latency.cpu_latency_us == 0


def test_each_process_of_a_run_has_a_slot_of_its_own_and_too_few_cores_are_said(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """hw.latency.cores_per_server: the driver's order of processes (prefill nodes, decode
    nodes, then ranks within a node) numbers the cores each takes, and the driver's
    (hw.latency.driver_cores) come after theirs while it drives the run, all of them after
    hw.latency.first_core cores; a host that has too few is told, and the process is left
    unpinned."""
    disagg = build_experiment(
        {
            "cluster": {
                "mode": "disagg",
                "prefill": {"nodes": 2, "tp": 2},
                "decode": {"nodes": 3, "tp": 1, "dp": 2},
            }
        }
    ).cluster  # its colocated group, which the mode does not run, takes no cores
    slots = [
        latency.process_slot(disagg, role, node, rank)
        for role, nodes, ranks in (("prefill", 2, 2), ("decode", 3, 2))
        for node in range(nodes)
        for rank in range(ranks)
    ]
    assert slots == list(range(10))
    colocated = build_experiment(
        {"cluster": {"mode": "colocated", "colocated": {"nodes": 2, "tp": 1}}}
    )
    assert latency.process_slot(colocated.cluster, "colocated", 1) == 1
    assert latency.cpu_list("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert latency.near_cores("cpu") == []
    monkeypatch.setitem(latency._cpu_latency, "cores", "not pinned")  # restored after
    cores = len(os.sched_getaffinity(0))
    said = latency.pin_cores(1, cores, "cpu")  # the process after the last core
    assert said == f"refused: process {cores} of 1 cores each, {cores} cores"
    assert said in capsys.readouterr().err
    assert latency.held()["cores"] == said
    allowed = sorted(os.sched_getaffinity(0))
    two = LatencyConfig(cores_per_server=1, driver_cores=1)  # the core after one server's
    with latency.driver_cores(two, 1, "cpu") as held:
        assert held == str(allowed[1]) == ",".join(map(str, sorted(os.sched_getaffinity(0))))
    assert sorted(os.sched_getaffinity(0)) == allowed  # back on its own cores
    with latency.driver_cores(two, cores, "cpu") as held:  # after the last core: refused
        assert held == f"refused: 1 cores after {cores} x 1"
        assert sorted(os.sched_getaffinity(0)) == allowed
    with latency.driver_cores(LatencyConfig(), 1, "cpu") as held:
        assert held == "not pinned"
    # hw.latency.first_core: the servers' cores, then the driver's, begin that far in
    assert latency.host_cores(1, 1, "cpu") == allowed[1:2]
    with latency.driver_cores(LatencyConfig(driver_cores=1, first_core=1), 0, "cpu") as held:
        assert held == str(allowed[1])
    late = LatencyConfig(cores_per_server=1, driver_cores=1, first_core=1)
    with latency.driver_cores(late, cores, "cpu") as held:
        assert held == f"refused: 1 cores after 1 + {cores} x 1"
    said = latency.pin_cores(1, cores - 1, "cpu", first=1)  # one past the last core
    assert said == f"refused: process {cores - 1} of 1 cores each after the first 1, {cores} cores"


def test_a_run_s_host_usage_is_read_from_proc_and_differenced(tmp_path: Path) -> None:
    """A server's records say what took its cores from it during the run: /proc/stat's
    fields summed over its cores, in seconds; its main thread's context switches; and the
    time its cores ran anything else (their busy time less its own CPU time)."""
    tick = os.sysconf("SC_CLK_TCK")
    stat = tmp_path / "stat"
    stat.write_text(
        "cpu  9 9 9 9 9 9 9 9 0 0\n"
        f"cpu0 {tick} 0 {2 * tick} 5 0 {tick} 0 {3 * tick} 0 0\n"
        f"cpu1 {4 * tick} {tick} 0 5 0 0 {tick} 0 0 0\n"
        "cpu2 100 100 100 100 100 100 100 100 0 0\n"
        "intr 1 2 3\n"
    )
    spent = latency.cores_time([0, 1], stat)
    assert spent == {
        "user": 5.0, "nice": 1.0, "system": 2.0, "idle": 10 / tick, "iowait": 0.0,
        "irq": 1.0, "softirq": 1.0, "steal": 3.0,
    }  # fmt: skip
    assert latency.cores_time([0], tmp_path / "none") == {}
    status = tmp_path / "status"
    status.write_text(
        "Name:\tpython\nvoluntary_ctxt_switches:\t12\nnonvoluntary_ctxt_switches:\t3\n"
    )
    assert latency.switches(status) == (12, 3)
    assert latency.switches(tmp_path / "none") == (0, 0)
    before = {"wall_s": 1.0, "user_s": 1.0, "system_s": 0.5, "cores_user_s": 2.0}
    before |= {"cores_nice_s": 0.0, "cores_system_s": 1.0, "main_switches_forced": 4}
    after = {"wall_s": 11.0, "user_s": 7.0, "system_s": 1.5, "cores_user_s": 10.0}
    after |= {"cores_nice_s": 1.0, "cores_system_s": 2.0, "main_switches_forced": 10}
    # busy 10 s on its cores, of which 7 s its own: 3 s someone else's
    assert latency.used_between(before, after) == {
        "cores_nice_s": 1.0, "cores_others_s": 3.0, "cores_system_s": 1.0, "cores_user_s": 8.0,
        "main_switches_forced": 6, "system_s": 1.0, "user_s": 6.0, "wall_s": 10.0,
    }  # fmt: skip
    now = latency.usage()  # this process, for real: the fields a server's records carry
    assert now["user_s"] + now["system_s"] > 0 and now["main_switches"] >= 0
    assert set(latency.CORE_FIELDS) <= {k[6:-2] for k in now if k.startswith("cores_")}


@pytest.mark.parametrize("plan_ahead", [True, False])
def test_an_idle_decoder_plans_a_first_pass_only_when_it_is_next(plan_ahead: bool) -> None:
    """The decoder plans a request's first pass at handoff only when that pass will be its next
    step: the request's KV is inbound, and nothing else runs, is ready or is inbound (and not
    with hw.latency.plan_ahead off). The plan is of the step the decoder will run: the last
    prompt token, at its position, on the request's pages. (A CPU runner replays no graph, so
    what it is asked to plan is recorded here; the GPU tests check the plans are used.)"""
    server = decode_server(f"hw.latency.plan_ahead={str(plan_ahead).lower()}")
    assert server.runner.on_layer is None  # nobody follows a decoder's layers
    planned: list[list[Seq]] = []
    server.runner.plan_ahead = lambda b: planned.append(list(b)) or True  # type: ignore[method-assign]
    try:
        submit(server, 1)  # alone: planned
        pages = tuple(server.pool.pages_of(1))
        submit(server, 2)  # another is inbound: not planned
        submit(server, 3, tokens=1)  # a one-token prompt: ready at once, nothing inbound
    finally:
        server.control.close()
    assert planned == ([[Seq((39,), 39, pages)]] if plan_ahead else [])


@pytest.mark.parametrize(
    ("layout", "budget", "handoff", "policy", "tuned"),
    [
        ("HND", 8, "decode-first", "layerwise", {}),
        ("NHD", 1000, "decode-first", "layerwise", {}),
        ("HND", 8, "parallel", "layerwise", {}),
        (
            "HND",
            8,
            "decode-first",
            "layerwise",
            {"spin": True, "cpu_latency_us": 1, "cores_per_server": 1, "driver_cores": 1},
        ),
        ("HND", 8, "parallel", "whole", {"meta_in_stream": True, "overlap": True}),
    ],
    ids=[
        "HND-chunked",
        "NHD-whole-prompt",
        "HND-chunked-parallel-handoff",
        "servers-spin",
        "parallel-whole-request-posts-in-stream-overlap",
    ],
)
def test_disaggregated_equals_colocated(
    colocated,
    layout: str,
    budget: int,
    handoff: str,
    policy: str,
    tuned: dict,
    tmp_path: Path,
) -> None:
    """Under parallel handoff the driver sends each request to the prefill server too, which
    starts before the decoder's pages are known; the pages and metadata reach the decoder all
    the same. So they do with the latency settings ([hw.latency]): servers polling without
    sleeping, a pass's last posts made before the host waits for its end (ordered after it
    on the wire), and the decoder asking for its next pass's plan while a pass runs."""
    model, reference = colocated
    data = experiment(model, "disagg", layout, budget, handoff)
    data["transfer"]["policy"] = policy
    data["hw"] = {"latency": tuned}
    qos = "/dev/cpu_dma_latency"  # the servers may hold it only where this process could
    held_here = "1 us" if os.access(qos, os.W_OK) else f"refused: {qos}: "
    summary, state = run(tmp_path, "disagg", data)
    finished = state.finished
    submits = {name: r.submits for name, r in state.records.items()}
    assert submits == {"prefill0": 5 if handoff == "parallel" else 0, "decode0": 5}
    spin = tuned.get("spin", False)
    for r in state.records.values():  # the settings reached the spawned servers, took effect
        assert r.settings["switch_interval_s"] == pytest.approx(1e-4 if spin else 5e-3)
        held = r.settings["cpu_latency"]  # asked for 1 us; a host may refuse (not as root)
        assert held == "not asked" if not spin else held.startswith(held_here)
    cores = {name: r.settings["cores"] for name, r in state.records.items()}
    allowed = sorted(os.sched_getaffinity(0))  # the servers' own, inherited: no GPU to be near
    assert cores == (
        {"prefill0": str(allowed[0]), "decode0": str(allowed[1])}
        if spin
        else {"prefill0": "not pinned", "decode0": "not pinned"}
    )
    written = json.loads((tmp_path / "disagg" / "summary.json").read_text())
    # the driver on the core after the servers' while it drove the run (a 2-core host has none)
    driver = str(allowed[2]) if len(allowed) > 2 else "refused: 1 cores after 2 x 1"
    assert written["driver_cores"] == (driver if spin else "not pinned")
    assert sorted(os.sched_getaffinity(0)) == allowed  # and back on its own cores after
    assert written["node_settings"]["prefill0"] == state.records["prefill0"].settings
    assert written["node_settings"]["prefill0"]["warm_up_s"] is None  # on the CPU: no warm-up
    for r in state.records.values():  # weights drawn and pages allocated; no graphs on a CPU
        assert r.settings["build_s"] > 0 and r.settings["capture_s"] == 0
        used = r.settings["host_during_run"]  # from the driver's Start to the records
        assert 0 < used["wall_s"] < summary["wall_s"] and used["cores_others_s"] >= 0
        assert {f"cores_{k}_s" for k in latency.CORE_FIELDS} <= used.keys()  # /proc/stat read
        assert used["user_s"] + used["system_s"] > 0 and used["main_switches"] >= 0
    ran = json.loads((tmp_path / "disagg" / "experiment.json").read_text())
    assert ran["hw"]["latency"] == build_experiment(data).hw.latency.model_dump(mode="json")
    assert ran["kv"]["pages"] == 128
    replay = Sim(load_experiment(tmp_path / "disagg"))  # the run simulated as it ran
    assert [n.pool.num_pages for n in replay.nodes] == [128, 128]
    assert summary["completed"] == 5 and summary["failed"] == 0
    assert summary["transfer_ops_per_request"] > 0
    # the servers' start, before the first request went out, is part of the run's wall time
    assert 0 < written["startup_s"] < written["wall_s"]
    assert sorted(finished) == sorted(reference)
    for req_id, ref in reference.items():
        got = finished[req_id]
        assert got.status == ref.status == "finished"
        assert got.tokens == ref.tokens and len(got.tokens) >= 3
        assert len(got.first_logits) == len(got.logits) == 256
        np.testing.assert_allclose(got.first_logits, ref.first_logits, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got.logits, ref.logits, rtol=1e-4, atol=1e-4)
        # the hidden state handed over for MTP is the one colocated computed at that token
        assert np.isfinite(got.metadata_sum)
        assert got.metadata_sum == pytest.approx(ref.metadata_sum, rel=1e-4, abs=1e-3)
    req = pd.read_parquet(tmp_path / "disagg" / "requests.parquet")
    assert (req.ready_s >= req.prefill_end_s - 1e-3).all()
    assert (req.first_token_s >= req.ready_s).all()
    steps = pd.read_parquet(tmp_path / "disagg" / "steps.parquet")
    assert len(steps) > 0 and steps.device_s.isna().all()  # a CPU pass is all host time
    # each request's control hops, in causal order on the run's one clock
    hops = pd.read_parquet(tmp_path / "disagg" / "hops.parquet")
    t = hops.groupby(["request_id", "node", "event"]).t_s.min().unstack(["node", "event"])
    assert sorted(t.index) == sorted(reference) and not t.isna().any().any()
    sent, at_decoder = t["driver", "sent"], t["decode0", "received"]
    handed, at_prefill = t["decode0", "handed_off"], t["prefill0", "received"]
    assert (sent <= at_decoder).all() and (at_decoder <= handed).all()
    assert (handed <= t["prefill0", "pages"]).all()
    assert ((sent if handoff == "parallel" else handed) <= at_prefill).all()
    start = req.set_index("request_id").prefill_start_s.loc[t.index]
    assert (at_prefill <= start).all()
    # the queue's parts add up to each request's queue, along the path its handoff takes
    parts = queue_parts(req, hops, handoff == "parallel")
    path = ["late", "to_prefill", "prefill_wait"]
    if handoff != "parallel":
        path[1:1] = ["to_entry", "at_decoder"]
    arrival = req.set_index("request_id").arrival_s.loc[t.index]
    np.testing.assert_allclose(parts[path].sum(axis=1), start - arrival, atol=1e-9)
    assert (parts[path] >= 0).all().all() and (parts.to_prefill > 0).all()
    medians = summary["queue_parts_ms"]
    assert sorted(medians) == sorted(parts.columns)  # all five: the decoder's hop is in both
    assert medians["to_prefill"] == pytest.approx(1e3 * parts.to_prefill.median())
    # the handoff split by when the KV's last immediate reached the decoder's wire: it leaves
    # after the prefill's last pass ends and is taken (the request ready) after it lands
    handoff = handoff_parts(req, hops)
    r = req.set_index("request_id").loc[t.index]
    np.testing.assert_allclose(handoff.sum(axis=1), r.ready_s - r.prefill_end_s, atol=1e-9)
    assert (handoff.until_taken >= 0).all() and (handoff.to_decoder > -1e-3).all()
    assert summary["handoff_parts_ms"]["until_taken"] == pytest.approx(
        1e3 * handoff.until_taken.median()
    )


@pytest.mark.parametrize("model", ["tiny-moe", "tiny-mla-moe"])
def test_an_moe_model_disaggregated_equals_colocated(model: str, tmp_path: Path) -> None:
    """MoE layers (softmax top-k; DeepSeek's grouped routing with a shared expert) on the
    path of the KV pages: chunked prefill on one server, decode on another, the same tokens
    and logits as one colocated server."""
    _, colocated = run(tmp_path, "colocated", experiment(model, "colocated", "HND", 1000))
    summary, disagg = run(tmp_path, "disagg", experiment(model, "disagg", "HND", 8))
    assert summary["completed"] == 5 and sorted(disagg.finished) == sorted(colocated.finished)
    for req_id, ref in colocated.finished.items():
        got = disagg.finished[req_id]
        assert got.status == ref.status == "finished"
        assert got.tokens == ref.tokens and len(got.tokens) >= 3
        np.testing.assert_allclose(got.logits, ref.logits, rtol=1e-4, atol=1e-4)


def test_a_dead_server_is_an_error_naming_it_and_no_child_is_left(tmp_path: Path) -> None:
    from disagg.errors import TransportError
    from disagg.hw.driver import Driver

    data = experiment("tiny-gqa", "disagg", "HND", 8)
    data["workload"] = {**data["workload"], "rate_per_s": 2, "num_requests": 20}
    driver = Driver(build_experiment(data, ["kv.pages=128"]))
    try:
        driver.start()
        driver.procs["prefill0"].kill()
        with pytest.raises(TransportError, match=r"server prefill0 died \(exit code -9\)"):
            driver.replay()
    finally:
        driver.stop()
    assert not any(p.is_alive() for p in driver.procs.values())


def test_a_server_death_ends_the_run_with_every_request_in_the_tables(tmp_path: Path) -> None:
    """A server that dies mid-run ends it (one server per role: nothing can take over), but
    not silently: every request is in the tables, finished or unfinished with the reason, the
    summary counts them, and the error says where the tables are."""
    import multiprocessing as mp

    from disagg.errors import TransportError

    data = experiment("tiny-gqa", "disagg", "HND", 8)
    data["workload"] = {**data["workload"], "rate_per_s": 4, "num_requests": 20}
    killed: list[str] = []

    def kill_prefill_after_two(done: int, total: int) -> None:
        for p in mp.active_children():
            if done >= 2 and p.name == "prefill0" and not killed:
                p.kill()
                killed.append(p.name)

    out = tmp_path / "run"
    with pytest.raises(TransportError, match=r"server prefill0 died(.|\n)*tables of what ran"):
        run_hw(build_experiment(data, ["kv.pages=128"]), out, kill_prefill_after_two)
    req = pd.read_parquet(out / "requests.parquet")
    assert len(req) == 20 and set(req.status) <= {"finished", "unfinished"}
    unfinished = req[req.status == "unfinished"]
    assert (req.status == "finished").sum() >= 2 and len(unfinished) >= 1
    assert unfinished.fail_reason.str.startswith("the run stopped: server prefill0 died").all()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["unfinished"] == len(unfinished) and "prefill0 died" in summary["stopped"]
    assert not mp.active_children()


@pytest.mark.parametrize("stalled", ["decode0", "prefill0"])
def test_a_server_stalled_then_resumed_loses_no_request(stalled: str, tmp_path: Path) -> None:
    """SIGSTOP one server for longer than its peer's death time, with work queued, then
    SIGCONT. Its peer thought it dead and gave its transfers up; when it comes back every
    request still ends (finished, or failed with a reason), nothing crashes or hangs, and no
    page is left reserved (the run's own check: requests all accounted for)."""
    import os
    import signal
    import threading

    data = experiment("tiny-gqa", "disagg", "HND", 8)  # 8-token chunks: prefill is the queue
    data["workload"] |= {"rate_per_s": 40, "num_requests": 30}
    data["workload"]["prompt_tokens"] = {"dist": "uniform", "low": 300, "high": 500}
    data["transfer"] |= {"timeout_s": 2.0, "max_attempts": 5}
    settings = ["kv.pages=4096", "hw.dead_after_s=1", "hw.drain_timeout_s=60"]
    stopped: list[int] = []

    def stall_once(done: int, total: int) -> None:
        if done >= 1 and not stopped:
            import multiprocessing as mp

            (proc,) = [p for p in mp.active_children() if p.name == stalled]
            os.kill(proc.pid, signal.SIGSTOP)
            stopped.append(proc.pid)
            threading.Timer(3.0, os.kill, (proc.pid, signal.SIGCONT)).start()

    summary, state = run_hw(build_experiment(data, settings), tmp_path / "run", stall_once)
    assert stopped and len(state.finished) == 30
    req = pd.read_parquet(tmp_path / "run" / "requests.parquet")
    assert set(req.status) <= {"finished", "failed"}
    assert (req[req.status == "failed"].fail_reason != "").all()
    assert summary["completed"] >= 1 and summary["completed"] + summary["failed"] == 30
    assert summary["peers_declared_dead"] >= 1  # its peer thought it dead, and went on


def test_a_stuck_server_is_an_error_naming_it_and_says_where_its_threads_are(
    capfd: pytest.CaptureFixture[str],
) -> None:
    """A server alive but silent (here: stopped by SIGSTOP) fails the run after
    `silent_after_s`, naming it, and is killed on the way out; a server asked (SIGUSR1) writes
    every thread's stack to stderr and runs on."""
    import os
    import signal

    from disagg.errors import TransportError
    from disagg.hw.driver import Driver

    data = experiment("tiny-gqa", "disagg", "HND", 8)
    data["workload"] = {**data["workload"], "rate_per_s": 2, "num_requests": 20}
    driver = Driver(build_experiment(data, ["kv.pages=128", "hw.silent_after_s=3"]))
    try:
        driver.start()
        os.kill(driver.procs["prefill0"].pid, signal.SIGUSR1)
        os.kill(driver.procs["decode0"].pid, signal.SIGSTOP)
        with pytest.raises(TransportError, match=r"server decode0 is alive but has not been heard"):
            driver.replay()
        assert driver.stuck == {"decode0"} and driver.procs["prefill0"].is_alive()
    finally:
        driver.stop()
    assert not any(p.is_alive() for p in driver.procs.values())
    err = capfd.readouterr().err
    assert "most recent call first" in err and "in run" in err  # prefill0's main loop, at least


def test_a_peer_message_that_comes_before_the_start_is_kept_for_after_it() -> None:
    """Messages from different senders keep no order between them: a decoder already running
    can reach a prefill server before the driver's Start does (on a loaded 2-core machine a
    request's pages were dropped so, and the request lost). The server keeps them, in order,
    and handles them once it runs, before what the same peer sent after them."""
    import threading

    from disagg.core.messenger import CancelTransfer, PrefillRequest
    from disagg.hw.control import Control
    from disagg.hw.protocol import NodeConfig, Start

    here, driver, decoder = Control("prefill0"), Control("driver"), Control("decode0")
    try:
        for sender in (driver, decoder):
            sender.connect("prefill0", here.endpoint)
        pages = PrefillRequest(3, 0, 0, 40, (5, 6, 7), 0, (), True)
        cancel, later_cancel = CancelTransfer(3, "timeout"), CancelTransfer(4, "timeout")
        decoder.send("prefill0", pages)
        decoder.send("prefill0", cancel)
        assert here.router.poll(10_000)  # in (a socket queue: no order across senders)
        # the Start comes later, from the driver's own thread, while the server waits for it
        start = threading.Timer(0.3, driver.send, ("prefill0", Start(12.5)))
        start.start()
        data = experiment("tiny-gqa", "disagg", "HND", 64)
        exp = build_experiment(data, ["kv.pages=64"]).model_dump(mode="json")
        server = PrefillServer(NodeConfig("prefill", 0, exp, "tcp://127.0.0.1:1"), here)
        early = server.wait_start()
        assert early == [("decode0", pages), ("decode0", cancel)]
        assert server.t0 == 12.5 and server.running
        start.join()
        decoder.send("prefill0", later_cancel)  # waiting in the socket when the server runs
        assert here.router.poll(10_000)
        handled: list[object] = []
        server.on_message = handled.append  # type: ignore[method-assign]
        server.handle_early(early)
        server.handle(here.recv(0.0))
        assert handled == [pages, cancel, later_cancel] and server.early_messages == 2
    finally:
        for c in (here, driver, decoder):
            c.close()


def test_external_server_started_with_hw_serve(tmp_path: Path) -> None:
    """The driver waits for a server it did not spawn (how a multi-host run starts)."""
    import subprocess
    import sys
    import threading

    from disagg.hw.driver import Driver

    data = experiment("tiny-gqa", "disagg", "HND", 8)
    driver = Driver(build_experiment(data, ["kv.pages=128"]), external=("decode0",))
    exp_file = tiny_file(tmp_path)
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "disagg.cli",
            "hw",
            "serve",
            str(exp_file),
            "--role",
            "decode",
            "--driver",
            driver.control.endpoint,
            "--pages",
            "128",
        ]
    )
    watchdog = threading.Timer(60, proc.kill)
    watchdog.start()
    try:
        driver.start()
        state = driver.replay()
    finally:
        driver.stop()
        proc.wait(30)
        watchdog.cancel()
    assert len(state.finished) == 5
    assert all(f.status == "finished" for f in state.finished.values())
    assert proc.returncode == 0


def test_profile_measured_here_drives_the_simulator(tmp_path: Path) -> None:
    """disagg hw profile writes a table; a simulation with cost.source=profile:FILE runs on it."""
    from typer.testing import CliRunner

    from disagg.cli import app
    from disagg.config import load_experiment
    from disagg.hw.profile import profile
    from disagg.models import TINY_GQA
    from disagg.sim.cluster import Sim
    from disagg.sim.costmodel import ProfileCost, StepShape

    csv = tmp_path / "tiny.csv"
    profile(
        TINY_GQA,
        2,
        "cpu",
        prefill_tokens=(16, 64),
        prefill_context=(0, 64),
        decode_batch=(1, 4),
        decode_context=(32, 128),
        warmup=1,
        repeats=3,
    ).to_csv(csv, index=False)
    cost = ProfileCost(csv)
    assert cost.step_time(StepShape(prefill_tokens=64, prefill_attn_pairs=64 * 65 / 2)) > 0
    exp = load_experiment(
        Path(__file__).parent.parent / "experiments" / "tiny-disagg.toml",
        [f"cost.source=profile:{csv}"],
    )
    sim = Sim(exp)
    assert all(isinstance(n.cost, ProfileCost) for n in [*sim.prefills, *sim.decodes])
    sim.run()
    assert all(r.status == "finished" for r in sim.requests.values())
    res = CliRunner().invoke(app, ["hw", "profile", "--model", "nope"])
    assert res.exit_code == 2 and "unknown model" in res.output


CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200)"
)
TWO_GPUS = pytest.mark.skipif(
    torch.cuda.device_count() < 2, reason="needs two CUDA GPUs (runs on nvidia-h200-x2)"
)


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("model", "layout", "handoff"),
    [
        ("llama-3.1-8b", "HND", "decode-first"),
        ("llama-3.1-8b", "NHD", "decode-first"),
        ("deepseek-v3", "HND", "decode-first"),
        ("deepseek-v3", "NHD", "decode-first"),
        ("llama-3.1-8b", "HND", "parallel"),
    ],
)
def test_gpu_disaggregated_equals_colocated_over_the_cuda_wire(
    model: str, layout: str, handoff: str, tmp_path: Path
) -> None:
    """bf16 + FlashInfer, two processes on one GPU exchanging pages by CUDA IPC peer copies."""
    gpu_equals_colocated(model, layout, handoff, "cuda:0", tmp_path)


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("policy", ["layerwise", "whole"])
def test_gpu_latency_options_carry_the_same_pages_and_metadata(
    policy: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Both latency options on: the pass's last posts wait for its end on the wire's stream,
    not on the host, and the servers spin; pages and metadata arrive the same."""
    monkeypatch.setenv("DISAGG_META_IN_STREAM", "1")
    monkeypatch.setenv("DISAGG_SPIN", "1")
    gpu_equals_colocated("llama-3.1-8b", "HND", "decode-first", "cuda:0", tmp_path, policy)


@CUDA
@pytest.mark.gpu
@TWO_GPUS
@pytest.mark.parametrize(
    ("model", "layout", "handoff"),
    [
        ("llama-3.1-8b", "HND", "decode-first"),
        ("llama-3.1-8b", "HND", "parallel"),
        ("deepseek-v3", "NHD", "decode-first"),
    ],
)
def test_gpu_two_devices_disaggregated_equals_colocated(
    model: str, layout: str, handoff: str, tmp_path: Path
) -> None:
    """Prefill on cuda:0, decode (and the colocated run) on cuda:1: pages cross by peer copies
    into the decoder's memory, mapped in the prefill GPU's context."""
    gpu_equals_colocated(model, layout, handoff, "cuda:1", tmp_path)


def gpu_equals_colocated(
    model: str,
    layout: str,
    handoff: str,
    decode_device: str,
    tmp_path: Path,
    policy: str = "layerwise",
) -> None:
    out = {}
    for mode, budget in (("colocated", 4096), ("disagg", 48)):
        data = experiment(model, mode, layout, budget, handoff)
        data["transfer"]["policy"] = policy
        data["model"]["layers"] = 2
        data["kv"]["page_size"] = 16
        data["workload"]["prompt_tokens"] = {"dist": "uniform", "low": 40, "high": 300}
        data["hw"] = {"wire": "cuda", "prefill_device": "cuda:0", "decode_device": decode_device}
        data["kv"]["pages"] = 256
        summary, state = run_hw(build_experiment(data), tmp_path / mode, return_logits=True)
        assert summary["completed"] == 5
        out[mode] = state.finished
        if mode == "disagg":  # an idle decoder plans a request's first pass while KV is inbound
            counters = state.records["decode0"].counters
            assert summary["passes_planned_ahead"] == counters["passes_planned_ahead"] >= 1
        # every decode graph was captured at start (none failed): no step paid for a capture
        assert summary["graphs_captured_on_demand"] == 0
        for name, r in state.records.items():
            assert r.settings["graph_error"] == ""
            assert bool(r.settings["cuda_graphs"]) is not name.startswith("prefill")
        assert 0 < summary["host_share_of_pass_time"] < 1
        # every pass's device time is measured, and is part of its wall time
        steps = pd.read_parquet(tmp_path / mode / "steps.parquet")
        assert (steps.device_s > 0).all()
        assert (steps.device_s <= steps.duration_s + 1e-4).all()
    for req_id, ref in out["colocated"].items():
        got = out["disagg"][req_id]
        # The first token is chosen from logits that read every transferred page: it and its
        # logits must match. Later tokens come from bf16 decode passes over KV computed in
        # other chunk and batch shapes; a random-weight model has near-ties among 128k
        # logits, so a later argmax may flip, and the tail then differs.
        assert got.tokens[0] == ref.tokens[0]
        first, ref_first = np.asarray(got.first_logits), np.asarray(ref.first_logits)
        scale = np.abs(ref_first).max()
        assert np.abs(first - ref_first).max() < 0.03 * scale
        assert np.corrcoef(first, ref_first)[0, 1] > 0.999
        assert got.metadata_sum == pytest.approx(ref.metadata_sum, rel=0.05, abs=0.5)


def test_a_server_that_cannot_start_says_why(tmp_path: Path) -> None:
    from disagg.errors import ConfigError, TransportError

    data = experiment("tiny-gqa", "disagg", "HND", 8)
    data["model"]["name"] = "llama-3.1-70b"  # 280 GB of float32 weights on this CPU
    with pytest.raises(TransportError, match=r"llama-3.1-70b weights \(80 layers\) needs"):
        run_hw(build_experiment(data, ["kv.pages=16"]), tmp_path / "x")
    data = experiment("tiny-gqa", "disagg", "HND", 8)
    data["cluster"]["decode"]["dp"] = 2  # (a node of tp 2 runs: tests/test_hw_tp_nodes.py)
    with pytest.raises(ConfigError, match=r"cluster\.decode has nodes=1 tp=1 dp=2"):
        run_hw(build_experiment(data), tmp_path / "y")


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_cli_hw_run_waits_for_an_external_server_on_its_bound_socket(tmp_path: Path) -> None:
    """`disagg hw run --external decode0 --bind ...` and `disagg hw serve --driver ...`, both
    from the command line: how a two-host run starts (here two processes on one machine)."""
    import subprocess
    import sys

    exp_file = tiny_file(tmp_path, num_requests=4)
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    cli = [sys.executable, "-m", "disagg.cli", "hw"]
    common = [str(exp_file), "--pages", "128", "--attention", "torch"]
    out = tmp_path / "out"
    driver = subprocess.Popen(
        [*cli, "run", *common, "--external", "decode0", "--bind", endpoint, "--out", str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    server = subprocess.Popen([*cli, "serve", *common, "--role", "decode", "--driver", endpoint])
    try:
        text, _ = driver.communicate(timeout=120)
        assert server.wait(30) == 0
    finally:
        for p in (driver, server):
            p.kill()
    assert driver.returncode == 0, text
    req = pd.read_parquet(out / "requests.parquet")
    assert len(req) == 4 and (req.status == "finished").all()


@pytest.mark.parametrize(
    ("option", "said"),
    [
        (["--attention", "flashinfer:fa9"], "unknown attention 'flashinfer:fa9'"),
        (["--silent-after-s", "0"], "hw.silent_after_s: Input should be greater than 0"),
    ],
)
def test_cli_hw_run_rejects_a_bad_option(option: list[str], said: str) -> None:
    import subprocess
    import sys

    proc = subprocess.run(
        [sys.executable, "-m", "disagg.cli", "hw", "run", *option],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert proc.returncode == 2 and said in proc.stdout
    assert "Traceback" not in proc.stdout + proc.stderr


def test_prefill_server_recomputes_an_evicted_early_start() -> None:
    """Parallel handoff under prefill memory pressure, in the real server's glue: an early start
    (the router's half, pages unknown) is evicted for a request whose decoder pages are known,
    and when it starts again the server still has its prompt and schedules it anew."""
    from disagg.core import messenger as m
    from disagg.hw.protocol import NodeConfig, Submit

    data = experiment("tiny-gqa", "disagg", "HND", 64, "parallel")
    data["kv"]["page_size"] = 16
    exp = build_experiment(data, ["kv.pages=4"]).model_dump(mode="json")
    server = PrefillServer(NodeConfig("prefill", 0, exp, "tcp://127.0.0.1:1"))
    try:
        assert server.runner.on_layer is not None  # its watcher follows the counter
        server.control.connect("decode0", "tcp://127.0.0.1:2")  # messages queue, unsent
        a, b = tuple(range(40)), tuple(range(100, 140))  # 39 tokens each: 3 of the 4 pages
        server.on_message(Submit(1, 0.0, a, 4))
        role = server.role
        assert [r.id for r, _ in role.scheduler.queue] == [1]  # type: ignore[attr-defined]
        server.on_message(m.PrefillRequest(2, 0, 0, 40, (0, 1, 2), 0, b))  # pages known
        assert role.messenger.evicted == 1 and list(role.messenger.parked) == [1]
        assert [r.id for r, _ in role.scheduler.queue] == [2]  # type: ignore[attr-defined]
        server.on_message(m.PrefillRequest(1, 1, 0, 40, (3, 4, 5), 0, (), True))  # A's pages
        server.on_message(m.CancelTransfer(2, "cancelled by the test"))  # B leaves, A starts
        queue = [(r.id, r.prompt) for r, _ in role.scheduler.queue]  # type: ignore[attr-defined]
        assert queue == [(1, a)]
        assert list(role.requests) == [1]  # B's prompt went with it
    finally:
        server.watcher.stop()
        server.control.close()


@CUDA
@pytest.mark.gpu
def test_servers_that_decode_capture_their_graphs_at_start() -> None:
    """Decode and colocated servers capture the decode graphs up to their own group's batch
    limit when they are built (before they report ready); a prefill server captures none."""
    from disagg.hw.protocol import NodeConfig

    captured = {}
    for role, mode, cls in (
        ("decode", "disagg", DecodeServer),
        ("colocated", "colocated", ColocatedServer),
        ("prefill", "disagg", PrefillServer),
    ):
        data = experiment("llama-3.1-8b", mode, "HND", 64)  # head_dim 128: FlashInfer's
        data["model"]["layers"] = 1
        data["kv"]["page_size"] = 16
        batching = "colocated" if mode == "colocated" else "decode"
        data["cluster"][batching]["max_batch"] = {"decode": 6, "colocated": 3}[batching]
        data["hw"] = {"prefill_device": "cuda:0", "decode_device": "cuda:0"}
        exp = build_experiment(data, ["kv.pages=16"]).model_dump(mode="json")
        server = cls(NodeConfig(role, 0, exp, "tcp://127.0.0.1:1"))
        captured[role] = server.runner.captured
        if isinstance(server, PrefillServer):
            server.watcher.stop()
        server.control.close()
    assert captured == {"decode": [1, 2, 4, 8], "colocated": [1, 2, 4], "prefill": []}
