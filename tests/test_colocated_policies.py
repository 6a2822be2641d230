"""The colocated scheduler variants in both backends: prefill-first passes carry prompts or
decodes, never both, so its decodes wait through the prompts' passes (and only its do);
decode-priority passes that carry decodes carry short chunks. The real
backend's tokens do not depend on the policy (the model's output is the same however its
passes are batched)."""

from pathlib import Path

import pandas as pd
import pytest

from disagg.config import build_experiment
from disagg.core.metrics import requests_table, stalled_waits, steps_table
from disagg.sim.cluster import Sim

POLICIES = {
    "chunked": {"name": "chunked"},
    "prefill_first": {"name": "prefill_first"},
    "decode_priority": {"name": "decode_priority", "chunk_with_decodes": 8},
}


def experiment(policy: str, requests: int, rate_per_s: float = 40) -> dict:
    return {
        "name": f"tiny-{policy}",
        "seed": 4,
        "model": {"name": "tiny-gqa", "weight_dtype": "bf16"},
        "cluster": {
            "mode": "colocated",
            "colocated": {
                "nodes": 1,
                "tp": 1,
                "token_budget": 32,
                "max_batch": 8,
                "scheduler": POLICIES[policy],
            },
        },
        "kv": {"page_size": 4, "pages": 512},
        "hw": {"wire": "tcp"},
        "workload": {
            "rate_per_s": rate_per_s,
            "num_requests": requests,
            "prompt_tokens": {"dist": "uniform", "low": 20, "high": 60},
            "output_tokens": {"dist": "uniform", "low": 4, "high": 12},
        },
    }


def check_passes(policy: str, steps: pd.DataFrame, requests: pd.DataFrame) -> None:
    with_prompts = steps[steps.prefill_tokens > 0]
    assert len(with_prompts) and (steps.decode_seqs > 0).any()
    stalled, _ = stalled_waits(steps, requests)  # decodes kept waiting by a prompt's pass
    assert bool(stalled) == (policy == "prefill_first")
    if policy == "prefill_first":
        assert (with_prompts.decode_seqs == 0).all()
        assert min(stalled) > with_prompts.duration_s.min()
    elif policy == "decode_priority":
        mixed = with_prompts[with_prompts.decode_seqs > 0]
        assert len(mixed) and (mixed.prefill_tokens <= 8).all()
    else:  # chunked mixes prompt chunks into decode passes up to the budget
        assert (with_prompts.decode_seqs > 0).any()
        assert (with_prompts.prefill_tokens > 8).any()


@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_simulator_runs_each_policy_as_it_schedules(policy: str) -> None:
    sim = Sim(build_experiment(experiment(policy, 40)))
    sim.run()
    assert all(r.status == "finished" for r in sim.requests.values())
    check_passes(policy, steps_table(sim.rec), requests_table(sim.requests.values()))


def test_the_real_backend_runs_each_policy_with_the_same_tokens(tmp_path: Path) -> None:
    pytest.importorskip("torch")
    pytest.importorskip("zmq")
    from disagg.hw.driver import run_hw

    tokens = {}
    for policy in POLICIES:  # a burst: prompts wait while the first ones decode
        exp = build_experiment(experiment(policy, 8, rate_per_s=1000))
        _, state = run_hw(exp, tmp_path / policy)
        assert all(f.status == "finished" for f in state.finished.values())
        tokens[policy] = {i: f.tokens for i, f in state.finished.items()}
        tables = [
            pd.read_parquet(tmp_path / policy / f"{t}.parquet") for t in ("steps", "requests")
        ]
        check_passes(policy, *tables)
    assert tokens["prefill_first"] == tokens["chunked"] == tokens["decode_priority"]
