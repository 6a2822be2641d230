"""What a posted write list costs on the simulated network, from the core's transfer plan.

Each request gets a transfer plan (which prefill DP group and which decode DP group hold it,
and which prefill replica feeds which decode replica, drawn from the run's seeded rng). A
PostWrites of P pages and L layers puts, on the NIC nearest each sending rank, that rank's
bytes and write operations times P*L; the immediates it delivers per decode rank come from the
same plan. Plans are cached: a run draws from a few per pair of DP groups.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass

from disagg.config import Experiment
from disagg.core.messenger import PostMetadata, PostWrites
from disagg.core.metrics import Recorder
from disagg.core.request import Request
from disagg.core.sharding import (
    MetadataKind,
    ShardLayout,
    TransferPlan,
    plan_transfer,
    shard_layout,
)
from disagg.sim.network import Network, Parts

PLANS_PER_PAIR = 8  # distinct replica assignments drawn per (prefill group, decode group)
METADATA: MetadataKind = (
    "hidden"  # hidden state of the token before the last prompt token (MTP / drafts)
)


@dataclass(frozen=True)
class PlanCost:
    """A plan's per-page-per-layer load on each sending NIC, and its immediates."""

    plan: TransferPlan
    bytes_by_nic: dict[int, int]
    ops_by_nic: dict[int, int]
    imms_by_rank: dict[int, int]
    metadata_nic: int
    metadata_bytes: int


@dataclass(slots=True)
class _Load:
    """What one kind of post (a prefill node, a plan, a size) puts on the network, and how
    many such posts were made."""

    parts: Parts  # the NIC work, resolved
    nbytes_by_nic: dict[tuple[str, int, int], int]
    max_work_s: float
    nbytes: int
    ops: int
    posts: int = 0


