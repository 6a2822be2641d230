"""End-to-end simulations: everything completes, nothing leaks, same seed same tables."""

from pathlib import Path

import pandas as pd
import pytest

from disagg.config import load_experiment
from disagg.core.metrics import requests_table, steps_table, transfers_table
from disagg.errors import ConfigError
from disagg.hardware import get_nic
from disagg.sim.clock import Clock
from disagg.sim.cluster import Proc, Sim
from disagg.sim.costmodel import StepShape
from disagg.sim.gpu import EXTRA_YIELD_SEQS, SharedGPU, TurnGPU

EXPERIMENTS = Path(__file__).parent.parent / "experiments"
SHORT = ["workload.duration_s=20"]


def simulate(path: str | None, *overrides: str) -> Sim:
    exp = load_experiment(EXPERIMENTS / path if path else None, [*SHORT, *overrides])
    sim = Sim(exp)
    sim.run()
    return sim


def tables(sim: Sim) -> tuple[pd.DataFrame, pd.DataFrame, pd.DataFrame]:
    return requests_table(sim.requests.values()), steps_table(sim.rec), transfers_table(sim.rec)


@pytest.mark.parametrize("path", sorted(p.name for p in EXPERIMENTS.glob("*.toml")))
def test_every_experiment_completes_every_request_without_leaks(path: str) -> None:
    sim = simulate(path)
    req, steps, xfers = tables(sim)
    assert len(req) == len(sim.arrivals) >= 20
    assert (req.status == "finished").all()
    assert (req.first_token_s >= req.arrival_s).all() and (req.finish_s >= req.first_token_s).all()
    assert (req.ttft_s > 0).all()
    for node in [*sim.prefills, *sim.decodes, *sim.colocated]:
        assert node.pool.used_pages == 0
    # every generated token is accounted for by the decode passes (with MTP, 1.7 per pass)
    if sim.exp.cluster.mode == "disagg":
        assert len(xfers) == len(req)
        assert (xfers.end_s >= xfers.start_s).all() and (xfers.bytes > 0).all()
        assert (req.ready_s <= req.first_token_s).all()
        assert (req.prefill_end_s <= req.ready_s + 1e-9).all()
    assert (steps.device_s == steps.duration_s).all()  # the model has no host overhead
    passes = (steps.steps * steps.decode_seqs).sum()
    tps = sim.exp.spec.accepted_tokens_per_step
    assert passes * tps >= req.output_tokens.sum() - len(req) * tps


def held_and_pairs(req: pd.DataFrame, disagg: bool) -> tuple[float, float]:
    """What the passes of finished requests hold, over all of them: the tokens their decode
    passes attend to and their prefill passes' attention pairs. A colocated request of P
    prompt and T output tokens is prefilled whole and in T - 1 decode passes (its first token
    comes with its prefill), of P + 1, ..., P + T - 1 tokens; a disaggregated one's prefill
    node runs P - 1 tokens and its decode node the last in its first pass, of P, ..., P + T - 1."""
    p, t = req.prompt_tokens - disagg, req.output_tokens - (not disagg)
    return float((t * (p + 1) + t * (t - 1) / 2).sum()), float((p * (p + 1) / 2).sum())


@pytest.mark.parametrize("path", ["llama8b-h200.toml", "tiny-disagg.toml"])
def test_a_steps_row_gives_the_shape_its_passes_were_costed_at(path: str) -> None:
    """Each one-pass row's shape columns, read back by the node's cost model, give the row's
    duration; over all rows (a run of k passes holds k contexts, each the last's plus its
    decodes) they hold every decode pass's tokens and every prompt's attention pairs."""
    sim = simulate(path, "workload.duration_s=10")
    req, steps, _ = tables(sim)
    assert (req.status == "finished").all() and len(req) > 10
    for row in steps[steps.steps == 1].itertuples():
        shape = StepShape(
            row.prefill_tokens, row.prefill_attn_pairs, row.decode_seqs, row.decode_context
        )
        assert sim.by_name[row.node].cost.step_time(shape) == pytest.approx(row.duration_s)
    k, d = steps.steps, steps.decode_seqs
    held = (k * steps.decode_context + d * k * (k - 1) / 2).sum()
    want = held_and_pairs(req, sim.exp.cluster.mode == "disagg")
    assert (held, steps.prefill_attn_pairs.sum()) == pytest.approx(want, rel=1e-12)
    assert (steps.steps > 1).any() and (steps.prefill_tokens > 0).any()
    assert steps[["host_before_s", "launch_s"]].isna().all(axis=None)  # the hw's to measure


def test_same_seed_gives_identical_tables_and_another_seed_does_not() -> None:
    a, b = tables(simulate("r1-disagg-dp8.toml")), tables(simulate("r1-disagg-dp8.toml"))
    for x, y in zip(a, b, strict=True):
        pd.testing.assert_frame_equal(x, y)
    c = tables(simulate("r1-disagg-dp8.toml", "seed=2"))
    assert not a[0].equals(c[0])


