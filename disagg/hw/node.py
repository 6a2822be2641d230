"""Prefill, decode and colocated servers: the core's schedulers and messenger on a real model.

Each server is one process with one main loop that owns the core objects (they are not
thread-safe). The only other threads are the layer watcher, which turns the GPU layer counter
into "layers done" values on a queue, and whatever a wire runs inside. A server talks to the
driver (`disagg.hw.driver`) and its peers over the ZeroMQ control plane, and moves KV pages over
a wire (tcp, cuda or verbs):

    driver -> Submit -> decode: reserve pages, PrefillRequest -> prefill
    (handoff "parallel": driver -> Submit -> prefill too, which starts before the pages come)
    prefill: chunks -> forward pass; counter moves -> PostWrites -> wire.post(units, imm=slot)
    decode: immediates -> Ready -> decode passes -> Finished -> driver
"""

from __future__ import annotations

import collections
import math
import os
import queue
import struct
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from disagg.config import Experiment
from disagg.core import messenger as m
from disagg.core.kvcache import PagePool
from disagg.core.metrics import Recorder
from disagg.core.request import Request, Status
from disagg.core.scheduler import Batch, ColocatedScheduler, DecodeScheduler, PrefillScheduler
from disagg.core.sharding import TransferPlan, plan_transfer, shard_layout
from disagg.errors import ConfigError, DisaggError
from disagg.hw.batch import Seq
from disagg.hw.control import Control, register
from disagg.hw.device import resolve_device
from disagg.hw.model import Transformer
from disagg.hw.runner import GRAPH_BATCHES, LayerWatcher, Runner
from disagg.hw.transport import make_transport
from disagg.hw.transport.base import Descriptor, Transport, Unit, Write, WriteArray, total_bytes

META_SLOTS = 4096  # rows of the decode side's metadata buffer (one per in-flight request)
SLOT_BITS = 16  # an immediate is (count << 16) | slot: which request, and how many write units


def pack_imm(slot: int, count: int) -> int:
    """The 32-bit immediate of a post that completes `count` counted units of request `slot`
    (units of one post ride one queue pair in order, so the last write's immediate vouches
    for all of them)."""
    if not 0 <= slot < 1 << SLOT_BITS or not 0 < count < 1 << (32 - SLOT_BITS):
        raise DisaggError(f"immediate out of range: slot {slot}, count {count}")
    return count << SLOT_BITS | slot


def unpack_imm(imm: int) -> tuple[int, int]:
    """(slot, count) of an immediate made by `pack_imm`."""
    return imm & ((1 << SLOT_BITS) - 1), imm >> SLOT_BITS


# ---- the node protocol (driver <-> servers) ---------------------------------------------------
@register
@dataclass(frozen=True)
class NodeUp:
    name: str
    endpoint: str
    wire_info: dict[str, Any]
    regions: tuple[dict[str, Any], ...]


@register
@dataclass(frozen=True)
class Peers:
    peers: tuple[dict[str, Any], ...]  # NodeUp fields of every other server


@register
@dataclass(frozen=True)
class Started:
    name: str


@register
@dataclass(frozen=True)
class Start:
    t0: float  # wall-clock origin of every timestamp


@register
@dataclass(frozen=True)
class Submit:
    req_id: int
    arrival_s: float
    prompt: tuple[int, ...]
    output_tokens: int

    def request(self) -> Request:
        """The request this message submits, as the serving node tracks it."""
        return Request(
            self.req_id, self.arrival_s, len(self.prompt), self.output_tokens, prompt=self.prompt
        )


@register
@dataclass(frozen=True)
class Finished:
    req_id: int
    status: str
    reason: str
    tokens: tuple[int, ...]
    times: dict[str, float]  # prefill_start_s, prefill_end_s, ready_s, first_token_s, finish_s
    logits: tuple[float, ...] = ()  # last step's logits (when the driver asks for them)
    first_logits: tuple[float, ...] = ()  # logits that chose the first token (likewise)
    metadata_sum: float = math.nan  # sum of the hidden state handed over (or computed) for MTP
    prefill_node: int = 0
    decode_node: int = 0


@register
@dataclass(frozen=True)
class Shutdown:
    pass


