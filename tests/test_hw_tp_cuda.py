"""Nodes of several ranks on GPUs (disagg.hw.ranks): where each rank runs, which collectives
join them, and, on a CUDA host, that a TP2 node gives the TP1 run's tokens, colocated and
disaggregated over the cuda wire (the leader's one wire moving every rank's pages, a
follower's mapped through CUDA IPC).

The placement and backend rules run anywhere. The GPU tests (named `gpu`, skipped without
CUDA) run small-gqa (FlashInfer's head size 128) in bf16: on one GPU every rank shares it over
gloo; on a host of two, each rank of a TP2 node on cuda:0 gets a GPU of its own and NCCL.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")

import torch
import torch.distributed as dist

from disagg.config import build_experiment
from disagg.errors import ConfigError
from disagg.hw.driver import Driver, HwRun, run_hw
from disagg.hw.ranks import collective_backend, rank_devices
from disagg.hw.specs import small_gqa


@pytest.mark.parametrize(
    ("device", "ranks", "gpus", "devices"),
    [
        ("cuda:0", 2, 2, ["cuda:0", "cuda:1"]),
        ("cuda:1", 2, 4, ["cuda:1", "cuda:2"]),
        ("1", 2, 4, ["cuda:1", "cuda:2"]),
        ("cuda", 4, 8, ["cuda:0", "cuda:1", "cuda:2", "cuda:3"]),
        ("cuda:0", 2, 1, ["cuda:0", "cuda:0"]),  # one H200: the ranks share it
        ("cuda:1", 2, 2, ["cuda:1", "cuda:1"]),  # no cuda:2: all on the node's device
        ("cpu", 2, 8, ["cpu", "cpu"]),
        ("cuda:3", 1, 8, ["cuda:3"]),
    ],
)
def test_each_rank_runs_on_a_device_of_its_own_where_the_host_has_them(
    device: str, ranks: int, gpus: int, devices: list[str]
) -> None:
    assert rank_devices(device, ranks, gpus) == devices


def test_ranks_that_share_a_device_join_over_gloo_those_of_one_each_over_nccl() -> None:
    assert collective_backend(["cpu", "cpu"], "decode", "decode0") == "gloo"
    assert collective_backend(["cuda:0", "cuda:0"], "decode", "decode0") == "gloo"
    if dist.is_nccl_available():
        assert collective_backend(["cuda:0", "cuda:1"], "decode", "decode0") == "nccl"
    else:
        with pytest.raises(
            ConfigError,
            match=r"cluster\.decode\.tp=2 on cuda:0, cuda:1 needs NCCL, and this torch build "
            r"has none \(torch\.distributed\.is_nccl_available\(\) is False\)",
        ):
            collective_backend(["cuda:0", "cuda:1"], "decode", "cluster.decode.tp=2")


def experiment(model: dict, cluster: dict) -> dict:
    """5 requests of 40-300 prompt tokens (test_hw_disagg's GPU workload), pages of 16."""
    return {
        "name": "small-gqa",
        "seed": 5,
        "model": model,
        "cluster": cluster,
        "kv": {"page_size": 16, "layout": "HND", "pages": 256},
        "hw": {"wire": "cuda", "prefill_device": "cuda:0", "decode_device": "cuda:0"},
        "workload": {
            "rate_per_s": 50,
            "num_requests": 5,
            "prompt_tokens": {"dist": "uniform", "low": 40, "high": 300},
            "output_tokens": {"dist": "uniform", "low": 3, "high": 7},
        },
    }


def colocated(model: dict, tp: int) -> dict:
    group = {"nodes": 1, "tp": tp, "token_budget": 4096, "max_batch": 8}
    return experiment(model, {"mode": "colocated", "colocated": group})


def disagg(model: dict, prefill_tp: int, decode_tp: int) -> dict:
    return experiment(
        model,
        {
            "mode": "disagg",
            "prefill": {"nodes": 1, "tp": prefill_tp, "token_budget": 48},
            "decode": {"nodes": 1, "tp": decode_tp, "max_batch": 8},
        },
    )


def test_ranks_on_a_device_over_a_wire_of_host_memory_are_refused_before_any_process() -> None:
    """Its leader holds a follower's GPU pages as CUDA IPC mappings: the cuda wire only."""
    data = disagg({"name": "tiny-gqa", "weight_dtype": "bf16"}, 1, 2)
    exp = build_experiment(data, ["hw.wire=tcp"])
    with pytest.raises(
        ConfigError,
        match=r"cluster\.decode\.tp=2 on cuda:0: a node of several ranks on GPUs runs over the "
        r"cuda wire only, not the tcp wire",
    ):
        Driver(exp)


CUDA = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (runs on the H200)"
)


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The model table of small-gqa (disagg.hw.specs: 8 query heads, 2 KV heads of 128, 2
    layers) as a Llama config.json."""
    spec = small_gqa()
    config = tmp_path_factory.mktemp("small") / "small-gqa" / "config.json"
    config.parent.mkdir()
    fields = {
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        "vocab_size": spec.vocab,
        "intermediate_size": spec.intermediate,
        "max_position_embeddings": 4096,
    }
    config.write_text(json.dumps(fields))
    return {"config": str(config), "weight_dtype": "bf16"}


@pytest.fixture(scope="module")
def tp1(small: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    """The colocated TP1 run's finished requests, the reference."""
    _, state = run(tmp_path_factory.mktemp("tp1"), colocated(small, 1))
    return state.finished


