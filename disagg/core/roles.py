"""Prefill, decode and colocated roles: a node's scheduler, messenger and page pool, driven
through one small port. Both backends run these; neither dispatches a messenger command itself.

A role is sans-IO like the messenger it wraps. The backend feeds it events (a request came, a
control message came, the layer counter moved, a post completed, immediates landed, a pass
ended, a timer fired, a peer died) and gives it a port to act through:

    now()                       the clock (seconds since the run's start)
    send(role, node, msg)       a control message to node `node` of role `role`
    post(cmd)                   (prefill) start a PostWrites/PostMetadata; report on_posted
    set_timer(at_s)             (decode) call on_timer at `at_s` or later
    wake()                      there may be a pass to run: ask next_batch()
    route(req)                  (decode) the prefill node for a retry of `req`
    request(id, ...)            (prefill) the request object to run for a request id
    prefilled(req) / ready(req) / finished(req)   what happened to a request, for the records

A backend runs a role's passes itself: `next_batch()` says what the next forward pass computes,
the backend runs it (a modelled duration, or a real forward) and reports its end with
`pass_done(batch, ...)`. A decode or colocated role's `continuation(batch)`, asked while the
pass of `batch` runs, is the pass after it if nothing comes meanwhile; a backend that chains
passes (`hw.latency.chain`) runs that one next, without asking `next_batch()`, and reports it
the same way. Request timestamps are stamped here, from the port's clock, so both
backends stamp the same events. Timeouts, retries, cancels and peer deaths are handled here
too, so a policy or a failure path behaves the same in both backends by construction.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sized
from typing import Any, Protocol, cast

from disagg.core import messenger as m
from disagg.core.kvcache import PagePool
from disagg.core.policies import GroupLike, make_scheduler
from disagg.core.request import Request, Status
from disagg.core.scheduler import Batch, Progress


class TransferLike(Protocol):
    """The protocol's settings (config.TransferConfig)."""

    @property
    def policy(self) -> m.TransferPolicy: ...
    @property
    def handoff(self) -> m.Handoff: ...
    @property
    def timeout_s(self) -> float: ...
    @property
    def max_attempts(self) -> int: ...


class Port(Protocol):
    def now(self) -> float: ...
    def send(self, role: str, node: int, msg: m.Message) -> None: ...
    def wake(self) -> None: ...


class PrefillPolicy(Protocol):
    """What a prefill role asks of its scheduler (PrefillScheduler and its kin)."""

    def __len__(self) -> int: ...
    def add(self, req: Request, target: int) -> None: ...
    def remove(self, req_id: int) -> bool: ...
    def schedule(self) -> Batch: ...
    def complete(self, batch: Batch) -> Progress: ...


class DecodePolicy(Protocol):
    """What a decode role asks of its scheduler (DecodeScheduler and its kin)."""

    max_batch: int
    running: list[Request]

    def __len__(self) -> int: ...
    def add_ready(self, req: Request) -> None: ...
    def schedule(self) -> Batch: ...
    def continuation(self, batch: Batch) -> Batch | None: ...
    def complete(self, batch: Batch, steps: int = 1) -> Progress: ...


class ColocatedPolicy(Protocol):
    """What a colocated role asks of its scheduler (ColocatedScheduler and its kin)."""

    waiting: Sized  # requests not admitted yet

    def __len__(self) -> int: ...
    def add(self, req: Request) -> None: ...
    def schedule(self) -> Batch: ...
    def continuation(self, batch: Batch) -> Batch | None: ...
    def complete(self, batch: Batch, steps: int = 1) -> Progress: ...


class PrefillPort(Port, Protocol):
    def request(self, req_id: int, prompt_tokens: int, prompt: tuple[int, ...]) -> Request:
        """The request object this node runs for `req_id` (a new one, or the backend's own)."""

    def post(self, cmd: m.PostWrites | m.PostMetadata) -> None:
        """Start moving the bytes of `cmd`; call `PrefillRole.on_posted` when they have."""

    def prefilled(self, req: Request) -> None:
        """`req`'s prompt is computed (its prefill start and end are stamped)."""