@register
@dataclass(frozen=True)
class Records:
    name: str
    steps: tuple[tuple[Any, ...], ...]
    # request_id, bytes, write ops, first post s, prefill start s, prefill end s
    transfers: tuple[tuple[Any, ...], ...]
    error: str = ""
    submits: int = 0  # requests that reached this node from the driver (a prefill node: parallel)
    settings: dict[str, Any] = field(default_factory=dict)  # what this process ran with
    # passes_planned_ahead: decode passes planned while their KV was inbound;
    # graphs_captured_on_demand: decode graphs captured when first needed (by a step or a plan
    # ahead), not at start
    counters: dict[str, int] = field(default_factory=dict)
    hops: tuple[tuple[Any, ...], ...] = ()  # request_id, node, event, t_s: see Server.mark


@dataclass(frozen=True)
class NodeConfig:
    """Everything a server process needs (picklable: it crosses a spawn)."""

    role: str  # prefill | decode | colocated
    index: int
    experiment: dict[str, Any]
    device: str
    wire: str
    num_pages: int
    driver: str  # the driver's control endpoint
    bind: str = "tcp://127.0.0.1:*"
    attention: str = "auto"
    return_logits: bool = False

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"


def serve(cfg: NodeConfig) -> None:
    """Process body: build the server for `cfg.role` and run it until Shutdown. A server that
    cannot be built (no GPU, too little memory, a missing library) tells the driver why."""
    kinds: dict[str, type[Server]] = {
        "prefill": PrefillServer,
        "decode": DecodeServer,
        "colocated": ColocatedServer,
    }
    # one control endpoint, made first: a second one under the same name would be refused by
    # the driver's socket while the first lives, and the reason with it
    control = Control(cfg.name, cfg.bind)
    control.connect("driver", cfg.driver)
    if SPIN:
        sys.setswitchinterval(SPIN_SWITCH_S)
    if CPU_LATENCY_US is not None:
        hold_cpu_latency(CPU_LATENCY_US)
    try:
        server = kinds[cfg.role](cfg, control)
    except DisaggError as e:
        control.send("driver", Records(cfg.name, (), (), f"{cfg.name}: {e}"))
        control.close(linger_s=5.0)
        return
    server.run()


# ---- common server ---------------------------------------------------------------------------
# An idle server sleeps in its poll until a control message or a landing wakes it. With
# DISAGG_SPIN=1 every server polls without sleeping (one busy core each). A spinning main
# thread holds the GIL between polls, so a wire thread that wants it waits for the switch
# interval (5 ms by default): spinning servers cut it to SPIN_SWITCH_S. Measured on H200s at
# 2k prompts (gpu_2026-11-29f.md, -g.md): without that cut whole-request TTFT grew by 1.5 ms;
# with it, decode-first's hop fell from 0.67 to 0.51 ms, but parallel handoff was 0.9 ms
# worse in the same run. Mixed: opt-in.
SPIN = os.environ.get("DISAGG_SPIN", "0") != "0"
SPIN_SWITCH_S = 100e-6
# A decoder with nothing to run plans a request's first pass when it hands the request to
# prefill (Runner.plan_ahead), so the pass only replays its graph when the KV lands.
# DISAGG_PLAN_AHEAD=0 plans it then, as every other pass.
PLAN_AHEAD = os.environ.get("DISAGG_PLAN_AHEAD", "1") != "0"


# Each control message wakes a sleeping thread on both sides (ZeroMQ's I/O threads, and the
# receiving loop): on an idle host every wake-up may first bring a core out of a deep idle
# state. DISAGG_CPU_LATENCY_US=N asks the kernel (PM QoS, /dev/cpu_dma_latency) to keep the
# host's cores out of idle states slower than N us to leave, while the servers live.
def _cpu_latency_us() -> int | None:
    value = os.environ.get("DISAGG_CPU_LATENCY_US", "").strip()
    if not value:
        return None
    if not value.isdigit():
        raise ConfigError(f"DISAGG_CPU_LATENCY_US={value!r}: want whole microseconds, e.g. 0")
    return int(value)


CPU_LATENCY_US = _cpu_latency_us()
_cpu_latency = {"held": "not asked"}


