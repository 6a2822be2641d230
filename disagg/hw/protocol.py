"""The node protocol: the messages between the driver and the servers, and the immediates
that count a request's writes.

    driver -> Submit -> decode (and, under parallel handoff, prefill)
    servers -> NodeUp -> driver -> Peers -> servers -> Started; driver -> Start (the clock)
    decode or colocated -> Finished -> driver; driver -> Shutdown; servers -> Records
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from disagg.core.request import Request
from disagg.errors import DisaggError
from disagg.hw.control import register

META_SLOTS = 4096  # rows of the decode side's metadata buffer (one per in-flight request)
SLOT_BITS = 16  # an immediate is (count << 16) | (rank << 12) | slot
RANK_SHIFT = 12  # slots are below META_SLOTS = 1 << 12: the field's top 4 bits name the rank
MAX_RANKS = 1 << (SLOT_BITS - RANK_SHIFT)


def pack_imm(slot: int, count: int, rank: int = 0) -> int:
    """The 32-bit immediate of a post that completes `count` counted units of request `slot`
    in the KV memory of destination rank `rank` of the decode node (units of one post ride one
    queue pair in order, so the last write's immediate vouches for all of them). One engine
    drives every rank of a node, so the immediate itself says whose memory was written."""
    if not 0 <= slot < META_SLOTS or not 0 < count < 1 << (32 - SLOT_BITS):
        raise DisaggError(f"immediate out of range: slot {slot}, count {count}")
    if not 0 <= rank < MAX_RANKS:
        raise DisaggError(f"immediate out of range: rank {rank} (at most {MAX_RANKS} ranks)")
    return count << SLOT_BITS | rank << RANK_SHIFT | slot


def unpack_imm(imm: int) -> tuple[int, int, int]:
    """(slot, count, rank) of an immediate made by `pack_imm`."""
    low = imm & ((1 << SLOT_BITS) - 1)
    return low & (META_SLOTS - 1), imm >> SLOT_BITS, low >> RANK_SHIFT


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
    # the router's choices, under parallel handoff (-1: the decode node routes the prefill)
    prefill_node: int = -1
    decode_node: int = -1

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
    attempts: int = 0  # handoffs to prefill (retries after a failed transfer add one each)


@register
@dataclass(frozen=True)
class Shutdown:
    pass


@register
@dataclass(frozen=True)
class Inject:
    """A fault the driver injects in a server (disagg.faults): `drop_connection` (to `peer`),
    `nic_down` / `nic_degrade` (to `gbps`) of its wire, or `delay_control` (by `delay_s`), for
    `for_s`."""

    kind: str
    peer: str = ""
    for_s: float = 0.0
    gbps: float = 0.0
    delay_s: float = 0.0


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
    # ahead), not at start; passes_in_pieces: passes that replayed hw.latency.prefill_graphs'
    # pieces; messages_before_start: peers' messages that came before the driver's Start
    # (kept, and handled after it)
    counters: dict[str, int] = field(default_factory=dict)
    hops: tuple[tuple[Any, ...], ...] = ()  # request_id, node, event, t_s: see Server.mark


@dataclass(frozen=True)
class NodeConfig:
    """Everything a server process needs (picklable: it crosses a spawn). Its settings are the
    experiment's (`[hw]`, `[kv]`), as the driver resolved them."""

    role: str  # prefill | decode | colocated
    index: int
    experiment: dict[str, Any]
    driver: str  # the driver's control endpoint
    bind: str = "tcp://127.0.0.1:*"  # this server's control socket
    return_logits: bool = False
    # the control plane's shared secret from the driver that spawns this server (None: this
    # server finds its own, disagg.hw.auth.control_secret); it crosses the spawn, nothing else
    secret: bytes | None = field(default=None, repr=False)
    # a node of several ranks (tp x dp > 1): the directory its ranks share (the group's store,
    # each rank's KV memory); the driver makes it, one per node
    tp_dir: str = ""

    @property
    def name(self) -> str:
        return f"{self.role}{self.index}"

    @property
    def tp(self) -> int:
        """Ranks per attention group: `cluster.<role>.tp` of the experiment."""
        return int(self.experiment["cluster"][self.role]["tp"])

    @property
    def dp(self) -> int:
        """DP attention groups of the node: `cluster.<role>.dp` of the experiment."""
        return int(self.experiment["cluster"][self.role].get("dp", 1))

    @property
    def expert_parallel(self) -> bool:
        """`cluster.<role>.expert_parallel`: routed experts split whole across the ranks."""
        return bool(self.experiment["cluster"][self.role].get("expert_parallel", False))

    @property
    def ranks(self) -> int:
        """The node's processes: tp x dp (rank r is in attention group r // tp)."""
        return self.tp * self.dp

    def rank_name(self, rank: int) -> str:
        """A rank's process name: the node's for its leader (rank 0), `name.r<rank>` else."""
        return self.name if rank == 0 else f"{self.name}.r{rank}"

    @property
    def senders(self) -> set[str]:
        """Whose control messages this server accepts: the driver's and the other servers'."""
        cluster = self.experiment["cluster"]
        roles = ["colocated"] if cluster["mode"] == "colocated" else ["prefill", "decode"]
        servers = {f"{r}{i}" for r in roles for i in range(cluster[r]["nodes"])}
        return {"driver"} | servers - {self.name}
