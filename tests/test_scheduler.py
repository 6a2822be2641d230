"""Batch policies: chunking under a token budget, decode admission, colocated mixing; the
policy registries that build schedulers and routers by name."""

from dataclasses import dataclass

import pytest

from disagg.config import GroupConfig
from disagg.core.kvcache import PagePool
from disagg.core.policies import (
    SCHEDULERS,
    FcfsConfig,
    LeastLoadedConfig,
    SchedulerPolicy,
    make_router,
    make_scheduler,
)
from disagg.core.request import Request, Status
from disagg.core.router import LeastLoaded, RoundRobin, pick_replica
from disagg.core.scheduler import (
    Batch,
    ColocatedScheduler,
    DecodePriorityScheduler,
    DecodeScheduler,
    PrefillFirstScheduler,
    PrefillScheduler,
    steps_to_finish,
)
from disagg.errors import ConfigError


def req(i: int, prompt: int = 100, output: int = 10) -> Request:
    return Request(i, 0.0, prompt, output)


def test_prefill_chunks_fifo_under_budget() -> None:
    s = PrefillScheduler(token_budget=250)
    a, b, c = req(0, 300), req(1, 100), req(2, 200)
    for r in (a, b, c):
        s.add(r, r.prompt_tokens - 1)
    batch = s.schedule()
    assert [(ch.req.id, ch.start, ch.tokens, ch.last) for ch in batch.chunks] == [
        (0, 0, 250, False)
    ]
    assert s.complete(batch).prefilled == []
    batch = s.schedule()
    chunks = [(ch.req.id, ch.start, ch.tokens, ch.last) for ch in batch.chunks]
    assert chunks == [(0, 250, 49, True), (1, 0, 99, True), (2, 0, 102, False)]
    done = s.complete(batch).prefilled
    assert [r.id for r in done] == [0, 1]
    assert a.prefilled == 299 and c.prefilled == 102 and len(s) == 1
    assert [(ch.start, ch.tokens, ch.last) for ch in s.schedule().chunks] == [(102, 97, True)]


def test_prefill_remove() -> None:
    s = PrefillScheduler(100)
    s.add(req(0), 99)
    s.add(req(1), 99)
    assert s.remove(0) and not s.remove(7)
    assert [ch.req.id for ch in s.schedule().chunks] == [1]


def test_decode_admits_only_ready_up_to_max_batch() -> None:
    s = DecodeScheduler(max_batch=2)
    assert s.schedule().empty
    for i in range(3):
        s.add_ready(req(i, output=3))
    batch = s.schedule()
    assert [r.id for r in batch.decodes] == [0, 1]
    assert all(r.status is Status.DECODING for r in batch.decodes)
    p = s.complete(batch, steps=1)
    assert [r.id for r in p.first_token] == [0, 1] and p.finished == []
    p = s.complete(s.schedule(), steps=2)
    assert [r.id for r in p.finished] == [0, 1]
    assert [r.id for r in s.schedule().decodes] == [2]


def test_a_decode_continuation_is_the_next_schedule_unless_a_request_is_ready() -> None:
    """The pass after a batch, asked while it runs: its decodes less those it finishes, which
    is what `schedule` gives after `complete`; None while a request waits to join, or when the
    batch finishes every decode."""
    s = DecodeScheduler(max_batch=4)
    s.add_ready(req(0, output=3))
    s.add_ready(req(1, output=2))
    batch = s.schedule()
    s.complete(batch)  # first tokens: 0 has 2 to go, 1 has 1
    batch = s.schedule()
    nxt = s.continuation(batch)
    assert nxt is not None and [r.id for r in nxt.decodes] == [0]
    s.complete(batch)
    assert s.schedule().decodes == nxt.decodes
    s.add_ready(req(2, output=5))
    assert s.continuation(Batch(decodes=[s.running[0]])) is None  # 2 joins the next pass
    s.complete(s.schedule())  # 0's last token
    assert s.continuation(Batch(decodes=list(s.running))) is not None
    assert s.continuation(Batch(decodes=[req(3, output=1)])) is None  # it finishes


def test_a_colocated_continuation_waits_for_no_prompt() -> None:
    """A colocated scheduler's continuation holds while no prompt waits or is being computed,
    and the batch computes none; the variants' is the same."""
    for cls in (ColocatedScheduler, PrefillFirstScheduler):
        s = cls(PagePool(100, 16), token_budget=64, max_batch=8)
        two_decoding_then(s)
        batch = s.schedule()
        nxt = s.continuation(batch)
        assert nxt is not None and nxt.decodes == batch.decodes
        s.add(req(2, prompt=30, output=5))
        assert s.continuation(batch) is None  # waiting
        batch = s.schedule()
        assert s.continuation(batch) is None  # computing its prompt
        s.complete(batch)
        batch = s.schedule()
        assert [r.id for r in batch.decodes] == [0, 1, 2] and not batch.chunks
        assert s.continuation(batch) is not None


