"""The core roles driven through a fake port with scripted events: no SimPy, no sockets. Each
test checks what a role asks of its port (messages, posts, timers, what it reports)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import pytest

from disagg.core import messenger as m
from disagg.core.kvcache import PagePool
from disagg.core.request import Request, Status
from disagg.core.roles import ColocatedRole, DecodeRole, PrefillRole

LAYERS, PAGE = 2, 16


@dataclass
class FakePort:
    """Records what a role asks; the test moves the clock and feeds events."""

    t: float = 0.0
    sent: list[tuple[str, int, Any]] = field(default_factory=list)
    posts: list[Any] = field(default_factory=list)
    timers: list[float] = field(default_factory=list)
    events: list[tuple[str, int, float]] = field(default_factory=list)  # (what, req, at)
    wakes: int = 0
    prefill_for_retry: int = 0

    def now(self) -> float:
        return self.t

    def send(self, role: str, node: int, msg: Any) -> None:
        self.sent.append((role, node, msg))

    def wake(self) -> None:
        self.wakes += 1

    def post(self, cmd: Any) -> None:
        self.posts.append(cmd)

    def set_timer(self, at_s: float) -> None:
        self.timers.append(at_s)

    def request(self, req_id: int, prompt_tokens: int, prompt: tuple[int, ...]) -> Request:
        return Request(req_id, 0.0, prompt_tokens, 1, prompt=prompt)

    def route(self, req: Request) -> int:
        self.events.append(("route", req.id, self.t))
        return self.prefill_for_retry

    def prefilled(self, req: Request) -> None:
        self.events.append(("prefilled", req.id, req.prefill_end_s))

    def ready(self, req: Request) -> None:
        self.events.append(("ready", req.id, req.ready_s))

    def finished(self, req: Request) -> None:
        self.events.append((str(req.status), req.id, req.finish_s))


def group(**kw: Any) -> Any:
    return SimpleNamespace(**({"max_batch": 8, "token_budget": 64, "scheduler": None} | kw))


def transfer(**kw: Any) -> Any:
    defaults = {"policy": "layerwise", "handoff": "decode-first", "timeout_s": 1.0}
    return SimpleNamespace(**(defaults | {"max_attempts": 2} | kw))


def one_rank(req: Request, prefill_node: int, pages: int) -> dict[int, int]:
    return {0: pages * LAYERS + 1}  # a write unit per page and layer, and the metadata


def decode_role(port: FakePort, pages: int = 64, **kw: Any) -> DecodeRole:
    return DecodeRole(3, port, PagePool(pages, PAGE, "d"), group(), transfer(**kw), one_rank)


def prefill_role(port: FakePort, policy: str = "layerwise") -> PrefillRole:
    return PrefillRole(0, port, PagePool(64, PAGE, "p"), group(), transfer(policy=policy), LAYERS)


def test_decode_role_hands_off_counts_in_decodes_and_releases() -> None:
    port = FakePort(t=1.0)
    role = decode_role(port)
    req = Request(7, 1.0, prompt_tokens=33, output_tokens=2)  # 32 tokens of KV: 2 pages
    role.submit(req, prefill_node=0)
    ((to, node, msg),) = port.sent
    assert (to, node) == ("prefill", 0) and isinstance(msg, m.PrefillRequest)
    assert (msg.req_id, msg.decode_node, msg.prompt_tokens, len(msg.dst_pages)) == (7, 3, 33, 2)
    assert port.timers == [2.0]  # the transfer's deadline: now + timeout_s
    assert req.status is Status.RESERVED and role.pool.used_pages == 3  # 35 tokens reserved

    port.t = 1.5
    role.on_immediates(msg.slot, 4)  # 2 pages x 2 layers
    assert port.events == [] and req.status is Status.RESERVED
    role.on_immediates(msg.slot, 1)  # the metadata
    assert port.events == [("ready", 7, 1.5)] and port.wakes == 1

    batch = role.next_batch()
    assert batch.decodes == [req]
    port.t = 1.6
    role.pass_done(batch)
    assert req.first_token_s == 1.6 and req.status is Status.DECODING
    port.t = 1.7
    role.pass_done(role.next_batch())
    assert port.events[-1] == ("finished", 7, 1.7)
    assert role.pool.used_pages == 0 and len(role) == 0 and not role.requests


def test_decode_role_first_token_of_a_run_of_passes_is_when_the_first_pass_ended() -> None:
    port = FakePort()
    role = decode_role(port)
    req = Request(1, 0.0, prompt_tokens=1, output_tokens=5)  # one token: ready at once
    role.submit(req, 0)
    assert port.sent == [] and port.events == [("ready", 1, 0.0)]
    port.t = 0.5
    progress = role.pass_done(role.next_batch(), steps=5, first_token_s=0.1)
    assert req.first_token_s == 0.1 and req.finish_s == 0.5 and progress.finished == [req]


def test_a_transfer_that_outlives_its_deadline_is_cancelled_retried_then_failed() -> None:
    port = FakePort(prefill_for_retry=1)
    role = decode_role(port)
    req = Request(5, 0.0, prompt_tokens=40, output_tokens=4)
    role.submit(req, 0)
    assert port.timers == [1.0]
    port.t = 1.0
    role.on_timer()
    cancel = port.sent[-1]
    assert cancel == ("prefill", 0, m.CancelTransfer(5, "transfer timed out after 1 s", True, 3))
    assert role.pool.used_pages > 0  # the pages wait for the prefill's answer
    role.on_message(m.TransferAborted(5, "transfer timed out after 1 s"))
    # retried through the port's router, to prefill node 1, with a new deadline
    assert port.events == [("route", 5, 1.0)]
    assert port.sent[-1][:2] == ("prefill", 1) and port.timers == [1.0, 2.0]
    port.t = 2.0
    role.on_timer()
    role.on_message(m.TransferAborted(5, "transfer timed out after 1 s"))
    assert req.status is Status.FAILED
    assert req.fail_reason == "transfer timed out after 1 s (after 2 attempts)"
    assert port.events[-1][:2] == ("failed", 5) and math.isnan(req.finish_s)
    assert role.pool.used_pages == 0 and not role.requests


def test_a_cancel_answered_after_the_last_writes_landed_is_ignored() -> None:
    """The deadline passes with the last writes in flight: the decoder cancels, the writes
    land (the request is ready), then the prefill's answer comes. It changes nothing."""
    port = FakePort()
    role = decode_role(port)
    req = Request(9, 0.0, prompt_tokens=17, output_tokens=2)  # one page of KV
    role.submit(req, 0)
    slot = port.sent[0][2].slot
    port.t = 1.0
    role.on_timer()
    assert isinstance(port.sent[-1][2], m.CancelTransfer)
    role.on_immediates(slot, LAYERS + 1)
    assert req.status is Status.READY
    role.on_message(m.TransferAborted(9, "transfer timed out after 1 s"))
    assert req.status is Status.READY and role.messenger.late_answers == 1
    assert role.next_batch().decodes == [req]
    role.on_timer()  # a timer with nothing due asks nothing
    assert len(port.sent) == 2 and port.timers == [1.0, 2.0]  # the cancel's lease


