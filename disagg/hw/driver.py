"""`disagg hw run`: start the servers, replay the workload in real time, collect the tables.

The driver spawns one process per server (`cluster.<role>.nodes` per role; one per rank of a
node of tp x dp > 1: disagg.hw.ranks), or waits for servers started elsewhere with `disagg hw
serve`, introduces every prefill node to every decode node, replays the experiment's arrivals
against the wall clock, each to the node the experiment's router picks (as the simulator's
does), and gathers what each request finished with. It writes the same requests, steps and
transfers tables and summary as `disagg sim run`, and one table of its own: `hops`, when each
request's control messages left and arrived (Server.mark). Every child is stopped on the way
out, Ctrl-C included; a server (or a rank of one) that dies fails its own requests while its
role has another node alive (`Driver.lose`), and is an error naming it otherwise.
"""

from __future__ import annotations

import math
import multiprocessing as mp
import os
import shutil
import signal
import sys
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import torch

from disagg.config import Experiment, GroupConfig
from disagg.core.metrics import (
    Recorder,
    handoff_parts,
    host_share,
    queue_parts,
    requests_table,
    steps_table,
    summarize,
    transfers_table,
    write_results,
)
from disagg.core.policies import make_router
from disagg.core.request import Request, Status
from disagg.core.slo import Slo
from disagg.core.workload import generate
from disagg.errors import ConfigError, TransportError
from disagg.faults import (
    DelayControl,
    DropConnection,
    Kill,
    NicDegrade,
    NicDown,
    Stop,
    attribute,
)
from disagg.hardware import DEVICE_NAMES
from disagg.hw import latency
from disagg.hw.attention import parse_attention
from disagg.hw.auth import control_secret
from disagg.hw.control import Control
from disagg.hw.model import rank_cuts
from disagg.hw.protocol import (
    MAX_RANKS,
    Finished,
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
from disagg.hw.ranks import LOST_GROUP, collective_backend, follow, rank_devices, rank_dir
from disagg.hw.serve import serve
from disagg.hw.tp import TensorParallel
from disagg.settings import HW_PAGES
from disagg.trace import write_trace


@dataclass
class HwRun:
    requests: dict[int, Request] = field(default_factory=dict)
    finished: dict[int, Finished] = field(default_factory=dict)
    records: dict[str, Records] = field(default_factory=dict)
    sent: list[tuple[int, str, str, float]] = field(default_factory=list)  # the driver's hops
    ended_s: dict[int, float] = field(default_factory=dict)  # when the driver heard the end
    stopped_s: float = math.nan  # when the run stopped early (a server died, ...)


def hw_experiment(exp: Experiment, gpus: int | None = None) -> Experiment:
    """`exp` as a hardware run runs it, so that the run's experiment.json records it and its
    replay simulates that: its KV pool given (HW_PAGES unless set); and, given this host's
    `gpus`, `cluster.shared_gpu` where every server runs on one GPU (`shares_one_gpu`) and,
    where the experiment names a catalogue GPU, the one its servers run on as `hardware.gpu`
    (`recorded_gpu`; a table of the experiment's own is its model of the device, and kept)."""
    exp = exp if exp.kv.pages else exp.updated(f"kv.pages={HW_PAGES}")
    if gpus is None:
        return exp
    if shares_one_gpu(exp, gpus) and not exp.cluster.shared_gpu:
        exp = exp.updated("cluster.shared_gpu=true")
    names = device_names(server_devices(exp, gpus)) if isinstance(exp.hardware.gpu, str) else {}
    if names and (gpu := recorded_gpu(exp, names)) != exp.hardware.gpu_spec.name:
        exp = exp.updated(f"hardware.gpu={gpu}")
    return exp


def device_names(devices: set[str]) -> dict[str, str]:
    """CUDA's name of each of `devices` (torch.cuda.get_device_name); none unless every one is a
    CUDA device of this host."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    indices = {d: (torch.device(d).index or 0) if d.startswith("cuda") else count for d in devices}
    if not devices or max(indices.values()) >= count:
        return {}
    return {d: torch.cuda.get_device_name(i) for d, i in indices.items()}


def recorded_gpu(exp: Experiment, names: dict[str, str]) -> str:
    """The catalogue GPU a run of `exp` records, given the CUDA name of each device its
    servers run on (`names`): the one their names are (`DEVICE_NAMES`), so that a run on an
    H100 of an experiment that names an H200 replays on an H100; else the experiment's, with a
    warning that its roofline replays model that one."""
    found = {DEVICE_NAMES.get(name) for name in names.values()}
    if len(found) == 1 and (gpu := found.pop()) is not None:
        return gpu.name
    said = ", ".join(f"{d} is {name}" for d, name in sorted(names.items()))
    known = ", ".join(sorted(DEVICE_NAMES))
    warnings.warn(
        f"{said}: not one GPU of the catalogue ({known}); the run records hardware.gpu="
        f"{exp.hardware.gpu_spec.name} as the experiment gives it, and its roofline replays "
        "model that GPU",
        stacklevel=3,
    )
    return exp.hardware.gpu_spec.name


def server_devices(exp: Experiment, gpus: int) -> set[str]:
    """The devices the servers of `exp` run on, on a host of `gpus` CUDA GPUs (`rank_devices`)."""
    devices: set[str] = set()
    for role, g in exp.cluster.groups.items():
        device = exp.hw.prefill_device if role == "prefill" else exp.hw.decode_device
        devices |= set(rank_devices(device, g.tp * g.dp, gpus))
    return devices


def shares_one_gpu(exp: Experiment, gpus: int) -> bool:
    """Whether the servers of `exp`, more than one process, all run on one CUDA GPU of a host
    of `gpus` (`server_devices`): their passes share it there."""
    devices = server_devices(exp, gpus)
    if "cpu" in devices:
        return False
    processes = sum(g.nodes * g.tp * g.dp for g in exp.cluster.groups.values())
    return len({torch.device(d).index or 0 for d in devices}) == 1 and processes > 1


def node_configs(
    exp: Experiment, driver: str, return_logits: bool = False, secret: bytes | None = None
) -> list[NodeConfig]:
    """The servers of `exp` (`cluster.<role>.nodes` per role: prefill0, prefill1, ...,
    decode0, ...), each told the driver's control endpoint (and the control plane's `secret`,
    when it has one)."""
    data = exp.model_dump(mode="json")
    bind = exp.hw.bind.rsplit(":", 1)[0] + ":*"  # the driver's host, any port
    roles = ["colocated"] if exp.cluster.mode == "colocated" else ["prefill", "decode"]
    return [
        NodeConfig(r, i, data, driver, bind, return_logits, secret)
        for r in roles
        for i in range(exp.cluster.groups[r].nodes)
    ]


PEER_ROLES = {"prefill": "decode", "decode": "prefill", "colocated": ""}  # whom a server meets


def prompts_for(exp: Experiment, lengths: list[int]) -> list[tuple[int, ...]]:
    """Seeded random prompt token ids (the model's weights are random too)."""
    rng = np.random.default_rng(exp.seed + 1)
    vocab = exp.model.spec.vocab
    return [tuple(int(t) for t in rng.integers(0, vocab, n)) for n in lengths]


def fault_actions(exp: Experiment, external: tuple[str, ...]) -> list[tuple[float, str, Any]]:
    """The experiment's faults as (time, server, action), in time order. An action is a signal
    (a kill is SIGKILL, a stop SIGSTOP then SIGCONT: spawned servers only) or an Inject message
    the server carries out (its wire's connection or NIC, its control messages). ConfigError
    for a fault this run cannot inject."""
    actions: list[tuple[float, str, Any]] = []
    for i, f in enumerate(exp.faults):
        where = f"faults[{i}]"
        if isinstance(f, Kill | Stop) and f.node in external:
            raise ConfigError(
                f"{where}.node={f.node!r} is started elsewhere: it cannot be signalled"
            )
        if isinstance(f, NicDown | NicDegrade | DropConnection) and exp.hw.wire == "verbs":
            raise ConfigError(
                f"{where}.kind={f.kind!r}: the verbs wire's NICs and connections are not "
                "faulted on request (the simulator models it: disagg sim run)"
            )
        if isinstance(f, NicDegrade) and exp.hw.wire != "tcp":
            raise ConfigError(
                f"{where}.kind='nic_degrade' paces the tcp wire only, not {exp.hw.wire}"
            )
        if isinstance(f, Kill):
            actions.append((f.at_s, f.node, signal.SIGKILL))
        elif isinstance(f, Stop):
            actions += [
                (f.at_s, f.node, signal.SIGSTOP),
                (f.at_s + f.for_s, f.node, signal.SIGCONT),
            ]
        elif isinstance(f, DropConnection):
            actions.append((f.at_s, f.node, Inject("drop_connection", peer=f.peer)))
        elif isinstance(f, NicDegrade):
            actions.append((f.at_s, f.node, Inject(f.kind, for_s=f.for_s, gbps=f.gbps)))
        elif isinstance(f, NicDown):
            actions.append((f.at_s, f.node, Inject(f.kind, for_s=f.for_s)))
        elif isinstance(f, DelayControl):
            actions.append((f.at_s, f.node, Inject(f.kind, for_s=f.for_s, delay_s=f.delay_s)))
    return sorted(actions, key=lambda a: a[0])


def ranks_label(role: str, g: GroupConfig) -> str:
    """A node's ranks as the experiment sets them: 'cluster.decode.tp=2', or
    'cluster.decode: tp=1 x dp=2'."""
    return f"cluster.{role}: tp={g.tp} x dp={g.dp}" if g.dp > 1 else f"cluster.{role}.tp={g.tp}"


def check_hw_experiment(exp: Experiment) -> None:
    """ConfigError unless the hw backend can run every node of the experiment: any number of
    nodes per role; a node of several ranks (tp x dp, one process each, disagg.hw.ranks; dp
    attention groups for MLA models) on the CPU over the tcp or verbs wire (its leader
    registers every rank's pages, files mapped shared, as host memory), on GPUs over the cuda
    wire (NCCL where its ranks have a GPU each, as this host's GPUs place them), and only where
    its ranks split every weight of the model. Checked before any process starts."""
    spec = exp.model.spec
    for role, g in exp.cluster.groups.items():
        device = exp.hw.prefill_device if role == "prefill" else exp.hw.decode_device
        ranks = ranks_label(role, g)
        if g.dp > 1 and spec.attention != "mla":
            raise ConfigError(
                f"cluster.{role} has nodes={g.nodes} tp={g.tp} dp={g.dp}, but DP attention "
                f"runs MLA models only, and {spec.name} is {spec.attention}: --set "
                f"cluster.{role}.dp=1"
            )
        if g.gpus_per_node == 1:
            continue
        if device == "cpu" and exp.hw.wire not in ("tcp", "verbs"):
            raise ConfigError(
                f"{ranks}: a node of several ranks on the CPU runs over the tcp or verbs wire, "
                f"not the {exp.hw.wire} wire (its ranks share their KV pages as host memory): "
                f"--set hw.wire=tcp, or cluster.{role}.tp=1 cluster.{role}.dp=1"
            )
        if device != "cpu":
            devices = rank_devices(device, g.gpus_per_node, torch.cuda.device_count())
            collective_backend(devices, role, ranks)
            if exp.cluster.mode == "disagg" and exp.hw.wire != "cuda":
                raise ConfigError(
                    f"{ranks} on {device}: a node of several ranks on GPUs runs over the cuda "
                    f"wire only, not the {exp.hw.wire} wire (its leader holds its followers' "
                    "pages as CUDA IPC mappings, which the tcp wire, of host memory, cannot "
                    "move and the verbs wire does not register): --set hw.wire=cuda, or "
                    f"cluster.{role}.tp=1 cluster.{role}.dp=1"
                )
        if g.gpus_per_node > MAX_RANKS:
            raise ConfigError(
                f"{ranks}: an immediate names at most {MAX_RANKS} ranks of a node, not "
                f"{g.gpus_per_node}"
            )
        try:
            rank_cuts(
                spec,
                TensorParallel(0, g.gpus_per_node, expert_parallel=g.expert_parallel, dp=g.dp),
            )
        except ConfigError as e:
            raise ConfigError(f"cluster.{role}: {e}") from None


class Driver:
    """`external`: servers started elsewhere (disagg hw serve), by name; `return_logits`: the
    servers send each request's first and last logits with its tokens."""

    def __init__(
        self, exp: Experiment, external: tuple[str, ...] = (), return_logits: bool = False
    ) -> None:
        exp = hw_experiment(exp, None if external else torch.cuda.device_count())
        parse_attention(exp.hw.attention)  # a bad choice fails here, not in every server
        check_hw_experiment(exp)
        self.exp, self.hw, self.external = exp, exp.hw, external
        self.control = Control(
            "driver",
            self.hw.bind,
            dead_after_s=self.hw.silent_after_s,
            secret=control_secret(
                self.hw, self.hw.bind, generate=not external, base_dir=exp.base_dir
            ),
        )
        self.configs = node_configs(exp, self.control.endpoint, return_logits, self.control.secret)
        self.control.allow(cfg.name for cfg in self.configs)  # strangers' messages drop
        self.procs: dict[str, Any] = {}
        self.run_state = HwRun()
        self.stuck: set[str] = set()
        self.faults = fault_actions(exp, external)  # still to inject
        self.tp_dirs: list[str] = []  # nodes' rank directories (with_tp_dir)
        self.t0 = math.nan  # the run's clock starts at the Start
        c = exp.cluster
        self.entry_role = "colocated" if c.mode == "colocated" else "decode"
        self.parallel = c.mode == "disagg" and exp.transfer.handoff == "parallel"
        # the routers, as the simulator's (disagg.sim.cluster.Sim): the decode (or colocated)
        # node of each request, and its prefill node under parallel handoff (the decode nodes
        # route the others' prefill themselves: DecodeServer.route)
        self.routers = {
            self.entry_role: make_router(c.router, range(c.groups[self.entry_role].nodes))
        }
        if self.parallel:
            self.routers["prefill"] = make_router(c.router, range(c.prefill.nodes))
        self.load = {cfg.name: 0 for cfg in self.configs}  # requests sent, not finished
        self.routes: dict[int, tuple[str, ...]] = {}  # each request's nodes, as sent
        self.lost: dict[str, str] = {}  # dead nodes (their role has others alive): why

    # -- starting
    def start(self) -> None:
        if self.external:
            print(f"driver control endpoint: {self.control.endpoint}", flush=True)
        ctx = mp.get_context("spawn")
        self.configs = [self.with_tp_dir(cfg) for cfg in self.configs]
        for cfg in self.configs:
            if cfg.name in self.external:
                continue
            for rank in range(cfg.ranks):  # rank 0, the leader, is the server (disagg.hw.ranks)
                target, args = (serve, (cfg,)) if rank == 0 else (follow, (cfg, rank))
                name = cfg.rank_name(rank)
                proc = ctx.Process(target=target, args=args, name=name, daemon=True)
                proc.start()
                self.procs[name] = proc
        ups: dict[str, NodeUp] = self._gather(NodeUp, self.hw.start_timeout_s, "start")
        for up in ups.values():
            self.control.connect(up.name, up.endpoint)
        role_of = {c.name: c.role for c in self.configs}
        for name in ups:  # every prefill node meets every decode node, and vice versa
            meets = PEER_ROLES[role_of[name]]
            others = tuple(vars(u) for n, u in ups.items() if role_of[n] == meets)
            self.control.send(name, Peers(others))
        self._gather(Started, 120.0, "connect")

    def with_tp_dir(self, cfg: NodeConfig) -> NodeConfig:
        """`cfg` with a directory of its own for its ranks to share, if it has several and is
        started here (`rank_dir`; removed by `stop`). `disagg hw serve` makes an external
        node's."""
        if cfg.ranks == 1 or cfg.name in self.external:
            return cfg
        cfg = rank_dir(cfg)
        self.tp_dirs.append(cfg.tp_dir)
        return cfg

    def _gather(self, kind: type, timeout_s: float, what: str) -> dict[str, Any]:
        names = {c.name for c in self.configs}
        got: dict[str, Any] = {}
        deadline = time.monotonic() + timeout_s
        while set(got) != names:
            self.control.heartbeat()
            msg = self.control.recv(0.5)
            if msg is not None and isinstance(msg[1], kind):
                got[msg[0]] = msg[1]
            elif msg is not None and isinstance(msg[1], Records) and msg[1].error:
                raise self.blame(msg[0], msg[1].error)  # (not started: nothing is lost yet)
            self.check_children()
            if time.monotonic() > deadline:
                missing = sorted(names - set(got))
                raise TransportError(f"servers {missing} did not {what} within {timeout_s:g} s")
        return got

    def check_silent(self) -> None:
        """A server that is alive but has sent nothing, not even a heartbeat, for
        `silent_after_s` is stuck: a spawned one is asked to write its threads' stacks to
        stderr (faulthandler, on SIGUSR1), and the run fails naming it."""
        for name in self.control.dead_peers():
            if name in self.lost:
                continue  # gone: its silence is no news
            self.stuck.add(name)
            proc = self.procs.get(name)
            if proc is not None and proc.is_alive() and hasattr(signal, "SIGUSR1"):
                os.kill(proc.pid, signal.SIGUSR1)
                time.sleep(0.5)  # time to write them
            raise TransportError(
                f"server {name} is alive but has not been heard from for "
                f"{self.hw.silent_after_s:g} s: it is stuck (a spawned server's threads' "
                "stacks are on stderr)"
            )

    def check_children(self) -> None:
        """TransportError naming a child that died, the cause first: a follower rank that
        died by itself before its leader (which fails on its next collective, because of
        it), and any process before a follower that only lost its group."""
        dead = [
            (n, p)
            for n, p in self.procs.items()
            if not p.is_alive() and n.split(".")[0] not in self.lost
        ]
        dead.sort(key=lambda d: (d[1].exitcode == LOST_GROUP, "." not in d[0]))
        for name, proc in dead[:1]:
            self._last_words(name)
            records = self.run_state.records.get(name)
            why = f": {records.error}" if records and records.error else ""
            self.lose(name.split(".")[0], f"server {name} died (exit code {proc.exitcode}){why}")

    def blame(self, node: str, error: str, wait_s: float = 1.0) -> TransportError:
        """The error that stops the run when `node` failed with `error`: the death of one of
        its follower ranks, if one died (waited for up to `wait_s`: its sockets close, failing
        the leader's collective, a moment before its exit is seen), else `error`."""
        followers = {n: p for n, p in self.procs.items() if n.startswith(f"{node}.")}
        deadline = time.monotonic() + wait_s
        while followers and time.monotonic() < deadline:
            for name, proc in followers.items():
                if not proc.is_alive() and proc.exitcode != LOST_GROUP:
                    return TransportError(
                        f"server {name} died (exit code {proc.exitcode}), so {node} failed: {error}"
                    )
            self.control.heartbeat()
            time.sleep(0.05)
        return TransportError(error)

    # -- replaying
    def replay(self, progress: Callable[[int, int], None] | None = None) -> HwRun:
        arrivals = generate(self.exp.workload, self.exp.seed, Path(self.exp.base_dir))
        if not arrivals:
            raise ConfigError("the workload produced no requests")
        prompts = prompts_for(self.exp, [a.prompt_tokens for a in arrivals])
        self.t0 = t0 = time.time()
        for cfg in self.configs:
            self.control.send(cfg.name, Start(t0))
        pending = list(zip(arrivals, prompts, strict=True))
        last_arrival = arrivals[-1].arrival_s
        state = self.run_state
        for a in arrivals:  # every request has its row, whether the run reaches it or not
            state.requests[a.request_id] = Request(
                a.request_id,
                a.arrival_s,
                a.prompt_tokens,
                a.output_tokens,
                prefill_node=0,
                decode_node=0,
            )
        while len(state.finished) < len(arrivals):
            now = time.time() - t0
            while pending and pending[0][0].arrival_s <= now:
                a, prompt = pending.pop(0)
                self.submit(a.request_id, a.arrival_s, prompt, a.output_tokens)
            # wake for the next arrival on time (recv sleeps below a millisecond)
            self._receive(min(0.001, max(0.0, pending[0][0].arrival_s - now)) if pending else 0.05)
            self.control.heartbeat()  # servers stop when the driver falls silent
            self.inject(now)
            self.check_silent()
            if progress:
                progress(len(state.finished), len(arrivals))
            if now > last_arrival + self.hw.drain_timeout_s:
                left = sorted(set(state.requests) - set(state.finished))
                raise TransportError(
                    f"{len(arrivals) - len(state.finished)} requests unfinished "
                    f"{self.hw.drain_timeout_s:g} s after the last arrival (ids {left[:10]})"
                )
        return state

    def pick(self, role: str) -> int | None:
        """The node of `role` its router picks, given each node's outstanding requests,
        passing over dead nodes; None if all are dead."""
        nodes = self.exp.cluster.groups[role].nodes
        loads = {
            i: math.inf if f"{role}{i}" in self.lost else self.load[f"{role}{i}"]
            for i in range(nodes)
        }
        for _ in range(nodes):
            i = self.routers[role].pick(loads)
            if f"{role}{i}" not in self.lost:
                return i
        return None

    def submit(self, req_id: int, arrival_s: float, prompt: tuple[int, ...], out: int) -> None:
        """Send a request to the decode (or colocated) node the router picks; under parallel
        handoff to the prefill node it picks too, first (it starts computing at once), both
        told the other's index (the decoder's handoff goes to that prefill node)."""
        state, req = self.run_state, self.run_state.requests[req_id]
        node = self.pick(self.entry_role)
        prefill = self.pick("prefill") if self.parallel else -1
        if node is None or prefill is None:  # (the run stops when a role has none left)
            role = self.entry_role if node is None else "prefill"
            self.finish("driver", Finished(req_id, "failed", f"no {role} node is alive", (), {}))
            return
        targets: tuple[str, ...] = (f"prefill{prefill}",) if prefill >= 0 else ()
        targets += (f"{self.entry_role}{node}",)
        req.decode_node = node  # and its prefill node, until its decoder says
        req.prefill_node = node if self.entry_role == "colocated" else max(prefill, 0)
        self.routes[req_id] = targets
        for name in targets:
            self.load[name] += 1
        state.sent.append((req_id, "driver", "sent", time.time() - self.t0))  # before
        self.control.send(list(targets), Submit(req_id, arrival_s, prompt, out, prefill, node))

    def inject(self, now: float) -> None:
        """Inject the faults due by `now` (the run's clock)."""
        while self.faults and self.faults[0][0] <= now:
            _, name, action = self.faults.pop(0)
            if isinstance(action, Inject):
                self.control.send(name, action)
                continue
            proc = self.procs[name]
            if proc.is_alive() and proc.pid is not None:
                os.kill(proc.pid, action)
                if action == signal.SIGKILL:  # dead now: no request is routed to it after
                    proc.join(5.0)
                    self.check_children()

    def _receive(self, timeout_s: float) -> None:
        msg = self.control.recv(timeout_s)
        while msg is not None:
            sender, body = msg
            if isinstance(body, Finished):
                self.finish(sender, body)
            elif isinstance(body, Records):
                self.run_state.records[body.name] = body
                if body.error and sender not in self.lost:
                    self.lose(sender, str(self.blame(sender, body.error)))
            msg = self.control.recv(0.0)
        self.check_children()

    def finish(self, sender: str, fin: Finished) -> None:
        """A request's end, as its server reports it: kept once, for a request of this run;
        any other (a stranger's id, a second end) is dropped and counted, as the servers do."""
        state = self.run_state
        why = ""
        if fin.req_id not in state.requests:
            why = "not a request of this run"
        elif fin.req_id in state.finished:
            why = "it had ended already"
        if why:
            self.control.dropped += 1
            print(f"driver: dropped Finished {fin.req_id} from {sender}: {why}", file=sys.stderr)
            return
        state.finished[fin.req_id] = fin
        state.ended_s[fin.req_id] = time.time() - self.t0
        for name in self.routes.pop(fin.req_id, ()):
            self.load[name] -= 1

    def lose(self, node: str, why: str) -> None:
        """`node` died (or failed) with `why`: TransportError if the run has not started or
        its role has no other node alive; else the run goes on without it, as the
        simulator's does: its processes are stopped, the requests it decodes fail with the
        reason (`decode1 died (kill decode1 at 1 s)`), the router passes over it, and its peers
        learn of it by its silence (hw.dead_after_s) and retry elsewhere or fail theirs."""
        role = next(c.role for c in self.configs if c.name == node)
        alive = [c.name for c in self.configs if c.role == role and c.name not in self.lost]
        if math.isnan(self.t0) or alive == [node] or node in self.external:
            raise TransportError(why)
        kills = [f for f in self.exp.faults if isinstance(f, Kill) and f.node == node]
        fault = next((f for f in kills if f.at_s <= time.time() - self.t0), None)
        self.lost[node] = reason = f"{node} died ({fault.label() if fault else why})"
        print(f"driver: {reason}; the run goes on without it", file=sys.stderr)
        for name, proc in self.procs.items():  # its other ranks
            if (name == node or name.startswith(f"{node}.")) and proc.is_alive():
                proc.kill()
                proc.join(5.0)
        if role == self.entry_role:
            mine = [i for i, t in self.routes.items() if t[-1] == node]
            for req_id in mine:
                self.finish(node, Finished(req_id, "failed", reason, (), {}))

    def _last_words(self, name: str, wait_s: float = 1.0) -> None:
        """A server that exits right after saying why (it cannot start) may be seen dead before
        its message is read: wait a moment for its records (the run is failing anyway)."""
        deadline = time.monotonic() + wait_s
        while name not in self.run_state.records and time.monotonic() < deadline:
            self.control.heartbeat()  # the run may go on (lose): the servers must hear it
            msg = self.control.recv(0.1)
            if msg is not None and isinstance(msg[1], Records):
                self.run_state.records[msg[1].name] = msg[1]
            elif msg is not None and isinstance(msg[1], Finished):  # the run may go on (lose)
                self.finish(*msg)

    # -- stopping
    def stop(self) -> None:
        """Ask every server to stop, collect its records, and make sure no child is left."""
        dead = {n for n, p in self.procs.items() if not p.is_alive()}
        for name, proc in self.procs.items():  # a server stopped by a fault cannot answer
            if name not in dead and proc.pid is not None:
                os.kill(proc.pid, signal.SIGCONT)
        awaited = {c.name for c in self.configs if c.name in self.control.dealers}
        awaited -= self.stuck | dead | set(self.lost)
        for name in sorted(awaited):
            self.control.send(name, Shutdown())
        deadline = time.monotonic() + 20.0
        while time.monotonic() < deadline and not awaited <= set(self.run_state.records):
            msg = self.control.recv(0.2)
            if msg is not None and isinstance(msg[1], Records):
                self.run_state.records[msg[1].name] = msg[1]
        for name, proc in self.procs.items():
            if name not in self.stuck:  # a stuck one would not leave by itself
                proc.join(5.0)
                if proc.is_alive():
                    proc.terminate()
                    proc.join(5.0)
            if proc.is_alive():  # stuck, stopped, or deaf to SIGTERM
                proc.kill()
                proc.join(5.0)
        for tp_dir in self.tp_dirs:
            shutil.rmtree(tp_dir, ignore_errors=True)
        self.control.close()


def run_hw(
    exp: Experiment,
    out: Path,
    progress: Callable[[int, int], None] | None = None,
    external: tuple[str, ...] = (),
    return_logits: bool = False,
    slo: Slo | None = None,
) -> tuple[dict[str, Any], HwRun]:
    """Run the experiment on local devices (its `[hw]` settings); write the tables and the
    experiment as run to `out`; return the summary (with goodput under `slo` if given). A run
    that stops early (a server died or got stuck, requests were left) writes its tables too,
    each request with its final status (finished, failed with its reason, or unfinished: the
    run stopped), then raises."""
    start = time.perf_counter()
    driver = Driver(exp, external, return_logits)
    exp = driver.exp
    stopped: TransportError | None = None
    startup_s, driver_cores = math.nan, "not started"
    try:
        driver.start()
        startup_s = time.perf_counter() - start  # the servers' start: most of a short run
        with latency.driver_cores(exp.hw.latency, len(driver.procs), exp.hw.decode_device) as (
            driver_cores
        ):
            driver.replay(progress)
    except TransportError as e:
        stopped = e
        driver.run_state.stopped_s = time.time() - driver.t0
    finally:
        driver.stop()
    state = driver.run_state
    if stopped is not None and not state.requests:
        raise stopped  # it never started: nothing to write
    wall = time.perf_counter() - start
    req, steps, xfers = tables(state, f"the run stopped: {stopped}" if stopped else "")
    summary = summarize(req, steps, xfers, len(driver.configs), wall, slo)
    summary |= {"experiment": exp.name, "backend": "hw", "wire": exp.hw.wire}
    summary["startup_s"] = startup_s
    summary["node_settings"] = {name: r.settings for name, r in sorted(state.records.items())}
    summary["driver_cores"] = driver_cores
    counters = [
        *("passes_planned_ahead", "graphs_captured_on_demand", "passes_in_pieces"),
        *("messages_before_start", "messages_dropped", "peers_declared_dead", "faults_injected"),
    ]
    for key in counters:
        summary[key] = sum(r.counters.get(key, 0) for r in state.records.values())
    summary["messages_dropped"] += driver.control.dropped  # the driver's own refusals too
    summary["pages_in_use"] = {
        n: r.counters.get("pages_in_use", 0) for n, r in state.records.items()
    }
    summary["host_share_of_pass_time"] = host_share(steps)  # every node's passes together
    summary["host_share_by_node"] = {n: host_share(g) for n, g in steps.groupby("node")}
    hops = hops_table(state)
    split = {
        "queue_parts_ms": queue_parts(req, hops, exp.transfer.handoff == "parallel"),
        "handoff_parts_ms": handoff_parts(req, hops),
    }
    for key, parts in split.items():  # medians over the requests, of the parts this run has
        summary[key] = {k: 1e3 * float(v) for k, v in parts.median().dropna().items()}
    if stopped is not None:
        summary["stopped"] = str(stopped)
    if exp.faults:  # a request left unfinished ended with the kill that stopped the run
        kills = [f.at_s for f in exp.faults if f.kind == "kill" and f.at_s <= state.stopped_s]
        stop_s = max(kills, default=state.stopped_s)
        ended = [state.ended_s.get(i, stop_s) for i in req.request_id[req.status != "finished"]]
        summary["faults"] = attribute(exp.faults, ended)
    write_results(out, req, steps, xfers, summary)
    hops.to_parquet(out / "hops.parquet", index=False)
    (out / "experiment.json").write_text(exp.model_dump_json(indent=2) + "\n")
    write_trace(out)
    if stopped is not None:
        raise TransportError(f"{stopped} (the tables of what ran are in {out})")
    return summary, state


HOP_COLUMNS = ["request_id", "node", "event", "t_s"]


def hops_table(state: HwRun) -> pd.DataFrame:
    """Each request's control-plane stamps, in time order: the driver's `sent`, then each
    node's `received`, `handed_off` (decoder to prefill), `pages` (at a prefill node) and
    `landed` (its KV's last immediate at the decoder's wire, `Server.mark`).
    Sends are stamped just before they leave, so a send precedes its arrival. All processes
    of one host share the run's clock (time since the driver's start); across hosts the
    stamps are only as close as the hosts' clocks."""
    rows = list(state.sent)
    for records in state.records.values():
        rows.extend(tuple(h) for h in records.hops)
    hops = pd.DataFrame(rows, columns=HOP_COLUMNS)
    return hops.sort_values(["t_s", "request_id"], kind="stable").reset_index(drop=True)


def tables(state: HwRun, stopped: str = "") -> tuple[Any, Any, Any]:
    """The run's requests, steps and transfers tables (same columns as the simulator's). A
    request not finished when the run `stopped` (why, if it did) is unfinished, with that
    reason."""
    rec = Recorder()
    prefill_times: dict[int, tuple[float, float]] = {}
    for req_id, fin in state.finished.items():
        if fin.attempts > 0:  # handed off: to the prefill node its decoder says (a retry's)
            state.requests[req_id].prefill_node = fin.prefill_node
    for records in state.records.values():
        rec.steps.extend(tuple(s) for s in records.steps)
        for req_id, nbytes, ops, first_s, p_start, p_end in records.transfers:
            req = state.requests[req_id]
            rec.transfer(req, nbytes, ops, first_s if math.isfinite(first_s) else math.nan)
            prefill_times[req_id] = (p_start, p_end)
    for req_id, fin in state.finished.items():
        req = state.requests[req_id]
        req.status = Status(fin.status)
        req.fail_reason, req.attempts = fin.reason, fin.attempts
        for key, value in fin.times.items():
            if value is not None and not math.isnan(value):
                setattr(req, key, value)
        if req_id in prefill_times:
            req.prefill_start_s, req.prefill_end_s = prefill_times[req_id]
            rec.landed(req_id, req.ready_s)
    if stopped:
        for req_id in set(state.requests) - set(state.finished):
            state.requests[req_id].status = Status.UNFINISHED
            state.requests[req_id].fail_reason = stopped
    rec.steps.sort(key=lambda s: (s[2], s[0]))
    return requests_table(state.requests.values()), steps_table(rec), transfers_table(rec)
