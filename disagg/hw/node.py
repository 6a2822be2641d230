"""Prefill, decode and colocated servers: the core's roles (disagg.core.roles) on a real model.
This module holds what they share (the `Server` loop); each server is the port of its role, in
`prefill.py` and `decode.py`; the process body is `serve.py`, the messages `protocol.py`.

Each server is one process with one main loop that owns the core objects (they are not
thread-safe); a node of tp x dp > 1 ranks adds follower processes that only compute, this
process leading them and moving every rank's pages (`ranks.py`; DP attention there too). The
only other threads are the layer watcher, which turns the GPU layer counter into "layers
done" values on a queue, and whatever a wire runs inside. A server talks to the driver
(`disagg.hw.driver`) and its peers over the ZeroMQ control plane, and moves KV pages over a
wire (tcp, cuda or verbs):

    driver -> Submit -> decode: reserve pages, PrefillRequest -> prefill
    (handoff "parallel": driver -> Submit -> prefill too, which starts before the pages come)
    prefill: chunks -> forward pass; counter moves -> PostWrites -> wire.post(units, imm=slot)
    decode: immediates -> Ready -> decode passes -> Finished -> driver
"""

from __future__ import annotations

import collections
import math
import os
import random
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
from disagg.errors import DisaggError, ProtocolError, TransportError
from disagg.hw import latency
from disagg.hw.auth import control_secret
from disagg.hw.control import Control
from disagg.hw.device import resolve_device
from disagg.hw.protocol import (
    META_SLOTS,
    Inject,
    NodeConfig,
    NodeUp,
    Peers,
    Records,
    Shutdown,
    Start,
    Started,
    Submit,
)
from disagg.hw.ranks import LeaderRunner, join_node, node_caches, rank_model, register_pages
from disagg.hw.runner import GRAPH_BATCHES, Runner, StepOutput
from disagg.hw.transport import make_transport
from disagg.hw.transport.base import Transport
from disagg.settings import HW_PAGES


@dataclass
class _Stats:
    steps: Recorder = field(default_factory=Recorder)  # its steps rows only
    transfers: dict[int, list[Any]] = field(default_factory=dict)
    submits: int = 0
    hops: list[tuple[int, str, str, float]] = field(default_factory=list)


