"""Model shifting (DDAP, section 3.2): between merges, replicas move one place around a ring,
so each replica meets every peer's data shard rather than only its own.

Round k (this peer's local step count at the shift point, which merges and joins keep in
step across peers):
  1. offer: the peer's replica (weights, and moments when merged), serialized, is handed to
     its DHT process, which serves it over libp2p to whoever asks for round k;
  2. announce: the peer adds itself to the DHT record `PREFIX.shift.k`;
  3. after a rendezvous window, the members of round k, sorted by peer ID, form the ring, and
     the peer downloads its predecessor's offer and continues from it.
Transfers are point to point: one replica per peer per round each way. A peer alone in its
round, or whose download fails, keeps its own replica. Peers that reach a round at different
moments may see different members; then one replica may be taken twice and another by no
one, which costs that replica's progress since the last merge and nothing else.

Payloads are read with `torch.load(weights_only=True)`: a peer can send only tensors, and a
layout other than this peer's is refused.
"""

from __future__ import annotations

import asyncio
import io
import logging
import struct
import time
from functools import partial
from typing import Any, Optional, Sequence

import torch

from hivekeeper.hivemind_ext.streams import hang_up_after_caller

log = logging.getLogger("hivekeeper.model_shifting")

_ROUND = struct.Struct("!q")
_LENGTH = struct.Struct("!Q")
MAX_PAYLOAD = 1 << 34
_offers: dict[str, dict[int, bytes]] = {}  # in the DHT's process: handler name -> round -> payload


async def _offer(handler: str, round_: int, payload: bytes, _dht, node) -> None:
    """Runs in the DHT's process: keep this round's payload (and the previous one, for late askers)."""
    if handler not in _offers:
        _offers[handler] = {}

        async def serve(_info, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            try:
                (wanted,) = _ROUND.unpack(await reader.readexactly(_ROUND.size))
                data = _offers[handler].get(wanted, b"")
                writer.write(_LENGTH.pack(len(data)) + data)  # length 0: no offer for that round
                await writer.drain()
            except (asyncio.IncompleteReadError, ConnectionError):
                pass
            await hang_up_after_caller(reader, writer)

        await node.p2p.add_binary_stream_handler(handler, serve)
    offers = _offers[handler]
    offers[round_] = payload
    for old in [r for r in offers if r < round_ - 1]:
        del offers[old]


async def _fetch(handler: str, peer: str, round_: int, timeout: float, _dht, node) -> Optional[bytes]:
    from hivemind.p2p import PeerID

    async def fetch() -> bytes:
        _, reader, writer = await node.p2p.call_binary_stream_handler(PeerID.from_base58(peer), handler)
        try:
            writer.write(_ROUND.pack(round_))
            await writer.drain()
            (length,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
            if length > MAX_PAYLOAD:
                raise ValueError(f"offer of {length} bytes exceeds the limit")
            return await reader.readexactly(length)
        finally:
            writer.close()

    try:
        return await asyncio.wait_for(fetch(), timeout) or None
    except Exception as e:
        log.warning("model shift download failed", extra={"fields": {"peer": peer, "error": repr(e)}})
        return None


def serialize(tensors: Sequence[torch.Tensor]) -> bytes:
    buffer = io.BytesIO()
    torch.save([t.detach().cpu() for t in tensors], buffer)
    return buffer.getvalue()


def deserialize(payload: bytes, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """Tensors from a peer's payload, or ValueError if it is not a list shaped like `like`."""
    try:
        tensors = torch.load(io.BytesIO(payload), weights_only=True)
    except Exception as e:
        raise ValueError(f"not a tensor payload: {e}") from None
    if not isinstance(tensors, list) or [tuple(t.shape) for t in tensors if isinstance(t, torch.Tensor)] != [
            tuple(t.shape) for t in like]:
        raise ValueError("the payload's tensors are laid out differently from this replica's")
    return tensors


class ModelShifter:
    """One peer's side of ring-wise model shifting (see the module docstring)."""

    def __init__(self, dht: Any, prefix: str, *, rendezvous_seconds: float = 2.0, timeout: float = 30.0):
        self.dht, self.prefix = dht, prefix
        self.handler = f"hivekeeper.shift.{prefix}"
        self.rendezvous_seconds, self.timeout = rendezvous_seconds, timeout
        self.peer_id = str(dht.peer_id)

    def ring(self, round_: int) -> list[str]:
        """The peers that announced `round_`, in ring order."""
        found = self.dht.get(f"{self.prefix}.shift.{round_}", latest=True)
        members = found.value if found is not None and isinstance(found.value, dict) else {}
        return sorted(str(peer) for peer in members)

    def shift(self, round_: int, replica: Sequence[torch.Tensor]) -> Optional[tuple[list[torch.Tensor], str]]:
        """Offer `replica`, meet the round's other members, and return the predecessor's replica
        and its peer ID; None if this peer is alone or the download fails."""
        from hivemind.utils import get_dht_time

        self.dht.run_coroutine(partial(_offer, self.handler, round_, serialize(replica)))
        self.dht.store(f"{self.prefix}.shift.{round_}", subkey=self.peer_id, value=True,
                       expiration_time=get_dht_time() + max(60.0, 4 * self.timeout))
        time.sleep(self.rendezvous_seconds)
        ring = self.ring(round_)
        if self.peer_id not in ring or len(ring) < 2:
            return None
        predecessor = ring[ring.index(self.peer_id) - 1]
        payload = self.dht.run_coroutine(partial(_fetch, self.handler, predecessor, round_, self.timeout))
        if payload is None:
            return None
        try:
            return deserialize(payload, replica), predecessor
        except ValueError as e:
            log.warning("refused a shifted model", extra={"fields": {"peer": predecessor, "error": str(e)}})
            return None
