"""The KV messenger: the prefill/decode transfer protocol, both sides, as sans-IO state machines.

Each side takes events (a request arrived, a chunk was scheduled, the layer counter moved, writes
completed, immediates landed, a peer died) and returns commands for its backend (send this
control message, post these writes, this request is ready, this one failed). It never reads a
clock, sleeps, or touches a socket: the simulator and the real backend feed it the same events.

Protocol (DESIGN.md):
1. Decode reserves non-evictable pages for prompt + output and sends a PrefillRequest with its
   page ids and the slot its immediates will carry. A request that can never fit fails with a
   reason; one that cannot fit now waits, in order, for pages to be freed.
2. Prefill allocates source pages for the prompt minus its last token and queues the request.
   Handoff "parallel": the router sends the request to the prefill node too
   (`PrefillMessenger.submit`), which starts it at once if it has the pages free; the KV it
   produces waits on the prefill node until the decoder's PrefillRequest (marked `routed`) says
   where it goes, and what was produced by then is posted on arrival. The decoder's reservation
   leaves TTFT's path. Such an early start never delays a request whose decoder pages are known:
   one that cannot start otherwise evicts early starts (freed, recomputed once their pages come),
   so the pools of several prefill and decode nodes cannot wait on each other in a cycle.
   Before each forward pass the backend reports the chunks scheduled (`on_batch`).
3. As the per-layer counter moves (`on_layers`), each chunk's pages of the new layers become
   PostWrites (policy "layerwise"); policy "whole" posts everything after the last chunk.
4. After the last chunk: one metadata write (hidden state / logits of the token before the
   last prompt token). The decoder runs the last prompt token as its first decode step.
5. A write unit (page, layer, source rank, destination rank) carries one immediate on its last
   write. A page cut by a chunk boundary is sent again, whole, by the chunk that completes it;
   only that send carries the immediate, so the count does not depend on chunking. Decode
   counts immediates to the planned number; prefill frees its pages when its posts complete.
6. Failures (a failed post, a cancel after a timeout, a dead peer) end with every page returned
   and the request retried or failed with its reason.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, NamedTuple

from disagg.core.kvcache import PagePool, pages_for
from disagg.core.messages import (
    CancelTransfer,
    Message,
    PrefillRejected,
    PrefillRequest,
    TransferAborted,
)
from disagg.core.request import Request, Status
from disagg.errors import ProtocolError

TransferPolicy = Literal["layerwise", "whole"]
Handoff = Literal["decode-first", "parallel"]


def timeout_reason(timeout_s: float) -> str:
    """Why a transfer was cancelled by its decoder (both backends give this text)."""
    return f"transfer timed out after {timeout_s:g} s"


# Commands are values: nothing changes one once it is made. They are not frozen dataclasses
# only because a few are made per request, and a frozen __init__ costs several times as much
# (a setattr call per field). The control-plane messages are in disagg.core.messages.


# ---- commands to the local backend -------------------------------------------------------
@dataclass(slots=True)
class Send:
    node: int
    msg: Message


@dataclass(slots=True)
class Prefill:
    """Queue `req_id` with the local batch scheduler to prefill its first `tokens` tokens."""

    req_id: int
    tokens: int


@dataclass(slots=True)
class Unschedule:
    req_id: int


@dataclass(slots=True)
class PostWrites:
    """Write pages `src_pages[i] -> dst_pages[i]` for `layers`; `imm[i]` marks the pages whose
    units carry the immediate `slot` (the transfer plan expands this into writes)."""

    req_id: int
    decode_node: int
    slot: int
    layers: range
    src_pages: tuple[int, ...]
    dst_pages: tuple[int, ...]
    imm: tuple[bool, ...]
    dst_rank: int = 0
    earlier: bool = False  # layers produced by earlier passes (a catch-up post): start at once

    @property
    def imm_pages(self) -> int:
        return self.imm.count(True)


@dataclass(slots=True)
class PostMetadata:
    req_id: int
    decode_node: int
    slot: int
    dst_rank: int = 0


@dataclass(slots=True)
class Ready:
    req_id: int


@dataclass(slots=True)
class Failed:
    req_id: int
    reason: str


@dataclass(slots=True)
class Retry:
    """Decode side: route `req_id` to a prefill node again and `submit` it."""

    req_id: int
    reason: str


Command = Send | Prefill | Unschedule | PostWrites | PostMetadata | Ready | Failed | Retry

# expected immediates per destination rank for (request, prefill node, pages transferred)
ExpectedFn = Callable[[Request, int, int], dict[int, int]]


# ---- decode side ---------------------------------------------------------------------------
@dataclass(slots=True)
class _Inbound:
    req: Request
    prefill_node: int
    slot: int
    expected: dict[int, int]
    received: dict[int, int] = field(default_factory=dict)
    deadline_s: float = math.inf
    cancelling: bool = False
    # sum(expected) - sum(received): the counts can only match when it is 0
    left: int = field(init=False)

    def __post_init__(self) -> None:
        self.left = sum(self.expected.values())
        if self.received:
            self.left -= sum(self.received.values())


class DecodeMessenger:
    """Decode side: reserve, hand off to prefill, count immediates, release."""

    def __init__(
        self,
        node: int,
        pool: PagePool,
        expected_imms: ExpectedFn,
        *,
        max_attempts: int = 3,
        timeout_s: float = math.inf,
        handoff: Handoff = "decode-first",
    ) -> None:
        if handoff not in ("decode-first", "parallel"):
            raise ProtocolError(f"unknown handoff {handoff!r}: decode-first or parallel")
        self.node = node
        self.handoff = handoff
        self.pool = pool
        self.expected_imms = expected_imms
        self.max_attempts = max_attempts
        self.timeout_s = timeout_s
        self.waiting: deque[tuple[Request, int]] = deque()
        self.inbound: dict[int, _Inbound] = {}  # by slot
        self._slot_of: dict[int, int] = {}  # req_id -> slot
        # freed slots are reused oldest first: a slot's metadata row stays untouched for as long
        # as possible after its request is ready (the decoder may still be reading it)
        self._free_slots: deque[int] = deque()
        self._next_slot = 0
        self.stale_immediates = 0  # immediates of no transfer in flight (given up, or spoofed)
        self.excess_immediates = 0  # beyond a transfer's planned count (dropped)
        self.late_answers = 0
        self.quarantined_slots = 0

    def __len__(self) -> int:
        return len(self.waiting) + len(self.inbound)

    def submit(self, req: Request, prefill_node: int, now_s: float = 0.0) -> list[Command]:
        """A request arrives (or is retried) at this decode node, routed to `prefill_node`
        (under parallel handoff, a first submission reached `prefill_node` at the same time)."""
        need = req.prompt_tokens + req.output_tokens
        if not self.pool.fits_ever(need):
            req.fail(
                f"needs {self.pool.pages_for(need)} KV pages on decode node {self.node}, "
                f"whose pool holds {self.pool.num_pages}"
            )
            cmds: list[Command] = [Failed(req.id, req.fail_reason)]
            if self._routed(req, first=req.attempts == 0):  # stop the prefill already started
                cancel = CancelTransfer(req.id, req.fail_reason, False, self.node)
                cmds.append(Send(prefill_node, cancel))
            return cmds
        req.attempts += 1
        req.status = Status.QUEUED
        if self.waiting or not self.pool.can_allocate(need):
            self.waiting.append((req, prefill_node))
            return []
        return self._handoff(req, prefill_node, now_s)

    def _handoff(self, req: Request, prefill_node: int, now_s: float) -> list[Command]:
        dst = self.pool.reserve(req.id, req.prompt_tokens + req.output_tokens)
        req.status, req.decode_node, req.prefill_node = Status.RESERVED, self.node, prefill_node
        kv_pages = pages_for(req.prompt_tokens - 1, self.pool.page_size)
        if kv_pages == 0:  # one-token prompt: nothing to prefill, decode runs it directly
            req.status = Status.READY
            return [Ready(req.id)]
        slot = self._take_slot()
        expected = self.expected_imms(req, prefill_node, kv_pages)
        self.inbound[slot] = _Inbound(
            req, prefill_node, slot, expected, deadline_s=now_s + self.timeout_s
        )
        self._slot_of[req.id] = slot
        routed = self._routed(req, first=req.attempts == 1)
        msg = PrefillRequest(
            req.id,
            slot,
            self.node,
            req.prompt_tokens,
            tuple(dst[:kv_pages]),
            0,
            () if routed else req.prompt,  # a routed prefill node has the prompt already
            routed,
            req.attempts,
        )
        return [Send(prefill_node, msg)]

    def _routed(self, req: Request, first: bool) -> bool:
        """Whether the prefill node got this request from the router too (parallel handoff,
        first attempt, and a prompt with something to prefill); retries go decode-first."""
        return self.handoff == "parallel" and first and req.prompt_tokens > 1

    def _take_slot(self) -> int:
        if self._free_slots:
            return self._free_slots.popleft()
        self._next_slot += 1
        return self._next_slot - 1

    def on_immediates(self, slot: int, count: int = 1, rank: int = 0) -> list[Command]:
        """`count` writes carrying immediate `slot` landed on destination `rank`."""
        inb = self.inbound.get(slot)
        if inb is None:
            self.stale_immediates += count
            return []
        got = inb.received.get(rank, 0) + count
        if got > inb.expected.get(rank, 0):  # not this transfer's: counted, never a crash
            self.excess_immediates += count
            return []
        inb.received[rank] = got
        inb.left -= count
        if inb.left or inb.received != inb.expected:
            return []
        self._close(slot)
        inb.req.status = Status.READY
        return [Ready(inb.req.id)]

    def on_immediates_by_rank(self, slot: int, counts: Mapping[int, int]) -> list[Command]:
        """`on_immediates(slot, count, rank)` for each (rank, count) of `counts`, in order, in
        one call; the commands of them all (after the one that completes the transfer, the
        rest are stale)."""
        inb = self.inbound.get(slot)
        if inb is None:  # none in flight
            self.stale_immediates += sum(counts.values())
            return []
        received, expected, left = inb.received, inb.expected, inb.left
        ranks = iter(counts.items())
        for rank, count in ranks:
            got = received.get(rank, 0) + count
            if got > expected.get(rank, 0):
                self.excess_immediates += count
                continue
            received[rank] = got
            left -= count
            if left or received != expected:
                continue
            inb.left = 0
            self._close(slot)
            inb.req.status = Status.READY
            self.stale_immediates += sum(count for _, count in ranks)  # after the close
            return [Ready(inb.req.id)]
        inb.left = left
        return []

    def _close(self, slot: int, reuse: bool = True) -> _Inbound:
        inb = self.inbound.pop(slot)
        del self._slot_of[inb.req.id]
        if reuse:
            self._free_slots.append(slot)
        else:
            self.quarantined_slots += 1
        return inb

    def on_message(self, msg: Message) -> list[Command]:
        if isinstance(msg, PrefillRejected):
            return self._give_up(msg.req_id, msg.reason, retry=False)
        if isinstance(msg, TransferAborted):
            return self._give_up(msg.req_id, msg.reason, retry=True)
        raise ProtocolError(f"decode node {self.node} cannot handle {type(msg).__name__}")

    def _give_up(
        self, req_id: int, reason: str, retry: bool, quarantine: bool = False
    ) -> list[Command]:
        """Prefill will write no more for `req_id`: free its pages, then retry or fail it.
        `quarantine`: the prefill never confirmed it stopped, so the request's slot is never
        used again (a late write's immediate must not count for another request)."""
        slot = self._slot_of.get(req_id)
        if slot is None:  # an answer to a cancel that came too late: the request's last writes
            self.late_answers += 1  # landed first (it is ready), or it was given up already
            return []
        req = self._close(slot, reuse=not quarantine).req
        self.pool.free(req.id)
        cmds: list[Command]
        if retry and req.attempts < self.max_attempts:
            req.status = Status.QUEUED
            cmds = [Retry(req.id, reason)]
        else:
            req.fail(reason if not retry else f"{reason} (after {req.attempts} attempts)")
            cmds = [Failed(req.id, req.fail_reason)]
        return cmds + self._admit_waiting(now_s=0.0)

    def on_peer_dead(self, prefill_node: int, reason: str) -> list[Command]:
        """A prefill node is gone: it will write nothing more, so its requests' pages are free."""
        ids = [i.req.id for i in self.inbound.values() if i.prefill_node == prefill_node]
        cmds: list[Command] = []
        for req_id in ids:  # a node thought dead may be alive and still writing: quarantine
            why = f"prefill node {prefill_node} died: {reason}"
            cmds += self._give_up(req_id, why, retry=True, quarantine=True)
        return cmds

    def check_timeouts(self, now_s: float) -> list[Command]:
        """Ask prefill to stop transfers that outlived `timeout_s`; pages wait for its answer,
        for `timeout_s` more: a transfer whose cancel is not answered by then is given up here
        (its pages lease ends), as if the prefill node had died."""
        cmds: list[Command] = []
        for inb in list(self.inbound.values()):
            if not inb.cancelling and now_s >= inb.deadline_s:
                inb.cancelling = True
                inb.deadline_s += self.timeout_s  # the lease: how long the answer may take
                reason = timeout_reason(self.timeout_s)
                cmds.append(
                    Send(inb.prefill_node, CancelTransfer(inb.req.id, reason, True, self.node))
                )
            elif inb.cancelling and now_s >= inb.deadline_s:
                reason = (
                    f"{timeout_reason(self.timeout_s)}; prefill node {inb.prefill_node} did not "
                    f"answer the cancel within {self.timeout_s:g} s"
                )
                cmds += self._give_up(inb.req.id, reason, retry=True, quarantine=True)
        return cmds

    def next_deadline_s(self) -> float:
        """When `check_timeouts` next has something to do (inf: nothing inbound)."""
        return min((i.deadline_s for i in self.inbound.values()), default=math.inf)

    def release(self, req_id: int, now_s: float = 0.0) -> list[Command]:
        """A request finished decoding (or was dropped): free its pages, admit waiting ones."""
        self.pool.free(req_id)
        return self._admit_waiting(now_s) if self.waiting else []

    def _admit_waiting(self, now_s: float) -> list[Command]:
        cmds: list[Command] = []
        while self.waiting:
            req, node = self.waiting[0]
            if not self.pool.can_allocate(req.prompt_tokens + req.output_tokens):
                break
            self.waiting.popleft()
            cmds += self._handoff(req, node, now_s)
        return cmds


GONE_KEPT = 4096  # requests cancelled or refused before their other half came (parallel handoff)


# ---- prefill side --------------------------------------------------------------------------
@dataclass(slots=True)
class _Queued:
    """A request this node accepted: from the decoder (`msg`), or from the router first
    (parallel handoff: `msg` is None until the decoder's PrefillRequest arrives)."""

    req_id: int
    prompt_tokens: int
    decode_node: int
    msg: PrefillRequest | None = None


@dataclass(slots=True)
class _Outbound:
    job: _Queued
    src_pages: list[int]
    target: int  # prompt tokens this node prefills (all but the last)
    done: int = 0  # prompt tokens whose KV every layer holds (finished chunks)
    pending_posts: int = 0
    prefilled: bool = False
    abort_reason: str = ""
    notify: bool = True  # tell decode when the abort is over (not if decode is dead)

    @property
    def msg(self) -> PrefillRequest | None:
        return self.job.msg


class _ScheduledChunk(NamedTuple):  # what `on_batch` is given, as a record
    req_id: int
    start: int
    tokens: int


class PrefillMessenger:
    """Prefill side: accept requests, turn layers into writes, free pages when writes complete."""

    def __init__(
        self,
        node: int,
        pool: PagePool,
        num_layers: int,
        policy: TransferPolicy = "layerwise",
        metadata: bool = True,
    ) -> None:
        if policy not in ("layerwise", "whole"):
            raise ProtocolError(f"unknown transfer policy {policy!r}: layerwise or whole")
        self.node = node
        self.pool = pool
        self.num_layers = num_layers
        self.policy = policy
        self.metadata = metadata
        self.outbound: dict[int, _Outbound] = {}
        self.waiting: deque[_Queued] = deque()  # FIFO, decoder pages known (no early starts)
        self.parked: dict[int, _Queued] = {}  # routed, not started: wait for the decoder's pages
        self.evicted = 0  # early starts dropped to make room (recomputed later)
        self._batch: list[_ScheduledChunk] = []
        self._layers_sent = 0
        # parallel handoff, the two messages racing: a routed PrefillRequest that came before
        # the router's submission, and requests cancelled or refused before their other half
        self._early: dict[int, PrefillRequest] = {}
        self._gone: OrderedDict[int, str] = OrderedDict()
        self._superseded: dict[int, PrefillRequest] = {}  # retries waiting for the old to end

    def __len__(self) -> int:
        return len(self.waiting) + len(self.parked) + len(self.outbound)

    def known(self) -> set[int]:
        """The requests waiting, parked, prefilling or transferring here (len(self) of them)."""
        return {*self.outbound, *self.parked, *(q.req_id for q in self.waiting)}

    def submit(self, req_id: int, prompt_tokens: int, decode_node: int) -> list[Command]:
        """Parallel handoff: the router sent the request here and to `decode_node` at once.
        Prefill starts now; the decoder's PrefillRequest will say where the KV goes."""
        if req_id in self._gone:  # the decoder cancelled it before it got here
            del self._gone[req_id]
            return []
        if prompt_tokens <= 1:  # nothing to prefill: the decoder runs the one token
            return []
        return self._accept(
            _Queued(req_id, prompt_tokens, decode_node, self._early.pop(req_id, None))
        )

    def on_message(self, msg: Message) -> list[Command]:
        if isinstance(msg, PrefillRequest):
            return self._on_request(msg)
        if isinstance(msg, CancelTransfer):
            # the decoder cancels its latest attempt: a retry waiting for an older one to end
            # (sent before this cancel, so delivered before it) is the one cancelled
            self._superseded.pop(msg.req_id, None)
            if msg.req_id not in self.outbound:
                return self._drop_waiting(msg.req_id, msg.reason, msg.reply, msg.decode_node)
            return self._abort(msg.req_id, msg.reason, msg.reply)
        raise ProtocolError(f"prefill node {self.node} cannot handle {type(msg).__name__}")

    def _on_request(self, msg: PrefillRequest) -> list[Command]:
        if msg.routed and msg.req_id in self._gone:  # refused when the router's submission came
            reason = self._gone.pop(msg.req_id)
            return [Send(msg.decode_node, PrefillRejected(msg.req_id, reason))]
        if not msg.routed:
            self._gone.pop(msg.req_id, None)  # a retry: any old cancel is over
        parked = self.parked.pop(msg.req_id, None)
        if parked is not None:  # not started (or evicted): now it waits in order
            parked.msg = msg
            return self._accept(parked)
        out = self.outbound.get(msg.req_id)
        if out is None:
            if msg.routed:  # the router's submission is still on its way
                self._early[msg.req_id] = msg
                return []
            return self._accept(_Queued(msg.req_id, msg.prompt_tokens, msg.decode_node, msg))
        if out.msg is not None:  # a retry of a request still (or again) running here: the
            # decoder gave this transfer up (it thought this node dead); end it, then run anew
            if out.msg.attempt >= msg.attempt:
                return []  # the same handoff again, or an older one
            self._superseded[msg.req_id] = msg
            return self._abort(msg.req_id, "superseded by the decoder's retry", notify=False)
        out.job.msg = msg
        return [] if out.abort_reason else self._catch_up(out)

    def _catch_up(self, out: _Outbound) -> list[Command]:
        """The decoder's pages arrived for a request already (partly) prefilled: post what was
        produced so far (layer-wise: finished chunks, and the running chunk's layers)."""
        cmds: list[Command] = []
        req_id = out.job.req_id
        if out.done and (self.policy == "layerwise" or out.prefilled):
            everything = range(self.num_layers)
            cmds.append(self._post(_ScheduledChunk(req_id, 0, out.done), everything, True))
        running = next((c for c in self._batch if c.req_id == req_id), None)
        if running and self.policy == "layerwise" and self._layers_sent:
            cmds.append(self._post(running, range(self._layers_sent)))
        if out.prefilled and self.metadata:
            cmds.append(self._post_metadata(out))
        return cmds

    def _accept(self, job: _Queued) -> list[Command]:
        tokens = job.prompt_tokens - 1
        if not self.pool.fits_ever(tokens):
            reason = (
                f"prompt needs {self.pool.pages_for(tokens)} KV pages on prefill node "
                f"{self.node}, whose pool holds {self.pool.num_pages}"
            )
            if job.msg is None:  # answered when the decoder's PrefillRequest comes
                self._bury(job.req_id, reason)
                return []
            return [Send(job.decode_node, PrefillRejected(job.req_id, reason))]
        if job.msg is None:  # an early start, only into free room: never ahead of others
            if self.waiting or not self.pool.can_allocate(tokens):
                self.parked[job.req_id] = job
                return []
            return self._start(job)
        self.waiting.append(job)
        return self._admit()

    def _start(self, job: _Queued) -> list[Command]:
        tokens = job.prompt_tokens - 1
        src = self.pool.allocate(job.req_id, tokens)
        self.outbound[job.req_id] = _Outbound(job, src, tokens)
        return [Prefill(job.req_id, tokens)]

    def _bury(self, req_id: int, reason: str) -> None:
        """Remember why `req_id` ended here, for its other half still on its way. Only races
        need this (the two halves arrive close together), and cancels of requests long
        finished are also remembered: keep the newest GONE_KEPT."""
        self._gone[req_id] = reason
        if len(self._gone) > GONE_KEPT:
            self._gone.popitem(last=False)

    def _drop_waiting(
        self, req_id: int, reason: str, reply: bool = True, sender: int = -1
    ) -> list[Command]:
        """A cancel for a request not started here: drop it, and answer the decoder if it had
        handed the request off (it waits for the answer to free its pages), also when this
        node does not know the request (finished, or forgotten when the decoder was thought
        dead): the decoder ignores an answer that comes after its request is ready."""
        queued = next((q for q in self.waiting if q.req_id == req_id), None)
        queued = self.parked.pop(req_id, queued)
        early = self._early.pop(req_id, None)
        node: int | None = None
        if queued is not None:  # (an early start parked before the decoder's pages came
            # knows its decoder too: the router named it)
            self.waiting = deque(q for q in self.waiting if q.req_id != req_id)
            node = queued.decode_node
        else:  # finished and freed, forgotten, or not come yet
            node = sender if early is None else early.decode_node
            self._bury(req_id, reason)  # a router's submission still to come is dropped
        if node is None or node < 0 or not reply:
            return []
        return [Send(node, TransferAborted(req_id, reason))]

    def on_batch(self, chunks: Sequence[tuple[int, int, int]]) -> list[Command]:
        """Before a forward pass: the chunks (req_id, start, tokens) it computes."""
        for req_id, _, _ in chunks:
            if req_id not in self.outbound:
                raise ProtocolError(f"prefill node {self.node}: chunk of unknown request {req_id}")
        self._batch = [_ScheduledChunk._make(c) for c in chunks]
        self._layers_sent = 0
        return []

    def on_layers(self, done: int) -> list[Command]:
        """The layer counter reached `done` (it may jump); post the layers not yet posted."""
        if done > self.num_layers:
            raise ProtocolError(f"layer counter {done} > {self.num_layers} layers")
        if done <= self._layers_sent:
            return []
        layers = range(self._layers_sent, done)
        self._layers_sent = done
        if self.policy != "layerwise":
            return []
        return [self._post(c, layers) for c in self._batch if self._live(c.req_id)]

    def _live(self, req_id: int) -> bool:
        """Writes may go out: not aborted, and the decoder's pages are known."""
        out = self.outbound.get(req_id)
        return out is not None and not out.abort_reason and out.job.msg is not None

    def _post(self, c: _ScheduledChunk, layers: range, earlier: bool = False) -> PostWrites:
        out = self.outbound[c.req_id]
        msg = out.job.msg
        assert msg is not None
        ps = self.pool.page_size
        end = c.start + c.tokens
        first, last = c.start // ps, (end - 1) // ps
        # page i carries the immediate if the chunk completes it, or ends the prompt
        n = last + 1 - first
        whole = n if end == out.target else min(n, max(0, end // ps - first))
        imm = (True,) * whole + (False,) * (n - whole)
        out.pending_posts += 1
        return PostWrites(
            c.req_id,
            msg.decode_node,
            msg.slot,
            layers,
            tuple(out.src_pages[first : last + 1]),
            msg.dst_pages[first : last + 1],
            imm,
            msg.dst_rank,
            earlier,
        )

    def _post_metadata(self, out: _Outbound) -> PostMetadata:
        msg = out.job.msg
        assert msg is not None
        out.pending_posts += 1
        return PostMetadata(out.job.req_id, msg.decode_node, msg.slot, msg.dst_rank)

    def on_batch_done(self) -> list[Command]:
        """The forward pass finished: post what is left, and the metadata of finished prompts."""
        cmds = self.on_layers(self.num_layers)
        for c in self._batch:
            out = self.outbound.get(c.req_id)
            if out is None or out.abort_reason:
                continue
            out.done = c.start + c.tokens
            if out.done < out.target:
                continue
            out.prefilled = True
            if out.msg is None:  # the decoder's pages are not known yet: posted on arrival
                continue
            if self.policy == "whole":
                cmds.append(
                    self._post(_ScheduledChunk(c.req_id, 0, out.target), range(self.num_layers))
                )
            if self.metadata:
                cmds.append(self._post_metadata(out))
        self._batch = []
        return cmds + self._finish_ready()

    def on_posted(self, req_id: int, ok: bool = True, error: str = "") -> list[Command]:
        """One PostWrites/PostMetadata of `req_id` completed (or failed with `error`)."""
        out = self.outbound.get(req_id)
        if out is None or out.pending_posts == 0:
            raise ProtocolError(f"prefill node {self.node}: no posts pending for {req_id}")
        out.pending_posts -= 1
        if not ok and not out.abort_reason:
            reason = f"transfer to decode node {out.job.decode_node} failed: {error}"
            return self._abort(req_id, reason) + self._finish_ready()
        return self._finish_ready()

    def _abort(self, req_id: int, reason: str, notify: bool = True) -> list[Command]:
        out = self.outbound[req_id]
        out.abort_reason, out.notify = out.abort_reason or reason, notify
        cmds: list[Command] = [] if out.prefilled else [Unschedule(req_id)]
        out.prefilled = True  # no more chunks will run for it
        return cmds + self._finish_ready()

    def on_peer_dead(self, decode_node: int, reason: str) -> list[Command]:
        """A decode node is gone: stop its transfers; nobody to tell."""
        self.waiting = deque(q for q in self.waiting if q.decode_node != decode_node)
        self.parked = {i: q for i, q in self.parked.items() if q.decode_node != decode_node}
        self._early = {i: m for i, m in self._early.items() if m.decode_node != decode_node}
        cmds: list[Command] = []
        for req_id, out in list(self.outbound.items()):
            if out.job.decode_node == decode_node and req_id in self.outbound:
                cmds += self._abort(req_id, f"decode node {decode_node} died: {reason}", False)
        return cmds

    def _finish_ready(self) -> list[Command]:
        """Free pages of requests whose prefill and posts are all done (and whose KV has gone
        out, or never will); admit waiting ones."""
        cmds: list[Command] = []
        in_batch: set[int] | None = None  # built only when a request is done
        for req_id, out in list(self.outbound.items()):
            if not out.prefilled or out.pending_posts:
                continue
            if out.job.msg is None and not out.abort_reason:  # its KV has not gone out yet
                continue
            if in_batch is None:
                in_batch = {c.req_id for c in self._batch}
            if req_id not in in_batch:
                del self.outbound[req_id]
                self.pool.free(req_id)
                if out.abort_reason and out.notify:  # to the job's decoder, whose request
                    # may never have come (an early start: the router named the decoder)
                    cmds.append(
                        Send(out.job.decode_node, TransferAborted(req_id, out.abort_reason))
                    )
                retry = self._superseded.pop(req_id, None)
                if retry is not None:
                    q = _Queued(retry.req_id, retry.prompt_tokens, retry.decode_node, retry)
                    self.waiting.append(q)
        return cmds + self._admit() if self.waiting else cmds

    def _admit(self) -> list[Command]:
        """Start waiting requests in order, evicting early starts to make room for them."""
        cmds: list[Command] = []
        while self.waiting:
            need = self.waiting[0].prompt_tokens - 1
            if not self.pool.can_allocate(need):
                cmds += self._evict_early(need)
                if not self.pool.can_allocate(need):
                    break
            cmds += self._start(self.waiting.popleft())
        return cmds

    def _evict_early(self, need: int) -> list[Command]:
        """Free early starts (no decoder pages yet, not in the running pass), newest first,
        until `need` tokens fit; each is parked, to be recomputed when its pages come."""
        cmds: list[Command] = []
        in_batch = {c.req_id for c in self._batch}
        for req_id in reversed(list(self.outbound)):
            if self.pool.can_allocate(need):
                break
            out = self.outbound[req_id]
            if out.msg is not None or out.abort_reason or req_id in in_batch:
                continue
            del self.outbound[req_id]
            self.pool.free(req_id)
            self.parked[req_id] = out.job
            self.evicted += 1
            if not out.prefilled:
                cmds.append(Unschedule(req_id))
        return cmds
