"""The ranks of a node of several processes: a leader and its followers, one process each.

A node of `cluster.<role>.tp = T` and `.dp = D` runs as T x D processes on one host, all spawned
by the driver: D attention groups of T ranks (rank r in group r // T, as the transfer planner
numbers them). Rank 0, the leader, is the node's `Server`: control plane, role, scheduler,
messenger and the node's one wire. The others, the followers, only compute. Every rank joins the
node's process group through a FileStore in the node's directory (`NodeConfig.tp_dir`): gloo on
the CPU, and on GPUs (`rank_devices`: cuda:N+r each where the host has them, else all on the
node's cuda:N) NCCL when every rank has a GPU of its own, gloo when they share one
(`collective_backend`). Before each forward pass the leader broadcasts the pass's sequences,
as JSON (`encode_pass`; nothing between ranks is pickled); every rank runs the pass on its
shard of the model (the all-reduces inside keep the ranks in step) and the leader samples.

DP attention (D > 1): one scheduler, the leader's, batches the requests of every group; each
`Seq` names the group that holds its request (`disagg.hw.node.dp_rank`, a seeded draw per
request that the prefill and decode nodes make alike), each rank attends only its group's
sequences over its own cache, and the MLP or experts run over all T x D ranks
(disagg.hw.model). The node's page ids are one pool's: every rank's cache has room for all of
them, and a page holds data only in the cache of its request's group.

The leader holds every rank's KV pages, so that its wire registers them all (`region(layer,
rank)`, `register_pages`) and moves all of the node's KV, as the article's one transfer engine
per node does. On the CPU each rank's cache is a file of the node's directory mapped shared
(`kv.r<rank>`). On GPUs each rank allocates its own on its own GPU, a follower exports it
through the node's store as plain values (CUDA IPC handles as bytes and ints in JSON:
`publish_cache`), and the leader maps it (`mapped_cache`); a follower keeps its cache until
the leader stops it.

A pass's writes are complete before the leader's wire reads them. The leader's layer counter
passes a layer only after that layer's all-reduce (disagg.hw.model), which completes on the
leader only once every rank has contributed, and each rank contributes after its own writes
of that layer: on the CPU every op is synchronous; NCCL's kernel runs after the rank's earlier
kernels on its stream; gloo copies a CUDA tensor to the host after an event on the rank's
stream, and the leader's all-reduce returns only once every rank's copy has come. The one write
no collective orders, the zeroing of a follower's fresh GPU pages, the follower synchronizes
before it exports them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from disagg.config import Experiment
from disagg.core.kvcache import PageLayout
from disagg.errors import ConfigError, DisaggError, TransportError
from disagg.hw import latency
from disagg.hw.batch import Seq
from disagg.hw.cache import KVCache, page_layout
from disagg.hw.device import resolve_device
from disagg.hw.model import Transformer
from disagg.hw.protocol import NodeConfig
from disagg.hw.runner import Runner, StepOutput
from disagg.hw.tp import TensorParallel, join
from disagg.hw.transport.base import Descriptor, Transport
from disagg.settings import HW_PAGES

OP_TIMEOUT_S = 86400.0  # a follower waits for the next pass as long as its leader idles
LOST_GROUP = 3  # a follower's exit code when another rank left its group


def region(layer: int, rank: int) -> str:
    """The wire region of one layer of one rank's KV pages (rank 0's keeps the TP1 name)."""
    return f"kv{layer}" if rank == 0 else f"kv{layer}.r{rank}"


def device_of(cfg: NodeConfig, exp: Experiment) -> str:
    return exp.hw.prefill_device if cfg.role == "prefill" else exp.hw.decode_device


_CUDA = re.compile(r"(?:cuda:)?(\d+)|cuda")


def rank_devices(device: str, ranks: int, gpus: int) -> list[str]:
    """The device of each of the `ranks` ranks of a node whose device is `device`, on a host of
    `gpus` CUDA GPUs. On cuda:N, rank r runs on cuda:(N + r) where the host has GPUs N .. N +
    ranks - 1, a GPU of its own each; where it has fewer (one H200, say), every rank runs on
    cuda:N, sharing it. On the CPU every rank runs on the CPU."""
    cuda = _CUDA.fullmatch(device)
    first = int(cuda.group(1) or 0) if cuda else 0
    if cuda is None or ranks == 1 or first + ranks > gpus:
        return [device] * ranks
    return [f"cuda:{first + r}" for r in range(ranks)]


def rank_device(cfg: NodeConfig, exp: Experiment, rank: int) -> str:
    """The device of rank `rank` of node `cfg` on this host (`rank_devices`)."""
    return rank_devices(device_of(cfg, exp), cfg.ranks, torch.cuda.device_count())[rank]


def collective_backend(devices: Sequence[str], role: str, ranks: str) -> str:
    """The collectives of a node whose ranks run on `devices`: NCCL when every rank has a GPU
    of its own; gloo on the CPU and when ranks share a GPU (NCCL refuses two ranks on one
    device; gloo's all-reduce, all-gather and broadcast take CUDA tensors, through host
    memory). ConfigError naming the node (`ranks`) where NCCL is needed and this torch lacks it."""
    if len(devices) < 2 or len(set(devices)) < len(devices):
        return "gloo"
    if not dist.is_nccl_available():
        raise ConfigError(
            f"{ranks} on {', '.join(devices)} needs NCCL, and this torch build has none "
            "(torch.distributed.is_nccl_available() is False): install a CUDA build of torch, "
            f"or --set cluster.{role}.tp=1 cluster.{role}.dp=1"
        )
    return "nccl"


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
    exp = Experiment.model_validate(cfg.experiment)
    devices = rank_devices(device_of(cfg, exp), cfg.ranks, torch.cuda.device_count())
    backend = collective_backend(devices, cfg.role, f"{cfg.name}'s {world(cfg)} ranks")
    (here / f"came.r{rank}").write_text(str(cfg.ranks))  # the world size it was started for
    try:
        return join(
            rank,
            cfg.ranks,
            str(here / "store"),
            backend=backend,
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


def cache_shape(
    cfg: NodeConfig, exp: Experiment, model: Transformer
) -> tuple[PageLayout, tuple[int, ...]]:
    """The page layout and whole shape, [layers, pages + 1, ...], of one rank's KV pages: the
    pages its `model.new_cache` allocates (its share of its attention group's heads)."""
    kv, spec = exp.kv, exp.model.spec
    elem = torch.empty((), dtype=model.dtype).element_size()
    pl = page_layout(spec, kv.page_size, kv.layout, elem, cfg.tp)
    return pl, (spec.layers, (kv.pages or HW_PAGES) + 1, *pl.shape)


def shared_cache(cfg: NodeConfig, exp: Experiment, model: Transformer, rank: int) -> KVCache:
    """Rank `rank`'s KV pages on the CPU, in the node's shared file for it (made zeroed, or
    mapped if another rank made it)."""
    pl, shape = cache_shape(cfg, exp, model)
    path = os.path.join(cfg.tp_dir, f"kv.r{rank}")
    whole = torch.from_file(path, shared=True, size=math.prod(shape), dtype=model.dtype)
    return KVCache(list(whole.view(shape).unbind(0)), pl, shape[1] - 1)


def new_cache(exp: Experiment, model: Transformer) -> KVCache:
    """This rank's KV pages, allocated on its device (`model.new_cache`)."""
    kv = exp.kv
    return model.new_cache(kv.pages or HW_PAGES, kv.page_size, kv.layout)


def follower_cache(
    cfg: NodeConfig, exp: Experiment, model: Transformer, tp: TensorParallel
) -> KVCache:
    """Follower `tp.rank`'s KV pages: its shared file on the CPU; on a GPU its own, exported
    to the leader (`publish_cache`)."""
    if model.device.type != "cuda":
        return shared_cache(cfg, exp, model, tp.rank)
    cache = new_cache(exp, model)
    publish_cache(tp, cache)
    return cache


def publish_cache(tp: TensorParallel, cache: KVCache) -> None:
    """Export follower `tp.rank`'s GPU pages to its leader through the node's store, as JSON
    of plain values (`cuda.export_info`: IPC handles as base64 bytes and ints; nothing pickled):
    the whole allocation, which the leader maps, and each layer's pages, which the leader's
    wire hands its peers to map (the leader cannot export what it only maps)."""
    from disagg.hw.transport.cuda import export_info

    assert tp.store is not None
    storage = cache.layers[0].untyped_storage()  # the one allocation of every layer
    whole = torch.empty(0, dtype=torch.uint8, device=storage.device).set_(storage)
    torch.cuda.synchronize(whole.device)  # the zeroing is done before anyone reads the pages
    record = {
        "whole": export_info(whole),
        "layers": [export_info(cache.layer_bytes(i)) for i in range(len(cache.layers))],
    }
    tp.store.set(f"kv.r{tp.rank}", json.dumps(record))


def mapped_cache(
    cfg: NodeConfig, exp: Experiment, model: Transformer, tp: TensorParallel, rank: int
) -> tuple[KVCache, list[dict[str, Any]]]:
    """Follower `rank`'s GPU pages mapped on the leader's GPU (`publish_cache`), and its
    export of each layer's; ConfigError naming the rank if it exports none within the store's
    timeout (`hw.start_timeout_s`), TransportError if its export cannot be mapped."""
    from disagg.hw.transport.cuda import map_exported

    assert tp.store is not None
    try:
        record = json.loads(tp.store.get(f"kv.r{rank}"))
    except RuntimeError as e:  # the store's timeout
        raise ConfigError(f"{cfg.rank_name(rank)} exported no KV pages to its leader: {e}") from e
    pl, shape = cache_shape(cfg, exp, model)
    layers = record.get("layers") if isinstance(record, dict) else None
    if not isinstance(layers, list) or len(layers) != shape[0]:
        raise TransportError(f"{cfg.rank_name(rank)}'s export is not one of {shape[0]} layers")
    nbytes = math.prod(shape) * torch.empty((), dtype=model.dtype).element_size()
    flat = map_exported(record.get("whole"), nbytes, model.device)
    whole = flat.view(model.dtype).view(shape)
    return KVCache(list(whole.unbind(0)), pl, shape[1] - 1), layers


def node_caches(
    cfg: NodeConfig, exp: Experiment, model: Transformer, tp: TensorParallel | None
) -> tuple[list[KVCache], dict[int, list[dict[str, Any]]]]:
    """Every rank's KV pages as the leader holds them, by rank, and the exports of those it
    maps from a follower's GPU (by rank, one per layer; none on the CPU): `register_pages`.
    A node of one rank (`tp` None): its own pages."""
    if tp is None:
        return [new_cache(exp, model)], {}
    if model.device.type != "cuda":
        return [shared_cache(cfg, exp, model, r) for r in range(cfg.ranks)], {}
    caches, exported = [new_cache(exp, model)], {}
    for rank in range(1, cfg.ranks):
        cache, exported[rank] = mapped_cache(cfg, exp, model, tp, rank)
        caches.append(cache)
    return caches, exported


def register_pages(
    wire: Transport, caches: Sequence[KVCache], exported: Mapping[int, Sequence[dict[str, Any]]]
) -> list[Descriptor]:
    """Register every layer of every rank's pages with the leader's `wire`, by rank then layer
    (`region(layer, rank)`); a follower's GPU pages with its export (`exported[rank]`), which
    only the cuda wire takes."""
    out = []
    for rank, cache in enumerate(caches):
        for i in range(len(cache.layers)):
            name, pages = region(i, rank), cache.layer_bytes(i)
            if rank not in exported:
                out.append(wire.register(name, pages))
                continue
            from disagg.hw.transport.cuda import CudaTransport

            if not isinstance(wire, CudaTransport):
                raise ConfigError(
                    f"the {wire.name} wire cannot move GPU ranks' pages: hw.wire=cuda"
                )
            out.append(wire.register_mapped(name, pages, exported[rank][i]))
    return out


def rank_model(cfg: NodeConfig, exp: Experiment, tp: TensorParallel | None) -> Transformer:
    """The node's model, or rank `tp.rank`'s shard of it (every rank draws the same weights),
    on the rank's device (`rank_devices`)."""
    return Transformer(
        exp.model.spec,
        seed=exp.weight_seed,
        device=rank_device(cfg, exp, 0 if tp is None else tp.rank),
        fused_ops=exp.hw.latency.fused_ops,
        moe=exp.hw.moe,
        tp=tp,
        weight_cache=exp.hw.weight_cache,
    )


class LeaderRunner(Runner):
    """The leader's runner: each pass goes to the followers first, then runs here too."""

    def step(
        self,
        batch: Sequence[Seq],
        *,
        sample: bool = False,
        then: Sequence[Seq] = (),
        feed: tuple[StepOutput, Sequence[int]] | None = None,
        read: bool = True,
    ) -> StepOutput:
        tp = self.model.tp
        assert tp is not None and feed is None  # the followers take their tokens from here
        try:
            send_pass(tp, batch)
            return super().step(batch, sample=sample, then=then, read=read)
        except RuntimeError as e:  # gloo's word for a peer that left
            raise DisaggError(f"a rank of this node's {tp.size} left its group: {e}") from e

    def plan_ahead(self, batch: Sequence[Seq], in_flight: bool = False) -> bool:
        return False  # the followers would not have the plan

    def chains(self, batch: Sequence[Seq]) -> bool:
        return False  # the followers would not have the tokens

    def stop_followers(self) -> None:
        """Tell the followers the node is done (they leave their loops), then leave the group."""
        if dist.is_initialized() and self.model.tp is not None:
            with contextlib.suppress(RuntimeError):  # a follower gone already: the driver says
                send_pass(self.model.tp, None)
            dist.destroy_process_group()


def follow(cfg: NodeConfig, rank: int) -> None:
    """The process body of follower `rank` of node `cfg`: join, build its shard, then run the
    leader's passes until told to stop. A leader that goes away ends it with an error."""
    exp = Experiment.model_validate(cfg.experiment)
    name = cfg.rank_name(rank)
    device = rank_device(cfg, exp, rank)
    if device == "cpu":
        torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
    try:
        if device != "cpu":  # its GPU is current: its streams, NCCL's, the broadcasts' tensors
            torch.cuda.set_device(resolve_device(device))
        tp = join_node(cfg, rank, exp.hw.start_timeout_s)
        model = rank_model(cfg, exp, tp)
        # the cache lives as long as this process, which the leader's stop ends: as long as
        # the leader maps it
        cache = follower_cache(cfg, exp, model, tp)
        runner = Runner(
            model, cache, attention=exp.hw.attention, graph_batches=(), count_layers=False
        )  # the leader's counter is the one its watcher reads
        # pinned once built, as a leader is (disagg.hw.serve)
        slot = latency.process_slot(exp.cluster, cfg.role, cfg.index, rank)
        latency.apply(exp.hw.latency, slot, device)
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
    """The leader's next pass (None: stop), as `send_pass` sent it."""
    return decode_pass(_broadcast_bytes(tp, None))


def send_pass(tp: TensorParallel, batch: Sequence[Seq] | None) -> None:
    """Send the node's next pass (None: stop) from its leader to its followers."""
    _broadcast_bytes(tp, encode_pass(batch))


def encode_pass(batch: Sequence[Seq] | None) -> bytes:
    """A pass as JSON of plain values, each Seq as [tokens, start, pages, hidden_at, dp_rank]:
    what goes between a node's ranks is never pickled (gloo's sockets are the host's)."""
    seqs = (
        None
        if batch is None
        else [[list(s.tokens), s.start, list(s.pages), s.hidden_at, s.dp_rank] for s in batch]
    )
    return json.dumps(seqs, separators=(",", ":")).encode()


def decode_pass(data: bytes) -> list[Seq] | None:
    """`encode_pass`'s pass; DisaggError for anything that is not one."""
    try:
        seqs = json.loads(data)
        if seqs is None:
            return None
        if not isinstance(seqs, list):
            raise TypeError(f"a pass is a list of Seqs, not {type(seqs).__name__}")
        return [_seq(*item) for item in seqs]
    except (ValueError, TypeError, ConfigError) as e:  # not JSON, not a list of Seqs, bad Seq
        raise DisaggError(f"the leader's pass is not one: {e}") from e


def _seq(tokens: Any, start: Any, pages: Any, hidden_at: Any, dp_rank: Any) -> Seq:
    ints = [*tokens, start, *pages, dp_rank, *([] if hidden_at is None else [hidden_at])]
    if any(type(v) is not int for v in ints):
        raise TypeError("a Seq of values other than integers")
    return Seq(tuple(tokens), start, tuple(pages), hidden_at, dp_rank)


def _broadcast_bytes(tp: TensorParallel, data: bytes | None) -> bytes:
    """Broadcast `data` from the leader (given there, None on the followers): its length, then
    its bytes, as tensors on the group's device (the current GPU under NCCL)."""
    nccl = dist.get_backend(tp.group) == "nccl"
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    size = torch.tensor([0 if data is None else len(data)], dtype=torch.int64, device=device)
    dist.broadcast(size, src=0, group=tp.group)
    if data is not None:  # the leader: its own bytes back, no copy from the device
        dist.broadcast(
            torch.frombuffer(bytearray(data), dtype=torch.uint8).to(device), src=0, group=tp.group
        )
        return data
    buf = torch.empty(int(size.item()), dtype=torch.uint8, device=device)
    dist.broadcast(buf, src=0, group=tp.group)
    return buf.cpu().numpy().tobytes()
