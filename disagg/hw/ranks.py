"""The ranks of a node of several processes: a leader and its followers, one process each.

A node of `cluster.<role>.tp = T` and `.dp = D` runs as T x D processes on one host, all spawned
by the driver: D attention groups of T ranks (rank r in group r // T, as the transfer planner
numbers them). Rank 0, the leader, is the node's `Server`: control plane, role, scheduler,
messenger and the node's one wire. The others, the followers, only compute. Every rank joins the
node's process group (gloo on CPU) through a FileStore in the node's directory
(`NodeConfig.tp_dir`). Before each forward pass the leader broadcasts the pass's sequences;
every rank runs the pass on its shard of the model (the all-reduces inside keep the ranks in
step) and the leader samples.

DP attention (D > 1): one scheduler, the leader's, batches the requests of every group; each
`Seq` names the group that holds its request (`disagg.hw.node.dp_rank`, a seeded draw per
request that the prefill and decode nodes make alike), each rank attends only its group's
sequences over its own cache, and the MLP or experts run over all T x D ranks
(disagg.hw.model). The node's page ids are one pool's: every rank's cache file has room for all
of them, and a page holds data only in the file of its request's group.

Each rank's KV cache is a file of the node's directory mapped shared (`kv.r<rank>`), so the
leader maps every rank's pages too: its wire registers them all (`region(layer, rank)`) and
moves all of the node's KV, as the article's one transfer engine per node does. A pass's writes
are all made before the leader's pass returns (the last all-reduce waits for every rank).
"""

from __future__ import annotations

import contextlib
import math
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist

from disagg.config import Experiment
from disagg.errors import ConfigError, DisaggError
from disagg.hw.batch import Seq
from disagg.hw.cache import KVCache, page_layout
from disagg.hw.model import Transformer
from disagg.hw.protocol import NodeConfig
from disagg.hw.runner import Runner, StepOutput
from disagg.hw.tp import TensorParallel, join
from disagg.settings import HW_PAGES

OP_TIMEOUT_S = 86400.0  # a follower waits for the next pass as long as its leader idles
LOST_GROUP = 3  # a follower's exit code when another rank left its group


def region(layer: int, rank: int) -> str:
    """The wire region of one layer of one rank's KV pages (rank 0's keeps the TP1 name)."""
    return f"kv{layer}" if rank == 0 else f"kv{layer}.r{rank}"


def device_of(cfg: NodeConfig, exp: Experiment) -> str:
    return exp.hw.prefill_device if cfg.role == "prefill" else exp.hw.decode_device


def rank_dir(cfg: NodeConfig) -> NodeConfig:
    """`cfg` with a new directory for its ranks to share (the group's store, each rank's KV
    memory), in shared memory where the host has it; the caller removes it when the node ends."""
    shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
    return replace(cfg, tp_dir=tempfile.mkdtemp(prefix=f"disagg-{cfg.name}-", dir=shm))


def world(cfg: NodeConfig) -> str:
    """The node's ranks, in words: '2' (tp=2), or '4 (tp=2 x dp=2)'."""
    return str(cfg.ranks) if cfg.dp == 1 else f"{cfg.ranks} (tp={cfg.tp} x dp={cfg.dp})"


def join_node(cfg: NodeConfig, rank: int, timeout_s: float) -> TensorParallel:
    """Join the node's group as `rank`; ConfigError for a rank outside the node's world, and,
    if the group does not form within `timeout_s`, one naming the ranks that never came and any
    that came for another world size."""
    if not cfg.tp_dir:
        raise ConfigError(
            f"cluster.{cfg.role}: tp={cfg.tp} x dp={cfg.dp} needs the node's ranks started "
            "together, with a directory to share: by `disagg hw run`, or `disagg hw serve`"
        )
    if not 0 <= rank < cfg.ranks:
        raise ConfigError(f"rank {rank} is outside {cfg.name}'s world of {world(cfg)} ranks")
    here = Path(cfg.tp_dir)
    (here / f"came.r{rank}").write_text(str(cfg.ranks))  # the world size it was started for
    try:
        return join(
            rank,
            cfg.ranks,
            str(here / "store"),
            timeout_s=timeout_s,
            op_timeout_s=OP_TIMEOUT_S,
            dp=cfg.dp,
            expert_parallel=cfg.expert_parallel,
        )
    except ConfigError as err:
        came = {int(p.name[6:]): p.read_text() for p in here.glob("came.r*")}
        missing = [r for r in range(cfg.ranks) if r not in came]
        other = {r: w for r, w in sorted(came.items()) if w and w != str(cfg.ranks)}
        if other:
            raise ConfigError(
                f"{cfg.name}'s ranks disagree on its world size: rank {rank} was started for "
                f"{world(cfg)} ranks, but "
                + ", ".join(f"rank {r} for {w}" for r, w in other.items())
            ) from err
        raise ConfigError(
            f"ranks {missing or 'all'} of {cfg.name}'s {world(cfg)} did not join its group "
            f"within {timeout_s:g} s (as rank {rank} saw it: {err})"
        ) from err