class ColocatedPort(Port, Protocol):
    def finished(self, req: Request) -> None:
        """`req` left this node: finished (finish time stamped) or failed (with a reason)."""


class DecodePort(ColocatedPort, Protocol):
    def set_timer(self, at_s: float) -> None:
        """Call `DecodeRole.on_timer` once the clock reaches `at_s` (later is fine)."""

    def route(self, req: Request) -> int:
        """The prefill node that a retried `req` goes to."""

    def ready(self, req: Request) -> None:
        """Every planned write of `req` landed (its ready time is stamped)."""


class _Dispatch:
    """The one place a role carries out messenger commands: a handler per command type."""

    handlers: dict[type, Callable[[Any], None]]

    def dispatch(self, cmds: list[m.Command]) -> None:
        for cmd in cmds:
            self.handlers[type(cmd)](cmd)


# ---- prefill -------------------------------------------------------------------------------
class PrefillRole(_Dispatch):
    """A prefill node: accepts requests from decoders (or the router), computes their prompts
    in chunks, and posts each layer's pages as the layer counter passes it."""

    name = "prefill"

    def __init__(
        self,
        node: int,
        port: PrefillPort,
        pool: PagePool,
        group: GroupLike,
        transfer: TransferLike,
        num_layers: int,
    ) -> None:
        self.node, self.port, self.pool = node, port, pool
        self.num_layers = num_layers
        self.messenger = m.PrefillMessenger(node, pool, num_layers, transfer.policy)
        self.scheduler = cast(PrefillPolicy, make_scheduler("prefill", group, pool))
        self.requests: dict[int, Request] = {}  # the ones the messenger knows, as run here
        self.handlers = {
            m.Send: lambda c: self.port.send("decode", c.node, c.msg),
            m.Prefill: self._prefill,
            m.Unschedule: self._unschedule,
            m.PostWrites: self.port.post,
            m.PostMetadata: self.port.post,
        }

    def __len__(self) -> int:
        return len(self.messenger)

    def dispatch(self, cmds: list[m.Command]) -> None:
        for cmd in cmds:
            self.handlers[type(cmd)](cmd)
        messenger = self.messenger  # len(messenger), inlined: this runs after every event
        known_n = len(messenger.waiting) + len(messenger.parked) + len(messenger.outbound)
        if len(self.requests) > known_n:  # some left: prefilled, cancelled, refused
            known = messenger.known()
            for req_id in [r for r in self.requests if r not in known]:
                del self.requests[req_id]

    def _unschedule(self, cmd: m.Unschedule) -> None:
        self.scheduler.remove(cmd.req_id)

    def _prefill(self, cmd: m.Prefill) -> None:
        self.scheduler.add(self.requests[cmd.req_id], cmd.tokens)
        self.port.wake()

    # -- events
    def submit(
        self, req_id: int, prompt_tokens: int, decode_node: int, prompt: tuple[int, ...] = ()
    ) -> None:
        """Parallel handoff: the router sent the request here and to `decode_node` at once."""
        self.requests[req_id] = self.port.request(req_id, prompt_tokens, prompt)
        self.dispatch(self.messenger.submit(req_id, prompt_tokens, decode_node))

    def on_message(self, msg: m.Message) -> None:
        if isinstance(msg, m.PrefillRequest) and not msg.routed:  # the prompt comes with it
            self.requests[msg.req_id] = self.port.request(msg.req_id, msg.prompt_tokens, msg.prompt)
        self.dispatch(self.messenger.on_message(msg))

    def on_peer_dead(self, decode_node: int, reason: str) -> None:
        self.dispatch(self.messenger.on_peer_dead(decode_node, reason))

    def on_posted(self, req_id: int, ok: bool = True, error: str = "") -> None:
        self.dispatch(self.messenger.on_posted(req_id, ok, error))

    # -- passes
    def next_batch(self) -> Batch:
        """The chunks of the next pass (empty: nothing to run); the messenger is told."""
        batch = self.scheduler.schedule()
        if not batch.chunks and not batch.decodes:  # batch.empty, inlined
            return batch
        now = self.port.now()
        for c in batch.chunks:
            if math.isnan(c.req.prefill_start_s):
                c.req.prefill_start_s = now
        # no request leaves here (nor does on_batch give commands): no pruning
        for cmd in self.messenger.on_batch([(c.req.id, c.start, c.tokens) for c in batch.chunks]):
            self.handlers[type(cmd)](cmd)
        return batch

    def on_layers(self, done: int) -> None:
        """The running pass has appended `done` layers to the KV cache (the counter may jump)."""
        for cmd in self.messenger.on_layers(done):  # posts only: no request leaves here
            self.handlers[type(cmd)](cmd)

    def pass_done(self, batch: Batch) -> Progress:
        """The pass of `batch` ended: finished prompts are stamped, the rest is posted."""
        progress = self.scheduler.complete(batch)
        now = self.port.now()
        for r in progress.prefilled:
            r.prefill_end_s = now
            self.port.prefilled(r)
        self.dispatch(self.messenger.on_batch_done())
        return progress


