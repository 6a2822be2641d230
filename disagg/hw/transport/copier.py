"""Issues the copies that the copy planner (`copyplan`) chose for the cuda wire's groups.

A Copier issues each group's copies on the current stream and returns at once: one copy for a
single run; a batched copy (`torch._foreach_copy_`) for several; a gather and a scatter by row
number where `copyplan.gathers` says so; one driver copy per run into a region mapped by
address; and, for a stack of units (`copyplan.stackable`), one strided copy (or driver 2D copy)
per run, a row per unit. It keeps what repeats between calls: views of the rows of a region that
posts have named, and (for one post, until `start_post`) the row numbers of each gathered set of
runs. Regions are flat uint8 tensors of one device; on CPU tensors every path except the
driver's runs as well.
"""

from __future__ import annotations

import numpy as np
import torch

from disagg.hw.transport import cudadriver
from disagg.hw.transport.base import Runs
from disagg.hw.transport.copyplan import Group, Mapped, Region, address, row_index, whole_rows
from disagg.hw.transport.copyplan import gathers as plan_gathers

RowViews = tuple[torch.Tensor, torch.Tensor, dict[int, torch.Tensor]]


def gather_copy(src: torch.Tensor, dst: torch.Tensor, index: torch.Tensor, row: int) -> None:
    """Copy the `row`-byte rows that `index` ([2, rows] int64: source, destination row numbers)
    names between flat uint8 regions of one device as two kernels on the current stream: gather
    the source rows into a temporary, scatter them into place (every byte moves twice).
    Destination rows must not repeat (as for any batched copy, the order would be undefined)."""
    width = row // 8
    rows = src.view(torch.int64).view(-1, width).index_select(0, index[0])
    dst.view(torch.int64).view(-1, width).index_copy_(0, index[1], rows)


def strided_rows(t: torch.Tensor, first: int, pitch: int, width: int, rows: int) -> torch.Tensor:
    """`rows` rows of `width` bytes, `pitch` bytes apart from byte `first` of the flat uint8
    region `t`, as 16-byte words: a view of t's storage (which must hold every row)."""
    view = t.as_strided((rows, width), (pitch, 1), t.storage_offset() + first)
    return view.view(torch.complex128)


class Copier:
    """Issues groups' copies; `gather` lets groups of many whole rows go as gathers. `stream`
    (a CUDA stream handle, `torch.cuda.Stream.cuda_stream`) is the one driver copies into
    regions mapped by address go on, the stream current while `copy` runs."""

    def __init__(self, gather: bool, stream: int = 0) -> None:
        self.gather = gather
        self.stream = stream
        # (address, bytes, row) -> the region as int64, as rows, and the row views made so far
        self.row_views: dict[tuple[int, int, int], RowViews] = {}
        self.indexes: dict[int, tuple[Runs, torch.Tensor]] = {}  # id(runs) -> runs, row_index

    def start_post(self) -> None:
        """Forget the previous post's gather indexes (a post's layers share their runs)."""
        self.indexes = {}

    def clear(self) -> None:
        self.row_views.clear()
        self.indexes = {}

    def gathers(self, src: torch.Tensor, dst: Region, runs: int, row: int) -> bool:
        return self.gather and plan_gathers(src, dst, runs, row)

    def copy(self, src: torch.Tensor, dst: Region, runs: Runs) -> None:
        """Issue one group's copies on the current stream: one copy, one batched copy, or one
        gather (another GPU's region: one driver copy per run, or kernels through its view)."""
        s, d, n = runs
        if isinstance(dst, Mapped) and dst.view is not None and len(n) > 1:
            dst = dst.view
        if isinstance(dst, Mapped):
            base = src.data_ptr()
            for so, do, k in zip(s.tolist(), d.tolist(), n.tolist(), strict=True):
                cudadriver.copy_async(dst.ptr + do, base + so, k, self.stream)
        elif len(n) == 1:
            dst[d[0] : d[0] + n[0]].copy_(src[s[0] : s[0] + n[0]], non_blocking=True)
        elif len(n):
            row = whole_rows(src, dst, runs)
            if self.gathers(src, dst, len(n), row):
                key = id(runs)  # the same runs for every layer of a post: one index
                if key not in self.indexes:  # (held with its runs, so the id stays theirs)
                    self.indexes[key] = (runs, row_index(runs, row, src.device))
                gather_copy(src, dst, self.indexes[key][1], row)
                return
            dsts, srcs = (self._views(t, o, n, row, row > 0) for t, o in ((dst, d), (src, s)))
            torch._foreach_copy_(dsts, srcs, non_blocking=True)

    def copy_stacked(self, groups: list[Group]) -> None:
        """One copy per run of `groups[0]`, a row per group (units that `copyplan.stackable`
        joined): a strided torch copy of 16-byte words between two storages of this device, a
        driver 2D copy into a region mapped by address."""
        (src0, dst0, (s, d, n)), (src1, dst1, _) = groups[0], groups[1]
        sp, dp, rows = src1.data_ptr() - src0.data_ptr(), address(dst1) - address(dst0), len(groups)
        spans = zip(s.tolist(), d.tolist(), n.tolist(), strict=True)
        if isinstance(dst0, Mapped):
            base_s = src0.data_ptr()
            for so, do, k in spans:
                cudadriver.copy_2d_async(dst0.ptr + do, dp, base_s + so, sp, k, rows, self.stream)
            return
        for so, do, k in spans:
            strided_rows(dst0, do, dp, k, rows).copy_(
                strided_rows(src0, so, sp, k, rows), non_blocking=True
            )

    def _views(
        self, t: torch.Tensor, offsets: np.ndarray, sizes: np.ndarray, row: int, words: bool
    ) -> list[torch.Tensor]:
        """Byte ranges of `t`: uint8 slices, or (`words`) int64 views where single rows of
        `row` bytes come from a cache of row views (a dict lookup each instead of a new slice,
        after the first). The cache fills with the rows posts name, not the whole region: a
        region of a few hundred thousand rows split at once stalls a post for seconds."""
        spans = zip(offsets.tolist(), sizes.tolist(), strict=True)
        if not words:
            return [t[o : o + k] for o, k in spans]
        key = (t.data_ptr(), t.numel(), row)
        if key not in self.row_views:
            w = t.view(torch.int64)
            self.row_views[key] = (w, w.view(-1, row // 8), {})
        w, table, rows = self.row_views[key]
        views = []
        for o, k in spans:
            if k != row:
                views.append(w[o // 8 : (o + k) // 8])
                continue
            view = rows.get(o // row)
            if view is None:
                view = rows[o // row] = table[o // row]
            views.append(view)
        return views
