"""The cuda wire's copy planner: which copies carry a post's writes. Decides, issues nothing.

A unit's writes become one Group per (source, destination) region pair (`as_arrays`, then
`base.coalesce`): the source region (a flat uint8 tensor), the destination (a flat uint8 tensor,
or a peer region on another GPU mapped by address, `Mapped`) and the runs (`base.Runs`: source
offsets, destination offsets and sizes in bytes, int64 arrays of one length). A group goes out

- as one batched copy of its runs, by default;
- as one gather and one scatter by row number (`gathers`, `row_index`) when it has at least
  GATHER_MIN_RUNS runs of whole rows (`whole_rows`) of at least GATHER_MIN_ROW bytes, both
  regions on one device: thousands of scattered pages in one batched copy go slowly, a gather
  moves every byte twice but in two kernels;
- stacked with the groups of the next units of a post (`stackable`) when they write the same
  runs between regions at one distance from each other on both sides (the layers of a KV cache
  allocated as one tensor): one copy per run, a row per unit.

Everything here runs on CPU tensors: it reads addresses, storages and devices, never memory.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
import torch

from disagg.hw.transport.base import Runs, Write, WriteArray

WORD = 16  # bytes per element of a stacked local copy (complex128)
STACK_MAX_RUNS = 16  # runs per layer up to which a local peer's layers go as stacked copies
# from this many runs of whole rows a group goes as one gather and one scatter rather than one
# batched copy (docs/gpu-runs.md gives the comparison of copy ways that placed the threshold)
GATHER_MIN_RUNS = 512
GATHER_MIN_ROW = 1024  # bytes: smaller rows (a run much shorter than the others) stay batched


@dataclass(frozen=True)
class Mapped:
    """A peer region on another GPU, mapped in this endpoint's context: copied by address, or
    (`view`, a tensor of this GPU over the mapping) by kernels when a group has many runs."""

    ptr: int
    nbytes: int
    view: torch.Tensor | None = field(default=None, compare=False)
    base: int = 0  # the mapped allocation's address: one 2D copy stays within one allocation

    def numel(self) -> int:
        return self.nbytes


Region = torch.Tensor | Mapped
Group = tuple[torch.Tensor, Region, Runs]  # source, destination, runs
Plan = list[tuple[list[Group], int | None]]  # a post: each unit's groups and its immediate


def as_arrays(writes: Sequence[Write]) -> list[WriteArray]:
    """`writes` grouped by (src, dst) region pair as arrays, in order within each pair (pairs
    in order of first appearance); a WriteArray comes back as the only element."""
    if isinstance(writes, WriteArray):
        return [writes]
    groups: dict[tuple[str, str], list[Write]] = {}
    for w in writes:
        groups.setdefault((w.src, w.dst), []).append(w)
    return [
        WriteArray(
            src, dst, [w.src_offset for w in ws], [w.dst_offset for w in ws], [w.nbytes for w in ws]
        )
        for (src, dst), ws in groups.items()
    ]


def address(t: Region) -> int:
    """The address of a region's first byte."""
    return t.ptr if isinstance(t, Mapped) else t.data_ptr()


def same_storage(a: Region, b: Region) -> bool:
    """Both are views of one torch storage (a region mapped by address is none)."""
    if isinstance(a, Mapped) or isinstance(b, Mapped):
        return False
    return bool(a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr())


def same_base(a: Region, b: Region) -> bool:
    """Both are mapped by address from one peer allocation."""
    return isinstance(a, Mapped) and isinstance(b, Mapped) and a.base == b.base


def unaligned(src: torch.Tensor, dst: Region, *offsets: np.ndarray) -> bool:
    """True unless both regions and every offset and size are whole WORD-byte words."""
    starts = (src.data_ptr(), address(dst))
    return any(a % WORD for a in starts) or any(bool((o % WORD).any()) for o in offsets)


def whole_rows(src: torch.Tensor, dst: Region, runs: Runs) -> int:
    """The shortest run's size in bytes if every run of `runs` (at least one) is whole rows of
    it, at row-aligned offsets of 8-byte-aligned regions whose sizes are whole rows; else 0."""
    s, d, n = runs
    row = int(n.min())
    whole = (
        row % 8 == 0
        and not (n % row).any()
        and all(
            t.numel() % row == 0 and address(t) % 8 == 0 and not (o % row).any()
            for t, o in ((src, s), (dst, d))
        )
    )
    return row if whole else 0


