"""What hivemind's P2P does not expose: p2pd's `-relayDiscovery=0` for a peer given trusted
relays, dialing back peers that reach this one through a relay, and dialing a peer the daemon
cannot find at the addresses it announces.

With discovery on (p2pd's default), autorelay takes relay candidates from a peer source and
waits for 4 of them, or for its 3-minute boot delay, before it reserves a slot anywhere; and it
would reserve at any DHT peer that runs a relay service, not only the swarm's relays. With
discovery off, p2pd configures the trusted relays as static relays and reserves at once
(under a second in our runs).

A peer behind a NAT that others reach through a relay's circuit dials each of them back
(`keep_direct_connections`): its NAT lets outbound connections through, and the circuit is cut
after 128 KiB each way (go-libp2p's own limit for relayed connections, which p2pd's relay flags
do not lift): too little for a block server whose clients send it hidden states for every token.
p2pd's CONNECT does nothing while any connection to the peer is open, so the circuit is closed
first, as soon as it shows up (its open streams with it: a client then retries).

A client whose call to a peer fails dials that peer at the addresses its report announces
(`Redialer`). p2pd finds a peer it never met through its own DHT, whose records hold the
addresses the peer listens on: a pod IP, which does not route from another lab's cluster. The
public address a peer announces (its node port, its LoadBalancer) reaches only those that dial it.

`DHT` starts its P2P daemon inside its own process through `P2P.create`, which takes no extra
daemon flags and no P2P subclass, so the flag goes in through `P2P._make_process_args`, patched
for the whole process (and the DHT processes it forks) when a caller asks for it. A role's p2pd
starts the same way through an exec wrapper that sets its parent-death signal
(`die_with_parent`, see hivekeeper.runtime.lifeline)."""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from typing import Any, Callable, Optional, Sequence

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from hivekeeper.hivemind_ext import check_hivemind_version

check_hivemind_version(__name__)

__all__ = ["use_static_relays", "keep_direct_connections", "die_with_parent", "dial", "Redialer", "running_loop", "WireMaddr"]
log = logging.getLogger("hivekeeper.p2pd")


def use_static_relays() -> None:
    """Make every P2P daemon this process (or a DHT process it forks) starts with autoRelay and
    trustedRelays use those relays only. Idempotent."""

    def change(kwargs: dict[str, Any]) -> None:
        if kwargs.get("autoRelay") and kwargs.get("trustedRelays"):
            kwargs["relayDiscovery"] = False

    _patch("static_relays", change)


STOPS_ITS_P2PD = "stops_its_p2pd"  # a thread attribute: see die_with_parent


def die_with_parent(prefix: Sequence[str]) -> None:
    """Start every p2pd this process (or a process it forks) starts from its main thread through
    `prefix`, an exec wrapper that sets its parent-death signal to SIGKILL and execs p2pd in the
    same process (hivemind stops it by that pid; `runtime.lifeline.exec_prefix`): a DHT process
    that dies, however it dies, takes its p2pd with it. The kernel sends the signal when the
    thread that started p2pd exits, so a p2pd started from another thread (one that may end
    before its process) starts as before, unless that thread is marked as stopping every p2pd it
    starts before it ends (its STOPS_ITS_P2PD attribute true, as `join`'s relay watchdog).
    Idempotent."""
    prefix = list(prefix)

    def wrap(proc_args: list[str]) -> list[str]:
        thread = threading.current_thread()
        if thread is threading.main_thread() or getattr(thread, STOPS_ITS_P2PD, False):
            return [*prefix, *proc_args]
        return proc_args

    _patch("parent_death", wrap=wrap)


def _patch(name: str, change: Optional[Callable[[dict[str, Any]], None]] = None,
           wrap: Optional[Callable[[list[str]], list[str]]] = None) -> None:
    """Wrap P2P._make_process_args with `change` to its flags and `wrap` of the command line it
    makes, once per name (the names applied ride on the wrapper, so that a reload of this module
    does not wrap twice)."""
    original = P2P._make_process_args
    applied = getattr(original, "hivekeeper_patches", frozenset())
    if name in applied:
        return

    def make_process_args(*args, **kwargs):
        if change is not None:
            change(kwargs)
        proc_args = original(*args, **kwargs)
        return wrap(proc_args) if wrap is not None else proc_args

    make_process_args.hivekeeper_patches = applied | {name}  # type: ignore[attr-defined]
    P2P._make_process_args = staticmethod(make_process_args)


async def dial(p2p: P2P, peer_id, maddrs: Sequence[Any] = ()) -> None:
    """Open a connection to `peer_id` (at `maddrs`, or where the daemon knows it): hivemind's P2P
    has no public connect; Petals' reachability check reaches into its client the same way."""
    await p2p._client.connect(peer_id, list(maddrs))


async def running_loop() -> asyncio.AbstractEventLoop:
    """The event loop this coroutine runs on (`RemoteExpertWorker.run_coroutine(running_loop())`:
    the loop of hivemind's client thread, where p2p calls run)."""
    return asyncio.get_running_loop()


