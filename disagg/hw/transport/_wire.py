"""Socket plumbing shared by the tcp and cuda wires: frames, a receiving server, sender links.

Every frame starts with one 32-byte header (FRAME). A sender opens one TCP connection per peer
(a `Link`) and first proves that it knows the receiver's secret token, which only the control
plane carries (`local_info()["token"]`): the server sends a random nonce, the sender answers
with a HELLO frame, its endpoint name and HMAC-SHA256(token, nonce + name), and the server
answers HELLO. A connection that sends anything else first, or a wrong proof, is closed. Then
the sender streams WRITE frames (tcp: payload follows) or IMM frames (cuda: the bytes were
already copied) and one END frame per posted batch. The receiving `Server` checks each frame
(kind, region, bounds, size, immediate) before acting on it, applies frames in stream order and
answers each END with an ACK, so a batch completes only once the receiver has applied all of it.
A bad frame closes its connection; a refused connection is counted and said on stderr.

A connection that breaks fails every batch not yet acknowledged, with the peer named in the
error; the link reconnects on its next batch (RECONNECT_ATTEMPTS tries, backing off from
RECONNECT_BACKOFF_S), and once those fail the peer is dead: every later batch fails at once.
The server drops what it has not applied yet of a sender's old connection once the sender is
back, so no frame of a failed batch lands after a later batch's.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import hmac
import os
import queue
import secrets
import socket
import struct
import sys
import threading
import time
from collections.abc import Callable
from typing import Any, Protocol, cast

from disagg.errors import TransportError
from disagg.hw.transport.base import Completion, Polled, Transport, Unit

FRAME = struct.Struct("<BBHIQQQ")  # kind, flags, pad, region, offset, nbytes, value
HELLO, WRITE, IMM, END, ACK = range(5)
HAS_IMM = 1
SMALL = 64 * 1024  # payloads below this are coalesced with their header into one send
MAX_FRAME_BYTES = 256 << 20  # a WRITE's payload at most; larger writes go as several frames
MAX_NAME_BYTES = 1024  # a HELLO's endpoint name at most
TOKEN_BYTES = NONCE_BYTES = MAC_BYTES = 32
AUTH_TIMEOUT_S = 10.0  # a connection must have authenticated by then
CONNECT_TIMEOUT_S = 10.0  # the first connection, handshake included
RECONNECT_ATTEMPTS = 4  # after a break; then the peer is dead
RECONNECT_TIMEOUT_S = 0.5  # per attempt, handshake included
RECONNECT_BACKOFF_S = 0.05  # before the second attempt, doubling up to RECONNECT_BACKOFF_MAX_S
RECONNECT_BACKOFF_MAX_S = 0.4


def frame(
    kind: int, value: int = 0, region: int = 0, offset: int = 0, nbytes: int = 0, flags: int = 0
) -> bytes:
    return FRAME.pack(kind, flags, 0, region, offset, nbytes, value)


def check_imm(unit: Unit) -> None:
    """TransportError unless the unit's immediate is None or fits in 32 bits."""
    if unit.imm is not None and not 0 <= unit.imm < 2**32:
        raise TransportError(f"immediate {unit.imm} does not fit in 32 bits")


def proof(token: bytes, nonce: bytes, name: bytes) -> bytes:
    """What a sender named `name` answers to the server's `nonce`: it knows `token`."""
    return hmac.new(token, nonce + name, hashlib.sha256).digest()


class BadFrame(TransportError):
    """A frame a peer may not send (the server closes its connection)."""


class Reader(Protocol):
    def readinto(self, buffer: memoryview, /) -> int | None: ...

    def read(self, n: int, /) -> bytes | None: ...


def read_exact(reader: Reader, view: memoryview) -> None:
    """Fill `view` from `reader`; ConnectionError at end of stream."""
    got = 0
    while got < len(view):
        n = reader.readinto(view[got:])
        if not n:
            raise ConnectionError("connection closed by peer")
        got += n


