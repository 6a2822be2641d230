"""Hugging Face config.json files -> ModelSpec: the real public configs of a few models map to
the catalogue's specs, or to the parameter counts their model cards publish."""

import json
from pathlib import Path
from typing import Any

import pytest

from disagg.config import load_experiment
from disagg.core.metrics import requests_table
from disagg.errors import ConfigError
from disagg.hf_config import read_hf_config, spec_from_hf
from disagg.models import (
    DEEPSEEK_V2_LITE,
    DEEPSEEK_V3,
    LLAMA_31_8B,
    QWEN3_30B_A3B,
    QWEN3_CODER_480B,
)
from disagg.sim.cluster import Sim

# the fields of each model's config.json on Hugging Face (extra fields the mapping ignores,
# such as rope_theta, are kept where they were, to show they are ignored)
LLAMA_31_8B_CONFIG = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 131072,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "rms_norm_eps": 1e-05,
    "rope_scaling": {
        "factor": 8.0,
        "original_max_position_embeddings": 8192,
        "rope_type": "llama3",
    },
    "rope_theta": 500000.0,
    "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
DEEPSEEK_V3_CONFIG = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "model_type": "deepseek_v3",
    "hidden_size": 7168,
    "intermediate_size": 18432,
    "moe_intermediate_size": 2048,
    "num_hidden_layers": 61,
    "num_attention_heads": 128,
    "num_key_value_heads": 128,
    "n_shared_experts": 1,
    "n_routed_experts": 256,
    "num_experts_per_tok": 8,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "first_k_dense_replace": 3,
    "moe_layer_freq": 1,
    "num_nextn_predict_layers": 1,
    "vocab_size": 129280,
    "max_position_embeddings": 163840,
    "tie_word_embeddings": False,
}
MIXTRAL_8X7B_CONFIG = {
    "architectures": ["MixtralForCausalLM"],
    "model_type": "mixtral",
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "max_position_embeddings": 32768,
    "num_attention_heads": 32,
    "num_experts_per_tok": 2,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "num_local_experts": 8,
    "sliding_window": None,
    "tie_word_embeddings": False,
    "vocab_size": 32000,
}
QWEN3_30B_A3B_CONFIG = {
    "architectures": ["Qwen3MoeForCausalLM"],
    "model_type": "qwen3_moe",
    "decoder_sparse_step": 1,
    "head_dim": 128,
    "hidden_size": 2048,
    "intermediate_size": 6144,
    "max_position_embeddings": 40960,
    "mlp_only_layers": [],
    "moe_intermediate_size": 768,
    "norm_topk_prob": True,
    "num_attention_heads": 32,
    "num_experts": 128,
    "num_experts_per_tok": 8,
    "num_hidden_layers": 48,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}
QWEN3_CODER_480B_CONFIG = {
    **QWEN3_30B_A3B_CONFIG,
    "hidden_size": 6144,
    "intermediate_size": 8192,
    "max_position_embeddings": 262144,
    "moe_intermediate_size": 2560,
    "num_attention_heads": 96,
    "num_experts": 160,
    "num_hidden_layers": 62,
    "num_key_value_heads": 8,
}
QWEN3_8B_CONFIG = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "head_dim": 128,
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "max_position_embeddings": 40960,
    "num_attention_heads": 32,
    "num_hidden_layers": 36,
    "num_key_value_heads": 8,
    "tie_word_embeddings": False,
    "vocab_size": 151936,
}
QWEN25_7B_CONFIG = {
    "architectures": ["Qwen2ForCausalLM"],
    "model_type": "qwen2",
    "hidden_size": 3584,
    "intermediate_size": 18944,
    "max_position_embeddings": 131072,
    "num_attention_heads": 28,
    "num_hidden_layers": 28,
    "num_key_value_heads": 4,
    "tie_word_embeddings": False,
    "vocab_size": 152064,
}
DEEPSEEK_V2_LITE_CONFIG = {
    "architectures": ["DeepseekV2ForCausalLM"],
    "model_type": "deepseek_v2",
    "hidden_size": 2048,
    "intermediate_size": 10944,
    "moe_intermediate_size": 1408,
    "num_hidden_layers": 27,
    "num_attention_heads": 16,
    "n_shared_experts": 2,
    "n_group": 1,  # routing: greedy softmax top-k, not renormalised
    "topk_group": 1,
    "topk_method": "greedy",
    "norm_topk_prob": False,
    "routed_scaling_factor": 1.0,
    "n_routed_experts": 64,
    "num_experts_per_tok": 6,
    "q_lora_rank": None,  # queries are not compressed
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "first_k_dense_replace": 1,
    "moe_layer_freq": 1,
    "vocab_size": 102400,
    "max_position_embeddings": 163840,
}


def write(tmp_path: Path, name: str, cfg: dict[str, Any]) -> Path:
    path = tmp_path / name / "config.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(cfg))
    return path


def test_llama_31_8b_config_maps_to_the_catalogue_spec(tmp_path: Path) -> None:
    spec = read_hf_config(write(tmp_path, "Llama-3.1-8B", LLAMA_31_8B_CONFIG), "llama-3.1-8b")
    assert spec == LLAMA_31_8B


