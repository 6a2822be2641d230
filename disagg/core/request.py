"""A request's lifecycle: its shape, where it runs, how far it got, and when things happened."""

from __future__ import annotations

import math
from dataclasses import dataclass
from enum import StrEnum

NAN = math.nan


class Status(StrEnum):
    QUEUED = "queued"  # arrived, waiting for pages (or for a node)
    RESERVED = "reserved"  # decode holds pages; prefill not finished yet
    PREFILLING = "prefilling"
    READY = "ready"  # every planned write landed; waiting for a decode slot
    DECODING = "decoding"
    FINISHED = "finished"
    FAILED = "failed"
    UNFINISHED = "unfinished"  # the run stopped before the request ended (its reason says why)


@dataclass(eq=False, slots=True)
class Request:
    """One request. Token counts are integers except `generated`, which may grow by a
    fractional number of accepted tokens per step under speculative decoding / MTP."""

    id: int
    arrival_s: float
    prompt_tokens: int
    output_tokens: int
    status: Status = Status.QUEUED
    prefill_node: int = -1
    decode_node: int = -1
    prefilled: int = 0  # prompt tokens whose KV has been computed
    generated: float = 0.0
    attempts: int = 0
    fail_reason: str = ""
    prompt: tuple[int, ...] = ()  # token ids, when a real model runs the request
    # timestamps, seconds since the start of the run
    prefill_start_s: float = NAN
    prefill_end_s: float = NAN
    ready_s: float = NAN
    first_token_s: float = NAN
    finish_s: float = NAN

    def __post_init__(self) -> None:
        if self.prompt_tokens < 1 or self.output_tokens < 1:
            raise ValueError(
                f"request {self.id}: prompt_tokens={self.prompt_tokens} and "
                f"output_tokens={self.output_tokens} must both be >= 1"
            )

    @property
    def context(self) -> int:
        """Tokens whose KV is cached: the prompt computed so far plus emitted tokens."""
        return self.prefilled + int(self.generated)

    @property
    def remaining_output(self) -> float:
        return self.output_tokens - self.generated

    @property
    def done(self) -> bool:
        return self.generated >= self.output_tokens

    @property
    def ttft_s(self) -> float:
        return self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float:
        """Mean time per output token after the first (NaN for one-token outputs)."""
        if self.output_tokens < 2:
            return NAN
        return (self.finish_s - self.first_token_s) / (self.output_tokens - 1)

    def fail(self, reason: str) -> None:
        self.status = Status.FAILED
        self.fail_reason = reason