def recv_exact(sock: socket.socket, nbytes: int) -> bytes:
    """`nbytes` from `sock`; ConnectionError at end of stream."""
    buf = bytearray(nbytes)
    view, got = memoryview(buf), 0
    while got < nbytes:
        n = sock.recv_into(view[got:])
        if not n:
            raise ConnectionError("connection closed by peer")
        got += n
    return bytes(buf)


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class Server:
    """Accepts senders that prove they know `token`; checks and applies their frames to
    `regions`; collects immediates; ACKs batches.

    regions maps a region id to a writable byte view (tcp); the cuda wire passes none and only
    receives IMM frames. Thread-safe: `take_immediates` may be called from any thread, and
    gives each immediate with the time it arrived (time.time()). A byte on the `wake_fd` pipe
    says immediates are waiting, so a loop can sleep until they come.
    `refused` counts the connections closed before authenticating ("auth") and for a bad
    frame ("frame"); each is also said on stderr with the peer, prefixed by `label`.
    """

    def __init__(
        self, host: str, port: int, regions: dict[int, memoryview], label: str = "wire"
    ) -> None:
        self.regions, self.label = regions, label
        self.token = secrets.token_bytes(TOKEN_BYTES)
        self.refused = {"auth": 0, "frame": 0}
        self._listener = socket.create_server((host, port))
        self.address = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        self._imms: list[tuple[int, float]] = []  # value, when it arrived
        self.wake_fd, self._wake_w = os.pipe()
        for fd in (self.wake_fd, self._wake_w):
            os.set_blocking(fd, False)
        self._conns: set[socket.socket] = set()
        self._senders: dict[str, tuple[socket.socket, threading.Thread]] = {}  # by name
        self._closed = False
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="wire-accept")]
        self._threads[0].start()

    def take_immediates(self) -> list[tuple[int, float]]:
        with self._lock:
            out, self._imms = self._imms, []
            with contextlib.suppress(BlockingIOError, OSError):
                os.read(self.wake_fd, 4096)
        return out

    def _add_immediate(self, value: int) -> None:
        arrived_s = time.time()
        with self._lock:
            self._imms.append((value, arrived_s))
            if len(self._imms) == 1:  # the first since the last take: wake the reader
                with contextlib.suppress(BlockingIOError, OSError):
                    os.write(self._wake_w, b"\0")

    def _accept(self) -> None:
        while True:
            try:
                conn, address = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    _shut(conn)
                    return
                self._conns.add(conn)
                t = threading.Thread(
                    target=self._serve, args=(conn, address), daemon=True, name="wire-recv"
                )
                self._threads = [t for t in self._threads if t.is_alive()] + [t]
            t.start()

    def _serve(self, conn: socket.socket, address: tuple[Any, ...]) -> None:
        peer = f"{address[0]}:{address[1]}"
        reader = cast(Reader, conn.makefile("rb", buffering=1 << 20))
        try:
            name = self._authenticate(conn, reader)
        except Exception as e:  # a wrong proof, a frame too early, silence, a hang-up
            self._refuse("auth", f"{peer} (not authenticated)", e)
            self._drop(conn)
            return
        self._take_over(name, conn)
        header = bytearray(FRAME.size)
        try:
            conn.sendall(frame(HELLO))  # authenticated, and its old connection is gone
            while True:
                read_exact(reader, memoryview(header))
                self._apply(conn, reader, *FRAME.unpack(header))
        except (OSError, ConnectionError):
            pass  # the sender went away: it fails its open batches itself
        except Exception as e:  # a bad frame, or anything else a peer's bytes caused
            self._refuse("frame", f"{name!r} at {peer}", e)
        finally:
            self._drop(conn, name)

    def _take_over(self, name: str, conn: socket.socket) -> None:
        """Make `conn` sender `name`'s connection (senders have distinct endpoint names: a
        node's). Its earlier one (broken: the sender reconnected) is closed and its thread
        waited for, so that nothing of a batch that failed with it is applied after this
        connection's frames."""
        with self._lock:
            old = self._senders.get(name)
            self._senders[name] = (conn, threading.current_thread())
        if old is not None:
            _shut(old[0])
            old[1].join(timeout=AUTH_TIMEOUT_S)

    def _drop(self, conn: socket.socket, name: str | None = None) -> None:
        _shut(conn)
        with self._lock:
            self._conns.discard(conn)
            if name is not None and self._senders.get(name, (None,))[0] is conn:
                del self._senders[name]

    def _refuse(self, why: str, peer: str, error: Exception) -> None:
        with self._lock:
            if self._closed:
                return
            self.refused[why] += 1
        print(
            f"{self.label}: closed the connection of {peer}: {error}", file=sys.stderr, flush=True
        )

    def _authenticate(self, conn: socket.socket, reader: Reader) -> str:
        """The sender's name, once it proved it knows the token (not answered yet); BadFrame
        otherwise."""
        conn.settimeout(AUTH_TIMEOUT_S)
        nonce = secrets.token_bytes(NONCE_BYTES)
        conn.sendall(nonce)
        header = bytearray(FRAME.size)
        read_exact(reader, memoryview(header))
        kind, *_, nbytes, _ = FRAME.unpack(header)
        if kind != HELLO:
            raise BadFrame(f"a frame of kind {kind} before authenticating")
        if nbytes > MAX_NAME_BYTES:
            raise BadFrame(f"a HELLO name of {nbytes} bytes (at most {MAX_NAME_BYTES})")
        body = bytearray(nbytes + MAC_BYTES)
        read_exact(reader, memoryview(body))
        name, mac = bytes(body[:nbytes]), bytes(body[nbytes:])
        if not hmac.compare_digest(mac, proof(self.token, nonce, name)):
            raise BadFrame(f"a wrong token proof from {name.decode(errors='replace')!r}")
        conn.settimeout(None)
        return name.decode(errors="replace")

    def _check(
        self, kind: int, flags: int, pad: int, region: int, offset: int, nbytes: int, value: int
    ) -> None:
        """BadFrame unless an authenticated sender may send this frame."""
        if kind == HELLO:
            raise BadFrame("a second HELLO")
        if kind not in (WRITE, IMM, END):
            raise BadFrame(f"a frame of unknown kind {kind}")
        if pad or (flags and (kind != WRITE or flags != HAS_IMM)):
            raise BadFrame(f"a frame of kind {kind} with flags {flags} and pad {pad}")
        if kind != WRITE and (region or offset or nbytes):
            raise BadFrame(f"a frame of kind {kind} with a region, offset or payload")
        if (kind == IMM or flags) and value >= 2**32:
            raise BadFrame(f"immediate {value} does not fit in 32 bits")
        if kind == WRITE:
            view = self.regions.get(region)
            if view is None:
                raise BadFrame(f"a write to region {region}, which is not registered")
            if nbytes > MAX_FRAME_BYTES:
                raise BadFrame(f"a frame of {nbytes} bytes (at most {MAX_FRAME_BYTES})")
            if offset + nbytes > len(view):
                raise BadFrame(
                    f"a write of {nbytes} bytes at {offset} past the end of region {region} "
                    f"({len(view)} bytes)"
                )

    def _apply(
        self,
        conn: socket.socket,
        reader: Reader,
        kind: int,
        flags: int,
        pad: int,
        region: int,
        offset: int,
        nbytes: int,
        value: int,
    ) -> None:
        self._check(kind, flags, pad, region, offset, nbytes, value)
        if kind == WRITE:
            read_exact(reader, self.regions[region][offset : offset + nbytes])
            if flags & HAS_IMM:
                self._add_immediate(value)
        elif kind == IMM:
            self._add_immediate(value)
        else:
            conn.sendall(frame(ACK, value))

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns, threads = list(self._conns), list(self._threads)
        _shut(self._listener)
        for c in conns:
            _shut(c)
        for t in threads:
            t.join(timeout=5)
        for fd in (self.wake_fd, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


class Link:
    """The sending side of one peer: jobs run in order on a worker thread, each batch ends with
    an END frame, and the receiver's ACK completes it.

    info is the peer's `local_info()` (host, port, token). run_job(link, job) sends a job's
    frames through `link.send`; on_done receives every Completion (ok or failed) from the
    link's threads. A broken connection fails its open batches; the next batch reconnects
    (see the module doc); `dead` says why the peer was given up, once it was.
    """

    def __init__(
        self,
        wire: str,
        peer: str,
        info: dict[str, Any],
        endpoint: str,
        run_job: Callable[[Link, Any], None],
        on_done: Callable[[Completion], None],
    ) -> None:
        self.label = f"{wire}: peer {peer!r} at {info['host']}:{info['port']}"
        self.run_job, self.on_done = run_job, on_done
        self._address = (str(info["host"]), int(info["port"]))
        try:
            self._token = bytes.fromhex(info["token"])
        except (KeyError, TypeError, ValueError) as e:
            raise TransportError(f"{self.label}: its info lacks a hex wire token") from e
        self._name = endpoint.encode()
        self._lock = threading.Lock()
        self._open: collections.deque[int] = collections.deque()
        self._sock: socket.socket | None = None  # None: broken, reconnect on the next batch
        self.dead = ""
        self._closing = threading.Event()
        self._jobs: queue.Queue[tuple[Any, int] | None] = queue.Queue()
        self._threads: list[threading.Thread] = []
        # a fault (SocketWire.impair): until when, and at how many bytes/s (0: nothing moves)
        self.impaired: tuple[float, float] = (0.0, 0.0)
        try:
            self._sending = self._connect(CONNECT_TIMEOUT_S)
        except (OSError, ConnectionError, TransportError) as e:
            raise TransportError(f"{self.label}: cannot connect: {e}") from e
        worker = threading.Thread(target=self._work, daemon=True, name="wire-send")
        self._threads.append(worker)
        worker.start()

    def _connect(self, timeout_s: float) -> socket.socket:
        """A new authenticated connection, with its ACK reader running."""
        sock = socket.create_connection(self._address, timeout=timeout_s)
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            nonce = recv_exact(sock, NONCE_BYTES)
            hello = frame(HELLO, nbytes=len(self._name)) + self._name
            sock.sendall(hello + proof(self._token, nonce, self._name))
            if FRAME.unpack(recv_exact(sock, FRAME.size))[0] != HELLO:
                raise TransportError("the peer did not answer HELLO")
            sock.settimeout(None)
        except (OSError, ConnectionError) as e:
            _shut(sock)
            raise TransportError(f"the handshake failed (a wrong wire token?): {e}") from e
        except TransportError:
            _shut(sock)
            raise
        acks = threading.Thread(target=self._acks, args=(sock,), daemon=True, name="wire-ack")
        with self._lock:
            if self._closing.is_set():
                _shut(sock)
                raise TransportError("transport closed")
            self._sock = sock
            self._threads = [t for t in self._threads if t.is_alive()] + [acks]
        acks.start()
        return sock

    def _reconnect(self) -> socket.socket | None:
        """Worker side: a new connection, or None once RECONNECT_ATTEMPTS failed (then dead)."""
        delay_s, error = RECONNECT_BACKOFF_S, ""
        for attempt in range(1, RECONNECT_ATTEMPTS + 1):
            if self.dead:
                return None
            try:
                return self._connect(RECONNECT_TIMEOUT_S)
            except (OSError, ConnectionError, TransportError) as e:
                error = str(e)
            if attempt < RECONNECT_ATTEMPTS and self._closing.wait(delay_s):
                return None
            delay_s = min(2 * delay_s, RECONNECT_BACKOFF_MAX_S)
        with self._lock:
            if not self.dead:
                self.dead = (
                    f"{self.label}: no connection after {RECONNECT_ATTEMPTS} reconnect attempts "
                    f"(last: {error})"
                )
        return None

    def submit(self, job: Any, wr_id: int) -> None:
        self._jobs.put((job, wr_id))

    def send(self, data: bytes | bytearray | memoryview) -> None:
        until, rate = self.impaired
        wait_s = until - time.monotonic()
        if wait_s > 0:  # the fault's NIC: down (wait it out) or slow (pace the bytes)
            self._closing.wait(wait_s if rate == 0 else min(wait_s, len(data) / rate))
        self._sending.sendall(data)

    def reset(self, reason: str) -> None:
        """Break the connection as a fault would: its open batches fail; the next reconnects."""
        sock = self._sock
        if sock is not None:
            self._lost(sock, reason)

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, wr_id = item
            sock = self._sock
            if sock is None and not self.dead:
                sock = self._reconnect()
            with self._lock:
                live = sock is not None and sock is self._sock and not self.dead
                if live:
                    self._open.append(wr_id)
                reason = self.dead or f"{self.label}: connection lost"
            if sock is None or not live:
                self.on_done(Completion(wr_id, False, reason))
                continue
            try:
                self._sending = sock
                self.run_job(self, job)
                self.send(frame(END, wr_id))
            except Exception as e:  # a wire error, or a failed copy: the batch fails, named
                self._lost(sock, f"send failed: {e}")

    def _acks(self, sock: socket.socket) -> None:
        reader = cast(Reader, sock.makefile("rb", buffering=0))
        header = bytearray(FRAME.size)
        try:
            while True:
                read_exact(reader, memoryview(header))
                kind, *_, value = FRAME.unpack(header)
                with self._lock:
                    if self._sock is not sock:
                        return  # this connection was given up: its batches failed already
                    if kind != ACK or not self._open or self._open[0] != value:
                        raise TransportError(f"unexpected frame {kind} for batch {value}")
                    self._open.popleft()
                self.on_done(Completion(value, True))
        except (OSError, ConnectionError, TransportError) as e:
            self._lost(sock, f"connection lost: {e}")

    def _lost(self, sock: socket.socket, reason: str) -> None:
        """Connection `sock` broke: fail every batch open on it (once), close it."""
        with self._lock:
            if self._sock is not sock:
                return
            self._sock = None
            failed, self._open = list(self._open), collections.deque()
        _shut(sock)
        for wr_id in failed:
            self.on_done(Completion(wr_id, False, f"{self.label}: {reason}"))

    def close(self) -> None:
        """Fail every open and queued batch; stop the threads."""
        self._closing.set()
        with self._lock:
            self.dead = self.dead or f"{self.label}: transport closed"
            sock, self._sock = self._sock, None
            failed, self._open = list(self._open), collections.deque()
            threads = list(self._threads)
        self._jobs.put(None)
        for wr_id in failed:
            self.on_done(Completion(wr_id, False, self.dead))
        if sock is not None:
            _shut(sock)
        for t in threads:
            if t is not threading.current_thread():
                t.join(timeout=5)


class SocketWire(Transport):
    """What the tcp and cuda wires share: a receiving Server (it applies or notes what peers
    send and collects immediates), one sending Link per peer, and completions gathered from
    the links' threads. Subclasses register memory and post. `local_info()` carries the
    server's secret token: give it to peers through the control plane only."""

    def __init__(self, endpoint: str, host: str, port: int, regions: dict[int, Any]) -> None:
        self.endpoint = endpoint or f"{socket.gethostname()}:{os.getpid()}"
        self._server = Server(host, port, regions, f"{self.name} endpoint {self.endpoint!r}")
        self._links: dict[str, Link] = {}
        self._lock = threading.Lock()
        self._completions: list[Completion] = []
        self._closed = False

    def _check_open(self) -> None:
        if self._closed:
            raise TransportError(f"{self.name} endpoint {self.endpoint!r} is closed")

    def _check_new_peer(self, peer: str) -> None:
        self._check_open()
        if peer in self._links:
            raise TransportError(f"already connected to peer {peer!r}")

    def _done(self, c: Completion) -> None:
        with self._lock:
            self._completions.append(c)

    def local_info(self) -> dict[str, Any]:
        host, port = self._server.address
        return {
            "wire": self.name,
            "host": host,
            "port": port,
            "endpoint": self.endpoint,
            "token": self._server.token.hex(),
        }

    @property
    def refused(self) -> dict[str, int]:
        """Incoming connections closed: before authenticating ("auth"), for a bad frame
        ("frame")."""
        return dict(self._server.refused)

    def wake_fd(self) -> int | None:
        return self._server.wake_fd

    # -- faults (disagg.faults), injected on request of the driver
    def reset(self, peer: str) -> None:
        """Drop the connection to `peer`: the batches in flight fail, the next reconnects."""
        if peer in self._links:
            self._links[peer].reset("connection reset (a fault)")

    def impair(self, for_s: float, bytes_per_s: float = 0.0) -> None:
        """For `for_s`, send nothing (0) or at most `bytes_per_s` to every peer."""
        for link in self._links.values():
            link.impaired = (time.monotonic() + for_s, bytes_per_s)

    def poll(self) -> Polled:
        with self._lock:
            done, self._completions = self._completions, []
        imms = self._server.take_immediates()
        return Polled(done, [v for v, _ in imms], [t for _, t in imms])

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for link in self._links.values():
            link.close()
        self._server.close()