def run(out: Path, data: dict) -> tuple[dict, HwRun]:
    shm = Path("/dev/shm")
    before = set(shm.glob("disagg-*"))
    summary, state = run_hw(build_experiment(data), out, return_logits=True)
    assert summary["completed"] == 5 and summary["failed"] == 0
    assert set(shm.glob("disagg-*")) <= before  # the ranks' directories are gone
    return summary, state


def assert_tp1_outputs(state: HwRun, reference: dict) -> None:
    """Every request's first token and its logits are the TP1 run's, to bf16 rounding (the
    ranks' partial sums are rounded to bf16 before the all-reduce adds them, not after one
    GEMM); a random-weight model has near-ties, so a later argmax may flip and the tail then
    differs, but where the tokens agree the last logits do too."""
    assert sorted(state.finished) == sorted(reference)
    for req_id, ref in reference.items():
        got = state.finished[req_id]
        assert got.status == ref.status == "finished"
        assert got.tokens[0] == ref.tokens[0]
        pairs = [(got.first_logits, ref.first_logits)]
        if got.tokens == ref.tokens:
            pairs.append((got.logits, ref.logits))
        for logits, ref_logits in pairs:
            a, b = np.asarray(logits), np.asarray(ref_logits)
            assert np.abs(a - b).max() < 0.03 * np.abs(b).max()
            assert np.corrcoef(a, b)[0, 1] > 0.999


@CUDA
@pytest.mark.gpu
def test_gpu_colocated_tp2_node_gives_the_tp1_first_tokens_and_logits(
    small: dict, tp1: dict, tmp_path: Path
) -> None:
    """Both ranks' passes on CUDA, the leader's without graphs (its followers run eagerly)."""
    _, state = run(tmp_path, colocated(small, 2))
    assert_tp1_outputs(state, tp1)
    assert not state.records["colocated0"].settings["cuda_graphs"]


@CUDA
@pytest.mark.gpu
@pytest.mark.parametrize("tps", [(2, 1), (1, 2)], ids=["TP2-TP1", "TP1-TP2"])
def test_gpu_tp2_node_over_the_cuda_wire_gives_the_colocated_first_tokens_and_logits(
    small: dict, tp1: dict, tps: tuple[int, int], tmp_path: Path
) -> None:
    """Prefill TP2 -> decode TP1: the prefill leader's wire copies its follower's pages, mapped
    from the follower's GPU. TP1 -> TP2: the prefill maps the decode follower's pages from the
    follower's own export, which the decode leader registered. Either way every page lands
    where the planner says, and the decode gives the colocated run's first tokens."""
    _, state = run(tmp_path, disagg(small, *tps))
    assert_tp1_outputs(state, tp1)