def shared_cache(cfg: NodeConfig, exp: Experiment, model: Transformer, rank: int) -> KVCache:
    """Rank `rank`'s KV pages, in the node's shared file for it (made zeroed, or mapped if
    another rank made it): the same pages the rank's `model.new_cache` would allocate (its
    share of its attention group's heads, `cluster.<role>.tp`)."""
    kv, spec = exp.kv, exp.model.spec
    pages = kv.pages or HW_PAGES
    elem = torch.empty((), dtype=model.dtype).element_size()
    pl = page_layout(spec, kv.page_size, kv.layout, elem, cfg.tp)
    shape = (spec.layers, pages + 1, *pl.shape)
    path = os.path.join(cfg.tp_dir, f"kv.r{rank}")
    whole = torch.from_file(path, shared=True, size=math.prod(shape), dtype=model.dtype)
    whole = whole.view(shape)
    return KVCache(list(whole.unbind(0)), pl, pages)


def rank_model(cfg: NodeConfig, exp: Experiment, tp: TensorParallel | None) -> Transformer:
    """The node's model, or rank `tp.rank`'s shard of it (every rank draws the same weights)."""
    return Transformer(
        exp.model.spec,
        seed=exp.seed,
        device=device_of(cfg, exp),
        fused_ops=exp.hw.latency.fused_ops,
        moe=exp.hw.moe,
        tp=tp,
    )


class LeaderRunner(Runner):
    """The leader's runner: each pass goes to the followers first, then runs here too."""

    def step(self, batch: Sequence[Seq], *, sample: bool = False) -> StepOutput:
        tp = self.model.tp
        assert tp is not None
        try:
            dist.broadcast_object_list([list(batch)], src=0, group=tp.group)
            return super().step(batch, sample=sample)
        except RuntimeError as e:  # gloo's word for a peer that left
            raise DisaggError(f"a rank of this node's {tp.size} left its group: {e}") from e

    def plan_ahead(self, batch: Sequence[Seq]) -> bool:
        return False  # the followers would not have the plan

    def stop_followers(self) -> None:
        """Tell the followers the node is done (they leave their loops), then leave the group."""
        if dist.is_initialized() and self.model.tp is not None:
            with contextlib.suppress(RuntimeError):  # a follower gone already: the driver says
                dist.broadcast_object_list([None], src=0, group=self.model.tp.group)
            dist.destroy_process_group()


def follow(cfg: NodeConfig, rank: int) -> None:
    """The process body of follower `rank` of node `cfg`: join, build its shard, then run the
    leader's passes until told to stop. A leader that goes away ends it with an error."""
    exp = Experiment.model_validate(cfg.experiment)
    name = cfg.rank_name(rank)
    if device_of(cfg, exp) == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    try:
        tp = join_node(cfg, rank, exp.hw.start_timeout_s)
        model = rank_model(cfg, exp, tp)
        runner = Runner(
            model, shared_cache(cfg, exp, model, rank), attention=exp.hw.attention, graph_batches=()
        )
        while (batch := receive(tp)) is not None:
            runner.step(batch)
    except DisaggError as e:
        print(f"{name}: {e}", file=sys.stderr, flush=True)
        sys.exit(1)
    except RuntimeError as e:  # gloo's word for a rank that left: another death's consequence
        print(f"{name}: its group broke (a rank left): {e}", file=sys.stderr, flush=True)
        sys.exit(LOST_GROUP)
    dist.destroy_process_group()


def receive(tp: TensorParallel) -> list[Seq] | None:
    """The leader's next pass (None: stop)."""
    got: list[list[Seq] | None] = [None]
    dist.broadcast_object_list(got, src=0, group=tp.group)
    return got[0]
