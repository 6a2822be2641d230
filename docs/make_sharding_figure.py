"""Draw docs/sharding.png and print the op-count table of docs/sharding.md.

    python docs/make_sharding_figure.py            # writes docs/sharding.png
    python docs/make_sharding_figure.py --table    # prints the markdown table

The figure: one page of one layer moving from TP4 prefill to TP2 decode (4 KV heads, 4 tokens per
page), NHD above and HND below. Each box is one row (one head of one token of K or V), coloured
by the prefill rank it comes from; a thick outline is one write.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from pathlib import Path

import matplotlib.pyplot as plt
from matplotlib.axes import Axes
from matplotlib.patches import Rectangle

from disagg.core.kvcache import Layout, PageLayout
from disagg.core.sharding import TransferPlan, plan_transfer, shard_layout
from disagg.core.sharding import parse_shard_layout as parse
from disagg.models import LLAMA_31_8B, QWEN3_CODER_480B, get_model

FIGURE_MODEL = replace(LLAMA_31_8B, name="4 KV heads", kv_heads=4, head_dim=8)
PAGE_SIZE = 4
COLORS = ["#4C72B0", "#DD8452", "#55A868", "#C44E52"]
SHAPES: dict[Layout, str] = {"NHD": "[2, tokens, heads, dim]", "HND": "[2, heads, tokens, dim]"}


def row_labels(page: PageLayout, first_head: int) -> dict[int, str]:
    """Byte offset of each row of a rank's page -> 'K h2 t0'."""
    return {
        page.offset(kv, h, t): f"{'KV'[kv]}\nh{first_head + h}\nt{t}"
        for kv in range(2)
        for h in range(page.heads)
        for t in range(page.page_size)
    }


def draw_strip(ax: Axes, y: float, page: PageLayout, first_head: int, name: str) -> None:
    row = page.head_dim * page.elem_bytes
    for offset, label in row_labels(page, first_head).items():
        ax.text(offset + row / 2, y + 0.4, label, ha="center", va="center", fontsize=5)
    ax.text(-row / 2, y + 0.4, name, ha="right", va="center", fontsize=8)


def draw_plan(ax: Axes, plan: TransferPlan, title: str) -> None:
    src_y = {s: 8 - s for s in range(plan.src.tp)}
    dst_y = {d: 2.5 - 1.2 * d for d in range(plan.dst.tp)}
    for seg in plan.segments:
        color = COLORS[seg.src_rank]
        for y, at in ((src_y[seg.src_rank], seg.src_offset), (dst_y[seg.dst_rank], seg.dst_offset)):
            box = Rectangle((at, y), seg.nbytes, 0.8, fc=color, ec="black", lw=1.5, alpha=0.55)
            ax.add_patch(box)
    for s, y in src_y.items():
        draw_strip(ax, y, plan.src_page, plan.src.heads_of(s).start, f"prefill rank {s}")
    for d, y in dst_y.items():
        draw_strip(ax, y, plan.dst_page, plan.dst.heads_of(d).start, f"decode rank {d}")
    ax.set_xlim(-plan.dst_page_bytes * 0.18, plan.dst_page_bytes * 1.01)
    ax.set_ylim(0, 9)
    ax.axis("off")
    ax.set_title(f"{title}: {plan.ops_per_page_layer} writes per page per layer", fontsize=10)


def figure(path: Path) -> None:
    tp4, tp2 = shard_layout(FIGURE_MODEL, 4), shard_layout(FIGURE_MODEL, 2)
    fig, axes = plt.subplots(2, 1, figsize=(12, 8))
    for ax, layout in zip(axes, SHAPES, strict=True):
        plan = plan_transfer(tp4, tp2, PAGE_SIZE, layout)
        draw_plan(ax, plan, f"TP4 → TP2, {layout} {SHAPES[layout]}")
    fig.text(
        0.5,
        0.01,
        "colour: prefill rank the bytes come from; outlined box: one write",
        ha="center",
        fontsize=9,
    )
    fig.tight_layout(rect=(0, 0.03, 1, 1))
    fig.savefig(path, dpi=130)


TABLE_CASES = [  # (catalogue name, prefill, decode, layout)
    ("deepseek-r1", "TP8", "TP8", "any"),
    ("deepseek-r1", "DP8", "DP8", "any"),
    ("deepseek-r1", "TP8", "DP8", "any"),
    ("deepseek-r1", "DP8", "TP8", "any"),
    (QWEN3_CODER_480B.name, "TP8", "TP8", "HND"),
    (QWEN3_CODER_480B.name, "TP8", "TP8", "NHD"),
    (QWEN3_CODER_480B.name, "TP8", "TP4", "HND"),
    (QWEN3_CODER_480B.name, "TP8", "TP4", "NHD"),
    (QWEN3_CODER_480B.name, "TP4", "TP8", "HND"),
    (QWEN3_CODER_480B.name, "TP4", "TP8", "NHD"),
]


def table(page_size: int = 16) -> str:
    lines = [
        "| Model | Prefill → decode | Layout | Writes per page per layer | Sending prefill ranks "
        "| Immediates per decode rank per page per layer | Bytes per write |",
        "|---|---|---|---|---|---|---|",
    ]
    for name, src, dst, layout in TABLE_CASES:
        model = get_model(name)
        page_layout: Layout = "NHD" if layout == "NHD" else "HND"  # MLA pages have no heads
        plan = plan_transfer(parse(model, src), parse(model, dst), page_size, page_layout)
        imms = sorted(set(plan.imms_per_page_layer_by_dst_rank().values()))
        sizes = sorted({s.nbytes for s in plan.segments})
        lines.append(
            f"| {name} | {src} → {dst} | {layout} | {plan.ops_per_page_layer} "
            f"| {len(plan.ops_by_src_rank())} | {', '.join(map(str, imms))} "
            f"| {', '.join(map(str, sizes))} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    if "--table" in sys.argv:
        print(table())
    else:
        figure(Path(__file__).with_name("sharding.png"))