DRIVER_ONLY = (Peers, Start, Shutdown, Submit, Inject)  # what only the driver sends a server


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
            control = Control(
                cfg.name,
                cfg.bind,
                dead_after_s=self.hw.dead_after_s,
                allowed=cfg.senders,
                secret=control_secret(
                    self.hw, cfg.bind, cfg.driver, given=cfg.secret, base_dir=self.exp.base_dir
                ),
            )
            control.connect("driver", cfg.driver)
        self.control = control
        self.wake_fd: int | None = None  # wakes an idle loop when immediates arrive
        # a node of several ranks: this process is its leader, rank 0 (disagg.hw.ranks)
        self.tp = join_node(cfg, 0, self.hw.start_timeout_s) if cfg.ranks > 1 else None
        began = time.perf_counter()
        self.model = rank_model(cfg, self.exp, self.tp)
        kv = self.exp.kv
        # every rank's KV pages, by rank: the leader's wire moves them all (those it maps from
        # a follower's GPU registered with the follower's export of them)
        self.rank_caches, self.exported = node_caches(cfg, self.exp, self.model, self.tp)
        self.cache = self.rank_caches[0]
        self.build_s = time.perf_counter() - began  # the weights drawn, the pages allocated
        self.pool = PagePool(kv.pages or HW_PAGES, kv.page_size, cfg.name)
        # a prefill server's passes run eagerly (one of only 1-token chunks would otherwise
        # replay, and first capture, a decode graph), and so do a leader's (its followers run
        # theirs eagerly, and a graph would replay its collectives without them); the others
        # capture theirs at start
        graphs = () if self.kind == "prefill" or self.tp is not None else GRAPH_BATCHES
        runner = Runner if self.tp is None else LeaderRunner
        self.runner = runner(
            self.model,
            self.cache,
            attention=self.hw.attention,
            graph_batches=graphs,
            count_layers=self.kind == "prefill",  # its KV goes out layer by layer
            prefill_graphs=self.hw.latency.prefill_graphs,
        )
        self.runner.capture_pieces()  # before the warm-up pass, which replays them
        self.warm_up_s: float | None = None  # its warm-up passes (None: none ran)
        warm = self.hw.warm_up
        if self.model.device.type == "cuda" if warm is None else warm:  # one-time costs, now
            began = time.perf_counter()
            self.runner.warm_up(
                getattr(self.exp.cluster, cfg.role).token_budget, self.rank_caches[1:]
            )
            self.warm_up_s = time.perf_counter() - began
        self.stats = _Stats()
        self.t0 = time.time()
        self.running = True
        self.early_messages = 0  # from peers, before the driver's Start (kept: wait_start)
        self.dropped = 0  # control messages refused (Server.drop)
        self.peers_declared_dead = 0  # peers silent for longer than hw.dead_after_s
        self.faults_injected = 0  # Inject messages carried out
        self.last_tick_s = time.monotonic()
        self.dead: set[str] = set()  # peers silent for longer than hw.dead_after_s
        # a delay_control fault: until when, and by how much, peers' messages are held (both
        # ways); held ones leave (or are handled) in order, at their due time
        self.delay: tuple[float, float] = (0.0, 0.0)
        self.held: collections.deque[tuple[float, str, Any, bool]] = collections.deque()
        self.wire: Transport | None = None

    # -- lifecycle
    def run(self) -> None:
        error = ""
        began: dict[str, float] = {}  # latency.usage() at the start: what the run took after
        try:
            self.announce()
            early = self.wait_start()
            began = latency.usage()
            self.handle_early(early)
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
                | {"cuda_graphs": self.runner.captured, "graph_error": self.runner.graph_error}
                | {"build_s": self.build_s, "capture_s": self.runner.capture_s}
                | {"weights_read": list(self.model.weights_read)}
                | {"warm_up_s": self.warm_up_s}
                | {
                    "host_during_run": latency.used_between(began, latency.usage()) if began else {}
                },
                {
                    "passes_planned_ahead": self.runner.planned_ahead,
                    "graphs_captured_on_demand": self.runner.captured_on_demand,
                    "passes_in_pieces": self.runner.passes_in_pieces,
                    "messages_before_start": self.early_messages,
                    "messages_dropped": self.dropped + self.control.dropped,  # protocol + socket
                    "peers_declared_dead": self.peers_declared_dead,
                    "faults_injected": self.faults_injected,
                    "pages_in_use": self.pool.used_pages,  # at the end: 0 unless cut short
                },
                tuple(self.stats.hops),
            ),
        )
        if isinstance(self.runner, LeaderRunner):
            self.runner.stop_followers()
        if self.wire is not None:
            self.wire.close()
        self.control.close(linger_s=5.0)  # let the records leave first

    def announce(self) -> None:
        self.wire = make_transport(self.hw.wire, endpoint=self.cfg.name, **self.wire_options())
        regions = [d.to_dict() for d in register_pages(self.wire, self.rank_caches, self.exported)]
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
            sender, msg = got
            if isinstance(msg, DRIVER_ONLY) and sender != "driver":
                self.drop(sender, msg, "only the driver sends it")
            elif isinstance(msg, Peers):
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
        for sender, msg in early:
            self.dispatch(sender, msg)

    def meet(self, peer: dict[str, Any]) -> None:
        self.control.connect(peer["name"], peer["endpoint"])

    def now(self) -> float:
        return time.time() - self.t0

    def mark(self, req_id: int, event: str, at_s: float | None = None) -> None:
        """Stamp a request's control-plane event on this node (the run's hops table), now or
        at `at_s` (the run's clock): `received` (the request reached this node), `handed_off`
        (a decoder is about to send it to prefill), `pages` (a prefill node got the
        decoder's pages), `landed` (the last immediate of its KV reached a decoder's wire,
        which the decoder takes between passes)."""
        self.stats.hops.append((req_id, self.cfg.name, event, self.now() if at_s is None else at_s))

    def tick(self) -> None:
        """One turn of the main loop: messages, wire events, then at most one forward pass."""
        busy = self.step()
        self.handle(self.control.recv(0.0 if busy else self.idle_wait_s(), self.wake_fd))
        if not self.running:
            return
        self.control.heartbeat()
        now = time.monotonic()
        if now - self.last_tick_s > self.hw.dead_after_s / 2:  # this process was stopped (or
            # ran one long pass): its peers' queued heartbeats may not be read in yet, so their
            # silence says nothing; hear them out before judging
            self.control.last_seen = dict.fromkeys(self.control.last_seen, now)
        self.last_tick_s = now
        while self.held and self.held[0][0] <= now:
            _, peer, msg, outgoing = self.held.popleft()
            if outgoing:
                self.control.send(peer, msg)
            else:
                self.handle_peer(peer, msg)
        # judged at this tick's `now`: a stop after it shows as the next tick's gap, not as
        # every peer's silence
        dead = set(self.control.dead_peers(now))
        for peer in sorted(dead - self.dead):  # once per death: a stalled peer may come back
            self.on_dead(peer)
        self.dead = dead

    def handle(self, got: tuple[str, Any] | None) -> None:
        """Handle `got` and every control message waiting behind it."""
        while got is not None and self.running:
            self.dispatch(*got)
            got = self.control.recv(0.0) if self.running else None

    def dispatch(self, sender: str, msg: Any) -> None:
        """One control message from `sender`: the driver's (Shutdown stops the loop) only
        from the driver, the messenger's only from a peer; one that breaks the protocol is
        dropped, said and counted, never a crash (it came from the network)."""
        if isinstance(msg, DRIVER_ONLY) != (sender == "driver"):
            self.drop(sender, msg, "not from this sender")
            return
        if isinstance(msg, Shutdown):
            self.running = False
        elif isinstance(msg, Inject):
            self.inject(msg)
        elif sender != "driver" and self.hold(sender, msg, outgoing=False):
            pass  # a delay_control fault: handled later
        else:
            self.handle_peer(sender, msg)

    def handle_peer(self, sender: str, msg: Any) -> None:
        self.stats.submits += isinstance(msg, Submit)
        try:
            self.on_message(msg)
        except ProtocolError as e:
            self.drop(sender, msg, str(e))

    def hold(self, peer: str, msg: Any, outgoing: bool) -> bool:
        """Hold a message to or from a peer while a delay_control fault lasts (and behind any
        still held: order is kept); True if held."""
        now = time.monotonic()
        until, delay_s = self.delay
        if now >= until and not self.held:
            return False
        due = max(now + (delay_s if now < until else 0.0), self.held[-1][0] if self.held else 0.0)
        self.held.append((due, peer, msg, outgoing))
        return True

    def inject(self, fault: Inject) -> None:
        """A fault the driver injects here (disagg.faults; the driver checked the wire)."""
        try:
            if fault.kind == "delay_control":
                self.delay = (time.monotonic() + fault.for_s, fault.delay_s)
            elif self.wire is None:
                raise TransportError("no wire")
            elif fault.kind == "drop_connection":
                self.wire.reset(fault.peer)
            elif fault.kind in ("nic_down", "nic_degrade"):
                self.wire.impair(fault.for_s, fault.gbps * 1e9 / 8)
            else:
                raise TransportError(f"unknown fault {fault.kind!r}")
            self.faults_injected += 1
        except TransportError as e:
            self.drop("driver", fault, str(e))

    def drop(self, sender: str, msg: Any, why: str) -> None:
        """Refuse a control message: said on stderr, counted in the records."""
        self.dropped += 1
        name = type(msg).__name__
        print(f"{self.cfg.name}: dropped {name} from {sender}: {why}", file=sys.stderr)

    def bad_prompt(self, prompt: tuple[int, ...], output_tokens: int = 1) -> str:
        """Why a request of `prompt` cannot run on this model ('' if it can)."""
        vocab = self.spec.vocab
        if not prompt or output_tokens < 1:
            return f"a request needs a prompt and an output: got {len(prompt)} and {output_tokens}"
        low, high = min(prompt), max(prompt)
        if low < 0 or high >= vocab:
            return f"token id {low if low < 0 else high} is outside the vocabulary [0, {vocab})"
        return ""

    def group(self, req_id: int) -> int:
        """The DP attention group of this node that holds request `req_id` (`dp_rank`)."""
        return dp_rank(self.exp, self.kind, req_id)

    def on_message(self, msg: Any) -> None:
        raise NotImplementedError

    # -- the port's parts every role uses (disagg.core.roles.Port)
    def send(self, role: str, node: int, msg: Any) -> None:
        if not self.hold(f"{role}{node}", msg, outgoing=True):
            self.control.send(f"{role}{node}", msg)

    def wake(self) -> None:
        """Nothing to do: the loop asks its role for a pass every turn."""

    def idle_wait_s(self) -> float:
        """How long an idle loop waits for a control message (they wake it at once)."""
        return 0.0 if self.hw.latency.spin else 0.002

    def on_dead(self, peer: str) -> None:
        self.peers_declared_dead += 1
        if peer == "driver":
            print(f"{self.cfg.name}: the driver fell silent; stopping", file=sys.stderr)
            self.running = False

    def step(self) -> bool:
        """Run one forward pass if there is work; True if one ran."""
        raise NotImplementedError

    def record(
        self,
        kind: str,
        start: float,
        batch: Batch,
        res: StepOutput,
        chained: bool = False,
        end: float | None = None,
    ) -> None:
        """The steps row of the pass of `batch` begun at `start` (`now`), just run (its output
        `res`), to `end` (default: now): its device time, and where its host time went
        (`Recorder.batch`). A `chained` pass was launched while the pass before it ran
        (hw.latency.chain): its row begins when that one was read, and its host time before
        and during its launch was spent before then (NaN)."""
        took = (self.now() if end is None else end) - start
        began, launched = res.launched
        before, launch = (
            (math.nan, math.nan) if chained else (began - self.t0 - start, launched - began)
        )
        self.stats.steps.batch(
            self.cfg.name,
            kind,
            start,
            took,
            batch,
            device_s=res.device_s(),
            host_before_s=before,
            launch_s=launch,
            chained=int(chained),
        )

    def sync(self) -> None:
        if self.model.device.type == "cuda":
            torch.cuda.synchronize(self.model.device)


