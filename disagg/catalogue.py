"""The catalogue as rows: every model, GPU and NIC with its derived figures (`disagg catalogue`).

Rows are plain dicts in base units (parameters, bytes, FLOP/s, Gbit/s) for `--json`; `tables`
renders them for people (billions, GB, TB/s).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from rich.table import Table

from disagg.hardware import GPU, GPUS, NIC, NICS
from disagg.models import MODELS, ModelSpec


def attention_kind(spec: ModelSpec) -> str:
    """ "mla", "mha" (one KV head per query head) or "gqa"."""
    if spec.attention == "mla":
        return "mla"
    return "mha" if spec.kv_heads == spec.heads else "gqa"


def model_row(spec: ModelSpec) -> dict[str, Any]:
    """A model's shapes and derived figures; KV bytes per token in bf16, over all layers."""
    return {
        "name": spec.name,
        "params": spec.params,
        "active_params": spec.active_params_per_token,
        "layers": spec.layers,
        "hidden": spec.hidden,
        "attention": attention_kind(spec),
        "heads": spec.heads,
        "kv_heads": spec.kv_heads,
        "experts": spec.experts,
        "experts_per_token": spec.experts_per_token,
        "shared_experts": spec.shared_experts,
        "kv_bytes_per_token": spec.kv_bytes_per_token("bf16"),
        "max_context": spec.max_context,
    }


def gpu_row(gpu: GPU) -> dict[str, Any]:
    return {
        "name": gpu.name,
        "bf16_flops": gpu.bf16_flops,
        "fp8_flops": gpu.fp8_flops,
        "hbm_bytes": gpu.hbm_bytes,
        "hbm_bandwidth_bps": gpu.hbm_bandwidth_bps,
        "nvlink_bandwidth_bps": gpu.nvlink_bandwidth_bps,
    }


def nic_row(nic: NIC) -> dict[str, Any]:
    return {
        "name": nic.name,
        "bandwidth_gbps": nic.bandwidth_gbps,
        "latency_s": nic.latency_s,
        "op_cost_s": nic.op_cost_s,
    }


def catalogue(extra: Sequence[ModelSpec] = ()) -> dict[str, list[dict[str, Any]]]:
    """Every catalogue entry, then the `extra` models (read from config.json files):
    {"models": [...], "gpus": [...], "nics": [...]}, in catalogue order."""
    return {
        "models": [model_row(m) for m in (*MODELS.values(), *extra)],
        "gpus": [gpu_row(g) for g in GPUS.values()],
        "nics": [nic_row(n) for n in NICS.values()],
    }


def count(n: int) -> str:
    """A parameter count for people, to 4 significant digits: 6.738B, 68.98B, 12.35k, 12."""
    for scale, unit in ((1e9, "B"), (1e6, "M"), (1e3, "k")):
        if n >= scale:
            return f"{n / scale:.4g}{unit}"
    return str(n)


def _context(tokens: int | None) -> str:
    """A context in tokens as people write it: 128k for 131,072 (k = 1,024 here)."""
    if tokens is None:
        return "-"
    return f"{tokens // 1024}k" if tokens % 1024 == 0 else f"{tokens:,}"


def _moe(row: dict[str, Any]) -> str:
    if not row["experts"]:
        return "dense"
    shared = f"+{row['shared_experts']}" if row["shared_experts"] else ""
    return f"{row['experts_per_token']}/{row['experts']}{shared}"


def _attention(row: dict[str, Any]) -> str:
    if row["attention"] == "mla":
        return f"MLA {row['heads']}"
    return f"{row['attention'].upper()} {row['heads']}/{row['kv_heads']}"


def _table(
    title: str, columns: tuple[str, ...], rows: list[tuple[str, ...]], caption: str | None = None
) -> Table:
    """A rich table: the first column (never wrapped) and the experts left-aligned, numbers
    right."""
    table = Table(title=title, caption=caption)
    for i, col in enumerate(columns):
        table.add_column(
            col, justify="left" if i == 0 or col == "experts" else "right", no_wrap=i == 0
        )
    for row in rows:
        table.add_row(*row)
    return table


def _model_cells(r: dict[str, Any]) -> tuple[str, ...]:
    return (
        r["name"],
        count(r["params"]),
        count(r["active_params"]),
        str(r["layers"]),
        _attention(r),
        _moe(r),
        f"{r['kv_bytes_per_token'] / 1e3:.1f}",
        _context(r["max_context"]),
    )


def _gpu_cells(r: dict[str, Any]) -> tuple[str, ...]:
    return (
        r["name"],
        f"{r['bf16_flops'] / 1e12:,.0f}",
        "-" if r["fp8_flops"] is None else f"{r['fp8_flops'] / 1e12:,.0f}",
        f"{r['hbm_bytes'] / 1e9:.0f}",
        f"{r['hbm_bandwidth_bps'] / 1e12:.2f}",
        f"{r['nvlink_bandwidth_bps'] / 1e9:.0f}",
    )


def _nic_cells(r: dict[str, Any]) -> tuple[str, ...]:
    return (
        r["name"],
        f"{r['bandwidth_gbps']:,.0f}",
        f"{r['latency_s'] * 1e6:g}",
        f"{r['op_cost_s'] * 1e6:g}",
    )


MODEL_COLUMNS = (
    "model",
    "params",
    "active",
    "layers",
    "attention",
    "experts",
    "KV kB/token",
    "context",
)
GPU_COLUMNS = ("GPU", "bf16 TFLOP/s", "fp8 TFLOP/s", "HBM GB", "HBM TB/s", "NVLink GB/s")
NIC_COLUMNS = ("NIC", "Gb/s", "latency us", "per write us")


def tables(extra: Sequence[ModelSpec] = ()) -> list[Table]:
    """The catalogue (and the `extra` models) as three rich tables: models (KV in bf16), GPUs
    (dense tensor FLOP/s; NVLink per direction), NICs."""
    cat = catalogue(extra)
    return [
        _table(
            "Models",
            MODEL_COLUMNS,
            [_model_cells(r) for r in cat["models"]],
            "attention: query/KV heads; experts: active/routed+shared; KV in bf16, all layers",
        ),
        _table(
            "GPUs",
            GPU_COLUMNS,
            [_gpu_cells(r) for r in cat["gpus"]],
            "dense tensor FLOP/s; NVLink per direction",
        ),
        _table("NICs", NIC_COLUMNS, [_nic_cells(r) for r in cat["nics"]]),
    ]
