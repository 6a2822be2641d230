"""Simulated nodes driving the core roles: SimPy processes for prefill, decode and colocated
nodes.

Each node is the port of its core role (disagg.core.roles): it asks the role for a batch, holds
for the cost model's step time, and reports the pass's end; what the role asks of the port is
carried out here (control messages after a control-plane latency, writes as network flows,
timers as SimPy timeouts). A decode node runs identical decode passes between batch changes as
one event (`_decode_run`), so an hour of cluster traffic costs a few events per request, not
one per token.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any

import simpy

from disagg.config import Experiment, GroupConfig
from disagg.core.kvcache import PagePool
from disagg.core.messenger import Message, PostMetadata, PostWrites
from disagg.core.metrics import Recorder
from disagg.core.policies import make_router
from disagg.core.request import Request, Status
from disagg.core.roles import ColocatedRole, DecodeRole, PrefillRole
from disagg.core.router import Router
from disagg.core.scheduler import Batch, steps_to_finish
from disagg.core.workload import generate
from disagg.errors import ConfigError
from disagg.sim.costmodel import StepShape, chunk_attn_pairs, make_cost_model
from disagg.sim.network import Network
from disagg.sim.transfer import TransferModel

Proc = Generator[simpy.Event, Any, None]


def pool_pages(exp: Experiment, group: GroupConfig, role: str) -> int:
    """KV pages of one node of `group`: `kv.pages` if set, else what the HBM left after
    weights and a reserve holds."""
    spec, hw, kv = exp.model.spec, exp.hardware, exp.kv
    gpu_bytes = hw.gpu_spec.hbm_bytes * kv.memory_fraction
    weights = spec.weight_bytes(exp.model.weight_dtype) / group.gpus_per_node
    free = gpu_bytes - weights - kv.activation_reserve_gb * 1e9
    kv_shards = 1 if spec.attention == "mla" else min(group.tp, spec.kv_heads)
    page_bytes = kv.page_size * spec.kv_bytes_per_token(exp.model.kv_dtype) / kv_shards
    pages = int(free // page_bytes) * group.dp
    if pages < 1:
        raise ConfigError(
            f"cluster.{role}: {spec.name} does not fit: {weights / 1e9:.0f} GB of weights per "
            f"GPU (tp={group.tp} x dp={group.dp}) leave {free / 1e9:.1f} GB of "
            f"{hw.gpu_spec.hbm_bytes / 1e9:.0f} GB for the KV cache on {hw.gpu}"
        )
    if kv.pages is not None:  # as given (a hw run records the pool it ran with)
        if kv.pages > pages:
            raise ConfigError(
                f"kv.pages={kv.pages}: a cluster.{role} node of {spec.name} on {hw.gpu} holds "
                f"at most {pages} pages"
            )
        return kv.pages
    return pages


class Node:
    """A simulated node: the port of its core role (SimPy time, simulated control plane and
    network) and the loop that runs the role's passes for the cost model's time."""

    kind = "node"
    role: PrefillRole | DecodeRole | ColocatedRole

    def __init__(self, sim: Sim, idx: int, group: GroupConfig) -> None:
        self.sim, self.idx, self.group = sim, idx, group
        self.name = f"{self.kind}{idx}"
        self.env = sim.env
        self.cost = make_cost_model(sim.exp, group)
        self.pool = PagePool(pool_pages(sim.exp, group, self.kind), sim.exp.kv.page_size, self.name)
        self._wake = self.env.event()

    # -- the port
    def now(self) -> float:
        return self.env.now

    def send(self, role: str, node: int, msg: Message) -> None:
        self.sim.send(role, node, msg)

    def wake(self) -> None:
        if not self._wake.triggered:
            self._wake.succeed()

    def finished(self, req: Request) -> None:
        self.sim.finished += 1

    # -- the loop
    def sleep(self) -> simpy.Event:
        self._wake = self.env.event()
        return self._wake

    def loop(self) -> Proc:
        """Ask the role for a batch, run it, repeat; sleep while there is nothing to do."""
        while True:
            batch = self.role.next_batch()
            if batch.empty:
                yield self.sleep()
            else:
                yield from self.run_pass(batch)

    def run_pass(self, batch: Batch) -> Proc:
        raise NotImplementedError

    def shape(self, batch: Batch) -> StepShape:
        """The cost model's view of `batch`."""
        return StepShape(
            prefill_tokens=batch.prefill_tokens,
            prefill_attn_pairs=sum(chunk_attn_pairs(c.start, c.tokens) for c in batch.chunks),
            decode_seqs=len(batch.decodes),
            decode_context=float(sum(r.prompt_tokens + int(r.generated) for r in batch.decodes)),
        )

    def record(self, kind: str, t0: float, steps: int, batch: Batch) -> None:
        """One steps-table row for `steps` passes of `batch` that began at `t0`."""
        took = self.env.now - t0  # all of it device time: the model has no host overhead
        self.sim.rec.batch(self.name, kind, t0, took, batch, steps, self.cost.decode_qo, took)

    def _decode_run(
        self, decodes: list[Request], tokens_per_step: float, interruptible: Callable[[], bool]
    ) -> Generator[simpy.Event, Any, tuple[int, float]]:
        """Run identical decode passes until one request finishes or the node is woken (then
        up to the end of the pass in flight); returns the passes run and when the first ended.
        Step time is a + b * context, and context grows by len(decodes) * tokens_per_step per
        pass."""
        a, b = self.cost.decode_line(len(decodes))
        k0 = float(sum(r.prompt_tokens + int(r.generated) for r in decodes))
        grow = len(decodes) * tokens_per_step

        def elapsed(k: int) -> float:
            return k * a + b * (k * k0 + grow * k * (k - 1) / 2)

        n = min(steps_to_finish(r, tokens_per_step) for r in decodes)
        t0 = self.env.now
        yield self.env.timeout(elapsed(n)) | self.sleep()
        steps = n
        if self.env.now < t0 + elapsed(n) and interruptible():
            steps = min(n, _passes_done(elapsed, self.env.now - t0, n) + 1)
            yield self.env.timeout(t0 + elapsed(steps) - self.env.now)
        elif self.env.now < t0 + elapsed(n):
            yield self.env.timeout(t0 + elapsed(n) - self.env.now)
        return steps, t0 + elapsed(1)


