"""The direct path: block calls over a TCP connection of their own to a server's port, for
clients that can reach it.

Through p2pd, every call crosses four processes (client, its daemon, the server's daemon, the
server) and opens a libp2p stream: on loopback that costs a one-token inference step about
2.7 ms. A server therefore also listens on a TCP port of its own and announces it in its DHT
record (`ServerInfo.direct`, protocol 1.1). A client that reaches that port keeps a connection
to it and sends each call as one frame; a client that cannot (NAT, a firewall, an address of
another network) goes through p2pd, which is what reaches peers behind NAT and relays.

Why frames on a plain socket, not gRPC: on a 2-core machine, a one-token round trip with the
server's compute handed to its compute thread (bench/bench_transport.py) costs about ten
times less than a gRPC unary call or stream on one kept HTTP/2 connection, and gRPC's share
grows after a real step's compute has pushed the code paths out of the caches (about 1.7 ms
per hop through gRPC, measured with bench_petals). The protocol needs none of gRPC's features:
one call at a time per connection, a client-side timeout, messages that are already protobuf.

The wire: on connect the server sends a frame holding MAGIC and its peer ID, which the client
checks (an address a server announced may belong to another process by now: a restarted
server, a reused port). Then the client sends requests, each a header (body length, the kind
of call: an index into KINDS) and an ExpertRequest; the server answers each with a frame
holding an ExpertResponse. A frame is a 4-byte big-endian length and its body. The same
messages go to the same handler (`BlockServicer.handle`, under its compute lock) whichever way
they come. A connection serves one call at a time; a client calling a server from several
threads at once (a batch's parts) opens more connections to it.

Falling back: a client's first call to a server connects and waits for the hello within
CONNECT_TIMEOUT; if that fails, or the hello names another peer, the client leaves that
address alone for UNREACHABLE_SECONDS and calls through p2pd. A call that fails on a
connection that did say hello is a failure of that server, as a failure through p2pd is (the
client fails over); it is not retried through p2pd, since an inference step may have run
before the connection broke, and a second run would advance the session twice.

Security: admission by token (hivemind_ext.admission) identifies a caller by the libp2p peer ID
its connection authenticated, and libp2p encrypts that connection; a plain TCP connection
has neither. So the direct path exists only where admission is off: a server whose process
installed the admission gate opens no direct port and announces none, and a client whose
process installed it never uses one, even if offered. A resource without volunteers trusts
whatever reaches its pods (docs/security.md); its block calls then travel unencrypted between
peers that reach each other directly."""

from __future__ import annotations

import logging
import socket
import struct
import threading
import time
from typing import Callable, Optional

log = logging.getLogger("hivekeeper.blocks.direct")
KINDS = ("info", "forward", "backward", "inference", "close")
CONNECT_TIMEOUT = 1.0  # seconds for the connection and its hello; past it, p2pd
UNREACHABLE_SECONDS = 60.0  # how long an address that failed its hello is left alone
MAX_MESSAGE_BYTES = 1 << 27  # a frame announcing more ends its connection
MAX_CONNECTIONS = 256  # a server's open direct connections (each has a thread)
MAGIC = b"hivekeeper-blocks-direct/1\n"
_REQUEST = struct.Struct("!IB")  # body length, kind
_REPLY = struct.Struct("!I")  # body length


def admission_on() -> bool:
    """Whether this process admits peers by token (then the direct path is off, both ways)."""
    from hivekeeper.hivemind_ext.admission import installed_gate

    return installed_gate() is not None


