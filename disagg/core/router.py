"""Routing: which prefill node and which decode node serve a request, and which GPU sends.

Policies are small classes with one method, `pick(loads)`; `make_router` is the registry.
Loads are whatever the backend counts (outstanding requests, queued tokens): lower is better.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence

from disagg.errors import ConfigError


class RoundRobin:
    """Cycle through the nodes in order, ignoring load."""

    def __init__(self, nodes: Sequence[int]) -> None:
        self.nodes = list(nodes)
        self._next = 0

    def pick(self, loads: Mapping[int, float]) -> int:
        node = self.nodes[self._next % len(self.nodes)]
        self._next += 1
        return node


class LeastLoaded:
    """The node with the smallest load; ties go to the lowest node id (deterministic)."""

    def __init__(self, nodes: Sequence[int]) -> None:
        self.nodes = list(nodes)

    def pick(self, loads: Mapping[int, float]) -> int:
        return min(self.nodes, key=lambda n: (loads.get(n, 0.0), n))


Router = RoundRobin | LeastLoaded
ROUTERS: dict[str, type[RoundRobin] | type[LeastLoaded]] = {
    "round_robin": RoundRobin,
    "least_loaded": LeastLoaded,
}


def make_router(policy: str, nodes: Sequence[int]) -> Router:
    if policy not in ROUTERS:
        raise ConfigError(f"unknown router {policy!r}; known: {', '.join(ROUTERS)}")
    if not nodes:
        raise ConfigError("a router needs at least one node")
    return ROUTERS[policy](nodes)


def pick_replica(replicas: Sequence[int], rng: random.Random) -> int:
    """A random replica (DP rank, GPU) out of several equivalent ones, from a seeded rng."""
    return replicas[rng.randrange(len(replicas))]
