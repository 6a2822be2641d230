"""The KV messenger protocol, both sides, driven by hand: every rule and every failure path."""

from __future__ import annotations

import pytest

from disagg.core.kvcache import PagePool
from disagg.core.messenger import (
    CancelTransfer,
    DecodeMessenger,
    Failed,
    PostMetadata,
    PostWrites,
    Prefill,
    PrefillMessenger,
    PrefillRejected,
    PrefillRequest,
    Ready,
    Retry,
    Send,
    TransferAborted,
    Unschedule,
)
from disagg.core.request import Request, Status
from disagg.errors import ProtocolError

LAYERS = 4
PAGE = 16
PREFILL, DECODE = 0, 1


def expected_one_rank(req: Request, prefill_node: int, pages: int) -> dict[int, int]:
    """One source rank per destination rank, plus the metadata write."""
    return {0: pages * LAYERS + 1}


def sides(
    decode_pages: int = 64,
    prefill_pages: int = 64,
    policy: str = "layerwise",
    timeout_s: float = float("inf"),
    handoff: str = "decode-first",
) -> tuple[DecodeMessenger, PrefillMessenger]:
    dec = DecodeMessenger(
        DECODE,
        PagePool(decode_pages, PAGE, "decode"),
        expected_one_rank,
        timeout_s=timeout_s,
        handoff=handoff,  # type: ignore[arg-type]
    )
    pre = PrefillMessenger(PREFILL, PagePool(prefill_pages, PAGE, "prefill"), LAYERS, policy=policy)  # type: ignore[arg-type]
    return dec, pre


def handoff(dec: DecodeMessenger, pre: PrefillMessenger, req: Request) -> PrefillRequest:
    (send,) = dec.submit(req, PREFILL)
    assert isinstance(send, Send) and send.node == PREFILL
    assert isinstance(send.msg, PrefillRequest)
    assert pre.on_message(send.msg) == [Prefill(req.id, req.prompt_tokens - 1)]
    return send.msg


def run_chunk(
    pre: PrefillMessenger,
    req_id: int,
    start: int,
    tokens: int,
    counter_steps: tuple[int, ...] = (1, 3, LAYERS),
) -> list:
    cmds = pre.on_batch([(req_id, start, tokens)])
    for n in counter_steps:
        cmds += pre.on_layers(n)
    return cmds + pre.on_batch_done()


def land(dec: DecodeMessenger, cmds: list) -> list:
    """Deliver every write of `cmds` to the decoder, counting one immediate per flagged page
    per layer (one source rank) and one for the metadata."""
    out = []
    for c in cmds:
        if isinstance(c, PostWrites):
            out += dec.on_immediates(c.slot, c.imm_pages * len(c.layers))
        elif isinstance(c, PostMetadata):
            out += dec.on_immediates(c.slot, 1)
    return out


def complete_posts(pre: PrefillMessenger, cmds: list) -> list:
    out = []
    for c in cmds:
        if isinstance(c, PostWrites | PostMetadata):
            out += pre.on_posted(c.req_id)
    return out


def test_decode_reserves_prompt_plus_output_and_sends_pages_of_prompt_minus_one() -> None:
    dec, pre = sides()
    req = Request(7, 0.0, prompt_tokens=40, output_tokens=30)
    msg = handoff(dec, pre, req)
    assert dec.pool.pages_of(7) == list(range(5))  # ceil(70 / 16) pages, pinned
    assert dec.pool.is_pinned(7)
    assert msg.dst_pages == (0, 1, 2)  # 39 tokens -> 3 pages travel
    assert pre.pool.pages_of(7) == [0, 1, 2]
    assert req.status is Status.RESERVED


