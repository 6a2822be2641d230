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

import collections
import math
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from disagg.core.kvcache import PagePool, pages_for
from disagg.core.request import Request, Status
from disagg.errors import ProtocolError

TransferPolicy = Literal["layerwise", "whole"]


# ---- control-plane messages (cross node boundaries: plain data) ---------------------------
@dataclass(frozen=True)
class PrefillRequest:
    req_id: int
    slot: int  # the immediate value of every write for this request
    decode_node: int
    prompt_tokens: int
    dst_pages: tuple[int, ...]
    dst_rank: int = 0  # decode DP rank holding the pages (0 under TP)
    prompt: tuple[int, ...] = ()  # the prompt's token ids (a simulator sends none)


@dataclass(frozen=True)
class PrefillRejected:
    req_id: int
    reason: str


@dataclass(frozen=True)
class CancelTransfer:
    req_id: int
    reason: str


@dataclass(frozen=True)
class TransferAborted:
    """Prefill stopped writing for a request: decode may reuse its pages."""

    req_id: int
    reason: str


Message = PrefillRequest | PrefillRejected | CancelTransfer | TransferAborted


# ---- commands to the local backend -------------------------------------------------------
@dataclass(frozen=True)
class Send:
    node: int
    msg: Message


@dataclass(frozen=True)
class Prefill:
    """Queue `req_id` with the local batch scheduler to prefill its first `tokens` tokens."""

    req_id: int
    tokens: int


@dataclass(frozen=True)
class Unschedule:
    req_id: int


@dataclass(frozen=True)
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

    @property
    def imm_pages(self) -> int:
        return sum(self.imm)


@dataclass(frozen=True)
class PostMetadata:
    req_id: int
    decode_node: int
    slot: int
    dst_rank: int = 0


@dataclass(frozen=True)
class Ready:
    req_id: int


@dataclass(frozen=True)
class Failed:
    req_id: int
    reason: str


@dataclass(frozen=True)
class Retry:
    """Decode side: route `req_id` to a prefill node again and `submit` it."""

    req_id: int
    reason: str


Command = Send | Prefill | Unschedule | PostWrites | PostMetadata | Ready | Failed | Retry

# expected immediates per destination rank for (request, prefill node, pages transferred)
ExpectedFn = Callable[[Request, int, int], dict[int, int]]