# ---- decode --------------------------------------------------------------------------------
class DecodeRole(_Dispatch):
    """A decode node: reserves pages, hands requests to prefill, counts their immediates,
    decodes the ready ones; transfers that outlive `transfer.timeout_s` are cancelled."""

    name = "decode"

    def __init__(
        self,
        node: int,
        port: DecodePort,
        pool: PagePool,
        group: GroupLike,
        transfer: TransferLike,
        expected: m.ExpectedFn,
        tokens_per_step: float = 1.0,
    ) -> None:
        self.node, self.port, self.pool = node, port, pool
        self.messenger = m.DecodeMessenger(
            node,
            pool,
            expected,
            max_attempts=transfer.max_attempts,
            timeout_s=transfer.timeout_s,
            handoff=transfer.handoff,
        )
        self.scheduler = cast(DecodePolicy, make_scheduler("decode", group, pool, tokens_per_step))
        self.requests: dict[int, Request] = {}
        # when the armed timer fires (inf: none armed); deadlines are handed out in time order
        # (now + timeout), so one timer at the earliest is all it takes
        self.timer_s = math.inf
        self.handlers = {
            m.Send: self._send,
            m.Ready: self._ready,
            m.Failed: lambda c: self._leave(self.requests[c.req_id]),
            m.Retry: self._retry,
        }

    def __len__(self) -> int:
        """Requests this node holds (what a least-loaded router compares, for every node on
        every arrival): those submitted that have not left. Between events each of them is
        in the messenger (waiting, or inbound) or in the scheduler (ready, or running)."""
        return len(self.requests)

    def _send(self, cmd: m.Send) -> None:
        self.port.send("prefill", cmd.node, cmd.msg)
        timeout_s = self.messenger.timeout_s
        if timeout_s < math.inf and isinstance(cmd.msg, m.PrefillRequest):  # else no timer
            self._arm(self.port.now() + timeout_s)

    def _ready(self, cmd: m.Ready) -> None:
        req = self.requests[cmd.req_id]
        req.ready_s = self.port.now()
        self.port.ready(req)
        self.scheduler.add_ready(req)
        if len(self.scheduler.running) < self.scheduler.max_batch:
            self.port.wake()

    def _retry(self, cmd: m.Retry) -> None:
        req = self.requests[cmd.req_id]
        self.submit(req, self.port.route(req))

    def _leave(self, req: Request) -> None:
        del self.requests[req.id]
        self.port.finished(req)

    def _arm(self, at_s: float) -> None:
        if self.timer_s == math.inf and at_s < math.inf:
            self.timer_s = at_s
            self.port.set_timer(at_s)

    # -- events
    def submit(self, req: Request, prefill_node: int) -> None:
        """`req` arrives here (or is retried), its prefill to be done by `prefill_node`."""
        self.requests[req.id] = req
        self.dispatch(self.messenger.submit(req, prefill_node, self.port.now()))

    def on_message(self, msg: m.Message) -> None:
        self.dispatch(self.messenger.on_message(msg))

    def on_immediates(self, slot: int, count: int = 1, rank: int = 0) -> None:
        cmds = self.messenger.on_immediates(slot, count, rank)
        if cmds:  # most landings complete nothing: the common case costs no dispatch
            self.dispatch(cmds)

    def on_immediates_by_rank(self, slot: int, counts: Mapping[int, int]) -> None:
        """`on_immediates(slot, count, rank)` for each rank of `counts`, in its order."""
        cmds = self.messenger.on_immediates_by_rank(slot, counts)
        if cmds:
            self.dispatch(cmds)

    def on_peer_dead(self, prefill_node: int, reason: str) -> None:
        self.dispatch(self.messenger.on_peer_dead(prefill_node, reason))

    def on_timer(self) -> None:
        """Cancel the transfers past their deadline, give up those whose cancel went
        unanswered for as long again; arm the timer for the next deadline."""
        if self.timer_s == math.inf:
            return  # none armed
        due = max(self.port.now(), self.timer_s)  # a port may round the time it fires at
        self.timer_s = math.inf
        self.dispatch(self.messenger.check_timeouts(due))
        self._arm(self.messenger.next_deadline_s())  # a new deadline, or a cancel's lease

    # -- passes
    def next_batch(self) -> Batch:
        return self.scheduler.schedule()

    def continuation(self, batch: Batch) -> Batch | None:
        """The pass after the one of `batch` (which runs) if no request becomes ready first:
        its decodes that it does not finish; None if it may differ."""
        return self.scheduler.continuation(batch)

    def pass_done(
        self, batch: Batch, steps: int = 1, first_token_s: float | None = None
    ) -> Progress:
        """`steps` passes of `batch` ended; the first of them ended at `first_token_s` (default:
        now): that is when a request decoding its first token got it."""
        now = self.port.now()
        progress = self.scheduler.complete(batch, steps)
        first = now if first_token_s is None else first_token_s
        for r in progress.first_token:
            r.first_token_s = first
        for r in progress.finished:
            r.finish_s = now
            self._leave(r)
            cmds = self.messenger.release(r.id, now)
            if cmds:  # handoffs of waiting requests: most releases admit none
                self.dispatch(cmds)
        return progress