def dp_rank(exp: Experiment, role: str, req_id: int) -> int:
    """The DP attention group of a `role` node that holds request `req_id`: drawn at random,
    as the simulator and the transfer planner assume, from a generator seeded by the run's seed,
    the role and the request, so that the prefill and decode nodes draw alike without a message
    (the core's PrefillRequest names no group). 0 for a node of one group."""
    dp = exp.cluster.groups[role].dp
    return 0 if dp == 1 else random.Random(f"{exp.seed}/{role}/{req_id}").randrange(dp)


def transfer_plan(
    exp: Experiment, elem_bytes: int, src_dp_rank: int = 0, dst_dp_rank: int = 0
) -> TransferPlan:
    """The writes of one page of one layer from attention group `src_dp_rank` of the prefill
    node to group `dst_dp_rank` of the decode node (`cluster.<role>.tp` x `.dp` ranks each,
    numbered as the planner numbers them; both sides plan alike, from the experiment's seed).
    One rank on each side: one write per page per layer."""
    spec, cluster = exp.model.spec, exp.cluster
    dtype = {4: "fp32", 2: "bf16", 1: "fp8"}[elem_bytes]
    return plan_transfer(
        shard_layout(spec, cluster.prefill.tp, cluster.prefill.dp),
        shard_layout(spec, cluster.decode.tp, cluster.decode.dp),
        exp.kv.page_size,
        exp.kv.layout,
        dtype,
        exp.seed,
        src_dp_rank=src_dp_rank,
        dst_dp_rank=dst_dp_rank,
    )