class TransferModel:
    def __init__(self, exp: Experiment, network: Network, rng: random.Random) -> None:
        self.exp, self.network, self.rng = exp, network, rng
        self.node = exp.hardware.node
        self.layers = exp.model.spec.layers
        self.layerwise = exp.transfer.policy == "layerwise"
        self.plans: dict[int, PlanCost] = {}
        self._cache: dict[tuple[int, int, int], PlanCost] = {}
        # (prefill node, id of a cached PlanCost, page-layers) -> that post's load
        self._loads: dict[tuple[int, int, int], _Load] = {}
        self._expected: dict[tuple[int, int], dict[int, int]] = {}  # (PlanCost id, pages)
        self._imms: dict[tuple[int, int], dict[int, int]] = {}  # (PlanCost id, page-layers)
        self._meta_imms: dict[int, dict[int, int]] = {}  # by PlanCost id
        c, spec = exp.cluster, exp.model.spec
        self.src: ShardLayout | None = None
        self.dst: ShardLayout | None = None
        if c.mode == "disagg":
            self.src = shard_layout(spec, c.prefill.tp, c.prefill.dp)
            self.dst = shard_layout(spec, c.decode.tp, c.decode.dp)

    def add_nics(self, prefills: int, decodes: int) -> None:
        for p in range(prefills):
            for n in range(self.node.nics):
                self.network.add_nic(("prefill", p, n), self.node.nic)

    def choose_plan(self, req: Request) -> None:
        """Draw the request's prefill group, decode group and replica assignment."""
        assert self.src is not None and self.dst is not None
        key = (
            self.rng.randrange(self.src.dp),
            self.rng.randrange(self.dst.dp),
            self.rng.randrange(PLANS_PER_PAIR),
        )
        if key not in self._cache:
            self._cache[key] = self._plan_cost(*key)
        self.plans[req.id] = self._cache[key]

    def _plan_cost(self, src_group: int, dst_group: int, variant: int) -> PlanCost:
        assert self.src is not None and self.dst is not None
        kv = self.exp.kv
        plan = plan_transfer(
            self.src,
            self.dst,
            kv.page_size,
            kv.layout,
            self.exp.model.kv_dtype,
            random.Random(hash((self.exp.seed, src_group, dst_group, variant))),
            src_dp_rank=src_group,
            dst_dp_rank=dst_group,
        )
        by_nic_bytes: dict[int, int] = {}
        by_nic_ops: dict[int, int] = {}
        for rank, nbytes in plan.bytes_by_src_rank().items():
            nic = self.node.nic_of_gpu(rank)
            by_nic_bytes[nic] = by_nic_bytes.get(nic, 0) + nbytes
        for rank, ops in plan.ops_by_src_rank().items():
            nic = self.node.nic_of_gpu(rank)
            by_nic_ops[nic] = by_nic_ops.get(nic, 0) + ops
        meta = plan.metadata(METADATA)
        return PlanCost(
            plan,
            by_nic_bytes,
            by_nic_ops,
            plan.imms_per_page_layer_by_dst_rank(),
            self.node.nic_of_gpu(meta.src_rank),
            meta.nbytes,
        )

    def expected(self, req: Request, prefill_node: int, pages: int) -> dict[int, int]:
        """Immediates each decode rank counts for `req` (the decoder knows the plan); the dict
        is shared by requests of the same plan and size: read it, do not change it."""
        pc = self.plans[req.id]
        key = (id(pc), pages)
        counts = self._expected.get(key)
        if counts is None:
            counts = self._expected[key] = pc.plan.expected_immediates(pages, self.layers, True)
        return counts

    @property
    def nic_bytes(self) -> dict[tuple[str, int, int], float]:
        """Bytes each sending NIC was given to send, by NIC key."""
        total: dict[tuple[str, int, int], int] = {}
        for load in self._loads.values():
            if not load.posts:
                continue
            for key, nbytes in load.nbytes_by_nic.items():
                total[key] = total.get(key, 0) + nbytes * load.posts
        return {key: float(nbytes) for key, nbytes in total.items()}

    def immediates(self, req: Request, cmd: PostWrites | PostMetadata) -> dict[int, int]:
        """Immediates the post's writes deliver, by decode rank (do not change the dict)."""
        pc = self.plans[req.id]
        if not isinstance(cmd, PostWrites):  # the metadata write
            imms = self._meta_imms.get(id(pc))
            if imms is None:
                imms = self._meta_imms[id(pc)] = {pc.plan.dst_leader: 1}
            return imms
        units = cmd.imm.count(True) * len(cmd.layers)  # cmd.imm_pages, inlined
        key = (id(pc), units)
        imms = self._imms.get(key)
        if imms is None:
            imms = self._imms[key] = {r: n * units for r, n in pc.imms_by_rank.items() if n * units}
        return imms

    def _load(self, prefill: int, pc: PlanCost, units: int) -> _Load:
        """A post's NIC work and bytes of `units` page-layers (-1: the metadata write)."""
        if units < 0:
            load = {pc.metadata_nic: (pc.metadata_bytes, 1)}
        else:
            load = {n: (b * units, pc.ops_by_nic[n] * units) for n, b in pc.bytes_by_nic.items()}
        work = {
            ("prefill", prefill, n): self.network.work_s(("prefill", prefill, n), b, o)
            for n, (b, o) in load.items()
        }
        nbytes = {("prefill", prefill, n): b for n, (b, _) in load.items()}
        return _Load(
            self.network.parts(work),
            nbytes,
            max(work.values(), default=0.0),
            sum(b for b, _ in load.values()),
            sum(o for _, o in load.values()),
        )

    def post(
        self,
        prefill: int,
        req: Request,
        cmd: PostWrites | PostMetadata,
        step: tuple[float, float] | None,
        rec: Recorder,
        done: Callable[[], None],
    ) -> None:
        """Move the bytes of one post, then call `done`; layer-wise posts start when their
        first layer is produced and cannot end before their last layer is produced and sent."""
        pc, network = self.plans[req.id], self.network
        now = network.env._now
        writes = cmd if isinstance(cmd, PostWrites) else None
        units = -1 if writes is None else len(writes.src_pages) * len(writes.layers)
        key = (prefill, id(pc), units)
        load = self._loads.get(key)
        if load is None:
            load = self._loads[key] = self._load(prefill, pc, units)
        load.posts += 1
        if step is None or writes is None or not self.layerwise or writes.earlier:
            rec.transfer(req, load.nbytes, load.ops, now)
            network.transfer_parts(load.parts, 0.0, done)
            return
        t0, step_s = step
        per_layer = step_s / self.layers
        layers = writes.layers
        start = t0 + per_layer * (layers.start + 1)
        not_before = t0 + per_layer * layers.stop + load.max_work_s / len(layers)

        def begin() -> None:
            rec.transfer(req, load.nbytes, load.ops, network.env._now)
            network.transfer_parts(load.parts, not_before, done)

        if start > now:
            network.call(start - now, begin)
        else:
            begin()
