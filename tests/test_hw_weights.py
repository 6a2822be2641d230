"""The weight cache: a model built from it holds the very weights drawn without it."""

from __future__ import annotations

import os
import warnings
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="the hw backend needs torch: pip install -e '.[hw]'")

import torch

from disagg.config import load_experiment
from disagg.hw.model import Transformer
from disagg.hw.specs import tiny_gqa, tiny_moe
from disagg.hw.tp import TensorParallel
from disagg.hw.weights import SPARE_BYTES, WeightMaker
from disagg.models import ModelSpec


def weights(m: Transformer) -> list[torch.Tensor]:
    moe = [t for e in m.moes.values() for t in (e.router, e.w13, e.w2)]
    return [m.embed, m.lm_head, *(w for layer in m.layers for w in layer.values()), *moe]


def assert_same(a: Transformer, b: Transformer) -> None:
    for x, y in zip(weights(a), weights(b), strict=True):
        assert x.dtype == y.dtype and torch.equal(x, y)


@pytest.mark.parametrize("spec", [tiny_gqa(), tiny_moe()], ids=["gqa", "moe"])
def test_a_model_read_from_the_cache_equals_one_drawn(tmp_path: Path, spec: ModelSpec) -> None:
    drawn = Transformer(spec, seed=5)
    first = Transformer(spec, seed=5, weight_cache=str(tmp_path))
    second = Transformer(spec, seed=5, weight_cache=str(tmp_path))
    tensors = len(list(tmp_path.glob("*.bin")))
    assert tensors > 0 and not list(tmp_path.glob(".*"))  # whole files only, none left half
    assert first.weights_read == (0, tensors)
    assert second.weights_read == (tensors, tensors)
    assert_same(drawn, first)
    assert_same(drawn, second)


def test_another_seed_or_dtype_reads_nothing_kept_for_the_first(tmp_path: Path) -> None:
    Transformer(tiny_gqa(), seed=5, weight_cache=str(tmp_path))
    kept = len(list(tmp_path.glob("*.bin")))
    other = Transformer(tiny_gqa(), seed=6, weight_cache=str(tmp_path))
    assert other.weights_read == (0, kept)
    assert_same(other, Transformer(tiny_gqa(), seed=6))
    half = Transformer(tiny_gqa(), seed=5, dtype=torch.bfloat16, weight_cache=str(tmp_path))
    assert half.weights_read == (0, kept)
    assert len(list(tmp_path.glob("*.bin"))) == 3 * kept


def test_a_rank_cuts_its_shard_from_the_kept_tensor(tmp_path: Path) -> None:
    Transformer(tiny_gqa(), seed=5, weight_cache=str(tmp_path))
    rank = Transformer(tiny_gqa(), seed=5, tp=TensorParallel(1, 2), weight_cache=str(tmp_path))
    assert rank.weights_read[0] == rank.weights_read[1] > 0
    assert_same(rank, Transformer(tiny_gqa(), seed=5, tp=TensorParallel(1, 2)))


def test_a_file_of_the_wrong_size_is_drawn_and_written_again(tmp_path: Path) -> None:
    Transformer(tiny_gqa(), seed=5, weight_cache=str(tmp_path))
    embed = next(tmp_path.glob("embed-*.bin"))
    whole = embed.read_bytes()
    embed.write_bytes(whole[:-2])  # cut short, as by a full disk
    again = Transformer(tiny_gqa(), seed=5, weight_cache=str(tmp_path))
    assert again.weights_read[1] - again.weights_read[0] == 1
    assert embed.read_bytes() == whole
    assert_same(again, Transformer(tiny_gqa(), seed=5))


def test_a_cache_that_cannot_be_written_is_said_once_and_drawing_goes_on(
    tmp_path: Path,
) -> None:
    blocked = tmp_path / "file"
    blocked.write_text("not a directory")
    with warnings.catch_warnings(record=True) as said:
        warnings.simplefilter("always")
        m = Transformer(tiny_gqa(), seed=5, weight_cache=str(blocked / "cache"))
    assert [str(w.message).split(":")[0] for w in said] == [f"hw.weight_cache {blocked}/cache"]
    assert m.weights_read[0] == 0
    assert_same(m, Transformer(tiny_gqa(), seed=5))


def test_the_file_names_the_tensor_and_is_its_bytes(tmp_path: Path) -> None:
    w = WeightMaker(3, torch.device("cpu"), torch.float32, tmp_path)
    t = w.uniform("layer0.wo", (4, 6), 0.5)
    w.close()
    (path,) = tmp_path.glob("*.bin")
    assert path.name.startswith("layer0.wo-")
    assert path.read_bytes() == t.numpy().tobytes()
    assert float(t.abs().max()) <= 0.5 * 3**0.5  # uniform on [-std sqrt 3, std sqrt 3]


def test_the_environment_sets_the_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DISAGG_WEIGHT_CACHE", str(tmp_path / "w"))
    exp = load_experiment(Path(__file__).parents[1] / "experiments" / "tiny-disagg.toml")
    assert exp.hw.weight_cache == str(tmp_path / "w")


def test_room_is_made_from_the_least_recently_used_files_not_the_models_own(
    tmp_path: Path,
) -> None:
    for i, name in enumerate(["old", "mid", "new"]):
        (tmp_path / f"{name}.bin").write_bytes(bytes(100))
        os.utime(tmp_path / f"{name}.bin", (1000 + i, 1000 + i))
    w = WeightMaker(3, torch.device("cpu"), torch.float32, tmp_path)
    w.mine.add(tmp_path / "old.bin")  # this model reads it: it stays
    w.make_room(150, free=SPARE_BYTES + 20)  # 130 bytes short: two files of 100 go
    assert sorted(p.name for p in tmp_path.glob("*.bin")) == ["old.bin"]
    with pytest.raises(OSError, match="150 bytes more"):
        w.make_room(150, free=SPARE_BYTES)  # only the model's own file is left
    w.close()
