"""The cuda wire: IPC peer copies between two processes (on one GPU or two), immediates only
after the copies, a dead peer named in the failure. The copier is tested without a GPU, on CPU
tensors (the planner that it follows: tests/test_copyplan.py)."""

from __future__ import annotations

import base64
import dataclasses
import inspect
import json
import os
import pickle
import random
import time
from typing import Any

import numpy as np
import pytest

pytest.importorskip("torch", reason="the hw backend needs torch: pip install -e '.[hw]'")

import torch
from torch.multiprocessing.reductions import rebuild_cuda_tensor

from disagg.errors import TransportError
from disagg.hw.transport import copyplan, make_transport
from disagg.hw.transport import cuda as cuda_wire
from disagg.hw.transport._wire import IMM, frame
from disagg.hw.transport.base import Completion, Transport, Unit, Write, WriteArray, coalesce
from disagg.hw.transport.copier import Copier, gather_copy
from disagg.hw.transport.copyplan import STACK_MAX_RUNS, Group, Mapped, stackable
from disagg.hw.transport.cuda import tensor_at
from disagg.hw.transport.peer import SLOT, ReceiverProcess, slot_bytes, wait_completions

gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
ORDER, SCATTER = 1 << 16, 1 << 20


def _peer_device() -> str:
    """The receiver's GPU: a second one when visible, else the same one (IPC on one GPU)."""
    return "cuda:1" if torch.cuda.device_count() > 1 else "cuda:0"


def _sender(
    r: ReceiverProcess, src: torch.Tensor, by_address: bool = False, kernels: bool = False
) -> Transport:
    wire = make_transport("cuda", endpoint="prefill0", by_address=by_address, peer_kernels=kernels)
    wire.register("src", src)
    wire.connect("decode0", r.info, r.descs)
    return wire


