"""Sharded KV caches: which rank holds which heads, and the writes that move pages between them.

A node runs `dp` attention groups of `tp` ranks each (rank r is in group r // tp). A request's
KV cache lives in one group, split over its tp ranks by KV head; MLA has a single latent "head"
that every rank of the group replicates. The planner maps one page of one layer from a prefill
group to a decode group that may shard differently, as a few contiguous byte copies (segments)
per (source rank, destination rank) pair.

Immediate rule: a unit is (source rank, destination rank, page, layer). Its writes go on one
queue pair, so they land in order; only the last carries an immediate. A decode rank therefore
expects pages x layers x (source ranks writing into it) immediates, plus one at the decode
leader for the speculative-decoding metadata, whatever the prefill's chunking (each page of each
layer is posted once, after the chunk that completes it).
"""

from __future__ import annotations

import random
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, NamedTuple

from disagg.core.kvcache import Layout, PageLayout
from disagg.errors import ConfigError
from disagg.models import ModelSpec, dtype_bytes

MetadataKind = Literal["hidden", "logits"]


@dataclass(frozen=True)
class ShardLayout:
    """How one node shards `model`'s KV cache: `dp` groups of `tp` ranks (tp*dp ranks in all).

    A rank holds a contiguous range of KV heads. With fewer KV heads than `tp`, each head sits on
    tp // kv_heads consecutive ranks (MLA: the latent sits on every rank). A replica set is a
    set of ranks of one group that together hold every head exactly once.
    """

    model: ModelSpec
    tp: int = 1
    dp: int = 1

    def __post_init__(self) -> None:
        if self.dp < 1:
            raise ConfigError(f"{self.model.name}: dp={self.dp} must be >= 1")
        try:
            self.model.check_tp(self.tp)
        except ConfigError as err:
            raise ConfigError(
                f"cannot shard {self.model.name}'s KV cache as {self}: {err}"
            ) from err

    def __str__(self) -> str:
        if self.dp == 1:
            return f"TP{self.tp}"
        return f"DP{self.dp}" if self.tp == 1 else f"DP{self.dp}xTP{self.tp}"

    @property
    def ranks(self) -> int:
        return self.tp * self.dp

    @property
    def kv_heads(self) -> int:
        """Heads of one full copy of the cache (1 for MLA's latent)."""
        return self.model.kv_shardable_heads

    @property
    def heads_per_rank(self) -> int:
        return max(1, self.kv_heads // self.tp)

    @property
    def replication(self) -> int:
        """Ranks of one group that hold each head (the number of replica sets)."""
        return max(1, self.tp // self.kv_heads)

    def group(self, dp_rank: int) -> range:
        """Ranks of DP group `dp_rank`."""
        return range(dp_rank * self.tp, (dp_rank + 1) * self.tp)

    def heads_of(self, rank: int) -> range:
        """KV heads (global head ids) that `rank` holds."""
        if not 0 <= rank < self.ranks:
            raise ValueError(f"rank {rank} out of range for {self} ({self.ranks} ranks)")
        start = (rank % self.tp) // self.replication * self.heads_per_rank
        return range(start, start + self.heads_per_rank)

    def replica_sets(self, dp_rank: int = 0) -> tuple[tuple[int, ...], ...]:
        """Replica sets of group `dp_rank`: set j holds the group's ranks j, j + replication, ..."""
        ranks = self.group(dp_rank)
        return tuple(tuple(ranks[j :: self.replication]) for j in range(self.replication))

    def page_layout(
        self, page_size: int, layout: Layout = "HND", kv_dtype: str = "bf16"
    ) -> PageLayout:
        """Layout of one page of one layer on one rank (every rank's pages are alike)."""
        m = self.model
        if m.attention == "mla":
            latent = m.kv_lora_rank + m.qk_rope_dim
            return PageLayout(page_size, 1, latent, dtype_bytes(kv_dtype), layout, mla=True)
        return PageLayout(page_size, self.heads_per_rank, m.head_dim, dtype_bytes(kv_dtype), layout)


def shard_layout(model: ModelSpec, tp: int, dp: int = 1) -> ShardLayout:
    """`model` sharded over `dp` attention groups of `tp` ranks; ConfigError if impossible."""
    return ShardLayout(model, tp, dp)


def parse_shard_layout(model: ModelSpec, label: str) -> ShardLayout:
    """The inverse of `str(ShardLayout)`: 'TP8' (a group of 8), 'DP8' (8 groups of 1), 'DP2xTP4'."""
    match = re.fullmatch(r"(?:DP(\d+))?(x)?(?:TP(\d+))?", label, re.IGNORECASE)
    dp, x, tp = match.groups() if match else (None, None, None)
    if not (dp or tp) or bool(x) != bool(dp and tp):
        raise ConfigError(f"sharding {label!r} is not TP<n>, DP<n> or DP<n>xTP<n>")
    return ShardLayout(model, int(tp or 1), int(dp or 1))


@dataclass(frozen=True)
class Segment:
    """One contiguous copy inside one page of one layer: byte offsets relative to the page start."""

    src_rank: int
    src_offset: int
    dst_rank: int
    dst_offset: int
    nbytes: int


class PlannedWrite(NamedTuple):
    """A concrete write between two ranks' regions; `imm` marks the last write of its unit.

    A tuple rather than a dataclass: writes are made per page per layer, a hot path.
    """

    src_rank: int
    dst_rank: int
    src_offset: int
    dst_offset: int
    nbytes: int
    imm: bool


@dataclass(frozen=True)
class MetadataPlan:
    """One write of speculative-decoding metadata (`nbytes`) from the prefill leader to the decode
    leader's pre-allocated buffer; it carries one immediate, counted at the decode leader."""

    kind: MetadataKind
    nbytes: int
    src_rank: int
    dst_rank: int

    def write(self, src_offset: int = 0, dst_offset: int = 0) -> PlannedWrite:
        return PlannedWrite(self.src_rank, self.dst_rank, src_offset, dst_offset, self.nbytes, True)


def metadata_bytes(model: ModelSpec, kind: MetadataKind) -> int:
    """Bytes of the metadata of one request: a bf16 hidden state (MTP) or fp32 logits (draft)."""
    if kind == "hidden":
        return model.hidden * 2
    if kind == "logits":
        return model.vocab * 4
    raise ConfigError(f"unknown metadata kind {kind!r}; known: hidden, logits")


@dataclass(frozen=True)
class TransferPlan:
    """The writes that move one page of one layer from a prefill group to a decode group.

    `segments` is the template for one page of one layer, ordered by (src_rank, dst_rank) and
    then source offset, merged into the fewest contiguous runs per rank pair. Offsets are bytes
    from the start of the page on each side; ranks are global rank ids of each node.
    """

    src: ShardLayout
    dst: ShardLayout
    src_page: PageLayout
    dst_page: PageLayout
    segments: tuple[Segment, ...]
    src_dp_rank: int
    dst_dp_rank: int

    @property
    def src_leader(self) -> int:
        """First rank of the prefill group that holds the request (sends the metadata)."""
        return self.src.group(self.src_dp_rank).start

    @property
    def dst_leader(self) -> int:
        """First rank of the decode group that holds the request (receives the metadata)."""
        return self.dst.group(self.dst_dp_rank).start

    @property
    def src_page_bytes(self) -> int:
        """Bytes of one page of one layer on one prefill rank."""
        return self.src_page.page_bytes

    @property
    def dst_page_bytes(self) -> int:
        """Bytes of one page of one layer on one decode rank."""
        return self.dst_page.page_bytes

    @property
    def ops_per_page_layer(self) -> int:
        """Writes posted per page per layer, over all source ranks."""
        return len(self.segments)

    @property
    def pairs(self) -> tuple[tuple[int, int], ...]:
        """(src_rank, dst_rank) pairs that exchange data, sorted."""
        return tuple(sorted({(s.src_rank, s.dst_rank) for s in self.segments}))

    def ops_by_src_rank(self) -> dict[int, int]:
        """Writes each source rank posts per page per layer."""
        return dict(sorted(Counter(s.src_rank for s in self.segments).items()))

    def bytes_by_src_rank(self) -> dict[int, int]:
        """Bytes each source rank sends per page per layer."""
        out: Counter[int] = Counter()
        for s in self.segments:
            out[s.src_rank] += s.nbytes
        return dict(sorted(out.items()))

    def imms_per_page_layer_by_dst_rank(self) -> dict[int, int]:
        """Immediates each decode rank receives per page per layer (source ranks writing to it)."""
        return dict(sorted(Counter(d for _, d in self.pairs).items()))

    def expected_immediates(
        self, num_pages: int, num_layers: int, metadata: bool = False
    ) -> dict[int, int]:
        """Immediates each decode rank of the group counts before the request is ready."""
        if num_pages < 0 or num_layers < 1:
            raise ValueError(
                f"need num_pages >= 0 and num_layers >= 1, got {num_pages}, {num_layers}"
            )
        per = self.imms_per_page_layer_by_dst_rank()
        group = self.dst.group(self.dst_dp_rank)
        out = {d: per.get(d, 0) * num_pages * num_layers for d in group}
        out[self.dst_leader] += int(metadata)
        return out

    def writes(
        self, pages: Iterable[tuple[int, int]], src_layer_base: int = 0, dst_layer_base: int = 0
    ) -> list[PlannedWrite]:
        """Concrete writes of one layer for (src_page_id, dst_page_id) pairs, unit by unit.

        Offset = layer base + page id * page bytes + segment offset, on each side.
        """
        last = _last_of_pair(self.segments)
        bases = [
            (src_layer_base + sp * self.src_page_bytes, dst_layer_base + dp * self.dst_page_bytes)
            for sp, dp in pages
        ]
        return [
            PlannedWrite(s.src_rank, s.dst_rank, sb + s.src_offset, db + s.dst_offset, s.nbytes, i)
            for sb, db in bases
            for s, i in zip(self.segments, last, strict=True)
        ]

    def metadata(self, kind: MetadataKind) -> MetadataPlan:
        """The metadata write of one request (leader to leader)."""
        nbytes = metadata_bytes(self.src.model, kind)
        return MetadataPlan(kind, nbytes, self.src_leader, self.dst_leader)


def plan_transfer(
    src: ShardLayout,
    dst: ShardLayout,
    page_size: int,
    layout: Layout = "HND",
    kv_dtype: str = "bf16",
    rng: random.Random | int = 0,
    *,
    src_dp_rank: int | None = None,
    dst_dp_rank: int | None = None,
    dst_page_size: int | None = None,
    dst_layout: Layout | None = None,
) -> TransferPlan:
    """Plan the writes of one page of one layer from prefill sharding `src` to decode `dst`.

    `page_size` (tokens) and `layout` are the prefill's; `dst_page_size` and `dst_layout` default
    to them (page sizes must match; layouts may differ). DP groups not given are drawn from
    `rng` (a Random or a seed), which also assigns each decode replica set a prefill replica set.
    """
    dst_page_size = page_size if dst_page_size is None else dst_page_size
    dst_layout = layout if dst_layout is None else dst_layout
    if src.model != dst.model:
        raise ConfigError(
            f"prefill {src} runs {src.model.name} but decode {dst} runs {dst.model.name}"
        )
    if page_size != dst_page_size:
        raise ConfigError(
            f"prefill {src} page_size={page_size} and decode {dst} page_size={dst_page_size} "
            "differ: a transfer maps whole pages, so both sides need the same page size"
        )
    rand = rng if isinstance(rng, random.Random) else random.Random(rng)
    src_group = _pick_group(src, src_dp_rank, rand, "prefill")
    dst_group = _pick_group(dst, dst_dp_rank, rand, "decode")
    src_page = src.page_layout(page_size, layout, kv_dtype)
    dst_page = dst.page_layout(dst_page_size, dst_layout, kv_dtype)
    routes = _routes(src, src_group, dst, dst_group, rand)
    segments = _segments(src, dst, src_page, dst_page, routes)
    return TransferPlan(src, dst, src_page, dst_page, segments, src_group, dst_group)


def _pick_group(shard: ShardLayout, dp_rank: int | None, rand: random.Random, side: str) -> int:
    if dp_rank is None:
        return rand.randrange(shard.dp)
    if not 0 <= dp_rank < shard.dp:
        raise ConfigError(f"{side} {shard}: dp rank {dp_rank} out of range 0..{shard.dp - 1}")
    return dp_rank


def _routes(
    src: ShardLayout, src_group: int, dst: ShardLayout, dst_group: int, rand: random.Random
) -> list[tuple[int, int, int]]:
    """(src_rank, dst_rank, head) for every head each decode rank needs.

    Decode replica set j takes everything from prefill replica set order[j % n], `order` being
    a seeded permutation: every prefill set sends when there are at least as many decode sets.
    """
    src_sets = src.replica_sets(src_group)
    order = rand.sample(range(len(src_sets)), len(src_sets))
    routes = []
    for j, dst_set in enumerate(dst.replica_sets(dst_group)):
        holder = {h: s for s in src_sets[order[j % len(order)]] for h in src.heads_of(s)}
        routes += [(holder[h], d, h) for d in dst_set for h in dst.heads_of(d)]
    return routes


def _segments(
    src: ShardLayout,
    dst: ShardLayout,
    src_page: PageLayout,
    dst_page: PageLayout,
    routes: Sequence[tuple[int, int, int]],
) -> tuple[Segment, ...]:
    """Rows (one head of one token of K or V: head_dim elements) merged into runs per rank pair."""
    rows: dict[tuple[int, int], list[tuple[int, int]]] = defaultdict(list)
    for s, d, head in routes:
        hs, hd = head - src.heads_of(s).start, head - dst.heads_of(d).start
        rows[s, d] += [
            (src_page.offset(kv, hs, t), dst_page.offset(kv, hd, t))
            for kv in range(src_page.kv_planes)
            for t in range(src_page.page_size)
        ]
    row_bytes = src_page.head_dim * src_page.elem_bytes
    return tuple(seg for s, d in sorted(rows) for seg in _merge(s, d, rows[s, d], row_bytes))


def _merge(s: int, d: int, rows: list[tuple[int, int]], row_bytes: int) -> list[Segment]:
    """Fewest runs: in source order, a row extends the previous run if both sides are adjacent."""
    runs: list[list[int]] = []
    for so, do in sorted(rows):
        if runs and runs[-1][0] + runs[-1][2] == so and runs[-1][1] + runs[-1][2] == do:
            runs[-1][2] += row_bytes
        else:
            runs.append([so, do, row_bytes])
    return [Segment(s, so, d, do, n) for so, do, n in runs]


def _last_of_pair(segments: Sequence[Segment]) -> list[bool]:
    """True for the last segment of each (src_rank, dst_rank) run of the sorted template."""
    keys = [(s.src_rank, s.dst_rank) for s in segments]
    return [i + 1 == len(keys) or keys[i + 1] != k for i, k in enumerate(keys)]
