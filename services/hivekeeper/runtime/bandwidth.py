"""What a peer can move: a short probe at join, then the rates its averaging rounds achieve.

The balancer needs every peer's upload and download rate before the first round, so a
joining peer sends a few megabytes to a backbone peer while fetching as many back, over the
same libp2p transport averaging uses (the backbone serves `PROBE_HANDLER` from its DHT
process). Both directions at once, because averaging moves both at once: on an asymmetric
or shaped link the acknowledgements of one direction queue behind the data of the other,
and a one-way probe overstates what a round gets. Every figure is a lower bound of the capacity (the other end or the path may be the
bottleneck, a round's duration includes waiting for the slowest peer), so the estimate is the
best rate seen recently; older observations age out so that a slower link shows up.
"""

from __future__ import annotations

import asyncio
import logging
import struct
import time
from collections import deque
from dataclasses import dataclass
from typing import Optional, Sequence

from hivekeeper.hivemind_ext.streams import hang_up_after_caller

log = logging.getLogger("hivekeeper.bandwidth")

PROBE_HANDLER = "hivekeeper.bandwidth_probe"
PROBE_BYTES = 2 << 20  # each way; ~1.7 s at 10 Mbps, milliseconds on a LAN
MAX_PROBE_BYTES = 16 << 20  # what a backbone peer agrees to move for one probe
_CHUNK = 1 << 16
_HEADER = struct.Struct("!QQ")  # bytes the prober sends, bytes it asks back
_SECONDS = struct.Struct("!d")


@dataclass(frozen=True)
class Rates:
    upload: float  # bytes per second
    download: float


async def _serve_probes(_dht, node) -> None:
    """Runs in a backbone's DHT process: answer probes, receiving and sending at once."""

    async def handle(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            incoming, outgoing = _HEADER.unpack(await reader.readexactly(_HEADER.size))
            if incoming > MAX_PROBE_BYTES or outgoing > MAX_PROBE_BYTES:
                return  # not a probe we serve; closing tells the prober
            started = time.perf_counter()
            _, received = await asyncio.gather(_send_zeros(writer, outgoing), _receive(reader, incoming))
            writer.write(_SECONDS.pack(received - started))  # how long the prober's upload took to arrive
            await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        await hang_up_after_caller(reader, writer)

    await node.p2p.add_binary_stream_handler(PROBE_HANDLER, handle)


async def _send_zeros(writer: asyncio.StreamWriter, size: int) -> None:
    zeros = bytes(_CHUNK)
    for offset in range(0, size, _CHUNK):
        writer.write(zeros[: min(_CHUNK, size - offset)])
        await writer.drain()


async def _receive(reader: asyncio.StreamReader, size: int) -> float:
    """Reads `size` bytes; returns the time the last one arrived."""
    while size:
        chunk = await reader.read(min(size, _CHUNK))
        if not chunk:
            raise asyncio.IncompleteReadError(b"", size)
        size -= len(chunk)
    return time.perf_counter()


def serve_probes(dht) -> None:
    dht.run_coroutine(_serve_probes)


async def _probe(peer_ids: Sequence[str], size: int, timeout: float, _dht, node) -> Optional[tuple[float, float]]:
    from hivemind.p2p import PeerID

    for peer in peer_ids:
        try:
            return await asyncio.wait_for(_probe_one(node.p2p, PeerID.from_base58(peer), size), timeout)
        except Exception as e:  # an unreachable or old backbone: try the next
            log.warning("bandwidth probe failed", extra={"fields": {"peer": peer, "error": repr(e)}})
    return None


async def _probe_one(p2p, peer_id, size: int) -> tuple[float, float]:
    _, reader, writer = await p2p.call_binary_stream_handler(peer_id, PROBE_HANDLER)
    try:
        writer.write(_HEADER.pack(size, size))
        started = time.perf_counter()
        _, downloaded = await asyncio.gather(_send_zeros(writer, size), _receive(reader, size))
        (upload_seconds,) = _SECONDS.unpack(await reader.readexactly(_SECONDS.size))
        return size / upload_seconds, size / (downloaded - started)
    finally:
        writer.close()


def probe(dht, backbone_peer_ids: Sequence[str], size: int = PROBE_BYTES, timeout: float = 30.0) -> Optional[Rates]:
    """Upload and download rates to the first backbone peer that answers; None if none does."""
    from functools import partial

    if not backbone_peer_ids:
        return None
    result = dht.run_coroutine(partial(_probe, list(backbone_peer_ids), size, timeout))
    return Rates(*result) if result else None


def peer_ids_of(maddrs: Sequence[str]) -> list[str]:
    """The peer IDs named by /p2p/ID multiaddrs."""
    return [str(maddr).rsplit("/p2p/", 1)[1] for maddr in maddrs if "/p2p/" in str(maddr)]


class BandwidthEstimate:
    """The best upload and download rates among the last `window` observations."""

    def __init__(self, window: int = 10):
        self._seen: deque[Rates] = deque(maxlen=window)

    def observe(self, rates: Rates) -> None:
        if rates.upload > 0 or rates.download > 0:
            self._seen.append(rates)

    @property
    def rates(self) -> Optional[Rates]:
        if not self._seen:
            return None
        return Rates(max(r.upload for r in self._seen), max(r.download for r in self._seen))
