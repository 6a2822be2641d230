"""The KV messenger's control-plane messages: what crosses node boundaries, as plain data.

A decode node's PrefillRequest hands a request off to a prefill node; the prefill node answers
PrefillRejected or, once it stopped writing, TransferAborted; a decoder's CancelTransfer stops a
transfer. The hw backend's control plane sends these as they are (disagg.hw.control checks a
received one against its fields' annotations); the simulator delivers them after a latency.
They are values: nothing changes one once it is made (not frozen: a frozen __init__ costs
several times as much, and a PrefillRequest is made per request). A module of their own, and not
compiled by tools/compile_sim.py: a compiled dataclass keeps no annotations to check.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(slots=True)
class PrefillRequest:
    req_id: int
    slot: int  # the immediate value of every write for this request
    decode_node: int
    prompt_tokens: int
    dst_pages: tuple[int, ...]
    dst_rank: int = 0  # decode DP rank holding the pages (0 under TP)
    prompt: tuple[int, ...] = ()  # the prompt's token ids (a simulator sends none)
    routed: bool = False  # the router sent the request to the prefill node too (parallel)
    attempt: int = 1  # the decoder's handoff number for this request (a retry is a new one)


@dataclass
class PrefillRejected:
    req_id: int
    reason: str


@dataclass
class CancelTransfer:
    """Decode node `decode_node` asks prefill to stop a request's transfer. `reply`: the
    decoder holds pages for it and waits for TransferAborted; not when it failed the request
    before any handoff. A prefill node answers even a request it does not know (it finished,
    or the prefill declared the decoder dead and forgot it): the decoder's pages wait for it."""

    req_id: int
    reason: str
    reply: bool = True
    decode_node: int = -1


@dataclass
class TransferAborted:
    """Prefill stopped writing for a request: decode may reuse its pages."""

    req_id: int
    reason: str


Message = PrefillRequest | PrefillRejected | CancelTransfer | TransferAborted
