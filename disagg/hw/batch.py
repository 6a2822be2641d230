"""What one forward step runs: sequences in, index arrays out.

A step is a list of `Seq`: each carries the new token ids of one request (a prefill chunk or
one decode token), how many of its tokens are already cached, and the request's page ids. From
them `BatchMeta` derives FlashInfer's paged index arrays (host int32 arrays, planned once per
step), and `StepTensors`, from those, the per-token device tensors the model reads. A server
builds both on every pass over every page its sequences hold, so numpy does the per-page work
and Python loops only over the sequences. Under DP attention a `Seq` also names the attention
group that holds its request, and `GroupRows` is the part of a step that one group attends.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from itertools import chain

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
        tokens: Iterable[int],
        start: int,
        pages: Iterable[int],
        hidden_at: int | None = None,
        dp_rank: int = 0,
    ) -> Seq:
        """A Seq of any ints (numpy's and torch's too): `operator.index` takes each, at a
        server's every pass for every page, so it must be quick (a float is a TypeError)."""
        return Seq(
            tuple(map(operator.index, tokens)),
            operator.index(start),
            tuple(map(operator.index, pages)),
            hidden_at,
            operator.index(dp_rank),
        )

    @staticmethod
    def decode(token: int, start: int, pages: Sequence[int], dp_rank: int = 0) -> Seq:
        """One decode row: `token` at position `start`, on a pool's pages (ints already: taken
        as they are, which a server does for every row of every pass)."""
        return Seq((token,), start, tuple(pages), None, dp_rank)

    @property
    def end(self) -> int:
        """Tokens cached once this step has appended its own."""
        return self.start + len(self.tokens)


@dataclass(frozen=True, eq=False)
class BatchMeta:
    """Paged index arrays of one step, as FlashInfer's plan() takes them (host int32 arrays).

    qo_indptr [B+1]: row offsets of each sequence's new tokens.
    kv_indptr [B+1]: offsets into kv_indices of each sequence's pages in use.
    kv_indices: page ids in use (only the pages covering `kv_lens`), concatenated.
    kv_lens [B]: cached tokens of each sequence after this step's append.
    """

    page_size: int
    qo_indptr: np.ndarray
    kv_indptr: np.ndarray
    kv_indices: np.ndarray
    kv_lens: np.ndarray

    @property
    def batch(self) -> int:
        return len(self.kv_lens)

    @property
    def tokens(self) -> int:
        return int(self.qo_indptr[-1])

    @property
    def is_decode(self) -> bool:
        return self.tokens == self.batch

    @property
    def last_page_len(self) -> np.ndarray:
        return (self.kv_lens - 1) % self.page_size + 1

    @staticmethod
    def of(seqs: Sequence[Seq], page_size: int, num_pages: int) -> BatchMeta:
        """Index arrays for `seqs`; ConfigError if a sequence lacks pages or names a bad page."""
        if not seqs:
            raise ConfigError("a step needs at least one sequence")
        n = len(seqs)
        new = np.fromiter((len(s.tokens) for s in seqs), np.int64, n)
        lens = np.fromiter((s.end for s in seqs), np.int64, n)
        held = np.fromiter((len(s.pages) for s in seqs), np.int64, n)
        used = -(-lens // page_size)
        short = np.flatnonzero(used > held)
        if short.size:
            i = short[0]
            raise ConfigError(f"seq {i}: {lens[i]} tokens need {used[i]} pages, has {held[i]}")
        kv_indptr = np.concatenate([[0], np.cumsum(used)])
        pages = chain.from_iterable(s.pages[:u] for s, u in zip(seqs, used.tolist(), strict=True))
        idx = np.fromiter(pages, np.int64, int(kv_indptr[-1]))
        bad = np.flatnonzero((idx < 0) | (idx > num_pages))  # num_pages: the scratch page
        if bad.size:
            i = int(np.searchsorted(kv_indptr, bad[0], "right")) - 1
            raise ConfigError(f"seq {i}: page ids must be in 0..{num_pages} (last: scratch)")
        qo_indptr = np.concatenate([[0], np.cumsum(new)])
        arrays = (a.astype(np.int32) for a in (qo_indptr, kv_indptr, idx, lens))
        return BatchMeta(page_size, *arrays)


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
    def pack(seqs: Sequence[Seq], meta: BatchMeta) -> np.ndarray:
        """All six arrays of `seqs` (whose index arrays are `meta`) in one int64 host array
        [4T + 2B] (one host-to-device copy)."""
        first, last = meta.qo_indptr[:-1].astype(np.int64), meta.qo_indptr[1:] - 1
        new = last + 1 - first
        tokens = meta.tokens
        ids = np.fromiter(chain.from_iterable(s.tokens for s in seqs), np.int64, tokens)
        row = np.repeat(np.arange(len(seqs)), new)  # each new token's sequence
        starts = meta.kv_lens - new  # tokens cached before the step
        pos = np.arange(tokens) + np.repeat(starts - first, new)
        slot_pages = meta.kv_indices[meta.kv_indptr[row] + pos // meta.page_size]
        hidden = last.astype(np.int64)
        for i, s in enumerate(seqs):
            if s.hidden_at is not None:
                hidden[i] = first[i] + s.hidden_at % new[i]
        parts = [ids, pos, slot_pages, pos % meta.page_size, last, hidden]
        return np.concatenate(parts, dtype=np.int64)

    @staticmethod
    def unpack(packed: torch.Tensor, batch: int) -> StepTensors:
        """Views into a packed [4T + 2B] tensor (see `pack`)."""
        t = (packed.numel() - 2 * batch) // 4
        parts = packed.split([t, t, t, t, batch, batch])
        return StepTensors(*parts)

    @staticmethod
    def build(seqs: Sequence[Seq], meta: BatchMeta, device: torch.device) -> StepTensors:
        packed = torch.from_numpy(StepTensors.pack(seqs, meta))
        if device.type == "cuda":
            packed = packed.pin_memory().to(device, non_blocking=True)
        return StepTensors.unpack(packed, len(seqs))


@dataclass
class GroupRows:
    """The part of a step that one DP attention group attends (its requests' sequences).

    seqs: those sequences, in step order; rows [t] int64: their new tokens' rows in the step;
    meta, x: their own index arrays and StepTensors (None when the step has none of them).
    """

    seqs: list[Seq]
    rows: torch.Tensor
    meta: BatchMeta | None
    x: StepTensors | None

    @staticmethod
    def of(
        seqs: Sequence[Seq],
        dp_rank: int,
        dp: int,
        page_size: int,
        num_pages: int,
        device: torch.device,
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
        meta = BatchMeta.of(mine, page_size, num_pages) if mine else None
        x = StepTensors.build(mine, meta, device) if meta is not None else None
        return GroupRows(mine, torch.tensor(rows, dtype=torch.int64, device=device), meta, x)
