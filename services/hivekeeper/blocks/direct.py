"""The direct path: block calls over gRPC to a server's own port, for clients that can reach it.

Through p2pd, every call crosses four processes (client, its daemon, the server's daemon, the
server) and opens a libp2p stream; on loopback that alone costs a one-token inference step about
2.7 ms. A server therefore also listens on a TCP port of its own and announces it in its DHT
record (`ServerInfo.direct`, protocol 1.1). A client that reaches that port calls it over one
persistent HTTP/2 connection (gRPC, which hivekeeper already depends on); a client that cannot
(NAT, a firewall, an address from another network) goes through p2pd as before: p2pd stays
what reaches peers behind NAT and relays.

The same messages (ExpertRequest, ExpertResponse) go to the same handler
(`BlockServicer.handle`, on the compute thread) whichever way they come: one gRPC method per
kind of call, `/hivekeeper.blocks.Direct/{info,forward,backward,inference,close}`, and `hello`,
which answers the server's peer ID. The client checks it: an address a server announced may
belong to another process by now (a restarted server, a reused port).

Falling back: the first call to a server connects and says hello within CONNECT_TIMEOUT; if
that fails, or names another peer, the client notes the address unreachable for
UNREACHABLE_SECONDS and calls through p2pd. A call that fails on a connection that did say hello
is a failure of that server, as a failure through p2pd is (the client fails over); it is not
retried through p2pd, since an inference step may have run before the connection broke, and a
second run would advance the session twice.

Security: admission by token (hivemind_ext.admission) identifies a caller by the libp2p peer ID
its connection authenticated, and libp2p encrypts that connection; a plain TCP connection
has neither. So the direct path exists only where admission is off: a server whose process
installed the admission gate opens no direct port and announces none, and a client whose
process installed it never uses one, even if offered. A resource without volunteers trusts
whatever reaches its pods (docs/security.md); its block calls then travel unencrypted between
peers that reach each other directly."""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Optional

log = logging.getLogger("hivekeeper.blocks.direct")
SERVICE = "hivekeeper.blocks.Direct"
KINDS = ("info", "forward", "backward", "inference", "close")
CONNECT_TIMEOUT = 1.0  # seconds for the first hello; past it, p2pd
UNREACHABLE_SECONDS = 60.0  # how long an address that failed its hello is left alone
MAX_MESSAGE_BYTES = 1 << 27
_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
            ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES)]
_CLIENT_OPTIONS = _OPTIONS + [("grpc.enable_http_proxy", 0)]  # never through an HTTP proxy from the environment


def admission_on() -> bool:
    """Whether this process admits peers by token (then the direct path is off, both ways)."""
    from hivekeeper.hivemind_ext.admission import installed_gate

    return installed_gate() is not None


