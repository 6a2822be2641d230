"""The planner's search space: which configurations of a base experiment to try.

A configuration is the base experiment in one cluster mode, with node counts (colocated nodes,
or prefill and decode nodes) and one value for each varied setting (`--vary KEY=V1,V2`). The
space is the product of those choices, cut to the GPU budget. Settings of one mode only
(`cluster.colocated.*`; `cluster.prefill.*`, `cluster.decode.*`, `transfer.*`) are varied in
that mode only. A base in the other mode lends its groups: a colocated base runs each disagg
pool like its colocated nodes; a disagg base runs colocated nodes with the decode pool's
parallelism and batch and the prefill pool's token budget.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from disagg.config import Experiment, build_experiment, parse_override, set_path
from disagg.errors import ConfigError
from disagg.sim.cluster import pool_pages

MODES = ("colocated", "disagg")
_OWN_OPTION = {"cluster.mode": "--modes", "workload.rate_per_s": "(the planner's search)"}
_DISAGG_ONLY = ("cluster.prefill.", "cluster.decode.", "transfer.")


@dataclass(frozen=True)
class Space:
    """What to search. Node counts left as None run 1..`max_nodes` per pool, as far as
    `max_gpus` allows; `vary` holds (dotted key, values) pairs."""

    max_gpus: int
    modes: tuple[str, ...] = MODES
    colocated_nodes: tuple[int, ...] | None = None
    prefill_nodes: tuple[int, ...] | None = None
    decode_nodes: tuple[int, ...] | None = None
    vary: tuple[tuple[str, tuple[Any, ...]], ...] = ()
    max_nodes: int = 8

    def __post_init__(self) -> None:
        if self.max_gpus < 1:
            raise ConfigError(f"--max-gpus {self.max_gpus}: must be at least 1")
        bad = [m for m in self.modes if m not in MODES]
        if bad or not self.modes:
            raise ConfigError(f"--modes {','.join(self.modes)!r}: use colocated and/or disagg")
        for name in ("colocated_nodes", "prefill_nodes", "decode_nodes"):
            counts = getattr(self, name)
            if counts is not None and (not counts or min(counts) < 1):
                raise ConfigError(f"--{name.replace('_', '-')} {counts}: counts must be >= 1")


def parse_vary(text: str) -> tuple[str, tuple[Any, ...]]:
    """`KEY=V1,V2,...` -> (KEY, values), each value read as `--set` reads it."""
    key, eq, raw = text.partition("=")
    key = key.strip()
    values = tuple(parse_override(f"{key}={v.strip()}")[1] for v in raw.split(",") if v.strip())
    if not eq or not key or not values:
        raise ConfigError(f"--vary {text!r}: expected KEY=V1,V2,... (e.g. transfer.policy=...)")
    if key in _OWN_OPTION or key.endswith(".nodes"):
        own = _OWN_OPTION.get(key, "--nodes, --prefill-nodes or --decode-nodes")
        raise ConfigError(f"--vary {text!r}: {key} is set by {own}, not --vary")
    return key, values


@dataclass(frozen=True)
class Candidate:
    """One configuration: its label (e.g. `1P3D transfer.policy=whole`) and experiment."""

    label: str
    mode: str
    exp: Experiment

    @property
    def gpus(self) -> int:
        return self.exp.cluster.total_gpus


@dataclass
class Expansion:
    """The configurations to simulate, and those skipped: (label, reason)."""

    candidates: list[Candidate] = field(default_factory=list)
    skipped: list[tuple[str, str]] = field(default_factory=list)


def expand(base: Experiment, space: Space) -> Expansion:
    """Every configuration of `space` within its GPU budget, validated, each of whose pools
    fits its KV (`pool_pages`); ConfigError if none is left."""
    out, smallest = Expansion(), None
    for key, _ in space.vary:
        _check_key(base, key)
    for mode in space.modes:
        axes = [(k, vs) for k, vs in space.vary if _applies(k, mode)]
        for combo in itertools.product(*(vs for _, vs in axes)):
            data = _mode_data(base, mode)
            settings = [(k, v) for (k, _), v in zip(axes, combo, strict=True)]
            for k, v in settings:
                set_path(data, k, v)
            for nodes in _node_counts(data, mode, space):
                label = " ".join([_nodes_label(mode, nodes), *(f"{k}={v}" for k, v in settings)])
                gpus = _gpus(data, mode, nodes)
                smallest = gpus if smallest is None else min(smallest, gpus)
                if gpus <= space.max_gpus:
                    _add(out, label, mode, data, nodes, base.name)
    if not out.candidates:
        raise ConfigError(_empty(space, smallest, out.skipped))
    return out


def _check_key(base: Experiment, key: str) -> None:
    """ConfigError unless `key` names a setting of an experiment (a typo would otherwise
    skip every configuration it applies to, one by one)."""
    node: Any = base.model_dump(mode="json")
    for i, part in enumerate(key.split(".")):
        if not isinstance(node, dict):
            break  # inside a value given as a table (a router's options): validation judges
        if part not in node:
            where = ".".join(key.split(".")[:i]) or "the experiment"
            raise ConfigError(f"--vary {key}: {where} has no setting {part!r}")
        node = node[part]


def _applies(key: str, mode: str) -> bool:
    if key.startswith("cluster.colocated."):
        return mode == "colocated"
    return mode == "disagg" or not key.startswith(_DISAGG_ONLY)


def _mode_data(base: Experiment, mode: str) -> dict[str, Any]:
    """The base experiment as plain data, in `mode`, with only that mode's groups."""
    data = base.model_dump(mode="json", exclude_none=True)
    c = data["cluster"]
    if c["mode"] != mode:

        def plain(name: str) -> dict[str, Any]:
            return {k: v for k, v in c[name].items() if k != "scheduler"}  # role-specific

        if mode == "disagg":
            c["prefill"], c["decode"] = plain("colocated"), plain("colocated")
        else:
            c["colocated"] = plain("decode") | {"token_budget": c["prefill"]["token_budget"]}
    c["mode"] = mode
    for name in ("colocated",) if mode == "disagg" else ("prefill", "decode"):
        c.pop(name, None)
    return data


