"""Every RPC a peer serves admits only callers that hold a valid token for the swarm.

hivemind checks tokens in the DHT protocol only (`DHT(authorizer=...)`); averaging, state
downloads, bandwidth probes, block and expert calls are served to any peer that dials. Here, in
a process where `install` ran (and every process it forks after: the DHT, the averagers, the
expert connection handlers), each handler registered on a `P2P` first checks that the caller's
peer ID is admitted, and each call to another peer first gets this peer admitted there.

Admission binds a token to a libp2p identity. The caller sends its access token (signed by the
swarm's key, naming the caller's RSA key) and its signature, with that RSA key, over its own
libp2p peer ID. The callee checks both against the peer ID that the libp2p handshake
authenticated, so a stranger holding someone else's token cannot use it: it cannot sign for its
own peer ID with the token's key. The peer ID stays admitted until the token expires, so a
revoked identity (no renewal from the token service) loses access within one token lifetime.

One peer's processes share one p2pd and so one peer ID, and any of them may serve a request:
the admitted peer IDs live in a directory all of them read (a file per peer ID holding the
expiry), and refusals are counted in shared memory and exported by the installing process.

Left open on purpose (OPEN_HANDLER_PREFIXES): DHT requests, which the authorizer already checks
one by one, the reachability check, and the admission handler itself. A peer that serves no
admission handler (one that does not check tokens) is called without it."""

from __future__ import annotations

import asyncio
import atexit
import base64
import json
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from pathlib import Path
from typing import Any, Awaitable, Callable, Optional, Protocol

from hivemind.p2p import P2P, P2PContext, P2PDaemonError, P2PHandlerError, PeerID
from hivemind.proto.auth_pb2 import AccessToken
from hivemind.proto.p2pd_pb2 import RPCError
from hivemind.utils.crypto import RSAPrivateKey, RSAPublicKey

from hivekeeper.auth.tokens import signed_bytes, token_expiry, verify_access_token
from hivekeeper.hivemind_ext import check_hivemind_version
from hivekeeper.hivemind_ext.streams import hang_up_after_caller

check_hivemind_version(__name__)

__all__ = ["ADMIT_HANDLER", "AdmissionRefused", "Credentials", "install", "installed_gate"]
log = logging.getLogger("hivekeeper.admission")

ADMIT_HANDLER = "hivekeeper.Admission/admit"
REFUSED = "hivekeeper admission refused"  # starts every refusal's message, so a caller can tell it apart
# Open to anyone: DHT requests each carry a token the authorizer checks, and the dial-back check
# (volunteer.reachability) is asked by a joining peer's throwaway daemons before it has a peer ID
# worth admitting; it dials back only the caller itself, a few at a time.
OPEN_HANDLER_PREFIXES = ("DHTProtocol.", "hivekeeper.reachability.")
RECHECK_SECONDS = 60.0  # a caller admits again this often, in case the callee restarted and forgot it
TABLE_PREFIX = "hivekeeper-admitted-"  # then the installer's pid: a table whose installer is gone is removed
DISCARD_SECONDS = 2.0  # how long a refused caller may take to hang up
REASONS = ("not_admitted", "malformed", "bad_signature", "expired", "bad_proof")
_ADMIT_DOMAIN = b"hivekeeper-admit-v1\x00"


class Credentials(Protocol):
    """What admission needs from this peer's authorizer (auth.authorizer.SwarmAuthorizer)."""

    @property
    def swarm_public_key(self) -> Optional[RSAPublicKey]: ...

    @property
    def private_key(self) -> RSAPrivateKey: ...

    async def get_token(self) -> AccessToken: ...


class AdmissionRefused(P2PHandlerError):
    """A peer refused this one's token (or its proof), or served nothing to a peer it had not admitted."""


def admit_message(token: AccessToken, private_key: RSAPrivateKey, caller: PeerID) -> bytes:
    signature = private_key.sign(signed_bytes(_ADMIT_DOMAIN, caller.to_bytes()))
    return json.dumps({"token": base64.b64encode(token.SerializeToString()).decode(),
                       "signature": signature.decode()}).encode()


def check_admit_message(data: bytes, caller: PeerID, swarm_key: RSAPublicKey) -> float:
    """The caller's token expiry if `data` admits `caller`; else AdmissionRefused naming the reason."""
    try:
        message = json.loads(data)
        token = AccessToken.FromString(base64.b64decode(message["token"], validate=True))
        signature = message["signature"].encode()
    except Exception as e:  # noqa: BLE001 (anything a stranger sends: JSON, base64, protobuf, types)
        raise _refusal("malformed", f"not an admission request ({type(e).__name__})") from None
    check = verify_access_token(token, swarm_key)
    if not check:
        raise _refusal(check.reason, f"the token does not check out ({check.reason})")
    try:
        proven = RSAPublicKey.from_bytes(token.public_key).verify(
            signed_bytes(_ADMIT_DOMAIN, caller.to_bytes()), signature)
    except Exception:  # noqa: BLE001 (a key or signature that does not parse)
        proven = False
    if not proven:
        raise _refusal("bad_proof", "the token's key did not sign the caller's peer ID")
    return token_expiry(token)


