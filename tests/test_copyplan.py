"""The cuda wire's copy planner, on CPU tensors: which writes make a group, which groups gather
(and by which row numbers), how many units stack. No GPU, no wire."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

pytest.importorskip("torch", reason="the copy planner needs torch: pip install -e '.[hw]'")

import torch

from disagg.hw.transport import copyplan
from disagg.hw.transport.base import Write, WriteArray, coalesce
from disagg.hw.transport.copyplan import (
    STACK_MAX_RUNS,
    Mapped,
    Plan,
    Region,
    as_arrays,
    gathers,
    row_index,
    row_numbers,
    stackable,
    whole_rows,
)


def runs_of(s: list[int], d: list[int], n: list[int]) -> tuple[np.ndarray, ...]:
    return tuple(np.array(x, dtype=np.int64) for x in (s, d, n))


def test_writes_group_by_region_pair_and_coalesce_only_runs_contiguous_on_both_sides() -> None:
    ws = [
        Write("a", 0, "b", 100, 10),
        Write("a", 10, "b", 110, 5),
        Write("a", 15, "b", 200, 5),
        Write("c", 25, "b", 210, 5),
        Write("a", 20, "b", 205, 5),
    ]
    (ab, cb) = as_arrays(ws)
    assert (ab.src, ab.dst, cb.src, cb.dst) == ("a", "b", "c", "b")
    assert [w.nbytes for w in ab] == [10, 5, 5, 5] and ab[1] == ws[1] and cb[0] == ws[3]
    s, d, n = coalesce(ab)
    assert (s.tolist(), d.tolist(), n.tolist()) == ([0, 15], [100, 200], [15, 10])
    wa = WriteArray("x", "y", [0], [0], [4])
    assert as_arrays(wa) == [wa]  # an array is already one group


def test_whole_rows_is_the_shortest_run_when_every_run_is_whole_aligned_rows() -> None:
    src, dst = torch.zeros(1024, dtype=torch.uint8), torch.zeros(2048, dtype=torch.uint8)
    assert whole_rows(src, dst, runs_of([0, 128], [64, 512], [64, 192])) == 64
    assert whole_rows(src, dst, runs_of([0, 128], [64, 512], [64, 96])) == 0  # 96 not 64k
    assert whole_rows(src, dst, runs_of([0, 130], [64, 512], [64, 64])) == 0  # offset 130
    assert whole_rows(src, dst, runs_of([0], [0], [12])) == 0  # rows of 8-byte words only
    odd = torch.zeros(1000, dtype=torch.uint8)  # 1000 bytes are not whole 64-byte rows
    assert whole_rows(odd, dst, runs_of([0], [0], [64])) == 0
    assert whole_rows(src, Mapped(4096, 2048), runs_of([0], [64], [64])) == 64
    assert whole_rows(src, Mapped(4100, 2048), runs_of([0], [64], [64])) == 0  # unaligned


def test_row_numbers_expand_runs_of_several_rows_in_order() -> None:
    row = 64
    sizes = np.array([64, 192, 64])
    assert row_numbers(np.array([640, 0, 128]), sizes, row).tolist() == [10, 0, 1, 2, 2]
    assert row_numbers(np.array([192, 64]), np.array([64, 64]), row).tolist() == [3, 1]
    index = row_index(runs_of([640, 0, 128], [0, 320, 64], [64, 192, 64]), row, torch.device("cpu"))
    assert index.dtype == torch.int64
    assert index.tolist() == [[10, 0, 1, 2, 2], [0, 5, 6, 7, 1]]


def test_gathers_from_the_thresholds_on_one_device() -> None:
    src, dst = torch.zeros(8, dtype=torch.uint8), torch.zeros(8, dtype=torch.uint8)
    many, row = copyplan.GATHER_MIN_RUNS, copyplan.GATHER_MIN_ROW
    assert gathers(src, dst, many, row)
    assert not gathers(src, dst, many - 1, row)
    assert not gathers(src, dst, many, row - 8)
    assert not gathers(src, dst, many, 0)  # not whole rows
    assert not gathers(src, Mapped(0, 8), many, row)  # by address: no kernel can reach it
    assert gathers(src, Mapped(0, 8, dst), many, row)  # through a view of this device
    assert not gathers(src, torch.zeros(8, dtype=torch.uint8, device="meta"), many, row)


@settings(max_examples=60, deadline=None)
@given(st.data())
def test_every_destination_byte_is_planned_once_from_its_source_byte(data: st.DataObject) -> None:
    """Page writes (some continuing each other) grouped, coalesced and expanded into gather row
    numbers name every written destination row exactly once, with the source row it copies."""
    pages = data.draw(st.integers(1, 24))
    dst_pages = data.draw(st.permutations(range(32)))[:pages]
    src_pages = data.draw(st.lists(st.integers(0, 31), min_size=pages, max_size=pages))
    if data.draw(st.booleans()):  # a run of pages contiguous on both sides
        src_pages, dst_pages = list(range(3, 3 + pages)), list(range(5, 5 + pages))
    row = 64
    writes = [
        Write("s", a * row, "d", b * row, row) for a, b in zip(src_pages, dst_pages, strict=True)
    ]
    (wa,) = as_arrays(writes)
    runs = coalesce(wa)
    assert int(runs[2].sum()) == pages * row  # no byte lost or added
    index = row_index(runs, row, torch.device("cpu")).tolist()
    assert sorted(index[1]) == sorted(dst_pages)  # each destination row once
    assert dict(zip(index[1], index[0], strict=True)) == dict(
        zip(dst_pages, src_pages, strict=True)
    )


def stack_plan(srcs: list[torch.Tensor], dsts: list[Region], wa: WriteArray) -> Plan:
    """A post's plan: unit i writes `wa`'s runs from srcs[i] to dsts[i], immediate i."""
    return [([(s, d, coalesce(wa))], i) for i, (s, d) in enumerate(zip(srcs, dsts, strict=True))]


def pitch(limit: int) -> Callable[[], int]:
    """A device's pitch limit, as stackable asks for it."""
    return lambda: limit


