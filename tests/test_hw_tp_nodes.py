"""Tensor-parallel nodes in the hw backend: a prefill or decode node of tp 2 runs as two real
processes (disagg.hw.ranks), its leader's one wire moving every rank's pages, and a
disaggregated run gives the colocated TP1 run's tokens, and its logits to float32 rounding, for
every TP pairing of the two sides.

CPU, float32, tiny models, gloo and the tcp wire (what CI runs): at most seven processes at
once (the driver, a node of two ranks and one of four: TP2 <-> TP4, the KV heads replicated).
"""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")

import torch.distributed

from disagg.config import build_experiment
from disagg.core import messenger as m
from disagg.errors import ConfigError, TransportError
from disagg.hardware import DEVICE_NAMES
from disagg.hw.driver import (
    Driver,
    HwRun,
    check_hw_experiment,
    hw_experiment,
    recorded_gpu,
    run_hw,
    shares_one_gpu,
)
from disagg.hw.prefill import PrefillServer
from disagg.hw.protocol import NodeConfig, pack_imm, unpack_imm
from disagg.hw.ranks import join_node
from disagg.hw.transport.base import WriteArray


def experiment(model: str, cluster: dict) -> dict:
    """5 requests of 6-30 prompt tokens and 3-7 output tokens (test_hw_disagg's workload)."""
    return {
        "name": model,
        "seed": 5,
        "model": {"name": model, "weight_dtype": "bf16"},
        "cluster": cluster,
        "kv": {"page_size": 4, "layout": "HND"},
        "workload": {
            "rate_per_s": 50,
            "num_requests": 5,
            "prompt_tokens": {"dist": "uniform", "low": 6, "high": 30},
            "output_tokens": {"dist": "uniform", "low": 3, "high": 7},
        },
    }


def colocated_tp1(model: str) -> dict:
    group = {"nodes": 1, "tp": 1, "token_budget": 1000, "max_batch": 8}
    return experiment(model, {"mode": "colocated", "colocated": group})


def with_tp(model: str, prefill_tp: int, decode_tp: int) -> dict:
    """Disaggregated, prompts in chunks of 8 tokens, a node of `<role>_tp` ranks per role."""
    return experiment(
        model,
        {
            "mode": "disagg",
            "prefill": {"nodes": 1, "tp": prefill_tp, "token_budget": 8},
            "decode": {"nodes": 1, "tp": decode_tp, "max_batch": 8},
        },
    )


def run(tmp_path: Path, name: str, data: dict) -> tuple[dict, HwRun]:
    exp = build_experiment(data, ["hw.wire=tcp", "kv.pages=64"])
    return run_hw(exp, tmp_path / name, return_logits=True)


