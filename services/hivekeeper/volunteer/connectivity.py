"""How a volunteer can take part: DIRECT if a relay can dial it back, RELAY if it cannot but a
relay reserves a slot for it and the relayed path works end to end, CLIENT (dials out only) if
not even that. Each check runs on a throwaway p2pd with a random identity, listening where the
volunteer's role will listen, and is gone before the role starts."""

from __future__ import annotations

import asyncio
import time
from contextlib import asynccontextmanager
from dataclasses import asdict, dataclass, field
from typing import Any, AsyncIterator, Optional, Sequence

from hivekeeper.volunteer.reachability import Answer, ask, connect, is_relayed

DIRECT, RELAY, CLIENT = "direct", "relay", "client"
MODES = (DIRECT, RELAY, CLIENT)
RESERVATION_TIMEOUT = 20.0  # how long a relay may take to hand out a slot


class Unreachable(Exception):
    """Nothing in the swarm answers this peer: it cannot join at all."""


@dataclass
class Connectivity:
    mode: str
    reason: str
    relays: list[str] = field(default_factory=list)  # the relays this peer could connect to
    entry_points: list[str] = field(default_factory=list)  # initial peers it could connect to
    observed: Optional[str] = None  # where a relay saw this peer's connection come from
    relayed_address: Optional[str] = None  # a /p2p-circuit address that was dialed back
    seconds: dict[str, float] = field(default_factory=dict)

    def as_dict(self) -> dict[str, Any]:
        return asdict(self)


async def detect(initial_peers: Sequence[str], relays: Sequence[str], host: str, port: int,
                 wanted: str = "auto") -> Connectivity:
    """The best mode this peer can run in (or, with `wanted`, whether it can run in that one).
    Raises Unreachable when no relay and no initial peer answers."""
    from hivemind.p2p import P2P

    seconds: dict[str, float] = {}
    started = time.perf_counter()
    async with _daemon(P2P, host, port) as p2p:
        reachable_relays = await _reachable(p2p, relays)
        entry_points = [m for m in initial_peers if m in reachable_relays] or await _reachable(p2p, initial_peers)
        seconds["connect"] = time.perf_counter() - started
        if not reachable_relays and not entry_points:
            raise Unreachable(f"no relay and no initial peer answers (tried {len(set(relays) | set(initial_peers))})")
        direct: Optional[Answer] = None
        if reachable_relays and wanted in ("auto", DIRECT):
            direct = await _first_answer(p2p, reachable_relays, [a for a in await _own_maddrs(p2p) if not is_relayed(a)])
            seconds["directCheck"] = time.perf_counter() - started - seconds["connect"]
    result = Connectivity(CLIENT, "", relays=reachable_relays, entry_points=entry_points,
                          observed=direct.observed if direct else None, seconds=seconds)
    if direct is not None and direct.reachable:
        result.mode, result.reason = DIRECT, f"relay {_short(direct.checker)} dialed this peer back directly"
        return result
    if wanted == DIRECT:
        result.reason = "no relay could dial this peer back" if reachable_relays else "no relay answers to check"
        return result
    if reachable_relays and wanted in ("auto", RELAY):
        mark = time.perf_counter()
        relayed, why = await _relayed_path(P2P, host, port, reachable_relays)
        seconds["relayCheck"] = time.perf_counter() - mark
        if relayed is not None:
            result.mode, result.relayed_address = RELAY, relayed
            first = "not reachable directly" if direct is not None else "relay mode asked for"
            result.reason = f"{first}; a relay reserved a slot and dialed this peer back through it"
            return result
        result.reason = f"not reachable directly, and the relayed path failed: {why}"
    elif not reachable_relays:
        result.reason = "no relay answers; joining through the initial peers, dialing out only"
    else:
        result.reason = "client mode asked for"
    if not entry_points:
        raise Unreachable(f"{result.reason}; and no initial peer answers")
    return result


@asynccontextmanager
async def _daemon(P2P, host: str, port: int, **options: Any) -> AsyncIterator[Any]:
    p2p = await P2P.create(host_maddrs=[f"/ip4/{host}/tcp/{port}"], auto_nat=False, nat_port_map=False,
                           dht_mode="client", **options)
    try:
        yield p2p
    finally:
        await p2p.shutdown()


DIAL_ATTEMPTS = 3  # a first dial through a NodePort can fail while the swarm is up
DIAL_RETRY_SECONDS = 1.0


async def _reachable(p2p, maddrs: Sequence[str]) -> list[str]:
    async def ok(maddr: str) -> bool:
        for attempt in range(DIAL_ATTEMPTS):
            try:
                await connect(p2p, maddr)
                return True
            except Exception:
                if attempt + 1 < DIAL_ATTEMPTS:
                    await asyncio.sleep(DIAL_RETRY_SECONDS)
        return False

    answers = await asyncio.gather(*(ok(m) for m in maddrs))
    return [m for m, good in zip(maddrs, answers) if good]


async def _own_maddrs(p2p) -> list[str]:
    return [str(a) for a in await p2p.get_visible_maddrs(latest=True)]


async def _first_answer(p2p, checkers: Sequence[str], maddrs: Sequence[str],
                        errors: Optional[list[str]] = None) -> Optional[Answer]:
    """The first checker's answer that says reachable, else the last answer (None if none
    answered; then `errors` gets why each did not)."""
    last = None
    for checker in checkers:
        try:
            last = await ask(p2p, checker, maddrs)
        except Exception as e:
            if errors is not None:
                errors.append(f"{_short(checker)}: {e!r}")
            continue
        if last.reachable:
            return last
    return last


async def _relayed_path(P2P, host: str, port: int, relays: Sequence[str]) -> tuple[Optional[str], str]:
    """Reserve a slot at the relays as the role will, wait for our /p2p-circuit address, and have
    the relay dial us there: (that address, "") or (None, why not)."""
    from hivekeeper.hivemind_ext.p2pd import use_static_relays

    use_static_relays()
    async with _daemon(P2P, host, port, use_auto_relay=True, trusted_relays=list(relays),
                       force_reachability="private") as p2p:
        for relay in relays:  # autorelay dials them too; connecting first saves its discovery delay
            try:
                await connect(p2p, relay)
            except Exception:
                pass
        deadline = time.monotonic() + RESERVATION_TIMEOUT
        circuits: list[str] = []
        while not circuits and time.monotonic() < deadline:
            circuits = [a for a in await _own_maddrs(p2p) if is_relayed(a)]
            if not circuits:
                await asyncio.sleep(0.5)
        if not circuits:
            return None, f"no relay reserved a slot within {RESERVATION_TIMEOUT:.0f}s"
        errors: list[str] = []
        answer = await _first_answer(p2p, relays, circuits, errors)
        if answer is None:
            return None, f"no relay answered the relayed check ({'; '.join(errors)})"
        if not answer.reachable:
            return None, f"the relay could not dial this peer through the circuit ({answer.error})"
        return circuits[0], ""


def _short(peer_id: str) -> str:
    return peer_id[-8:]
