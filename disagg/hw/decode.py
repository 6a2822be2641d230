"""The servers that emit tokens, ports of the core's decode and colocated roles: the decode
server (KV from a prefill server, counted in by the wire's immediates) and the colocated server
(prefill and decode in one process)."""

from __future__ import annotations

import math
import time
from typing import Any

import numpy as np
import torch

from disagg.core import messenger as m
from disagg.core.policies import make_router
from disagg.core.request import Request, Status
from disagg.core.roles import ColocatedRole, DecodeRole
from disagg.core.scheduler import Batch, steps_to_finish
from disagg.core.sharding import TransferPlan
from disagg.errors import ProtocolError
from disagg.hw.batch import Seq
from disagg.hw.control import Control
from disagg.hw.node import Server, dp_rank, transfer_plan
from disagg.hw.protocol import Finished, NodeConfig, NodeUp, Submit, unpack_imm
from disagg.hw.runner import StepOutput


class GeneratingServer(Server):
    """A server that emits tokens (decode or colocated) and reports finished requests: the
    port's `finished` sends them to the driver, with the logits of the pass that finished them.
    Its passes run in `step`, each subclass building its rows and keeping its tokens."""

    role: DecodeRole | ColocatedRole

    def __init__(self, cfg: NodeConfig, control: Control | None = None) -> None:
        super().__init__(cfg, control)
        self.outputs: dict[int, list[int]] = {}
        self.meta_sums: dict[int, float | torch.Tensor] = {}  # device sums: read at finish
        self.first_logits: dict[int, torch.Tensor] = {}
        # the running pass's rows and logits, for the requests it finishes
        self.pass_rows: list[Request] = []
        self.pass_logits: torch.Tensor | None = None
        # hw.latency.chain: the pass launched behind the one being read (its batch, rows and
        # output), and when the one before it was read (where its steps row begins)
        self.chained: tuple[Batch, list[Seq], StepOutput] | None = None
        self.read_s = math.nan

    def capture(self, max_batch: int) -> None:
        """Capture the decode graphs of up to `max_batch` rows; then, where the server warms up
        (`warm_up_s`) and chains its passes, warm the chained path on them too (`warm_chain`)."""
        self.runner.capture_up_to(max_batch)
        if self.warm_up_s is not None and self.hw.latency.chain:
            began = time.perf_counter()
            self.runner.warm_chain()
            self.warm_up_s += time.perf_counter() - began

    def finished(self, req: Request) -> None:
        row = next((i for i, r in enumerate(self.pass_rows) if r is req), None)
        logits = None if row is None or self.pass_logits is None else self.pass_logits[row]
        msg = _finished(
            req,
            self.outputs.pop(req.id, []),
            logits,
            self.first_logits.pop(req.id, None),
            self.cfg.return_logits,
            float(self.meta_sums.pop(req.id, math.nan)),
        )
        self.control.send("driver", msg)

    def accept(self, msg: Submit, known: bool) -> Request | None:
        """The request `msg` submits, or None if it failed at once (reported to the driver).
        A request id already known here is a ProtocolError (the message is dropped)."""
        if known or msg.req_id in self.outputs:
            raise ProtocolError(f"request id {msg.req_id} is already in use here")
        req = msg.request()
        self.outputs[req.id] = []
        why = self.bad_prompt(msg.prompt, msg.output_tokens)
        if why:
            req.fail(why)
            self.finished(req)
            return None
        return req

    def decode_seq(self, r: Request) -> Seq:
        """`r`'s next decode pass: its last token (the prompt's, first) at its last position."""
        out = self.outputs[r.id]
        last = out[-1] if out else r.prompt[-1]
        start = r.prompt_tokens - 1 + len(out)
        return Seq.decode(last, start, self.pool.pages_of(r.id), self.group(r.id))

    def next_rows(self, decodes: list[Request], seqs: list[Seq]) -> list[Seq]:
        """With hw.latency.overlap, the pass after the one of `decodes` (their rows `seqs`) if
        nothing joins it: each row this pass does not finish, one position on (its token is not
        sampled yet: 0 in the plan, written when the plan is used); none without overlap."""
        if not self.hw.latency.overlap:
            return []
        return [
            Seq.decode(0, s.start + 1, s.pages, s.dp_rank)
            for r, s in zip(decodes, seqs, strict=True)
            if steps_to_finish(r, 1) > 1
        ]

    def pass_ran(self, rows: list[Request], logits: torch.Tensor) -> None:
        """Keep the pass's rows and logits for `finished` (until the next pass)."""
        self.pass_rows, self.pass_logits = rows, logits

    def step(self) -> bool:
        """Run one forward pass if there is work (read one chained behind the last); True if
        one ran."""
        got = self.next_pass()
        if got is None:
            return False
        batch, seqs, res, start, chained = got
        self.chain(batch, seqs, res)
        tokens = res.read()
        self.read_s = self.now()
        self.took(batch, tokens, res)
        kind = "mixed" if batch.chunks else "decode"
        end = self.read_s if self.chained is not None else None  # rows do not overlap
        self.record(kind, start, batch, res, chained, end)
        self.pass_ran([c.req for c in batch.chunks] + batch.decodes, res.logits)
        self.role.pass_done(batch)
        return True

    def rows(self, batch: Batch) -> list[Seq]:
        """The rows of the pass of `batch`: its chunks', then its decodes' (`decode_seq`)."""
        raise NotImplementedError

    def then_rows(self, batch: Batch, seqs: list[Seq]) -> list[Seq]:
        """The pass to plan while the one of `batch` runs (`next_rows`), or none."""
        return self.next_rows(batch.decodes, seqs[len(batch.chunks) :])

    def took(self, batch: Batch, tokens: list[int], res: StepOutput) -> None:
        """Keep what the pass of `batch` sampled (`tokens`, one a row) and returns."""
        raise NotImplementedError

    def next_pass(self) -> tuple[Batch, list[Seq], StepOutput, float, bool] | None:
        """The pass to read now: the one chained behind the last (`chain`), or the role's
        next batch, launched here (None: nothing to run). With its rows, its output, when its
        steps row begins and whether it was chained."""
        if self.chained is not None:
            batch, seqs, res = self.chained
            return batch, seqs, res, self.read_s, True
        batch = self.role.next_batch()
        if batch.empty:
            return None
        start = self.now()
        seqs = self.rows(batch)
        chain = self.hw.latency.chain
        then = [] if chain else self.then_rows(batch, seqs)
        res = self.runner.step(seqs, sample=True, then=then, read=not chain)
        return batch, seqs, res, start, False

    def chain(self, batch: Batch, seqs: list[Seq], res: StepOutput) -> None:
        """With hw.latency.chain, launch the pass after the one of `batch` (launched, its rows
        `seqs` and output `res`) now, before its tokens are read, where the role knows it
        (`continuation`: nothing waits to join) and the runner can (`Runner.chains`): the
        continuing rows one position on, their tokens this pass's samples, on the device."""
        self.chained = None
        nxt = self.role.continuation(batch) if self.hw.latency.chain else None
        if nxt is None:
            return
        row = {id(r): len(batch.chunks) + i for i, r in enumerate(batch.decodes)}
        rows = [row[id(r)] for r in nxt.decodes]
        after = [Seq.decode(0, seqs[i].start + 1, seqs[i].pages, seqs[i].dp_rank) for i in rows]
        if self.runner.chains(after):
            out = self.runner.step(after, sample=True, feed=(res, rows), read=False)
            self.chained = nxt, after, out