def address(host: str, port: int) -> str:
    """host:port as gRPC dials it ([v6]:port)."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class DirectServer:
    """gRPC on `host:port` (0: any free port) serving `handle(kind, request_bytes) -> response
    bytes` for each kind, and `hello` with this server's peer ID. Handlers run on gRPC's
    threads; `handle` decides where the work happens (the server hands it to its compute thread)."""

    def __init__(self, peer_id: str, handle: Callable[[str, bytes], bytes], host: str, port: int = 0,
                 threads: int = 16):
        import grpc

        def unary(kind: str):
            return grpc.unary_unary_rpc_method_handler(lambda request, context: handle(kind, request))

        handlers = {kind: unary(kind) for kind in KINDS}
        hello = peer_id.encode()
        handlers["hello"] = grpc.unary_unary_rpc_method_handler(lambda request, context: hello)
        self._server = grpc.server(ThreadPoolExecutor(threads, thread_name_prefix="direct"),
                                   options=_OPTIONS + [("grpc.so_reuseport", 0)])
        self._server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        self.port = self._server.add_insecure_port(address(host, port))
        if not self.port:
            raise OSError(f"direct path: cannot listen on {address(host, port)}")
        self._server.start()

    def stop(self, grace: float = 1.0) -> None:
        self._server.stop(grace).wait(grace + 1.0)


class DirectCallError(Exception):
    """A call over an established direct connection failed (the server, not the path)."""


class _Connection:
    def __init__(self, target: str, channel) -> None:
        self.target = target
        self.channel = channel
        self.methods = {kind: channel.unary_unary(f"/{SERVICE}/{kind}") for kind in KINDS}


class DirectClient:
    """One gRPC channel per server that answered hello; addresses that did not, left alone for a while."""

    def __init__(self, connect_timeout: float = CONNECT_TIMEOUT, unreachable_seconds: float = UNREACHABLE_SECONDS):
        self.connect_timeout = connect_timeout
        self.unreachable_seconds = unreachable_seconds
        self._connections: dict[str, _Connection] = {}  # peer ID -> its connection
        self._unreachable: dict[tuple[str, str], float] = {}  # (peer ID, target) -> until
        self._lock = threading.Lock()
        self._connecting: dict[str, threading.Lock] = {}

    def call(self, peer_id: str, target: str, kind: str, request: bytes, timeout: float) -> Optional[bytes]:
        """The reply's bytes; None if `target` does not reach `peer_id` (use p2pd);
        DirectCallError if the server failed the call."""
        import grpc

        connection = self._connection(peer_id, target)
        if connection is None:
            return None
        try:
            return connection.methods[kind](request, timeout=timeout)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:  # its connection is gone: say hello again next time
                self._drop(peer_id, connection)
            raise DirectCallError(_explain(e)) from None

    def reachable(self, peer_id: str, target: str) -> bool:
        with self._lock:
            return self._unreachable.get((peer_id, target), 0.0) <= time.monotonic()

    def _connection(self, peer_id: str, target: str) -> Optional[_Connection]:
        with self._lock:
            connection = self._connections.get(peer_id)
            if connection is not None and connection.target == target:
                return connection
            if self._unreachable.get((peer_id, target), 0.0) > time.monotonic():
                return None
            connecting = self._connecting.setdefault(peer_id, threading.Lock())
        with connecting:  # one hello per server at a time (a batch's parts call from several threads)
            with self._lock:
                connection = self._connections.get(peer_id)
                if connection is not None and connection.target == target:
                    return connection
            connection = self._hello(peer_id, target)
            with self._lock:
                if connection is None:
                    self._unreachable[(peer_id, target)] = time.monotonic() + self.unreachable_seconds
                    return None
                old = self._connections.get(peer_id)
                self._connections[peer_id] = connection
            if old is not None:
                old.channel.close()
            return connection

    def _hello(self, peer_id: str, target: str) -> Optional[_Connection]:
        import grpc

        channel = grpc.insecure_channel(target, options=_CLIENT_OPTIONS)
        try:
            answer = channel.unary_unary(f"/{SERVICE}/hello")(b"", timeout=self.connect_timeout)
        except grpc.RpcError as e:
            channel.close()
            log.info("direct path unreachable; calling through p2pd",
                     extra={"fields": {"peer_id": peer_id, "target": target, "why": _explain(e)}})
            return None
        if answer != peer_id.encode():
            channel.close()
            log.info("direct path leads to another peer; calling through p2pd",
                     extra={"fields": {"peer_id": peer_id, "target": target, "answered": answer[:60].decode(errors="replace")}})
            return None
        return _Connection(target, channel)

    def _drop(self, peer_id: str, connection: _Connection) -> None:
        with self._lock:
            if self._connections.get(peer_id) is connection:
                del self._connections[peer_id]
        connection.channel.close()

    def close(self) -> None:
        with self._lock:
            connections, self._connections = list(self._connections.values()), {}
        for connection in connections:
            connection.channel.close()


def _explain(error) -> str:
    import grpc

    code = error.code() if isinstance(error, grpc.RpcError) else None
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return "timed out"
    details = error.details() if isinstance(error, grpc.RpcError) else str(error)
    return f"{getattr(code, 'name', 'error').lower()}: {(details or '').splitlines()[0][:200] if details else ''}".rstrip(": ")
