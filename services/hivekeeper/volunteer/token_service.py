"""The token service role (`hivekeeper run auth`): with the relays, what lets volunteers in, for
any kind. It joins no DHT; it serves hivekeeper.Gateway/Join and gRPC health on --grpc-port, over
TLS with a certificate for the swarm's key made at start (clients pin it by the fingerprint in
their invite), and /metrics, /healthz, /readyz, /status on --metrics-port (plain HTTP: what the
pods' probes use). Ready once gRPC serves."""

from __future__ import annotations

import argparse
import json
import logging
from pathlib import Path
from typing import Any

from hivekeeper.auth.gateway import REFUSAL_REASONS, Allowlist, TokenService, serve_gateway
from hivekeeper.auth.keys import load_swarm_key
from hivekeeper.auth.labs import labs_of
from hivekeeper.auth.watched import WatchedFile
from hivekeeper.runtime.context import RoleContext
from hivekeeper.runtime.lifecycle import load_context
from hivekeeper.volunteer.metrics import AuthMetrics

log = logging.getLogger("hivekeeper.auth")


def run(args: argparse.Namespace) -> int:
    ctx = load_context("auth", args, None, AuthMetrics())  # any kind: it admits peers, whatever they run
    if not args.swarm_key or not Path(args.swarm_key).is_file():
        raise SystemExit(f"auth: --swarm-key must name the swarm's signing key file (got {args.swarm_key!r})")
    volunteers = ctx.spec.volunteers
    allowlist = Allowlist(volunteers.allowlist, args.allowlist_file, labs_of(volunteers.labs))
    service = TokenService(load_swarm_key(args.swarm_key), allowlist, swarm_info(ctx),
                           token_ttl=volunteers.token_ttl_seconds, **counters(ctx))
    ctx.start_endpoint()
    server = serve_gateway(service, args.host, args.grpc_port)
    address = f"{args.announce_host or args.host}:{server.port}"
    log.info("token service up", extra={"fields": {"gateway": address, "keyFingerprint": server.key_fingerprint}})
    ctx.status.update(gateway=address, keyFingerprint=server.key_fingerprint)
    ctx.endpoint.ready.set()
    try:
        while not ctx.stop.wait(2.0):
            ctx.status.update(allowlisted=len(allowlist.identities()), labPeers=service.quota.held())
    finally:
        ctx.endpoint.ready.clear()
        server.stop()
    return 0


def swarm_info(ctx: RoleContext) -> Any:
    """What joining peers are told (--swarm-info, re-read when the runner or operator updates it,
    say once a relay's public address is known); without the file, the swarm's name and kind."""
    fallback = {"kind": ctx.manifest.kind, "name": ctx.run_id}
    if not ctx.args.swarm_info:
        return lambda: fallback
    info = WatchedFile(ctx.args.swarm_info, _json_object, fallback)
    return lambda: info.value


def _json_object(text: str) -> dict[str, Any]:
    value = json.loads(text)
    if not isinstance(value, dict):
        raise ValueError("not a JSON object")
    return value


def counters(ctx: RoleContext) -> dict[str, Any]:
    issued, refusals = ctx.metrics.auth_tokens_issued, ctx.metrics.auth_refusals
    for kind in ("internal", "volunteer"):  # every series from the start, at 0
        issued.labels(kind)
    for reason in REFUSAL_REASONS:
        refusals.labels(reason)
    return {"on_issue": lambda identity, internal: issued.labels("internal" if internal else "volunteer").inc(),
            "on_refuse": lambda reason: refusals.labels(reason).inc()}