def _refusal(reason: str, detail: str) -> AdmissionRefused:
    error = AdmissionRefused(f"{REFUSED} ({reason}): {detail}")
    error.reason = reason  # type: ignore[attr-defined]
    return error


class AdmittedPeers:
    """Admitted peer IDs and their expiries, shared by one peer's processes through a directory
    (a file per peer ID, replaced atomically), each process caching what it read."""

    def __init__(self, directory: Path):
        self.directory = directory
        self._cache: dict[str, float] = {}

    def add(self, peer: PeerID, expires_at: float) -> None:
        name = peer.to_base58()
        tmp = self.directory / f".{name}.{os.getpid()}"
        tmp.write_text(repr(expires_at))
        os.replace(tmp, self.directory / name)
        self._cache[name] = expires_at

    def __contains__(self, peer: PeerID) -> bool:
        name, now = peer.to_base58(), time.time()
        if self._cache.get(name, 0.0) > now:
            return True
        try:
            self._cache[name] = float((self.directory / name).read_text())
        except (FileNotFoundError, ValueError):
            return False
        return self._cache[name] > now


class RefusalCounts:
    """Refusals by reason, in shared memory (a forked process counts into the installer's), and
    a Prometheus collector for them: hivekeeper_rpc_refused_total{reason}."""

    def __init__(self) -> None:
        self._values = {reason: mp.Value("q", 0) for reason in REASONS}

    def count(self, reason: str) -> None:
        value = self._values[reason]
        with value.get_lock():
            value.value += 1

    def snapshot(self) -> dict[str, int]:
        return {reason: value.value for reason, value in self._values.items()}

    def collect(self):
        from prometheus_client.core import CounterMetricFamily

        family = CounterMetricFamily("hivekeeper_rpc_refused", "RPCs refused to callers without admission, by reason",
                                     labels=["reason"])
        for reason, count in self.snapshot().items():
            family.add_metric([reason], count)
        yield family


