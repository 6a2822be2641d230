"""The hw model's seeded random weights, and a directory that keeps them for the next process.

Every tensor is drawn on the CPU in fixed chunks, each from its own torch.Generator seeded by
(seed, tensor name, chunk), so it is identical in every process and for any thread count. A
full-size model takes a server seconds to draw (docs/results.md), and a validate starts a dozen
servers of the same model and seed. With a cache directory (`hw.weight_cache`,
`DISAGG_WEIGHT_CACHE`) the first process to draw a tensor writes its bytes there, and later
ones map the file instead of drawing it again.

A file is named by the tensor and a digest of everything its values depend on (seed, name,
size, bound, dtype, chunk size), so it is only ever read back for the very same draw: the
weights are bit for bit those drawn, cache or not. Files are written whole and then renamed, so
a reader never sees a half-written one, and one of the wrong size is drawn and written again.
The cache leaves SPARE_BYTES of its disk free: to make room for a new tensor it removes the
files least recently used, never one this model uses. A cache that cannot be written (a
read-only directory, a disk too small) is said once and left alone: the run goes on drawing.
"""

from __future__ import annotations

import contextlib
import hashlib
import math
import os
import shutil
import warnings
import zlib
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from disagg.hw.tp import Cut

CHUNK = 1 << 22  # elements per generator: the unit of determinism and of parallel work
SPARE_BYTES = 4 << 30  # free disk that the cache leaves alone


class WeightMaker:
    """Deterministic random tensors: chunk i of tensor `name` is drawn from seed (seed, name, i).
    `cache`: a directory to read tensors drawn before from, and to keep new ones in (module doc).
    `drawn` and `read` count the tensors drawn here and those read from the cache."""

    def __init__(
        self,
        seed: int,
        device: torch.device,
        dtype: torch.dtype,
        cache: str | Path | None = None,
    ) -> None:
        self.seed, self.device, self.dtype = seed, device, dtype
        self.cache = None if cache is None else Path(cache)
        self.pool = ThreadPoolExecutor(max_workers=min(32, os.cpu_count() or 1))
        self.drawn = self.read = 0
        self.mine: set[Path] = set()  # the files this model reads or writes: never removed

    def _chunk(self, name: str, i: int, n: int, bound: float) -> torch.Tensor:
        key = zlib.crc32(f"{self.seed}/{name}/{i}".encode()) + (self.seed << 32)
        g = torch.Generator().manual_seed(key & (2**63 - 1))
        return torch.empty(n).uniform_(-bound, bound, generator=g).to(self.dtype)

    def uniform(
        self, name: str, shape: tuple[int, ...], std: float, cut: Cut | None = None
    ) -> torch.Tensor:
        """A tensor of `shape` with i.i.d. uniform entries of standard deviation `std`; with a
        `cut`, only the part it keeps. The full tensor is drawn (or read) either way, on the
        CPU, so a TP rank's device holds only its shard: every rank pays one full draw in CPU
        time and the full tensor's bytes in host memory, one tensor at a time."""
        total = math.prod(shape)
        bound = std * math.sqrt(3.0)
        path = self._path(name, total, bound)
        full = self._read(path, total)
        if full is None:
            starts = range(0, total, CHUNK)
            parts = self.pool.map(
                lambda s: self._chunk(name, s // CHUNK, min(CHUNK, total - s), bound), starts
            )
            full = torch.cat(list(parts))
            self.drawn += 1
            self._write(path, full)
        else:
            self.read += 1
        full = full.view(shape)
        # a copy even on the CPU: the model never holds the cache file's mapping
        return (full if cut is None else cut.apply(full)).to(self.device, copy=True)

    def ones(self, n: int) -> torch.Tensor:
        return torch.ones(n, dtype=self.dtype, device=self.device)

    def close(self) -> None:
        self.pool.shutdown()

    # ---- the cache -------------------------------------------------------------------------
    def _path(self, name: str, total: int, bound: float) -> Path | None:
        if self.cache is None:
            return None
        draw = f"{self.seed}/{name}/{total}/{bound.hex()}/{self.dtype}/{CHUNK}"
        return self.cache / f"{name}-{hashlib.sha256(draw.encode()).hexdigest()[:16]}.bin"

    def _read(self, path: Path | None, total: int) -> torch.Tensor | None:
        """The tensor kept at `path` (mapped, not copied), or None: not kept, or not whole."""
        size = total * self._itemsize()
        if path is None or not path.is_file() or path.stat().st_size != size:
            return None
        self.mine.add(path)
        with contextlib.suppress(OSError):
            os.utime(path)  # used now: the last to make room
        return torch.from_file(str(path), shared=False, size=total, dtype=self.dtype)

    def _write(self, path: Path | None, full: torch.Tensor) -> None:
        if path is None:
            return
        data = full.view(torch.uint8).numpy()
        part = path.with_name(f".{path.name}.{os.getpid()}")
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            self.make_room(data.nbytes, shutil.disk_usage(path.parent).free)
            data.tofile(part)
            os.replace(part, path)
            self.mine.add(path)
        except OSError as e:
            with contextlib.suppress(OSError):
                part.unlink(missing_ok=True)
            warnings.warn(f"hw.weight_cache {self.cache}: not kept ({e}); drawing on", stacklevel=3)
            self.cache = None  # said once

    def make_room(self, nbytes: int, free: int) -> None:
        """Remove kept files, least recently used first, until `nbytes` more leave SPARE_BYTES
        of the `free` bytes free; OSError if this model's own files would have to go too."""
        assert self.cache is not None
        if free >= nbytes + SPARE_BYTES:
            return
        kept = []
        for f in self.cache.glob("*.bin"):
            with contextlib.suppress(FileNotFoundError):  # another process may remove it
                if f not in self.mine:
                    kept.append((f.stat().st_mtime, f.stat().st_size, f))
        for _, size, f in sorted(kept):
            f.unlink(missing_ok=True)
            free += size
            if free >= nbytes + SPARE_BYTES:
                return
        raise OSError(f"{nbytes} bytes more would leave less than {SPARE_BYTES} free")

    def _itemsize(self) -> int:
        return torch.empty((), dtype=self.dtype).element_size()
