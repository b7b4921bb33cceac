"""Dial-back reachability check: can the swarm open a connection to this peer?

A peer asks a checker (a relay, or any peer serving `HANDLER`) to dial it at the multiaddrs it
names. The checker dials from a fresh temporary P2P daemon that has never seen the caller, so
the connection the caller itself opened to ask does not count, and answers whether the dial
succeeded and which address it saw the caller's request come from. Naming direct addresses
tests direct reachability; naming a relay's /p2p-circuit address tests the relayed path.

The checker dials the caller's own peer ID (the handshake proves who answers), at no more
than MAX_MADDRS addresses, a few checks at a time. It dials another peer only at relayed
addresses through itself (a watchdog asking whether a volunteer still holds its reservation):
it cannot be made to probe others.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import Counter
from contextlib import suppress
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence, Union

from hivemind.p2p import P2P, PeerID
from hivemind.utils.multiaddr import Multiaddr

from hivekeeper.hivemind_ext.p2pd import WireMaddr, dial, hang_up
from hivekeeper.hivemind_ext.streams import hang_up_after_caller

log = logging.getLogger("hivekeeper.reachability")

HANDLER = "hivekeeper.reachability.v1"
DIAL_TIMEOUT = 6.0  # a NAT that drops inbound SYNs makes the dial hang until this
PROBE_START_TIMEOUT = 15.0  # a check's own p2pd starting on a loaded host (hivemind's default)
# a caller waits for the checker's whole check: its p2pd's start, the dial, and the way back
ANSWER_TIMEOUT = PROBE_START_TIMEOUT + DIAL_TIMEOUT + 10.0
MAX_MADDRS = 8
MAX_CONCURRENT = 2  # each check starts a p2pd of its own
MAX_REQUEST_BYTES = 16 << 10


@dataclass(frozen=True)
class Answer:
    checker: str  # peer ID of the peer that dialed back
    reachable: bool
    observed: Optional[str] = None  # where the checker saw our request come from
    error: Optional[str] = None


@dataclass
class ReachabilityService:
    """Answers dial-back requests. Lives where the P2P instance lives (a DHT's process)."""

    dial_timeout: float = DIAL_TIMEOUT
    outcomes: Counter = field(default_factory=Counter)  # reachable | unreachable | error
    _own_id: str = ""
    _slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(MAX_CONCURRENT))
    _relay_probe: Optional[P2P] = None
    _relay_probe_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    async def serve(self, p2p: P2P) -> None:
        self._own_id = p2p.peer_id.to_base58()
        await p2p.add_binary_stream_handler(HANDLER, self._handle)

    async def _handle(self, info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            request = json.loads(await asyncio.wait_for(_receive(reader), self.dial_timeout))
            target = PeerID.from_base58(request["peer"]) if request.get("peer") else info.peer_id
            texts = request.get("maddrs", [])[:MAX_MADDRS]
            if target != info.peer_id and not all(f"/p2p/{self._own_id}/p2p-circuit" in a for a in texts):
                raise ValueError("another peer is checked only at relayed addresses through this relay")
            suffix = f"/p2p/{target.to_base58()}"  # dialed as that peer anyway
            maddrs = [WireMaddr(a.removesuffix(suffix)) for a in texts]
            if target == info.peer_id:
                async with self._slots:
                    reachable, error = await self.dial_back(target, maddrs)
            else:
                reachable, error = await self.dial_relayed(target, maddrs)
            self.outcomes["reachable" if reachable else "unreachable"] += 1
            reply = {"reachable": reachable, "observed": str(info.addr), "error": error}
        except Exception as e:  # a malformed request; the caller learns why
            self.outcomes["error"] += 1
            reply = {"reachable": False, "observed": str(info.addr), "error": f"bad request: {e!r}"}
        try:
            await P2P.send_raw_data(json.dumps(reply).encode(), writer)
        except ConnectionError:
            pass
        await hang_up_after_caller(reader, writer)

    async def dial_back(self, peer_id: PeerID, maddrs: Sequence["WireMaddr"]) -> tuple[bool, Optional[str]]:
        """From a daemon started for this check alone."""
        if not maddrs:
            return False, "no addresses to dial"
        probe = await _probe_daemon()
        try:
            return await _dial(probe, peer_id, maddrs, self.dial_timeout)
        finally:
            await probe.shutdown()

    async def dial_relayed(self, peer_id: PeerID, maddrs: Sequence["WireMaddr"]) -> tuple[bool, Optional[str]]:
        """A watchdog's periodic check that a peer still holds its reservation here: from one
        long-lived daemon (a fresh one per check would cost a p2pd start every few seconds for
        every volunteer), disconnected after each check so that the next one dials again. It
        may learn the peer's direct addresses: a dial that succeeds there is reachable too.
        After a failure it is replaced, so that libp2p's dial backoff does not fail the next."""
        async with self._relay_probe_lock:
            if self._relay_probe is None:
                self._relay_probe = await _probe_daemon()
            probe = self._relay_probe
        reachable, error = await _dial(probe, peer_id, maddrs, self.dial_timeout)
        with suppress(Exception):
            await hang_up(probe, peer_id)
        if not reachable:
            async with self._relay_probe_lock:
                if self._relay_probe is probe:
                    self._relay_probe = None
                    await probe.shutdown()
        return reachable, error

    async def close(self) -> None:
        if self._relay_probe is not None:
            await self._relay_probe.shutdown()


async def _probe_daemon() -> P2P:
    # no listening socket, no DHT, no bootstrap: a daemon that can only dial out
    return await P2P.create(no_listen=True, auto_nat=False, nat_port_map=False, dht_mode="client", conn_manager=False,
                            startup_timeout=PROBE_START_TIMEOUT)


async def _dial(probe: P2P, peer_id: PeerID, maddrs: Sequence["WireMaddr"], timeout: float) -> tuple[bool, Optional[str]]:
    try:
        await asyncio.wait_for(dial(probe, peer_id, maddrs), timeout)
        return True, None
    except asyncio.TimeoutError:
        return False, f"no answer in {timeout}s"
    except Exception as e:
        return False, repr(e)


async def ask(p2p: P2P, checker: Union[str, PeerID], maddrs: Sequence[Union[str, Multiaddr]],
              timeout: float = ANSWER_TIMEOUT, peer: Optional[str] = None) -> Answer:
    """Ask one checker (a /p2p/ multiaddr to connect to first, or a peer ID already known) to
    dial this peer, or `peer` through a reservation at the checker, at `maddrs`."""
    peer_id = await connect(p2p, checker) if isinstance(checker, str) else checker
    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, HANDLER)
    try:
        request = {"maddrs": [str(a) for a in maddrs], **({"peer": peer} if peer else {})}
        await P2P.send_raw_data(json.dumps(request).encode(), writer)
        try:
            reply: dict[str, Any] = json.loads(await asyncio.wait_for(_receive(reader), timeout))
        except asyncio.IncompleteReadError as e:
            raise ConnectionError(f"checker {peer_id} closed the stream after {len(e.partial)} bytes "
                                  "of its answer") from None
    finally:
        writer.close()
    return Answer(checker=str(peer_id), reachable=bool(reply.get("reachable")), observed=reply.get("observed"),
                  error=reply.get("error"))


