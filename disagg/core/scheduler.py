"""Batch policies: what the next forward pass of a node runs.

Three policies share one shape: `add` requests, `schedule()` a Batch, run it (sim or hw), then
`complete(batch, steps)` to advance progress. They keep no clock.

- ColocatedScheduler: continuous batching with chunked prefill under a token budget; running
  decodes first, then prefill chunks fill what is left of the budget (Sarathi-style).
  PrefillFirstScheduler and DecodePriorityScheduler are its variants that production systems
  ship besides: whole prompts in passes of their own, or decodes first with short chunks.
- PrefillScheduler: prefill only, chunked, FIFO; pages come from the messenger.
- DecodeScheduler: decode only; admits only requests whose KV has fully arrived.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from disagg.core.kvcache import PagePool
from disagg.core.request import Request, Status
from disagg.errors import ConfigError


@dataclass(slots=True)  # a value, not frozen only because a frozen __init__ costs more
class Chunk:
    """`tokens` prompt tokens of `req`, starting at prompt position `start`."""

    req: Request
    start: int
    tokens: int
    last: bool  # this chunk completes the request's prefill


def chunk_attn_pairs(start: int, tokens: int) -> float:
    """(query, key) pairs of a causal chunk of `tokens` tokens after `start` cached tokens."""
    return tokens * start + tokens * (tokens + 1) / 2


@dataclass(slots=True)
class Batch:
    chunks: list[Chunk] = field(default_factory=list)
    decodes: list[Request] = field(default_factory=list)

    @property
    def prefill_tokens(self) -> int:
        chunks = self.chunks
        return sum(c.tokens for c in chunks) if chunks else 0  # most batches have none

    @property
    def prefill_attn_pairs(self) -> float:
        """The (query, key) pairs of its chunks' attention, all together."""
        return float(sum(chunk_attn_pairs(c.start, c.tokens) for c in self.chunks))

    @property
    def decode_context(self) -> float:
        """The tokens its decodes hold, all together: each one's prompt and output so far."""
        return float(sum(r.prompt_tokens + int(r.generated) for r in self.decodes))

    @property
    def empty(self) -> bool:
        return not self.chunks and not self.decodes

    @property
    def decode_only(self) -> bool:
        return not self.chunks and bool(self.decodes)


@dataclass(slots=True)  # not frozen: one is made per pass, and a frozen __init__ costs more
class Progress:
    """What a completed batch changed: who emitted a first token, who finished."""

    prefilled: list[Request] = field(default_factory=list)  # prefill complete this batch
    first_token: list[Request] = field(default_factory=list)
    finished: list[Request] = field(default_factory=list)


def _check_positive(name: str, value: float) -> None:
    if value <= 0:
        raise ConfigError(f"{name} must be > 0, got {value}")


def advance_decodes(decodes: list[Request], steps: int, tokens_per_step: float) -> Progress:
    """Advance decoding requests by `steps` steps of `tokens_per_step` accepted tokens each."""
    first, finished = [], []
    tokens = steps * tokens_per_step
    for r in decodes:
        generated = r.generated
        if generated == 0:
            first.append(r)
        generated += tokens
        if generated < r.output_tokens:
            r.generated = generated
        else:  # done: generated is min(output_tokens, generated)
            r.generated = float(r.output_tokens)
            r.status = Status.FINISHED
            finished.append(r)
    return Progress([], first, finished)


