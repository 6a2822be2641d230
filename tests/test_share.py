"""The decode share of a shared GPU, fitted from steps tables (disagg.share)."""

from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from disagg.config import Experiment, load_experiment
from disagg.core.metrics import STEP_COLUMNS, steps_table
from disagg.errors import ConfigError
from disagg.settings import pieces_size
from disagg.share import (
    MIN_ALONE_PASSES,
    MIN_BESIDE_PASSES,
    MIN_CHUNK_PASSES,
    chunk_line,
    decode_alone,
    decode_scale,
    decode_share,
    decode_share_shape,
    decode_share_wide,
    extra_shape,
    extra_wide,
    overlap_segments,
    prefill_share,
    shares,
    shares_at_full_pace,
)
from disagg.sim.cluster import Sim
from disagg.sim.gpu import EXTRA_YIELD_SEQS
from disagg.validate_plan import other_mode

EXPERIMENTS = Path(__file__).parent.parent / "experiments"


def _steps(exp: Experiment) -> pd.DataFrame:
    sim = Sim(exp)
    sim.run()
    return steps_table(sim.rec)


def _rows(*passes: tuple[str, float, float, int, int]) -> pd.DataFrame:
    """Steps rows of (node, start, duration, decode seqs, prefill tokens), one pass each."""
    rows = [
        {"node": n, "kind": "decode" if not p else "prefill", "start_s": t, "duration_s": d}
        | {"steps": 1, "batch_size": b, "decode_seqs": b, "tokens": b + p, "prefill_tokens": p}
        | {"device_s": np.nan}
        for n, t, d, b, p in passes
    ]
    return pd.DataFrame(rows, columns=STEP_COLUMNS)


@pytest.mark.parametrize("path", ["llama8b-h200.toml", "qwen3moe-h200-colocated.toml"])
def test_the_fit_finds_the_share_a_simulated_shared_gpu_ran_at(path: str) -> None:
    """A disaggregated run simulated on one shared GPU at a known decode share gives that
    share back (within 1%), against the decode line of the colocated run (one process)."""
    base = load_experiment(EXPERIMENTS / path, ["workload.duration_s=20"])
    disagg = other_mode(base)
    alone = decode_alone(_steps(base))
    for share in (0.25, 0.6):
        steps = _steps(disagg.updated("cluster.shared_gpu=true", f"cluster.decode_share={share}"))
        assert decode_share(steps, alone) == pytest.approx(share, rel=0.01)


@pytest.mark.parametrize("path", ["llama8b-h200.toml", "qwen3moe-h200-colocated.toml"])
def test_the_fit_finds_both_shares_a_simulated_gpu_of_more_capacity_ran_at(path: str) -> None:
    """A disaggregated run simulated on one shared GPU at decode share 0.3 and prefill share
    0.85 gives both back (within 1%), against the passes of the same run on GPUs of their own
    (each pass alone)."""
    disagg = other_mode(load_experiment(EXPERIMENTS / path, ["workload.duration_s=20"]))
    apart = _steps(disagg)
    shared = _steps(
        disagg.updated(
            "cluster.shared_gpu=true", "cluster.decode_share=0.3", "cluster.prefill_share=0.85"
        )
    )
    assert shares(shared, decode_alone(apart), chunk_line(apart)) == pytest.approx(
        (0.3, 0.85), rel=0.01
    )