def _passes_done(elapsed: Callable[[int], float], e: float, n: int) -> int:
    """Largest k <= n with elapsed(k) <= e (elapsed is increasing)."""
    lo, hi = 0, n
    while lo < hi:
        mid = (lo + hi + 1) // 2
        if elapsed(mid) <= e:
            lo = mid
        else:
            hi = mid - 1
    return lo


class PrefillNode(Node):
    kind = "prefill"
    role: PrefillRole

    def __init__(self, sim: Sim, idx: int, group: GroupConfig) -> None:
        super().__init__(sim, idx, group)
        exp = sim.exp
        self.layers = exp.model.spec.layers
        self.role = PrefillRole(idx, self, self.pool, group, exp.transfer, self.layers)
        self.pass_step: tuple[float, float] | None = None  # (start, duration) of the running pass
        self.env.process(self.loop())

    def post(self, cmd: PostWrites | PostMetadata) -> None:
        """A post made during a pass takes its layers' times from the pass; one made between
        passes (metadata, a catch-up of earlier layers) starts at once."""
        self.env.process(self.sim.post(self, cmd, self.pass_step))

    def request(self, req_id: int, prompt_tokens: int, prompt: tuple[int, ...]) -> Request:
        return self.sim.requests[req_id]  # one object per request: its stamps are the table's

    def prefilled(self, req: Request) -> None:
        pass  # stamped on the run's own request object

    def run_pass(self, batch: Batch) -> Proc:
        t0 = self.env.now
        self.pass_step = (t0, self.cost.step_time(self.shape(batch)))
        # every layer of the pass, each sent once it is produced (see TransferModel.post)
        self.role.on_layers(self.layers)
        yield self.env.timeout(self.pass_step[1])
        self.pass_step = None
        self.role.pass_done(batch)
        self.record("prefill", t0, 1, batch)


