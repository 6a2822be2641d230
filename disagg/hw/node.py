"""Prefill, decode and colocated servers: the core's roles (disagg.core.roles) on a real model.
This module holds what they share (the `Server` loop); each server is the port of its role, in
`prefill.py` and `decode.py`; the process body is `serve.py`, the messages `protocol.py`.

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

import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from typing import Any

import torch

from disagg.config import Experiment
from disagg.core.kvcache import PagePool
from disagg.core.metrics import Recorder
from disagg.core.scheduler import Batch
from disagg.core.sharding import TransferPlan, plan_transfer, shard_layout
from disagg.errors import DisaggError
from disagg.hw import latency
from disagg.hw.control import Control
from disagg.hw.device import resolve_device
from disagg.hw.model import Transformer
from disagg.hw.protocol import (
    META_SLOTS,
    NodeConfig,
    NodeUp,
    Peers,
    Records,
    Shutdown,
    Start,
    Started,
    Submit,
)
from disagg.hw.runner import GRAPH_BATCHES, Runner
from disagg.hw.transport import make_transport
from disagg.hw.transport.base import Transport
from disagg.settings import HW_PAGES


@dataclass
class _Stats:
    steps: Recorder = field(default_factory=Recorder)  # its steps rows only
    transfers: dict[int, list[Any]] = field(default_factory=dict)
    submits: int = 0
    hops: list[tuple[int, str, str, float]] = field(default_factory=list)


class Server:
    kind = "server"

    def __init__(self, cfg: NodeConfig, control: Control | None = None) -> None:
        """`control`: this node's control endpoint, connected to the driver (made if None)."""
        self.cfg = cfg
        self.exp = Experiment.model_validate(cfg.experiment)
        self.hw = self.exp.hw
        device = self.hw.prefill_device if self.kind == "prefill" else self.hw.decode_device
        if device == "cpu":  # a server shares the CPU with its peers and the driver
            torch.set_num_threads(max(1, (os.cpu_count() or 2) // 2))
        else:  # one GPU per server: its current device (streams, events, graphs, kernels)
            torch.cuda.set_device(resolve_device(device))
        self.spec = self.exp.model.spec
        self.layers = self.spec.layers
        if control is None:
            control = Control(cfg.name, cfg.bind, dead_after_s=self.hw.dead_after_s)
            control.connect("driver", cfg.driver)
        self.control = control
        self.wake_fd: int | None = None  # wakes an idle loop when immediates arrive
        self.model = Transformer(
            self.spec, seed=self.exp.seed, device=device, fused_ops=self.hw.latency.fused_ops
        )
        kv = self.exp.kv
        pages = kv.pages or HW_PAGES
        self.cache = self.model.new_cache(pages, kv.page_size, kv.layout)
        self.pool = PagePool(pages, kv.page_size, cfg.name)
        # a prefill server's passes run eagerly (one of only 1-token chunks would otherwise
        # replay, and first capture, a decode graph); the others capture theirs at start
        graphs = () if self.kind == "prefill" else GRAPH_BATCHES
        self.runner = Runner(
            self.model, self.cache, attention=self.hw.attention, graph_batches=graphs
        )
        self.stats = _Stats()
        self.t0 = time.time()
        self.running = True
        self.early_messages = 0  # from peers, before the driver's Start (kept: wait_start)
        self.wire: Transport | None = None

    # -- lifecycle
    def run(self) -> None:
        error = ""
        try:
            self.announce()
            self.handle_early(self.wait_start())
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
                latency.held()
                | {"cuda_graphs": self.runner.captured, "graph_error": self.runner.graph_error},
                {
                    "passes_planned_ahead": self.runner.planned_ahead,
                    "graphs_captured_on_demand": self.runner.captured_on_demand,
                    "messages_before_start": self.early_messages,
                },
                tuple(self.stats.hops),
            ),
        )
        if self.wire is not None:
            self.wire.close()
        self.control.close(linger_s=5.0)  # let the records leave first

    def announce(self) -> None:
        self.wire = make_transport(self.hw.wire, endpoint=self.cfg.name, **self.wire_options())
        regions = [
            self.wire.register(f"kv{i}", self.cache.layer_bytes(i)).to_dict()
            for i in range(self.layers)
        ]
        regions += [self.wire.register("meta", self.meta).to_dict()]
        self.control.send(
            "driver",
            NodeUp(self.cfg.name, self.control.endpoint, self.wire.local_info(), tuple(regions)),
        )

    def wire_options(self) -> dict[str, Any]:
        """The experiment's settings of this server's wire (`[hw.cuda]`, `[hw.verbs]`)."""
        if self.hw.wire == "cuda":
            return self.hw.cuda.model_dump()
        if self.hw.wire == "verbs":
            return self.hw.verbs.model_dump()
        return {}

    @property
    def meta(self) -> torch.Tensor:
        """Metadata rows (float32 hidden states), one per slot; registered with the wire."""
        if not hasattr(self, "_meta"):
            self._meta = torch.zeros(
                (META_SLOTS, self.spec.hidden), dtype=torch.float32, device=self.model.device
            )
        return self._meta

    def wait_start(self) -> list[tuple[str, Any]]:
        """Meet the peers, then wait for the driver's Start (the run's clock). A peer may
        already be running and send before this server's Start is read (each sender's
        messages come in order, but not across senders): those are kept, in order, and
        returned, to be handled once the server runs."""
        early: list[tuple[str, Any]] = []
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
                return early
            elif isinstance(msg, Shutdown):
                self.running = False
                return []
            else:
                early.append(got)

    def handle_early(self, early: list[tuple[str, Any]]) -> None:
        """Handle the peers' messages that came before the start, in order, before any that
        the socket holds now (a sender's later messages must not overtake its earlier ones)."""
        self.early_messages = len(early)
        for _, msg in early:
            self.dispatch(msg)

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
            self.dispatch(got[1])
            got = self.control.recv(0.0) if self.running else None

    def dispatch(self, msg: Any) -> None:
        """One control message: Shutdown stops the loop; the rest go to the role."""
        if isinstance(msg, Shutdown):
            self.running = False
            return
        self.stats.submits += isinstance(msg, Submit)
        self.on_message(msg)

    def on_message(self, msg: Any) -> None:
        raise NotImplementedError

    # -- the port's parts every role uses (disagg.core.roles.Port)
    def send(self, role: str, node: int, msg: Any) -> None:
        self.control.send(f"{role}{node}", msg)

    def wake(self) -> None:
        """Nothing to do: the loop asks its role for a pass every turn."""

    def idle_wait_s(self) -> float:
        """How long an idle loop waits for a control message (they wake it at once)."""
        return 0.0 if self.hw.latency.spin else 0.002

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


def single_gpu_plan(exp: Experiment, elem_bytes: int) -> TransferPlan:
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