def hold_cpu_latency(us: int, path: str = "/dev/cpu_dma_latency") -> str:
    """Hold a PM QoS request for a CPU wake-up latency of at most `us` microseconds, for as
    long as this process lives (closing the file would end it); what happened, in words (also
    in this server's settings). A host that refuses it is told on stderr, not an error: the
    run is only slower to wake."""
    try:
        fd = os.open(path, os.O_WRONLY)
        try:
            os.write(fd, struct.pack("i", us))
        except OSError:
            os.close(fd)
            raise
    except OSError as e:
        _cpu_latency["held"] = f"refused: {path}: {e.strerror}"
        print(f"DISAGG_CPU_LATENCY_US={us}: {_cpu_latency['held']}", file=sys.stderr)
    else:
        _cpu_latency["held"] = f"{us} us"  # the descriptor stays open until the process exits
    return _cpu_latency["held"]


def settings() -> dict[str, Any]:
    """The latency settings this process runs with, for its records (the DISAGG_* variables
    it was started with, and what they turned on)."""
    return {
        "environment": {k: v for k, v in sorted(os.environ.items()) if k.startswith("DISAGG_")},
        "spin": SPIN,
        "meta_in_stream": META_IN_STREAM,
        "plan_ahead": PLAN_AHEAD,
        "cpu_latency": _cpu_latency["held"],
        "switch_interval_s": sys.getswitchinterval(),
    }


@dataclass
class _Stats:
    steps: Recorder = field(default_factory=Recorder)  # its steps rows only
    transfers: dict[int, list[Any]] = field(default_factory=dict)
    submits: int = 0
    hops: list[tuple[int, str, str, float]] = field(default_factory=list)


class Server:
    role = "server"

    def __init__(self, cfg: NodeConfig, control: Control | None = None) -> None:
        """`control`: this node's control endpoint, connected to the driver (made if None)."""
        self.cfg = cfg
        if cfg.device == "cpu":  # a server shares the CPU with its peers and the driver
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        else:  # one GPU per server: its current device (streams, events, graphs, kernels)
            torch.cuda.set_device(resolve_device(cfg.device))
        self.exp = Experiment.model_validate(cfg.experiment)
        self.spec = self.exp.model.spec
        self.layers = self.spec.layers
        if control is None:
            control = Control(cfg.name, cfg.bind)
            control.connect("driver", cfg.driver)
        self.control = control
        self.wake_fd: int | None = None  # wakes an idle loop when immediates arrive
        self.model = Transformer(self.spec, seed=self.exp.seed, device=cfg.device)
        kv = self.exp.kv
        self.cache = self.model.new_cache(cfg.num_pages, kv.page_size, kv.layout)
        self.pool = PagePool(cfg.num_pages, kv.page_size, cfg.name)
        # a prefill server's passes run eagerly (one of only 1-token chunks would otherwise
        # replay, and first capture, a decode graph); the others capture theirs at start
        graphs = () if self.role == "prefill" else GRAPH_BATCHES
        self.runner = Runner(self.model, self.cache, attention=cfg.attention, graph_batches=graphs)
        self.stats = _Stats()
        self.t0 = time.time()
        self.running = True
        self.wire: Transport | None = None

    # -- lifecycle
    def run(self) -> None:
        error = ""
        try:
            self.announce()
            self.wait_start()
            while self.running:
                self.tick()
        except DisaggError as e:
            error = f"{self.cfg.name}: {e}"
        except Exception:  # report, then die: the driver names the node and the error
            error = f"{self.cfg.name} crashed:\n{traceback.format_exc()}"
            print(error, file=sys.stderr, flush=True)
        self.control.send(
            "driver",
            Records(
                self.cfg.name,
                tuple(self.stats.steps.steps),
                tuple(tuple(v) for v in self.stats.transfers.values()),
                error,
                self.stats.submits,
                settings()
                | {"cuda_graphs": self.runner.captured, "graph_error": self.runner.graph_error},
                {
                    "passes_planned_ahead": self.runner.planned_ahead,
                    "graphs_captured_on_demand": self.runner.captured_on_demand,
                },
                tuple(self.stats.hops),
            ),
        )
        if self.wire is not None:
            self.wire.close()
        self.control.close(linger_s=5.0)  # let the records leave first

    def announce(self) -> None:
        self.wire = make_transport(self.cfg.wire, endpoint=self.cfg.name)
        regions = [
            self.wire.register(f"kv{i}", self.cache.layer_bytes(i)).to_dict()
            for i in range(self.layers)
        ]
        regions += [self.wire.register("meta", self.meta).to_dict()]
        self.control.send(
            "driver",
            NodeUp(self.cfg.name, self.control.endpoint, self.wire.local_info(), tuple(regions)),
        )

    @property
    def meta(self) -> torch.Tensor:
        """Metadata rows (float32 hidden states), one per slot; registered with the wire."""
        if not hasattr(self, "_meta"):
            self._meta = torch.zeros(
                (META_SLOTS, self.spec.hidden), dtype=torch.float32, device=self.model.device
            )
        return self._meta

    def wait_start(self) -> None:
        while True:
            got = self.control.recv(1.0)
            if got is None:
                continue
            _, msg = got
            if isinstance(msg, Peers):
                for p in msg.peers:
                    self.meet(p)
                self.control.send("driver", Started(self.cfg.name))
            elif isinstance(msg, Start):
                self.t0 = msg.t0
                return
            elif isinstance(msg, Shutdown):
                self.running = False
                return

    def meet(self, peer: dict[str, Any]) -> None:
        self.control.connect(peer["name"], peer["endpoint"])

    def now(self) -> float:
        return time.time() - self.t0

    def mark(self, req_id: int, event: str) -> None:
        """Stamp a request's control-plane event on this node (the run's hops table):
        `received` (the request reached this node), `handed_off` (a decoder is about to send
        it to prefill), `pages` (a prefill node got the decoder's pages)."""
        self.stats.hops.append((req_id, self.cfg.name, event, self.now()))

    def tick(self) -> None:
        """One turn of the main loop: messages, wire events, then at most one forward pass."""
        busy = self.step()
        self.handle(self.control.recv(0.0 if busy else self.idle_wait_s(), self.wake_fd))
        if not self.running:
            return
        self.control.heartbeat()
        for peer in self.control.dead_peers():
            self.on_dead(peer)

    def handle(self, got: tuple[str, Any] | None) -> None:
        """Handle `got` and every control message waiting behind it."""
        while got is not None and self.running:
            if isinstance(got[1], Shutdown):
                self.running = False
                return
            self.stats.submits += isinstance(got[1], Submit)
            self.on_message(got[1])
            got = self.control.recv(0.0)

    def on_message(self, msg: Any) -> None:
        raise NotImplementedError

    def idle_wait_s(self) -> float:
        """How long an idle loop waits for a control message (they wake it at once)."""
        return 0.0 if SPIN else 0.002

    def on_dead(self, peer: str) -> None:
        if peer == "driver":
            print(f"{self.cfg.name}: the driver fell silent; stopping", file=sys.stderr)
            self.running = False

    def step(self) -> bool:
        """Run one forward pass if there is work; True if one ran."""
        raise NotImplementedError

    def record(self, kind: str, start: float, batch: Batch) -> None:
        took = self.now() - start
        self.stats.steps.batch(
            self.cfg.name, kind, start, took, batch, device_s=self.runner.device_s()
        )

    def sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)