def test_a_dead_prefill_node_frees_the_pages_and_retries_elsewhere() -> None:
    port = FakePort(prefill_for_retry=2)
    role = decode_role(port)
    req = Request(4, 0.0, prompt_tokens=40, output_tokens=4)
    role.submit(req, 0)
    role.on_peer_dead(0, "no heartbeat")
    assert port.events == [("route", 4, 0.0)] and port.sent[-1][:2] == ("prefill", 2)
    assert req.attempts == 2 and req.status is Status.RESERVED


def test_prefill_role_posts_each_layer_as_it_is_appended_then_frees() -> None:
    port = FakePort(t=2.0)
    role = prefill_role(port)
    role.on_message(m.PrefillRequest(7, 0, 3, 33, (10, 11), prompt=tuple(range(33))))
    assert port.wakes == 1 and role.requests[7].prompt == tuple(range(33))
    batch = role.next_batch()
    ((chunk,),) = [batch.chunks]
    assert (chunk.req.id, chunk.start, chunk.tokens, chunk.last) == (7, 0, 32, True)
    assert chunk.req.prefill_start_s == 2.0
    role.on_layers(1)
    (first,) = port.posts
    assert isinstance(first, m.PostWrites) and first.layers == range(1)
    assert (first.dst_pages, first.imm, first.decode_node) == ((10, 11), (True, True), 3)
    port.t = 2.5
    role.pass_done(batch)
    assert port.events == [("prefilled", 7, 2.5)]
    rest, meta = port.posts[1:]
    assert isinstance(rest, m.PostWrites) and rest.layers == range(1, 2)
    assert meta == m.PostMetadata(7, 3, 0)
    assert role.pool.used_pages == 2
    for _ in range(3):
        role.on_posted(7)
    assert role.pool.used_pages == 0 and not role.requests and len(role) == 0