class DecodeNode(Node):
    kind = "decode"
    role: DecodeRole

    def __init__(self, sim: Sim, idx: int, group: GroupConfig) -> None:
        super().__init__(sim, idx, group)
        self.tps = sim.exp.spec.accepted_tokens_per_step
        t = sim.exp.transfer
        self.role = DecodeRole(idx, self, self.pool, group, t, sim.transfers.expected, self.tps)
        self.env.process(self.loop())

    def set_timer(self, at_s: float) -> None:
        timer = self.env.timeout(max(0.0, at_s - self.env.now))
        timer.callbacks.append(lambda _: self.role.on_timer())

    def route(self, req: Request) -> int:
        return self.sim.route(req)

    def ready(self, req: Request) -> None:
        self.sim.rec.landed(req.id, self.env.now)

    def run_pass(self, batch: Batch) -> Proc:
        t0 = self.env.now
        steps, first_s = yield from self._decode_run(batch.decodes, self.tps, lambda: True)
        self.role.pass_done(batch, steps, first_s)
        self.record("decode", t0, steps, batch)


class ColocatedNode(Node):
    kind = "colocated"
    role: ColocatedRole

    def __init__(self, sim: Sim, idx: int, group: GroupConfig) -> None:
        super().__init__(sim, idx, group)
        self.tps = sim.exp.spec.accepted_tokens_per_step
        decode_qo = 1 + sim.exp.spec.draft_tokens
        self.role = ColocatedRole(idx, self, self.pool, group, self.tps, decode_qo)
        self.env.process(self.loop())

    def run_pass(self, batch: Batch) -> Proc:
        t0 = self.env.now
        if batch.decode_only:
            admitting = lambda: self.role.admitting  # noqa: E731
            steps, _ = yield from self._decode_run(batch.decodes, self.tps, admitting)
        else:
            steps = 1
            yield self.env.timeout(self.cost.step_time(self.shape(batch)))
        self.role.pass_done(batch, steps)
        self.record("decode" if batch.decode_only else "mixed", t0, steps, batch)


def _pick(router: Router, nodes: Sequence[Node]) -> int:
    """The index of the node `router` picks, given every node's current load (the requests
    its role holds)."""
    return router.pick({i: len(n.role) for i, n in enumerate(nodes)})