def row_numbers(offsets: np.ndarray, sizes: np.ndarray, row: int) -> np.ndarray:
    """The rows of `row` bytes that runs at byte `offsets` of `sizes` bytes (whole rows) cover,
    run by run in order: int64, sum(sizes) // row of them."""
    per, first = sizes // row, offsets // row
    if (per == 1).all():
        return first
    return np.repeat(first - (np.cumsum(per) - per), per) + np.arange(int(per.sum()))


def row_index(runs: Runs, row: int, device: torch.device) -> torch.Tensor:
    """[2, rows] int64 row numbers (source, destination) of runs of whole `row`-byte rows, on
    `device` (from pinned memory on a GPU, so that the copy does not wait for the stream)."""
    s, d, n = runs
    index = torch.from_numpy(np.stack([row_numbers(s, n, row), row_numbers(d, n, row)]))
    if device.type == "cuda":
        index = index.pin_memory().to(device, non_blocking=True)
    return index


def gathers(src: torch.Tensor, dst: Region, runs: int, row: int) -> bool:
    """Whether a group of `runs` runs of whole `row`-byte rows (0: not whole rows) goes as a
    gather: at least GATHER_MIN_RUNS runs of at least GATHER_MIN_ROW bytes, into a tensor of
    the source's device (another GPU's region through this GPU's view of it, never by
    address)."""
    if isinstance(dst, Mapped):
        if dst.view is None:
            return False
        dst = dst.view
    return runs >= GATHER_MIN_RUNS and row >= GATHER_MIN_ROW and src.device == dst.device


def stackable(plan: Plan, i: int, *, gather: bool, max_pitch: Callable[[], int]) -> int:
    """How many units from `plan[i]` on (at least 1) go out as one stacked copy: units of one
    group each that write the same runs between regions lying at one distance from each other
    on both sides (pitches in bytes). A local peer's units stack up to STACK_MAX_RUNS runs, in
    whole WORD-byte words; a mapped peer's within one allocation, at pitches up to
    `max_pitch()` bytes (the device's 2D-copy limit, asked only for a mapped peer). A unit's
    rows may not reach into the next unit's (the units' order would be lost), and with `gather`
    on, a group that `gathers` goes as a gather per unit instead."""
    if len(plan[i][0]) != 1:
        return 1
    src0, dst0, runs0 = plan[i][0][0]
    s0, d0, n0 = runs0
    mapped = isinstance(dst0, Mapped)
    if not len(n0):
        return 1
    if (
        gather
        and len(n0) >= GATHER_MIN_RUNS
        and gathers(src0, dst0, len(n0), whole_rows(src0, dst0, runs0))
    ):
        return 1  # many scattered pages: a gather per unit rather than a stacked copy per run
    if mapped:
        limit = max_pitch()
    elif len(n0) > STACK_MAX_RUNS or unaligned(src0, dst0, s0, d0, n0):
        return 1
    else:
        limit = 1 << 62
    k, pitches = 1, (0, 0)
    while i + k < len(plan) and len(plan[i + k][0]) == 1:
        src, dst, (s, d, n) = plan[i + k][0][0]
        if isinstance(dst, Mapped) != mapped or not same_storage(src, src0):
            break  # a strided view (or 2D copy) spans one allocation
        if not (same_base(dst, dst0) if mapped else same_storage(dst, dst0)):
            break
        step = (src.data_ptr() - src0.data_ptr(), address(dst) - address(dst0))
        if k == 1:
            if min(step) < int(n0.max()) or max(step) > limit or step[0] % WORD:
                break  # pitch >= width, within the device's limit
            if step[1] < int((d0 + n0).max() - d0.min()):
                break  # one unit's rows would overwrite another's: keep the units' order
            if step[1] % WORD and not mapped:
                break
            pitches = step
        elif step != (k * pitches[0], k * pitches[1]):
            break
        if not all(a is b or np.array_equal(a, b) for a, b in ((s, s0), (d, d0), (n, n0))):
            break
        k += 1
    return k