@pytest.fixture(scope="module", params=["tiny-gqa", "tiny-mla"])
def colocated(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    model = request.param
    _, state = run(tmp_path_factory.mktemp(model), "colocated", colocated_tp1(model))
    return model, state.finished


@pytest.mark.parametrize("tps", [(2, 1), (1, 2), (2, 2)], ids=["TP2-TP1", "TP1-TP2", "TP2-TP2"])
def test_tp_nodes_give_the_colocated_tokens(
    colocated, tps: tuple[int, int], tmp_path: Path
) -> None:
    """tiny-gqa's 2 KV heads split one per rank (TP2), tiny-mla's latent replicated on both:
    each decode rank's pages, written by the prefill ranks the planner names and counted in by
    their immediates, give the colocated logits; no rank process is left, nor its files."""
    model, reference = colocated
    shm = Path("/dev/shm")
    before = set(shm.glob("disagg-*"))  # other runs' (a test that killed its servers)
    summary, state = run(tmp_path, "disagg", with_tp(model, *tps))
    assert_same_outputs(summary, state, reference)
    assert set(shm.glob("disagg-*")) <= before  # this run's ranks' files are gone


def test_tp_nodes_that_warm_up_first_give_the_colocated_tokens(colocated, tmp_path: Path) -> None:
    """With a warm-up pass at start (`hw.warm_up`, on a GPU by default): each leader runs it
    with its followers and zeroes every rank's pages it wrote, and the layers the pass counted
    do not reach the prefill leader's posts."""
    model, reference = colocated
    data = with_tp(model, 2, 2) | {"hw": {"warm_up": True}}
    summary, state = run(tmp_path, "disagg-warm", data)
    assert_same_outputs(summary, state, reference)
    for name in ("prefill0", "decode0"):
        assert summary["node_settings"][name]["warm_up_s"] > 0


def test_a_colocated_node_of_two_ranks_gives_the_tp1_tokens(colocated, tmp_path: Path) -> None:
    """The same ranks serve a colocated node: prefill chunks and decodes in one TP2 pass."""
    model, reference = colocated
    data = colocated_tp1(model)
    data["cluster"]["colocated"]["tp"] = 2
    summary, state = run(tmp_path, "colocated-tp2", data)
    assert_same_outputs(summary, state, reference)


def assert_same_outputs(summary: dict, state: HwRun, reference: dict) -> None:
    """Every request finished with the reference's tokens, and its first and last logits and
    handed-over hidden state to float32 rounding."""
    assert summary["completed"] == 5 and summary["failed"] == 0
    assert sorted(state.finished) == sorted(reference)
    for req_id, ref in reference.items():
        got = state.finished[req_id]
        assert got.status == ref.status == "finished"
        assert got.tokens == ref.tokens and len(got.tokens) >= 3
        np.testing.assert_allclose(got.first_logits, ref.first_logits, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got.logits, ref.logits, rtol=1e-4, atol=1e-4)
        assert got.metadata_sum == pytest.approx(ref.metadata_sum, rel=1e-4, abs=1e-3)


def test_prefill_posts_one_unit_per_rank_pair_and_counts_each_destination_rank() -> None:
    """TP1 -> TP2 of tiny-gqa (HND, pages of 4 fp32 tokens of 16-wide heads): the prefill
    rank's page holds K heads 0, 1 then V heads 0, 1 (256 bytes each); decode rank r takes head
    r (K then V). Per layer: one unit to each rank's region, each immediate naming its rank and
    counting the post's complete pages."""
    data = with_tp("tiny-gqa", 1, 2)
    exp = build_experiment(data, ["kv.pages=16"]).model_dump(mode="json")
    server = PrefillServer(NodeConfig("prefill", 0, exp, "tcp://127.0.0.1:1"))
    try:
        post = m.PostWrites(7, 0, 9, range(0, 2), (3, 5), (1, 2), (True, False))
        units = server.page_units(post)
    finally:
        server.watcher.stop()
        server.control.close()
    page = 2 * 2 * 4 * 16 * 4  # K and V, 2 heads, 4 tokens, 16 dims, fp32 = 1024 bytes
    assert [(u.writes.src, u.writes.dst) for u in units] == [
        ("kv0", "kv0"),
        ("kv0", "kv0.r1"),
        ("kv1", "kv1"),
        ("kv1", "kv1.r1"),
    ]
    to_rank1 = units[1].writes
    assert isinstance(to_rank1, WriteArray)
    assert list(to_rank1.src_offsets) == [
        3 * page + 256,
        3 * page + 768,
        5 * page + 256,
        5 * page + 768,
    ]
    assert list(to_rank1.dst_offsets) == [512, 768, 1024, 1280]
    assert list(to_rank1.nbytes) == [256] * 4
    assert [unpack_imm(u.imm) for u in units if u.imm] == [(9, 1, 0), (9, 1, 1)] * 2
    plan = server.plan
    assert plan.expected_immediates(2, 2, metadata=True) == {0: 5, 1: 4}


def test_an_immediate_names_its_destination_rank() -> None:
    assert pack_imm(5, 3) == 3 << 16 | 5  # rank 0: as at TP1
    assert pack_imm(5, 3, rank=1) == 3 << 16 | 1 << 12 | 5
    assert unpack_imm(pack_imm(4095, 65535, rank=15)) == (4095, 65535, 15)


@pytest.mark.parametrize("victim", ["prefill0.r1", "prefill0"], ids=["follower", "leader"])
def test_a_rank_that_dies_fails_the_run_naming_it(victim: str) -> None:
    """A rank of the prefill node killed once the run has started: the run stops with an error
    naming that rank (not the other, which only lost its group), and no process of the run,
    nor the node's directory, is left."""
    exp = build_experiment(with_tp("tiny-gqa", 2, 1), ["hw.wire=tcp", "kv.pages=64"])
    driver = Driver(exp)
    try:
        driver.start()
        os.kill(driver.procs[victim].pid, signal.SIGKILL)
        with pytest.raises(TransportError, match=rf"server {victim} died \(exit code -9\)"):
            driver.replay()
    finally:
        driver.stop()
    assert not [n for n, p in driver.procs.items() if p.is_alive()]
    assert all(not os.path.exists(d) for d in driver.tp_dirs)


def test_a_rank_that_never_joins_is_a_timeout_naming_it(tmp_path: Path) -> None:
    exp = build_experiment(with_tp("tiny-gqa", 2, 1)).model_dump(mode="json")
    cfg = NodeConfig("prefill", 0, exp, "tcp://127.0.0.1:1", tp_dir=str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"ranks \[1\] of prefill0's 2 did not join its group within 1 s"
    ):
        join_node(cfg, 0, timeout_s=1)
    assert not torch.distributed.is_initialized()


def test_a_tp_that_does_not_divide_the_heads_is_an_error_before_any_process() -> None:
    with pytest.raises(ConfigError, match=r"cluster\.prefill: tp=3 does not divide tiny-gqa's 4"):
        build_experiment(with_tp("tiny-gqa", 3, 1))


@pytest.mark.parametrize(
    ("overrides", "match"),
    [
        (["hw.wire=cuda"], r"cluster\.decode\.tp=2: .* tcp or verbs wire, not the cuda wire"),
        (["cluster.decode.dp=2"], r"cluster\.decode has nodes=1 tp=2 dp=2"),
    ],
)
def test_what_tp_nodes_do_not_run_yet_is_refused_naming_the_field(
    overrides: list[str], match: str
) -> None:
    exp = build_experiment(with_tp("tiny-gqa", 1, 2), overrides)
    with pytest.raises(ConfigError, match=match):
        check_hw_experiment(exp)


def test_a_tp2_node_started_by_hw_serve_gives_the_colocated_tokens(
    colocated, tmp_path: Path
) -> None:
    """`disagg hw serve` of a decode node of tp 2 starts both its ranks on this host, as the
    driver would (how a multi-host run starts a TP node): the driver, which spawns only the
    prefill node, gets the colocated run's tokens; no rank process or directory is left."""
    import subprocess
    import sys

    model, reference = colocated
    exp = build_experiment(with_tp(model, 1, 2), ["hw.wire=tcp", "kv.pages=64"])
    run_dir = tmp_path / "experiment"
    run_dir.mkdir()
    (run_dir / "experiment.json").write_text(exp.model_dump_json())
    shm = Path("/dev/shm")
    before = set(shm.glob("disagg-*"))
    driver = Driver(exp, external=("decode0",))
    cli = [sys.executable, "-m", "disagg.cli", "hw", "serve", str(run_dir)]
    serve = subprocess.Popen([*cli, "--role", "decode", "--driver", driver.control.endpoint])
    try:
        driver.start()
        state = driver.replay()
    finally:
        driver.stop()
        try:
            serve.wait(60)
        finally:
            serve.kill()
    assert serve.returncode == 0
    assert {i: r.tokens for i, r in state.finished.items()} == {
        i: r.tokens for i, r in reference.items()
    }
    assert all(r.status == "finished" for r in state.finished.values())
    assert set(shm.glob("disagg-*")) <= before  # the node's rank directory is gone


@pytest.mark.parametrize(
    ("tps", "layout"),
    [((2, 4), "HND"), ((4, 2), "NHD"), ((2, 1), "NHD")],
    ids=["TP2-TP4-HND", "TP4-TP2-NHD", "TP2-TP1-NHD"],
)
@pytest.mark.parametrize("colocated", ["tiny-gqa"], indirect=True)  # up to seven processes
def test_tp_mismatch_with_kv_heads_replicated_gives_the_colocated_tokens(
    colocated, tps: tuple[int, int], layout: str, tmp_path: Path
) -> None:
    """At TP4 tiny-gqa's 2 KV heads are each held by two ranks (the planner's replicas): a TP2
    prefill writes each head to both ranks that hold it, a TP4 prefill has each TP2 rank's
    head written from one of its two holders; in either page layout the decode ranks' pages
    give the colocated TP1 run's tokens and logits."""
    model, reference = colocated
    data = with_tp(model, *tps)
    data["kv"]["layout"] = layout
    summary, state = run(tmp_path, "disagg", data)
    assert_same_outputs(summary, state, reference)


@pytest.mark.parametrize(
    ("sets", "gpus", "shared"),
    [
        (["hw.prefill_device=cuda:0", "hw.decode_device=cuda:0"], 1, True),
        (["hw.prefill_device=cuda:0", "hw.decode_device=cuda"], 8, True),  # cuda is cuda:0
        (["hw.prefill_device=cuda:0", "hw.decode_device=cuda:1"], 8, False),
        (["hw.prefill_device=cuda:0", "hw.decode_device=cuda:0", "cluster.decode.tp=2"], 8, False),
        (["hw.prefill_device=cuda:0", "hw.decode_device=cuda:0", "cluster.decode.tp=2"], 1, True),
        ([], 1, False),  # the CPU
        (
            [
                "cluster.mode=colocated",
                "cluster.colocated.nodes=1",
                "cluster.colocated.tp=1",
                "hw.decode_device=cuda:0",
            ],
            1,
            False,
        ),
    ],
    ids=[
        "one-gpu",
        "cuda-is-cuda0",
        "a-gpu-each",
        "tp2-on-own-gpus",
        "tp2-on-one-gpu",
        "cpu",
        "one-server",
    ],
)
def test_a_run_records_whether_its_servers_share_one_gpu(
    sets: list[str], gpus: int, shared: bool
) -> None:
    """A hw run's experiment says cluster.shared_gpu where its servers (more than one process)
    all land on one GPU of the host, so that its replay shares one simulated GPU."""
    colocated = "cluster.mode=colocated" in sets
    tiny = (
        []
        if colocated
        else ["cluster.prefill.tp=1", "cluster.decode.tp=1", "cluster.decode.nodes=1"]
    )
    exp = build_experiment({}, ["model.name=tiny-gqa", *tiny, *sets])
    assert shares_one_gpu(exp, gpus) is shared
    assert hw_experiment(exp, gpus).cluster.shared_gpu is shared
    assert hw_experiment(exp).cluster.shared_gpu is False  # no host given: as configured


TINY_ONE_RANK = ["model.name=tiny-gqa", "cluster.prefill.tp=1", "cluster.decode.tp=1"]


@pytest.mark.parametrize(
    ("names", "recorded", "warned"),
    [
        ({"cuda:0": "NVIDIA H100 80GB HBM3"}, "H100-SXM", ""),
        ({"cuda:0": "NVIDIA H200", "cuda:1": "NVIDIA H200"}, "H200-SXM", ""),
        ({"cuda:0": "NVIDIA A100-SXM4-80GB"}, "A100-SXM-80GB", ""),
        ({"cuda:0": "NVIDIA H100 PCIe"}, "H200-SXM", "cuda:0 is NVIDIA H100 PCIe: not one GPU"),
        (
            {"cuda:0": "NVIDIA H100 80GB HBM3", "cuda:1": "NVIDIA H200"},
            "H200-SXM",
            "cuda:0 is NVIDIA H100 80GB HBM3, cuda:1 is NVIDIA H200: not one GPU",
        ),
    ],
    ids=["h100", "two-h200", "a100", "pcie-board", "mixed"],
)
def test_a_run_records_the_gpu_its_servers_ran_on(
    names: dict[str, str], recorded: str, warned: str
) -> None:
    """A hw run records the catalogue GPU whose CUDA name its devices have, whatever GPU the
    experiment names (an H200 here), so that its roofline replay models the GPU it ran on;
    where they have no one catalogue name, the experiment's, and a warning says so."""
    exp = build_experiment({}, [*TINY_ONE_RANK, "hardware.gpu=H200-SXM"])
    if warned:
        with pytest.warns(UserWarning, match=warned) as said:
            assert recorded_gpu(exp, names) == recorded
        assert "the run records hardware.gpu=H200-SXM" in str(said[0].message)
    else:
        assert recorded_gpu(exp, names) == recorded


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_gpu_a_run_on_this_gpu_records_it() -> None:
    """On a GPU of the catalogue, a run's experiment names that GPU, not the catalogue GPU it was
    given; a GPU table of the experiment's own stays."""
    name = torch.cuda.get_device_name(0)
    if name not in DEVICE_NAMES:
        pytest.skip(f"{name} is not in the catalogue")
    other = "A100-SXM-80GB" if DEVICE_NAMES[name].name != "A100-SXM-80GB" else "H200-SXM"
    devices = ["hw.prefill_device=cuda:0", "hw.decode_device=cuda:0"]
    exp = build_experiment({}, [*TINY_ONE_RANK, f"hardware.gpu={other}", *devices])
    ran = hw_experiment(exp, torch.cuda.device_count())
    assert ran.hardware.gpu_spec is DEVICE_NAMES[name]
    own = {"name": "my-gpu", "bf16_flops": 1e15, "hbm_bandwidth_bps": 3e12, "hbm_bytes": 8e10}
    custom = exp.updated(f"hardware.gpu={json.dumps(own | {'nvlink_bandwidth_bps': 4e11})}")
    kept = hw_experiment(custom, torch.cuda.device_count()).hardware.gpu_spec
    assert kept.name == "my-gpu"  # a table of its own is the experiment's model of the device