def test_layerwise_transfer_overlaps_prefill_and_whole_request_waits() -> None:
    # a slower wire (EFA) and a sharding mismatch (TP8 -> TP4): transfers cost milliseconds
    slow = ["hardware.nic=EFA", "cluster.decode.tp=4", "cluster.decode.dp=2"]
    layer = tables(simulate("qwen3coder-disagg-1p3d.toml", *slow))[0]
    whole = tables(simulate("qwen3coder-disagg-1p3d.toml", *slow, "transfer.policy=whole"))[0]
    # one layer's transfer after the pass vs the whole cache's (the decoder counts what
    # landed once its pass in flight ends: a decode pass is the median's floor)
    gap_layer, gap_whole = ((t.ready_s - t.prefill_end_s) for t in (layer, whole))
    assert gap_layer.min() < 0.0001 < 0.003 < gap_whole.min()
    assert gap_layer.median() + 0.005 < gap_whole.median()
    assert whole.ttft_s.median() > layer.ttft_s.median()


def test_parallel_handoff_takes_the_control_hop_off_ttft() -> None:
    """The prefill starts after the driver's hop alone, not the decoder's too; the decoder's
    pages land mid-pass and, as a hw server handles messages between passes, what the pass
    produced is posted at its end (a catch-up post), so the KV lands later after the pass than
    layer by layer, and TTFT gains less than the prefill's start (no page leaked:
    Sim.check_end)."""
    hop = "transfer.control_latency_s=0.005"
    first = tables(simulate("qwen3coder-disagg-1p3d.toml", hop))[0].set_index("request_id")
    sim = simulate("qwen3coder-disagg-1p3d.toml", hop, "transfer.handoff=parallel")
    both = tables(sim)[0].set_index("request_id")
    assert (both.status == "finished").all() and len(both) == len(first) >= 20
    assert (both.prefill_start_s - both.arrival_s).min() == pytest.approx(0.005)  # one hop
    assert (first.prefill_start_s - first.arrival_s).min() >= 2 * 0.005 - 1e-9  # two
    landed = [(r.ready_s - r.prefill_end_s).median() for r in (first, both)]
    assert landed[0] + 0.001 < landed[1]
    started = first.prefill_start_s - both.prefill_start_s  # the decoder's hop and its wait
    saved = first.ttft_s - both.ttft_s
    assert started.median() >= 0.005 and 0 < saved.median() < started.median()


def test_parallel_handoff_under_memory_pressure_evicts_early_starts_and_loses_nothing() -> None:
    # decode pools far too small for the load: early starts hold their KV on the prefill node
    # until a decoder has pages, fill its pool, and some are evicted (and recomputed) to make
    # room for requests whose pages came (Sim.check_end: no leaks, nothing stuck)
    tight = ["workload.rate_per_s=30", "kv.memory_fraction=0.53"]
    sim = simulate("qwen3coder-disagg-1p3d.toml", *tight, "transfer.handoff=parallel")
    req = tables(sim)[0]
    assert (req.status == "finished").all() and len(req) == len(sim.arrivals) >= 500
    assert sim.prefills[0].role.messenger.evicted > 0
    assert (req.ready_s - req.arrival_s).median() > 2.0  # the decoders' queue


def test_nhd_under_a_head_mismatch_posts_more_writes_than_hnd() -> None:
    tp4 = ("cluster.decode.tp=4", "cluster.decode.dp=2")  # two TP4 groups per node
    hnd = tables(simulate("qwen3coder-disagg-1p3d.toml", *tp4))[2]
    nhd = tables(simulate("qwen3coder-disagg-1p3d.toml", *tp4, "kv.layout=NHD"))[2]
    assert nhd.ops.sum() > 10 * hnd.ops.sum()
    assert nhd.bytes.sum() == hnd.bytes.sum()


def test_mtp_accepting_more_tokens_shortens_decode() -> None:
    one = tables(simulate("r1-disagg-1p3d.toml", "spec.accepted_tokens_per_step=1.0"))[0]
    two = tables(simulate("r1-disagg-1p3d.toml", "spec.accepted_tokens_per_step=2.0"))[0]
    assert two.tpot_s.median() < 0.7 * one.tpot_s.median()


@pytest.mark.parametrize("handoff", ["decode-first", "parallel"])
def test_a_request_that_cannot_fit_fails_with_a_reason_and_nothing_is_lost(handoff: str) -> None:
    # the prompt fits the prefill pool (3,328 tokens), prompt + output never fit the decoder's:
    # under parallel handoff the prefill has started by the refusal and is cancelled
    sim = simulate(
        None,
        f"transfer.handoff={handoff}",
        "model.name=llama-3.1-8b",
        "model.weight_dtype=bf16",
        "cluster.prefill.tp=1",
        "cluster.decode.tp=1",
        "hardware.gpu=H100-SXM",
        "kv.memory_fraction=0.3",
        "kv.activation_reserve_gb=7.5",
        "workload.prompt_tokens.dist=fixed",
        "workload.prompt_tokens.value=3000",
        "workload.prompt_tokens.mean=null",
        "workload.prompt_tokens.sigma=null",
        "workload.prompt_tokens.low=null",
        "workload.prompt_tokens.high=null",
        "workload.output_tokens.dist=fixed",
        "workload.output_tokens.value=8000",
        "workload.output_tokens.mean=null",
        "workload.output_tokens.sigma=null",
        "workload.output_tokens.low=null",
        "workload.output_tokens.high=null",
    )
    req, steps = tables(sim)[:2]
    assert len(req) == len(sim.arrivals) and (req.status == "failed").all()
    assert req.fail_reason.str.contains("KV pages on decode node").all()
    prefills = steps[steps.node.str.startswith("prefill")]
    assert (len(prefills) > 0) == (handoff == "parallel")  # started, then cancelled


