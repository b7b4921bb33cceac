"""Hanging up a binary stream that answered a caller, without losing the answer.

p2pd pipes each stream between the libp2p stream and a socket to this process, and resets the
stream when either copy fails; a reset discards whatever the other end has not read yet. The
side that answers last therefore closes only once the caller has closed its end (it has read
the answer by then), discarding whatever more it sends, or after a timeout at the latest: a
caller that never hangs up holds nothing but this coroutine."""

from __future__ import annotations

import asyncio

from hivekeeper.hivemind_ext import check_hivemind_version

check_hivemind_version(__name__)  # the reset it works around is that of the p2pd hivemind ships

__all__ = ["HANG_UP_SECONDS", "DISCARD_BYTES", "discard", "hang_up_after_caller"]

HANG_UP_SECONDS = 10.0  # how long an answered caller may take to close its end
DISCARD_BYTES = 1 << 20  # what a caller may still send before it is cut


async def discard(reader: asyncio.StreamReader, limit: int = DISCARD_BYTES) -> None:
    """Reads and drops up to `limit` bytes, until the other end closes."""
    while limit > 0:
        chunk = await reader.read(min(limit, 1 << 16))
        if not chunk:
            return
        limit -= len(chunk)


async def hang_up_after_caller(reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                               timeout: float = HANG_UP_SECONDS) -> None:
    """Closes `writer` once the caller has closed its end, or after `timeout`."""
    try:
        await asyncio.wait_for(discard(reader), timeout)
    except Exception:  # noqa: BLE001 (the caller may be gone already, or never stop sending)
        pass
    finally:
        writer.close()