# ---- colocated -----------------------------------------------------------------------------
class ColocatedRole:
    """Prefill and decode on one node: chunked prefill mixed into the decode batch."""

    name = "colocated"

    def __init__(
        self,
        node: int,
        port: ColocatedPort,
        pool: PagePool,
        group: GroupLike,
        tokens_per_step: float = 1.0,
        decode_qo: int = 1,
    ) -> None:
        self.node, self.port, self.pool = node, port, pool
        self.scheduler = cast(
            ColocatedPolicy, make_scheduler("colocated", group, pool, tokens_per_step, decode_qo)
        )

    def __len__(self) -> int:
        return len(self.scheduler)

    @property
    def admitting(self) -> bool:
        """Requests wait for room: a run of decode-only passes should end soon."""
        return bool(self.scheduler.waiting)

    def submit(self, req: Request) -> None:
        req.prefill_node = req.decode_node = self.node
        self.scheduler.add(req)
        if req.status is Status.FAILED:  # can never fit here
            self.port.finished(req)
        self.port.wake()

    def next_batch(self) -> Batch:
        batch = self.scheduler.schedule()
        now = self.port.now()
        for c in batch.chunks:
            if math.isnan(c.req.prefill_start_s):
                c.req.prefill_start_s = now
        return batch

    def continuation(self, batch: Batch) -> Batch | None:
        """The pass after the one of `batch` (which runs) if no request comes first: its
        decodes that it does not finish; None if it may differ (prompts to compute)."""
        return self.scheduler.continuation(batch)

    def pass_done(self, batch: Batch, steps: int = 1) -> Progress:
        """`steps` passes of `batch` ended (more than one only for decode-only batches); a
        finished prompt emits its first token with the pass that computed it."""
        progress = self.scheduler.complete(batch, steps)
        now = self.port.now()
        for r in progress.prefilled:
            r.prefill_end_s = r.first_token_s = now
        for r in progress.finished:
            r.finish_s = now
            self.port.finished(r)
        return progress


Role = PrefillRole | DecodeRole | ColocatedRole