def test_units_stack_only_over_regions_at_one_distance_with_the_same_runs() -> None:
    """The layers of one allocation stack; a layer out of order, other runs, rows that would
    overlap (within a run or across runs) or bytes not in 16-byte words end the stack."""
    src, dst = torch.zeros(6, 4096, dtype=torch.uint8), torch.zeros(6, 8192, dtype=torch.uint8)
    kw = {"gather": True, "max_pitch": pitch(1 << 20)}
    one = WriteArray("s", "d", [512], [1024], [2048])
    assert stackable(stack_plan(list(src), list(dst), one), 0, **kw) == 6
    assert stackable(stack_plan(list(src), list(dst), one), 2, **kw) == 4  # from unit 2 on
    shuffled = [dst[0], dst[1], dst[3], dst[2], dst[4], dst[5]]
    assert stackable(stack_plan(list(src), list(shuffled), one), 0, **kw) == 2
    plan = stack_plan(list(src), list(dst), one)
    plan[3] = ([(src[3], dst[3], coalesce(WriteArray("s", "d", [0], [1024], [2048])))], 3)
    assert stackable(plan, 0, **kw) == 3
    wide = WriteArray("s", "d", [0], [0], [4096 + 16])  # wider than the regions' distance
    overlapping = list(torch.zeros(7 * 4096, dtype=torch.uint8).as_strided((6, 8192), (4096, 1)))
    assert stackable(stack_plan(overlapping, list(dst), wide), 0, **kw) == 1
    # two runs whose rows of consecutive units would overlap (destination windows 992 bytes
    # apart, the runs 1024 bytes wide together): stacked, the units' writes would reorder
    windows = list(torch.zeros(4096, dtype=torch.uint8).as_strided((3, 1024), (992, 1)))
    crossing = WriteArray("s", "d", [0, 1024], [0, 976], [32, 48])
    assert stackable(stack_plan(list(src[:3]), windows, crossing), 0, **kw) == 1
    odd = WriteArray("s", "d", [512], [1024], [2040])
    assert stackable(stack_plan(list(src), list(dst), odd), 0, **kw) == 1
    assert (
        stackable(stack_plan(list(src), list(dst), WriteArray("s", "d", [], [], [])), 0, **kw) == 1
    )
    two_groups: Plan = [(plan[0][0] * 2, 0), *plan[1:]]
    assert stackable(two_groups, 0, **kw) == 1  # a unit of several groups stacks with none