def test_a_decode_pass_inside_a_prefill_pass_gives_its_slowdown_as_the_share() -> None:
    """Hand arithmetic: a 24 ms decode pass wholly inside a prefill pass of another node, 6 ms
    alone, ran at a quarter: s / (s + 1 - s) = s = 0.25. A decode pass of a third node in the
    same window (two decodes beside the prefill) would make it s / (2 s + 1 - s)."""
    alone = decode_alone(_rows(("c", 0.0, 6e-3, 1, 0), ("c", 0.01, 6e-3, 2, 0)))
    assert alone(np.array([4.0])).tolist() == pytest.approx([6e-3])
    one = _rows(("p", 0.0, 0.040, 0, 2048), ("d", 0.010, 0.024, 1, 0))
    assert decode_share(one, alone) == pytest.approx(0.25, rel=1e-9)
    segments = overlap_segments(one)
    assert list(segments) == [1]
    seconds, decodes, others = segments[1]
    assert seconds.tolist() == pytest.approx([0.024]) and decodes.tolist() == [1]
    assert others.tolist() == [1]
    # two 6 ms decodes of 20 ms each beside a prefill: 20 s / (1 + s) = 6 ms -> s = 3 / 7
    two = _rows(("p", 0.0, 0.040, 0, 2048), ("d", 0.010, 0.020, 1, 0), ("e", 0.010, 0.020, 1, 0))
    assert decode_share(two, alone) == pytest.approx(3 / 7, rel=1e-9)
    # a 12 ms decode pass whose first 2 ms ran alone (at full rate): 2 + 10 s = 6 -> s = 0.4
    late = _rows(("p", 0.002, 0.040, 0, 2048), ("d", 0.0, 0.012, 1, 0))
    assert decode_share(late, alone) == pytest.approx(0.4, rel=1e-9)


def test_a_prefill_pass_beside_a_decode_gives_its_slowdown_as_the_prefill_share() -> None:
    """Hand arithmetic: a 40 ms pass of a 2048-token chunk, 30 ms alone, with a decode pass of
    another node running throughout, ran at 0.75: beside one decode a chunk pass's pace is the
    prefill share, whatever the decode share. Half of it alone (the decode ended at 20 ms):
    20 + 20 b = 30 -> b = 0.5."""
    alone = chunk_line(_rows(("c", 0.0, 0.015, 0, 1024), ("c", 0.1, 0.030, 0, 2048)))
    assert alone(np.array([2048.0])).tolist() == pytest.approx([0.030])
    one = _rows(("p", 0.0, 0.040, 0, 2048), ("d", 0.0, 0.040, 1, 0))
    for decode in (0.2, 0.4):
        assert prefill_share(one, alone, decode) == pytest.approx(0.75, rel=1e-9)
    half = _rows(("p", 0.0, 0.040, 0, 2048), ("d", 0.0, 0.020, 1, 0))
    assert prefill_share(half, alone, 0.3) == pytest.approx(0.5, rel=1e-9)
    assert list(overlap_segments(half, decode=False)) == [0]
    with pytest.raises(ConfigError, match="fewer than two chunk passes"):
        chunk_line(one.iloc[:1])


def test_at_full_pace_a_chunk_pass_beside_decodes_costs_its_time_alone_plus_the_extra() -> None:
    """Hand arithmetic: chunk passes of 1,024 and 2,048 tokens (15 and 30 ms alone) took 65
    and 80 ms beside a decode server: at full pace, 50 ms more each, whatever the chunk. The
    decode passes wholly inside them, 6 ms alone, took 15 ms: at decode share a a decode
    pass's pace beside a chunk pass of share 1 is (a + 1) a / (a + 1) = a = 0.4. A pass that
    ran faster than alone gives no negative extra."""
    chunk = chunk_line(_rows(("c", 0.0, 0.015, 0, 1024), ("c", 0.1, 0.030, 0, 2048)))
    decode = decode_alone(_rows(("c", 0.0, 6e-3, 1, 0), ("c", 0.01, 6e-3, 2, 0)))
    run = _rows(
        ("p", 0.0, 0.065, 0, 1024),
        ("d", 0.010, 0.015, 1, 0),
        ("p", 0.100, 0.080, 0, 2048),
        ("d", 0.120, 0.015, 1, 0),
    )
    a, extra = shares_at_full_pace(run, decode, chunk)
    assert (a, extra) == pytest.approx((0.4, 0.050), rel=1e-9)
    quick = _rows(("p", 0.0, 0.010, 0, 1024), ("d", 0.002, 0.006, 1, 0))
    assert shares_at_full_pace(quick, decode, chunk)[1] == 0.0