def _single_gpu_plan(exp: Experiment, elem_bytes: int) -> TransferPlan:
    """One rank on each side (one GPU per process): one write per page per layer."""
    spec = exp.model.spec
    dtype = {4: "fp32", 2: "bf16", 1: "fp8"}[elem_bytes]
    return plan_transfer(
        shard_layout(spec, 1),
        shard_layout(spec, 1),
        exp.kv.page_size,
        exp.kv.layout,
        dtype,
        exp.seed,
    )


# ---- prefill -----------------------------------------------------------------------------
# When a prefill pass ends, the server waits for the pass on the host, then posts the metadata
# (and, under whole-request transfer, the pages). With DISAGG_META_IN_STREAM=1 it posts them as
# soon as the last layer is seen, the cuda wire's copy stream waiting on an event at the end of
# the pass instead of the host (other wires wait for the event on the host). On one H200 at 2k
# prompts that changed neither TTFT nor ready minus prefill start beyond the spread between runs
# (gpu_2026-11-29f.md), so it stays off: the host then stamps the prefill's end only after its
# posts, which would move their host time from "end to ready" into "prefill" in the tables.
META_IN_STREAM = os.environ.get("DISAGG_META_IN_STREAM", "0") != "0"


class _PassDone:
    """The end of a pass on the CPU, which is over when the runner returns."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class PrefillServer(Server):
    role = "prefill"

    def __init__(self, cfg: NodeConfig, control: Control | None = None) -> None:
        super().__init__(cfg, control)
        t = self.exp.transfer
        self.messenger = m.PrefillMessenger(cfg.index, self.pool, self.layers, t.policy)
        group = self.exp.cluster.prefill
        self.scheduler = PrefillScheduler(group.token_budget, group.max_batch)
        self.plan = _single_gpu_plan(self.exp, self.cache.layers[0].element_size())
        self.requests: dict[int, Request] = {}
        self.prompts: dict[int, tuple[int, ...]] = {}
        # this side's metadata rows, one per prefilled request until its posts complete (the
        # decoder's slot may not be known yet when the hidden state is computed)
        self.rows: dict[int, int] = {}
        self.free_rows = collections.deque(range(META_SLOTS))
        self.posts: dict[int, int] = {}  # wr_id -> req_id
        self._wr = 0
        self.after: torch.cuda.Event | _PassDone | None = None  # posts wait for it
        self.layer_q: queue.Queue[int] = queue.Queue()
        # a layer takes ~1 ms or more: polling faster only steals the GIL from the launches
        self.watcher = LayerWatcher(self.runner.counter, self.layer_q.put, 250e-6).start()

    def meet(self, peer: dict[str, Any]) -> None:
        super().meet(peer)
        assert self.wire is not None
        regions = [Descriptor.from_dict(d) for d in peer["regions"]]
        self.wire.connect(peer["name"], peer["wire_info"], regions)

    def on_message(self, msg: Any) -> None:
        if isinstance(msg, Submit):  # parallel handoff: straight from the driver
            self.mark(msg.req_id, "received")
            self.prompts[msg.req_id] = msg.prompt
            self.execute(self.messenger.submit(msg.req_id, len(msg.prompt), decode_node=0))
            return
        if isinstance(msg, m.PrefillRequest):
            if msg.prompt:
                self.mark(msg.req_id, "received")
                self.prompts[msg.req_id] = msg.prompt
            self.mark(msg.req_id, "pages")
        self.execute(self.messenger.on_message(msg))

    def on_dead(self, peer: str) -> None:
        super().on_dead(peer)
        if peer.startswith("decode"):
            self.execute(self.messenger.on_peer_dead(int(peer[6:]), "no heartbeat"))

    def execute(self, cmds: list[m.Command]) -> None:
        for cmd in cmds:
            if isinstance(cmd, m.Send):
                self.control.send(f"decode{cmd.node}", cmd.msg)
            elif isinstance(cmd, m.Prefill):
                prompt = self.prompts[cmd.req_id]  # kept: an evicted early start runs again
                req = Request(cmd.req_id, 0.0, len(prompt), 1, prompt=prompt)
                self.requests[req.id] = req
                self.scheduler.add(req, cmd.tokens)
            elif isinstance(cmd, m.Unschedule):
                self.scheduler.remove(cmd.req_id)
            elif isinstance(cmd, m.PostWrites):
                self.post(cmd.req_id, f"decode{cmd.decode_node}", self.page_units(cmd))
            elif isinstance(cmd, m.PostMetadata):
                self.post(cmd.req_id, f"decode{cmd.decode_node}", [self.meta_unit(cmd)])
        for req_id in [r for r in self.rows if r not in self.messenger.outbound]:
            self.free_rows.append(self.rows.pop(req_id))  # its posts are done (or never will be)
        if len(self.prompts) > len(self.messenger):  # some left: prefilled, cancelled, refused
            known = self.messenger.known()
            for req_id in [r for r in self.prompts if r not in known]:
                del self.prompts[req_id]

    def page_units(self, cmd: m.PostWrites) -> list[Unit]:
        """One unit per layer: every page's writes as arrays, then one immediate that counts
        the post's complete pages (pages cut by the chunk are written but not counted; the
        chunk that completes them writes them again and counts them)."""
        segs = self.plan.segments
        src = np.asarray(cmd.src_pages, dtype=np.int64)[:, None]
        dst = np.asarray(cmd.dst_pages, dtype=np.int64)[:, None]
        src_off = (src * self.plan.src_page_bytes + [g.src_offset for g in segs]).ravel()
        dst_off = (dst * self.plan.dst_page_bytes + [g.dst_offset for g in segs]).ravel()
        nbytes = np.tile([g.nbytes for g in segs], len(cmd.src_pages))
        count = cmd.imm_pages * sum(self.plan.imms_per_page_layer_by_dst_rank().values())
        imm = pack_imm(cmd.slot, count) if count else None
        return [
            Unit(WriteArray(f"kv{layer}", f"kv{layer}", src_off, dst_off, nbytes), imm)
            for layer in cmd.layers
        ]

    def meta_unit(self, cmd: m.PostMetadata) -> Unit:
        """This side's row of the request's hidden state -> the decoder's row of its slot."""
        if cmd.slot >= META_SLOTS:
            raise DisaggError(f"metadata slot {cmd.slot} >= {META_SLOTS} rows")
        row = self.meta.shape[1] * 4
        src, dst = self.rows[cmd.req_id] * row, cmd.slot * row
        return Unit([Write("meta", src, "meta", dst, row)], pack_imm(cmd.slot, 1))

    def meta_row(self, req_id: int) -> int:
        if not self.free_rows:
            raise DisaggError(f"{self.cfg.name}: all {META_SLOTS} metadata rows in use")
        self.rows[req_id] = self.free_rows.popleft()
        return self.rows[req_id]

    def post(self, req_id: int, peer: str, units: list[Unit]) -> None:
        assert self.wire is not None
        self._wr += 1
        self.posts[self._wr] = req_id
        t = self.transfer_row(req_id)
        t[3] = min(t[3], self.now())
        t[1] += sum(total_bytes(u.writes) for u in units)
        t[2] += sum(len(u.writes) for u in units)
        if self.after is not None:  # bytes the pass is still writing: order the copies after
            stream = getattr(self.wire, "stream", None)  # the cuda wire's copy stream
            if stream is not None:
                stream.wait_event(self.after)
            else:
                self.after.synchronize()
        self.wire.post(peer, units, self._wr)

    def transfer_row(self, req_id: int) -> list[Any]:
        nan = math.nan
        return self.stats.transfers.setdefault(req_id, [req_id, 0, 0, math.inf, nan, nan])

    def poll_wire(self) -> None:
        assert self.wire is not None
        for c in self.wire.poll().completions:
            req_id = self.posts.pop(c.wr_id)
            self.execute(self.messenger.on_posted(req_id, c.ok, c.error))

    def tick(self) -> None:
        self.poll_wire()
        super().tick()

    def step(self) -> bool:
        batch = self.scheduler.schedule()
        if batch.empty:
            return False
        start = self.now()
        for c in batch.chunks:
            if math.isnan(c.req.prefill_start_s):
                c.req.prefill_start_s = start
        self.execute(self.messenger.on_batch([(c.req.id, c.start, c.tokens) for c in batch.chunks]))
        seqs = [
            Seq.of(
                c.req.prompt[c.start : c.start + c.tokens], c.start, self.pool.pages_of(c.req.id)
            )
            for c in batch.chunks
        ]
        out = self.runner.step(seqs)
        for i, c in enumerate(batch.chunks):
            if c.last:  # hidden state of the token before the last prompt token (stream order)
                self.meta[self.meta_row(c.req.id)] = out.hidden[i].float()
        end: torch.cuda.Event | _PassDone | None = None
        if META_IN_STREAM:
            end = torch.cuda.Event() if self.model.device.type == "cuda" else _PassDone()
            end.record()  # after the metadata rows: the end of the pass
        self.follow_layers(out.layers_before)
        prefilled = self.scheduler.complete(batch).prefilled
        if end is None:
            self.sync()
            end_s = self.now()
        self.after = end  # with an end event, the pass's last posts wait for it on the wire
        try:
            self.execute(self.messenger.on_batch_done())
        finally:
            self.after = None
        if end is not None:
            end.synchronize()  # the pass, not the copies just posted (a device sync would wait)
            end_s = self.now()
        for r in prefilled:
            row = self.transfer_row(r.id)
            row[4], row[5] = r.prefill_start_s, end_s
            del self.requests[r.id]
        self.record("prefill", start, batch)
        return True

    def follow_layers(self, before: int) -> None:
        """Post each layer's pages as the watcher sees the counter pass it. Control messages
        are handled meanwhile: a decoder's pages that come mid-pass (parallel handoff) take
        what the pass has produced so far at once, and the rest layer by layer."""
        done = 0
        while done < self.layers:
            self.handle(self.control.recv(0.0))
            try:
                n = self.layer_q.get(timeout=0.001) - before
            except queue.Empty:
                self.poll_wire()
                continue
            if n > done:
                done = min(n, self.layers)
                self.execute(self.messenger.on_layers(done))

    def run(self) -> None:
        try:
            super().run()
        finally:
            self.watcher.stop()