def address(host: str, port: int) -> str:
    """host:port as announced ([v6]:port)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _split(target: str) -> tuple[str, int]:
    host, _, port = target.rpartition(":")
    return host.strip("[]"), int(port)


def _frame(body: bytes, header: bytes) -> bytes | list[bytes]:
    """Header and body in one send when small (one segment), else two (no copy of a large body)."""
    return header + body if len(body) < 65536 else [header, body]


def _send(sock: socket.socket, data: bytes | list[bytes]) -> None:
    for part in ([data] if isinstance(data, bytes) else data):
        sock.sendall(part)


class DirectServer:
    """Listens on `host:port` (0: any free port); a thread per connection reads requests and
    answers `handle(kind, request bytes) -> reply bytes` on that thread (the block server's
    handler takes its compute lock: one call computes at a time)."""

    def __init__(self, peer_id: str, handle: Callable[[str, bytes], bytes], host: str, port: int = 0):
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.create_server((host, port), family=family, backlog=128)
        self.port = self._listener.getsockname()[1]
        self._handle = handle
        hello = MAGIC + peer_id.encode()
        self._hello = _REPLY.pack(len(hello)) + hello
        self._connections: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._stopped = False
        threading.Thread(target=self._accept, name="direct-accept", daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                connection, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._stopped or len(self._connections) >= MAX_CONNECTIONS:
                    connection.close()
                    continue
                self._connections.add(connection)
            threading.Thread(target=self._serve, args=(connection,), name="direct", daemon=True).start()

    def _serve(self, connection: socket.socket) -> None:
        reader = None
        try:
            connection.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection.sendall(self._hello)
            reader = connection.makefile("rb")
            while True:
                header = reader.read(_REQUEST.size)
                if len(header) < _REQUEST.size:
                    return
                length, kind = _REQUEST.unpack(header)
                if length > MAX_MESSAGE_BYTES or kind >= len(KINDS):
                    return
                body = reader.read(length)
                if len(body) < length:
                    return
                reply = self._handle(KINDS[kind], body)
                _send(connection, _frame(reply, _REPLY.pack(len(reply))))
        except OSError:
            pass
        finally:
            with self._lock:
                self._connections.discard(connection)
            if reader is not None:
                reader.close()
            connection.close()

    def stop(self, grace: float = 1.0) -> None:
        with self._lock:
            self._stopped = True
            connections = list(self._connections)
        for sock in [self._listener, *connections]:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            sock.close()


class DirectCallError(Exception):
    """A call over a connection that said hello failed (the server, not the path)."""


class _Connection:
    def __init__(self, target: str, sock: socket.socket):
        self.target = target
        self.sock = sock
        self.reader = sock.makefile("rb")

    def read_frame(self) -> bytes:
        header = self.reader.read(_REPLY.size)
        if len(header) < _REPLY.size:
            raise ConnectionError("connection closed")
        (length,) = _REPLY.unpack(header)
        if length > MAX_MESSAGE_BYTES:
            raise ConnectionError(f"reply of {length} bytes")
        body = self.reader.read(length)
        if len(body) < length:
            raise ConnectionError("connection closed")
        return body

    def call(self, kind: str, request: bytes, timeout: float) -> bytes:
        self.sock.settimeout(timeout)
        _send(self.sock, _frame(request, _REQUEST.pack(len(request), KINDS.index(kind))))
        return self.read_frame()

    def close(self) -> None:
        try:
            self.reader.close()
            self.sock.close()
        except OSError:
            pass


class DirectClient:
    """Idle connections per server that said hello; addresses that did not, left alone for a while."""

    def __init__(self, connect_timeout: float = CONNECT_TIMEOUT, unreachable_seconds: float = UNREACHABLE_SECONDS):
        self.connect_timeout = connect_timeout
        self.unreachable_seconds = unreachable_seconds
        self._idle: dict[str, list[_Connection]] = {}
        self._unreachable: dict[tuple[str, str], float] = {}
        self._lock = threading.Lock()

    def call(self, peer_id: str, target: str, kind: str, request: bytes, timeout: float) -> Optional[bytes]:
        """The reply's bytes; None if `target` does not reach `peer_id` (use p2pd);
        DirectCallError if the server failed the call."""
        connection = self._take(peer_id, target)
        if connection is None:
            return None
        try:
            reply = connection.call(kind, request, timeout)
        except (OSError, ValueError) as e:
            connection.close()
            raise DirectCallError("timed out" if isinstance(e, TimeoutError) else f"{type(e).__name__}: {e}") from None
        with self._lock:
            self._idle.setdefault(peer_id, []).append(connection)
        return reply

    def reachable(self, peer_id: str, target: str) -> bool:
        with self._lock:
            return self._unreachable.get((peer_id, target), 0.0) <= time.monotonic()

    def _take(self, peer_id: str, target: str) -> Optional[_Connection]:
        with self._lock:
            idle = self._idle.get(peer_id, [])
            while idle:
                connection = idle.pop()
                if connection.target == target:
                    return connection
                connection.close()
            if self._unreachable.get((peer_id, target), 0.0) > time.monotonic():
                return None
        connection = self._hello(peer_id, target)
        if connection is None:
            with self._lock:
                self._unreachable[(peer_id, target)] = time.monotonic() + self.unreachable_seconds
        return connection

    def _hello(self, peer_id: str, target: str) -> Optional[_Connection]:
        sock = None
        try:
            sock = socket.create_connection(_split(target), timeout=self.connect_timeout)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            connection = _Connection(target, sock)
            answer = connection.read_frame()
        except (OSError, ValueError) as e:
            if sock is not None:
                sock.close()
            log.info("direct path unreachable; calling through p2pd",
                     extra={"fields": {"peer_id": peer_id, "target": target, "why": f"{type(e).__name__}: {e}"}})
            return None
        if answer != MAGIC + peer_id.encode():
            connection.close()
            log.info("direct path leads to another peer; calling through p2pd",
                     extra={"fields": {"peer_id": peer_id, "target": target, "answered": answer[:80].decode(errors="replace")}})
            return None
        return connection

    def close(self) -> None:
        with self._lock:
            connections = [c for idle in self._idle.values() for c in idle]
            self._idle = {}
        for connection in connections:
            connection.close()
