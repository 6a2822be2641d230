"""Simulated nodes driving the core: SimPy processes for prefill, decode and colocated nodes.

Each node asks its core scheduler for a batch, holds for the cost model's step time, and feeds
the messenger the same events the real backend does; the commands that come back are carried
out here (control messages after a control-plane latency, writes as network flows). A decode
node runs identical decode passes between batch changes as one event (`_decode_run`), so an
hour of cluster traffic costs a few events per request, not one per token.
"""

from __future__ import annotations

import math
import random
from collections.abc import Callable, Generator, Sequence
from pathlib import Path
from typing import Any, Protocol

import simpy

from disagg.config import Experiment, GroupConfig
from disagg.core.kvcache import PagePool
from disagg.core.messenger import (
    Command,
    DecodeMessenger,
    Failed,
    Message,
    PostMetadata,
    PostWrites,
    Prefill,
    PrefillMessenger,
    Ready,
    Retry,
    Send,
    Unschedule,
)
from disagg.core.metrics import Recorder
from disagg.core.request import Request, Status
from disagg.core.router import Router, make_router
from disagg.core.scheduler import (
    Batch,
    ColocatedScheduler,
    DecodeScheduler,
    PrefillScheduler,
    steps_to_finish,
)
from disagg.core.workload import generate
from disagg.errors import ConfigError
from disagg.sim.costmodel import StepShape, chunk_attn_pairs, make_cost_model
from disagg.sim.network import Network
from disagg.sim.transfer import TransferModel

Proc = Generator[simpy.Event, Any, None]


def pool_pages(exp: Experiment, group: GroupConfig, role: str) -> int:
    """KV pages one node of `group` can hold: HBM left after weights and a reserve."""
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
    return pages


class _Schedules(Protocol):
    def schedule(self) -> Batch: ...


class Node:
    """Common parts of a simulated node: name, wake-up event, cost model, the pass loop."""

    role = "node"
    scheduler: _Schedules

    def __init__(self, sim: Sim, idx: int, group: GroupConfig) -> None:
        self.sim, self.idx, self.group = sim, idx, group
        self.name = f"{self.role}{idx}"
        self.env = sim.env
        self.cost = make_cost_model(sim.exp, group)
        self.pool = PagePool(pool_pages(sim.exp, group, self.role), sim.exp.kv.page_size, self.name)
        self._wake = self.env.event()

    def wake(self) -> None:
        if not self._wake.triggered:
            self._wake.succeed()

    def sleep(self) -> simpy.Event:
        self._wake = self.env.event()
        return self._wake

    def loop(self) -> Proc:
        """Ask the scheduler for a batch, run it, repeat; sleep while there is nothing to do."""
        while True:
            batch = self.scheduler.schedule()
            if batch.empty:
                yield self.sleep()
            else:
                yield from self.run_pass(batch)

    def run_pass(self, batch: Batch) -> Proc:
        raise NotImplementedError

    @property
    def load(self) -> int:
        """Requests this node holds (what a least-loaded router compares)."""
        raise NotImplementedError

    def shape(self, batch: Batch) -> StepShape:
        """The cost model's view of `batch`; stamps the prefill start of first chunks."""
        for c in batch.chunks:
            if math.isnan(c.req.prefill_start_s):
                c.req.prefill_start_s = self.env.now
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
    ) -> Generator[simpy.Event, Any, int]:
        """Run identical decode passes until one request finishes or the node is woken (then
        up to the end of the pass in flight); returns the passes run. Step time is
        a + b * context, and context grows by len(decodes) * tokens_per_step per pass."""
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
        first = t0 + elapsed(1)
        for r in decodes:
            if r.generated == 0:
                r.first_token_s = first
        return steps


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
    role = "prefill"
    scheduler: PrefillScheduler

    def __init__(self, sim: Sim, idx: int, group: GroupConfig) -> None:
        super().__init__(sim, idx, group)
        exp = sim.exp
        self.layers = exp.model.spec.layers
        self.messenger = PrefillMessenger(idx, self.pool, self.layers, exp.transfer.policy)
        self.scheduler = PrefillScheduler(group.token_budget, group.max_batch)
        self.pass_step: tuple[float, float] | None = None  # (start, duration) of the running pass
        self.env.process(self.loop())

    @property
    def load(self) -> int:
        return len(self.messenger)

    def run_pass(self, batch: Batch) -> Proc:
        t0 = self.env.now
        step_s = self.cost.step_time(self.shape(batch))
        chunks = [(c.req.id, c.start, c.tokens) for c in batch.chunks]
        self.sim.execute(self, self.messenger.on_batch(chunks))
        # every layer of the pass, each sent once it is produced (see TransferModel.post)
        self.sim.execute(self, self.messenger.on_layers(self.layers), (t0, step_s))
        self.pass_step = (t0, step_s)
        yield self.env.timeout(step_s)
        self.pass_step = None
        for r in self.scheduler.complete(batch).prefilled:
            r.prefill_end_s = self.env.now
        self.record("prefill", t0, 1, batch)
        self.sim.execute(self, self.messenger.on_batch_done())


