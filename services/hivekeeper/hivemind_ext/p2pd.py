"""What hivemind's P2P does not expose: p2pd's `-relayDiscovery=0` for a peer given trusted
relays, and dialing back peers that reach this one through a relay.

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

from hivemind.p2p import P2P

from hivekeeper.hivemind_ext import check_hivemind_version

check_hivemind_version(__name__)

__all__ = ["use_static_relays", "keep_direct_connections", "die_with_parent"]
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