class Gate:
    """The serving half (checks callers) and the calling half (gets this peer admitted)."""

    def __init__(self, credentials: Credentials, directory: Path, registry: Any = None):
        self.credentials = credentials
        self.admitted = AdmittedPeers(directory)
        self.installer_pid = os.getpid()
        self.refusals = RefusalCounts()
        self._served_daemons: set[str] = set()
        self._admitted_at: dict[tuple[str, str], tuple[float, bytes]] = {}  # (us, them) -> (until, token)
        if registry is not None:
            registry.register(self.refusals)

    # --- serving -----------------------------------------------------------------------------

    def refuse(self, reason: str) -> None:
        self.refusals.count(reason)

    def admits(self, local: PeerID, remote: PeerID) -> bool:
        return remote == local or remote in self.admitted

    async def serve_admission(self, p2p: P2P) -> None:
        """Register the admission handler on this peer's daemon, once (the first process to serve
        anything does it; the others' calls land there too, and the table is shared)."""
        daemon = str(p2p.daemon_listen_maddr)
        if daemon in self._served_daemons:
            return
        self._served_daemons.add(daemon)

        async def admit(data: bytes, remote_id: PeerID) -> bytes:
            swarm_key = self.credentials.swarm_public_key
            try:
                if swarm_key is None:
                    raise _refusal("not_admitted", "this peer has no swarm key yet")
                expires_at = check_admit_message(data, remote_id, swarm_key)
            except AdmissionRefused as e:
                self.refuse(getattr(e, "reason", "malformed"))
                log.info("admission refused", extra={"fields": {"peer": str(remote_id), "why": str(e)}})
                raise
            self.admitted.add(remote_id, expires_at)
            return json.dumps({"expires": expires_at}).encode()

        try:
            await p2p._client.add_unary_handler(ADMIT_HANDLER, admit, balanced=True)
        except Exception:  # another process of this peer registered it with other options
            log.debug("admission handler already served on this daemon", exc_info=True)

    def gate_stream(self, p2p: P2P, name: str,
                    handler: Callable[..., Awaitable[None]]) -> Callable[..., Awaitable[None]]:
        async def gated(stream_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            if self.admits(p2p.peer_id, stream_info.peer_id):
                return await handler(stream_info, reader, writer)
            self.refuse("not_admitted")
            try:  # tell it why, in the form protobuf callers decode
                await P2P.send_protobuf(RPCError(message=_not_admitted(name)), writer)
            except Exception:  # noqa: BLE001 (it may be gone already)
                pass
            await hang_up_after_caller(reader, writer, DISCARD_SECONDS)  # or it may lose the refusal

        return gated

    def gate_unary(self, name: str, handler: Callable[[Any, P2PContext], Awaitable[Any]]):
        async def gated(request: Any, context: P2PContext) -> Any:
            if self.admits(context.local_id, context.remote_id):
                return await handler(request, context)
            self.refuse("not_admitted")
            raise AdmissionRefused(_not_admitted(name))

        return gated

    # --- calling -----------------------------------------------------------------------------

    async def ensure_admitted(self, p2p: P2P, peer: PeerID) -> None:
        """Present this peer's token to `peer`, unless done recently with the same token."""
        if peer == p2p.peer_id:
            return
        token = await self.credentials.get_token()
        key = (p2p.peer_id.to_base58(), peer.to_base58())
        until, presented = self._admitted_at.get(key, (0.0, b""))
        if until > time.time() and presented == token.signature:
            return
        message = admit_message(token, self.credentials.private_key, p2p.peer_id)
        try:
            reply = await p2p._client.call_unary_handler(peer, ADMIT_HANDLER, message)
            expires_at = float(json.loads(reply)["expires"])
        except (P2PHandlerError, P2PDaemonError) as e:
            if REFUSED in str(e):
                raise AdmissionRefused(f"{peer}: {e}") from None
            if "protocols not supported" not in str(e):  # a real failure (it would fail the call too)
                raise
            expires_at = time.time() + RECHECK_SECONDS  # a peer that checks no tokens
        now = time.time()
        self._admitted_at[key] = (now + min(RECHECK_SECONDS, max(expires_at - now, 0.0) / 2), token.signature)

    def forget(self, p2p: P2P, peer: PeerID) -> None:
        self._admitted_at.pop((p2p.peer_id.to_base58(), peer.to_base58()), None)


def _not_admitted(name: str) -> str:
    return f"{REFUSED} (not_admitted): {name} serves only peers admitted with a token for this swarm"


def _is_open(name: str) -> bool:
    return name == ADMIT_HANDLER or name.startswith(OPEN_HANDLER_PREFIXES)


_gate: Optional[Gate] = None


def installed_gate() -> Optional[Gate]:
    return _gate


def install(credentials: Credentials, registry: Any = None) -> Gate:
    """Check every RPC this process (and each process it forks from now on) serves, and get
    admitted before each call. Call before the DHT starts, so that its process has the gate too.
    Idempotent per process."""
    global _gate
    if _gate is not None and _gate.installer_pid == os.getpid():
        return _gate
    base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
    _remove_orphaned_tables(base)
    directory = Path(tempfile.mkdtemp(prefix=f"{TABLE_PREFIX}{os.getpid()}-", dir=base))
    _gate = Gate(credentials, directory, registry)
    atexit.register(_remove_table, directory, os.getpid())
    _patch_p2p()
    return _gate


def _remove_orphaned_tables(base: Path) -> None:
    """Tables of installers that died without exiting (killed): nothing removed them."""
    for table in base.glob(f"{TABLE_PREFIX}*-*"):
        pid = table.name[len(TABLE_PREFIX):].split("-", 1)[0]
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            shutil.rmtree(table, ignore_errors=True)


def _remove_table(directory: Path, owner: int) -> None:
    if os.getpid() == owner:  # forked processes exit without atexit, but be sure
        shutil.rmtree(directory, ignore_errors=True)


def _patch_p2p() -> None:
    if getattr(P2P, "_hivekeeper_admission", False):
        return
    add_stream, add_unary = P2P.add_binary_stream_handler, P2P._add_protobuf_unary_handler
    open_stream, call_unary = P2P.call_binary_stream_handler, P2P._call_unary_protobuf_handler

    async def add_binary_stream_handler(self: P2P, name: str, handler, balanced: bool = False) -> None:
        if _gate is not None and not _is_open(name):
            await _gate.serve_admission(self)
            handler = _gate.gate_stream(self, name, handler)
        await add_stream(self, name, handler, balanced=balanced)

    async def _add_protobuf_unary_handler(self: P2P, handle_name: str, handler, input_protobuf_type,
                                          balanced: bool = False) -> None:
        if _gate is not None and not _is_open(handle_name):
            await _gate.serve_admission(self)
            handler = _gate.gate_unary(handle_name, handler)
        await add_unary(self, handle_name, handler, input_protobuf_type, balanced=balanced)

    async def call_binary_stream_handler(self: P2P, peer_id: PeerID, handler_name: str):
        if _gate is not None and not _is_open(handler_name):
            await _gate.ensure_admitted(self, peer_id)
        return await open_stream(self, peer_id, handler_name)

    async def _call_unary_protobuf_handler(self: P2P, peer_id: PeerID, handle_name: str, input, output_type):
        if _gate is None or _is_open(handle_name):
            return await call_unary(self, peer_id, handle_name, input, output_type)
        await _gate.ensure_admitted(self, peer_id)
        try:
            return await call_unary(self, peer_id, handle_name, input, output_type)
        except P2PHandlerError as e:
            if REFUSED not in str(e):
                raise
            _gate.forget(self, peer_id)  # the callee restarted and forgot us: admit again, once
            await _gate.ensure_admitted(self, peer_id)
            return await call_unary(self, peer_id, handle_name, input, output_type)

    P2P.add_binary_stream_handler = add_binary_stream_handler
    P2P._add_protobuf_unary_handler = _add_protobuf_unary_handler
    P2P.call_binary_stream_handler = call_binary_stream_handler
    P2P._call_unary_protobuf_handler = _call_unary_protobuf_handler
    P2P._hivekeeper_admission = True