# ---- decode ------------------------------------------------------------------------------
class DecodeServer(GeneratingServer):
    """The port of a core DecodeRole: immediates from the wire, passes on the model."""

    kind = "decode"
    role: DecodeRole

    def __init__(self, cfg: NodeConfig, control: Control | None = None) -> None:
        super().__init__(cfg, control)
        exp, group = self.exp, self.exp.cluster.decode
        # by (prefill DP group, decode DP group); (0, 0) the only one without DP attention
        self.plans: dict[tuple[int, int], TransferPlan] = {}
        self.plan = self.pair_plan(0, 0)  # groups 0 to 0: the only plan without DP
        # the hw model drafts no tokens: one per step
        self.role = DecodeRole(cfg.index, self, self.pool, group, exp.transfer, self.expected)
        self.capture(group.max_batch)
        self.slots: dict[int, int] = {}
        self.timer_s = math.inf
        self.landed_s = math.nan  # the immediate being handed to the role arrived then
        self.prefill_nodes = exp.cluster.prefill.nodes
        self.prefill_router = make_router(exp.cluster.router, range(self.prefill_nodes))

    def announce(self) -> None:
        super().announce()
        assert self.wire is not None
        self.wake_fd = self.wire.wake_fd()

    def idle_wait_s(self) -> float:
        if self.role.messenger.inbound and self.wake_fd is None and not self.hw.latency.spin:
            return 200e-6  # KV on its way over a wire without a wake-up fd: poll it often
        return super().idle_wait_s()

    def plan_of(self, req_id: int) -> TransferPlan:
        """The transfer plan of request `req_id`: from its group at the prefill node to its
        group here."""
        return self.pair_plan(dp_rank(self.exp, "prefill", req_id), self.group(req_id))

    def pair_plan(self, src_dp: int, dst_dp: int) -> TransferPlan:
        key = (src_dp, dst_dp)
        if key not in self.plans:
            self.plans[key] = transfer_plan(self.exp, self.cache.layers[0].element_size(), *key)
        return self.plans[key]

    def expected(self, req: Request, prefill_node: int, pages: int) -> dict[int, int]:
        """Immediates each rank of the request's group counts (its leader's: + the metadata)."""
        return self.plan_of(req.id).expected_immediates(pages, self.layers, metadata=True)

    def on_message(self, msg: Any) -> None:
        if isinstance(msg, Submit):
            self.mark(msg.req_id, "received")
            req = self.accept(msg, msg.req_id in self.role.requests)
            if req is not None:
                routed = msg.prefill_node >= 0  # parallel handoff: the driver's router chose
                self.role.submit(req, msg.prefill_node if routed else self.route(req))
                self.plan_first_pass(req)  # after the handoff has left
        else:
            self.role.on_message(msg)

    def on_dead(self, peer: str) -> None:
        super().on_dead(peer)
        if peer.startswith("prefill"):
            self.role.on_peer_dead(int(peer[7:]), "no heartbeat")

    # -- the port (disagg.core.roles.DecodePort)
    def send(self, role: str, node: int, msg: Any) -> None:
        if isinstance(msg, m.PrefillRequest):
            self.slots[msg.req_id] = msg.slot
            self.mark(msg.req_id, "handed_off")  # before it leaves: causal order
        super().send(role, node, msg)

    def set_timer(self, at_s: float) -> None:
        self.timer_s = at_s

    def route(self, req: Request) -> int:
        """The prefill node the experiment's router picks for `req`, given each prefill
        node's load as this node sees it (its requests queued for or inbound from there),
        passing over the nodes it holds dead; node 0 if all are (the handoff times out, as in
        the simulator)."""
        loads = dict.fromkeys(range(self.prefill_nodes), 0.0)
        messenger = self.role.messenger
        queued = [p for _, p in messenger.waiting] + [
            i.prefill_node for i in messenger.inbound.values()
        ]
        for node in queued:
            loads[node] = loads.get(node, 0.0) + 1
        dead = {int(p[7:]) for p in self.dead if p.startswith("prefill")}
        for node in dead:
            loads[node] = math.inf
        for _ in range(self.prefill_nodes):
            node = self.prefill_router.pick(loads)
            if node not in dead:
                return node
        return 0

    def ready(self, req: Request) -> None:
        if not math.isnan(self.landed_s):  # made ready by the immediate `tick` hands on
            self.mark(req.id, "landed", self.landed_s)
        if req.id in self.slots:  # summed on the device, no sync: the first pass should not
            self.meta_sums[req.id] = self.meta[self.slots.pop(req.id)].sum()  # wait for it

    def tick(self) -> None:
        assert self.wire is not None
        polled = self.wire.poll()
        for imm, at_s in zip(polled.immediates, polled.arrived_s, strict=True):
            self.landed_s = at_s - self.t0  # when it reached the wire, on the run's clock
            self.role.on_immediates(*unpack_imm(imm))
        self.landed_s = math.nan
        if self.now() >= self.timer_s:
            self.timer_s = math.inf
            self.role.on_timer()
        super().tick()

    def plan_first_pass(self, req: Request) -> bool:
        """Plan `req`'s first pass now (Runner.plan_ahead) if it will be the next step: its KV
        is inbound and nothing else runs, is ready or is inbound. True if planned."""
        alone = not len(self.role.scheduler) and len(self.role.messenger.inbound) == 1
        if self.hw.latency.plan_ahead and req.status is Status.RESERVED and alone:
            return self.runner.plan_ahead([self.decode_seq(req)])
        return False

    def rows(self, batch: Batch) -> list[Seq]:
        return [self.decode_seq(r) for r in batch.decodes]

    def took(self, batch: Batch, tokens: list[int], res: StepOutput) -> None:
        for i, (r, tok) in enumerate(zip(batch.decodes, tokens, strict=True)):
            self.outputs[r.id].append(tok)
            if r.generated == 0:
                self.first_logits[r.id] = res.logits[i]


