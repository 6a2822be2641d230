"""The Ray executor of sweeps: each point a Ray task of one CPU (disagg.sweep.run_point).

Ray is an optional extra (`pip install -e '.[ray]'`), imported only here.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

from disagg.errors import ConfigError, DisaggError
from disagg.sweep import Executor, Point, run_point

RAY_CONNECT_TIMEOUT_S = 5.0  # TCP connect to the address
RAY_INIT_TIMEOUT_S = 20.0  # Ray's handshake after it


def ray_cluster(address: str, cpus: int) -> Executor:
    """An executor over a Ray cluster: `auto` (the one running here), `local` (start one here
    with `cpus` CPUs, stopped after the sweep), `ray://HOST:PORT` (Ray Client) or `HOST:PORT`
    (its GCS). A cluster that cannot be reached within RAY_CONNECT_TIMEOUT_S is a ConfigError
    naming `address`. Run directories are written where the tasks run: on a cluster of several
    machines, the experiments and `--out` must be on a file system they share."""
    if address not in ("auto", "local"):
        _probe(address)
    try:
        import ray
    except ImportError:
        raise ConfigError(
            f"--ray {address}: ray is not installed (pip install -e '.[ray]')"
        ) from None

    def run(points: list[Point]) -> Iterator[tuple[Point, dict[str, Any]]]:
        if not points:
            return
        started = _ray_connect(ray, address, cpus)
        try:
            task = ray.remote(num_cpus=1, max_retries=0)(run_point)
            pending = {task.remote(p): p for p in points}
            while pending:
                ready, _ = ray.wait(list(pending), num_returns=1)
                try:
                    summary = ray.get(ready[0])
                except ray.exceptions.RayTaskError as e:
                    raise e.cause if isinstance(e.cause, DisaggError) else e from None
                yield pending.pop(ready[0]), summary
        finally:
            if started:
                ray.shutdown()

    return run


def _ray_connect(ray: Any, address: str, cpus: int) -> bool:
    """Connect to (or, for `local`, start) the cluster unless this process already is; return
    whether it connected now (and so should disconnect after). A cluster that has not answered
    within RAY_INIT_TIMEOUT_S is a ConfigError (Ray itself would retry for minutes)."""
    import logging

    if ray.is_initialized():
        return False
    quiet: dict[str, Any] = {"logging_level": logging.WARNING, "log_to_driver": False}
    if not address.startswith("ray://"):
        quiet["include_dashboard"] = False
    if address == "local":
        quiet["num_cpus"] = cpus
    failure: list[Exception] = []

    def init() -> None:
        try:
            ray.init(address=address, **quiet)
        except Exception as e:  # ray raises ConnectionError, ValueError, RuntimeError, ...
            failure.append(e)

    if address == "local":  # starting, not connecting: however long it takes
        init()
    elif not _finishes(init, RAY_INIT_TIMEOUT_S):
        raise ConfigError(
            f"--ray {address}: no Ray cluster answered there within {RAY_INIT_TIMEOUT_S:g} s "
            "(Ray's log above may say why: not a Ray port, a missing authentication token)"
        )
    if failure:
        raise ConfigError(f"--ray {address}: cannot connect to a Ray cluster: {failure[0]}")
    return True


def _finishes(fn: Callable[[], None], timeout_s: float) -> bool:
    """Run `fn` on a daemon thread; whether it returned within `timeout_s` (if not, it is left
    to run, or to hang, in the background)."""
    import threading

    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    thread.join(timeout_s)
    return not thread.is_alive()


def _probe(address: str) -> None:
    """Check that `address` (ray://HOST:PORT or HOST:PORT) accepts a TCP connection within
    RAY_CONNECT_TIMEOUT_S, so an unreachable cluster is an error now and not a long hang."""
    import socket

    hostport = address.removeprefix("ray://")
    host, sep, port = hostport.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ConfigError(
            f"--ray {address!r}: not an address (auto, local, ray://HOST:PORT or HOST:PORT)"
        )
    try:
        socket.create_connection((host.strip("[]"), int(port)), RAY_CONNECT_TIMEOUT_S).close()
    except OSError as e:
        why = "timed out" if isinstance(e, TimeoutError) else (e.strerror or str(e))
        raise ConfigError(
            f"--ray {address}: cannot reach {hostport} ({why}, {RAY_CONNECT_TIMEOUT_S:g} s timeout)"
        ) from None