def test_layerwise_writes_follow_the_counter_and_request_becomes_ready() -> None:
    dec, pre = sides()
    req = Request(1, 0.0, prompt_tokens=40, output_tokens=8)
    handoff(dec, pre, req)
    cmds = run_chunk(pre, 1, 0, 39)
    posts = [c for c in cmds if isinstance(c, PostWrites)]
    assert [p.layers for p in posts] == [range(0, 1), range(1, 3), range(3, 4)]
    assert all(p.imm == (True, True, True) for p in posts)
    assert isinstance(cmds[-1], PostMetadata)
    assert land(dec, cmds) == [Ready(1)]
    assert req.status is Status.READY
    assert complete_posts(pre, cmds) == []
    assert pre.pool.free_pages == 64 and not pre.outbound  # freed after its posts completed


def test_counter_jumps_and_repeats_post_each_layer_once() -> None:
    dec, pre = sides()
    handoff(dec, pre, Request(1, 0.0, 20, 4))
    cmds = run_chunk(pre, 1, 0, 19, counter_steps=(2, 2, 1, 4, 4))
    layers = [layer for c in cmds if isinstance(c, PostWrites) for layer in c.layers]
    assert layers == [0, 1, 2, 3]


def test_chunked_prefill_resends_cut_page_and_counts_it_once() -> None:
    dec, pre = sides()
    req = Request(3, 0.0, prompt_tokens=51, output_tokens=5)  # 50 tokens travel: 4 pages
    msg = handoff(dec, pre, req)
    first = run_chunk(pre, 3, 0, 20)  # tokens 0..19: page 0 complete, page 1 cut
    w1 = [c for c in first if isinstance(c, PostWrites)]
    assert w1[0].dst_pages == msg.dst_pages[0:2] and w1[0].imm == (True, False)
    assert not any(isinstance(c, PostMetadata) for c in first)
    assert land(dec, first) == []
    second = run_chunk(pre, 3, 20, 30)  # tokens 20..49: pages 1..3, page 3 is the last
    w2 = [c for c in second if isinstance(c, PostWrites)]
    assert w2[0].dst_pages == msg.dst_pages[1:4] and w2[0].imm == (True, True, True)
    assert land(dec, second) == [Ready(3)]
    assert dec.inbound == {}
    # pages are freed only once every post of every chunk completed
    complete_posts(pre, first)
    assert pre.pool.used_pages == 4
    complete_posts(pre, second)
    assert pre.pool.used_pages == 0


def test_whole_request_policy_posts_once_after_last_chunk() -> None:
    dec, pre = sides(policy="whole")
    handoff(dec, pre, Request(2, 0.0, 51, 5))
    first = run_chunk(pre, 2, 0, 20)
    assert first == []
    second = run_chunk(pre, 2, 20, 30)
    (post, meta) = second
    assert isinstance(post, PostWrites) and post.layers == range(LAYERS)
    assert post.src_pages == (0, 1, 2, 3) and all(post.imm)
    assert isinstance(meta, PostMetadata)
    assert land(dec, second) == [Ready(2)]


def test_over_count_and_stale_immediates_are_counted_never_a_crash() -> None:
    """Immediates beyond a transfer's plan (spoofed, or a bug) are dropped and counted; the
    request still becomes ready at exactly its planned count."""
    dec, pre = sides()
    msg = handoff(dec, pre, Request(1, 0.0, 17, 2))
    assert dec.on_immediates(msg.slot, 6) == [] and dec.excess_immediates == 6
    assert dec.on_immediates(999, 3) == []
    assert dec.stale_immediates == 3
    assert dec.on_immediates(msg.slot, 5) == [Ready(1)]


def test_immediates_by_rank_count_as_one_call_per_rank_in_order() -> None:
    """A post's immediates for several ranks at once: each rank checked as `on_immediates`
    would; a rank outside the plan is excess, and after the transfer completes the rest are
    stale."""
    dec, pre = sides()
    msg = handoff(dec, pre, Request(1, 0.0, 17, 2))  # 1 page: 4 layers + metadata = 5 on rank 0
    assert dec.on_immediates_by_rank(msg.slot, {0: 2, 3: 1}) == []
    assert dec.excess_immediates == 1 and dec.stale_immediates == 0
    assert dec.on_immediates_by_rank(msg.slot, {0: 3, 2: 4}) == [Ready(1)]
    assert dec.stale_immediates == 4  # rank 2's, after the transfer closed
    assert dec.on_immediates_by_rank(msg.slot, {0: 1}) == [] and dec.stale_immediates == 5