class Redialer:
    """After a call to a peer fails, dials the peer at the addresses it announces (`addresses`:
    peer ID -> multiaddrs, the swarm's reports; a blocking read, run on a thread), at most once
    every `every` seconds a peer; the next calls go over that connection. `failed` may be called
    from any thread: the dial runs on `loop`, the one the p2p client runs on."""

    def __init__(self, p2p: P2P, loop: asyncio.AbstractEventLoop, addresses: Callable[[], dict[str, list[str]]],
                 every: float = 10.0, timeout: float = 10.0):
        self.p2p, self.loop, self.addresses = p2p, loop, addresses
        self.every, self.timeout = every, timeout
        self._last: dict[str, float] = {}
        self._lock = threading.Lock()

    def failed(self, peer_id) -> None:
        key, now = str(peer_id), time.monotonic()
        with self._lock:
            if now - self._last.get(key, -self.every) < self.every:
                return
            self._last[key] = now
        asyncio.run_coroutine_threadsafe(self._dial(peer_id), self.loop)

    async def _dial(self, peer_id) -> None:
        try:
            announced = (await self.loop.run_in_executor(None, self.addresses)).get(str(peer_id)) or []
            if announced:
                peer = peer_id if isinstance(peer_id, PeerID) else PeerID.from_base58(peer_id)
                suffix = f"/p2p/{peer.to_base58()}"  # dialed as that peer anyway
                maddrs = [WireMaddr(m.removesuffix(suffix)) for m in announced]
                await asyncio.wait_for(dial(self.p2p, peer, maddrs), self.timeout)
                log.info("dialed a peer at its announced addresses",
                         extra={"fields": {"peer_id": str(peer_id), "maddrs": announced}})
            else:
                log.info("a peer announces no addresses to dial", extra={"fields": {"peer_id": str(peer_id)}})
        except Exception as e:  # noqa: BLE001 - unreachable now: its calls keep failing, and it is avoided
            log.info("a peer is unreachable at its announced addresses",
                     extra={"fields": {"peer_id": str(peer_id), "error": repr(e)}})


class WireMaddr:
    """A multiaddr as p2pd reads it. hivemind's Python multiaddr writes a /p2p/ value as a CID,
    go-multiaddr reads the bare multihash: a relay's /p2p/ID/p2p-circuit address would not
    parse. Anything with to_bytes() does for hivemind's daemon client."""

    def __init__(self, text: str):
        self.text = text

    def __str__(self) -> str:
        return self.text

    def to_bytes(self) -> bytes:
        head, *rest = self.text.split("/p2p/")
        encoded = Multiaddr(head).to_bytes() if head else b""
        for part in rest:
            peer, _, tail = part.partition("/")
            multihash = PeerID.from_base58(peer).to_bytes()
            encoded += _varint(P2P_CODE) + _varint(len(multihash)) + multihash
            encoded += Multiaddr("/" + tail).to_bytes() if tail else b""
        return encoded


P2P_CODE = 421  # the multicodec of /p2p/


def _varint(value: int) -> bytes:
    out = bytearray()
    while True:
        byte, value = value & 0x7F, value >> 7
        out.append(byte | (0x80 if value else 0))
        if not value:
            return bytes(out)


async def hang_up(p2p: P2P, peer_id) -> None:
    await p2p._client.disconnect(peer_id)


REDIAL_POLL_SECONDS = 0.5
REDIAL_TIMEOUT = 10.0
REDIAL_BACKOFF_SECONDS = 300.0  # a peer that could not be dialed directly (behind a NAT too) keeps its circuit
_redialing: list[asyncio.Task] = []  # in the DHT's process


async def keep_direct_connections(_dht, node) -> None:
    """For `DHT.run_coroutine`: from now on, replace every connection that reaches this peer
    only through a relay's circuit by a direct one that this peer dials."""
    if not _redialing:
        _redialing.append(asyncio.create_task(_redial_relayed(node.p2p)))


async def _redial_relayed(p2p: P2P) -> None:
    tried: dict[Any, float] = {}
    while True:
        await asyncio.sleep(REDIAL_POLL_SECONDS)
        try:
            peers = await p2p.list_peers()
        except Exception:  # the daemon is going away with the DHT
            continue
        for info in peers:
            relayed = info.addrs and all("/p2p-circuit" in str(a) for a in info.addrs)
            since = time.monotonic() - tried.get(info.peer_id, -REDIAL_BACKOFF_SECONDS)
            if not relayed or since < REDIAL_BACKOFF_SECONDS:
                continue
            tried[info.peer_id] = time.monotonic()
            await hang_up(p2p, info.peer_id)
            try:
                await asyncio.wait_for(dial(p2p, info.peer_id), REDIAL_TIMEOUT)
                log.info(f"dialed {info.peer_id} directly, instead of its relayed connection")
            except Exception as e:  # it redials through the relay when it needs us
                log.info(f"cannot dial {info.peer_id} directly ({type(e).__name__}): it keeps the relay")