def test_the_extra_s_shape_is_read_by_chunk_size_from_the_passes_that_met_a_decode() -> None:
    """Hand arithmetic. Beside a decode pass that runs throughout: three chunks of 300-512
    tokens (one size: 512) took 10 ms more than their 10 ms alone, four of 2,048 tokens 20 ms
    more than their 30 ms alone, two of 1,024 (too few for a point) 40 ms more. A pass of 4,096
    after the decode ended met none. The shape: 0.5 at 10 ms, 1 at 30 ms (the extra of the
    size with the most passes). One size alone, or an extra of 0 there, gives none."""
    chunks = [(300, 0.010, 0.020), (400, 0.010, 0.020), (512, 0.010, 0.020)]
    chunks += [(2048, 0.030, 0.050)] * 4 + [(1024, 0.015, 0.055)] * 2
    passes = [("p", 0.1 * i, device, 0, n) for i, (n, _, device) in enumerate(chunks)]
    run = _rows(("d", 0.0, 1.0, 1, 0), *passes, ("p", 2.0, 0.06, 0, 4096))
    run["device_s"] = [1.0, *(device for _, _, device in chunks), 0.06]
    shaped = pd.Series([np.nan, *(alone for _, alone, _ in chunks), 0.04], index=run.index)
    shape = extra_shape([(run, shaped)])
    assert [x for p in shape for x in p] == pytest.approx([0.010, 0.5, 0.030, 1.0])
    assert extra_shape([(run.iloc[:4], shaped.iloc[:4])]) == ()
    even = run.assign(device_s=shaped.fillna(1.0))  # no pass took longer than alone
    assert extra_shape([(even, shaped)]) == ()
    assert extra_shape([]) == ()
    # a second run's passes pool with the first's: its two chunks of 1,024 tokens make that
    # size a point (four passes, 40 and 20 ms more: median 30 ms, over 20 ms: 1.5), and its
    # two chunks of 2,048 add none to that size's median
    more = [(1024, 0.015, 0.035)] * 2 + [(2048, 0.030, 0.050)] * 2
    other = _rows(
        ("d", 0.0, 1.0, 1, 0), *[("p", 0.1 * i, d, 0, n) for i, (n, _, d) in enumerate(more)]
    )
    other["device_s"] = [1.0, *(device for _, _, device in more)]
    alone = pd.Series([np.nan, *(a for _, a, _ in more)], index=other.index)
    pooled = extra_shape([(run, shaped), (other, alone)])
    assert [x for p in pooled for x in p] == pytest.approx([0.010, 0.5, 0.015, 1.5, 0.030, 1.0])
    # in pieces of 600 and 4,096 tokens (hw.latency.prefill_graphs) the chunks make two
    # sizes: those of 300-512 tokens, and the ten of 1,024 and 2,048 (four 15 ms alone, six 30
    # ms: median 30 ms; 20-40 ms more, median 20 ms), the size with the most passes
    pieced = extra_shape([(run, shaped), (other, alone)], pieces=(600, 4096))
    assert [x for p in pieced for x in p] == pytest.approx([0.010, 0.5, 0.030, 1.0])
    # read at a pass's whole time alone, as the simulator's weights rule reads it: each
    # point's seconds with the host time per pass, the extras as they were
    hosted = extra_shape([(run, shaped), (other, alone)], pieces=(600, 4096), host_s=0.003)
    assert [x for p in hosted for x in p] == pytest.approx([0.013, 0.5, 0.033, 1.0])


def _beside_chunks(sizes: list[tuple[int, float, float]]) -> tuple[pd.DataFrame, pd.Series]:
    """Steps of chunk passes of (tokens, seconds alone, seconds a decode pass of 6 ms alone
    took inside it), each with one such decode pass of another node wholly inside it and the
    decode server alone between them, and the profile's time alone per row (the chunks')."""
    passes, alone = [], []
    for i, (tokens, chunk_s, decode_s) in enumerate(sizes):
        t = 0.1 * i
        passes += [("p", t, 0.06, 0, tokens), ("d", t + 0.001, decode_s, 1, 0)]
        alone += [chunk_s, np.nan]
    run = _rows(*passes)
    return run, pd.Series(alone, index=run.index)


