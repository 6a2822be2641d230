"""Tensor parallelism for the hw model: a rank's place in its group, and how weights are cut.

A `TensorParallel` names one rank of a torch.distributed process group (gloo on the CPU and
for ranks that share a GPU, NCCL for ranks of a GPU each: disagg.hw.ranks) and carries the two
collectives the model needs: an all-reduce (sum) after each row-parallel projection and an
all-gather of the vocab-parallel logits.

With DP attention (`dp` > 1) the group is a node of `dp` attention groups of `size // dp` ranks
(rank r in group r // (size // dp), as `disagg.core.sharding.ShardLayout` numbers them): the
attention weights are cut within the rank's attention group (`attention`), every other weight
(MLP, experts, vocab) over all `size` ranks of the node.

A `Cut` says which part of a full weight a rank keeps: ranges of one dimension, concatenated
in order (the column-parallel qkv keeps its query rows, then its K rows, then its V rows). The
model draws every full tensor exactly as at tp 1 and keeps only the cut, so tp N computes the
same function as tp 1. Which KV heads a rank keeps is `disagg.core.sharding.ShardLayout`'s
answer, the one the transfer planner uses.
"""

from __future__ import annotations

import datetime
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from disagg.core.sharding import shard_layout
from disagg.errors import ConfigError
from disagg.models import ModelSpec


