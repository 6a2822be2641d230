"""Disaggregated serving over the verbs wire on a real verbs device (soft-RoCE rxe0 in the test
VM): a prefill process and a decode process, each with its own verbs context on the one device,
give the colocated run's tokens and logits, so the KV pages, the immediates and the metadata all
land intact over RDMA WRITE / WRITE_WITH_IMM.

The same check as tests/test_hw_disagg.py (which runs it over tcp), kept small for qemu TCG: the
tiny models, four requests, a few output tokens, and the servers forked from a process that
imported torch once (under TCG every import of torch takes about 25 s). CPU, float32; batches
differ between the two runs, so logits agree to float32 rounding and the greedy tokens exactly.
"""

from __future__ import annotations

import multiprocessing
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch")
pytest.importorskip("zmq")
pd = pytest.importorskip("pandas")

from disagg.config import build_experiment
from disagg.hw import driver
from disagg.hw.driver import run_hw

pytestmark = pytest.mark.rdma
REQUESTS = 4


@pytest.fixture(scope="module", autouse=True)
def servers_from_a_forkserver(rdma_device: str) -> Iterator[None]:
    """The driver spawns each server afresh; here they fork from a forkserver that has imported
    the server module (and torch) once. Each server still opens its own verbs context."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(["disagg.hw.node", "disagg.hw.prefill", "disagg.hw.decode"])
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(driver, "mp", SimpleNamespace(get_context=lambda method: ctx))
        yield


def groups(mode: str, budget: int) -> dict[str, Any]:
    """One node of each group the mode runs (a group it does not run is an error)."""
    if mode == "colocated":
        return {"colocated": {"nodes": 1, "tp": 1, "token_budget": budget, "max_batch": 8}}
    return {
        "prefill": {"nodes": 1, "tp": 1, "token_budget": budget},
        "decode": {"nodes": 1, "tp": 1, "max_batch": 8},
    }


def experiment(model: str, mode: str, layout: str, budget: int) -> dict[str, Any]:
    return {
        "name": f"{model}-{mode}",
        "seed": 5,
        "model": {"name": model, "weight_dtype": "bf16"},
        "cluster": {"mode": mode, **groups(mode, budget)},
        "kv": {"page_size": 4, "layout": layout},
        "workload": {
            "rate_per_s": 50,
            "num_requests": REQUESTS,
            "prompt_tokens": {"dist": "uniform", "low": 6, "high": 20},
            "output_tokens": {"dist": "uniform", "low": 3, "high": 4},
        },
    }


def run(out: Path, wire: str, data: dict[str, Any]) -> tuple[dict[str, Any], dict[int, Any]]:
    settings = [f"hw.wire={wire}", "kv.pages=64", "hw.start_timeout_s=300"]
    summary, state = run_hw(build_experiment(data, settings), out, return_logits=True)
    return summary, state.finished


def assert_same_requests(finished: dict[int, Any], reference: dict[int, Any]) -> None:
    """Every request finished with the colocated run's tokens, and its first and last logits
    and handed-over hidden state (the "meta" region, for MTP) to float32 rounding."""
    assert sorted(finished) == sorted(reference) == list(range(REQUESTS))
    for req_id, ref in reference.items():
        got = finished[req_id]
        assert got.status == ref.status == "finished"
        assert got.tokens == ref.tokens and len(got.tokens) >= 3
        np.testing.assert_allclose(got.first_logits, ref.first_logits, rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(got.logits, ref.logits, rtol=1e-4, atol=1e-4)
        assert np.isfinite(got.metadata_sum)
        assert got.metadata_sum == pytest.approx(ref.metadata_sum, rel=1e-4, abs=1e-3)


@pytest.mark.parametrize(
    ("model", "layout", "budget"),
    [("tiny-gqa", "HND", 8), ("tiny-mla", "NHD", 1000)],
    ids=["tiny-gqa-HND-chunked", "tiny-mla-NHD-whole-prompt"],
)
def test_disaggregated_over_verbs_equals_colocated(
    rdma_device: str, model: str, layout: str, budget: int, tmp_path: Path
) -> None:
    # the colocated server opens no wire: nothing crosses a network
    _, reference = run(tmp_path / "colocated", "tcp", experiment(model, "colocated", layout, 1000))
    disagg = experiment(model, "disagg", layout, budget)
    summary, finished = run(tmp_path / "disagg", "verbs", disagg)
    assert summary["wire"] == "verbs"
    assert summary["completed"] == REQUESTS and summary["failed"] == 0
    assert summary["transfer_ops_per_request"] > 0
    assert_same_requests(finished, reference)
    req = pd.read_parquet(tmp_path / "disagg" / "requests.parquet")
    assert (req.ready_s >= req.prefill_end_s - 1e-3).all()
    assert (req.first_token_s >= req.ready_s).all()
    xfers = pd.read_parquet(tmp_path / "disagg" / "transfers.parquet")
    assert len(xfers) == REQUESTS and (xfers["bytes"] > 0).all() and (xfers.ops > 0).all()


@pytest.fixture(scope="module")
def colocated_gqa(tmp_path_factory: pytest.TempPathFactory) -> dict[int, Any]:
    """tiny-gqa's colocated TP1 run (HND), once for the TP pairings."""
    out = tmp_path_factory.mktemp("colocated-gqa")
    return run(out, "tcp", experiment("tiny-gqa", "colocated", "HND", 1000))[1]


@pytest.mark.parametrize("tps", [(2, 1), (1, 2)], ids=["TP2-TP1", "TP1-TP2"])
def test_a_tp_mismatch_over_verbs_equals_colocated(
    colocated_gqa: dict[int, Any], tps: tuple[int, int], tmp_path: Path
) -> None:
    """A node of two ranks on the CPU keeps each rank's KV pages in a file of its directory in
    /dev/shm, mapped shared (disagg.hw.ranks), and its leader registers both ranks' pages as
    MRs of its one verbs context: tiny-gqa's 2 KV heads, one per rank at TP2, are written from
    (TP2 -> TP1) or into (TP1 -> TP2) both ranks' pages over RDMA and give the colocated TP1
    run's tokens and logits. The follower ranks fork from the same forkserver as the servers."""
    reference = colocated_gqa
    disagg = experiment("tiny-gqa", "disagg", "HND", 8)
    disagg["cluster"]["prefill"]["tp"], disagg["cluster"]["decode"]["tp"] = tps
    summary, finished = run(tmp_path / "disagg", "verbs", disagg)
    assert summary["wire"] == "verbs"
    assert summary["completed"] == REQUESTS and summary["failed"] == 0
    assert_same_requests(finished, reference)
    xfers = pd.read_parquet(tmp_path / "disagg" / "transfers.parquet")
    assert len(xfers) == REQUESTS and (xfers["bytes"] > 0).all() and (xfers.ops > 0).all()