def steps_to_finish(req: Request, tokens_per_step: float) -> int:
    """Decode steps until `req` has emitted all its output tokens."""
    return max(1, -int(-req.remaining_output // tokens_per_step))


def continuing(decodes: list[Request], tokens_per_step: float) -> Batch | None:
    """The decode pass after one of `decodes`: those it does not finish (None: none)."""
    left = [r for r in decodes if steps_to_finish(r, tokens_per_step) > 1]
    return Batch(decodes=left) if left else None


class PrefillScheduler:
    """Chunked prefill, FIFO. Each request prefills `target` tokens (set on `add`)."""

    def __init__(self, token_budget: int, max_seqs: int = 256) -> None:
        _check_positive("prefill token_budget", token_budget)
        self.token_budget = token_budget
        self.max_seqs = max_seqs
        self.queue: deque[tuple[Request, int]] = deque()

    def add(self, req: Request, target: int) -> None:
        """Queue `req` to prefill its first `target` prompt tokens (from the start: a request
        queued again after an eviction or a retry is computed anew)."""
        req.status, req.prefilled = Status.PREFILLING, 0
        self.queue.append((req, target))

    def remove(self, req_id: int) -> bool:
        """Drop a request (cancelled transfer); True if it was queued."""
        before = len(self.queue)
        self.queue = deque((r, t) for r, t in self.queue if r.id != req_id)
        return len(self.queue) < before

    def __len__(self) -> int:
        return len(self.queue)

    def schedule(self, budget: int | None = None) -> Batch:
        """Chunks for the next pass, within `budget` tokens (default: the token budget)."""
        batch = Batch()
        budget = self.token_budget if budget is None else budget
        for req, target in self.queue:
            if budget <= 0 or len(batch.chunks) >= self.max_seqs:
                break
            n = min(target - req.prefilled, budget)
            batch.chunks.append(Chunk(req, req.prefilled, n, req.prefilled + n == target))
            budget -= n
        return batch

    def complete(self, batch: Batch) -> Progress:
        done = []
        for c in batch.chunks:
            c.req.prefilled = c.start + c.tokens
            if c.last:
                done.append(c.req)
        if done:  # most passes of a long prompt finish nobody: keep the queue as it is
            ids = {r.id for r in done}
            self.queue = deque((r, t) for r, t in self.queue if r.id not in ids)
        return Progress(done, [], [])


class DecodeScheduler:
    """Decode only: up to `max_batch` running requests, admitted from the ready queue."""

    def __init__(self, max_batch: int, tokens_per_step: float = 1.0) -> None:
        _check_positive("decode max_batch", max_batch)
        if tokens_per_step < 1:
            raise ConfigError(f"accepted tokens per step must be >= 1, got {tokens_per_step}")
        self.max_batch = max_batch
        self.tokens_per_step = tokens_per_step
        self.ready: deque[Request] = deque()
        self.running: list[Request] = []

    def add_ready(self, req: Request) -> None:
        req.status = Status.READY
        self.ready.append(req)

    def __len__(self) -> int:
        return len(self.ready) + len(self.running)

    def schedule(self) -> Batch:
        while self.ready and len(self.running) < self.max_batch:
            req = self.ready.popleft()
            req.status = Status.DECODING
            self.running.append(req)
        return Batch([], list(self.running))

    def continuation(self, batch: Batch) -> Batch | None:
        """The next pass if no request becomes ready before it: `batch`'s decodes that it does
        not finish, in order; None if requests wait to join, or none would be left."""
        if self.ready or batch.chunks:
            return None
        return continuing(batch.decodes, self.tokens_per_step)

    def complete(self, batch: Batch, steps: int = 1) -> Progress:
        progress = advance_decodes(batch.decodes, steps, self.tokens_per_step)
        for r in progress.finished:  # each is in `running` once (compared by identity)
            self.running.remove(r)
        return progress


class ColocatedScheduler:
    """Continuous batching with chunked prefill on one engine.

    A request is admitted when the pool can reserve pages for its whole prompt and output (so
    nothing is ever preempted); a request that could never fit is rejected with a reason.
    """

    def __init__(
        self,
        pool: PagePool,
        token_budget: int,
        max_batch: int,
        tokens_per_step: float = 1.0,
        decode_qo: int = 1,
    ) -> None:
        _check_positive("colocated token_budget", token_budget)
        self.pool = pool
        self.prefill = PrefillScheduler(token_budget, max_batch)
        self.decode = DecodeScheduler(max_batch, tokens_per_step)
        self.decode_qo = decode_qo  # tokens per decoding sequence in a step (1 + draft tokens)
        self.waiting: deque[Request] = deque()
        self.rejected: list[Request] = []

    def add(self, req: Request) -> None:
        if not self.pool.fits_ever(req.prompt_tokens + req.output_tokens):
            need = self.pool.pages_for(req.prompt_tokens + req.output_tokens)
            req.fail(f"needs {need} KV pages; the pool holds {self.pool.num_pages}")
            self.rejected.append(req)
            return
        self.waiting.append(req)

    def __len__(self) -> int:
        return len(self.waiting) + len(self.prefill) + len(self.decode)

    def _admit(self) -> None:
        while self.waiting and len(self.prefill) + len(self.decode) < self.decode.max_batch:
            req = self.waiting[0]
            if not self.pool.can_allocate(req.prompt_tokens + req.output_tokens):
                return
            self.waiting.popleft()
            self.pool.reserve(req.id, req.prompt_tokens + req.output_tokens)
            self.prefill.add(req, req.prompt_tokens)

    def schedule(self) -> Batch:
        self._admit()
        decodes = self.decode.schedule().decodes
        return Batch(
            chunks=self.prefill.schedule(self.chunk_budget(decodes)).chunks, decodes=decodes
        )

    def chunk_budget(self, decodes: list[Request]) -> int:
        """Prompt tokens a pass carrying `decodes` may add: what the token budget leaves."""
        return self.prefill.token_budget - len(decodes) * self.decode_qo

    def continuation(self, batch: Batch) -> Batch | None:
        """The next pass if no request comes before it: `batch`'s decodes that it does not
        finish, in order; None if `batch` computes a prompt, prompts wait or are being
        computed, or no decode would be left."""
        if self.waiting or self.prefill.queue or batch.chunks:
            return None
        return continuing(batch.decodes, self.decode.tokens_per_step)

    def complete(self, batch: Batch, steps: int = 1) -> Progress:
        """Advance a batch; a last chunk emits the request's first token (colocated samples)."""
        dec = self.decode.complete(Batch(decodes=batch.decodes), steps)
        pre = self.prefill.complete(Batch(chunks=batch.chunks))
        for req in pre.prefilled:
            req.generated = 1.0
            if req.done:
                req.status = Status.FINISHED
            else:
                req.status = Status.DECODING
                self.decode.running.append(req)
        finished = dec.finished + [r for r in pre.prefilled if r.done]
        for req in finished:
            self.pool.free(req.id)
        return Progress(pre.prefilled, dec.first_token + pre.prefilled, finished)


class PrefillFirstScheduler(ColocatedScheduler):
    """Prefill first, as vLLM's original scheduler and SGLang without mixed chunks: a pass with
    prompts to compute runs only them, whole, in arrival order while they fit the token budget
    (the first always, however long); the running decodes wait for a pass without prompts."""

    def schedule(self) -> Batch:
        self._admit()
        if not self.prefill.queue:
            return Batch(decodes=self.decode.schedule().decodes)
        budget = 0
        for i, (req, target) in enumerate(self.prefill.queue):
            need = target - req.prefilled
            if i and budget + need > self.prefill.token_budget:
                break
            budget += need
        return Batch(chunks=self.prefill.schedule(budget).chunks)


class DecodePriorityScheduler(ColocatedScheduler):
    """Decode priority: the running decodes in every pass, and while any runs, prompt chunks of
    at most `chunk_with_decodes` tokens a pass (a short pass keeps inter-token latency low, at
    the cost of TTFT); the whole token budget goes to prompts only when nothing decodes."""

    def __init__(
        self,
        pool: PagePool,
        token_budget: int,
        max_batch: int,
        tokens_per_step: float = 1.0,
        decode_qo: int = 1,
        *,
        chunk_with_decodes: int,
    ) -> None:
        super().__init__(pool, token_budget, max_batch, tokens_per_step, decode_qo)
        _check_positive("decode_priority chunk_with_decodes", chunk_with_decodes)
        self.chunk_with_decodes = chunk_with_decodes

    def chunk_budget(self, decodes: list[Request]) -> int:
        budget = super().chunk_budget(decodes)
        return min(budget, self.chunk_with_decodes) if decodes else budget
