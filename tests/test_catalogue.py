"""`disagg catalogue` lists every entry with its derived figures, and the simulator runs every
catalogue model."""

import json
from pathlib import Path

import pytest
from test_hf_config import MIXTRAL_8X7B_CONFIG  # the model's config.json
from typer.testing import CliRunner

from disagg.catalogue import catalogue, count
from disagg.cli import app
from disagg.config import load_experiment
from disagg.core.metrics import requests_table
from disagg.hardware import GPUS, NICS
from disagg.models import MODELS
from disagg.sim.cluster import Sim

runner = CliRunner()


def test_json_lists_every_model_gpu_and_nic_with_derived_figures() -> None:
    res = runner.invoke(app, ["catalogue", "--json"])
    assert res.exit_code == 0, res.output
    cat = json.loads(res.output)
    assert [m["name"] for m in cat["models"]] == [m.name for m in MODELS.values()]
    assert [g["name"] for g in cat["gpus"]] == [g.name for g in GPUS.values()]
    assert [n["name"] for n in cat["nics"]] == [n.name for n in NICS.values()]
    llama2 = next(m for m in cat["models"] if m["name"] == "llama-2-7b")
    assert llama2 == {
        "name": "llama-2-7b",
        "params": 6_738_149_376,
        "active_params": 6_738_149_376 - 32000 * 4096,  # the embedding lookup multiplies nothing
        "layers": 32,
        "hidden": 4096,
        "attention": "mha",
        "heads": 32,
        "kv_heads": 32,
        "experts": 0,
        "experts_per_token": 0,
        "shared_experts": 0,
        "kv_bytes_per_token": 524_288,
        "max_context": 4096,
    }
    r1 = next(m for m in cat["models"] if m["name"] == "deepseek-r1")
    assert (r1["attention"], r1["kv_bytes_per_token"]) == ("mla", 61 * 576 * 2)
    assert (r1["experts"], r1["experts_per_token"], r1["shared_experts"]) == (256, 8, 1)
    a100 = next(g for g in cat["gpus"] if g["name"] == "A100-SXM-80GB")
    assert a100 == {
        "name": "A100-SXM-80GB",
        "bf16_flops": 312e12,
        "fp8_flops": None,
        "hbm_bytes": 80 * 10**9,
        "hbm_bandwidth_bps": 2.039e12,
        "nvlink_bandwidth_bps": 300e9,
    }
    assert next(n for n in cat["nics"] if n["name"] == "ConnectX-7")["bandwidth_gbps"] == 400


def test_tables_show_the_figures_for_people() -> None:
    res = runner.invoke(app, ["catalogue"], env={"COLUMNS": "200"})
    assert res.exit_code == 0, res.output
    for text in ("Models", "GPUs", "NICs", "A100-SXM-80GB", "llama-2-70b", "68.98B", "671B"):
        assert text in res.output
    assert "8/256+1" in res.output and "MHA 32/32" in res.output and "MLA 128" in res.output
    assert [count(n) for n in (6_738_149_376, 123_456, 12)] == ["6.738B", "123.5k", "12"]


def test_a_config_json_joins_the_listing(tmp_path: Path) -> None:
    path = tmp_path / "Mixtral-8x7B" / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(MIXTRAL_8X7B_CONFIG))
    res = runner.invoke(app, ["catalogue", "--json", "--config", str(path)])
    assert res.exit_code == 0, res.output
    mixtral = json.loads(res.output)["models"][-1]
    assert (mixtral["name"], mixtral["experts"], mixtral["max_context"]) == (
        "Mixtral-8x7B",
        8,
        32768,
    )
    assert catalogue()["models"][-1]["name"] != "Mixtral-8x7B"  # the catalogue is unchanged
    bad = runner.invoke(app, ["catalogue", "--config", str(tmp_path / "none.json")])
    assert bad.exit_code == 2 and "error: model config" in bad.output


DOC = Path(__file__).parent.parent / "docs" / "models.md"


def toml_blocks(path: Path) -> list[str]:
    """The ```toml blocks of a markdown page."""
    blocks, lines, inside = [], [], False
    for line in path.read_text().splitlines():
        if line.startswith("```"):
            if inside:
                blocks.append("\n".join(lines))
            inside, lines = line[3:].strip() == "toml", []
        elif inside:
            lines.append(line)
    return blocks


def test_every_toml_block_of_docs_models_md_loads(tmp_path: Path) -> None:
    """The page's examples load as experiments: Mixtral from its config.json on A100s, the
    catalogue names, a custom MI300X and NIC."""
    config = tmp_path / "models" / "Mixtral-8x7B" / "config.json"
    config.parent.mkdir(parents=True)
    config.write_text(json.dumps(MIXTRAL_8X7B_CONFIG))
    exps = []
    for i, block in enumerate(toml_blocks(DOC)):
        (tmp_path / f"{i}.toml").write_text(block)
        exps.append(load_experiment(tmp_path / f"{i}.toml"))
    assert len(exps) == 3
    assert exps[0].model.name == "Mixtral-8x7B" and exps[0].model.spec.experts == 8
    assert (exps[1].hardware.gpu_spec.name, exps[1].hardware.nic_spec.name) == (
        "A100-SXM-80GB",
        "EFA",
    )
    mi300x = exps[2].hardware.gpu_spec
    assert (mi300x.name, mi300x.hbm_bytes, mi300x.flops("fp8")) == ("MI300X", 192 * 10**9, 2615e12)
    assert exps[2].hardware.nic_spec.bandwidth_bps == 25e9


def small_run(name: str) -> list[str]:
    """One prefill and one decode node at 2 req/s, requests that fit a 4k context. Models
    under 200B parameters run bf16 on A100s, the larger ones fp8 on H200s; tp 8 where the
    heads allow."""
    spec = MODELS[name]
    big = spec.params > 200e9
    tp = 8 if spec.heads % 8 == 0 else 1
    return [
        f"model.name={name}",
        f"model.weight_dtype={'fp8' if big else 'bf16'}",
        f"hardware.gpu={'H200-SXM' if big else 'A100-SXM-80GB'}",
        "cluster.prefill.nodes=1",
        "cluster.decode.nodes=1",
        f"cluster.prefill.tp={tp}",
        f"cluster.decode.tp={tp}",
        "workload.rate_per_s=2",
        "workload.num_requests=6",
        'workload.prompt_tokens={dist="uniform", low=100, high=2000}',
        'workload.output_tokens={dist="uniform", low=8, high=64}',
    ]


@pytest.mark.parametrize("name", sorted(MODELS))
def test_the_simulator_runs_every_catalogue_model(name: str) -> None:
    exp = load_experiment(None, small_run(name))
    sim = Sim(exp)
    sim.run()
    req = requests_table(sim.requests.values())
    assert len(req) == 6 and (req.status == "finished").all()
    assert (req.first_token_s > req.arrival_s).all() and (req.finish_s > req.first_token_s).all()
