"""Wires behind one interface (base.Transport): make_transport("tcp" | "cuda" | "verbs", **kw).

Each wire's module is imported only when asked for, so the tcp wire needs neither CUDA nor
pyverbs. A wire module is found by its registered module path; the class used is the Transport
subclass defined there whose `name` is the wire's name.
"""

from __future__ import annotations

import importlib
import inspect
from typing import Any

from disagg.errors import ConfigError
from disagg.hw.transport.base import Transport

WIRES = {
    "tcp": "disagg.hw.transport.tcp",
    "cuda": "disagg.hw.transport.cuda",
    "verbs": "disagg.hw.transport.verbs",
}


def transport_class(name: str) -> type[Transport]:
    """The Transport subclass of wire `name` (its module imported now)."""
    if name not in WIRES:
        raise ConfigError(f"unknown wire {name!r}; known: {', '.join(WIRES)}")
    try:
        module = importlib.import_module(WIRES[name])
    except ModuleNotFoundError as e:
        raise ConfigError(f"wire {name!r} is not available here: {e}") from e
    for obj in vars(module).values():
        if inspect.isclass(obj) and issubclass(obj, Transport) and obj.name == name:
            return obj
    raise ConfigError(f"module {WIRES[name]} defines no Transport named {name!r}")


def make_transport(name: str, **kw: Any) -> Transport:
    """A new endpoint of wire `name`; keyword arguments go to its constructor."""
    return transport_class(name)(**kw)
