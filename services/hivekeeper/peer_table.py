"""The peers of a running resource as its DHT sees them (each peer's latest report), for
`hivekeeper status --swarm NAME --initial-peers ...`: works for a local run and for a swarm in
a cluster alike, from anywhere that can reach one of its backbone peers."""

from __future__ import annotations

import time
from typing import Any, Sequence

from rich.console import Group, RenderableType
from rich.table import Table

from hivekeeper.local.progress import describe_round


READ_ATTEMPTS = 3  # a client that has just joined may find no report at its first get


def read_reports(initial_peers: Sequence[str], swarm: str, authorizer=None) -> list[dict[str, Any]]:
    """The peers' reports, read through a short-lived client-mode DHT peer (signing its requests
    with `authorizer` where the swarm admits peers by token). A read that finds none is tried
    again, up to READ_ATTEMPTS times a second apart: on a loaded machine the new client's first
    get can time out before it reaches the peers that store the reports."""
    import hivemind

    from hivekeeper.runtime.reports import read_peer_reports

    dht = hivemind.DHT(initial_peers=list(initial_peers), client_mode=True, start=True, authorizer=authorizer)
    try:
        reports = read_peer_reports(dht, swarm)
        for _ in range(READ_ATTEMPTS - 1):
            if reports:
                break
            time.sleep(1.0)
            reports = read_peer_reports(dht, swarm)
        return sorted(reports, key=lambda r: (r.get("role", ""), r.get("name", "")))
    finally:
        dht.shutdown()


HOST = "(host)"  # the lab column's word for the swarm's own peers


def status_view(swarm: str, reports: list[dict[str, Any]]) -> RenderableType:
    """The peers, and where other labs or volunteers take part, their sums by lab first."""
    labs = lab_table(reports)
    return Group(labs, peer_table(swarm, reports)) if labs is not None else peer_table(swarm, reports)


def lab_table(reports: list[dict[str, Any]]) -> Table | None:
    """Peers and samples/s by the identity that admitted them (a lab, or one volunteer); None
    while only the swarm's own peers report."""
    if not any(report.get("lab") for report in reports):
        return None
    rows: dict[str, dict[str, Any]] = {}
    for report in reports:
        row = rows.setdefault(report.get("lab") or HOST, {"peers": 0, "roles": {}, "samples": 0.0})
        row["peers"] += 1
        role = str(report.get("role", "?"))
        row["roles"][role] = row["roles"].get(role, 0) + 1
        if isinstance(report.get("samplesPerSecond"), (int, float)):
            row["samples"] += report["samplesPerSecond"]
    table = Table(title="by lab", title_justify="left")
    for column in ("lab", "peers", "roles", "samples/s"):
        table.add_column(column, justify="right" if column in ("peers", "samples/s") else "left")
    for lab in sorted(rows, key=lambda name: (name != HOST, name)):
        row = rows[lab]
        table.add_row(lab, str(row["peers"]), ", ".join(f"{n} {role}" for role, n in sorted(row["roles"].items())),
                      f"{row['samples']:.0f}")
    return table


def peer_table(swarm: str, reports: list[dict[str, Any]]) -> Table:
    table = Table(title=f"{swarm}: {len(reports)} peers reporting", title_justify="left")
    labs = any(report.get("lab") for report in reports)
    for column in ("peer", *(("lab",) if labs else ()), "role", "step", "samples/s", "loss", "last round", "reported"):
        table.add_column(column, justify="right" if column in ("step", "samples/s", "loss", "reported") else "left")
    now = time.time()
    for report in reports:
        loss = report.get("loss")
        table.add_row(
            str(report.get("name", "?")), *((str(report.get("lab") or HOST),) if labs else ()),
            str(report.get("role", "?")),
            str(report.get("globalEpoch", report.get("epoch", ""))) if report.get("role") != "backbone" else "",
            f"{report['samplesPerSecond']:.0f}" if isinstance(report.get("samplesPerSecond"), (int, float)) else "",
            f"{loss:.4f}" if isinstance(loss, (int, float)) else "",
            describe_round(report.get("lastRound")) if report.get("lastRound") else "",
            f"{max(0.0, now - report['time']):.0f}s ago" if isinstance(report.get("time"), (int, float)) else "",
        )
    return table
