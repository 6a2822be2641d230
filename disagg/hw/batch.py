"""What one forward step runs: sequences in, index arrays out.

A step is a list of `Seq`: each carries the new token ids of one request (a prefill chunk or
one decode token), how many of its tokens are already cached, and the request's page ids. From
them `BatchMeta` derives FlashInfer's paged index arrays (host lists, planned once per step)
and `StepTensors` the per-token device tensors the model reads. Under DP attention a `Seq` also
names the attention group that holds its request, and `GroupRows` is the part of a step that
one group attends.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from disagg.errors import ConfigError


@dataclass(frozen=True)
class Seq:
    """One request's share of a step.

    tokens: new token ids (appended to the cache at positions start, start+1, ...).
    start: tokens of this request already in the cache.
    pages: the request's page ids in order; must cover start + len(tokens) tokens.
    hidden_at: index into `tokens` whose final hidden state to return (None: the last).
    dp_rank: the DP attention group whose KV cache holds the request (0 without DP).
    """

    tokens: tuple[int, ...]
    start: int
    pages: tuple[int, ...]
    hidden_at: int | None = None
    dp_rank: int = 0

    def __post_init__(self) -> None:
        if not self.tokens:
            raise ConfigError("a Seq needs at least one new token")
        if self.start < 0:
            raise ConfigError(f"Seq.start must be >= 0, got {self.start}")
        if self.hidden_at is not None and not -len(self.tokens) <= self.hidden_at < len(
            self.tokens
        ):
            raise ConfigError(f"hidden_at={self.hidden_at} outside {len(self.tokens)} new tokens")
        if self.dp_rank < 0:
            raise ConfigError(f"Seq.dp_rank must be >= 0, got {self.dp_rank}")

    @staticmethod
    def of(
        tokens: Sequence[int],
        start: int,
        pages: Sequence[int],
        hidden_at: int | None = None,
        dp_rank: int = 0,
    ) -> Seq:
        return Seq(
            tuple(int(t) for t in tokens),
            int(start),
            tuple(int(p) for p in pages),
            hidden_at,
            int(dp_rank),
        )

    @property
    def end(self) -> int:
        """Tokens cached once this step has appended its own."""
        return self.start + len(self.tokens)


@dataclass(frozen=True)
class BatchMeta:
    """Paged index arrays of one step, as FlashInfer's plan() takes them (host ints).

    qo_indptr [B+1]: row offsets of each sequence's new tokens.
    kv_indptr [B+1]: offsets into kv_indices of each sequence's pages in use.
    kv_indices: page ids in use (only the pages covering `kv_lens`), concatenated.
    kv_lens [B]: cached tokens of each sequence after this step's append.
    """

    page_size: int
    qo_indptr: list[int]
    kv_indptr: list[int]
    kv_indices: list[int]
    kv_lens: list[int]

    @property
    def batch(self) -> int:
        return len(self.kv_lens)

    @property
    def tokens(self) -> int:
        return self.qo_indptr[-1]

    @property
    def is_decode(self) -> bool:
        return self.tokens == self.batch

    @property
    def last_page_len(self) -> list[int]:
        return [(n - 1) % self.page_size + 1 for n in self.kv_lens]

    @staticmethod
    def of(seqs: Sequence[Seq], page_size: int, num_pages: int) -> BatchMeta:
        """Index arrays for `seqs`; ConfigError if a sequence lacks pages or names a bad page."""
        qo, kv_ptr, idx, lens = [0], [0], list[int](), list[int]()
        for i, s in enumerate(seqs):
            used = -(-s.end // page_size)
            if used > len(s.pages):
                raise ConfigError(f"seq {i}: {s.end} tokens need {used} pages, has {len(s.pages)}")
            pages = s.pages[:used]
            if min(pages) < 0 or max(pages) > num_pages:  # num_pages: the scratch page
                raise ConfigError(f"seq {i}: page ids must be in 0..{num_pages} (last: scratch)")
            qo.append(qo[-1] + len(s.tokens))
            idx.extend(pages)
            kv_ptr.append(len(idx))
            lens.append(s.end)
        if not lens:
            raise ConfigError("a step needs at least one sequence")
        return BatchMeta(page_size, qo, kv_ptr, idx, lens)


@dataclass
class StepTensors:
    """Device tensors (int64) of one step: T new tokens, B sequences.

    input_ids, positions, slot_pages, slot_offsets: [T] per new token (where its K/V go).
    last_rows: [B] row of each sequence's last new token (logits are taken there).
    hidden_rows: [B] row whose final hidden state each sequence returns.
    """

    input_ids: torch.Tensor
    positions: torch.Tensor
    slot_pages: torch.Tensor
    slot_offsets: torch.Tensor
    last_rows: torch.Tensor
    hidden_rows: torch.Tensor

    @staticmethod
    def pack(seqs: Sequence[Seq], page_size: int) -> np.ndarray:
        """All six arrays in one int64 host array [4T + 2B] (one host-to-device copy)."""
        ids, pos, pages = [], [], []
        last, hid = np.empty(len(seqs), np.int64), np.empty(len(seqs), np.int64)
        rows = 0
        for i, s in enumerate(seqs):
            p = np.arange(s.start, s.end, dtype=np.int64)
            ids.append(np.asarray(s.tokens, dtype=np.int64))
            pos.append(p)
            pages.append(np.asarray(s.pages, dtype=np.int64)[p // page_size])
            n = len(s.tokens)
            last[i] = rows + n - 1
            hid[i] = rows + (n - 1 if s.hidden_at is None else s.hidden_at % n)
            rows += n
        p_all = np.concatenate(pos)
        parts = [np.concatenate(ids), p_all, np.concatenate(pages), p_all % page_size, last, hid]
        return np.concatenate(parts)

    @staticmethod
    def unpack(packed: torch.Tensor, batch: int) -> StepTensors:
        """Views into a packed [4T + 2B] tensor (see `pack`)."""
        t = (packed.numel() - 2 * batch) // 4
        parts = packed.split([t, t, t, t, batch, batch])
        return StepTensors(*parts)

    @staticmethod
    def build(seqs: Sequence[Seq], page_size: int, device: torch.device) -> StepTensors:
        packed = torch.from_numpy(StepTensors.pack(seqs, page_size))
        if device.type == "cuda":
            packed = packed.pin_memory().to(device, non_blocking=True)
        return StepTensors.unpack(packed, len(seqs))


@dataclass
class GroupRows:
    """The part of a step that one DP attention group attends (its requests' sequences).

    seqs: those sequences, in step order; rows [t] int64: their new tokens' rows in the step;
    x: their own StepTensors (None when the step has none of them).
    """

    seqs: list[Seq]
    rows: torch.Tensor
    x: StepTensors | None

    @staticmethod
    def of(
        seqs: Sequence[Seq], dp_rank: int, dp: int, page_size: int, device: torch.device
    ) -> GroupRows:
        """Group `dp_rank`'s part of the step `seqs`; ConfigError for a Seq of no group of `dp`."""
        rows: list[int] = []
        mine: list[Seq] = []
        at = 0
        for s in seqs:
            if s.dp_rank >= dp:
                raise ConfigError(f"Seq.dp_rank={s.dp_rank} outside the node's {dp} DP groups")
            if s.dp_rank == dp_rank:
                mine.append(s)
                rows.extend(range(at, at + len(s.tokens)))
            at += len(s.tokens)
        x = StepTensors.build(mine, page_size, device) if mine else None
        return GroupRows(mine, torch.tensor(rows, dtype=torch.int64, device=device), x)
