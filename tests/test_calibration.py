"""The simulator against recorded hardware runs: the four runs of `benchmarks/gpu_tpot.py` on
two H200s (2026-11-29, kept in tests/data/hw-runs), simulated again from their own
experiment.json with the default roofline. What must hold is what docs/calibration.md reports:
the same requests, prefill passes within 10%, decode within the roofline's known overestimate,
and the same verdict on inter-token latency, which the real backend also gives when run here
on CPU."""

from __future__ import annotations

from pathlib import Path

import pandas as pd
import pytest

from disagg.cli import run_simulation
from disagg.config import Experiment, build_experiment
from disagg.core.metrics import read_results

RUNS = Path(__file__).resolve().parent / "data" / "hw-runs" / "gpu_tpot_2026-11-29d"
NAMES = ["colocated-2rps", "disagg-2rps", "colocated-6rps", "disagg-6rps"]


@pytest.fixture(scope="module")
def both(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    out = tmp_path_factory.mktemp("sim")
    return {
        n: (read_results(RUNS / n), read_results(run_simulation(RUNS / n, None, out / n, True)[0]))
        for n in NAMES
    }


def test_the_simulator_replays_the_same_requests(both: dict[str, tuple]) -> None:
    for hw, sim in both.values():
        cols = ["request_id", "arrival_s", "prompt_tokens", "output_tokens"]
        pd.testing.assert_frame_equal(hw[0][cols], sim[0][cols], check_exact=False, atol=1e-9)
        assert sim[3]["completed"] == hw[3]["completed"] > 0


def test_prefill_passes_within_ten_percent(both: dict[str, tuple]) -> None:
    for name in ("disagg-2rps", "disagg-6rps"):
        hw, sim = (s[1] for s in both[name])
        med = [s[s.node.str.startswith("prefill")].duration_s.median() for s in (hw, sim)]
        assert abs(med[1] / med[0] - 1) < 0.10, (name, med)


def test_decode_within_the_rooflines_known_overestimate(both: dict[str, tuple]) -> None:
    # docs/calibration.md: the roofline's decode overestimate puts these TPOTs 13-31% high
    for name in ("disagg-2rps", "disagg-6rps"):
        hw, sim = (s[3]["tpot_s_p50"] for s in both[name])
        assert 1.0 <= sim / hw <= 1.4, (name, hw, sim)


def cpu_experiment(mode: str) -> Experiment:
    """tiny-gqa on CPU: six 2000-token prompts arriving at once (chunks of 1024 tokens), 24
    output tokens each. A prefill chunk costs tens of ms here, a decode pass a few."""
    groups = {
        "colocated": {"colocated": {"nodes": 1, "tp": 1, "token_budget": 1024, "max_batch": 16}},
        "disagg": {
            "prefill": {"nodes": 1, "tp": 1, "token_budget": 1024},
            "decode": {"nodes": 1, "tp": 1, "max_batch": 16},
        },
    }
    return build_experiment(
        {
            "name": f"calibration-{mode}",
            "seed": 3,
            "model": {"name": "tiny-gqa", "layers": 2},
            "cluster": {"mode": mode, **groups[mode]},
            "kv": {"page_size": 16, "pages": 1024},
            "hw": {"wire": "tcp"},  # CPU devices
            "workload": {
                "rate_per_s": 20,
                "num_requests": 6,
                "prompt_tokens": {"dist": "fixed", "value": 2000},
                "output_tokens": {"dist": "fixed", "value": 24},
            },
        }
    )


@pytest.fixture(scope="module")
def cpu_hw(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple]:
    """The real backend's colocated and disaggregated runs of `cpu_experiment`, as read back."""
    pytest.importorskip("torch")
    pytest.importorskip("zmq")
    from disagg.hw.driver import run_hw

    out = tmp_path_factory.mktemp("hw")
    runs = {}
    for mode in ("colocated", "disagg"):
        run_hw(cpu_experiment(mode), out / mode)
        runs[mode] = read_results(out / mode)
    return runs


def decode_weight(steps: pd.DataFrame) -> pd.Series:
    """Each row's decode tokens: its passes times the sequences each pass decodes."""
    return steps.steps * steps.decode_seqs


def test_both_backends_find_disaggregated_decode_steady(
    both: dict[str, tuple], cpu_hw: dict[str, tuple]
) -> None:
    # the simulator replaying the H200 runs: colocated decode stutters, disaggregated is flat
    co, dis = (both[n][1][3] for n in ("colocated-2rps", "disagg-2rps"))
    assert co["itl_s_p99"] > 4 * dis["itl_s_p99"]
    assert dis["itl_s_p99"] < 1.2 * dis["itl_s_p50"]
    # the real backend on CPU: every request done; the colocated server runs prefill chunks in
    # passes that carry decodes (over 1% of the decode tokens, so p99 is such a pass, over four
    # times its p50: measured 13-14x), and the disaggregated decoder never does. Not asked
    # here: the disaggregated p99 within 1.2x of its p50, as on GPUs, or below the colocated
    # one by a factor: on CPU the prefill server and the decoder share the cores, so its tail
    # is the OS's (the colocated p99 over it measured 13-25x, and once 2.7x on a CI machine).
    for mode in ("colocated", "disagg"):
        requests, _, _, summary = cpu_hw[mode]
        assert summary["completed"] == len(requests) == 6
        assert (requests.output_tokens == 24).all()
    co_steps, dis_steps = cpu_hw["colocated"][1], cpu_hw["disagg"][1]
    co_mixed = co_steps[(co_steps.decode_seqs > 0) & (co_steps.prefill_tokens > 0)]
    assert decode_weight(co_mixed).sum() > 0.01 * decode_weight(co_steps).sum()
    dis_decoding = dis_steps[dis_steps.decode_seqs > 0]
    assert (dis_decoding.prefill_tokens == 0).all()
    assert set(dis_decoding.node) == {"decode0"}
    # the decoder runs each prompt's last token as a decode pass: all 6 x 24 tokens come from it
    assert decode_weight(dis_decoding).sum() == 6 * 24
    co = cpu_hw["colocated"][3]
    assert co["itl_s_p99"] > 4 * co["itl_s_p50"]