# ---- colocated ---------------------------------------------------------------------------
class ColocatedServer(GeneratingServer):
    """The port of a core ColocatedRole: chunks and decodes in the same passes."""

    kind = "colocated"
    role: ColocatedRole

    def __init__(self, cfg: NodeConfig, control: Control | None = None) -> None:
        super().__init__(cfg, control)
        g = self.exp.cluster.colocated
        self.role = ColocatedRole(cfg.index, self, self.pool, g)  # one token per step
        self.capture(g.max_batch)

    def announce(self) -> None:  # no wire: nothing crosses a network
        self.control.send("driver", NodeUp(self.cfg.name, self.control.endpoint, {}, ()))

    def on_message(self, msg: Any) -> None:
        if isinstance(msg, Submit):
            self.mark(msg.req_id, "received")
            req = self.accept(msg, False)
            if req is not None:
                self.role.submit(req)

    def rows(self, batch: Batch) -> list[Seq]:
        chunks = [
            Seq.of(
                c.req.prompt[c.start : c.start + c.tokens],
                c.start,
                self.pool.pages_of(c.req.id),
                hidden_at=-2 if c.tokens > 1 else None,
                dp_rank=self.group(c.req.id),
            )
            for c in batch.chunks
        ]
        return [*chunks, *(self.decode_seq(r) for r in batch.decodes)]

    def then_rows(self, batch: Batch, seqs: list[Seq]) -> list[Seq]:
        alone = not batch.chunks and not len(self.role.scheduler.waiting)  # no prompt to come
        return super().then_rows(batch, seqs) if alone else []

    def took(self, batch: Batch, tokens: list[int], res: StepOutput) -> None:
        for i, c in enumerate(batch.chunks):
            if c.last:
                self.outputs[c.req.id].append(tokens[i])
                self.first_logits[c.req.id] = res.logits[i]
                if c.tokens > 1:
                    self.meta_sums[c.req.id] = float(res.hidden[i].float().sum())
        for r, tok in zip(batch.decodes, tokens[len(batch.chunks) :], strict=True):
            self.outputs[r.id].append(tok)


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
        req.attempts,
    )
