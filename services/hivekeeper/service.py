"""The HTTP face every long-running service has: /metrics, /healthz (liveness),
/readyz (readiness) and /status (JSON state for `hivekeeper status` and the runner)."""

from __future__ import annotations

import json
import logging
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Callable

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

log = logging.getLogger(__name__)


class ServiceEndpoint:
    def __init__(
        self,
        registry: CollectorRegistry,
        host: str,
        port: int,
        status: Callable[[], dict[str, Any]] = dict,
    ):
        self.registry = registry
        self.status = status
        self.ready = threading.Event()
        self.alive = True
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="http", daemon=True)

    @property
    def port(self) -> int:
        return self._server.server_address[1]

    def start(self) -> "ServiceEndpoint":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        endpoint = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    self._reply(200, generate_latest(endpoint.registry), CONTENT_TYPE_LATEST)
                elif path == "/healthz":
                    self._reply(200 if endpoint.alive else 503, b"ok\n" if endpoint.alive else b"dead\n")
                elif path == "/readyz":
                    ready = endpoint.ready.is_set()
                    self._reply(200 if ready else 503, b"ready\n" if ready else b"not ready\n")
                elif path == "/status":
                    try:
                        body = json.dumps(endpoint.status(), default=str).encode()
                    except Exception as e:  # a status bug must not kill the service
                        log.exception("status handler failed")
                        self._reply(500, json.dumps({"error": repr(e)}).encode(), "application/json")
                    else:
                        self._reply(200, body, "application/json")
                else:
                    self._reply(404, b"not found\n")

            def _reply(self, code: int, body: bytes, content_type: str = "text/plain; charset=utf-8") -> None:
                try:
                    self.send_response(code)
                    self.send_header("Content-Type", content_type)
                    self.send_header("Content-Length", str(len(body)))
                    self.end_headers()
                    self.wfile.write(body)
                except (BrokenPipeError, ConnectionResetError):
                    pass  # the caller gave up waiting (a poll with a short timeout on a busy process)

            def log_message(self, *args: Any) -> None:  # scrapes every few seconds: keep logs quiet
                pass

        return Handler