def test_a_transfer_past_its_timeout_is_retried_then_fails_with_the_reason_hw_gives() -> None:
    """A 1 ms timeout against the tiny model's 3 ms passes: every transfer times out, is
    retried once, then fails. The reason is the core decode role's, which the hw decoder runs
    too (tests/test_roles.py drives it through the same path)."""
    sim = simulate("tiny-disagg.toml", "transfer.timeout_s=0.001", "transfer.max_attempts=2")
    req = tables(sim)[0]
    long = req[req.prompt_tokens > 1]
    assert len(long) == len(sim.arrivals) and (long.status == "failed").all()
    assert (long.attempts == 2).all()
    # the reason names the timeout (and, where the cancel itself went unanswered for another
    # timeout, says so) and the attempts
    assert long.fail_reason.str.startswith("transfer timed out after 0.001 s").all()
    assert long.fail_reason.str.endswith("(after 2 attempts)").all()
    for node in [*sim.prefills, *sim.decodes]:
        assert node.pool.used_pages == 0


def test_transfers_within_the_timeout_are_untouched_by_it() -> None:
    a = tables(simulate("tiny-disagg.toml"))
    b = tables(simulate("tiny-disagg.toml", "transfer.timeout_s=1e6"))
    for x, y in zip(a, b, strict=True):
        pd.testing.assert_frame_equal(x, y)
    assert (a[0].status == "finished").all()


def test_a_pool_given_is_the_pool_simulated_and_one_too_big_is_a_config_error() -> None:
    sim = Sim(load_experiment(EXPERIMENTS / "tiny-disagg.toml", ["kv.pages=77"]))
    assert [n.pool.num_pages for n in sim.nodes] == [77, 77]
    with pytest.raises(ConfigError, match=r"kv.pages=10000000000: a cluster.prefill node"):
        Sim(load_experiment(EXPERIMENTS / "r1-disagg-1p3d.toml", ["kv.pages=10000000000"]))


def test_a_model_that_does_not_fit_is_a_config_error() -> None:
    with pytest.raises(ConfigError, match="does not fit"):
        Sim(
            load_experiment(
                None,
                [
                    "model.name=llama-3.1-70b",
                    "model.weight_dtype=bf16",
                    "cluster.prefill.tp=1",
                    "cluster.decode.tp=1",
                    "hardware.gpu=H100-SXM",
                ],
            )
        )


def test_the_cuda_wire_entries_simulate_one_host_faster_than_a_network() -> None:
    """Llama-8B prefill and decode on one host: over the cuda wire's measured figures
    (`cuda-H200`, `NVLink-H200`) a whole request's KV is ready after its prefill in the
    entry's latency + bytes / bandwidth + writes x cost per write, as over a ConnectX-7 NIC,
    and so much sooner."""
    one_host = [
        "model.name=llama-3.1-8b",
        "model.layers=32",
        "transfer.policy=whole",
        "workload.prompt_tokens.low=2000",
        "workload.prompt_tokens.high=2100",
        "workload.rate_per_s=2",
    ]
    gaps = {}
    for nic in ("ConnectX-7", "NVLink-H200", "cuda-H200"):
        sim = simulate("tiny-disagg.toml", *one_host, f"hardware.nic={nic}")
        req, _, xfers = tables(sim)
        assert (req.status == "finished").all() and len(req) >= 20
        req, xfers = req.set_index("request_id"), xfers.set_index("request_id")
        gap = req.ready_s - req.prefill_end_s
        spec = get_nic(nic)
        want = spec.latency_s + xfers.bytes / spec.bandwidth_bps + xfers.ops * spec.op_cost_s
        assert gap.to_numpy() == pytest.approx(want.loc[gap.index].to_numpy(), rel=0.05)
        gaps[nic] = float(gap.mean())
    assert gaps["ConnectX-7"] > 3 * gaps["NVLink-H200"]
    assert gaps["NVLink-H200"] > 1.2 * gaps["cuda-H200"]


def test_a_kv_pool_that_does_not_fit_names_the_kv_fields_and_what_would_fit() -> None:
    """R1 in fp8 is 671 GB of weights, 83.9 GB per GPU of TP 8: 30% of an H200's 141 GB cannot
    hold them; the message names both kv fields with their values and the fraction that fits,
    and that fraction does fit."""
    with pytest.raises(ConfigError) as err:
        Sim(load_experiment(None, ["kv.memory_fraction=0.3"]))
    msg = str(err.value)
    assert msg.startswith("cluster.prefill: deepseek-r1 does not fit on H200-SXM: ")
    assert "kv.memory_fraction=0.3 of 141 GB is 42.3 GB per GPU, less than 83.9 GB" in msg
    assert "kv.activation_reserve_gb=8.0 + one KV page" in msg
    assert msg.endswith("kv.memory_fraction >= 0.652 would fit")
    assert Sim(load_experiment(None, ["kv.memory_fraction=0.652"])).nodes[0].pool.num_pages >= 1
    with pytest.raises(ConfigError, match=r"activation_reserve_gb <= 63.9 would fit"):
        Sim(
            load_experiment(
                None,
                [
                    "model.name=llama-3.1-8b",
                    "model.weight_dtype=bf16",
                    "cluster.prefill.tp=1",
                    "cluster.decode.tp=1",
                    "hardware.gpu=H100-SXM",
                    "kv.activation_reserve_gb=70",
                ],
            )
        )