@dataclass(frozen=True)
class TensorParallel:
    """Rank `rank` of a group of `size` ranks; `group` None is the default process group.

    `expert_parallel`: an MoE layer's experts are split across the ranks (each keeps whole
    experts) instead of each expert's intermediate width.
    `dp`: DP attention groups among the `size` ranks (each of `size // dp` ranks).
    `store`: the store the group formed through (`join`), for what the ranks exchange besides
    tensors.
    """

    rank: int
    size: int
    group: dist.ProcessGroup | None = field(default=None, compare=False)
    expert_parallel: bool = False
    dp: int = 1
    store: dist.Store | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        if self.size < 1:
            raise ConfigError(f"tp size={self.size} must be >= 1")
        if self.dp < 1 or self.size % self.dp:
            raise ConfigError(f"dp={self.dp} does not split a group of {self.size} ranks")
        if not 0 <= self.rank < self.size:
            raise ConfigError(f"tp rank={self.rank} outside 0..{self.size - 1}")

    def __str__(self) -> str:
        tp = self.size // self.dp
        return f"tp={tp}" if self.dp == 1 else f"tp={tp} x dp={self.dp} ({self.size} ranks)"

    @property
    def dp_rank(self) -> int:
        """This rank's attention group."""
        return self.rank // (self.size // self.dp)

    @property
    def attention(self) -> TensorParallel:
        """This rank's place in its attention group (itself without DP): what the attention
        weights are cut by. It only names the place: its collectives are the node's."""
        if self.dp == 1:
            return self
        tp = self.size // self.dp
        return TensorParallel(self.rank % tp, tp, None, self.expert_parallel)

    def part(self, n: int, what: str) -> range:
        """This rank's even share of `n` items (`what` names them in the error)."""
        if n % self.size:
            raise ConfigError(f"{self} does not divide {what} ({n})")
        share = n // self.size
        return range(self.rank * share, (self.rank + 1) * share)

    def kv_heads(self, spec: ModelSpec) -> range:
        """KV heads this rank holds, as the transfer planner assumes (MLA: the latent, 0)."""
        return shard_layout(spec, self.size // self.dp, self.dp).heads_of(self.rank)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum of `x` over the group, in place; returns `x`."""
        dist.all_reduce(x, group=self.group)
        return x

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Every rank's `x` (same shape on each), concatenated along `dim` in rank order."""
        parts = [torch.empty_like(x) for _ in range(self.size)]
        dist.all_gather(parts, x.contiguous(), group=self.group)
        return torch.cat(parts, dim)


def join(
    rank: int,
    size: int,
    init_file: str,
    *,
    backend: str = "gloo",
    timeout_s: float = 60.0,
    expert_parallel: bool = False,
    op_timeout_s: float | None = None,
    dp: int = 1,
) -> TensorParallel:
    """Join the default process group of `size` ranks (`dp` attention groups of them) through a
    FileStore at `init_file` (every rank of one host passes the same path), over `backend`
    ("gloo" or "nccl"); ConfigError naming the rank on a timeout.
    `op_timeout_s`: how long a collective may wait for the other ranks (`timeout_s` if None;
    if given, the returned `group` is a second group of the same ranks, that patient)."""
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.FileStore(init_file, size)
        store.set_timeout(timeout)
        dist.init_process_group(backend, store=store, rank=rank, world_size=size, timeout=timeout)
        if op_timeout_s is not None:  # the same ranks, patient (formed at once: all are here)
            ops = datetime.timedelta(seconds=op_timeout_s)
            group = dist.new_group(list(range(size)), timeout=ops)
            return TensorParallel(rank, size, group, expert_parallel, dp, store)
    except (RuntimeError, ValueError) as err:
        raise ConfigError(
            f"tp rank {rank} of {size} could not join the group at {init_file} "
            f"within {timeout_s} s: {err}"
        ) from err
    return TensorParallel(rank, size, None, expert_parallel, dp, store)


@dataclass(frozen=True)
class Cut:
    """The part of a full tensor one rank keeps: `keep` ranges of dimension `dim`, in order."""

    dim: int
    keep: tuple[range, ...]

    def shape(self, full: tuple[int, ...]) -> tuple[int, ...]:
        """The kept tensor's shape, given the full one."""
        out = list(full)
        out[self.dim] = sum(len(r) for r in self.keep)
        return tuple(out)

    def apply(self, full: torch.Tensor) -> torch.Tensor:
        """The kept part of `full`, contiguous."""
        parts = [full.narrow(self.dim, r.start, len(r)) for r in self.keep]
        return torch.cat(parts, self.dim) if len(parts) > 1 else parts[0].contiguous()


def scaled(r: range, by: int, offset: int = 0) -> range:
    """Rows of items `r` when each item is `by` rows, the whole block starting at `offset`."""
    return range(offset + r.start * by, offset + r.stop * by)


def attention_cuts(spec: ModelSpec, tp: TensorParallel) -> dict[str, Cut]:
    """Cuts of one layer's attention weights within the rank's attention group: query heads
    split (column-parallel in, row-parallel `wo`); GQA KV heads as the planner places them;
    MLA's latent (w_dkv, w_dq) uncut."""
    spec.check_tp(tp.attention.size)
    q = tp.attention.part(spec.heads, f"{spec.name}'s query heads")
    if spec.attention != "mla":
        d, kv = spec.head_dim, tp.kv_heads(spec)
        k_at, v_at = spec.heads * d, (spec.heads + spec.kv_heads) * d
        rows = (scaled(q, d), scaled(kv, d, k_at), scaled(kv, d, v_at))
        return {"wqkv": Cut(0, rows), "wo": Cut(1, (scaled(q, d),))}
    qk = spec.qk_nope_dim + spec.qk_rope_dim
    q_proj = "w_uq" if spec.q_lora_rank else "w_q"
    return {
        q_proj: Cut(0, (scaled(q, qk),)),
        "w_uk": Cut(0, (q,)),
        "w_uv": Cut(0, (q,)),
        "wo": Cut(1, (scaled(q, spec.v_head_dim),)),
    }


def swiglu_cuts(width: int, tp: TensorParallel, what: str, dim: int = 0) -> tuple[Cut, Cut]:
    """(gate/up cut, down cut) of a SwiGLU of `width` whose [gate; up] rows lie along `dim`
    (its down projection's inputs along `dim + 1`): each rank keeps its share of both halves."""
    mine = tp.part(width, what)
    up = range(width + mine.start, width + mine.stop)
    return Cut(dim, (mine, up)), Cut(dim + 1, (mine,))


def lm_head_cut(spec: ModelSpec, tp: TensorParallel) -> Cut:
    """The vocab-parallel lm_head: each rank computes its share of the logits."""
    return Cut(0, (tp.part(spec.vocab, f"{spec.name}'s vocab"),))