# ---- decode side ---------------------------------------------------------------------------
@dataclass
class _Inbound:
    req: Request
    prefill_node: int
    slot: int
    expected: dict[int, int]
    received: dict[int, int] = field(default_factory=dict)
    deadline_s: float = math.inf
    cancelling: bool = False


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
    ) -> None:
        self.node = node
        self.pool = pool
        self.expected_imms = expected_imms
        self.max_attempts = max_attempts
        self.timeout_s = timeout_s
        self.waiting: deque[tuple[Request, int]] = deque()
        self.inbound: dict[int, _Inbound] = {}  # by slot
        self._slot_of: dict[int, int] = {}  # req_id -> slot
        # freed slots are reused oldest first: a slot's metadata row stays untouched for as long
        # as possible after its request is ready (the decoder may still be reading it)
        self._free_slots: collections.deque[int] = collections.deque()
        self._next_slot = 0
        self.stale_immediates = 0

    def __len__(self) -> int:
        return len(self.waiting) + len(self.inbound)

    def submit(self, req: Request, prefill_node: int, now_s: float = 0.0) -> list[Command]:
        """A request arrives (or is retried) at this decode node, routed to `prefill_node`."""
        need = req.prompt_tokens + req.output_tokens
        if not self.pool.fits_ever(need):
            req.fail(
                f"needs {self.pool.pages_for(need)} KV pages on decode node {self.node}, "
                f"whose pool holds {self.pool.num_pages}"
            )
            return [Failed(req.id, req.fail_reason)]
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
        msg = PrefillRequest(
            req.id, slot, self.node, req.prompt_tokens, tuple(dst[:kv_pages]), 0, req.prompt
        )
        return [Send(prefill_node, msg)]

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
        if got > inb.expected.get(rank, 0):
            raise ProtocolError(
                f"request {inb.req.id}: rank {rank} received {got} immediates, "
                f"expected {inb.expected.get(rank, 0)}"
            )
        inb.received[rank] = got
        if inb.received != inb.expected:
            return []
        self._close(slot)
        inb.req.status = Status.READY
        return [Ready(inb.req.id)]

    def _close(self, slot: int) -> _Inbound:
        inb = self.inbound.pop(slot)
        del self._slot_of[inb.req.id]
        self._free_slots.append(slot)
        return inb

    def on_message(self, msg: Message) -> list[Command]:
        if isinstance(msg, PrefillRejected):
            return self._give_up(msg.req_id, msg.reason, retry=False)
        if isinstance(msg, TransferAborted):
            return self._give_up(msg.req_id, msg.reason, retry=True)
        raise ProtocolError(f"decode node {self.node} cannot handle {type(msg).__name__}")

    def _give_up(self, req_id: int, reason: str, retry: bool) -> list[Command]:
        """Prefill will write no more for `req_id`: free its pages, then retry or fail it."""
        slot = self._slot_of.get(req_id)
        if slot is None:
            raise ProtocolError(f"decode node {self.node}: no transfer in flight for {req_id}")
        req = self._close(slot).req
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
        for req_id in ids:
            cmds += self._give_up(req_id, f"prefill node {prefill_node} died: {reason}", True)
        return cmds

    def check_timeouts(self, now_s: float) -> list[Command]:
        """Ask prefill to stop transfers that outlived `timeout_s`; pages wait for its answer."""
        cmds: list[Command] = []
        for inb in self.inbound.values():
            if not inb.cancelling and now_s >= inb.deadline_s:
                inb.cancelling = True
                reason = f"transfer timed out after {self.timeout_s:g} s"
                cmds.append(Send(inb.prefill_node, CancelTransfer(inb.req.id, reason)))
        return cmds

    def release(self, req_id: int, now_s: float = 0.0) -> list[Command]:
        """A request finished decoding (or was dropped): free its pages, admit waiting ones."""
        self.pool.free(req_id)
        return self._admit_waiting(now_s)

    def _admit_waiting(self, now_s: float) -> list[Command]:
        cmds: list[Command] = []
        while self.waiting:
            req, node = self.waiting[0]
            if not self.pool.can_allocate(req.prompt_tokens + req.output_tokens):
                break
            self.waiting.popleft()
            cmds += self._handoff(req, node, now_s)
        return cmds


# ---- prefill side --------------------------------------------------------------------------
@dataclass
class _Outbound:
    msg: PrefillRequest
    src_pages: list[int]
    target: int  # prompt tokens this node prefills (all but the last)
    pending_posts: int = 0
    prefilled: bool = False
    abort_reason: str = ""
    notify: bool = True  # tell decode when the abort is over (not if decode is dead)