def test_speculative_decoding_emits_fractional_tokens_per_step() -> None:
    s = DecodeScheduler(max_batch=4, tokens_per_step=1.7)
    r = req(0, output=10)
    s.add_ready(r)
    assert steps_to_finish(r, 1.7) == 6  # ceil(10 / 1.7)
    s.complete(s.schedule(), steps=5)
    assert r.generated == pytest.approx(8.5) and not r.done
    assert [x.id for x in s.complete(s.schedule(), steps=1).finished] == [0]
    assert r.generated == 10
    with pytest.raises(ConfigError):
        DecodeScheduler(4, tokens_per_step=0.5)


def test_colocated_decodes_first_then_prefill_fills_the_budget() -> None:
    pool = PagePool(100, 16)
    s = ColocatedScheduler(pool, token_budget=64, max_batch=8)
    s.add(req(0, prompt=40, output=5))
    b = s.schedule()
    assert [(c.req.id, c.tokens, c.last) for c in b.chunks] == [(0, 40, True)]
    assert pool.pages_of(0) == [0, 1, 2]  # prompt + output reserved on admission
    p = s.complete(b)
    assert [r.id for r in p.first_token] == [0] and s.decode.running[0].generated == 1
    s.add(req(1, prompt=100, output=5))
    b = s.schedule()
    assert [r.id for r in b.decodes] == [0]
    assert [(c.req.id, c.tokens) for c in b.chunks] == [(1, 63)]  # 64 - one decode token


def two_decoding_then(s: ColocatedScheduler, *prompts: int) -> None:
    """Requests 0 and 1 decoding (10-token prompts, prefilled in one pass), then `prompts`
    waiting as requests 2, 3, ..."""
    s.add(req(0, prompt=10, output=20))
    s.add(req(1, prompt=10, output=20))
    s.complete(s.schedule())
    assert [r.id for r in s.decode.running] == [0, 1]
    for i, n in enumerate(prompts):
        s.add(req(2 + i, prompt=n, output=5))


def test_prefill_first_runs_whole_prompts_alone_then_the_decodes() -> None:
    s = PrefillFirstScheduler(PagePool(100, 16), token_budget=64, max_batch=8)
    two_decoding_then(s, 100, 30, 20)
    b = s.schedule()  # the 100-token prompt whole, over the budget: the first always goes
    assert not b.decodes and [(c.req.id, c.tokens, c.last) for c in b.chunks] == [(2, 100, True)]
    s.complete(b)
    b = s.schedule()  # 30 + 20 fit the budget of 64 together: one prefill pass
    assert not b.decodes and [(c.req.id, c.tokens) for c in b.chunks] == [(3, 30), (4, 20)]
    s.complete(b)
    b = s.schedule()  # no prompt left: every running request decodes
    assert not b.chunks and [r.id for r in b.decodes] == [0, 1, 2, 3, 4]


def test_decode_priority_keeps_chunks_short_while_decodes_run() -> None:
    s = DecodePriorityScheduler(
        PagePool(100, 16), token_budget=64, max_batch=8, chunk_with_decodes=16
    )
    two_decoding_then(s, 100)
    b = s.schedule()  # chunked would give 62 tokens (64 - 2 decodes); decode priority 16
    assert [r.id for r in b.decodes] == [0, 1]
    assert [(c.req.id, c.tokens) for c in b.chunks] == [(2, 16)]
    lone = DecodePriorityScheduler(
        PagePool(100, 16), token_budget=64, max_batch=8, chunk_with_decodes=16
    )
    lone.add(req(0, prompt=100, output=5))
    assert [(c.req.id, c.tokens) for c in lone.schedule().chunks] == [(0, 64)]  # none decodes


def test_the_colocated_variants_are_chosen_by_name() -> None:
    group = GroupConfig(max_batch=8, token_budget=64, scheduler={"name": "prefill_first"})
    assert isinstance(make_scheduler("colocated", group, PagePool(10, 16)), PrefillFirstScheduler)
    spec = {"name": "decode_priority", "chunk_with_decodes": 32}
    built = make_scheduler("colocated", GroupConfig(scheduler=spec), PagePool(10, 16))
    assert isinstance(built, DecodePriorityScheduler) and built.chunk_with_decodes == 32
    with pytest.raises(ConfigError, match="chunk_with_decodes: Input should be greater than 0"):
        SCHEDULERS.parse({"name": "decode_priority", "chunk_with_decodes": 0})
    with pytest.raises(ConfigError, match="'prefill_first' schedules colocated nodes, not decode"):
        make_scheduler("decode", GroupConfig(scheduler="prefill_first"), PagePool(10, 16))