def test_a_trace_request_beyond_the_models_context_is_refused_not_simulated(
    tmp_path: Path,
) -> None:
    trace = tmp_path / "t.csv"
    trace.write_text(
        "TIMESTAMP,ContextTokens,GeneratedTokens\n"
        "2024-01-01 00:00:01,100,10\n2024-01-01 00:00:02,32760,10\n"
    )
    exp = load_experiment(EXPERIMENTS / "tiny-disagg.toml", [f"workload.trace={trace}"])
    assert exp.model.spec.max_context == 32768
    with pytest.raises(
        ConfigError, match=r"request 1 .*32,770 tokens exceed tiny-gqa.s context of 32,768"
    ):
        Sim(exp)


def _overlaps(steps: pd.DataFrame) -> int:
    """Pairs of passes of different nodes that overlap in time."""
    s = steps.sort_values("start_s").reset_index(drop=True)
    ends = s.start_s + s.duration_s
    return sum(
        int(((s.start_s[i + 1 :] < ends[i] - 1e-12) & (s.node[i + 1 :] != s.node[i])).sum())
        for i in range(len(s))
    )


def _ends(
    passes: list[tuple[float, float, bool]] | list[tuple[float, float, bool, int]],
    share: float,
    prefill: float | None = None,
    switch_s: float | None = None,
    extra: float = 0.0,
    shape: tuple[tuple[float, float], ...] = (),
    share_shape: tuple[tuple[float, float], ...] = (),
    wide: float = 1.0,
    share_wide: float = 1.0,
) -> list[float]:
    """When each (start, seconds alone, decode-only[, decode sequences]) pass ends on a
    SharedGPU (`extra`: its chunk_extra_s, `shape` its chunk_extra_shape, `share_shape` its
    decode_share_shape, `wide` its chunk_extra_wide, `share_wide` its decode_share_wide)."""
    env, ends = Clock(), [0.0] * len(passes)
    rule = (extra, shape, share_shape, wide, share_wide)
    gpu = SharedGPU(env, share, prefill, switch_s, 1.0, *rule)

    def one(i: int, start: float, seconds: float, decode_only: bool, seqs: int = 1) -> Proc:
        yield start
        yield from gpu.run(seconds, decode_only, seqs=seqs if decode_only else 0)
        ends[i] = env.now

    for i, p in enumerate(passes):
        env.start(one(i, *p))
    env.run()
    return ends


def test_passes_sharing_a_gpu_advance_at_their_weights() -> None:
    """Hand arithmetic, decode share 0.25: a 6 ms decode beside a 30 ms prefill runs at 1/4 and
    ends at 24 ms, when the prefill has done 18 ms at 3/4 and runs its last 12 alone (36 ms:
    the work is conserved). A decode starting at 10 ms, when the prefill has 20 ms left: it
    ends at 10 + 24 = 34, the prefill (18 more done) at 36. Alone, a pass takes its time."""
    assert _ends([(0.0, 6e-3, True), (0.0, 30e-3, False)], 0.25) == pytest.approx(
        [24e-3, 36e-3], abs=1e-12
    )
    assert _ends([(10e-3, 6e-3, True), (0.0, 30e-3, False)], 0.25) == pytest.approx(
        [34e-3, 36e-3], abs=1e-12
    )
    assert _ends([(0.0, 6e-3, True)], 0.25) == pytest.approx([6e-3], abs=1e-15)
    # two decodes and a prefill: weights 1/4, 1/4, 3/4; the 2 ms decode ends at 2 / (1/5) = 10
    # ms, the other (4 ms, 2 done) at 10 + 2 / (1/4) = 18, the prefill (30 ms) at 36
    ends = _ends([(0.0, 2e-3, True), (0.0, 4e-3, True), (0.0, 30e-3, False)], 0.25)
    assert ends == pytest.approx([10e-3, 18e-3, 36e-3], abs=1e-12)
    # two decodes alone split the GPU evenly, whatever the share
    assert _ends([(0.0, 2e-3, True), (0.0, 4e-3, True)], 0.1) == pytest.approx(
        [4e-3, 6e-3], abs=1e-12
    )