def test_deepseek_v3_config_maps_to_the_catalogue_spec(tmp_path: Path) -> None:
    spec = read_hf_config(write(tmp_path, "DeepSeek-V3", DEEPSEEK_V3_CONFIG), "deepseek-v3")
    assert spec == DEEPSEEK_V3


def test_the_mid_size_moe_configs_map_to_the_catalogue_specs(tmp_path: Path) -> None:
    qwen = write(tmp_path, "qwen3-30b-a3b", QWEN3_30B_A3B_CONFIG)
    lite = write(tmp_path, "deepseek-v2-lite", DEEPSEEK_V2_LITE_CONFIG)
    assert read_hf_config(qwen) == QWEN3_30B_A3B
    assert read_hf_config(lite) == DEEPSEEK_V2_LITE


def test_qwen3_coder_config_maps_to_the_catalogue_spec(tmp_path: Path) -> None:
    path = write(tmp_path, "Qwen3-Coder", QWEN3_CODER_480B_CONFIG)
    assert read_hf_config(path, "qwen3-coder-480b-a35b") == QWEN3_CODER_480B


def test_the_name_defaults_to_the_config_directory(tmp_path: Path) -> None:
    assert (
        read_hf_config(write(tmp_path, "Llama-3.1-8B", LLAMA_31_8B_CONFIG)).name == "Llama-3.1-8B"
    )


def test_mixtral_8x7b_every_layer_is_8_experts_of_the_mlp_width(tmp_path: Path) -> None:
    m = read_hf_config(write(tmp_path, "Mixtral-8x7B", MIXTRAL_8X7B_CONFIG))
    assert (m.experts, m.experts_per_token, m.moe_intermediate) == (8, 2, 14336)
    assert (m.moe_layers, m.shared_experts, m.kv_heads, m.head_dim) == (32, 0, 8, 128)
    attn = 2 * 4096 * 4096 + 2 * 4096 * 8 * 128
    experts = 8 * 3 * 4096 * 14336 + 4096 * 8  # and the router
    assert m.params == 32 * (attn + experts) + 2 * 32000 * 4096
    assert 46.6e9 < m.params < 46.8e9  # "46.7B total parameters" (Mistral AI)
    assert 12.7e9 < m.active_params_per_token < 12.9e9  # "12.9B active" with the embedding
    assert m.max_context == 32768


def test_qwen3_30b_a3b_is_30_5b_with_3_3b_active(tmp_path: Path) -> None:
    m = read_hf_config(write(tmp_path, "Qwen3-30B-A3B", QWEN3_30B_A3B_CONFIG))
    assert (m.hidden, m.heads, m.kv_heads, m.head_dim) == (2048, 32, 4, 128)  # head_dim given
    assert (m.experts, m.experts_per_token, m.moe_intermediate, m.dense_layers) == (128, 8, 768, 0)
    assert m.kv_bytes_per_token("bf16") == 48 * 2 * 4 * 128 * 2
    assert 30.4e9 < m.params < 30.6e9  # the model card: 30.5B
    # the card's 3.3B counts the input embedding as well (0.31B)
    assert 3.3e9 < m.active_params_per_token + 151936 * 2048 < 3.4e9
    assert m.max_context == 40960


def test_dense_qwen_configs_match_their_cards(tmp_path: Path) -> None:
    qwen3 = read_hf_config(write(tmp_path, "Qwen3-8B", QWEN3_8B_CONFIG))
    assert not qwen3.is_moe and 8.1e9 < qwen3.params < 8.3e9  # "8.2B"
    qwen25 = read_hf_config(write(tmp_path, "Qwen2.5-7B", QWEN25_7B_CONFIG))
    assert qwen25.head_dim == 3584 // 28 == 128  # no head_dim field: hidden / heads
    assert 7.60e9 < qwen25.params < 7.62e9  # "7.61B" (its q/k/v biases are not counted)


def test_deepseek_v2_lite_without_query_compression(tmp_path: Path) -> None:
    m = read_hf_config(write(tmp_path, "DeepSeek-V2-Lite", DEEPSEEK_V2_LITE_CONFIG))
    assert (m.attention, m.q_lora_rank, m.kv_heads, m.mtp_layers) == ("mla", 0, 0, 0)
    assert m.attn_params_per_layer == 2048 * 16 * 192 + 2048 * 576 + 512 * 16 * 256 + 2048 * 2048
    assert 15.6e9 < m.params < 15.8e9  # "15.7B"
    assert 2.3e9 < m.active_params_per_token < 2.5e9  # "2.4B activated"


def test_tied_embeddings_are_counted_once(tmp_path: Path) -> None:
    tied = read_hf_config(write(tmp_path, "tied", {**QWEN3_8B_CONFIG, "tie_word_embeddings": True}))
    untied = read_hf_config(write(tmp_path, "untied", QWEN3_8B_CONFIG))
    assert untied.params - tied.params == 151936 * 4096