def test_the_decode_shares_shape_is_read_by_the_size_of_the_chunk_beside() -> None:
    """Hand arithmetic. A decode pass of 6 ms alone inside a chunk pass at full pace runs at
    the decode share: MIN_BESIDE_PASSES of them took 10 ms inside chunks of 300-512 tokens (one
    size, 10 ms alone): 0.6; as many took 15 ms inside chunks of 2,048 tokens (30 ms alone):
    0.4. Over a decode share of 0.4 the shape is 1.5 at 10 ms and 1 at 30 ms; read at a pass's
    whole time alone, each point's seconds with the host time. One size short of passes leaves
    one point: none."""
    decode = decode_alone(_rows(("c", 0.0, 6e-3, 1, 0), ("c", 0.01, 6e-3, 2, 0)))
    n = MIN_BESIDE_PASSES
    small = [(300 + i, 0.010, 0.010) for i in range(n)]
    run, shaped = _beside_chunks([*small, *[(2048, 0.030, 0.015)] * n])
    shape = decode_share_shape([(run, shaped)], decode, 0.4)
    assert [x for p in shape for x in p] == pytest.approx([0.010, 1.5, 0.030, 1.0], rel=1e-6)
    hosted = decode_share_shape([(run, shaped)], decode, 0.4, host_s=0.002)
    assert [x for p in hosted for x in p] == pytest.approx([0.012, 1.5, 0.032, 1.0], rel=1e-6)
    # in one piece of 4,096 tokens, all one size: no shape
    assert decode_share_shape([(run, shaped)], decode, 0.4, pieces=(4096,)) == ()
    short, at = _beside_chunks([*small, *[(2048, 0.030, 0.015)] * (n - 1)])
    assert decode_share_shape([(short, at)], decode, 0.4) == ()
    # pooled with a second run, the short size has its passes
    more, alone = _beside_chunks([(2048, 0.030, 0.015)])
    pooled = decode_share_shape([(short, at), (more, alone)], decode, 0.4)
    assert [x for p in pooled for x in p] == pytest.approx([0.010, 1.5, 0.030, 1.0], rel=1e-6)


def test_the_fit_finds_the_decode_shares_shape_a_simulated_gpu_ran_at() -> None:
    """A disaggregated run simulated on one shared GPU at decode share 0.4, prefill share 1 and
    the decode share shaped 1.5 at 20 ms alone and 1 at 45 ms: each size's fitted factor lies
    among the factors the simulator gave its chunk passes (a size's passes span 1,025-2,048
    tokens, say), and the shorter chunks' is the larger."""
    disagg = other_mode(
        load_experiment(EXPERIMENTS / "llama8b-h200.toml", ["workload.duration_s=20"])
    )
    apart = _steps(disagg)
    points = ((0.020, 1.5), (0.045, 1.0))
    steps = _steps(
        disagg.updated(
            "cluster.shared_gpu=true",
            "cluster.decode_share=0.4",
            "cluster.prefill_share=1.0",
            f"cluster.decode_share_shape={[list(p) for p in points]}",
        )
    )
    chunk = steps.prefill_tokens > 0
    alone = pd.Series(np.nan, index=steps.index)
    alone[chunk] = chunk_line(apart)(steps.prefill_tokens[chunk].to_numpy(float))
    pieces = disagg.hw.latency.prefill_graphs
    shape = decode_share_shape([(steps, alone)], decode_alone(apart), 0.4, pieces)
    assert len(shape) == 2 and shape[0][1] > shape[1][1]
    sizes = [pieces_size(pieces, n) for n in steps.prefill_tokens[chunk]]
    simulated = np.interp(alone[chunk], [s for s, _ in points], [f for _, f in points])
    passes = pd.DataFrame({"size": sizes, "alone": alone[chunk], "factor": simulated})
    by_size = passes.groupby("size").agg(alone=("alone", "median"), low=("factor", "min"))
    by_size["high"] = passes.groupby("size").factor.max()
    for seconds, factor in shape:
        size = by_size.iloc[int(np.argmin(abs(by_size.alone - seconds)))]
        assert size.low <= factor <= size.high


