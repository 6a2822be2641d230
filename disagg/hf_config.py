"""A Hugging Face `config.json` -> ModelSpec, for the Llama, Qwen, Mixtral and DeepSeek families.

`model_type` picks the mapping. Dense and GQA models: llama, qwen2, qwen3. MoE: mixtral (every
layer's MLP is `num_local_experts` experts of `intermediate_size`), qwen3_moe. MLA + MoE:
deepseek_v2, deepseek_v3. Fields that Hugging Face itself defaults (num_key_value_heads,
head_dim, tie_word_embeddings, the DeepSeek layer layout) take the same defaults here; every
other field the mapping reads must be present, or a ConfigError names the file, the
architecture and the field. Nothing is downloaded: the user gives the file.
"""

from __future__ import annotations

import functools
import json
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path
from typing import Any

from disagg.errors import ConfigError
from disagg.models import ModelSpec


class _Fields:
    """Typed reads of one config.json's fields; errors name the file and architecture."""

    def __init__(self, cfg: Mapping[str, Any], source: str, arch: str) -> None:
        self.cfg, self.arch, self.where = cfg, arch, f"{source} (model_type {arch!r})"

    def int(self, key: str, default: int | None = None, minimum: int = 1) -> int:
        """Field `key`, an integer >= `minimum`; `default` if absent or null (None: required)."""
        v = self.cfg.get(key)
        if v is None:
            if default is None:
                raise ConfigError(f"{self.where}: field {key!r} missing; the mapping needs it")
            return default
        if isinstance(v, bool) or not isinstance(v, int) or v < minimum:
            raise ConfigError(
                f"{self.where}: field {key!r} = {v!r} must be an integer >= {minimum}"
            )
        return v

    def number(self, key: str, default: float) -> float:
        """Field `key`, a positive number; `default` if absent or null."""
        v = self.cfg.get(key)
        if v is None:
            return default
        if isinstance(v, bool) or not isinstance(v, int | float) or not v > 0:
            raise ConfigError(f"{self.where}: field {key!r} = {v!r} must be a positive number")
        return float(v)

    def flag(self, key: str, default: bool) -> bool:
        v = self.cfg.get(key, default)
        if not isinstance(v, bool):
            raise ConfigError(f"{self.where}: field {key!r} = {v!r} must be true or false")
        return v

    def unsupported(self, key: str, value: Any, why: str) -> ConfigError:
        return ConfigError(f"{self.where}: field {key!r} = {value!r} is not supported: {why}")