def test_mapped_units_stack_within_one_allocation_up_to_the_pitch_limit() -> None:
    """A mapped peer's units stack in any bytes and any number of runs, within one allocation
    and up to the device's pitch, which is asked only for a mapped peer; scattered runs of a
    local peer do not stack; runs that would gather (through a view) go as gathers instead."""
    src, dst = torch.zeros(6, 4096, dtype=torch.uint8), torch.zeros(6, 8192, dtype=torch.uint8)
    mapped: list[Region] = [Mapped(t.data_ptr(), t.numel()) for t in dst]
    one = WriteArray("s", "d", [512], [1024], [2048])
    odd = WriteArray("s", "d", [512], [1024], [2040])
    big = pitch(1 << 20)
    assert stackable(stack_plan(list(src), mapped, odd), 0, gather=True, max_pitch=big) == 6

    def unasked() -> int:
        raise AssertionError("the pitch limit is asked only for a mapped peer")

    assert stackable(stack_plan(list(src), list(dst), one), 0, gather=True, max_pitch=unasked) == 6
    other: list[Region] = [Mapped(t.data_ptr(), t.numel(), base=i // 3) for i, t in enumerate(dst)]
    assert stackable(stack_plan(list(src), other, one), 0, gather=True, max_pitch=big) == 3
    small = pitch(4096)  # the destination pitch is 8192
    assert stackable(stack_plan(list(src), mapped, one), 0, gather=True, max_pitch=small) == 1
    n = STACK_MAX_RUNS + 1
    scattered = WriteArray(
        "s", "d", [i * 128 for i in range(n)], [i * 256 for i in range(n)], [64] * n
    )
    assert (
        stackable(stack_plan(list(src), list(dst), scattered), 0, gather=True, max_pitch=big) == 1
    )
    assert stackable(stack_plan(list(src), mapped, scattered), 0, gather=True, max_pitch=big) == 6


def test_groups_that_gather_do_not_stack(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs enough to gather, into a mapped peer seen through a view on this GPU: a gather per
    unit, not a stacked copy per run; with no view (by address only), or gathers off, they
    stack."""
    n = STACK_MAX_RUNS + 1
    monkeypatch.setattr(copyplan, "GATHER_MIN_RUNS", n)
    monkeypatch.setattr(copyplan, "GATHER_MIN_ROW", 64)
    src, dst = torch.zeros(6, 4096, dtype=torch.uint8), torch.zeros(6, 8192, dtype=torch.uint8)
    scattered = WriteArray(
        "s", "d", [i * 128 for i in range(n)], [i * 256 for i in range(n)], [64] * n
    )
    viewed: list[Region] = [Mapped(t.data_ptr(), t.numel(), t) for t in dst]
    by_address: list[Region] = [Mapped(t.data_ptr(), t.numel()) for t in dst]
    big = pitch(1 << 20)
    assert stackable(stack_plan(list(src), viewed, scattered), 0, gather=True, max_pitch=big) == 1
    assert (
        stackable(stack_plan(list(src), by_address, scattered), 0, gather=True, max_pitch=big) == 6
    )
    assert stackable(stack_plan(list(src), viewed, scattered), 0, gather=False, max_pitch=big) == 6
