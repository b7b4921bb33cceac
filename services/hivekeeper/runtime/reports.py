"""What peers tell each other through the DHT: every role's latest report (who it is, what it
does, its figures) under one key per resource, and the stop record that ends a run."""

from __future__ import annotations

from typing import Any

PEERS_KEY = "_peers"  # subkey per peer: the role's latest report (roles, losses, throughput)
STOP_KEY = "_stop"  # set by whoever ends the run (a Swarm's monitor) when its stopping condition is met
REPORT_EXPIRATION = 15.0  # seconds a peer's report stays in the DHT without a refresh


def read_peer_reports(dht, run_id: str) -> list[dict[str, Any]]:
    """Reports of the peers that are alive (their records have not expired); a record that is
    not a report (a peer sending garbage) is skipped."""
    found = dht.get(run_id + PEERS_KEY, latest=True)
    if found is None or not isinstance(found.value, dict):
        return []
    reports = []
    for entry in found.value.values():
        value = getattr(entry, "value", None)
        if isinstance(value, dict) and isinstance(value.get("role"), str):
            reports.append(value)
    return reports


def announced_addresses(dht, run_id: str) -> dict[str, list[str]]:
    """Each live peer's announced multiaddrs by peer ID (its report's): where a client dials a
    peer its p2p daemon cannot find (`hivemind_ext.p2pd.Redialer`)."""
    return {r["peerId"]: [str(m) for m in r.get("maddrs") or []]
            for r in read_peer_reports(dht, run_id) if isinstance(r.get("peerId"), str)}


def read_stop(dht, run_id: str) -> dict[str, Any] | None:
    found = dht.get(run_id + STOP_KEY, latest=True)
    return found.value if found is not None else None