def test_one_token_prompt_is_ready_without_prefill() -> None:
    dec, _ = sides()
    assert dec.submit(Request(1, 0.0, 1, 4), PREFILL) == [Ready(1)]
    assert dec.pool.used_pages == 1


def test_decode_pool_too_small_ever_fails_with_reason() -> None:
    dec, _ = sides(decode_pages=2)
    req = Request(1, 0.0, 40, 10)
    (failed,) = dec.submit(req, PREFILL)
    assert isinstance(failed, Failed) and "needs 4 KV pages" in failed.reason
    assert req.status is Status.FAILED and dec.pool.used_pages == 0


def test_decode_pool_full_now_waits_in_order_then_proceeds_on_release() -> None:
    dec, pre = sides(decode_pages=6)
    a, b, c = (Request(i, 0.0, 40, 40) for i in range(3))  # 5 pages each
    handoff(dec, pre, a)
    assert dec.submit(b, PREFILL) == [] and dec.submit(c, PREFILL) == []
    assert [r.id for r, _ in dec.waiting] == [1, 2]
    (send,) = dec.release(0)
    assert isinstance(send, Send) and isinstance(send.msg, PrefillRequest)
    assert send.msg.req_id == 1 and [r.id for r, _ in dec.waiting] == [2]
    dec.pool.check()


def test_prefill_pool_too_small_rejects_and_decode_frees_and_fails() -> None:
    dec, pre = sides(prefill_pages=2)
    req = Request(1, 0.0, 60, 4)
    (send,) = dec.submit(req, PREFILL)
    (reply,) = pre.on_message(send.msg)
    assert isinstance(reply, Send) and isinstance(reply.msg, PrefillRejected)
    assert "prefill node 0" in reply.msg.reason
    (failed,) = dec.on_message(reply.msg)
    assert isinstance(failed, Failed) and req.status is Status.FAILED
    assert dec.pool.used_pages == 0 and not dec.inbound


def test_prefill_pool_full_queues_until_pages_free() -> None:
    dec, pre = sides(prefill_pages=3)
    handoff(dec, pre, Request(1, 0.0, 40, 4))
    (send,) = dec.submit(Request(2, 0.0, 40, 4), PREFILL)
    assert pre.on_message(send.msg) == []
    cmds = run_chunk(pre, 1, 0, 39)
    assert complete_posts(pre, cmds) == [Prefill(2, 39)]


def test_failed_post_aborts_frees_both_sides_and_retries() -> None:
    dec, pre = sides()
    req = Request(1, 0.0, 40, 4)
    handoff(dec, pre, req)
    cmds = run_chunk(pre, 1, 0, 39)
    posts = [c for c in cmds if isinstance(c, PostWrites | PostMetadata)]
    assert pre.on_posted(1, ok=False, error="remote access error") == []  # others pending
    for _ in posts[1:-1]:
        pre.on_posted(1)
    (abort,) = pre.on_posted(1)
    assert isinstance(abort, Send) and isinstance(abort.msg, TransferAborted)
    assert "remote access error" in abort.msg.reason
    assert pre.pool.used_pages == 0
    (retry,) = dec.on_message(abort.msg)
    assert retry == Retry(1, abort.msg.reason)
    assert dec.pool.used_pages == 0 and req.status is Status.QUEUED


