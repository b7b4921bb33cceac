"""Each party's part in a swarm, from its peers' DHT reports: the host lab's own peers and each
lab or volunteer whose invite admitted peers. The monitor shows it in the host's status, and a
joining lab's backbone in the lab's (with the swarm's step and rate: a lab runs no monitor)."""

from __future__ import annotations

from typing import Any


def export_parties(metrics: Any, parties: list[dict[str, Any]]) -> None:
    """Each party's peers, samples/s and share as gauges labelled by party (`parties_of`: the
    host's own peers alone too, so a dashboard's by-lab panels show them), those of parties gone
    dropped."""
    gauges = ((metrics.lab_peers, "peers"), (metrics.lab_samples_per_second, "samplesPerSecond"),
              (metrics.lab_sample_share, "share"))
    for gauge, _ in gauges:
        gauge.clear()
    for party in parties:
        for gauge, key in gauges:
            gauge.labels(party["name"]).set(party[key])


def swarm_figures(reports: list[dict[str, Any]], host: str) -> dict[str, Any]:
    """The swarm's global step (its trainers' furthest epoch), samples/s and parties, as far as
    the reports tell; keys without a figure are left out."""
    trainers = [r for r in reports if r.get("role") == "trainer"]
    epochs = [r["globalEpoch"] for r in trainers if isinstance(r.get("globalEpoch"), int)]
    rates = [r["samplesPerSecond"] for r in trainers
             if isinstance(r.get("samplesPerSecond"), (int, float)) and not isinstance(r["samplesPerSecond"], bool)]
    figures: dict[str, Any] = {"labs": labs_of(reports, host)}
    if epochs:
        figures["globalStep"] = max(epochs)
    if rates:
        figures["samplesPerSecond"] = round(sum(rates), 1)
    return {k: v for k, v in figures.items() if v is not None}


def labs_of(reports: list[dict], host: str) -> list[dict] | None:
    """`parties_of`, or None while only the host's peers report (nothing to break down)."""
    return parties_of(reports, host) if any(r.get("lab") for r in reports) else None


def parties_of(reports: list[dict], host: str) -> list[dict]:
    """Each party's part in the swarm, from the peers' reports: the host's own peers (`host`
    true, named after the resource) and each lab or volunteer whose invite admitted peers.
    Samples/s, samples and averaging bytes are the trainers' sums; `share` is the party's part
    of the samples computed so far."""
    parties: dict[str, dict] = {}
    for report in reports:
        lab = report.get("lab")
        party = parties.setdefault(lab or "", {"name": lab or host, "host": not lab, "peers": 0,
                                                "samplesPerSecond": 0.0, "samples": 0, "averagingBytesSent": 0})
        party["peers"] += 1
        if report.get("role") != "trainer":
            continue
        for key, kind in (("samplesPerSecond", float), ("samples", int), ("averagingBytesSent", int)):
            value = report.get(key)
            if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
                party[key] += kind(value)
    total = sum(party["samples"] for party in parties.values())
    for party in parties.values():
        party["samplesPerSecond"] = round(party["samplesPerSecond"], 1)
        party["share"] = round(party["samples"] / total, 4) if total else 0.0
    return sorted(parties.values(), key=lambda party: (not party["host"], party["name"]))
