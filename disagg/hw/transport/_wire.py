"""Socket plumbing shared by the tcp and cuda wires: frames, a receiving server, sender links.

Every frame starts with one 32-byte header (FRAME). A sender opens one TCP connection per peer
(a `Link`), says HELLO with its endpoint name, then streams WRITE frames (tcp: payload follows)
or IMM frames (cuda: the bytes were already copied) and one END frame per posted batch. The
receiving `Server` applies frames in stream order and answers each END with an ACK, so a batch
completes only once the receiver has applied all of it; a connection that breaks fails every
batch not yet acknowledged, with the peer named in the error.
"""

from __future__ import annotations

import collections
import contextlib
import os
import queue
import socket
import struct
import threading
from collections.abc import Callable
from typing import Any, Protocol, cast

from disagg.errors import TransportError
from disagg.hw.transport.base import Completion, Polled, Transport, Unit

FRAME = struct.Struct("<BBHIQQQ")  # kind, flags, pad, region, offset, nbytes, value
HELLO, WRITE, IMM, END, ACK = range(5)
HAS_IMM = 1
SMALL = 64 * 1024  # payloads below this are coalesced with their header into one send


def frame(
    kind: int, value: int = 0, region: int = 0, offset: int = 0, nbytes: int = 0, flags: int = 0
) -> bytes:
    return FRAME.pack(kind, flags, 0, region, offset, nbytes, value)


def check_imm(unit: Unit) -> None:
    """TransportError unless the unit's immediate is None or fits in 32 bits."""
    if unit.imm is not None and not 0 <= unit.imm < 2**32:
        raise TransportError(f"immediate {unit.imm} does not fit in 32 bits")


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


def _shut(sock: socket.socket) -> None:
    with contextlib.suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


class Server:
    """Accepts senders; applies their frames to `regions`; collects immediates; ACKs batches.

    regions maps a region id to a writable byte view (tcp); the cuda wire passes none and only
    receives IMM frames. Thread-safe: `take_immediates` may be called from any thread. A byte
    on the `wake_fd` pipe says immediates are waiting, so a loop can sleep until they come.
    """

    def __init__(self, host: str, port: int, regions: dict[int, memoryview]) -> None:
        self.regions = regions
        self._listener = socket.create_server((host, port))
        self.address = self._listener.getsockname()[:2]
        self._lock = threading.Lock()
        self._imms: list[int] = []
        self.wake_fd, self._wake_w = os.pipe()
        for fd in (self.wake_fd, self._wake_w):
            os.set_blocking(fd, False)
        self._conns: list[socket.socket] = []
        self._closed = False
        self._threads = [threading.Thread(target=self._accept, daemon=True, name="wire-accept")]
        self._threads[0].start()

    def take_immediates(self) -> list[int]:
        with self._lock:
            out, self._imms = self._imms, []
            with contextlib.suppress(BlockingIOError, OSError):
                os.read(self.wake_fd, 4096)
        return out

    def _add_immediate(self, value: int) -> None:
        with self._lock:
            self._imms.append(value)
            if len(self._imms) == 1:  # the first since the last take: wake the reader
                with contextlib.suppress(BlockingIOError, OSError):
                    os.write(self._wake_w, b"\0")

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:
                return
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            with self._lock:
                if self._closed:
                    _shut(conn)
                    return
                self._conns.append(conn)
                t = threading.Thread(
                    target=self._serve, args=(conn,), daemon=True, name="wire-recv"
                )
                self._threads.append(t)
            t.start()

    def _serve(self, conn: socket.socket) -> None:
        reader = cast(Reader, conn.makefile("rb", buffering=1 << 20))
        header = bytearray(FRAME.size)
        try:
            while True:
                read_exact(reader, memoryview(header))
                self._apply(conn, reader, *FRAME.unpack(header))
        except (OSError, ConnectionError, TransportError):
            _shut(conn)  # the sender sees the connection drop and fails its open batches

    def _apply(
        self,
        conn: socket.socket,
        reader: Reader,
        kind: int,
        flags: int,
        _pad: int,
        region: int,
        offset: int,
        nbytes: int,
        value: int,
    ) -> None:
        if kind == WRITE:
            view = self.regions.get(region)
            if view is None or offset + nbytes > len(view):
                raise TransportError(f"write outside region {region}")
            read_exact(reader, view[offset : offset + nbytes])
            if flags & HAS_IMM:
                self._add_immediate(value)
        elif kind == IMM:
            self._add_immediate(value)
        elif kind == END:
            conn.sendall(frame(ACK, value))
        elif kind == HELLO:
            reader.read(nbytes)  # the sender's name: kept for symmetry, not needed here
        else:
            raise TransportError(f"unknown frame kind {kind}")

    def close(self) -> None:
        with self._lock:
            self._closed = True
            conns = list(self._conns)
        _shut(self._listener)
        for c in conns:
            _shut(c)
        for t in self._threads:
            t.join(timeout=5)
        for fd in (self.wake_fd, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)