@pytest.mark.parametrize("row", [64, 24, 13], ids=["words", "three-words", "odd-bytes"])
def test_batched_copy_puts_every_run_in_place(row: int) -> None:
    """The copier on CPU tensors (it is device-agnostic): scattered rows, some merged into
    multi-row runs, land exactly where asked, through word views or byte slices."""
    copier = Copier(gather=False)
    n = 128  # rows per region; writes use even rows, plus one odd row that extends a run
    gen = torch.Generator().manual_seed(row)
    src = torch.randint(0, 256, (n * row,), dtype=torch.uint8, generator=gen)
    dst = torch.zeros(n * row, dtype=torch.uint8)
    sp, dp = ((2 * torch.randperm(n // 2, generator=gen)[:40]).tolist() for _ in range(2))
    sp[5], dp[5] = sp[4] + 1, dp[4] + 1  # continues write 4 on both sides: merged into one run
    wa = WriteArray("s", "d", [p * row for p in sp], [p * row for p in dp], [row] * 40)
    runs = coalesce(wa)
    assert len(runs[2]) == 39  # writes 4 and 5 merged
    want = torch.zeros_like(dst)
    for a, b in zip(sp, dp, strict=True):
        want[b * row : (b + 1) * row] = src[a * row : (a + 1) * row]
    cached = []
    for _ in range(2):  # the second pass reuses the row views the first made (words)
        dst.zero_()
        copier.copy(src, dst, runs)
        assert torch.equal(dst, want)
        cached.append({k: dict(v[2]) for k, v in copier.row_views.items()})
    assert len(copier.row_views) == (2 if row % 8 == 0 else 0)  # one table per region
    if row % 8 == 0:  # views of the 38 single-row runs' rows only, not of all 128 per region
        src_rows, dst_rows = (sorted(cached[0][(t.data_ptr(), t.numel(), row)]) for t in (src, dst))
        assert src_rows == sorted(p for i, p in enumerate(sp) if i not in (4, 5))
        assert dst_rows == sorted(p for i, p in enumerate(dp) if i not in (4, 5))
    for key, views in cached[0].items():  # not made again
        assert all(cached[1][key][i] is v for i, v in views.items())


def test_a_single_run_is_one_copy() -> None:
    copier = Copier(gather=True)
    src, dst = torch.arange(64, dtype=torch.uint8), torch.zeros(64, dtype=torch.uint8)
    copier.copy(src, dst, coalesce(WriteArray("s", "d", [8], [40], [16])))
    assert dst[40:56].tolist() == list(range(8, 24)) and int(dst.sum()) == sum(range(8, 24))
    assert not copier.row_views and not copier.indexes


@pytest.mark.parametrize("single", [True, False], ids=["one-row-runs", "multi-row-runs"])
def test_many_runs_go_as_one_gather_and_scatter_that_land_in_place(
    single: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """From GATHER_MIN_RUNS runs of whole rows (of at least GATHER_MIN_ROW bytes) a group is
    gathered and scattered by row number (CPU tensors here, both thresholds lowered to this
    group; the same torch calls run on the wire's stream on a GPU). Runs of several rows expand
    into their rows; the bytes land exactly as a plain copy puts them; the same runs again in
    one post reuse their row numbers, a new post makes them anew; one run fewer, or smaller
    rows, go batched."""
    copier = Copier(gather=True)
    row, n = 64, 512
    gen = torch.Generator().manual_seed(int(single))
    src = torch.randint(0, 256, (n * row,), dtype=torch.uint8, generator=gen)
    dst = torch.zeros(n * row, dtype=torch.uint8)
    # runs of 1 row, or 1-3 rows, at scattered row starts that do not overlap on either side
    sizes = [1] * 100 if single else torch.randint(1, 4, (100,), generator=gen).tolist()
    starts = []
    for side in range(2):
        slots = (4 * torch.randperm(n // 4, generator=gen)[:100]).tolist()
        starts.append([p + side for p in slots])  # 4-row slots hold any run of 1-3 rows
    wa = WriteArray(
        "s",
        "d",
        [p * row for p in starts[0]],
        [p * row for p in starts[1]],
        [k * row for k in sizes],
    )
    runs = coalesce(wa)
    monkeypatch.setattr(copyplan, "GATHER_MIN_RUNS", len(runs[2]))  # at the thresholds: gather
    monkeypatch.setattr(copyplan, "GATHER_MIN_ROW", row)
    want = torch.zeros_like(dst)
    for a, b, k in zip(*starts, sizes, strict=True):
        want[b * row : (b + k) * row] = src[a * row : (a + k) * row]
    copier.copy(src, dst, runs)
    assert torch.equal(dst, want)
    assert not copier.row_views  # no batched copy (it would have split the regions into rows)
    (index,) = [ix for _, ix in copier.indexes.values()]
    assert index.shape == (2, sum(sizes))
    dst.zero_()
    copier.copy(src, dst, runs)  # the next layer of the same post
    (again,) = [ix for _, ix in copier.indexes.values()]
    assert torch.equal(dst, want) and again is index
    copier.start_post()
    assert not copier.indexes
    for more_runs, more_row in ((1, 0), (0, 8)):  # one run fewer, or smaller rows: batched
        monkeypatch.setattr(copyplan, "GATHER_MIN_RUNS", len(runs[2]) + more_runs)
        monkeypatch.setattr(copyplan, "GATHER_MIN_ROW", row + more_row)
        copier.row_views.clear()
        dst.zero_()
        copier.copy(src, dst, runs)
        assert torch.equal(dst, want) and len(copier.row_views) == 2 and not copier.indexes


def test_gather_copy_moves_the_named_rows_and_nothing_else() -> None:
    src = torch.arange(4 * 16, dtype=torch.uint8)  # rows of 16 bytes: row r holds 16r..16r+15
    dst = torch.full((4 * 16,), 255, dtype=torch.uint8)
    gather_copy(src, dst, torch.tensor([[3, 0], [1, 2]]), 16)  # source row 3 -> 1, 0 -> 2
    assert dst[16:32].tolist() == list(range(48, 64)) and dst[32:48].tolist() == list(range(16))
    assert dst[:16].tolist() == [255] * 16 and dst[48:].tolist() == [255] * 16


def test_the_immediates_of_one_event_leave_in_one_send_after_it() -> None:
    """The notifier waits for each event in post order and sends the immediates it vouches
    for (a stacked copy's units) together, then waits for the batch's final event."""
    log: list[Any] = []

    class Event:  # the notifier only synchronizes events
        def __init__(self, name: str) -> None:
            self.name = name

        def synchronize(self) -> None:
            log.append(self.name)

    class Link:
        def send(self, data: bytes) -> None:
            log.append(data)

    a, b = Event("a"), Event("b")
    marks = [(a, 1), (a, 2), (a, 3), (b, 4)]
    cuda_wire._wait_and_notify(Link(), (marks, Event("final")))  # type: ignore[arg-type]
    imms = [frame(IMM, k) for k in range(1, 5)]
    assert log == ["a", b"".join(imms[:3]), "b", imms[3], "final"]


def test_a_stacked_copy_puts_every_layers_runs_in_place() -> None:
    """The strided copy (a row per layer, 16-byte words) on CPU tensors: three runs of pages in
    five layers land where five per-layer copies would put them, and nothing else changes."""
    copier = Copier(gather=True)
    gen = torch.Generator().manual_seed(0)
    src = torch.randint(0, 256, (5, 4096), dtype=torch.uint8, generator=gen)
    dst = torch.randint(0, 256, (5, 6144), dtype=torch.uint8, generator=gen)
    want = dst.clone()
    wa = WriteArray("s", "d", [0, 1024, 2048], [4096, 512, 2048], [512, 1024, 2048])
    groups: list[Group] = [(s, d, coalesce(wa)) for s, d in zip(src, dst, strict=True)]
    assert stackable([([g], None) for g in groups], 0, gather=True, max_pitch=lambda: 0) == 5
    copier.copy_stacked(groups)
    for layer in range(5):
        for so, do, k in zip(wa.src_offsets, wa.dst_offsets, wa.nbytes, strict=True):
            want[layer, do : do + k] = src[layer, so : so + k]
    assert torch.equal(dst, want)


@gpu
@pytest.mark.gpu
def test_cuda_registration_carries_an_ipc_handle() -> None:
    wire = make_transport("cuda")
    d = wire.register("kv", torch.zeros(3, 5, dtype=torch.bfloat16, device="cuda"))
    assert (d.wire, d.nbytes) == ("cuda", 30) and d.info["ipc"]
    assert len(base64.b64decode(d.info["cu_ipc"])) == 64 and d.info["cu_offset"] >= 0
    with pytest.raises(TransportError, match="CUDA tensors only"):
        wire.register("host", torch.zeros(4))
    wire.close()
    wire.close()
    with pytest.raises(TransportError, match="closed"):
        wire.register("x", torch.zeros(4, device="cuda"))


_HANDLE = cuda_wire.IpcHandle(
    device=1,
    handle=b"\x01\x00" + bytes(range(64)),
    storage_nbytes=2 << 20,
    storage_offset=4096,
    ref_counter=b"/torch_4242_123456789_7",
    ref_counter_offset=3,
    event=bytes(range(64, 128)),
    event_sync=True,
    tensor_offset=512,
    numel=30,
)


def test_an_ipc_handle_crosses_as_json_values_and_comes_back_exact() -> None:
    sent = json.loads(json.dumps(_HANDLE.to_json()))
    assert sent["handle"] == base64.b64encode(_HANDLE.handle or b"").decode()
    assert sent["device"] == 1 and sent["event_sync"] is True
    assert cuda_wire.IpcHandle.from_json(sent, 30) == _HANDLE
    empty = dataclasses.replace(_HANDLE, handle=None, ref_counter=None, event=None)
    empty = dataclasses.replace(empty, event_sync=None, storage_nbytes=0, tensor_offset=0, numel=0)
    assert cuda_wire.IpcHandle.from_json(json.loads(json.dumps(empty.to_json())), 0) == empty
    # torch's rebuild gets plain values only, in the order of its parameters
    args = inspect.signature(rebuild_cuda_tensor).bind(*_HANDLE.rebuild_args()).arguments
    assert args["storage_handle"] == _HANDLE.handle and args["tensor_size"] == (30,)
    assert args["storage_device"] == 1 and args["storage_offset_bytes"] == 4096
    assert (args["tensor_offset"], args["tensor_stride"], args["dtype"]) == (512, (1,), torch.uint8)
    assert (args["ref_counter_handle"], args["event_handle"]) == (
        _HANDLE.ref_counter,
        _HANDLE.event,
    )


class _Exploit:
    """Unpickling this runs a shell command that creates a file."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self) -> tuple[Any, ...]:
        return os.system, (f"touch {self.path}",)


def test_a_pickle_payload_in_a_descriptor_is_refused_and_never_run(tmp_path: Any) -> None:
    marker = tmp_path / "pwned"
    payload = base64.b64encode(pickle.dumps(_Exploit(str(marker)))).decode()
    good = _HANDLE.to_json()
    for ipc in (
        payload,  # the old format: the whole handle pickled
        {**good, "ref_counter": payload},
        {**good, "event": payload},
        {**good, "device": payload},
        {**good, "event_sync": payload},
    ):
        with pytest.raises(TransportError, match="IPC handle"):
            cuda_wire.IpcHandle.from_json(ipc, 30)
    # an allocation handle is opaque bytes for the driver: carried, never unpickled
    assert cuda_wire.IpcHandle.from_json({**good, "handle": payload}, 30).handle is not None
    assert not marker.exists()
    assert not hasattr(cuda_wire, "pickle")


BAD_FIELDS = {
    "a bool device": ({"device": True}, "field device"),
    "a negative device": ({"device": -1}, "field device"),
    "a str size": ({"storage_nbytes": "2097152"}, "field storage_nbytes"),
    "a huge offset": ({"storage_offset": 2**70}, "field storage_offset"),
    "a float offset": ({"tensor_offset": 1.5}, "field tensor_offset"),
    "an int handle": ({"handle": 5}, "field handle must be base64"),
    "not base64": ({"handle": "not base64!"}, "field handle is not base64"),
    "a short event": ({"event": base64.b64encode(bytes(63)).decode()}, "field event is 63"),
    "a str event_sync": ({"event_sync": "yes"}, "field event_sync"),
    "a path for a counter": (
        {"ref_counter": base64.b64encode(b"/../etc/passwd").decode()},
        "not a shared-memory name",
    ),
    "no handle": ({"handle": None}, "lacks its handle"),
    "another size": ({"numel": 31}, "numel 31 != 30"),
    "past the storage": ({"tensor_offset": (2 << 20) - 29}, "pass the storage"),
    "an extra field": ({"cmd": "x"}, "has the fields"),
}


@pytest.mark.parametrize("change,match", BAD_FIELDS.values(), ids=BAD_FIELDS.keys())
def test_an_ipc_handle_with_a_bad_field_is_refused_naming_it(
    change: dict[str, Any], match: str
) -> None:
    with pytest.raises(TransportError, match=match):
        cuda_wire.IpcHandle.from_json({**_HANDLE.to_json(), **change}, 30)
    field = next(iter(change))
    if field in _HANDLE.to_json():  # the same field left out
        missing = {k: v for k, v in _HANDLE.to_json().items() if k != field}
        with pytest.raises(TransportError, match="has the fields"):
            cuda_wire.IpcHandle.from_json(missing, 30)


def test_tensor_at_wraps_memory_it_does_not_own() -> None:
    """The peer-kernel path's wrapper, on CPU memory: a view that reads and writes the same
    bytes, sized as asked, and leaves the memory to its owner."""
    owner = torch.arange(64, dtype=torch.uint8)
    view = tensor_at(owner.data_ptr() + 16, 32, torch.device("cpu"))
    assert view.shape == (32,) and view.dtype == torch.uint8 and view[0] == 16
    view[:4] = 200
    assert owner[16:20].tolist() == [200] * 4 and owner[15] == 15 and owner[20] == 20
    del view
    assert owner[16] == 200  # the owner's memory outlives the view


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("by_address", "kernels"), [(False, False), (True, True)], ids=["torch-mapped", "kernels"]
)
def test_cuda_scattered_pages_go_as_a_gather_that_lands_in_place(
    by_address: bool, kernels: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Many scattered pages (here 1 KiB rows, the thresholds lowered to them) go as a gather
    and a scatter on the wire's stream, for two units of one post (the second reuses the row
    numbers): every byte lands where asked, and each unit's immediate arrives."""
    monkeypatch.setattr(copyplan, "GATHER_MIN_RUNS", 64)
    monkeypatch.setattr(copyplan, "GATHER_MIN_ROW", 1024)
    row, pages = 1024, SCATTER // 1024
    r = ReceiverProcess("cuda", (SCATTER, SCATTER), _peer_device(), "decode0")
    try:
        src = torch.randint(0, 256, (2, SCATTER), dtype=torch.uint8, device="cuda")
        torch.cuda.synchronize()
        wire = make_transport(
            "cuda", endpoint="prefill0", by_address=by_address, peer_kernels=kernels
        )
        wire.register("a", src[0])
        wire.register("b", src[1])
        wire.connect("decode0", r.info, r.descs)
        rng = np.random.default_rng(0)
        sp, dp = (rng.permutation(pages)[:300] * row for _ in range(2))
        sizes = np.full(300, row)  # the units share their arrays, as a post's layers do
        units = [
            Unit(WriteArray(name, f"r{i}", sp, dp, sizes), imm=i) for i, name in enumerate("ab")
        ]
        wire.post("decode0", units, wr_id=0)
        imms, _ = r.ask("wait", 2, False, 60)
        assert imms == [0, 1]
        assert wait_completions(wire, 1) == [Completion(0, True)]
        # one index for both units, unless another GPU's region goes by address, run by run
        # (stacked: a 2D copy per run for both units)
        gathered = kernels or torch.cuda.device_count() == 1
        assert len(wire._copier.indexes) == int(gathered)  # type: ignore[attr-defined]
        for i in range(2):
            want = np.zeros((pages, row), dtype=np.uint8)
            want[dp // row] = src[i].view(pages, row).cpu().numpy()[sp // row]
            assert r.ask("read", i) == want.tobytes()
        wire.close()
    finally:
        r.close()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize(
    ("by_address", "kernels"),
    [(False, False), (True, False), (True, True)],
    ids=["torch-mapped", "driver-mapped", "driver-mapped-kernels"],
)
def test_cuda_writes_land_and_immediates_follow_their_bytes_in_order(
    by_address: bool, kernels: bool
) -> None:
    """Every copy path: torch's IPC mapping (peer on this GPU), the driver's mapping in the
    sender's context (peer on another GPU, or forced with by_address) copied one run at a time,
    and the same mapping also wrapped as a tensor, its many-run groups copied by kernels
    (peer_kernels)."""
    r = ReceiverProcess("cuda", (ORDER, SCATTER), _peer_device(), "decode0")
    try:
        rng = random.Random(0)
        src = torch.randint(0, 256, (SCATTER,), dtype=torch.uint8, device="cuda")
        n = ORDER // SLOT
        slots = torch.tensor(list(b"".join(slot_bytes(k) for k in range(n))), dtype=torch.uint8)
        src[:ORDER] = slots.cuda()
        torch.cuda.synchronize()
        wire = _sender(r, src, by_address, kernels)
        two_gpus = torch.cuda.device_count() > 1  # then copies go by address, as peer copies
        mapped = wire._remote["decode0"]["r1"]  # type: ignore[attr-defined]
        assert isinstance(mapped, Mapped) == (two_gpus or by_address)
        if isinstance(mapped, Mapped):  # kernels: a tensor of the sender's GPU over the mapping
            view = mapped.view
            assert (view is not None and view.device == src.device) if kernels else view is None
        # scatter: 400 disjoint 256-byte slots of r1, random sources and sizes, two units
        starts = sorted(rng.sample(range(0, SCATTER - 256, 256), 400))
        writes = [
            Write("src", rng.randrange(SCATTER - 200), "r1", s, rng.randrange(1, 200))
            for s in starts
        ]
        wire.post("decode0", [Unit(writes[:200]), Unit(writes[200:])], wr_id=0)
        assert wait_completions(wire, 1) == [Completion(0, True)]
        want = torch.zeros(SCATTER, dtype=torch.uint8)
        host = src.cpu()
        for w in writes:
            want[w.dst_offset : w.dst_offset + w.nbytes] = host[
                w.src_offset : w.src_offset + w.nbytes
            ]
        assert r.ask("read", 1) == bytes(want.numpy().tobytes())
        # order: unit k copies slot k and carries immediate k; 40 batches
        per = n // 40
        for b in range(40):
            units = [
                Unit([Write("src", k * SLOT, "r0", k * SLOT, SLOT)], imm=k)
                for k in range(b * per, (b + 1) * per)
            ]
            wire.post("decode0", units, wr_id=1 + b)
        imms, violations = r.ask("wait", 40 * per, True, 60)
        assert imms == list(range(40 * per)) and violations == 0
        done = wait_completions(wire, 40)
        assert [c.wr_id for c in done] == list(range(1, 41)) and all(c.ok for c in done)
        wire.close()
    finally:
        r.close()


@gpu
@pytest.mark.gpu
@pytest.mark.parametrize("by_address", [False, True], ids=["torch-mapped", "driver-mapped"])
def test_cuda_layers_of_one_allocation_go_as_2d_copies_that_land_in_place(
    by_address: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A post of eight layers' pages between two stacked allocations: the layers go as one
    stacked copy (a row per layer: strided torch copies, or driver 2D copies into a region
    mapped by address), every layer's bytes land, immediates in order; a post whose layers are
    scattered over more runs than STACK_MAX_RUNS still lands (stacked only when mapped)."""
    layers, size, page = 8, 1 << 18, 4096
    r = ReceiverProcess("cuda", [size] * layers, _peer_device(), "decode0", stacked=True)
    try:
        src = torch.randint(0, 256, (layers, size), dtype=torch.uint8, device="cuda")
        wire = make_transport("cuda", endpoint="prefill0", by_address=by_address)
        for i in range(layers):
            wire.register(f"s{i}", src[i])
        wire.connect("decode0", r.info, r.descs)
        calls: list[int] = []  # units of each stacked copy
        real = Copier.copy_stacked

        def counted(self: Copier, groups: list[Group]) -> None:
            calls.append(len(groups))
            real(self, groups)

        monkeypatch.setattr(Copier, "copy_stacked", counted)
        rng = np.random.default_rng(0)
        few = (np.array([3, 4, 5, 9, 20, 21]), np.array([40, 41, 42, 7, 30, 31]))  # 3 runs
        many = tuple(rng.permutation(size // page)[: STACK_MAX_RUNS * 2] for _ in range(2))
        want = torch.zeros(layers, size, dtype=torch.uint8)
        host = src.cpu()
        for wr, (sp, dp) in enumerate((few, many)):
            wa = WriteArray("s", "r", sp * page, dp * page, np.full(len(sp), page))
            units = [
                Unit(WriteArray(f"s{i}", f"r{i}", wa.src_offsets, wa.dst_offsets, wa.nbytes), i)
                for i in range(layers)
            ]
            wire.post("decode0", units, wr_id=wr)
            assert wait_completions(wire, 1) == [Completion(wr, True)]
            for a, b in zip(sp.tolist(), dp.tolist(), strict=True):
                want[:, b * page : (b + 1) * page] = host[:, a * page : (a + 1) * page]
        # one stacked copy of the few runs; the many runs stack only into a mapped region
        mapped = by_address or torch.cuda.device_count() > 1  # another GPU: mapped by address
        assert calls == [layers] * (2 if mapped else 1)
        for i in range(layers):
            assert r.ask("read", i) == bytes(want[i].numpy().tobytes()), f"layer {i}"
        imms, _ = r.ask("wait", 2 * layers, False, 20)
        assert imms == list(range(layers)) * 2
        wire.close()
    finally:
        r.close()


@gpu
@pytest.mark.gpu
def test_cuda_dead_peer_fails_with_its_name() -> None:
    r = ReceiverProcess("cuda", (ORDER,), _peer_device(), "decode0")
    wire = _sender(r, torch.zeros(ORDER, dtype=torch.uint8, device="cuda"))
    r.proc.kill()
    r.proc.join(10)
    failed: list[Completion] = []
    deadline, wr_id = time.monotonic() + 20, 0
    while not failed and time.monotonic() < deadline:
        wire.post("decode0", [Unit([], imm=wr_id)], wr_id=wr_id)
        wr_id += 1
        failed = [c for c in wait_completions(wire, 1, timeout_s=0.5) if not c.ok]
    assert failed and "decode0" in failed[0].error
    wire.close()