def test_colocated_waits_for_pages_and_rejects_what_never_fits() -> None:
    pool = PagePool(4, 16)
    s = ColocatedScheduler(pool, token_budget=1000, max_batch=8)
    big = req(0, prompt=60, output=10)  # 5 pages > 4
    s.add(big)
    assert big.status is Status.FAILED and "needs 5 KV pages" in big.fail_reason
    a, b = req(1, prompt=40, output=8), req(2, prompt=30, output=2)
    s.add(a)
    s.add(b)
    batch = s.schedule()
    assert [c.req.id for c in batch.chunks] == [1]  # b waits: 3 + 2 pages > 4
    s.complete(batch)
    s.complete(s.schedule(), steps=7)  # a finishes, its pages come back
    assert pool.used_pages == 0 and a.status is Status.FINISHED
    assert [c.req.id for c in s.schedule().chunks] == [2]


def test_routers() -> None:
    rr = RoundRobin([0, 1, 2])
    assert [rr.pick({}) for _ in range(4)] == [0, 1, 2, 0]
    ll = LeastLoaded([0, 1, 2])
    assert ll.pick({0: 3, 1: 1, 2: 1}) == 1
    import random

    rng = random.Random(5)
    picks = [pick_replica([0, 1, 2, 3], rng) for _ in range(200)]
    assert set(picks) == {0, 1, 2, 3}
    assert picks == [pick_replica([0, 1, 2, 3], r) for r in [random.Random(5)] for _ in range(200)]


def test_each_role_defaults_to_its_scheduler_with_the_group_settings() -> None:
    group, pool = GroupConfig(max_batch=8, token_budget=64), PagePool(100, 16)
    pre = make_scheduler("prefill", group, pool)
    assert type(pre) is PrefillScheduler and (pre.token_budget, pre.max_seqs) == (64, 8)
    dec = make_scheduler("decode", group, pool, tokens_per_step=1.5)
    assert type(dec) is DecodeScheduler and (dec.max_batch, dec.tokens_per_step) == (8, 1.5)
    col = make_scheduler("colocated", group, pool, 1.5, decode_qo=3)
    assert type(col) is ColocatedScheduler and col.pool is pool and col.decode_qo == 3
    assert (col.prefill.token_budget, col.prefill.max_seqs) == (64, 8)
    assert (col.decode.max_batch, col.decode.tokens_per_step) == (8, 1.5)


@dataclass(frozen=True)
class Group:  # any object with these three fields will do (core does not import config)
    scheduler: SchedulerPolicy | None = None
    max_batch: int = 4
    token_budget: int = 32


def test_a_named_scheduler_is_built_for_its_role_only() -> None:
    pool = PagePool(10, 16)
    assert type(make_scheduler("decode", Group(FcfsConfig()), pool)) is DecodeScheduler
    with pytest.raises(ConfigError) as err:
        make_scheduler("prefill", Group(FcfsConfig()), pool)
    assert str(err.value) == (
        "cluster.prefill.scheduler.name: 'fcfs' schedules decode nodes, not prefill; "
        "prefill policies: fifo"
    )
    with pytest.raises(ConfigError, match="unknown role 'mixed'; known: prefill, decode"):
        make_scheduler("mixed", Group(), pool)


def test_scheduler_registry_names_and_errors() -> None:
    assert {"fifo", "fcfs", "chunked"} <= set(SCHEDULERS.classes)
    assert SCHEDULERS.parse("fcfs") == FcfsConfig() == SCHEDULERS.parse({"name": "fcfs"})
    with pytest.raises(ConfigError, match="unknown scheduler policy 'lifo'; known: fifo, fcfs"):
        SCHEDULERS.parse("lifo")
    with pytest.raises(ConfigError, match="'fifo': budget: Extra inputs are not permitted"):
        SCHEDULERS.parse({"name": "fifo", "budget": 3})
    with pytest.raises(ConfigError, match="already registered"):
        SCHEDULERS.register(FcfsConfig)


def test_routers_by_name_or_config() -> None:
    rr = make_router("round_robin", range(3))
    assert type(rr) is RoundRobin and [rr.pick({}) for _ in range(4)] == [0, 1, 2, 0]
    ll = make_router(LeastLoadedConfig(), [4, 5])
    assert type(ll) is LeastLoaded and ll.pick({4: 2.0, 5: 1.0}) == 5
    with pytest.raises(ConfigError, match="unknown router 'random'; known: round_robin, least_"):
        make_router("random", [0])
    with pytest.raises(ConfigError, match="a router needs at least one node"):
        make_router("round_robin", [])