class Link:
    """The sending side of one peer: jobs run in order on a worker thread, each batch ends with
    an END frame, and the receiver's ACK completes it.

    run_job(link, job) sends a job's frames through `link.send`; on_done receives every
    Completion (ok or failed) from the link's threads.
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
        try:
            self.sock = socket.create_connection((info["host"], int(info["port"])), timeout=10)
        except OSError as e:
            raise TransportError(f"{self.label}: cannot connect: {e}") from e
        self.sock.settimeout(None)
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        name = endpoint.encode()
        self.sock.sendall(frame(HELLO, nbytes=len(name)) + name)
        self._lock = threading.Lock()
        self._open: collections.deque[int] = collections.deque()
        self.dead = ""
        self._jobs: queue.Queue[tuple[Any, int] | None] = queue.Queue()
        self._threads = [
            threading.Thread(target=self._work, daemon=True, name="wire-send"),
            threading.Thread(target=self._acks, daemon=True, name="wire-ack"),
        ]
        for t in self._threads:
            t.start()

    def submit(self, job: Any, wr_id: int) -> None:
        self._jobs.put((job, wr_id))

    def send(self, data: bytes | bytearray | memoryview) -> None:
        self.sock.sendall(data)

    def _work(self) -> None:
        while (item := self._jobs.get()) is not None:
            job, wr_id = item
            with self._lock:
                if self.dead:
                    self.on_done(Completion(wr_id, False, self.dead))
                    continue
                self._open.append(wr_id)
            try:
                self.run_job(self, job)
                self.send(frame(END, wr_id))
            except Exception as e:  # a wire error, or a failed copy: the batch fails, named
                self.fail(f"send failed: {e}")

    def _acks(self) -> None:
        reader = cast(Reader, self.sock.makefile("rb", buffering=0))
        header = bytearray(FRAME.size)
        try:
            while True:
                read_exact(reader, memoryview(header))
                kind, *_, value = FRAME.unpack(header)
                with self._lock:
                    if kind != ACK or not self._open or self._open[0] != value:
                        raise TransportError(f"unexpected frame {kind} for batch {value}")
                    self._open.popleft()
                self.on_done(Completion(value, True))
        except (OSError, ConnectionError, TransportError) as e:
            self.fail(f"connection lost: {e}")

    def fail(self, reason: str) -> None:
        """Mark the peer dead; fail every open batch (later ones fail as the worker meets them)."""
        with self._lock:
            if not self.dead:
                self.dead = f"{self.label}: {reason}"
            failed, self._open = list(self._open), collections.deque()
        for wr_id in failed:
            self.on_done(Completion(wr_id, False, self.dead))

    def close(self) -> None:
        self._jobs.put(None)
        self.fail("transport closed")
        _shut(self.sock)
        for t in self._threads:
            if t is not threading.current_thread():
                t.join(timeout=5)


class SocketWire(Transport):
    """What the tcp and cuda wires share: a receiving Server (it applies or notes what peers
    send and collects immediates), one sending Link per peer, and completions gathered from
    the links' threads. Subclasses register memory and post."""

    def __init__(self, endpoint: str, host: str, port: int, regions: dict[int, Any]) -> None:
        self.endpoint = endpoint or f"{socket.gethostname()}:{os.getpid()}"
        self._server = Server(host, port, regions)
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
        return {"wire": self.name, "host": host, "port": port, "endpoint": self.endpoint}

    def wake_fd(self) -> int | None:
        return self._server.wake_fd

    def poll(self) -> Polled:
        with self._lock:
            done, self._completions = self._completions, []
        return Polled(done, self._server.take_immediates())

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for link in self._links.values():
            link.close()
        self._server.close()