def test_the_extra_beside_wide_decodes_is_read_over_the_extra_beside_narrow_ones() -> None:
    """Hand arithmetic. A decode pass of 4 sequences runs from 0 to 1 s, one of 17 from 1 to
    2 s; three chunk passes of 10 ms alone beside each took 20 ms more beside the narrow one,
    10 ms more beside the wide one: the factor is 0.5. A chunk pass that met the narrow one
    first and then the wide one counts as narrow. On a shape of 0.5 at 10 ms and 1 at 30 ms
    (read with a host time of 2 ms: at 12 ms, 0.55), each extra is over the same factor: 0.5
    again. With only two wide passes, or a narrow extra of 0, there is no factor (1)."""
    wide = EXTRA_YIELD_SEQS + 1
    chunks = [(0.1 * i, 0.030) for i in range(1, 4)] + [(1.0 + 0.1 * i, 0.020) for i in range(1, 4)]
    chunks.append((0.99, 0.030))  # from the narrow decode into the wide one
    run = _rows(
        ("d", 0.0, 1.0, 4, 0),
        ("d", 1.0, 1.0, wide, 0),
        *[("p", t, device, 0, 512) for t, device in chunks],
    )
    run["device_s"] = [1.0, 1.0, *(device for _, device in chunks)]
    alone = pd.Series([np.nan, np.nan, *[0.010] * len(chunks)], index=run.index)
    assert extra_wide([(run, alone)]) == pytest.approx(0.5)
    shape = ((0.010, 0.5), (0.030, 1.0))
    assert extra_wide([(run, alone)], shape, host_s=0.002) == pytest.approx(0.5)
    assert extra_wide([(run.iloc[:-2], alone.iloc[:-2])]) == 1.0  # two wide passes left
    flat = run.assign(device_s=[1.0, 1.0, *[0.010] * 3, *[0.020] * 3, 0.010])
    assert extra_wide([(flat, alone)]) == 1.0
    assert extra_wide([]) == 1.0


def test_a_wide_chained_decode_pass_s_share_is_read_over_the_narrow_ones() -> None:
    """Hand arithmetic. Decode passes take 10 ms alone at 4 and at 17 sequences. Beside one
    chunk pass throughout at full pace a decode pass's pace is its share a, so 20 chained
    passes of 4 sequences that took 20 ms each show a = 0.5, and 20 of 17 that took 25 ms
    each a = 0.4: the factor is 0.8. With 19 wide passes, none beside a chunk, or the same
    passes unchained (their server waited on its host between them), there is none (1)."""
    alone = decode_alone(_rows(("c", 0.0, 0.010, 4, 0), ("c", 0.1, 0.010, 17, 0)))
    n, seqs = MIN_BESIDE_PASSES, EXTRA_YIELD_SEQS + 1
    narrow = [("d", 0.02 * i, 0.020, 4, 0) for i in range(n)]
    wide = [("d", 0.02 * n + 0.025 * i, 0.025, seqs, 0) for i in range(n)]
    unchained = _rows(("p", 0.0, 2.0, 0, 512), *narrow, *wide)
    run = unchained.assign(chained=(unchained.node == "d").astype(int))
    assert decode_share_wide(run, alone) == pytest.approx(0.8)
    assert decode_share_wide(run.iloc[:-1], alone) == 1.0
    assert decode_share_wide(run.iloc[1:], alone) == 1.0
    assert decode_share_wide(unchained, alone) == 1.0
    assert decode_share_wide(unchained.drop(columns="chained"), alone) == 1.0  # an older table


def test_the_fit_finds_the_extra_a_simulated_gpu_gave_each_chunk_pass() -> None:
    """A disaggregated run simulated on one shared GPU at decode share 0.4, prefill share 1 and
    a chunk extra of 20 ms gives both back within 1%: the fit counts each chunk pass that met a
    decode pass, and each has the extra, whether it began beside one or met it later."""
    disagg = other_mode(
        load_experiment(EXPERIMENTS / "llama8b-h200.toml", ["workload.duration_s=20"])
    )
    apart = _steps(disagg)
    shared = _steps(
        disagg.updated(
            "cluster.shared_gpu=true",
            "cluster.decode_share=0.4",
            "cluster.prefill_share=1.0",
            "cluster.chunk_extra_s=0.02",
        )
    )
    a, extra = shares_at_full_pace(shared, decode_alone(apart), chunk_line(apart))
    assert a == pytest.approx(0.4, rel=0.01)
    assert extra == pytest.approx(0.02, rel=0.01)