def test_prefill_role_whole_policy_posts_after_the_pass() -> None:
    port = FakePort()
    role = prefill_role(port, policy="whole")
    role.on_message(m.PrefillRequest(1, 0, 0, 20, (5, 6)))
    batch = role.next_batch()
    role.on_layers(LAYERS)
    assert port.posts == []
    role.pass_done(batch)
    writes, meta = port.posts
    assert writes.layers == range(LAYERS) and isinstance(meta, m.PostMetadata)


def test_prefill_role_cancel_unschedules_and_answers_the_decoder() -> None:
    port = FakePort()
    role = prefill_role(port)
    role.on_message(m.PrefillRequest(2, 0, 1, 200, tuple(range(13))))
    role.on_message(m.CancelTransfer(2, "transfer timed out after 1 s"))
    assert port.sent == [("decode", 1, m.TransferAborted(2, "transfer timed out after 1 s"))]
    assert role.next_batch().empty and role.pool.used_pages == 0 and not role.requests


def test_parallel_handoff_starts_before_the_pages_and_posts_on_their_arrival() -> None:
    port = FakePort()
    role = prefill_role(port)
    role.submit(3, 33, decode_node=1, prompt=tuple(range(33)))
    batch = role.next_batch()
    role.on_layers(LAYERS)
    role.pass_done(batch)
    assert port.posts == [] and port.events == [("prefilled", 3, 0.0)]
    role.on_message(m.PrefillRequest(3, 4, 1, 33, (8, 9), routed=True))
    catch_up, meta = port.posts
    assert catch_up.earlier and catch_up.layers == range(LAYERS) and meta.slot == 4


def test_colocated_role_prefills_then_decodes_and_refuses_what_never_fits() -> None:
    port = FakePort()
    role = ColocatedRole(0, port, PagePool(4, PAGE, "c"), group())
    big = Request(1, 0.0, prompt_tokens=100, output_tokens=1)
    role.submit(big)
    assert big.status is Status.FAILED and port.events[0][:2] == ("failed", 1)
    req = Request(2, 0.0, prompt_tokens=20, output_tokens=2)
    role.submit(req)
    port.t = 0.25
    batch = role.next_batch()
    assert [c.req for c in batch.chunks] == [req] and req.prefill_start_s == 0.25
    port.t = 0.5
    role.pass_done(batch)
    assert req.first_token_s == req.prefill_end_s == 0.5
    port.t = 0.75
    role.pass_done(role.next_batch())
    assert port.events[-1] == ("finished", 2, 0.75) and role.pool.used_pages == 0


def test_a_prefill_and_a_decode_role_wired_together_finish_every_request() -> None:
    """Two roles joined by a port pair that delivers at once: the protocol end to end."""
    pre_port, dec_port = FakePort(), FakePort()
    pre, dec = prefill_role(pre_port), decode_role(dec_port)
    reqs = [Request(i, 0.0, prompt_tokens=10 + 17 * i, output_tokens=3) for i in range(4)]
    for r in reqs:
        dec.submit(r, 0)
    for _ in range(20):
        while dec_port.sent:
            pre.on_message(dec_port.sent.pop(0)[2])
        while pre_port.sent:
            dec.on_message(pre_port.sent.pop(0)[2])
        batch = pre.next_batch()
        if not batch.empty:
            pre.on_layers(LAYERS)
            pre.pass_done(batch)
        for cmd in pre_port.posts:
            if isinstance(cmd, m.PostMetadata):
                dec.on_immediates(cmd.slot)
            elif cmd.imm_pages:
                dec.on_immediates(cmd.slot, cmd.imm_pages * len(cmd.layers))
            pre.on_posted(cmd.req_id)
        pre_port.posts.clear()
        batch = dec.next_batch()
        if not batch.empty:
            dec.pass_done(batch)
    assert all(r.status is Status.FINISHED for r in reqs)
    assert pre.pool.used_pages == dec.pool.used_pages == 0


@pytest.mark.parametrize("role", ["prefill", "decode", "colocated"])
def test_a_role_built_for_a_group_takes_its_batch_limits(role: str) -> None:
    port, pool = FakePort(), PagePool(64, PAGE, "x")
    g = group(max_batch=3, token_budget=48)
    built: Any
    if role == "prefill":
        built = PrefillRole(0, port, pool, g, transfer(), LAYERS)
        assert (built.scheduler.token_budget, built.scheduler.max_seqs) == (48, 3)
    elif role == "decode":
        built = DecodeRole(0, port, pool, g, transfer(), one_rank, 1.7)
        assert (built.scheduler.max_batch, built.scheduler.tokens_per_step) == (3, 1.7)
    else:
        built = ColocatedRole(0, port, pool, g, 1.0, 2)
        assert (built.scheduler.prefill.token_budget, built.scheduler.decode_qo) == (48, 2)