def test_retries_are_bounded() -> None:
    dec, pre = sides()
    req = Request(1, 0.0, 40, 4)
    for attempt in range(1, 4):
        msg = handoff(dec, pre, req)
        (cmd,) = dec.on_message(TransferAborted(msg.req_id, "link down"))
        pre.on_peer_dead(DECODE, "test reset")
        expected = Retry if attempt < 3 else Failed
        assert isinstance(cmd, expected)
    assert req.status is Status.FAILED and "after 3 attempts" in req.fail_reason


def test_timeout_cancels_and_pages_wait_for_prefill_ack() -> None:
    dec, pre = sides(timeout_s=5.0)
    req = Request(1, 0.0, 40, 4)
    msg = handoff(dec, pre, req)
    assert dec.check_timeouts(4.9) == []
    (cancel,) = dec.check_timeouts(5.0)
    assert isinstance(cancel.msg, CancelTransfer)
    assert dec.check_timeouts(6.0) == []  # asked once
    assert dec.pool.used_pages == 3  # prefill may still be writing: pages stay reserved
    cmds = pre.on_message(cancel.msg)
    assert cmds[0] == Unschedule(1)
    (ack,) = cmds[1:]
    assert isinstance(ack.msg, TransferAborted) and "timed out" in ack.msg.reason
    assert pre.pool.used_pages == 0
    (retry,) = dec.on_message(ack.msg)
    assert isinstance(retry, Retry) and dec.pool.used_pages == 0
    assert dec.on_immediates(msg.slot, 1) == []  # a late write is ignored, not counted


def test_cancel_during_forward_pass_keeps_pages_until_pass_ends() -> None:
    dec, pre = sides()
    handoff(dec, pre, Request(1, 0.0, 40, 4))
    pre.on_batch([(1, 0, 39)])
    first = pre.on_layers(1)
    cmds = pre.on_message(CancelTransfer(1, "timeout"))
    assert cmds == [Unschedule(1)]
    assert pre.on_layers(LAYERS) == []  # no more writes for a cancelled request
    assert pre.pool.used_pages == 3  # the GPU is still writing these pages
    assert pre.on_batch_done() == []
    (ack,) = complete_posts(pre, first)
    assert isinstance(ack.msg, TransferAborted) and pre.pool.used_pages == 0


def test_dead_prefill_peer_frees_decode_pages_and_retries_every_request() -> None:
    dec, pre = sides()
    for i in range(3):
        handoff(dec, pre, Request(i, 0.0, 40, 4))
    cmds = dec.on_peer_dead(PREFILL, "connection reset")
    assert [type(c) for c in cmds] == [Retry, Retry, Retry]
    assert "prefill node 0 died: connection reset" in cmds[0].reason
    assert dec.pool.used_pages == 0 and not dec.inbound


def test_dead_decode_peer_frees_prefill_pages_without_a_message() -> None:
    dec, pre = sides()
    handoff(dec, pre, Request(1, 0.0, 40, 4))
    assert pre.on_peer_dead(DECODE, "gone") == [Unschedule(1)]
    assert pre.pool.used_pages == 0 and not pre.outbound


def test_cancel_of_a_waiting_request_is_acknowledged() -> None:
    dec, pre = sides(prefill_pages=3)
    handoff(dec, pre, Request(1, 0.0, 40, 4))
    (send,) = dec.submit(Request(2, 0.0, 40, 4), PREFILL)
    pre.on_message(send.msg)
    (ack,) = pre.on_message(CancelTransfer(2, "timeout"))
    assert isinstance(ack.msg, TransferAborted) and not pre.waiting


def test_chunk_of_unknown_request_and_bad_counter_are_protocol_errors() -> None:
    _, pre = sides()
    with pytest.raises(ProtocolError, match="unknown request 9"):
        pre.on_batch([(9, 0, 10)])
    with pytest.raises(ProtocolError, match="layer counter 5"):
        pre.on_layers(LAYERS + 1)


# ---- parallel handoff: the router sends the request to both sides at once ------------------
def parallel(decode_pages: int = 64, prefill_pages: int = 64, policy: str = "layerwise"):
    return sides(decode_pages, prefill_pages, policy, handoff="parallel")