def _gpus_per_node(data: dict[str, Any], group: str) -> int:
    g = data["cluster"][group]
    return int(g.get("tp", 8)) * int(g.get("dp", 1))


def _gpus(data: dict[str, Any], mode: str, nodes: tuple[int, ...]) -> int:
    groups = ("colocated",) if mode == "colocated" else ("prefill", "decode")
    return sum(n * _gpus_per_node(data, g) for n, g in zip(nodes, groups, strict=True))


def _node_counts(data: dict[str, Any], mode: str, space: Space) -> Iterator[tuple[int, ...]]:
    def counts(given: tuple[int, ...] | None, group: str) -> Sequence[int]:
        if given is not None:
            return given
        most = min(space.max_nodes, space.max_gpus // _gpus_per_node(data, group))
        return range(1, max(most, 1) + 1)

    if mode == "colocated":
        yield from ((n,) for n in counts(space.colocated_nodes, "colocated"))
    else:
        yield from itertools.product(
            counts(space.prefill_nodes, "prefill"), counts(space.decode_nodes, "decode")
        )


def _nodes_label(mode: str, nodes: tuple[int, ...]) -> str:
    return f"C{nodes[0]}" if mode == "colocated" else f"{nodes[0]}P{nodes[1]}D"


def _add(
    out: Expansion, label: str, mode: str, data: dict[str, Any], nodes: tuple[int, ...], name: str
) -> None:
    groups = ("colocated",) if mode == "colocated" else ("prefill", "decode")
    data = data | {"name": f"{name}-plan-{label.replace(' ', '-').replace('=', '-')}"}
    data["cluster"] = dict(data["cluster"])
    for group, n in zip(groups, nodes, strict=True):
        data["cluster"][group] = data["cluster"][group] | {"nodes": n}
    try:
        exp = build_experiment(data, source=label)
        for role, group_cfg in exp.cluster.groups.items():
            pool_pages(exp, group_cfg, role)
    except ConfigError as e:
        out.skipped.append((label, str(e).replace("\n", ";")))
        return
    out.candidates.append(Candidate(label, mode, exp))


def _empty(space: Space, smallest: int | None, skipped: list[tuple[str, str]]) -> str:
    if skipped:
        label, reason = skipped[0]
        return (
            f"none of the {len(skipped)} configurations within --max-gpus {space.max_gpus} "
            f"can run; the first, {label}: {reason}"
        )
    if smallest is None:
        return "the search space is empty: give at least one node count per pool"
    return (
        f"no configuration fits --max-gpus {space.max_gpus}: the smallest of the search space "
        f"needs {smallest} GPUs"
    )


def parse_counts(option: str, text: str | None) -> tuple[int, ...] | None:
    """`1,2,4` -> (1, 2, 4); None for None; ConfigError naming `option` for anything else."""
    if text is None:
        return None
    try:
        counts = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise ConfigError(f"{option} {text!r}: expected node counts, e.g. 1,2,4") from None
    if not counts or min(counts) < 1:
        raise ConfigError(f"{option} {text!r}: expected node counts >= 1, e.g. 1,2,4")
    return counts
