"""A step's index arrays and packed inputs, against hand arithmetic."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from disagg.errors import ConfigError
from disagg.hw.attention import plan_tensors
from disagg.hw.batch import BatchMeta, GroupRows, Seq, StepTensors

# page size 4: a chunk of three tokens after two cached (5 tokens: pages 5, 9 of three held),
# and one decode token after four cached (5 tokens: pages 3, 4 of three held)
CHUNK = Seq.of(np.array([10, 11, 12]), 2, [5, 9, 7], hidden_at=-2)
DECODE = Seq.of([20], np.int64(4), range(3, 6))


def test_meta_takes_only_the_pages_in_use():
    meta = BatchMeta.of([CHUNK, DECODE], page_size=4, num_pages=16)
    assert meta.qo_indptr.tolist() == [0, 3, 4]
    assert meta.kv_indptr.tolist() == [0, 2, 4]
    assert meta.kv_indices.tolist() == [5, 9, 3, 4]
    assert meta.kv_lens.tolist() == [5, 5]
    assert meta.last_page_len.tolist() == [1, 1]
    assert (meta.batch, meta.tokens, meta.is_decode) == (2, 4, False)
    assert BatchMeta.of([DECODE], 4, 16).is_decode


def test_pack_puts_each_token_on_its_page():
    meta = BatchMeta.of([CHUNK, DECODE], page_size=4, num_pages=16)
    x = StepTensors.unpack(torch.from_numpy(StepTensors.pack([CHUNK, DECODE], meta)), 2)
    assert x.input_ids.tolist() == [10, 11, 12, 20]
    assert x.positions.tolist() == [2, 3, 4, 4]
    assert x.slot_pages.tolist() == [5, 5, 9, 4]
    assert x.slot_offsets.tolist() == [2, 3, 0, 0]
    assert x.last_rows.tolist() == [2, 3]
    assert x.hidden_rows.tolist() == [1, 3]  # the chunk's hidden_at -2 is its row 1


def test_plan_tensors_are_int32_views_of_the_meta():
    meta = BatchMeta.of([CHUNK, DECODE], page_size=4, num_pages=16)
    qo, kv_ptr, idx, lens, last = plan_tensors(meta)
    assert all(t.dtype == torch.int32 for t in (qo, kv_ptr, idx, lens, last))
    assert idx.tolist() == [5, 9, 3, 4] and last.tolist() == [1, 1]
    assert np.shares_memory(idx.numpy(), meta.kv_indices)


def test_group_rows_index_their_own_sequences():
    seqs = [CHUNK, Seq.of([20], 4, [3, 4], dp_rank=1)]
    group = GroupRows.of(
        seqs, dp_rank=1, dp=2, page_size=4, num_pages=16, device=torch.device("cpu")
    )
    assert group.rows.tolist() == [3]
    assert group.meta is not None and group.meta.kv_indices.tolist() == [3, 4]
    assert group.x is not None and group.x.slot_pages.tolist() == [4]
    none = GroupRows.of([CHUNK], 1, 2, 4, 16, torch.device("cpu"))
    assert none.meta is None and none.x is None


@pytest.mark.parametrize(
    ("seq", "message"),
    [
        (Seq.of([1], 8, [0, 1]), "seq 1: 9 tokens need 3 pages, has 2"),
        (Seq.of([1], 4, [0, 17]), r"seq 1: page ids must be in 0\.\.16"),
        (Seq.of([1], 0, [-1]), r"seq 1: page ids must be in 0\.\.16"),
    ],
)
def test_meta_names_the_sequence_with_bad_pages(seq, message):
    with pytest.raises(ConfigError, match=message):
        BatchMeta.of([DECODE, seq], page_size=4, num_pages=16)


def test_a_decode_row_is_the_seq_of_its_token():
    assert Seq.decode(20, 4, [3, 4, 5]) == DECODE
    assert Seq.decode(20, 4, [3, 4, 5], dp_rank=1) == Seq.of([20], 4, [3, 4, 5], dp_rank=1)


def test_seq_of_takes_ints_only():
    assert Seq.of(torch.tensor([1, 2]), 0, np.arange(2)).pages == (0, 1)
    with pytest.raises(TypeError):
        Seq.of([1.5], 0, [0])