def routed_request(dec: DecodeMessenger, req: Request) -> PrefillRequest:
    (send,) = dec.submit(req, PREFILL)
    assert isinstance(send.msg, PrefillRequest) and send.msg.routed
    return send.msg


def test_parallel_prefill_starts_before_the_decoder_pages_and_catches_up_mid_pass() -> None:
    dec, pre = parallel()
    req = Request(1, 0.0, prompt_tokens=40, output_tokens=8, prompt=tuple(range(40)))
    assert pre.submit(1, 40, DECODE) == [Prefill(1, 39)]  # no pages from the decoder yet
    cmds = pre.on_batch([(1, 0, 39)]) + pre.on_layers(3)
    assert cmds == []  # the KV waits on the prefill node
    msg = routed_request(dec, req)
    assert msg.prompt == ()  # the prefill node has it from the router
    catch_up = pre.on_message(msg)
    assert [(c.layers, c.earlier) for c in catch_up] == [(range(0, 3), False)]
    rest = pre.on_layers(LAYERS) + pre.on_batch_done()
    assert [c.layers for c in rest if isinstance(c, PostWrites)] == [range(3, 4)]
    assert isinstance(rest[-1], PostMetadata)
    assert land(dec, catch_up) == [] and land(dec, rest) == [Ready(1)]
    assert complete_posts(pre, catch_up + rest) == []
    assert pre.pool.used_pages == 0 and not pre.outbound


def test_parallel_pages_arriving_after_the_prefill_are_sent_whole_then_freed() -> None:
    dec, pre = parallel()
    req = Request(2, 0.0, prompt_tokens=51, output_tokens=5)
    pre.submit(2, 51, DECODE)
    assert run_chunk(pre, 2, 0, 20) + run_chunk(pre, 2, 20, 30) == []
    assert pre.pool.used_pages == 4  # held until the decoder says where they go
    cmds = pre.on_message(routed_request(dec, req))
    post, meta = cmds
    assert isinstance(post, PostWrites) and post.earlier and post.layers == range(LAYERS)
    assert post.src_pages == (0, 1, 2, 3) and all(post.imm) and isinstance(meta, PostMetadata)
    assert land(dec, cmds) == [Ready(2)]
    complete_posts(pre, cmds)
    assert pre.pool.used_pages == 0


def test_parallel_pages_arriving_between_chunks_count_the_cut_page_once() -> None:
    dec, pre = parallel()
    req = Request(3, 0.0, prompt_tokens=51, output_tokens=5)  # 50 tokens travel: 4 pages
    pre.submit(3, 51, DECODE)
    assert run_chunk(pre, 3, 0, 20) == []  # page 0 complete, page 1 cut
    pre.on_batch([(3, 20, 30)])
    pre.on_layers(2)
    catch_up = pre.on_message(routed_request(dec, req))
    done, running = catch_up
    assert done.earlier and done.layers == range(LAYERS) and done.imm == (True, False)
    assert not running.earlier and running.layers == range(2) and running.imm == (True,) * 3
    rest = pre.on_layers(LAYERS) + pre.on_batch_done()
    assert land(dec, catch_up) == [] and land(dec, rest) == [Ready(3)]


def test_parallel_whole_policy_posts_only_after_the_last_chunk() -> None:
    dec, pre = parallel(policy="whole")
    req = Request(4, 0.0, 51, 5)
    pre.submit(4, 51, DECODE)
    run_chunk(pre, 4, 0, 20)
    assert pre.on_message(routed_request(dec, req)) == []
    (post, meta) = run_chunk(pre, 4, 20, 30)
    assert post.layers == range(LAYERS) and all(post.imm) and not post.earlier
    assert land(dec, [post, meta]) == [Ready(4)]