def _gqa(f: _Fields, name: str) -> ModelSpec:
    """The fields every GQA family shares: attention shapes, vocabulary, context, dense MLP."""
    hidden, heads = f.int("hidden_size"), f.int("num_attention_heads")
    if f.cfg.get("head_dim") is None and hidden % heads:
        raise ConfigError(
            f"{f.where}: field 'head_dim' missing and hidden_size={hidden} is not a multiple "
            f"of num_attention_heads={heads}"
        )
    return ModelSpec(
        name=name,
        hidden=hidden,
        layers=f.int("num_hidden_layers"),
        heads=heads,
        kv_heads=f.int("num_key_value_heads", heads),
        head_dim=f.int("head_dim", hidden // heads),
        vocab=f.int("vocab_size"),
        intermediate=f.int("intermediate_size"),
        max_context=f.int("max_position_embeddings"),
        tied_embeddings=f.flag("tie_word_embeddings", False),
    )


def _mixtral(f: _Fields, name: str) -> ModelSpec:
    spec = _gqa(f, name)  # softmax over the chosen experts' logits: renormalised top-k
    experts = f.int("num_local_experts")
    return _with_moe(spec, experts, f.int("num_experts_per_tok"), spec.intermediate, 0, 0)


def _qwen3_moe(f: _Fields, name: str) -> ModelSpec:
    spec = _gqa(f, name)
    step = f.int("decoder_sparse_step", 1)
    if step != 1:
        raise f.unsupported("decoder_sparse_step", step, "only every layer MoE (1) is modelled")
    dense = f.cfg.get("mlp_only_layers") or []
    if dense != list(range(len(dense))):
        raise f.unsupported("mlp_only_layers", dense, "only the first layers can be dense")
    experts, top_k = f.int("num_experts"), f.int("num_experts_per_tok")
    spec = _with_moe(spec, experts, top_k, f.int("moe_intermediate_size"), 0, len(dense))
    return replace(spec, norm_topk=f.flag("norm_topk_prob", False))


def _with_moe(
    spec: ModelSpec, experts: int, top_k: int, width: int, shared: int, dense: int
) -> ModelSpec:
    return replace(
        spec,
        experts=experts,
        experts_per_token=top_k,
        moe_intermediate=width,
        shared_experts=shared,
        dense_layers=dense,
    )


def _deepseek(f: _Fields, name: str) -> ModelSpec:
    freq = f.int("moe_layer_freq", 1)
    if freq != 1:
        raise f.unsupported("moe_layer_freq", freq, "only every layer after the dense ones is MoE")
    nope, rope = f.int("qk_nope_head_dim"), f.int("qk_rope_head_dim")
    v3 = f.arch == "deepseek_v3"
    method = f.cfg.get("topk_method", "noaux_tc" if v3 else "greedy")
    if method not in ("greedy", "noaux_tc"):
        raise f.unsupported("topk_method", method, "greedy and noaux_tc routing are modelled")
    grouped = method == "noaux_tc"
    return ModelSpec(
        name=name,
        hidden=f.int("hidden_size"),
        layers=f.int("num_hidden_layers"),
        heads=f.int("num_attention_heads"),
        head_dim=nope + rope,
        vocab=f.int("vocab_size"),
        intermediate=f.int("intermediate_size"),
        attention="mla",
        q_lora_rank=f.int("q_lora_rank", 0, minimum=0),  # null: queries not compressed
        kv_lora_rank=f.int("kv_lora_rank"),
        qk_nope_dim=nope,
        qk_rope_dim=rope,
        v_head_dim=f.int("v_head_dim"),
        experts=f.int("n_routed_experts"),
        experts_per_token=f.int("num_experts_per_tok"),
        shared_experts=f.int("n_shared_experts", 0, minimum=0),
        moe_intermediate=f.int("moe_intermediate_size"),
        dense_layers=f.int("first_k_dense_replace", 0, minimum=0),
        router="grouped" if grouped else "softmax",
        expert_groups=f.int("n_group", 8) if grouped else 1,
        topk_groups=f.int("topk_group", 4) if grouped else 1,
        norm_topk=f.flag("norm_topk_prob", v3),
        routed_scale=f.number("routed_scaling_factor", 2.5 if v3 else 1.0),
        mtp_layers=f.int("num_nextn_predict_layers", 0, minimum=0),
        max_context=f.int("max_position_embeddings"),
        tied_embeddings=f.flag("tie_word_embeddings", False),
    )


MAPPINGS: dict[str, Callable[[_Fields, str], ModelSpec]] = {
    "llama": _gqa,
    "qwen2": _gqa,
    "qwen3": _gqa,
    "qwen3_moe": _qwen3_moe,
    "mixtral": _mixtral,
    "deepseek_v2": _deepseek,
    "deepseek_v3": _deepseek,
}


def spec_from_hf(cfg: Mapping[str, Any], name: str, source: str = "config.json") -> ModelSpec:
    """Map the parsed config.json `cfg` (read from `source`, named in errors) to a ModelSpec
    called `name`."""
    arch = cfg.get("model_type")
    supported = ", ".join(MAPPINGS)
    if arch is None:
        raise ConfigError(
            f"{source}: field 'model_type' missing: cannot tell the architecture "
            f"(supported: {supported})"
        )
    if arch not in MAPPINGS:
        raise ConfigError(
            f"{source}: architecture (model_type) {arch!r} is not supported; supported: {supported}"
        )
    spec = MAPPINGS[arch](_Fields(cfg, source, arch), name)
    if spec.is_moe and spec.experts_per_token > spec.experts:
        raise ConfigError(
            f"{source}: {spec.experts_per_token} experts per token of {spec.experts} experts"
        )
    if spec.dense_layers > spec.layers:
        raise ConfigError(f"{source}: {spec.dense_layers} dense layers of {spec.layers} layers")
    return spec


def default_name(path: str | Path) -> str:
    """A model's name from its file: the directory of a `config.json`, else the file's stem."""
    p = Path(path)
    return p.parent.resolve().name if p.name == "config.json" else p.stem


def read_hf_config(path: str | Path, name: str | None = None) -> ModelSpec:
    """The ModelSpec of the config.json at `path`, called `name` (default: `default_name`).
    Parsed once per file version (path, size, modification time)."""
    p = Path(path)
    try:
        st = p.stat()
    except FileNotFoundError:
        raise ConfigError(f"model config {p} not found") from None
    if p.is_dir():
        raise ConfigError(f"model config {p} is a directory: give its config.json")
    return _read(str(p), st.st_size, st.st_mtime_ns, name or default_name(p))


@functools.lru_cache(maxsize=64)
def _read(path: str, size: int, mtime_ns: int, name: str) -> ModelSpec:
    try:
        cfg = json.loads(Path(path).read_text())
    except json.JSONDecodeError as e:
        raise ConfigError(f"{path}: not valid JSON: {e}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"{path}: not a text file") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"{path}: a config.json holds a JSON object, not {type(cfg).__name__}")
    return spec_from_hf(cfg, name, path)
