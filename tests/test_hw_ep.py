"""Expert parallelism in the hw backend, set by `cluster.<role>.expert_parallel`: a node's
ranks each keep whole routed experts (experts / ranks of them), not a share of every expert's
width. CPU, float32, gloo, the tcp wire, toy shapes (at most four processes at once).

- a Qwen3-MoE model whose expert width (9) no TP2 splits runs at prefill TP2 with expert
  parallelism (4 experts a rank), and gives the colocated TP1 run's tokens and logits; without
  it, the same experiment is refused naming the width;
- under DP attention (tiny-mla-moe, decode DP2, 8 experts a rank) the same holds;
- bad input: expert parallelism for a dense model, or over ranks that do not split the experts,
  is a ConfigError naming the field.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the hw backend needs torch: pip install -e '.[hw]'")
pytest.importorskip("zmq")

from test_hw_tp_errors import TINY_QWEN3_MOE, refused
from test_hw_tp_nodes import assert_same_outputs, colocated_tp1, run, with_tp

from disagg.config import build_experiment
from disagg.errors import ConfigError
from disagg.hw.driver import check_hw_experiment


@pytest.fixture(scope="module")
def odd_moe(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """model table of a toy Qwen3-MoE: 8 experts of width 9 (odd: TP2 cannot split it)."""
    config = tmp_path_factory.mktemp("odd-moe") / "tiny-odd-moe" / "config.json"
    config.parent.mkdir()
    config.write_text(json.dumps(TINY_QWEN3_MOE | {"moe_intermediate_size": 9}))
    return {"config": str(config), "weight_dtype": "bf16"}


def with_model(data: dict, model: dict) -> dict:
    return data | {"model": model}


@pytest.fixture(scope="module")
def odd_moe_colocated(odd_moe: dict, tmp_path_factory: pytest.TempPathFactory) -> dict:
    data = with_model(colocated_tp1("tiny-gqa"), odd_moe)
    _, state = run(tmp_path_factory.mktemp("odd-moe-colocated"), "colocated", data)
    return state.finished


def test_prefill_tp2_with_expert_parallelism_gives_the_colocated_tokens(
    odd_moe: dict, odd_moe_colocated: dict, tmp_path: Path
) -> None:
    data = with_model(with_tp("tiny-gqa", 2, 1), odd_moe)
    data["cluster"]["prefill"]["expert_parallel"] = True
    summary, state = run(tmp_path, "tp2-ep", data)
    assert_same_outputs(summary, state, odd_moe_colocated)
    recorded = json.loads((tmp_path / "tp2-ep" / "experiment.json").read_text())
    assert recorded["cluster"]["prefill"]["expert_parallel"] is True


def test_without_expert_parallelism_the_odd_expert_width_is_refused(odd_moe: dict) -> None:
    data = with_model(with_tp("tiny-gqa", 2, 1), odd_moe)
    refused(data, [], r"cluster\.prefill: tp=2 does not divide tiny-odd-moe's expert width")


def test_decode_dp2_with_expert_parallelism_gives_the_colocated_tokens(tmp_path: Path) -> None:
    _, reference = run(tmp_path, "colocated", colocated_tp1("tiny-mla-moe"))
    data = with_tp("tiny-mla-moe", 1, 1)
    data["cluster"]["decode"] |= {"dp": 2, "expert_parallel": True}
    summary, state = run(tmp_path, "dp2-ep", data)
    assert_same_outputs(summary, state, reference.finished)


def test_expert_parallelism_passes_the_checks_that_width_sharding_fails(odd_moe: dict) -> None:
    data = with_model(with_tp("tiny-gqa", 1, 2), odd_moe)
    data["cluster"]["decode"]["expert_parallel"] = True
    check_hw_experiment(build_experiment(data, ["hw.wire=tcp"]))  # 4 whole experts a rank


def test_expert_parallelism_for_a_dense_model_is_refused_naming_the_field() -> None:
    data = with_tp("tiny-gqa", 2, 1)
    data["cluster"]["prefill"]["expert_parallel"] = True
    with pytest.raises(ConfigError, match=r"cluster\.prefill\.expert_parallel=true, but tiny-gqa"):
        build_experiment(data)


def test_expert_parallelism_over_ranks_that_do_not_split_the_experts_is_refused() -> None:
    data = with_tp("tiny-mla-moe", 1, 1)
    data["cluster"]["decode"] |= {"dp": 3, "expert_parallel": True}
    match = r"cluster\.decode\.expert_parallel=true: 3 ranks \(tp=1 x dp=3\) do not split"
    with pytest.raises(ConfigError, match=match):
        build_experiment(data)