def test_a_gpu_whose_passes_fill_each_others_gaps_does_more_than_one_alone() -> None:
    """Hand arithmetic, decode share 0.25 and prefill share 0.85 (capacity 1.1): a 6 ms decode
    beside a 30 ms prefill runs at 0.25 and ends at 24 ms, when the prefill has done 20.4 ms
    at 0.85; its last 9.6 ms alone end at 33.6 ms. Beside two decodes the paces are 1.1 x
    weight / 1.35. Two decodes alone run at 1.1 x 0.25 / 0.5 = 0.55 each, and a pass alone at
    full speed, never faster."""
    assert _ends([(0.0, 6e-3, True), (0.0, 30e-3, False)], 0.25, 0.85) == pytest.approx(
        [24e-3, 33.6e-3], abs=1e-12
    )
    decode, prefill = 1.1 * 0.25 / 1.35, 1.1 * 0.85 / 1.35
    ends = _ends([(0.0, 2e-3, True), (0.0, 2e-3, True), (0.0, 30e-3, False)], 0.25, 0.85)
    first = 2e-3 / decode  # both decodes end together; the prefill then runs alone
    assert ends == pytest.approx([first, first, first + 30e-3 - first * prefill], abs=1e-12)
    assert _ends([(0.0, 2e-3, True), (0.0, 4e-3, True)], 0.25, 0.85) == pytest.approx(
        [2e-3 / 0.55, 2e-3 / 0.55 + 2e-3], abs=1e-12
    )
    assert _ends([(0.0, 30e-3, False)], 0.25, 0.85) == pytest.approx([30e-3], abs=1e-15)


def test_a_chunk_pass_takes_the_extra_once_it_meets_another_pass() -> None:
    """Hand arithmetic, decode share 0.25, prefill share 1 (capacity 1.25: the chunk pass runs
    at full pace, a decode beside it at 0.25) and a chunk extra of 10 ms. A 30 ms chunk pass
    from 0 meets a 6 ms decode begun at 10 ms: 20 ms left + 10 extra, so it ends at 40 ms, and
    the decode at 10 + 6 / 0.25 = 34. Begun beside a decode, it has the extra from its start,
    once: a second decode begun at 25 ms (ending at 25 + 2 / 0.25 = 33) adds none. Meeting no
    pass, it takes its time."""
    late = [(0.0, 30e-3, False), (10e-3, 6e-3, True)]
    assert _ends(late, 0.25, 1.0, extra=10e-3) == pytest.approx([40e-3, 34e-3], abs=1e-12)
    beside = [(0.0, 6e-3, True), (0.0, 30e-3, False), (25e-3, 2e-3, True)]
    assert _ends(beside, 0.25, 1.0, extra=10e-3) == pytest.approx([24e-3, 40e-3, 33e-3], abs=1e-12)
    assert _ends([(0.0, 30e-3, False)], 0.25, 1.0, extra=10e-3) == pytest.approx([30e-3])
    # a chunk pass after it, begun alone at 45 ms and met by nothing: its time
    after = [*late, (45e-3, 30e-3, False)]
    assert _ends(after, 0.25, 1.0, extra=10e-3)[2] == pytest.approx(75e-3, abs=1e-12)


def test_a_chunk_pass_beside_a_wide_decode_pass_takes_the_extra_times_its_factor() -> None:
    """Hand arithmetic, decode share 0.25, prefill share 1 (capacity 1.25), a chunk extra of
    10 ms, 0.5 of it beside a decode pass of more than EXTRA_YIELD_SEQS sequences. A 30 ms
    chunk pass from 0 meets a 6 ms decode of 17 sequences at 10 ms: 20 ms left + 5 extra, so
    it ends at 35 ms (the decode at 10 + 6 / 0.25 = 34); of 16 sequences, at 40 ms. Begun
    beside two decodes, of 1 and 17 sequences, it takes the widest's extra and runs at
    1.25 / 1.5: (30 + 5) / (1.25 / 1.5) = 42 ms. The first decode it meets decides: begun
    beside one of 1 sequence (1.25 ms alone, at 0.25: over at 5 ms), it keeps its 10 ms when
    a wide one comes at 10 ms, and ends at 40 ms."""
    wide = EXTRA_YIELD_SEQS + 1
    for seqs, end in ((wide, 35e-3), (EXTRA_YIELD_SEQS, 40e-3)):
        late = [(0.0, 30e-3, False, 0), (10e-3, 6e-3, True, seqs)]
        got = _ends(late, 0.25, 1.0, extra=10e-3, wide=0.5)
        assert got == pytest.approx([end, 34e-3], abs=1e-12)
    beside = [(0.0, 1.0, True, 1), (0.0, 1.0, True, wide), (0.0, 30e-3, False, 0)]
    assert _ends(beside, 0.25, 1.0, extra=10e-3, wide=0.5)[2] == pytest.approx(42e-3, abs=1e-12)
    narrow_first = [(0.0, 1.25e-3, True, 1), (0.0, 30e-3, False, 0), (10e-3, 1.0, True, wide)]
    ends = _ends(narrow_first, 0.25, 1.0, extra=10e-3, wide=0.5)
    assert ends[:2] == pytest.approx([5e-3, 40e-3], abs=1e-12)


