"""The prefill server: chunks of prompts through the model, each layer's pages posted to the
decoder as the layer counter passes it, then the metadata (the hidden state MTP needs)."""

from __future__ import annotations

import collections
import math
import queue
from typing import Any

import numpy as np
import torch

from disagg.core import messenger as m
from disagg.core.request import Request
from disagg.core.roles import PrefillRole
from disagg.core.sharding import Segment, TransferPlan
from disagg.errors import DisaggError, ProtocolError
from disagg.hw.batch import Seq
from disagg.hw.control import Control
from disagg.hw.node import Server, dp_rank, transfer_plan
from disagg.hw.protocol import META_SLOTS, NodeConfig, Submit, pack_imm
from disagg.hw.ranks import region
from disagg.hw.runner import LayerWatcher
from disagg.hw.transport.base import Descriptor, Unit, Write, WriteArray, total_bytes

Pair = tuple[int, int]  # (source rank, destination rank)


class _PassDone:
    """The end of a pass on the CPU, which is over when the runner returns."""

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass


class PrefillServer(Server):
    """The port of a core PrefillRole: passes on the model, posts on the wire."""

    kind = "prefill"

    def __init__(self, cfg: NodeConfig, control: Control | None = None) -> None:
        super().__init__(cfg, control)
        exp = self.exp
        self.role = PrefillRole(
            cfg.index, self, self.pool, exp.cluster.prefill, exp.transfer, self.layers
        )
        # by (prefill DP group, decode DP group): the plan, and its segments of one page of
        # one layer by (source rank, destination rank)
        self.plans: dict[tuple[int, int], tuple[TransferPlan, dict[Pair, list[Segment]]]] = {}
        self.plan = self.pair_plan(0, 0)[0]  # groups 0 to 0: the only plan without DP
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
        prompt = msg.prompt if isinstance(msg, Submit | m.PrefillRequest) else ()
        why = self.bad_prompt(prompt) if prompt else ""
        if why:  # the decoder fails it (a bad Submit), or cancels it in time (a bad peer)
            raise ProtocolError(f"request {msg.req_id}: {why}")
        if isinstance(msg, Submit):  # parallel handoff: straight from the driver
            self.mark(msg.req_id, "received")
            if msg.req_id in self.role.requests:
                raise ProtocolError(f"request id {msg.req_id} is already in use here")
            self.role.submit(msg.req_id, len(msg.prompt), max(msg.decode_node, 0), msg.prompt)
            return
        if isinstance(msg, m.PrefillRequest):
            if msg.prompt:
                self.mark(msg.req_id, "received")
            self.mark(msg.req_id, "pages")
        self.role.on_message(msg)

    def on_dead(self, peer: str) -> None:
        super().on_dead(peer)
        if peer.startswith("decode"):
            self.role.on_peer_dead(int(peer[6:]), "no heartbeat")

    # -- the port (disagg.core.roles.PrefillPort)
    def request(self, req_id: int, prompt_tokens: int, prompt: tuple[int, ...]) -> Request:
        return Request(req_id, 0.0, prompt_tokens, 1, prompt=prompt)

    def post(self, cmd: m.PostWrites | m.PostMetadata) -> None:
        units = self.page_units(cmd) if isinstance(cmd, m.PostWrites) else [self.meta_unit(cmd)]
        self.post_units(cmd.req_id, f"decode{cmd.decode_node}", units)

    def prefilled(self, req: Request) -> None:
        row = self.transfer_row(req.id)
        row[4], row[5] = req.prefill_start_s, req.prefill_end_s

    def free_meta_rows(self) -> None:
        """Rows of requests whose posts are done (or never will be) are free again."""
        outbound = self.role.messenger.outbound
        for req_id in [r for r in self.rows if r not in outbound]:
            self.free_rows.append(self.rows.pop(req_id))

    def plan_of(self, req_id: int) -> tuple[TransferPlan, dict[Pair, list[Segment]]]:
        """The transfer plan of request `req_id` (from its group here to its group at the
        decode node), and its segments by rank pair."""
        return self.pair_plan(self.group(req_id), dp_rank(self.exp, "decode", req_id))

    def pair_plan(self, src_dp: int, dst_dp: int) -> tuple[TransferPlan, dict[Pair, list[Segment]]]:
        key = (src_dp, dst_dp)
        if key not in self.plans:
            plan = transfer_plan(self.exp, self.cache.layers[0].element_size(), *key)
            pairs: dict[Pair, list[Segment]] = {}
            for g in plan.segments:
                pairs.setdefault((g.src_rank, g.dst_rank), []).append(g)
            self.plans[key] = plan, pairs
        return self.plans[key]

    def page_units(self, cmd: m.PostWrites) -> list[Unit]:
        """Per layer, one unit per (source rank, destination rank) pair of the request's plan:
        every page's writes as arrays, then one immediate for the destination rank that counts
        the post's complete pages (pages cut by the chunk are written but not counted; the
        chunk that completes them writes them again and counts them)."""
        src = np.asarray(cmd.src_pages, dtype=np.int64)[:, None]
        dst = np.asarray(cmd.dst_pages, dtype=np.int64)[:, None]
        plan, pair_segments = self.plan_of(cmd.req_id)
        pairs = []
        for (s, d), segs in pair_segments.items():
            src_off = (src * plan.src_page_bytes + [g.src_offset for g in segs]).ravel()
            dst_off = (dst * plan.dst_page_bytes + [g.dst_offset for g in segs]).ravel()
            nbytes = np.tile([g.nbytes for g in segs], len(cmd.src_pages))
            imm = pack_imm(cmd.slot, cmd.imm_pages, d) if cmd.imm_pages else None
            pairs.append((s, d, src_off, dst_off, nbytes, imm))
        return [
            Unit(WriteArray(region(layer, s), region(layer, d), so, do, n), imm)
            for layer in cmd.layers
            for s, d, so, do, n, imm in pairs
        ]

    def meta_unit(self, cmd: m.PostMetadata) -> Unit:
        """This side's row of the request's hidden state -> the decoder's row of its slot (in
        the decode node's one metadata buffer, its leader's, which reads it); the immediate
        counts at the plan's decode group leader, as the planner says."""
        if cmd.slot >= META_SLOTS:
            raise DisaggError(f"metadata slot {cmd.slot} >= {META_SLOTS} rows")
        row = self.meta.shape[1] * 4
        src, dst = self.rows[cmd.req_id] * row, cmd.slot * row
        leader = self.plan_of(cmd.req_id)[0].dst_leader
        return Unit([Write("meta", src, "meta", dst, row)], pack_imm(cmd.slot, 1, leader))

    def meta_row(self, req_id: int) -> int:
        if not self.free_rows:
            raise DisaggError(f"{self.cfg.name}: all {META_SLOTS} metadata rows in use")
        self.rows[req_id] = self.free_rows.popleft()
        return self.rows[req_id]

    def post_units(self, req_id: int, peer: str, units: list[Unit]) -> None:
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
            self.role.on_posted(self.posts.pop(c.wr_id), c.ok, c.error)
        self.free_meta_rows()

    def tick(self) -> None:
        self.poll_wire()
        super().tick()

    def step(self) -> bool:
        start = self.now()
        batch = self.role.next_batch()
        if batch.empty:
            return False
        seqs = [
            Seq.of(
                c.req.prompt[c.start : c.start + c.tokens],
                c.start,
                self.pool.pages_of(c.req.id),
                dp_rank=self.group(c.req.id),
            )
            for c in batch.chunks
        ]
        out = self.runner.step(seqs)
        for i, c in enumerate(batch.chunks):
            if c.last:  # hidden state of the token before the last prompt token (stream order)
                self.meta[self.meta_row(c.req.id)] = out.hidden[i].float()
        end: torch.cuda.Event | _PassDone | None = None
        if self.hw.latency.meta_in_stream:
            end = torch.cuda.Event() if self.model.device.type == "cuda" else _PassDone()
            end.record()  # after the metadata rows: the end of the pass
        self.follow_layers(out.layers_before)
        if end is None:
            self.sync()
        self.after = end  # with an end event, the pass's last posts wait for it on the wire
        try:
            prefilled = self.role.pass_done(batch).prefilled
        finally:
            self.after = None
        if end is not None:  # the pass ends on the device after the posts were issued
            end.synchronize()  # the pass, not the copies just posted (a device sync would wait)
            end_s = self.now()
            for r in prefilled:
                self.transfer_row(r.id)[5] = end_s
        self.free_meta_rows()
        self.record("prefill", start, batch, out)
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
                self.role.on_layers(done)

    def run(self) -> None:
        try:
            super().run()
        finally:
            self.watcher.stop()
