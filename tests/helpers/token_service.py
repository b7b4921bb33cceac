"""A real token service (hivekeeper.auth.gateway) in a process of its own, for tests whose
process forks hivemind peers.

A process that serves gRPC must not fork: its server threads are inside gRPC at any moment, so
gRPC skips its fork handlers and the child inherits locks held mid-call (a forked DHT then
aborts in abseil's mutex, and the test waits for it forever). In production the token service
is a role of its own (`hivekeeper run auth`) and never forks; here it runs in a process started
by spawn, which forks nothing either."""

from __future__ import annotations

import multiprocessing as mp
from contextlib import contextmanager
from typing import Any, Iterator

from hivemind.utils.crypto import RSAPrivateKey


def _serve(key: RSAPrivateKey, identities: list[str], info: dict[str, Any], port: Any, stop: Any) -> None:
    from hivekeeper.auth.gateway import Allowlist, TokenService, serve_gateway

    server = serve_gateway(TokenService(key, Allowlist(identities), lambda: info))
    port.put(server.port)
    stop.wait()
    server.stop(grace=0)


@contextmanager
def token_service(key: RSAPrivateKey, identities: list[str], info: dict[str, Any],
                  timeout: float = 60.0) -> Iterator[str]:
    """Serves Join for `key`'s swarm to the allowlisted `identities`; yields its HOST:PORT."""
    spawn = mp.get_context("spawn")
    port, stop = spawn.Queue(), spawn.Event()
    process = spawn.Process(target=_serve, args=(key, identities, info, port, stop), daemon=True,
                            name="token-service")
    process.start()
    try:
        yield f"127.0.0.1:{port.get(timeout=timeout)}"
    finally:
        stop.set()
        process.join(10)
        if process.is_alive():
            process.kill()
            process.join()