def test_a_chunk_pass_takes_the_extra_its_time_alone_gives_on_the_shape() -> None:
    """Hand arithmetic, decode share 0.25, prefill share 1, a chunk extra of 10 ms shaped 0.5
    at 10 ms alone and 1 at 30 ms. A 20 ms chunk pass from 0 meets a 6 ms decode begun at
    10 ms: its extra is 10 x 0.75 = 7.5 ms, so it ends at 10 + 10 + 7.5 = 27.5 ms; the decode
    does 17.5 x 0.25 = 4.375 ms of its work by then and its last 1.625 alone. The shape holds
    at its ends: a 5 ms pass beside a decode takes 5 ms more, a 40 ms one 10 ms more."""
    shape = ((0.010, 0.5), (0.030, 1.0))
    late = [(0.0, 20e-3, False), (10e-3, 6e-3, True)]
    assert _ends(late, 0.25, 1.0, extra=10e-3, shape=shape) == pytest.approx(
        [27.5e-3, 29.125e-3], abs=1e-12
    )
    for alone, extra in ((5e-3, 5e-3), (40e-3, 10e-3)):
        beside = [(0.0, 1.0, True), (0.0, alone, False)]  # a decode of 1 s: beside throughout
        ends = _ends(beside, 0.25, 1.0, extra=10e-3, shape=shape)
        assert ends[1] == pytest.approx(alone + extra, abs=1e-12)


def test_a_decode_pass_weighs_the_share_the_chunk_beside_it_gives_on_the_shape() -> None:
    """Hand arithmetic, decode share 0.25, prefill share 1, the decode share shaped 2 at 10 ms
    alone and 1 at 30 ms. A 6 ms decode beside a 10 ms chunk pass weighs 0.5 (capacity 1.5):
    it runs at 1.5 x 0.5 / 1.5 = 0.5 and the chunk at full pace, so the chunk ends at 10 ms
    and the decode, 5 ms done, at 11. Beside a 20 ms chunk it weighs 0.375 and ends at
    6 / 0.375 = 16 ms; beside a 30 ms one, 0.25: 24 ms. When a 30 ms chunk follows the 10 ms
    one at 10 ms, the decode's last 1 ms runs at 0.25: it ends at 14 ms. Round robin: no
    shape."""
    shape = ((0.010, 2.0), (0.030, 1.0))
    for chunk_s, decode_end in ((10e-3, 11e-3), (20e-3, 16e-3), (30e-3, 24e-3)):
        ends = _ends([(0.0, 6e-3, True), (0.0, chunk_s, False)], 0.25, 1.0, share_shape=shape)
        assert ends == pytest.approx([decode_end, chunk_s], abs=1e-12)
    two = [(0.0, 6e-3, True), (0.0, 10e-3, False), (10e-3, 30e-3, False)]
    assert _ends(two, 0.25, 1.0, share_shape=shape) == pytest.approx([14e-3, 10e-3, 40e-3])
    # beside no chunk pass, no factor: two decodes run at 1.25 x 0.25 / 0.5 = 0.625 each
    decodes = [(0.0, 2e-3, True), (0.0, 4e-3, True)]
    assert _ends(decodes, 0.25, 1.0, share_shape=shape) == pytest.approx([3.2e-3, 5.2e-3])
    rr = [(0.0, 6e-3, True), (0.0, 30e-3, False)]
    assert _ends(rr, 0.9, switch_s=4e-3, share_shape=shape) == pytest.approx([40e-3, 40e-3])


def test_a_wide_decode_pass_beside_a_chunk_weighs_its_factor_of_the_decode_share() -> None:
    """Hand arithmetic, decode share 0.25, prefill share 1 (capacity 1.25), 0.5 of the share
    for a decode pass of more than EXTRA_YIELD_SEQS sequences. A 6 ms decode of 17 beside a
    30 ms chunk weighs 0.125: it runs at 1.25 x 0.125 / 1.125 = 1/7.2 and has done 30 / 7.2 ms
    when the chunk ends at 30 ms (at full pace), then its last 6 - 30 / 7.2 alone: 31.83 ms.
    Of 16 sequences, it weighs 0.25, runs at 0.25 and ends at 24 ms. Beside no chunk the
    factor is unused: two decodes of 17 and 1 sequences run at 0.625 each."""
    wide = EXTRA_YIELD_SEQS + 1
    beside = [(0.0, 6e-3, True, wide), (0.0, 30e-3, False, 0)]
    ends = _ends(beside, 0.25, 1.0, share_wide=0.5)
    assert ends == pytest.approx([30e-3 + 6e-3 - 30e-3 / 7.2, 30e-3], abs=1e-12)
    narrow = [(0.0, 6e-3, True, EXTRA_YIELD_SEQS), (0.0, 30e-3, False, 0)]
    assert _ends(narrow, 0.25, 1.0, share_wide=0.5) == pytest.approx([24e-3, 30e-3], abs=1e-12)
    decodes = [(0.0, 2e-3, True, wide), (0.0, 4e-3, True, 1)]
    assert _ends(decodes, 0.25, 1.0, share_wide=0.5) == pytest.approx([3.2e-3, 5.2e-3])


