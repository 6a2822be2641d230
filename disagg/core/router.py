"""Routing: which prefill node and which decode node serve a request, and which GPU sends.

Policies are small classes with one method, `pick(loads)`; each has a config class in
policies.py, where `make_router` builds one by name. Loads are whatever the backend counts
(outstanding requests, queued tokens): lower is better.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from itertools import repeat
from typing import Protocol


class Router(Protocol):
    def pick(self, loads: Mapping[int, float]) -> int:
        """The node for the next request, given each node's load (missing: 0)."""
        ...


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
        # min of (load, node) pairs: what min(nodes, key=...) picks, without a call per node
        return min(zip(map(loads.get, self.nodes, repeat(0.0)), self.nodes, strict=True))[1]


def pick_replica(replicas: Sequence[int], rng: random.Random) -> int:
    """A random replica (DP rank, GPU) out of several equivalent ones, from a seeded rng."""
    return replicas[rng.randrange(len(replicas))]