class GeneratingServer(Server):
    """A server that emits tokens (decode or colocated) and reports finished requests."""

    def __init__(self, cfg: NodeConfig, control: Control | None = None) -> None:
        super().__init__(cfg, control)
        self.outputs: dict[int, list[int]] = {}
        self.meta_sums: dict[int, float | torch.Tensor] = {}  # device sums: read at finish
        self.first_logits: dict[int, torch.Tensor] = {}

    def finish(self, req: Request, logits: torch.Tensor | None = None) -> None:
        if req.status is Status.FINISHED:
            req.finish_s = self.now()
        msg = _finished(
            req,
            self.outputs.pop(req.id, []),
            logits,
            self.first_logits.pop(req.id, None),
            self.cfg.return_logits,
            float(self.meta_sums.pop(req.id, math.nan)),
        )
        self.control.send("driver", msg)


# ---- decode ------------------------------------------------------------------------------
class DecodeServer(GeneratingServer):
    role = "decode"

    def __init__(self, cfg: NodeConfig, control: Control | None = None) -> None:
        super().__init__(cfg, control)
        t, group = self.exp.transfer, self.exp.cluster.decode
        self.plan = _single_gpu_plan(self.exp, self.cache.layers[0].element_size())
        self.messenger = m.DecodeMessenger(
            cfg.index,
            self.pool,
            self.expected,
            max_attempts=t.max_attempts,
            timeout_s=t.timeout_s,
            handoff=t.handoff,
        )
        self.scheduler = DecodeScheduler(group.max_batch)
        self.runner.capture_up_to(group.max_batch)
        self.requests: dict[int, Request] = {}
        self.slots: dict[int, int] = {}

    def announce(self) -> None:
        super().announce()
        assert self.wire is not None
        self.wake_fd = self.wire.wake_fd()

    def idle_wait_s(self) -> float:
        if self.messenger.inbound and self.wake_fd is None and not SPIN:
            return 200e-6  # KV on its way over a wire without a wake-up fd: poll it often
        return super().idle_wait_s()

    def expected(self, req: Request, prefill_node: int, pages: int) -> dict[int, int]:
        return self.plan.expected_immediates(pages, self.layers, metadata=True)

    def on_message(self, msg: Any) -> None:
        if isinstance(msg, Submit):
            self.mark(msg.req_id, "received")
            req = msg.request()
            self.requests[req.id], self.outputs[req.id] = req, []
            self.execute(self.messenger.submit(req, 0, self.now()))
            self.plan_first_pass(req)  # after the handoff has left
        else:
            self.execute(self.messenger.on_message(msg))

    def on_dead(self, peer: str) -> None:
        super().on_dead(peer)
        if peer.startswith("prefill"):
            self.execute(self.messenger.on_peer_dead(int(peer[7:]), "no heartbeat"))

    def execute(self, cmds: list[m.Command]) -> None:
        for cmd in cmds:
            if isinstance(cmd, m.Send):
                if isinstance(cmd.msg, m.PrefillRequest):
                    self.slots[cmd.msg.req_id] = cmd.msg.slot
                    self.mark(cmd.msg.req_id, "handed_off")  # before it leaves: causal order
                self.control.send(f"prefill{cmd.node}", cmd.msg)
            elif isinstance(cmd, m.Ready):
                req = self.requests[cmd.req_id]
                req.ready_s = self.now()
                if cmd.req_id in self.slots:
                    # summed on the device, no sync: the first pass should not wait for it
                    self.meta_sums[req.id] = self.meta[self.slots.pop(req.id)].sum()
                self.scheduler.add_ready(req)
            elif isinstance(cmd, m.Failed):
                self.finish(self.requests[cmd.req_id])
            elif isinstance(cmd, m.Retry):
                self.execute(self.messenger.submit(self.requests[cmd.req_id], 0, self.now()))

    def tick(self) -> None:
        assert self.wire is not None
        for imm in self.wire.poll().immediates:
            self.execute(self.messenger.on_immediates(*unpack_imm(imm)))
        self.execute(self.messenger.check_timeouts(self.now()))
        super().tick()

    def plan_first_pass(self, req: Request) -> bool:
        """Plan `req`'s first pass now (Runner.plan_ahead) if it will be the next step: its KV
        is inbound and nothing else runs, is ready or is inbound. True if planned."""
        alone = not len(self.scheduler) and len(self.messenger.inbound) == 1
        if PLAN_AHEAD and req.status is Status.RESERVED and alone:
            return self.runner.plan_ahead([self.seq(req)])
        return False

    def seq(self, r: Request) -> Seq:
        """`r`'s next decode pass: its last token (the prompt's, first) at its last position."""
        out = self.outputs[r.id]
        last = out[-1] if out else r.prompt[-1]
        return Seq.of([last], r.prompt_tokens - 1 + len(out), self.pool.pages_of(r.id))

    def step(self) -> bool:
        batch = self.scheduler.schedule()
        if batch.empty:
            return False
        start = self.now()
        res = self.runner.step([self.seq(r) for r in batch.decodes], sample=True)
        assert res.tokens is not None
        for r, tok in zip(batch.decodes, res.tokens, strict=True):
            self.outputs[r.id].append(tok)
        for i, r in enumerate(batch.decodes):
            if r.generated == 0:
                r.first_token_s = self.now()
                self.first_logits[r.id] = res.logits[i]
        done = self.scheduler.complete(batch).finished
        self.record("decode", start, batch)
        for i, r in enumerate(batch.decodes):
            if r in done:
                self.finish(r, res.logits[i])
                self.execute(self.messenger.release(r.id, self.now()))
        return True


