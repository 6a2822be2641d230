"""Simulated nodes driving the core roles: light processes (`Clock.start`) for prefill, decode
and colocated nodes.

Each node is the port of its core role (disagg.core.roles): it asks the role for a batch, holds
for the cost model's step time, and reports the pass's end; what the role asks of the port is
carried out here (control messages after a control-plane latency, writes as network flows,
timers as clock calls). A decode node runs identical decode passes between batch changes as
one event (`_decode_run`), so an hour of cluster traffic costs a few events per request, not
one per token.

With `hw.latency.chain` a decode or colocated node chains passes as the hw servers do: where
its role knows the pass after the one starting (`continuation`: nothing waits to join), that
pass is launched behind it and runs without the host time between passes (the host did it
while the device ran the pass before); an event during a pass is handled after the pass
already chained behind it.
"""

from __future__ import annotations

import gc
import math
import random
from collections.abc import Callable, Generator, Sequence
from functools import partial
from operator import attrgetter, sub
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from disagg.config import Experiment, GroupConfig
from disagg.core.kvcache import PagePool
from disagg.core.messenger import Message, PostMetadata, PostWrites
from disagg.core.metrics import Recorder, host_share
from disagg.core.policies import make_router
from disagg.core.request import Request, Status
from disagg.core.roles import ColocatedRole, DecodeRole, PrefillRole
from disagg.core.router import Router
from disagg.core.scheduler import Batch
from disagg.core.workload import generate
from disagg.errors import ConfigError
from disagg.faults import (
    DelayControl,
    DropConnection,
    Fault,
    Kill,
    NicDegrade,
    NicDown,
    Stop,
    attribute,
)
from disagg.models import dtype_bytes
from disagg.sim.clock import Clock
from disagg.sim.costmodel import ProfileCost, StepShape, make_cost_model
from disagg.sim.gpu import SharedGPU, TurnGPU
from disagg.sim.network import Network
from disagg.sim.transfer import TransferModel

if TYPE_CHECKING:
    import pandas as pd

Proc = Generator[Any, Any, None]  # run by Clock.start: yields delays (s) and events


