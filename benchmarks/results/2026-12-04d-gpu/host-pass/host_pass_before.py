"""benchmarks/host_pass.py's pass as the code before 2d86534 built it (for host_pass_ff7371c.csv).

    git worktree add /tmp/before ff7371c
    PYTHONPATH=/tmp/before python benchmarks/results/2026-12-04d-gpu/host-pass/host_pass_before.py

Run from a checkout that has benchmarks/host_pass.py (2d86534 or later), with the package of
ff7371c first on the path. Before 2d86534 a decode pass built its BatchMeta (Python lists) once
to choose its graph and again for the graph's padded rows, the attention plan turned four of
its lists into int32 tensors with torch.tensor, and StepTensors.pack walked each sequence's
pages in numpy.
"""

import sys
from pathlib import Path

import disagg.hw.attention as attention
from disagg.hw.batch import BatchMeta, Seq, StepTensors
from disagg.hw.runner import GRAPH_BATCHES, graph_batch_for

sys.path.insert(0, str(Path.cwd() / "benchmarks"))
attention.plan_tensors = None  # not in ff7371c; host_pass imports the name
import host_pass as hp  # noqa: E402


def one_pass(rows: list[tuple[int, list[int]]], num_pages: int) -> None:
    seqs = [Seq.of([7], c, pages) for c, pages in rows]
    BatchMeta.of(seqs, hp.PAGE_SIZE, num_pages)  # Runner._step: a decode pass? which graph?
    size = graph_batch_for(GRAPH_BATCHES, len(seqs)) or len(seqs)
    pad = Seq((0,), 0, (num_pages,))
    padded = [*seqs, *[pad] * (size - len(seqs))]
    meta = BatchMeta.of(padded, hp.PAGE_SIZE, num_pages)
    for values in (meta.qo_indptr, meta.kv_indptr, meta.kv_indices, meta.last_page_len):
        attention._int32(values)
    StepTensors.pack(padded, hp.PAGE_SIZE)


hp.one_pass = one_pass
hp.main()