# ---- colocated ---------------------------------------------------------------------------
class ColocatedServer(GeneratingServer):
    role = "colocated"

    def __init__(self, cfg: NodeConfig, control: Control | None = None) -> None:
        super().__init__(cfg, control)
        g = self.exp.cluster.colocated
        self.scheduler = ColocatedScheduler(self.pool, g.token_budget, g.max_batch)
        self.runner.capture_up_to(g.max_batch)

    def announce(self) -> None:  # no wire: nothing crosses a network
        self.control.send("driver", NodeUp(self.cfg.name, self.control.endpoint, {}, ()))

    def on_message(self, msg: Any) -> None:
        if isinstance(msg, Submit):
            self.mark(msg.req_id, "received")
            req = msg.request()
            self.outputs[req.id] = []
            self.scheduler.add(req)
            if req.status is Status.FAILED:
                self.finish(req)

    def step(self) -> bool:
        batch = self.scheduler.schedule()
        if batch.empty:
            return False
        start = self.now()
        seqs = [
            Seq.of(
                c.req.prompt[c.start : c.start + c.tokens],
                c.start,
                self.pool.pages_of(c.req.id),
                hidden_at=-2 if c.tokens > 1 else None,
            )
            for c in batch.chunks
        ]
        for r in batch.decodes:
            out = self.outputs[r.id]
            seqs.append(Seq.of([out[-1]], r.prompt_tokens - 1 + len(out), self.pool.pages_of(r.id)))
        for c in batch.chunks:
            if math.isnan(c.req.prefill_start_s):
                c.req.prefill_start_s = start
        res = self.runner.step(seqs, sample=True)
        assert res.tokens is not None
        rows = [c.req for c in batch.chunks] + batch.decodes
        for i, c in enumerate(batch.chunks):
            if c.last:
                self.outputs[c.req.id].append(res.tokens[i])
                self.first_logits[c.req.id] = res.logits[i]
                if c.tokens > 1:
                    self.meta_sums[c.req.id] = float(res.hidden[i].float().sum())
        for r, tok in zip(batch.decodes, res.tokens[len(batch.chunks) :], strict=True):
            self.outputs[r.id].append(tok)
        progress = self.scheduler.complete(batch)
        for r in progress.prefilled:
            r.prefill_end_s = r.first_token_s = self.now()
        self.record("mixed" if batch.chunks else "decode", start, batch)
        for r in progress.finished:
            self.finish(r, res.logits[rows.index(r)])
        return True


def _finished(
    req: Request,
    tokens: list[int],
    logits: torch.Tensor | None,
    first: torch.Tensor | None,
    with_logits: bool,
    meta_sum: float,
) -> Finished:
    times = {
        k: getattr(req, k)
        for k in ("prefill_start_s", "prefill_end_s", "ready_s", "first_token_s", "finish_s")
    }

    def values(t: torch.Tensor | None) -> tuple[float, ...]:
        if not with_logits or t is None:
            return ()
        return tuple(np.asarray(t.float().cpu()).tolist())

    return Finished(
        req.id,
        str(req.status),
        req.fail_reason,
        tuple(tokens),
        times,
        values(logits),
        values(first),
        meta_sum,
        req.prefill_node,
        req.decode_node,
    )
