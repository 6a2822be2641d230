"""Who may speak on the control plane: nobody off-host on loopback, CURVE beyond it.

A control socket bound to loopback (the default) is reachable from its own host only, and runs
without authentication. Bound anywhere else (hw.auth "auto"), or always (hw.auth "curve"),
every endpoint of a run uses ZeroMQ CURVE with one keypair derived from a shared secret
(hw.secret_file): its ROUTER is a CURVE server that admits, through ZAP, only clients
presenting that public key (which takes its secret key to do), and its DEALERs are clients of
that server key. A peer without the secret never completes a handshake, so none of its messages
arrive; what does travel is encrypted. docs/security.md has the threat model.

The secret itself is never recorded: experiment.json holds the file's path, and a secret the
driver generates for the servers it spawns travels in their NodeConfig, not over the network.
"""

from __future__ import annotations

import hashlib
import ipaddress
import secrets
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zmq
from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85

from disagg.errors import ConfigError
from disagg.settings import HwConfig

SECRET_MIN_BYTES = 16
_KDF_CONTEXT = b"disagg-control"  # keys derived for the control plane, and nothing else
_SET_IT = "set hw.secret_file (or DISAGG_SECRET_FILE)"


@dataclass(frozen=True)
class CurveKeys:
    """The control plane's CURVE keypair, each key z85-encoded (40 bytes)."""

    public: bytes
    secret: bytes = field(repr=False)

    @classmethod
    def from_secret(cls, shared: bytes) -> CurveKeys:
        """The keypair every holder of `shared` (at least SECRET_MIN_BYTES) derives."""
        if len(shared) < SECRET_MIN_BYTES:
            raise ConfigError(
                f"a control-plane secret needs at least {SECRET_MIN_BYTES} bytes, not {len(shared)}"
            )
        secret = z85.encode(hashlib.sha256(_KDF_CONTEXT + shared).digest())
        return cls(zmq.curve_public(secret), secret)


def is_loopback(endpoint: str) -> bool:
    """Whether `endpoint` (a ZeroMQ bind or connect address) reaches this host only: tcp on
    127.0.0.0/8, ::1 or localhost, or ipc and inproc. A wildcard (*, 0.0.0.0), an interface
    name or any other host name is not."""
    scheme, _, rest = endpoint.partition("://")
    if scheme in ("ipc", "inproc"):
        return True
    host = rest.rsplit(";", 1)[-1].rsplit(":", 1)[0].strip("[]")  # [source;]host:port
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def curve_wanted(mode: str, *endpoints: str) -> bool:
    """Whether the control plane runs CURVE under hw.auth `mode`: always with "curve", never
    with "off", and with "auto" when any of `endpoints` (the address an endpoint binds, and
    those it connects to) is beyond loopback."""
    if mode not in ("auto", "curve", "off"):
        raise ConfigError(f"hw.auth={mode!r}: use auto, curve or off")
    return mode == "curve" or (mode == "auto" and not all(map(is_loopback, endpoints)))


def read_secret(path: Path) -> bytes:
    """The shared secret in the file at `path` (its contents, stripped)."""
    try:
        shared = path.read_bytes().strip()
    except OSError as e:
        why = e.strerror or e
        raise ConfigError(f"hw.secret_file={str(path)!r}: cannot read it ({why})") from None
    if len(shared) < SECRET_MIN_BYTES:
        raise ConfigError(
            f"hw.secret_file={str(path)!r} holds {len(shared)} bytes: a shared secret needs at "
            f"least {SECRET_MIN_BYTES} (e.g. head -c 32 /dev/urandom | base64 > {path})"
        )
    return shared


def control_secret(
    hw: HwConfig,
    *endpoints: str,
    given: bytes | None = None,
    generate: bool = False,
    base_dir: str = ".",
) -> bytes | None:
    """The shared secret of an endpoint's control sockets, or None: no authentication.

    `endpoints`: the address it binds, then those it connects to. A secret `given` (by the
    driver that spawned this process) is used as is. Otherwise, when CURVE is wanted
    (`curve_wanted`), it is hw.secret_file's contents (a relative path is from `base_dir`), or,
    with `generate` (a driver whose servers are all its own children), a fresh random secret;
    ConfigError without either."""
    if given is not None:
        return given
    beyond = [e for e in endpoints if not is_loopback(e)]
    if not curve_wanted(hw.auth, *endpoints):
        if beyond:
            print(f"warning: hw.auth=off: no authentication on {beyond[0]}", file=sys.stderr)
        return None
    if hw.secret_file is not None:
        path = Path(hw.secret_file).expanduser()
        return read_secret(path if path.is_absolute() else Path(base_dir) / path)
    if generate:
        return secrets.token_bytes(32)
    if endpoints and not is_loopback(endpoints[0]):
        raise ConfigError(f"binding to {beyond[0]} needs a shared secret: {_SET_IT}")
    if beyond:
        raise ConfigError(f"connecting to {beyond[0]} needs a shared secret: {_SET_IT}")
    raise ConfigError(f"hw.auth='curve' needs a shared secret: {_SET_IT}")


class _Admitted:
    """The ZAP credentials provider: a domain (one per keypair) admits its own public key only."""

    def __init__(self) -> None:
        self.keys: dict[str, bytes] = {}

    def callback(self, domain: str, key: bytes) -> bool:
        return self.keys.get(domain) == key


_GUARDS: dict[int, tuple[Any, ThreadAuthenticator, _Admitted]] = {}  # by id of the context
_GUARDS_LOCK = threading.Lock()


def _zap_domain(ctx: Any, keys: CurveKeys) -> str:
    """The ZAP domain of CURVE servers of `keys` in `ctx`, admitting holders of `keys` only;
    the context's ZAP handler (one thread, for the process's life) starts on first use."""
    domain = "disagg-" + keys.public.decode()
    with _GUARDS_LOCK:
        if id(ctx) not in _GUARDS:
            authenticator = ThreadAuthenticator(ctx)
            authenticator.start()
            _GUARDS[id(ctx)] = (ctx, authenticator, _Admitted())
        _, authenticator, admitted = _GUARDS[id(ctx)]
        if domain not in admitted.keys:
            admitted.keys[domain] = keys.public
            authenticator.configure_curve_callback(domain, admitted)
    return domain


def curve_server(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make `sock`, before it binds, a CURVE server that admits clients holding `keys` only."""
    sock.setsockopt(zmq.ZAP_DOMAIN, _zap_domain(sock.context, keys).encode())
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SERVER, 1)


def curve_client(sock: zmq.Socket[bytes], keys: CurveKeys) -> None:
    """Make `sock`, before it connects, a CURVE client holding `keys`, of a server of `keys`."""
    sock.setsockopt(zmq.CURVE_SERVERKEY, keys.public)
    sock.setsockopt(zmq.CURVE_PUBLICKEY, keys.public)
    sock.setsockopt(zmq.CURVE_SECRETKEY, keys.secret)
