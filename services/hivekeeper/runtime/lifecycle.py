"""How every role starts and stops: structured logs, SIGTERM/SIGINT ending the main loop (the
role then shuts its DHT and p2pd down), and its context loaded from the manifest."""

from __future__ import annotations

import argparse
import json
import logging
import os
import signal
import sys
import threading
from typing import Any, Optional, TypeVar

from hivekeeper.runtime.context import RoleContext
from hivekeeper.spec import load_manifest

SpecT = TypeVar("SpecT")


def setup_logging(role: str, index: int) -> logging.Logger:
    """Structured logs: one JSON object a line on stderr."""

    class JsonFormatter(logging.Formatter):
        def format(self, record: logging.LogRecord) -> str:
            entry = {
                "ts": round(record.created, 3),
                "level": record.levelname.lower(),
                "role": role,
                "index": index,
                "msg": record.getMessage(),
            }
            extra = getattr(record, "fields", None)
            if extra:
                entry.update(extra)
            if record.exc_info:
                entry["exc"] = self.formatException(record.exc_info)
            return json.dumps(entry, default=str)

    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter())
    logger = logging.getLogger("hivekeeper")
    logger.handlers[:] = [handler]
    logger.setLevel(logging.INFO)
    logger.propagate = False
    # hivemind logs every matchmaking retry at INFO; keep its warnings and errors
    logging.getLogger("hivemind").setLevel(logging.WARNING)
    return logger


def install_signal_handlers(stop: threading.Event) -> None:
    """SIGTERM and SIGINT end the main loop; a second one exits at once (the user insists)."""

    def _handler(signum: int, _frame: Any) -> None:
        if stop.is_set():
            os._exit(128 + signum)
        stop.set()

    signal.signal(signal.SIGTERM, _handler)
    signal.signal(signal.SIGINT, _handler)


def load_context(role: str, args: argparse.Namespace, spec_type: Optional[type[SpecT]], metrics: Any, *,
                 signals: bool = True, report_ttl: Optional[float] = None) -> RoleContext[SpecT]:
    """The role's context, after logging is set up; `spec_type` None accepts any kind (a relay,
    the token service). `signals=False` leaves SIGTERM/SIGINT to the caller (a role that forks
    workers first, so that they keep the default handlers)."""
    setup_logging(role, args.index)
    manifest = load_manifest(args.manifest)
    if spec_type is not None and not isinstance(manifest.spec, spec_type):
        raise SystemExit(f"{args.manifest}: role {role} needs a {spec_type.__name__.removesuffix('Spec')} "
                         f"manifest, got a {manifest.kind}")
    ctx: RoleContext[SpecT] = RoleContext(role=role, args=args, manifest=manifest, metrics=metrics)
    if report_ttl is not None:
        ctx.report_ttl = report_ttl
    if signals:
        install_signal_handlers(ctx.stop)
    return ctx