def test_passes_taking_turns_advance_at_their_part_of_all_their_time() -> None:
    """Hand arithmetic, round robin at switch_s 4 ms (the shares unused): a 6 ms decode and a
    30 ms prefill from 0 advance at 6/40 and 30/40 and both end at 40 ms, the sum of their
    times and the switch cost. A decode starting at 10 ms, when the prefill has 20 ms left:
    the prefill ends at 10 + 20 / (30/40) = 36.67 ms, the decode (4 ms done by then) runs its
    last 2 alone and ends at 38.67. Three passes pay 1.5 switches: 2 + 2 + 2 ms end at 12."""
    two = [(0.0, 6e-3, True), (0.0, 30e-3, False)]
    assert _ends(two, 0.9, switch_s=4e-3) == pytest.approx([40e-3, 40e-3], abs=1e-12)
    later = [(10e-3, 6e-3, True), (0.0, 30e-3, False)]
    assert _ends(later, 0.9, switch_s=4e-3) == pytest.approx(
        [38e-3 + 2e-3 / 3, 36e-3 + 2e-3 / 3], abs=1e-12
    )
    three = [(0.0, 2e-3, True), (0.0, 2e-3, True), (0.0, 2e-3, False)]
    assert _ends(three, 0.9, switch_s=4e-3) == pytest.approx([12e-3] * 3, abs=1e-12)
    assert _ends([(0.0, 30e-3, False)], 0.9, switch_s=4e-3) == pytest.approx([30e-3], abs=1e-15)
    # at no switch cost the GPU's work is conserved: both end at 36 ms
    assert _ends(two, 0.9, switch_s=0.0) == pytest.approx([36e-3, 36e-3], abs=1e-12)


def _host_ends(before: float) -> list[float]:
    """When a decode pass of 2 ms host and 6 ms device and a prefill pass of 30 ms device, both
    from 0, end on a GPU taking turns at 4 ms, `before` of the host time first."""
    env, ends = Clock(), [0.0, 0.0]
    gpu = SharedGPU(env, 0.9, None, 4e-3, before)

    def one(i: int, device_s: float, host_s: float, decode_only: bool) -> Proc:
        yield from gpu.run(device_s, decode_only, host_s)
        ends[i] = env.now

    env.start(one(0, 6e-3, 2e-3, True))
    env.start(one(1, 30e-3, 0.0, False))
    env.run()
    return ends


def test_a_passs_host_time_runs_beside_the_turns_before_and_after_its_device_time() -> None:
    """Hand arithmetic (`_host_ends`). All the decode's host time first: the prefill runs alone
    for 2 ms, then at 30/40 ends at 2 + 28 / 0.75 = 39.33 ms, and the decode, 5.6 ms done at
    6/40, runs its last 0.4 alone to 39.73. All after: both at 6/40 and 30/40 end at 40 ms,
    the decode's host then to 42. Half: the prefill ends at 1 + 29 / 0.75 = 39.67, the
    decode's device at 39.87 and its host at 40.87."""
    assert _host_ends(1.0) == pytest.approx([39.6e-3 + 0.4e-3 / 3, 39e-3 + 1e-3 / 3], abs=1e-12)
    assert _host_ends(0.0) == pytest.approx([42e-3, 40e-3], abs=1e-12)
    assert _host_ends(0.5) == pytest.approx([40.8e-3 + 0.2e-3 / 3, 39.6e-3 + 0.2e-3 / 3], abs=1e-12)


def _turn_ends(passes: list[tuple[float, float, bool, float]]) -> tuple[list[float], TurnGPU]:
    """When each (start, seconds alone, decode-only, host seconds) pass ends on a TurnGPU of
    2 ms slices, 0.5 ms switches, 4 turns a chunk and all host time first."""
    env, ends = Clock(), [0.0] * len(passes)
    gpu = TurnGPU(env, 2e-3, 0.5e-3, 4, 1.0)

    def one(i: int, start: float, seconds: float, decode_only: bool, host_s: float) -> Proc:
        yield start
        yield from gpu.run(seconds, decode_only, host_s or None)
        ends[i] = env.now

    for i, p in enumerate(passes):
        env.start(one(i, *p))
    env.run()
    return ends, gpu


def test_passes_on_a_time_sliced_gpu_take_turns_a_layer_or_a_slice_at_a_time() -> None:
    """Hand arithmetic, the turns rule (`_turn_ends`). A 5 ms decode pass is a yield, 2 + 2 + 1
    ms and a yield (of more than 16 sequences, two yields first); an 8 ms chunk pass four 2 ms
    layers. Both from 0: the decode yields, the chunk's layers run at 0.5-2.5, 5.5-7.5,
    10.5-12.5 and 14.5-16.5 ms between the decode's slices (3-5, 8-10, 13-14), and the
    decode's last yield waits for the chunk's last layer:
    it ends at 17 ms, the chunk at 16.5. Alone, each takes its time, with no switch."""
    both, gpu = _turn_ends([(0.0, 5e-3, True, 0.0), (0.0, 8e-3, False, 0.0)])
    assert both == pytest.approx([17e-3, 16.5e-3], abs=1e-12)
    assert gpu.shared == 2 and gpu.lost_s == pytest.approx(12e-3 + 8.5e-3, abs=1e-12)
    assert gpu.turns(5e-3, True) == pytest.approx([0.0, 2e-3, 2e-3, 1e-3, 0.0], abs=1e-15)
    assert gpu.turns(8e-3, False) == pytest.approx([2e-3] * 4, abs=1e-15)
    # beside more than 16 sequences a decode pass yields twice before its device time
    assert gpu.turns(5e-3, True, 16) == pytest.approx([0.0, 2e-3, 2e-3, 1e-3, 0.0], abs=1e-15)
    assert gpu.turns(5e-3, True, 17) == pytest.approx([0, 0, 2e-3, 2e-3, 1e-3, 0], abs=1e-15)
    assert _turn_ends([(0.0, 5e-3, True, 0.0)])[0] == pytest.approx([5e-3], abs=1e-15)
    assert _turn_ends([(0.0, 8e-3, False, 0.0)])[0] == pytest.approx([8e-3], abs=1e-15)
    # a decode pass of 1 ms host, then its turns: the chunk runs its first layer alone (0-2
    # ms), the decode's turns come between its next (2.5 yield; 5.5-7.5, 10.5-12.5) and the
    # chunk's last layer ends at 15 ms, the decode's last 1 ms at 16.5 (its yield free after)
    host, _ = _turn_ends([(0.0, 5e-3, True, 1e-3), (0.0, 8e-3, False, 0.0)])
    assert host == pytest.approx([16.5e-3, 15e-3], abs=1e-12)


