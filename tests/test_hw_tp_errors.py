"""Bad input to a node of several ranks (TP, DP attention): each a ConfigError naming what is
wrong, raised before any process starts where the experiment alone shows it, and leaving no
process behind where ranks had started.

Covered elsewhere: a TP that does not divide the query heads or the KV heads
(test_hw_tp_nodes, at the experiment's validation), a rank of a TP node that never joins
(test_hw_tp_nodes), a rank that dies (test_hw_tp_nodes).
"""

from __future__ import annotations

import json
import multiprocessing as mp
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")

import torch.distributed as dist
from test_hw_tp_nodes import with_tp

from disagg.config import build_experiment
from disagg.errors import ConfigError, DisaggError
from disagg.hw.batch import Seq
from disagg.hw.driver import Driver, check_hw_experiment
from disagg.hw.protocol import NodeConfig
from disagg.hw.ranks import decode_pass, encode_pass, join_node

# a Qwen3-MoE config.json at toy shapes whose experts are 18 wide: tp=4 splits its 4 query
# heads and its 2 KV heads (replicated), not its experts
TINY_QWEN3_MOE = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "decoder_sparse_step": 1,
    "head_dim": 16,
    "hidden_size": 64,
    "intermediate_size": 128,
    "max_position_embeddings": 32768,
    "mlp_only_layers": [],
    "moe_intermediate_size": 18,
    "norm_topk_prob": True,
    "num_attention_heads": 4,
    "num_experts": 8,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 2,
    "num_key_value_heads": 2,
    "vocab_size": 256,
}


def refused(data: dict, overrides: list[str], match: str) -> None:
    """`disagg hw run`'s driver refuses the experiment with `match`, before any process."""
    exp = build_experiment(data, ["hw.wire=tcp", *overrides])
    with pytest.raises(ConfigError, match=match):
        Driver(exp)
    assert not mp.active_children()


def test_a_tp_that_does_not_divide_the_experts_is_refused_before_any_process(
    tmp_path: Path,
) -> None:
    config = tmp_path / "tiny-qwen3-moe" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(TINY_QWEN3_MOE))
    data = with_tp("tiny-gqa", 1, 4)
    data["model"] = {"config": str(config), "weight_dtype": "bf16"}
    match = r"cluster\.decode: tp=4 does not divide tiny-qwen3-moe's expert width \(.*\) \(18\)"
    refused(data, [], match)


def test_a_dp_whose_ranks_do_not_split_the_mlp_is_refused_before_any_process() -> None:
    """DP attention cuts the MLP and the experts over all tp x dp ranks of the node."""
    match = r"cluster\.prefill: tp=1 x dp=3 \(3 ranks\) does not divide tiny-mla-moe's MLP width"
    refused(with_tp("tiny-mla-moe", 1, 1), ["cluster.prefill.dp=3"], match)


def test_dp_attention_of_a_gqa_model_is_refused_naming_it() -> None:
    match = r"cluster\.decode has nodes=1 tp=1 dp=2, but DP attention runs MLA models only"
    refused(with_tp("tiny-gqa", 1, 1), ["cluster.decode.dp=2"], match)


def test_a_node_of_several_ranks_on_cuda_is_refused_over_a_wire_of_host_memory() -> None:
    """Its leader holds its followers' GPU pages as CUDA IPC mappings: the cuda wire only (the
    rules of its ranks' devices and collectives: tests/test_hw_tp_cuda.py)."""
    match = (
        r"cluster\.decode\.tp=2 on cuda: a node of several ranks on GPUs runs over the cuda "
        r"wire only, not the tcp wire"
    )
    refused(with_tp("tiny-mla", 1, 2), ["hw.decode_device=cuda"], match)


