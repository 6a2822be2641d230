"""Device selection, default dtypes and step timing for the hw backend."""

from __future__ import annotations

import contextlib
import gc
import os
import statistics
import time
from collections.abc import Callable
from functools import partial

import torch

from disagg.errors import ConfigError


def resolve_device(device: str | torch.device) -> torch.device:
    """A torch device from a name ("cpu", "cuda", "cuda:1", or "1" for cuda:1); ConfigError if
    it does not exist."""
    if isinstance(device, str) and device.isdigit():
        device = f"cuda:{device}"
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ConfigError(f"device {str(device)!r} asked for, but torch sees no CUDA GPU")
        index = 0 if dev.index is None else dev.index
        if index >= torch.cuda.device_count():
            raise ConfigError(
                f"device {str(device)!r} asked for, but only {torch.cuda.device_count()} "
                "CUDA GPU(s) are visible"
            )
        return torch.device("cuda", index)
    if dev.type != "cpu":
        raise ConfigError(f"unsupported device {str(device)!r}: use cpu or cuda[:N]")
    return dev


def default_dtype(device: torch.device) -> torch.dtype:
    """bf16 on CUDA (what FlashInfer runs), float32 on CPU (the reference)."""
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def check_fits(device: torch.device, nbytes: int, what: str) -> None:
    """Raise ConfigError if `nbytes` more bytes cannot be allocated on the device (CUDA: free
    memory now; CPU: available memory)."""
    if device.type != "cuda":
        free = os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
        total = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    else:
        free, total = torch.cuda.mem_get_info(device)
    if nbytes > free:
        raise ConfigError(
            f"{what} needs {nbytes / 2**30:.1f} GiB but {device} has {free / 2**30:.1f} GiB free "
            f"of {total / 2**30:.1f} GiB: use fewer pages, layers or a smaller batch"
        )


def release(device: torch.device) -> None:
    """Hand the memory of the tensors gone back to `device`: PyTorch's CUDA allocator keeps
    what it freed reserved for this process, out of reach of the servers that a validate
    starts beside it."""
    gc.collect()  # tensors only a reference cycle still holds (a runner's graphs)
    if device.type == "cuda":
        torch.cuda.empty_cache()


def on_device(device: torch.device) -> contextlib.AbstractContextManager[object]:
    """Inside the block `device` is the current CUDA device (the one whose streams, events and
    graphs un-placed calls use); nothing for the CPU."""
    return torch.cuda.device(device) if device.type == "cuda" else contextlib.nullcontext()


def time_it(
    fn: Callable[[], object], device: torch.device, *, warmup: int, repeats: int
) -> list[float]:
    """Seconds per call of `fn`, `repeats` times after `warmup` calls.

    CUDA: timed with CUDA events around each call (no host sync inside the timed region).
    CPU: wall clock.
    """
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        out = []
        for _ in range(repeats):
            t0 = time.perf_counter()
            fn()
            out.append(time.perf_counter() - t0)
        return out
    with on_device(device):  # events on the stream `fn` runs on
        torch.cuda.synchronize(device)
        events = [
            (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            for _ in range(repeats)
        ]
        for start, end in events:
            start.record()
            fn()
            end.record()
        torch.cuda.synchronize(device)
    return [start.elapsed_time(end) / 1e3 for start, end in events]


def copy_seconds(
    nbytes: int,
    src: torch.device,
    dst: torch.device | None = None,
    *,
    warmup: int = 5,
    repeats: int = 20,
) -> float:
    """Median seconds of one plain copy of `nbytes` from `src` to `dst` (default: within `src`;
    another GPU: a peer copy), timed on `src` as `time_it` does."""
    a = torch.ones(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=src if dst is None else dst)
    return statistics.median(time_it(partial(b.copy_, a), src, warmup=warmup, repeats=repeats))