class Sim:
    """One simulated run of an experiment."""

    def __init__(self, exp: Experiment) -> None:
        self.exp = exp
        self.env = simpy.Environment()
        self.rng = random.Random(exp.seed)
        self.rec = Recorder()
        self.network = Network(self.env)
        self.arrivals = generate(exp.workload, exp.seed, base_dir=Path(exp.base_dir))
        if not self.arrivals:
            raise ConfigError("the workload produced no requests (duration too short?)")
        self.requests: dict[int, Request] = {}
        self.finished = 0
        self.transfers = TransferModel(exp, self.network, self.rng)
        c = exp.cluster
        self.colocated = (
            [ColocatedNode(self, i, c.colocated) for i in range(c.colocated.nodes)]
            if c.mode == "colocated"
            else []
        )
        self.prefills = (
            [PrefillNode(self, i, c.prefill) for i in range(c.prefill.nodes)]
            if c.mode == "disagg"
            else []
        )
        self.decodes = (
            [DecodeNode(self, i, c.decode) for i in range(c.decode.nodes)]
            if c.mode == "disagg"
            else []
        )
        self.nodes: list[Node] = [*self.colocated, *self.prefills, *self.decodes]
        self.transfers.add_nics(len(self.prefills), len(self.decodes))
        nodes = self.colocated or self.decodes
        self.route_main = make_router(c.router, range(len(nodes)))
        self.route_prefill = make_router(c.router, range(max(len(self.prefills), 1)))
        self.env.process(self._arrive())

    def _arrive(self) -> Proc:
        for a in self.arrivals:
            if a.arrival_s > self.env.now:
                yield self.env.timeout(a.arrival_s - self.env.now)
            req = Request(a.request_id, a.arrival_s, a.prompt_tokens, a.output_tokens)
            self.requests[req.id] = req
            if self.colocated:
                self.colocated[_pick(self.route_main, self.colocated)].role.submit(req)
            else:
                self._submit(self.decodes[_pick(self.route_main, self.decodes)], req)

    def _submit(self, decode: DecodeNode, req: Request) -> None:
        prefill = self.route(req)
        if self.exp.transfer.handoff == "parallel":  # to both at once
            self.prefills[prefill].role.submit(req.id, req.prompt_tokens, decode.idx)
        decode.role.submit(req, prefill)

    def route(self, req: Request) -> int:
        """The prefill node of `req` (a first attempt or a retry), and its transfer plan."""
        prefill = _pick(self.route_prefill, self.prefills)
        self.transfers.choose_plan(req)
        return prefill

    # ---- the simulated control plane and network -------------------------------------------
    def send(self, role: str, node: int, msg: Message) -> None:
        """Deliver `msg` to node `node` of `role` after the control-plane latency."""
        target = self.prefills[node] if role == "prefill" else self.decodes[node]
        deliver = lambda _: target.role.on_message(msg)  # noqa: E731
        self.env.timeout(self.exp.transfer.control_latency_s).callbacks.append(deliver)

    def post(
        self, node: PrefillNode, cmd: PostWrites | PostMetadata, step: tuple[float, float] | None
    ) -> Proc:
        """Move a post's bytes; its immediates land on the decoder, then the prefill hears."""
        req = self.requests[cmd.req_id]
        yield from self.transfers.post(node.idx, req, cmd, step, self.rec)
        decode = self.decodes[cmd.decode_node]
        for rank, count in self.transfers.immediates(req, cmd).items():
            decode.role.on_immediates(cmd.slot, count, rank)
        node.role.on_posted(cmd.req_id)

    # ---- running ---------------------------------------------------------------------------
    def run(
        self, progress: Callable[[int, int, float], None] | None = None, slice_s: float = 10.0
    ) -> None:
        """Run to the end; `progress(finished, total, now_s)` is called every `slice_s`."""
        total = len(self.arrivals)
        while self.finished < total and self.env.peek() < math.inf:
            self.env.run(until=self.env.now + slice_s)
            if progress:
                progress(self.finished, total, self.env.now)
        self.check_end()

    def network_summary(self) -> dict[str, float]:
        """Busiest sending NIC: bytes it sent and the fraction of the run it was busy."""
        keys = list(self.network.nics)
        if not keys:
            return {}
        return {
            "nic_bytes_max": max(self.transfers.nic_bytes.values(), default=0.0),
            "nic_busy_max": max(self.network.utilisation(k) for k in keys),
        }

    def check_end(self) -> None:
        """Every request finished or failed with a reason; every page back in its pool."""
        for node in self.nodes:
            node.pool.check()
            if node.pool.used_pages:
                raise ConfigError(f"{node.name}: {node.pool.used_pages} KV pages leaked")
        stuck = [
            r.id for r in self.requests.values() if r.status not in (Status.FINISHED, Status.FAILED)
        ]
        if stuck or len(self.requests) != len(self.arrivals):
            raise ConfigError(
                f"simulation ended with {len(stuck)} unfinished requests (first: {stuck[:5]})"
            )