def test_parallel_decoder_pages_before_the_router_submission_are_kept() -> None:
    dec, pre = parallel()
    req = Request(5, 0.0, 40, 4)
    assert pre.on_message(routed_request(dec, req)) == []  # the router's message is late
    assert pre.submit(5, 40, DECODE) == [Prefill(5, 39)]
    cmds = run_chunk(pre, 5, 0, 39)
    assert land(dec, cmds) == [Ready(5)]


def test_parallel_decode_that_can_never_fit_cancels_the_started_prefill() -> None:
    dec, pre = parallel(decode_pages=2)
    req = Request(6, 0.0, 40, 10)
    pre.submit(6, 40, DECODE)
    failed, cancel = dec.submit(req, PREFILL)
    assert isinstance(failed, Failed) and isinstance(cancel.msg, CancelTransfer)
    assert pre.on_message(cancel.msg) == [Unschedule(6)]  # nobody to answer
    assert pre.pool.used_pages == 0 and not pre.outbound
    # the same cancel overtaking the router's submission drops the submission
    assert pre.on_message(CancelTransfer(7, "decode pool")) == []
    assert pre.submit(7, 40, DECODE) == [] and not pre.outbound


def test_parallel_prefill_that_can_never_fit_rejects_the_decoder_pages() -> None:
    dec, pre = parallel(prefill_pages=2)
    req = Request(8, 0.0, 60, 4)
    assert pre.submit(8, 60, DECODE) == []
    (reply,) = pre.on_message(routed_request(dec, req))
    assert isinstance(reply.msg, PrefillRejected) and "prefill node 0" in reply.msg.reason
    (failed,) = dec.on_message(reply.msg)
    assert isinstance(failed, Failed) and dec.pool.used_pages == 0


def test_parallel_dead_decoder_frees_prefills_without_pages() -> None:
    _, pre = parallel()
    pre.submit(9, 40, DECODE)
    run_chunk(pre, 9, 0, 39)
    assert pre.pool.used_pages == 3
    assert pre.on_peer_dead(DECODE, "gone") == []
    assert pre.pool.used_pages == 0 and not pre.outbound


def test_parallel_retry_and_one_token_prompts_go_decode_first() -> None:
    dec, pre = parallel()
    assert pre.submit(10, 1, DECODE) == [] and dec.submit(Request(10, 0.0, 1, 4), PREFILL) == [
        Ready(10)
    ]
    req = Request(11, 0.0, 40, 4, prompt=tuple(range(40)))
    pre.submit(11, 40, DECODE)
    pre.on_message(routed_request(dec, req))
    cmds = pre.on_message(CancelTransfer(11, "timeout"))
    assert cmds[0] == Unschedule(11) and isinstance(cmds[1].msg, TransferAborted)
    (retry,) = dec.on_message(cmds[1].msg)
    assert isinstance(retry, Retry)
    (send,) = dec.submit(req, PREFILL)
    assert not send.msg.routed and send.msg.prompt == req.prompt
    assert pre.on_message(send.msg) == [Prefill(11, 39)]


def test_unknown_handoff_is_a_protocol_error() -> None:
    with pytest.raises(ProtocolError, match="unknown handoff 'eager'"):
        DecodeMessenger(DECODE, PagePool(8, PAGE, "d"), expected_one_rank, handoff="eager")  # type: ignore[arg-type]