async def check_reachability(p2p_or_dht, checkers: Sequence[Union[str, PeerID]],
                             my_maddrs: Sequence[Union[str, Multiaddr]]) -> bool:
    """True if any checker could dial us at `my_maddrs` (False if none could, or none answered)."""
    p2p = await p2p_or_dht.replicate_p2p() if hasattr(p2p_or_dht, "replicate_p2p") else p2p_or_dht
    for checker in checkers:
        try:
            if (await ask(p2p, checker, my_maddrs)).reachable:
                return True
        except Exception as e:  # a checker that is down or does not serve the check
            log.info("reachability checker failed", extra={"fields": {"checker": str(checker), "error": repr(e)}})
    return False


async def connect(p2p: P2P, maddr: str, timeout: float = DIAL_TIMEOUT) -> PeerID:
    """Open a connection to the peer at `maddr` (which must end in /p2p/ID); its peer ID."""
    address, _, peer = maddr.rpartition("/p2p/")
    peer_id = PeerID.from_base58(peer)
    await asyncio.wait_for(dial(p2p, peer_id, [Multiaddr(address)]), timeout)
    return peer_id


async def _receive(reader: asyncio.StreamReader) -> bytes:
    header = await reader.readexactly(P2P.HEADER_LEN)
    size = int.from_bytes(header, P2P.BYTEORDER)
    if size > MAX_REQUEST_BYTES:
        raise ValueError(f"message of {size} bytes")
    return await reader.readexactly(size)


def is_relayed(maddr: Union[str, Multiaddr]) -> bool:
    return "/p2p-circuit" in str(maddr)
