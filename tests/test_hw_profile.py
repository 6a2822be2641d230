"""The step-time profile: the table the simulator's cost model loads."""

from __future__ import annotations

from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the hw backend needs torch: pip install -e '.[hw]'")

import pandas as pd
import torch

from disagg.hw.profile import COLUMNS, long_mixes, mix_contexts, profile, write_csv
from disagg.hw.specs import tiny_gqa


def test_profile_on_cpu_writes_the_cost_model_table(tmp_path: Path) -> None:
    df = profile(
        tiny_gqa(layers=4),
        layers=2,
        device="cpu",
        prefill_tokens=(8, 32),
        prefill_context=(0, 16),
        decode_batch=(1, 4),
        decode_context=(8,),
        page_size=4,
        warmup=1,
        repeats=3,
        mixed=((8, 4, 8), (32, 4, 8)),
        decode_mix=(40, 5, 13, 9),
    )
    assert list(df.columns) == COLUMNS
    assert COLUMNS == [
        "kind",
        "tokens",
        "batch",
        "context",
        "duration_s",
        "host_s",
        "graph_batch",
    ]
    assert (df.graph_batch == 0).all()  # no CUDA graphs on the CPU
    prefill, decode, mixed = (df[df.kind == k] for k in ("prefill", "decode", "mixed"))
    # each mixed pass at 8 tokens a decode, then at the mix (mean 16.75)
    assert sorted(zip(mixed.tokens, mixed.batch, mixed.context, strict=True)) == [
        (8, 4, 8),
        (8, 4, 17),
        (32, 4, 8),
        (32, 4, 17),
    ]
    assert sorted(zip(prefill.tokens, prefill.context, strict=True)) == [
        (8, 0),
        (8, 16),
        (32, 0),
        (32, 16),
    ]
    assert (prefill.batch == 1).all()
    # each batch at 8 tokens, then at the mix: 13 (its median) alone, all four (mean 16.75);
    # then batch 1 at the mix's longest quarter, 40 (four of 40 would not fit the cache)
    assert list(decode.tokens) == list(decode.batch) == [1, 4, 1, 4, 1]
    assert list(decode.context) == [8, 8, 13, 17, 40]
    assert (df.duration_s > 0).all()
    assert (df.host_s == 0.0).all()  # on the CPU the step's wall time is its duration
    back = pd.read_csv(write_csv(df, tmp_path / "gpu_profile.csv"))
    pd.testing.assert_frame_equal(back, df)


def test_a_mixed_batch_takes_the_pools_quantiles_in_a_seeded_order() -> None:
    """Batch b takes the pool's values at ranks (i + 1/2) * len / b: of 8 values, a batch of 4
    the 2nd, 4th, 6th and 8th smallest; the order is shuffled, the same for the same seed."""
    pool = (80, 10, 70, 20, 60, 30, 50, 40)
    four = mix_contexts(pool, 4, seed=3)
    assert sorted(four) == [20, 40, 60, 80]
    assert mix_contexts(pool, 4, seed=3) == four
    assert mix_contexts(pool, 1) == (50,)
    assert sorted(mix_contexts(pool, 16)) == sorted(pool * 2)
    orders = {mix_contexts(pool, 8, seed=s) for s in range(5)}
    assert len(orders) > 1 and all(sorted(o) == sorted(pool) for o in orders)


def test_a_long_mix_draws_from_the_longest_quarter_where_the_cache_has_room() -> None:
    """Of 1-8, the longest quarter is 7 and 8. The whole pool's mix at the largest batch, 4,
    takes 2, 4, 6 and 8 (20 tokens): the long mixes of 1 and 2 fit in that, 4's (30) does not."""
    long = long_mixes(range(1, 9), [1, 2, 4], seed=0)
    assert sorted(long) == [1, 2]
    assert long[1] == (8,) and sorted(long[2]) == [7, 8]
    assert long_mixes((), [1, 2], seed=0) == {}


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_profile_on_a_gpu_gives_each_shape_its_host_time() -> None:
    """duration_s is the forward's device time, host_s the rest of a serial step's wall time;
    FlashInfer (with decode graphs: head_dim 128) where it is installed, else the torch
    reference."""
    import importlib.util

    from disagg.hw.specs import small_gqa

    flashinfer = importlib.util.find_spec("flashinfer") is not None
    df = profile(
        small_gqa(layers=4),
        layers=2,
        device="cuda",
        prefill_tokens=(16, 64),
        prefill_context=(0,),
        decode_batch=(1, 4),
        decode_context=(32,),
        attention="auto" if flashinfer else "torch",
        fused_ops=flashinfer,
        warmup=2,
        repeats=5,
        mixed=((16, 4, 32),),
    )
    assert list(df.kind) == ["prefill", "prefill", "decode", "decode", "mixed"]
    # FlashInfer replays decode passes in CUDA graphs (4 sequences: the graph of 4); the torch
    # reference and the other passes run eagerly
    assert list(df.graph_batch) == ([0, 0, 1, 4, 0] if flashinfer else [0] * 5)
    assert (df.duration_s > 0).all()
    assert (df.host_s >= 0).all() and df.host_s.notna().all()


CUBLAS_WORKSPACES = 8 * 4 * 2**20


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_profile_gives_its_gpu_memory_back() -> None:
    """What the profile allocated (its model, its cache of the largest shape's pages) is not
    left reserved in this process: validate starts its servers beside it."""
    from disagg.hw.specs import small_gqa

    before = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    profile(
        small_gqa(layers=2),
        layers=2,
        device="cuda",
        prefill_tokens=(64,),
        prefill_context=(0,),
        decode_batch=(64,),
        decode_context=(4096,),  # 64 x 257 pages: far more than any allocator slack
        attention="torch",
        fused_ops=False,
        warmup=1,
        repeats=1,
    )
    peak, left = torch.cuda.max_memory_reserved(), torch.cuda.memory_reserved() - before
    # what stays: torch's cuBLAS workspaces (8 x 4 MiB by default), taken from its allocator
    assert left <= CUBLAS_WORKSPACES + 2**21 and peak - before > 10 * left