@pytest.mark.parametrize(
    ("cfg", "message"),
    [
        (
            {"model_type": "gpt2", "n_embd": 768},
            "architecture (model_type) 'gpt2' is not supported",
        ),
        ({"hidden_size": 4096}, "field 'model_type' missing: cannot tell the architecture"),
        (
            {k: v for k, v in LLAMA_31_8B_CONFIG.items() if k != "num_hidden_layers"},
            "(model_type 'llama'): field 'num_hidden_layers' missing; the mapping needs it",
        ),
        (
            {k: v for k, v in MIXTRAL_8X7B_CONFIG.items() if k != "num_local_experts"},
            "(model_type 'mixtral'): field 'num_local_experts' missing",
        ),
        (
            {k: v for k, v in DEEPSEEK_V3_CONFIG.items() if k != "kv_lora_rank"},
            "(model_type 'deepseek_v3'): field 'kv_lora_rank' missing",
        ),
        (
            {**LLAMA_31_8B_CONFIG, "hidden_size": "4096"},
            "field 'hidden_size' = '4096' must be an integer >= 1",
        ),
        (
            {**QWEN3_30B_A3B_CONFIG, "mlp_only_layers": [3, 7]},
            "field 'mlp_only_layers' = [3, 7] is not supported: only the first layers",
        ),
        (
            {**QWEN3_30B_A3B_CONFIG, "num_experts_per_tok": 200},
            "200 experts per token of 128 experts",
        ),
    ],
)
def test_bad_configs_name_the_file_architecture_and_field(
    tmp_path: Path, cfg: dict[str, Any], message: str
) -> None:
    path = write(tmp_path, "bad", cfg)
    with pytest.raises(ConfigError) as err:
        read_hf_config(path)
    assert str(err.value).startswith(str(path))
    assert message in str(err.value)


def test_unreadable_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"model config .*missing\.json not found"):
        read_hf_config(tmp_path / "missing.json")
    (tmp_path / "broken.json").write_text("{")
    with pytest.raises(ConfigError, match=r"broken\.json: not valid JSON"):
        read_hf_config(tmp_path / "broken.json")
    with pytest.raises(ConfigError, match="holds a JSON object, not list"):
        read_hf_config(write(tmp_path, "list", []))  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="field 'model_type' missing"):
        spec_from_hf({}, "x")


def test_a_changed_file_is_read_again(tmp_path: Path) -> None:
    path = write(tmp_path, "m", LLAMA_31_8B_CONFIG)
    assert read_hf_config(path).layers == 32
    path.write_text(json.dumps({**LLAMA_31_8B_CONFIG, "num_hidden_layers": 16, "vocab_size": 1}))
    assert read_hf_config(path).layers == 16


EXPERIMENT = """
name = "mixtral"
[model]
config = "models/Mixtral-8x7B/config.json"
weight_dtype = "bf16"
[hardware]
gpu = "A100-SXM-80GB"
[cluster]
mode = "disagg"
prefill = { nodes = 1, tp = 8 }
decode = { nodes = 1, tp = 8 }
[workload]
rate_per_s = 2
num_requests = 6
prompt_tokens = { dist = "uniform", low = 100, high = 2000 }
output_tokens = { dist = "uniform", low = 8, high = 64 }
"""


def test_an_experiment_reads_a_relative_config_and_records_it_to_replay(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`model.config` resolves from the experiment file's directory; the experiment records the
    absolute path, so its experiment.json loads the same model from anywhere; Mixtral on
    A100s simulates to the end."""
    write(tmp_path / "models", "Mixtral-8x7B", MIXTRAL_8X7B_CONFIG)
    (tmp_path / "mixtral.toml").write_text(EXPERIMENT)
    exp = load_experiment(tmp_path / "mixtral.toml")
    assert exp.model.config == str(tmp_path / "models" / "Mixtral-8x7B" / "config.json")
    assert exp.model.name == "Mixtral-8x7B" and exp.model.spec.experts == 8
    run = tmp_path / "run"
    run.mkdir()
    (run / "experiment.json").write_text(exp.model_dump_json(indent=2))
    monkeypatch.chdir(tmp_path / "models")
    assert load_experiment(run) == exp
    sim = Sim(exp)
    sim.run()
    req = requests_table(sim.requests.values())
    assert len(req) == 6 and (req.status == "finished").all()


def test_an_experiment_names_the_missing_config_field(tmp_path: Path) -> None:
    bad = {k: v for k, v in MIXTRAL_8X7B_CONFIG.items() if k != "num_experts_per_tok"}
    write(tmp_path / "models", "Mixtral-8x7B", bad)
    (tmp_path / "mixtral.toml").write_text(EXPERIMENT)
    with pytest.raises(ConfigError) as err:
        load_experiment(tmp_path / "mixtral.toml")
    assert "model.config: " in str(err.value)
    assert "(model_type 'mixtral'): field 'num_experts_per_tok' missing" in str(err.value)


def test_a_catalogue_name_that_is_a_file_points_to_model_config() -> None:
    with pytest.raises(ConfigError, match=r"is a file: give a Hugging Face config\.json as model"):
        load_experiment(None, ["model.name=models/x/config.json"])