def test_parallel_early_start_gives_way_to_a_request_with_pages_and_is_recomputed() -> None:
    dec, pre = parallel(prefill_pages=3)
    a, b = Request(20, 0.0, 40, 4), Request(21, 0.0, 40, 4)
    assert pre.submit(20, 40, DECODE) == [Prefill(20, 39)]  # early start into free room
    assert pre.submit(21, 40, DECODE) == []  # no room: parked until its decoder's pages come
    assert run_chunk(pre, 20, 0, 20) == []  # half of a's prompt, its KV held here
    # b's pages come first: b may not wait behind a's early start, so a is evicted
    assert pre.on_message(routed_request(dec, b)) == [Unschedule(20), Prefill(21, 39)]
    assert pre.evicted == 1 and 20 in pre.parked and pre.pool.pages_of(21) == [0, 1, 2]
    b_posts = run_chunk(pre, 21, 0, 39)
    assert land(dec, b_posts) == [Ready(21)]
    assert pre.on_message(routed_request(dec, a)) == []  # waits in order for b's pages
    assert complete_posts(pre, b_posts) == [Prefill(20, 39)]  # recomputed from the start
    a_posts = run_chunk(pre, 20, 0, 39)
    assert land(dec, a_posts) == [Ready(20)]
    complete_posts(pre, a_posts)
    assert pre.pool.used_pages == 0 and not pre.parked and not pre.outbound


def test_cancels_for_unknown_requests_are_remembered_boundedly() -> None:
    # a cancel for a request long finished cannot be told from one whose router submission is
    # still on its way: both are remembered, the oldest forgotten past GONE_KEPT
    from disagg.core.messenger import GONE_KEPT

    _, pre = parallel()
    for i in range(GONE_KEPT + 10):
        assert pre.on_message(CancelTransfer(1000 + i, "timeout")) == []
    assert pre.submit(1000 + GONE_KEPT + 9, 40, DECODE) == []  # recent: dropped on arrival
    assert pre.submit(1000, 40, DECODE) == [Prefill(1000, 39)]  # forgotten: prefilled


@pytest.mark.parametrize("started", [True, False], ids=["prefilled", "parked"])
def test_parallel_timeout_is_answered_when_the_decoder_pages_never_came(started: bool) -> None:
    """Under parallel handoff the router's submission started (or parked) a prefill, and the
    decoder's routed PrefillRequest was lost. The decoder's timeout cancel still gets its
    answer (sent to the decoder the router named), so the decoder frees its pages and retries
    decode-first, and the retry runs: the request is not lost."""
    dec, pre = sides(timeout_s=5.0, handoff="parallel")
    req = Request(12, 0.0, prompt_tokens=40, output_tokens=8, prompt=tuple(range(40)))
    if not started:  # room for nothing: the early start parks
        pre.pool.allocate(99, pre.pool.num_pages * PAGE)
    assert pre.submit(12, 40, DECODE) == ([Prefill(12, 39)] if started else [])
    if started:
        run_chunk(pre, 12, 0, 39)  # prefilled; its KV waits for pages that never come
    routed_request(dec, req)  # sent, and lost on the way
    (cancel,) = dec.check_timeouts(5.0)
    assert isinstance(cancel.msg, CancelTransfer) and cancel.msg.reply
    (answer,) = pre.on_message(cancel.msg)
    assert answer == Send(DECODE, TransferAborted(12, "transfer timed out after 5 s"))
    assert not pre.outbound and not pre.parked
    assert dec.on_message(answer.msg) == [Retry(12, "transfer timed out after 5 s")]
    assert dec.pool.used_pages == 0  # freed on the answer
    if not started:
        pre.pool.free(99)
    (retry,) = dec.submit(req, PREFILL, 6.0)
    assert not retry.msg.routed and retry.msg.prompt == req.prompt
    assert pre.on_message(retry.msg) == [Prefill(12, 39)]


def test_parallel_cancel_of_a_request_failed_at_the_decoder_wants_no_answer() -> None:
    """A decoder that fails a request before any handoff tells the started prefill to stop,
    asking no answer: it holds nothing for it (an answer would name a request it has not)."""
    dec, pre = parallel(decode_pages=2)
    pre.submit(13, 40, DECODE)
    _, cancel = dec.submit(Request(13, 0.0, 40, 10), PREFILL)
    assert cancel.msg == CancelTransfer(13, cancel.msg.reason, reply=False, decode_node=DECODE)
    assert pre.on_message(cancel.msg) == [Unschedule(13)] and not pre.outbound