@dataclass(frozen=True)
class _ScheduledChunk:
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
        self.waiting: deque[PrefillRequest] = deque()
        self._batch: list[_ScheduledChunk] = []
        self._layers_sent = 0

    def __len__(self) -> int:
        return len(self.waiting) + len(self.outbound)

    def on_message(self, msg: Message) -> list[Command]:
        if isinstance(msg, PrefillRequest):
            return self._accept(msg)
        if isinstance(msg, CancelTransfer):
            if msg.req_id not in self.outbound:
                return self._drop_waiting(msg.req_id, msg.reason)
            return self._abort(msg.req_id, msg.reason)
        raise ProtocolError(f"prefill node {self.node} cannot handle {type(msg).__name__}")

    def _accept(self, msg: PrefillRequest) -> list[Command]:
        tokens = msg.prompt_tokens - 1
        if not self.pool.fits_ever(tokens):
            reason = (
                f"prompt needs {self.pool.pages_for(tokens)} KV pages on prefill node "
                f"{self.node}, whose pool holds {self.pool.num_pages}"
            )
            return [Send(msg.decode_node, PrefillRejected(msg.req_id, reason))]
        if self.waiting or not self.pool.can_allocate(tokens):
            self.waiting.append(msg)
            return []
        return self._start(msg)

    def _start(self, msg: PrefillRequest) -> list[Command]:
        tokens = msg.prompt_tokens - 1
        src = self.pool.allocate(msg.req_id, tokens)
        self.outbound[msg.req_id] = _Outbound(msg, src, tokens)
        return [Prefill(msg.req_id, tokens)]

    def _drop_waiting(self, req_id: int, reason: str) -> list[Command]:
        kept = [m for m in self.waiting if m.req_id != req_id]
        if len(kept) == len(self.waiting):
            return []  # already finished and freed: decode will see its immediates
        dropped = next(m for m in self.waiting if m.req_id == req_id)
        self.waiting = deque(kept)
        return [Send(dropped.decode_node, TransferAborted(req_id, reason))]

    def on_batch(self, chunks: Sequence[tuple[int, int, int]]) -> list[Command]:
        """Before a forward pass: the chunks (req_id, start, tokens) it computes."""
        for req_id, _, _ in chunks:
            if req_id not in self.outbound:
                raise ProtocolError(f"prefill node {self.node}: chunk of unknown request {req_id}")
        self._batch = [_ScheduledChunk(*c) for c in chunks]
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
        out = self.outbound.get(req_id)
        return out is not None and not out.abort_reason

    def _post(self, c: _ScheduledChunk, layers: range) -> PostWrites:
        out = self.outbound[c.req_id]
        ps = self.pool.page_size
        end = c.start + c.tokens
        first, last = c.start // ps, (end - 1) // ps
        imm = tuple((i + 1) * ps <= end or end == out.target for i in range(first, last + 1))
        out.pending_posts += 1
        return PostWrites(
            c.req_id,
            out.msg.decode_node,
            out.msg.slot,
            layers,
            tuple(out.src_pages[first : last + 1]),
            out.msg.dst_pages[first : last + 1],
            imm,
            out.msg.dst_rank,
        )

    def on_batch_done(self) -> list[Command]:
        """The forward pass finished: post what is left, and the metadata of finished prompts."""
        cmds = self.on_layers(self.num_layers)
        for c in self._batch:
            out = self.outbound.get(c.req_id)
            if out is None or out.abort_reason or c.start + c.tokens < out.target:
                continue
            out.prefilled = True
            if self.policy == "whole":
                cmds.append(
                    self._post(_ScheduledChunk(c.req_id, 0, out.target), range(self.num_layers))
                )
            if self.metadata:
                out.pending_posts += 1
                cmds.append(
                    PostMetadata(c.req_id, out.msg.decode_node, out.msg.slot, out.msg.dst_rank)
                )
        self._batch = []
        return cmds + self._finish_ready()

    def on_posted(self, req_id: int, ok: bool = True, error: str = "") -> list[Command]:
        """One PostWrites/PostMetadata of `req_id` completed (or failed with `error`)."""
        out = self.outbound.get(req_id)
        if out is None or out.pending_posts == 0:
            raise ProtocolError(f"prefill node {self.node}: no posts pending for {req_id}")
        out.pending_posts -= 1
        cmds: list[Command] = []
        if not ok and not out.abort_reason:
            cmds += self._abort(
                req_id, f"transfer to decode node {out.msg.decode_node} failed: {error}"
            )
        return cmds + self._finish_ready()

    def _abort(self, req_id: int, reason: str, notify: bool = True) -> list[Command]:
        out = self.outbound[req_id]
        out.abort_reason, out.notify = out.abort_reason or reason, notify
        cmds: list[Command] = [] if out.prefilled else [Unschedule(req_id)]
        out.prefilled = True  # no more chunks will run for it
        return cmds + self._finish_ready()

    def on_peer_dead(self, decode_node: int, reason: str) -> list[Command]:
        """A decode node is gone: stop its transfers; nobody to tell."""
        self.waiting = deque(m for m in self.waiting if m.decode_node != decode_node)
        cmds: list[Command] = []
        for req_id, out in list(self.outbound.items()):
            if out.msg.decode_node == decode_node and req_id in self.outbound:
                cmds += self._abort(req_id, f"decode node {decode_node} died: {reason}", False)
        return cmds

    def _finish_ready(self) -> list[Command]:
        """Free pages of requests whose prefill and posts are all done; admit waiting ones."""
        cmds: list[Command] = []
        in_batch = {c.req_id for c in self._batch}
        for req_id, out in list(self.outbound.items()):
            if out.prefilled and out.pending_posts == 0 and req_id not in in_batch:
                del self.outbound[req_id]
                self.pool.free(req_id)
                if out.abort_reason and out.notify:
                    cmds.append(
                        Send(out.msg.decode_node, TransferAborted(req_id, out.abort_reason))
                    )
        while self.waiting and self.pool.can_allocate(self.waiting[0].prompt_tokens - 1):
            cmds += self._start(self.waiting.popleft())
        return cmds