def test_a_chunk_pass_on_a_time_sliced_gpu_expects_a_layer_a_decode_yield() -> None:
    """expected_s (the pace of a chunk pass's layer-wise sends): alone its time; just after a 5
    ms decode pass (five yields a pass), 4 layers of 2 + 2 x 0.5 ms and 4/5 of a decode pass
    each: 12 + 4 = 16 ms."""
    env = Clock()
    gpu = TurnGPU(env, 2e-3, 0.5e-3, 4, 1.0)
    assert gpu.expected_s(8e-3, False) == pytest.approx(8e-3)

    def decode() -> Proc:
        yield from gpu.run(5e-3, True)

    env.start(decode())
    env.run()
    assert env.now == pytest.approx(5e-3)
    assert gpu.expected_s(8e-3, False) == pytest.approx(16e-3, abs=1e-12)
    assert gpu.expected_s(5e-3, True) == pytest.approx(5e-3)


def test_nodes_on_a_time_sliced_gpu_finish_and_slow_each_other() -> None:
    """cluster.turn_slice_s: every request finishes; beside the prefills the decodes take
    longer than on a GPU of their own, and a shorter slice (more turns for the chunks) slows
    the decodes further and speeds the prefills."""
    base = ("qwen3moe-h200-1p3d.toml", "cluster.shared_gpu=true", "cluster.switch_s=1e-4")
    long, short = (simulate(*base, f"cluster.turn_slice_s={s}") for s in (0.01, 0.001))
    own = tables(simulate("qwen3moe-h200-1p3d.toml"))[0]
    for sim in (long, short):
        assert isinstance(sim.gpu, TurnGPU) and sim.gpu.shared > 0
        assert (tables(sim)[0].status == "finished").all()
    a, b = tables(long)[0], tables(short)[0]
    assert a.tpot_s.median() > own.tpot_s.median()
    assert b.tpot_s.median() > a.tpot_s.median()
    assert b.ttft_s.median() < a.ttft_s.median()


def test_nodes_on_a_shared_gpu_slow_each_other_by_their_shares() -> None:
    """cluster.shared_gpu (a hw run on one device): passes of different nodes still overlap,
    but those that do take longer than alone, and a larger decode share trades prefill speed
    (TTFT) for decode speed (TPOT); every request still finishes."""
    own = simulate("qwen3moe-h200-1p3d.toml")
    low, high = (
        simulate("qwen3moe-h200-1p3d.toml", "cluster.shared_gpu=true", f"cluster.decode_share={s}")
        for s in (0.2, 0.8)
    )
    assert own.gpu is None and "gpu_shared_passes" not in own.network_summary()
    for sim in (low, high):
        assert sim.gpu is not None and sim.gpu.shared > 0 and sim.gpu.lost_s > 0
        assert sim.network_summary()["gpu_shared_passes"] == sim.gpu.shared
        assert _overlaps(tables(sim)[1]) > 0
        assert (tables(sim)[0].status == "finished").all()
        assert (tables(sim)[1].query("kind == 'decode'").steps == 1).all()
    req = {name: tables(sim)[0] for name, sim in (("own", own), ("low", low), ("high", high))}
    assert req["low"].tpot_s.median() > req["high"].tpot_s.median() > req["own"].tpot_s.median()
    assert req["high"].ttft_s.median() > req["low"].ttft_s.median()


def test_nodes_taking_turns_on_a_shared_gpu_lose_more_as_the_switch_costs_more() -> None:
    """The round robin (cluster.switch_s): every request still finishes, and a dearer switch
    slows both the decodes (TPOT) and the prefills (TTFT) beside them."""
    base = ("qwen3moe-h200-1p3d.toml", "cluster.shared_gpu=true")
    cheap, dear = (simulate(*base, f"cluster.switch_s={s}") for s in (0.0, 0.01))
    for sim in (cheap, dear):
        assert sim.gpu is not None and sim.gpu.switch_s is not None and sim.gpu.shared > 0
        assert (tables(sim)[0].status == "finished").all()
    assert dear.gpu is not None and cheap.gpu is not None and dear.gpu.lost_s > cheap.gpu.lost_s
    low, high = tables(cheap)[0], tables(dear)[0]
    assert high.tpot_s.median() > low.tpot_s.median()
    assert high.ttft_s.median() > low.ttft_s.median()