class DecodeNode(Node):
    role = "decode"
    scheduler: DecodeScheduler

    def __init__(self, sim: Sim, idx: int, group: GroupConfig) -> None:
        super().__init__(sim, idx, group)
        self.tps = sim.exp.spec.accepted_tokens_per_step
        t = sim.exp.transfer
        self.messenger = DecodeMessenger(
            idx, self.pool, sim.transfers.expected, max_attempts=t.max_attempts, handoff=t.handoff
        )
        self.scheduler = DecodeScheduler(group.max_batch, self.tps)
        self.env.process(self.loop())

    @property
    def load(self) -> int:
        return len(self.messenger) + len(self.scheduler)

    def ready(self, req: Request) -> None:
        req.ready_s = self.env.now
        self.scheduler.add_ready(req)
        if len(self.scheduler.running) < self.scheduler.max_batch:
            self.wake()

    def run_pass(self, batch: Batch) -> Proc:
        t0 = self.env.now
        steps = yield from self._decode_run(batch.decodes, self.tps, lambda: True)
        progress = self.scheduler.complete(batch, steps)
        self.record("decode", t0, steps, batch)
        for r in progress.finished:
            self.sim.finish(r)
            self.sim.execute(self, self.messenger.release(r.id, self.env.now))


class ColocatedNode(Node):
    role = "colocated"
    scheduler: ColocatedScheduler

    def __init__(self, sim: Sim, idx: int, group: GroupConfig) -> None:
        super().__init__(sim, idx, group)
        self.tps = sim.exp.spec.accepted_tokens_per_step
        self.scheduler = ColocatedScheduler(
            self.pool, group.token_budget, group.max_batch, self.tps, 1 + sim.exp.spec.draft_tokens
        )
        self.env.process(self.loop())

    @property
    def load(self) -> int:
        return len(self.scheduler)

    def submit(self, req: Request) -> None:
        req.prefill_node = req.decode_node = self.idx
        self.scheduler.add(req)
        self.wake()

    def run_pass(self, batch: Batch) -> Proc:
        t0 = self.env.now
        if batch.decode_only:
            waiting = lambda: bool(self.scheduler.waiting)  # noqa: E731
            steps = yield from self._decode_run(batch.decodes, self.tps, waiting)
            progress = self.scheduler.complete(batch, steps)
        else:
            steps = 1
            yield self.env.timeout(self.cost.step_time(self.shape(batch)))
            progress = self.scheduler.complete(batch)
            for r in progress.prefilled:
                r.prefill_end_s = r.first_token_s = self.env.now
        self.record("decode" if batch.decode_only else "mixed", t0, steps, batch)
        for r in progress.finished:
            self.sim.finish(r)


def _pick(router: Router, nodes: Sequence[Node]) -> int:
    """The index of the node `router` picks, given every node's current load."""
    return router.pick({i: n.load for i, n in enumerate(nodes)})


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
                node = self.colocated[_pick(self.route_main, self.colocated)]
                node.submit(req)
                if req.status is Status.FAILED:
                    self.finished += 1
            else:
                self._submit(self.decodes[_pick(self.route_main, self.decodes)], req)

    def _submit(self, decode: DecodeNode, req: Request) -> None:
        prefill = _pick(self.route_prefill, self.prefills)
        self.transfers.choose_plan(req)
        if self.exp.transfer.handoff == "parallel" and req.attempts == 0:  # to both at once
            node = self.prefills[prefill]
            self.execute(node, node.messenger.submit(req.id, req.prompt_tokens, decode.idx))
        self.execute(decode, decode.messenger.submit(req, prefill, self.env.now))

    def finish(self, req: Request) -> None:
        req.status, req.finish_s = Status.FINISHED, self.env.now
        self.finished += 1

    # ---- commands ------------------------------------------------------------------------
    def execute(
        self, node: Node, cmds: list[Command], step: tuple[float, float] | None = None
    ) -> None:
        """Carry out a messenger's commands; `step` = (start, duration) of the pass that
        produces the layers of any PostWrites."""
        for cmd in cmds:
            if isinstance(cmd, Send):
                self._send(node, cmd.node, cmd.msg)
            elif isinstance(cmd, Prefill):
                assert isinstance(node, PrefillNode)
                node.scheduler.add(self.requests[cmd.req_id], cmd.tokens)
                node.wake()
            elif isinstance(cmd, Unschedule):
                assert isinstance(node, PrefillNode)
                node.scheduler.remove(cmd.req_id)
            elif isinstance(cmd, PostWrites | PostMetadata):
                self.env.process(self._post(node, cmd, step))
            elif isinstance(cmd, Ready):
                assert isinstance(node, DecodeNode)
                self.rec.landed(cmd.req_id, self.env.now)
                node.ready(self.requests[cmd.req_id])
            elif isinstance(cmd, Failed):
                self.requests[cmd.req_id].fail(cmd.reason)
                self.finished += 1
            elif isinstance(cmd, Retry):
                assert isinstance(node, DecodeNode)
                self._submit(node, self.requests[cmd.req_id])

    def _send(self, sender: Node, dst: int, msg: Message) -> None:
        target: PrefillNode | DecodeNode = (
            self.prefills[dst] if isinstance(sender, DecodeNode) else self.decodes[dst]
        )

        def deliver(_: simpy.Event) -> None:  # mid-pass, a catch-up post follows that pass
            step = target.pass_step if isinstance(target, PrefillNode) else None
            self.execute(target, target.messenger.on_message(msg), step)

        self.env.timeout(self.exp.transfer.control_latency_s).callbacks.append(deliver)

    def _post(
        self, node: Node, cmd: PostWrites | PostMetadata, step: tuple[float, float] | None
    ) -> Proc:
        assert isinstance(node, PrefillNode)
        req = self.requests[cmd.req_id]
        yield from self.transfers.post(node.idx, req, cmd, step, self.rec)
        decode = self.decodes[cmd.decode_node]
        for rank, count in self.transfers.immediates(req, cmd).items():
            self.execute(decode, decode.messenger.on_immediates(cmd.slot, count, rank))
        self.execute(node, node.messenger.on_posted(cmd.req_id))

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
        for node in [*self.colocated, *self.prefills, *self.decodes]:
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
