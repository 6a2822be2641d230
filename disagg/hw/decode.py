"""The servers that emit tokens: the decode server (KV from a prefill server, counted in by the
wire's immediates) and the colocated server (prefill and decode in one process)."""

from __future__ import annotations

import math
from typing import Any

import numpy as np
import torch

from disagg.core import messenger as m
from disagg.core.request import Request, Status
from disagg.core.scheduler import ColocatedScheduler, DecodeScheduler
from disagg.hw import knobs
from disagg.hw.batch import Seq
from disagg.hw.control import Control
from disagg.hw.node import Server, single_gpu_plan
from disagg.hw.protocol import Finished, NodeConfig, NodeUp, Submit, unpack_imm


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
        self.plan = single_gpu_plan(self.exp, self.cache.layers[0].element_size())
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
        if self.messenger.inbound and self.wake_fd is None and not knobs.SPIN:
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
        if knobs.PLAN_AHEAD and req.status is Status.RESERVED and alone:
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
