"""GPUs and NICs: the catalogue's A100, and custom entries defined in an experiment file."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from disagg.cli import app
from disagg.config import load_experiment
from disagg.errors import ConfigError
from disagg.hardware import A100_SXM_80GB, GPU, NIC, from_table, get_gpu
from disagg.sim.cluster import Sim, pool_pages

EXPERIMENTS = Path(__file__).parent.parent / "experiments"
CUSTOM = """
[hardware.gpu]
name = "half-H100"
bf16_flops = 494.5e12
fp8_flops = 989e12
hbm_bandwidth_bps = 1.675e12
hbm_bytes = 10e9
nvlink_bandwidth_bps = 225e9

[hardware.nic]
name = "slow-ethernet"
bandwidth_gbps = 25
latency_s = 20e-6
op_cost_s = 2e-6
"""


def test_a100_has_its_datasheet_figures_and_runs_fp8_weights_at_the_bf16_rate() -> None:
    a100 = get_gpu("a100-sxm-80gb")
    assert a100 is A100_SXM_80GB
    assert (a100.bf16_flops, a100.hbm_bytes, a100.hbm_bandwidth_bps) == (312e12, 80e9, 2.039e12)
    assert a100.fp8_flops is None
    assert a100.flops("fp8") == a100.flops("bf16") == 312e12  # weight-only fp8: bf16 math


def custom_experiment(tmp_path: Path) -> Path:
    base = (EXPERIMENTS / "tiny-disagg.toml").read_text()
    path = tmp_path / "custom.toml"
    path.write_text(base.replace("[cluster]", CUSTOM + "\n[cluster]"))
    return path


def test_a_custom_gpu_and_nic_come_from_the_experiment_file(tmp_path: Path) -> None:
    exp = load_experiment(custom_experiment(tmp_path))
    gpu, nic = exp.hardware.gpu_spec, exp.hardware.nic_spec
    assert gpu == GPU("half-H100", 494.5e12, 1.675e12, 10**10, 225e9, fp8_flops=989e12)
    assert nic == NIC("slow-ethernet", 25, 20e-6, 2e-6)
    assert isinstance(gpu.hbm_bytes, int)  # 10e9 in TOML is a float
    # the KV pool fills what the custom GPU's 10 GB leave: 90% of it, less weights and 8 GB
    spec, group = exp.model.spec, exp.cluster.prefill
    page_bytes = 16 * spec.kv_bytes_per_token("bf16")
    free = 10e9 * 0.9 - spec.weight_bytes("bf16") - 8e9
    assert pool_pages(exp, group, "prefill") == int(free // page_bytes)
    sim = Sim(exp)
    sim.run()
    assert sim.transfers.node.nic == nic


def test_a_run_records_the_custom_spec_so_it_replays(tmp_path: Path) -> None:
    out = tmp_path / "run"
    res = CliRunner().invoke(
        app, ["sim", "run", str(custom_experiment(tmp_path)), "--out", str(out)]
    )
    assert res.exit_code == 0, res.output
    recorded = json.loads((out / "experiment.json").read_text())["hardware"]
    assert recorded["gpu"]["name"] == "half-H100" and recorded["gpu"]["hbm_bytes"] == 10**10
    assert recorded["nic"] == {
        "name": "slow-ethernet",
        "bandwidth_gbps": 25,
        "latency_s": 20e-6,
        "op_cost_s": 2e-6,
    }
    assert load_experiment(out) == load_experiment(custom_experiment(tmp_path))


GPU_FIELDS = "name=X, bf16_flops=1e15, hbm_bandwidth_bps=3e12, nvlink_bandwidth_bps=4e11"


@pytest.mark.parametrize(
    ("override", "message"),
    [
        (
            "hardware.gpu={" + GPU_FIELDS.replace("name=X", "name='X'") + "}",
            "hardware.gpu: custom GPU: field 'hbm_bytes' missing; give every one of name, "
            "bf16_flops, hbm_bandwidth_bps, hbm_bytes, nvlink_bandwidth_bps, fp8_flops "
            "(fp8_flops optional)",
        ),
        (
            "hardware.gpu={name='X', bf16_flops=-1, hbm_bandwidth_bps=3e12, hbm_bytes=8e10, "
            "nvlink_bandwidth_bps=4e11}",
            "hardware.gpu: GPU 'X': bf16_flops=-1 must be a number > 0",
        ),
        (
            "hardware.gpu={name='X', bf16_flops=1e15, hbm_bandwidth_bps='fast', hbm_bytes=8e10, "
            "nvlink_bandwidth_bps=4e11}",
            "hardware.gpu: GPU 'X': hbm_bandwidth_bps='fast' must be a number > 0",
        ),
        (
            "hardware.gpu={name='X', bf16_flops=1e15, hbm_bandwidth_bps=3e12, hbm_bytes=8.5, "
            "nvlink_bandwidth_bps=4e11}",
            "hardware.gpu: GPU 'X': hbm_bytes=8.5 must be whole",
        ),
        (
            "hardware.nic={name='n', bandwidth_gbps=100, latency_s=0, op_cost_s=0, mtu=9000}",
            "hardware.nic: custom NIC: unknown field 'mtu'; its fields: name, bandwidth_gbps, "
            "latency_s, op_cost_s",
        ),
        (
            "hardware.nic={name='n', bandwidth_gbps=100, latency_s=-1e-6, op_cost_s=0}",
            "hardware.nic: NIC 'n': latency_s=-1e-06 must be a number >= 0",
        ),
        (
            "hardware.nic={name='EFA', bandwidth_gbps=100, latency_s=0, op_cost_s=0}",
            "hardware.nic: custom NIC: name 'EFA' is a catalogue NIC",
        ),
        ("hardware.gpu=7", "hardware.gpu: give a catalogue GPU name or a table of its fields"),
        ("hardware.gpu=B300", "unknown GPU 'B300'; known: A100-SXM-80GB, H100-SXM, H200-SXM"),
    ],
)
def test_bad_hardware_names_the_field(override: str, message: str) -> None:
    with pytest.raises(ConfigError) as err:
        load_experiment(None, [override])
    assert message in str(err.value)


def test_from_table_builds_what_the_dataclass_would() -> None:
    table = {"name": "n", "bandwidth_gbps": 200, "latency_s": 1e-6, "op_cost_s": 0}
    assert from_table(NIC, table) == NIC("n", 200, 1e-6, 0)
    assert from_table(NIC, table).bandwidth_bps == 25e9


def test_under_dp_attention_each_group_holds_the_attention_weights() -> None:
    """R1 on a node of 8 GPUs as one DP8 group of TP1 ranks: each GPU holds all of the
    attention weights and 1/8 of the rest; the pool is 8 groups of what is left."""
    exp = load_experiment(EXPERIMENTS / "r1-disagg-dp8.toml")
    spec, group = exp.model.spec, exp.cluster.decode
    assert (group.tp, group.dp) == (1, 8)
    wb = 1  # fp8 weights
    attention = spec.layers * spec.attn_params_per_layer * wb
    weights = attention + (spec.params * wb - attention) / 8
    free = exp.hardware.gpu_spec.hbm_bytes * exp.kv.memory_fraction - weights
    free -= exp.kv.activation_reserve_gb * 1e9
    page_bytes = exp.kv.page_size * spec.kv_bytes_per_token("bf16")  # the latent, whole
    assert exp.model.weight_dtype == "fp8" and exp.kv.pages is None
    assert pool_pages(exp, group, "decode") == int(free // page_bytes) * 8