def test_a_chunk_pass_alone_is_read_from_the_passes_without_decodes() -> None:
    """A colocated server's chunk passes mostly carry decodes, whose work a disaggregated
    prefill server's passes do not: with MIN_CHUNK_PASSES passes of a chunk alone (10 ms +
    n / 256 ms), the line is theirs, not one through the mixed passes as well (20 ms more
    each); with fewer, all the chunk passes give it."""
    alone = [("c", i, 0.010 + n / 256e3, 0, n) for i, n in enumerate(range(256, 2049, 256))]
    mixed = [("c", 10 + i, 0.030 + n / 256e3, 8, n) for i, n in enumerate(range(256, 2049, 256))]
    assert len(alone) == MIN_CHUNK_PASSES
    line = chunk_line(_rows(*alone, *mixed))
    assert line(np.array([512.0, 2048.0])).tolist() == pytest.approx([0.012, 0.018])
    few = chunk_line(_rows(*alone[1:], *mixed))
    assert few(np.array([2048.0]))[0] > 0.018 + 0.005  # the mixed passes pull it up


def test_a_decode_pass_alone_takes_its_batch_sizes_median() -> None:
    """Hand arithmetic: passes of 1 sequence took 6 ms (twice), of 2 6.5 ms, of 4 9 ms, of 8
    8 and 9.5 ms (median 8.75, held at 9: a larger batch never runs faster). Between sizes the
    time is interpolated (3: 7.75 ms), beyond them held; a pass with a chunk is not read."""
    passes = [(1, 0.006), (1, 0.006), (2, 0.0065), (4, 0.009), (8, 0.008), (8, 0.0095)]
    rows = [("c", float(i), d, b, 0) for i, (b, d) in enumerate(passes)]
    alone = decode_alone(_rows(*rows, ("c", 9.0, 0.5, 3, 512)))
    sizes = np.array([0.5, 1, 2, 3, 4, 8, 16], float)
    assert alone(sizes).tolist() == pytest.approx([6e-3, 6e-3, 6.5e-3, 7.75e-3, 9e-3, 9e-3, 9e-3])


def test_the_fit_says_why_it_cannot_fit() -> None:
    alone = decode_alone(_rows(("c", 0.0, 6e-3, 1, 0), ("c", 0.01, 6e-3, 2, 0)))
    apart = _rows(("p", 0.0, 0.040, 0, 2048), ("d", 0.050, 0.006, 1, 0))
    with pytest.raises(ConfigError, match="no decode pass met a prompt pass"):
        decode_share(apart, alone)
    runs = _rows(("p", 0.0, 0.040, 0, 2048), ("d", 0.010, 0.024, 1, 0)).assign(steps=2)
    with pytest.raises(ConfigError, match="one pass a row"):
        decode_share(runs, alone)
    with pytest.raises(ConfigError, match="fewer than two decode passes"):
        decode_alone(apart.iloc[:1])


def test_the_decode_scale_is_its_passes_beside_no_prefill_over_a_colocated_servers() -> None:
    """Hand arithmetic: alone (a colocated server's run), a decode pass takes 5 ms + 1 ms per
    sequence on the device. The decode server's passes beside no prefill pass took 0.9 of
    that at their batch; its passes inside a prefill pass (more of them, three times as
    long) and the prefill pass itself do not count: the scale is 0.9. With fewer such passes than
    MIN_ALONE_PASSES, or without device times, there is none."""
    alone = _rows(*(("c", 0.01 * b, 0.002, b, 0) for b in (1, 2, 3, 4)))
    alone["device_s"] = 0.005 + 0.001 * alone.decode_seqs
    n = MIN_ALONE_PASSES
    passes = [("d", 0.01 * i, 0.008, 1 + i % 3, 0) for i in range(n)]
    passes += [("p", 1.0, 0.050 * (n + 1), 0, 2048)]
    passes += [("d", 1.01 + 0.05 * i, 0.030, 2, 0) for i in range(n + 1)]  # beside it
    shared = _rows(*passes)
    shared["device_s"] = 0.9 * (0.005 + 0.001 * shared.decode_seqs)
    shared.loc[n, "device_s"] = 0.045  # the prefill pass
    shared.loc[n + 1 :, "device_s"] = 3 * 0.007  # the decode passes beside it
    assert decode_scale(shared, alone) == pytest.approx(0.9, rel=1e-9)
    assert decode_scale(shared.drop(index=0), alone) is None  # one pass too few
    assert decode_scale(shared.assign(device_s=np.nan), alone) is None