# ---- faults: wrong verdicts of death, stalls, unanswered cancels ---------------------------
def test_a_cancel_of_a_request_prefill_forgot_is_answered() -> None:
    """The prefill wrongly declared the decoder dead and forgot its request; the decoder, alive,
    times out and cancels: the prefill answers, so the decoder frees its pages and retries."""
    dec, pre = sides(timeout_s=1.0)
    req = Request(1, 0.0, 40, 4)
    handoff(dec, pre, req)
    assert pre.on_peer_dead(DECODE, "no heartbeat") == [Unschedule(1)]
    assert not pre.outbound and pre.pool.used_pages == 0
    (cancel,) = dec.check_timeouts(1.0)
    (answer,) = pre.on_message(cancel.msg)
    assert answer == Send(DECODE, TransferAborted(1, "transfer timed out after 1 s"))
    (retry,) = dec.on_message(answer.msg)
    assert isinstance(retry, Retry) and dec.pool.used_pages == 0


def test_an_unanswered_cancel_ends_the_pages_lease_and_quarantines_the_slot() -> None:
    """A prefill node that never answers (gone, or cut off) holds the decoder's pages for one
    more timeout at most; the slot is never reused, so a late write cannot count for another."""
    dec, pre = sides(timeout_s=1.0)
    req = Request(1, 0.0, 40, 4)
    msg = handoff(dec, pre, req)
    (_cancel,) = dec.check_timeouts(1.0)
    assert dec.check_timeouts(1.5) == [] and dec.pool.used_pages > 0
    (retry,) = dec.check_timeouts(2.0)
    assert isinstance(retry, Retry) and "did not answer the cancel within 1 s" in retry.reason
    assert dec.pool.used_pages == 0 and dec.quarantined_slots == 1
    (again,) = dec.submit(req, PREFILL, now_s=2.0)
    assert again.msg.slot != msg.slot
    assert dec.on_immediates(msg.slot, 3) == [] and dec.stale_immediates == 3


def test_a_retry_of_a_request_still_running_supersedes_it() -> None:
    """The decoder thought the prefill node dead (it was stalled), gave the request up and
    handed it off again to the same node: the old transfer ends, the new one runs after it."""
    dec, pre = sides()
    req = Request(1, 0.0, 40, 4)
    first = handoff(dec, pre, req)
    pre.on_batch([(1, 0, 39)])
    (_retry,) = dec.on_peer_dead(PREFILL, "no heartbeat")
    (send,) = dec.submit(req, PREFILL)
    assert (send.msg.attempt, first.attempt) == (2, 1) and send.msg.slot != first.slot
    assert pre.on_message(send.msg) == [Unschedule(1)]  # the old ends with its pass
    assert pre.on_message(send.msg) == []  # the same message twice changes nothing
    cmds = pre.on_batch_done()
    assert Prefill(1, 39) in cmds  # the retry starts, on its own pages
    out = pre.outbound[1]
    assert out.msg == send.msg and not out.abort_reason


def test_a_cancel_of_a_retry_waiting_for_its_older_attempt_cancels_the_retry() -> None:
    """The retry waits for the old attempt to end; the decoder's cancel (sent after the retry)
    is for the retry: when the old attempt ends, the retry does not start on its own."""
    dec, pre = sides()
    req = Request(1, 0.0, 40, 4)
    handoff(dec, pre, req)
    pre.on_batch([(1, 0, 39)])
    dec.on_peer_dead(PREFILL, "no heartbeat")
    (send,) = dec.submit(req, PREFILL)
    pre.on_message(send.msg)
    cancel = CancelTransfer(1, "transfer timed out after 1 s", True, DECODE)
    assert pre.on_message(cancel) == []  # the old attempt is in the running pass
    cmds = pre.on_batch_done()
    assert cmds == [Send(DECODE, TransferAborted(1, "superseded by the decoder's retry"))]
    assert 1 not in pre.outbound and not pre.waiting and pre.pool.used_pages == 0