def pool_pages(exp: Experiment, group: GroupConfig, role: str) -> int:
    """KV pages of one node of `group`: `kv.pages` if set, else what the HBM left after
    weights and a reserve holds. Under DP attention each attention group holds the attention
    weights (split over its tp ranks), the rest are split over every GPU of the node."""
    spec, hw, kv = exp.model.spec, exp.hardware, exp.kv
    gpu_bytes = hw.gpu_spec.hbm_bytes * kv.memory_fraction
    weights = spec.weight_bytes(exp.model.weight_dtype) / group.gpus_per_node
    if group.dp > 1:
        attention = spec.layers * spec.attn_params_per_layer * dtype_bytes(exp.model.weight_dtype)
        weights += attention / group.tp - attention / group.gpus_per_node
    free = gpu_bytes - weights - kv.activation_reserve_gb * 1e9
    kv_shards = 1 if spec.attention == "mla" else min(group.tp, spec.kv_heads)
    page_bytes = kv.page_size * spec.kv_bytes_per_token(exp.model.kv_dtype) / kv_shards
    pages = int(free // page_bytes) * group.dp
    if pages < 1:
        hbm = hw.gpu_spec.hbm_bytes
        need = weights + kv.activation_reserve_gb * 1e9 + page_bytes  # one page of KV
        if need <= hbm:
            fix = f"kv.memory_fraction >= {math.ceil(need / hbm * 1000) / 1000:.3f} would fit"
        elif weights + page_bytes <= hbm:
            most_gb = math.floor((hbm - weights - page_bytes) / 1e8) / 10
            fix = (
                f"kv.memory_fraction=1 with kv.activation_reserve_gb <= {most_gb} would fit, "
                "or more GPUs per node (a larger tp)"
            )
        else:
            fix = "the weights alone exceed a GPU: more GPUs per node (a larger tp) would fit"
        raise ConfigError(
            f"cluster.{role}: {spec.name} does not fit on {hw.gpu_spec.name}: kv.memory_fraction="
            f"{kv.memory_fraction} of {hbm / 1e9:.0f} GB is {gpu_bytes / 1e9:.1f} GB per GPU, "
            f"less than {weights / 1e9:.1f} GB of weights (tp={group.tp} x dp={group.dp}) + "
            f"kv.activation_reserve_gb={kv.activation_reserve_gb} + one KV page "
            f"({page_bytes / 1e6:.2f} MB); {fix}"
        )
    if kv.pages is not None:  # as given (a hw run records the pool it ran with)
        if kv.pages > pages:
            raise ConfigError(
                f"kv.pages={kv.pages}: a cluster.{role} node of {spec.name} on "
                f"{hw.gpu_spec.name} holds at most {pages} pages"
            )
        return kv.pages
    return pages


R = TypeVar("R", bound=PrefillRole | DecodeRole | ColocatedRole)


class Node(Generic[R]):
    """A simulated node: the port of its core role (SimPy time, simulated control plane and
    network) and the loop that runs the role's passes for the cost model's time. Generic in
    its role's type (not an attribute a subclass narrows: mypyc, tools/compile_sim.py, does
    not compile that)."""

    kind = "node"
    role: R

    def __init__(self, sim: Sim, idx: int, group: GroupConfig) -> None:
        self.sim, self.idx, self.group = sim, idx, group
        self.name = f"{self.kind}{idx}"
        self.env = sim.env
        self.cost = make_cost_model(sim.exp, group, self.kind)
        self.pool = PagePool(pool_pages(sim.exp, group, self.kind), sim.exp.kv.page_size, self.name)
        self._wake = self.env.wake()
        self.wake = self._wake.set  # the port's wake(): there may be a pass to run
        self.dead = False  # killed (a fault): handles nothing more
        self.stopped_until = 0.0  # stopped (a fault): events wait for the resume
        self._held: list[Callable[[], None]] = []
        self.in_pass = False  # a pass runs: events wait in the inbox for its end
        self.chunk_end = -math.inf  # when its last pass with a prompt chunk ended
        self._inbox: list[Callable[[], None]] = []
        self.inbox_s = math.inf  # when the first event in the inbox came (inf: it is empty)
        self.chain = False  # hw.latency.chain (decode and colocated nodes)
        self.chained: Batch | None = None  # the pass launched behind the one that ran last
        # events came after the chained pass was launched: it runs alone (a hw server's loop
        # hears them once it ends, and the pass after it takes them in)
        self.late = False

    # -- events
    def deliver(self, event: Callable[[], None]) -> None:
        """Handle `event` (a message, immediates, a timer, a post's end) now, or, as a hw
        server's loop does, once the pass in flight has ended (a run of decode passes stops
        there), or when a stopped node resumes; a dead node handles nothing."""
        if self.dead:
            return
        if self.env._now < self.stopped_until:
            self._held.append(event)
        elif self.in_pass:
            if not self._inbox:
                self.inbox_s = self.env._now
            self._inbox.append(event)
            self.wake()
        else:
            event()

    def stop(self, for_s: float) -> None:
        """Freeze for `for_s`: the pass in flight ends, and events are handled, at the resume."""
        self.stopped_until = max(self.stopped_until, self.env._now + for_s)
        self.env.call(for_s, self._resume)

    def _resume(self) -> None:
        if self.dead or self.env._now < self.stopped_until:
            return  # dead, or stopped again for longer
        held, self._held = self._held, []
        for event in held:
            self.deliver(event)
        self.wake()

    def frozen(self) -> Proc:
        """Wait while the node is stopped."""
        while self.env._now < self.stopped_until:
            yield self.stopped_until - self.env._now

    # -- the port
    def now(self) -> float:
        return self.env._now

    def send(self, role: str, node: int, msg: Message) -> None:
        """Deliver `msg` to node `node` of `role` after the control-plane latency (and a
        delay_control fault's delay, on either end)."""
        sim = self.sim
        target = sim.prefills[node] if role == "prefill" else sim.decodes[node]
        latency = sim.control_latency_s
        if sim.delays:
            now = self.env._now
            ends = (self.name, target.name)
            latency += sum(d for n, t0, t1, d in sim.delays if n in ends and t0 <= now < t1)
        on_message = partial(target.role.on_message, msg)
        self.env.call(latency, lambda: target.deliver(on_message))

    def finished(self, req: Request) -> None:
        self.sim.finished += 1
        if req.status is Status.FAILED:
            self.sim.failed_at_s.append(self.env._now)
            self.sim.lost[req.id] = req.fail_reason

    # -- the loop
    def loop(self) -> Proc:
        """Ask the role for a batch, run it, repeat; sleep while there is nothing to do."""
        while not self.dead:
            if self.env._now < self.stopped_until:
                yield from self.frozen()
                continue
            batch, chained = self.chained, self.chained is not None
            self.chained = None
            if batch is None:
                batch = self.role.next_batch()
                if not batch.chunks and not batch.decodes:  # batch.empty, inlined
                    yield self._wake  # until the node's wake()
                    continue
            self.in_pass = True
            yield from self.run_pass(batch, chained)
            self.in_pass = False
            self.late = False
            if self._inbox:
                inbox, self._inbox = self._inbox, []
                self.inbox_s = math.inf
                for event in inbox:
                    self.deliver(event)
                self.late = self.chained is not None

    def busy(self, seconds: float, prefill: bool, decodes: int, chained: bool = False) -> Proc:
        """One pass of `seconds` (`prefill`: with a prompt chunk; `decodes` decode sequences):
        that long, or on a GPU shared with other nodes, as long as its share there makes it.
        Under the round robin and the turns rule only its device time takes turns: its host
        time runs beside the other nodes' passes, `cost.profile_host_before` of it first and
        the rest after (disagg/sim/gpu.py). A `chained` pass's host time ran during the pass
        before: only what of it outlasts the device time is left (`_chained_s`), and it takes
        its cost model's `chain_s` more."""
        gpu = self.sim.gpu
        needed = chained or gpu is not None  # alone and not chained, the host time is in it
        host = min(seconds, self.cost.host_s(prefill, decodes)) if needed else 0.0
        if chained:
            chain = self.cost.chain_s(decodes)
            seconds, host = _chained_s(seconds, host) + chain, max(0.0, 2 * host - seconds)
        if gpu is None:
            yield seconds
            return
        if isinstance(gpu, SharedGPU) and gpu.switch_s is None:
            yield from gpu.run(seconds, not prefill, seqs=decodes)
            return
        yield from gpu.run(seconds - host, not prefill, host, decodes)

    def run_pass(self, batch: Batch, chained: bool = False) -> Proc:
        """Run the pass of `batch` (`chained`: launched behind the one before, see `chain`)."""
        raise NotImplementedError

    def chain_after(self, batch: Batch, ahead: bool, last_start: float) -> None:
        """After the passes of `batch` (reported done), the last of them begun at `last_start`:
        where the role knew the pass after each when it began (`ahead`: nothing waited to join
        then) and no event had come before the last began, the pass after it (the role's next
        batch, now its continuation) was launched behind it (`chained`)."""
        if ahead and last_start < self.inbox_s:
            nxt = self.role.next_batch()
            self.chained = None if nxt.empty else nxt

    def shape(self, batch: Batch) -> StepShape:
        """The cost model's view of `batch`."""
        return StepShape(
            prefill_tokens=batch.prefill_tokens,
            prefill_attn_pairs=batch.prefill_attn_pairs,
            decode_seqs=len(batch.decodes),
            decode_context=batch.decode_context,
        )

    def record(
        self,
        kind: str,
        t0: float,
        steps: int,
        batch: Batch,
        pairs: float,
        context: float,
        chained: int = 0,
    ) -> None:
        """One steps-table row for `steps` passes of `batch` that began at `t0`, the first of
        them of `pairs` and `context` (StepShape's), `chained` of them chained: their device
        time is what the cost model's host time per pass leaves (a chained pass's: its
        `chain_s`)."""
        took = self.env._now - t0
        host = (steps - chained) * self.cost.host_s(bool(batch.chunks), len(batch.decodes))
        host += chained * self.cost.chain_s(len(batch.decodes))
        self.sim.rec.batch(
            self.name,
            kind,
            t0,
            took,
            batch,
            steps,
            self.cost.decode_qo,
            took - host,
            pairs,
            context,
            chained=chained,
        )

    def _decode_run(
        self,
        decodes: list[Request],
        tokens_per_step: float,
        interruptible: Callable[[], bool],
        chained: bool = False,
        ahead: bool = False,
    ) -> Generator[Any, Any, tuple[int, float, float, float]]:
        """Run identical decode passes until one request finishes or the node is woken (then
        up to the end of the pass in flight, and with `ahead` of the pass chained behind it),
        one pass only on a GPU shared with other nodes (its share there changes as theirs begin
        and end), while the cost model lengthens a pass for a chunk pass not long before
        (`fades_s`), or where events came after the first was launched (`late`); returns the
        passes run, when the first ended, its context, and when the last began. The first pass
        is `chained` or not; with `ahead` every later one is. Step time is a + b * context (a
        chained pass's: less its host time, plus the cost model's `chain_s`), and context
        grows by len(decodes) * tokens_per_step per pass."""
        env = self.env
        since = env._now - self.chunk_end
        a, b = self.cost.decode_line(len(decodes), since)
        # context tokens, and the output left of the request nearest its end (builtins over
        # the batch: this runs for every batch change)
        generated = list(map(_generated, decodes))
        k0 = float(sum(map(_prompt_tokens, decodes)) + sum(map(int, generated)))
        host = self.cost.host_s(False, len(decodes)) if chained or ahead else 0.0
        chain = self.cost.chain_s(len(decodes)) if chained or ahead else 0.0
        if self.sim.gpu is not None or since < self.cost.fades_s or a < 2 * host:
            t0 = env._now
            yield from self.busy(a + b * k0, False, len(decodes), chained)
            return 1, env._now, k0, t0
        first = a - host + chain if chained else a
        a = a - host + chain if ahead else a
        least = min(map(sub, map(_output_tokens, decodes), generated))  # decodes: not empty
        grow = len(decodes) * tokens_per_step
        # k -> the first k passes' time (no cells)
        elapsed = partial(_run_s, a, b, k0, grow, first - a)
        n = 1 if self.late else max(1, -int(-least // tokens_per_step))  # to finish one
        t0, all_s = env._now, elapsed(n)
        yield all_s, self._wake  # the first of the passes' end and a wake
        steps, now = n, env._now
        if now < t0 + all_s and (self._inbox or interruptible()):
            # elapsed(k) = qa k^2 + qb k: its root at now - t0 is about the passes done by now
            e, qa = now - t0, b * grow / 2
            qb = a + b * k0 - qa
            if qa > 0:
                guess = (math.sqrt(qb * qb + 4 * qa * e) - qb) / (2 * qa)
            else:
                guess = e / qb if qb > 0 else 0.0
            steps = min(n, _passes_done(elapsed, e, n, guess) + (2 if ahead else 1))
            yield t0 + elapsed(steps) - now
        elif now < t0 + all_s:
            yield t0 + all_s - now
        return steps, t0 + elapsed(1), k0, t0 + elapsed(steps - 1)


def _run_s(a: float, b: float, k0: float, grow: float, first: float, k: int) -> float:
    """Seconds of k passes of a + b * context, the context k0 at the first, growing by `grow`
    a pass, the first `first` longer."""
    return k * a + b * (k * k0 + grow * k * (k - 1) / 2) + (first if k else 0.0)


def _chained_s(seconds: float, host: float) -> float:
    """A chained pass's time, of `seconds` with `host` of host time before: the host's work ran
    while the pass before did, so the pass takes its device time, or the host's where that is
    longer (the device waits for the launch)."""
    return max(seconds - host, host)


_generated, _prompt_tokens = attrgetter("generated"), attrgetter("prompt_tokens")
_output_tokens = attrgetter("output_tokens")


def _always() -> bool:
    return True


_ENDED = (Status.FINISHED, Status.FAILED)


def _passes_done(elapsed: Callable[[int], float], e: float, n: int, guess: float) -> int:
    """Largest k in 0..n with elapsed(k) <= e (elapsed is increasing, elapsed(0) = 0), searched
    from `guess` (near the answer: a step or two to walk)."""
    k = min(n, max(0, int(guess)))
    while k < n and elapsed(k + 1) <= e:
        k += 1
    while k > 0 and elapsed(k) > e:
        k -= 1
    return k


class PrefillNode(Node[PrefillRole]):
    kind = "prefill"

    def __init__(self, sim: Sim, idx: int, group: GroupConfig) -> None:
        super().__init__(sim, idx, group)
        exp = sim.exp
        self.layers = exp.model.spec.layers
        self.role = PrefillRole(idx, self, self.pool, group, exp.transfer, self.layers)
        self.pass_step: tuple[float, float] | None = None  # (start, duration) of the running pass
        self.env.start(self.loop())

    def post(self, cmd: PostWrites | PostMetadata) -> None:
        """Move a post's bytes; its immediates land on the decoder, then this node hears. A
        post made during a pass takes its layers' times from the pass; one made between passes
        (metadata, a catch-up of earlier layers) starts at once."""
        sim = self.sim
        req = sim.requests[cmd.req_id]
        pair = (self.idx, cmd.decode_node)
        resets = sim.drops.get(pair, 0) if sim.drops else 0

        def moved() -> None:
            decode = sim.decodes[cmd.decode_node]
            if self.dead:
                return
            if decode.dead or (sim.drops and sim.drops.get(pair, 0) != resets):
                why = "it is dead" if decode.dead else "the connection was reset"
                error = f"{self.name} -> {decode.name}: {why}"
                self.deliver(lambda: self.role.on_posted(cmd.req_id, False, error))
                return
            # the writes land; the decoder counts them, and this node hears, between passes
            imms = sim.transfers.immediates(req, cmd)
            decode.deliver(partial(decode.role.on_immediates_by_rank, cmd.slot, imms))
            self.deliver(partial(self.role.on_posted, cmd.req_id))

        sim.transfers.post(self.idx, req, cmd, self.pass_step, sim.rec, moved)

    def request(self, req_id: int, prompt_tokens: int, prompt: tuple[int, ...]) -> Request:
        return self.sim.requests[req_id]  # one object per request: its stamps are the table's

    def prefilled(self, req: Request) -> None:
        pass  # stamped on the run's own request object

    def run_pass(self, batch: Batch, chained: bool = False) -> Proc:
        t0, gpu = self.env._now, self.sim.gpu
        shape = self.shape(batch)
        step_s = self.cost.step_time(shape)
        self.pass_step = (t0, step_s if gpu is None else gpu.expected_s(step_s, False))
        # every layer of the pass, each sent once it is produced (see TransferModel.post)
        self.role.on_layers(self.layers)
        yield from self.busy(step_s, True, len(batch.decodes))
        if self.env._now < self.stopped_until:
            yield from self.frozen()
        self.pass_step = None
        if self.dead:
            return
        self.role.pass_done(batch)
        self.record("prefill", t0, 1, batch, shape.prefill_attn_pairs, shape.decode_context)


class DecodeNode(Node[DecodeRole]):
    kind = "decode"

    def __init__(self, sim: Sim, idx: int, group: GroupConfig) -> None:
        super().__init__(sim, idx, group)
        self.tps = sim.exp.spec.accepted_tokens_per_step
        t = sim.exp.transfer
        self.role = DecodeRole(idx, self, self.pool, group, t, sim.transfers.expected, self.tps)
        self.chain = sim.exp.hw.latency.chain
        self.env.start(self.loop())

    def set_timer(self, at_s: float) -> None:
        self.env.call(max(0.0, at_s - self.env._now), lambda: self.deliver(self.role.on_timer))

    def route(self, req: Request) -> int:
        return self.sim.route(req)

    def ready(self, req: Request) -> None:
        self.sim.rec.landed(req.id, self.env._now)

    def run_pass(self, batch: Batch, chained: bool = False) -> Proc:
        t0 = self.env._now
        ahead = self.chain and self.role.continuation(batch) is not None
        run = self._decode_run(batch.decodes, self.tps, _always, chained, ahead)
        steps, first_s, context, last_s = yield from run
        if self.env._now < self.stopped_until:
            yield from self.frozen()
        if self.dead:
            return
        self.role.pass_done(batch, steps, first_s)
        self.record("decode", t0, steps, batch, 0.0, context, chained + (steps - 1) * ahead)
        self.chain_after(batch, ahead, last_s)


class ColocatedNode(Node[ColocatedRole]):
    kind = "colocated"

    def __init__(self, sim: Sim, idx: int, group: GroupConfig) -> None:
        super().__init__(sim, idx, group)
        self.tps = sim.exp.spec.accepted_tokens_per_step
        decode_qo = 1 + sim.exp.spec.draft_tokens
        self.role = ColocatedRole(idx, self, self.pool, group, self.tps, decode_qo)
        self.chain = sim.exp.hw.latency.chain
        self.env.start(self.loop())

    def run_pass(self, batch: Batch, chained: bool = False) -> Proc:
        t0 = self.env._now
        ahead = self.chain and self.role.continuation(batch) is not None
        if batch.decode_only:
            admitting = lambda: self.role.admitting  # noqa: E731
            run = self._decode_run(batch.decodes, self.tps, admitting, chained, ahead)
            steps, _, context, last_s = yield from run
            pairs = 0.0
        else:  # a pass with a chunk has no continuation: it is neither chained nor ahead
            steps, shape, last_s = 1, self.shape(batch), t0
            pairs, context = shape.prefill_attn_pairs, shape.decode_context
            yield from self.busy(self.cost.step_time(shape), True, len(batch.decodes))
            self.chunk_end = self.env._now
        if self.env._now < self.stopped_until:
            yield from self.frozen()
        if self.dead:
            return
        self.role.pass_done(batch, steps)
        kind = "decode" if batch.decode_only else "mixed"
        self.record(kind, t0, steps, batch, pairs, context, chained + (steps - 1) * ahead)
        self.chain_after(batch, ahead, last_s)


def _pick(router: Router, nodes: Sequence[Node]) -> int | None:
    """The index of the node `router` picks, given every node's current load (the requests
    its role holds), passing over dead nodes; None if all are dead. A router over one node
    picks it, whatever its load: that needs no loads."""
    if len(nodes) == 1:
        return None if nodes[0].dead else 0
    loads: dict[int, float] = {}
    for i, n in enumerate(nodes):
        role = n.role
        if n.dead:
            loads[i] = math.inf
        elif role.__class__ is DecodeRole:  # len(role), inlined: read for every node on
            loads[i] = len(role.requests)  # every arrival
        else:
            loads[i] = len(role)
    for _ in nodes:
        i = router.pick(loads)
        if not nodes[i].dead:
            return i
    return None


class Sim:
    """One simulated run of an experiment."""

    def __init__(self, exp: Experiment) -> None:
        self.exp = exp
        self.env = Clock()
        self.rng = random.Random(exp.seed)
        self.rec = Recorder()
        self.network = Network(self.env)
        spec = exp.model.spec
        self.arrivals = generate(
            exp.workload, exp.seed, Path(exp.base_dir), spec.max_context, spec.name
        )
        if not self.arrivals:
            raise ConfigError("the workload produced no requests (duration too short?)")
        self.requests: dict[int, Request] = {}
        self.finished = 0
        self.failed_at_s: list[float] = []  # when each failed request failed
        # failed requests: id -> reason. A prefill node runs the same request object (for its
        # stamps), and may still be working on a request its decoder gave up on
        self.lost: dict[int, str] = {}
        self.drops: dict[tuple[int, int], int] = {}  # (prefill, decode) -> connections reset
        self.delays: list[tuple[str, float, float, float]] = []  # node, from, until, delay
        self.transfers = TransferModel(exp, self.network, self.rng)
        self.control_latency_s = exp.transfer.control_latency_s
        c = exp.cluster
        self.gpu: SharedGPU | TurnGPU | None = None
        if c.shared_gpu and c.turn_slice_s is not None:
            turns = exp.model.spec.layers + 2  # the layers, and the embedding and the head
            before = exp.cost.profile_host_before
            self.gpu = TurnGPU(self.env, c.turn_slice_s, c.switch_s or 0.0, turns, before)
        elif c.shared_gpu:
            self.gpu = SharedGPU(
                self.env,
                c.decode_share,
                c.prefill_share,
                c.switch_s,
                exp.cost.profile_host_before,
                c.chunk_extra_s,
                c.chunk_extra_shape,
                c.decode_share_shape,
                c.chunk_extra_wide,
                c.decode_share_wide,
            )
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
        self.by_name = {n.name: n for n in self.nodes}
        for fault in exp.faults:
            self._check_fault(fault)
            self.env.start(self._inject(fault))
        self.env.start(self._arrive())

    def _arrive(self) -> Proc:
        for a in self.arrivals:
            if a.arrival_s > self.env._now:
                yield a.arrival_s - self.env._now
            req = Request(a.request_id, a.arrival_s, a.prompt_tokens, a.output_tokens)
            self.requests[req.id] = req
            node = _pick(self.route_main, self.colocated or self.decodes)
            if node is None:
                req.fail(f"no {'colocated' if self.colocated else 'decode'} node is alive")
                self.finished += 1
                self.failed_at_s.append(self.env._now)
                continue
            req.decode_node = node  # (it fails with its node if that dies before it arrives)
            if self.colocated:
                coloc = self.colocated[node]
                self._send(coloc, partial(coloc.role.submit, req))
            elif self.exp.transfer.handoff == "parallel":  # to both at once
                decode, prefill = self.decodes[node], self.route(req)
                pnode = self.prefills[prefill]
                self._send(pnode, partial(pnode.role.submit, req.id, req.prompt_tokens, node))
                self._send(decode, partial(decode.role.submit, req, prefill))
            else:  # decode-first: the decoder hands it to a prefill node
                decode = self.decodes[node]
                self._send(decode, partial(self._submit, decode, req))

    def _send(self, target: Node, submit: Callable[[], None]) -> None:
        """The driver's message of a request to `target`: a hop of the control plane, as one
        between nodes takes (a delay_control fault holds only the nodes' own messages)."""
        self.env.call(self.control_latency_s, partial(target.deliver, submit))

    def _submit(self, decode: DecodeNode, req: Request) -> None:
        decode.role.submit(req, self.route(req))

    def route(self, req: Request) -> int:
        """The prefill node of `req` (a first attempt or a retry), and its transfer plan."""
        prefill = _pick(self.route_prefill, self.prefills)
        self.transfers.choose_plan(req)
        return 0 if prefill is None else prefill  # all dead: the handoff times out

    # ---- the simulated control plane and network -------------------------------------------
    # ---- faults ------------------------------------------------------------------------------
    def _check_fault(self, fault: Fault) -> None:
        if isinstance(fault, NicDown | NicDegrade) and fault.nic >= self.transfers.node.nics:
            raise ConfigError(
                f"faults: nic={fault.nic} of {fault.node}, whose nodes have "
                f"{self.transfers.node.nics} NICs (0 to {self.transfers.node.nics - 1})"
            )

    def _inject(self, fault: Fault) -> Proc:
        """Make `fault` happen at its time (and end after its duration)."""
        yield fault.at_s
        node = self.by_name[fault.node]
        if isinstance(fault, Kill):
            self._kill(node, f"{node.name} died ({fault.label()})")
        elif isinstance(fault, Stop):
            node.stop(fault.for_s)
            if fault.for_s > self.exp.hw.dead_after_s:  # its peers hear nothing: it is dead
                yield self.exp.hw.dead_after_s
                self._declare_dead(node, f"no heartbeat ({fault.label()})")
        elif isinstance(fault, NicDown | NicDegrade):
            key = ("prefill", node.idx, fault.nic)
            rate = 0.0
            if isinstance(fault, NicDegrade):
                rate = min(1.0, fault.gbps * 1e9 / 8 / self.transfers.node.nic.bandwidth_bps)
            self.network.set_rate(key, rate)
            yield fault.for_s
            self.network.set_rate(key, 1.0)
        elif isinstance(fault, DropConnection):
            pair = (node.idx, self.by_name[fault.peer].idx)
            self.drops[pair] = self.drops.get(pair, 0) + 1
        elif isinstance(fault, DelayControl):
            now = self.env._now
            self.delays.append((node.name, now, now + fault.for_s, fault.delay_s))

    def _kill(self, node: Node, reason: str) -> None:
        """`node` dies: the requests it decodes fail now; its peers learn of it when its
        heartbeats are missed (`hw.dead_after_s`)."""
        node.dead = True
        if not isinstance(node, PrefillNode):  # a prefill node's requests are its decoders'
            for req in self.requests.values():
                if req.decode_node == node.idx and req.status not in _ENDED:
                    req.fail(reason)
                    self.lost[req.id] = reason
                    self.finished += 1
                    self.failed_at_s.append(self.env._now)
        self.env.call(self.exp.hw.dead_after_s, lambda: self._declare_dead(node, reason))

    def _declare_dead(self, node: Node, reason: str) -> None:
        """`node`'s peers think it dead (it may be only stopped)."""
        peers: list[DecodeNode] | list[PrefillNode] = []
        if isinstance(node, PrefillNode):
            peers = self.decodes
        elif isinstance(node, DecodeNode):
            peers = self.prefills
        for peer in peers:
            peer.deliver(partial(peer.role.on_peer_dead, node.idx, reason))

    def fault_summary(self) -> dict[str, Any]:
        """The faults injected, each with the requests that failed after it (`faults.attribute`)."""
        if not self.exp.faults:
            return {}
        return {"faults": attribute(self.exp.faults, self.failed_at_s)}

    # ---- running ---------------------------------------------------------------------------
    def run(
        self, progress: Callable[[int, int, float], None] | None = None, slice_s: float = 10.0
    ) -> None:
        """Run to the end; `progress(finished, total, now_s)` is called every `slice_s`.

        The objects that exist before the run (the imports, the experiment) are frozen out of
        the garbage collector meanwhile (`gc.freeze`): the run makes many objects, and each of
        the collector's full passes would otherwise walk all of those old ones again."""
        total = len(self.arrivals)
        gc.freeze()
        try:
            while self.finished < total and self.env.peek() < math.inf:
                self.env.run(until=self.env._now + slice_s)
                if progress:
                    progress(self.finished, total, self.env._now)
        finally:
            gc.unfreeze()
        self.check_end()

    def network_summary(self) -> dict[str, float]:
        """Busiest sending NIC: bytes it sent and the fraction of the run it was busy; on a
        shared GPU, the passes that shared it and the time that cost them."""
        out: dict[str, float] = {}
        if self.gpu is not None:
            out = {"gpu_shared_passes": self.gpu.shared, "gpu_shared_lost_s": self.gpu.lost_s}
        keys = list(self.network.nics)
        if keys:
            out["nic_bytes_max"] = max(self.transfers.nic_bytes.values(), default=0.0)
            out["nic_busy_max"] = max(self.network.utilisation(k) for k in keys)
        return out

    def cost_summary(self, steps: pd.DataFrame) -> dict[str, Any]:
        """With a measured profile as the cost model: the passes it costed, how many of them
        lay beyond the profiled grid (extrapolated, so less to be trusted), and the share of
        the passes' time that is its host time (as a hw run's summary has it), from `steps`."""
        profiles = [n.cost for n in self.nodes if isinstance(n.cost, ProfileCost)]
        if not profiles:
            return {}
        return {
            "profile_passes": sum(c.passes for c in profiles),
            "profile_passes_extrapolated": sum(c.extrapolated for c in profiles),
            "host_share_of_pass_time": host_share(steps),
            "host_share_by_node": {n: host_share(g) for n, g in steps.groupby("node")},
        }

    def check_end(self) -> None:
        """Every request finished or failed with a reason; every page of every living node
        back in its pool."""
        for req_id, reason in self.lost.items():  # a prefill node may have touched it since
            self.requests[req_id].fail(reason)
        for node in self.nodes:
            if node.dead:
                continue
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