def test_a_node_of_several_ranks_on_the_cpu_over_another_wire_is_refused() -> None:
    """Its ranks' pages are host memory (files mapped shared), which the tcp and verbs wires
    register and the cuda wire does not."""
    match = (
        r"cluster\.decode: tp=1 x dp=2: a node of several ranks on the CPU runs over the tcp "
        r"or verbs wire, not the cuda wire"
    )
    refused(with_tp("tiny-mla", 1, 1), ["cluster.decode.dp=2", "hw.wire=cuda"], match)
    check_hw_experiment(build_experiment(with_tp("tiny-gqa", 2, 1), ["hw.wire=verbs"]))


def node(tp_dir: Path, tp: int, dp: int) -> NodeConfig:
    data = with_tp("tiny-mla", tp, 1)
    data["cluster"]["prefill"]["dp"] = dp
    exp = build_experiment(data).model_dump(mode="json")
    return NodeConfig("prefill", 0, exp, "tcp://127.0.0.1:1", tp_dir=str(tp_dir))


def test_a_rank_outside_the_node_is_refused_before_joining(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"rank 4 is outside prefill0's world of 4 \(tp=2 x dp=2\)"
    ):
        join_node(node(tmp_path, 2, 2), 4, timeout_s=1)
    assert not list(tmp_path.iterdir())  # it did not even announce itself


def test_a_dp_rank_that_never_joins_is_a_timeout_naming_it(tmp_path: Path) -> None:
    with pytest.raises(
        ConfigError, match=r"ranks \[1\] of prefill0's 2 \(tp=1 x dp=2\) did not join its group"
    ):
        join_node(node(tmp_path, 1, 2), 0, timeout_s=1)
    assert not dist.is_initialized()


def join_as(cfg: NodeConfig, rank: int, timeout_s: float) -> None:
    """A rank's process that only joins (and says nothing: its exit code says how it went)."""
    try:
        join_node(cfg, rank, timeout_s)
    except ConfigError:
        raise SystemExit(2) from None
    dist.destroy_process_group()


def test_ranks_started_for_different_world_sizes_are_an_error_naming_both(tmp_path: Path) -> None:
    """Rank 1 started for a node of 2 ranks (tp=2), rank 0 for one of 4 (tp=2 x dp=2): the
    group cannot form; the error names each rank's world size, and both processes end."""
    ctx = mp.get_context("spawn")
    other = ctx.Process(target=join_as, args=(node(tmp_path, 2, 1), 1, 5.0))
    other.start()
    try:
        deadline = time.monotonic() + 60
        while not (tmp_path / "came.r1").exists() and time.monotonic() < deadline:
            time.sleep(0.05)
        with pytest.raises(
            ConfigError,
            match=r"prefill0's ranks disagree on its world size: rank 0 was started for "
            r"4 \(tp=2 x dp=2\) ranks, but rank 1 for 2",
        ):
            join_node(node(tmp_path, 2, 2), 0, timeout_s=2)
        other.join(timeout=60)
        assert other.exitcode == 2  # its own timeout: the group it was started for never formed
    finally:
        if other.is_alive():
            other.kill()
            other.join()
    assert not dist.is_initialized()


def test_a_pass_goes_between_ranks_as_plain_json_and_anything_else_is_refused() -> None:
    batch = [Seq.of([5, 9, 2], 0, [3, 4]), Seq.of([7], 12, [0, 8], hidden_at=-1, dp_rank=1)]
    data = encode_pass(batch)
    assert json.loads(data) == [[[5, 9, 2], 0, [3, 4], None, 0], [[7], 12, [0, 8], -1, 1]]
    assert decode_pass(data) == batch
    assert decode_pass(encode_pass(None)) is None
    assert decode_pass(encode_pass([])) == []
    for bad in (
        b"\x80\x04K\x01.",  # a pickle
        b"[[[5], 0, [3]]]",  # a Seq short of fields
        b'[[[5], 0, [3], null, "0"]]',  # a string for an integer
        b"[[[true], 0, [3], null, 0]]",  # a bool for a token
        b"[[[], 0, [3], null, 0]]",  # no tokens: not a Seq
        b"{}",
    ):
        with pytest.raises(DisaggError, match="the leader's pass is not one"):
            decode_pass(bad)
