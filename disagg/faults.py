"""Faults an experiment injects (`[[faults]]` entries), for both backends.

    kill             at_s, node                 the node's process dies
    stop             at_s, node, for_s          the node freezes (SIGSTOP), then resumes
    nic_down         at_s, node, nic, for_s     a prefill node's NIC moves nothing
    nic_degrade      at_s, node, nic, gbps, for_s   ... moves at most `gbps`
    drop_connection  at_s, node, peer           the wire connection node -> peer is reset
    delay_control    at_s, node, delay_s, for_s the node's control messages arrive late

Nodes are named as the runs name them: `prefill0`, `decode1`, `colocated0`. What a fault does
to requests and pages is the roles' business (disagg.core.roles): a backend only makes the fault
happen. The summary counts, per fault, the requests that failed from its start until the next
fault's (`attribute`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field


class _Fault(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)
    kind: str
    at_s: float = Field(ge=0)
    node: str

    def label(self) -> str:
        return f"{self.kind} {self.node} at {self.at_s:g} s"


class Kill(_Fault):
    kind: Literal["kill"] = "kill"


class Stop(_Fault):
    kind: Literal["stop"] = "stop"
    for_s: float = Field(gt=0)


class NicDown(_Fault):
    kind: Literal["nic_down"] = "nic_down"
    nic: int = Field(default=0, ge=0)
    for_s: float = Field(gt=0)


class NicDegrade(_Fault):
    kind: Literal["nic_degrade"] = "nic_degrade"
    nic: int = Field(default=0, ge=0)
    gbps: float = Field(gt=0)
    for_s: float = Field(gt=0)


class DropConnection(_Fault):
    kind: Literal["drop_connection"] = "drop_connection"
    peer: str


class DelayControl(_Fault):
    kind: Literal["delay_control"] = "delay_control"
    delay_s: float = Field(gt=0)
    for_s: float = Field(gt=0)


Fault = Annotated[
    Kill | Stop | NicDown | NicDegrade | DropConnection | DelayControl,
    Field(discriminator="kind"),
]


def node_names(nodes: dict[str, int]) -> list[str]:
    """The run's node names, given each used group's node count."""
    return [f"{role}{i}" for role, n in nodes.items() for i in range(n)]


def check(faults: Sequence[_Fault], nodes: dict[str, int]) -> None:
    """ValueError naming the entry and field of a fault that names no node of the run, or a
    NIC fault on a node that sends no KV."""
    names = node_names(nodes)
    for i, f in enumerate(faults):
        where = f"faults[{i}]"
        if f.node not in names:
            raise ValueError(f"{where}.node={f.node!r} is not a node of this run ({names})")
        if isinstance(f, NicDown | NicDegrade) and not f.node.startswith("prefill"):
            raise ValueError(
                f"{where}.node={f.node!r}: NIC faults are on prefill nodes (the senders of KV)"
            )
        if isinstance(f, DropConnection):
            if not (f.node.startswith("prefill") and f.peer.startswith("decode")):
                raise ValueError(
                    f"{where}: drop_connection is from a prefill node to a decode node, "
                    f"not {f.node!r} -> {f.peer!r}"
                )
            if f.peer not in names:
                raise ValueError(f"{where}.peer={f.peer!r} is not a node of this run ({names})")


def attribute(faults: Sequence[_Fault], failed_at_s: Sequence[float]) -> list[dict[str, object]]:
    """Per fault (in time order): its label and the requests that failed from its start until
    the next fault's start (failures before the first fault are nobody's)."""
    ordered = sorted(faults, key=lambda f: f.at_s)
    rows: list[dict[str, object]] = []
    for i, f in enumerate(ordered):
        end = ordered[i + 1].at_s if i + 1 < len(ordered) else float("inf")
        failed = sum(1 for t in failed_at_s if f.at_s <= t < end)
        rows.append({"fault": f.label(), "requests_failed": failed})
    return rows
