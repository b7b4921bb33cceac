"""Volunteers joining a running Swarm: how long from `hivekeeper join` to the first contributed
gradient in each mode, and what a relayed volunteer adds to the collaboration's throughput.

Setup (as root): tests/netns.py's lab. A digits Swarm runs in the "cluster" namespace
(`hivekeeper up --host`, with its relay and token service); volunteers run `hivekeeper join`
DIRECT from inside the cluster namespace (nothing in the way), RELAY from "home" behind a NAT
that lets nothing in, and CLIENT from home with the relay's port blocked by home's router (it
then joins through the backbone, which the test grant lists as a second entry point).

Join time: process start of `hivekeeper join` to its trainer's first accumulated batch as its
report shows it (RUN_DIR/join.json; the report trails the batch by at most a second), with the
milestones in between: access granted, connectivity decided, role ready.

Throughput. Anchor: the cluster alone (one trainer), the collaboration's samples/s from
optimizer steps (global steps x targetBatchSize over a window of the monitor's history, what
was averaged and applied), then the same with each volunteer in turn. A lone trainer never
averages; with a volunteer every step waits for an averaging round (matchmaking takes at
least averaging.matchmakingSeconds), so targetBatchSize is large enough to amortize rounds.
Every process shares this machine's two cores: the volunteer's compute comes out of the
cluster's, so the figure shows what joining costs or adds here, not what another machine's
CPU would add. Writes bench/results/join.json.

    .venv/bin/python bench/bench_join.py [--window 60]
"""

from __future__ import annotations

import argparse
import json
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Optional

import yaml
from rich.console import Console
from rich.table import Table

from bench_results import write_results
from hivekeeper.local.runner import read_history

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))
from netns import NatLab  # noqa: E402  (the lab the volunteer tests use)

NAME = "bench-join"
SPEC = {
    "targetBatchSize": 1024,  # rounds amortized over several seconds of compute
    "trainers": {"replicas": 1, "batchSize": 16},
    "auxiliary": {"replicas": 0},
    "averaging": {"matchmakingSeconds": 2.0, "timeoutSeconds": 15, "targetGroupSize": 4},
    "monitor": {"evalEverySteps": 1000, "checkpointEverySteps": 1000},
    "stopping": {"targetSteps": 100_000},
    "volunteers": {"enabled": True, "allowlist": ["volunteer"]},
}
MILESTONES = ("granted", "connectivity", "roleStarted", "firstReport", "firstGradient", "firstRound",
              "relayedReachable")


def hivekeeper(lab: NatLab, ns: str, *args: str, **kwargs: Any) -> subprocess.Popen:
    return lab.popen(ns, [sys.executable, "-m", "hivekeeper", *args], **kwargs)


def wait_for(condition, timeout: float, what: str):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


def throughput(run_dir: Path, since: float, until: float) -> Optional[dict[str, float]]:
    """Collaboration samples/s between two wall times: optimizer steps x the global batch (what
    was averaged and applied), and the sum of the trainers' reported rates (what was computed)."""
    window = [h for h in read_history(run_dir) if since <= h["time"] <= until and h["globalStep"] > 0]
    if len(window) < 2 or window[-1]["time"] - window[0]["time"] <= 0:
        return None
    span = window[-1]["time"] - window[0]["time"]
    steps = window[-1]["globalStep"] - window[0]["globalStep"]
    reported = sorted(h["samplesPerSecond"] for h in window)
    return {"seconds": round(span, 1), "steps": steps, "stepsSamplesPerSecond": round(steps * SPEC["targetBatchSize"] / span, 1),
            "reportedSamplesPerSecond": round(reported[len(reported) // 2], 1)}


def join(lab: NatLab, ns: str, host: str, gateway: str, invite: str, run_dir: Path) -> subprocess.Popen:
    return hivekeeper(lab, ns, "join", gateway, "--token", invite, "--run-dir", str(run_dir), "--host", host,
                      stdout=open(run_dir.with_suffix(".log"), "wb"), stderr=subprocess.STDOUT)


def record(run_dir: Path) -> dict[str, Any]:
    try:
        return json.loads((run_dir / "join.json").read_text())
    except (OSError, ValueError):
        return {}


def stop(process: subprocess.Popen) -> None:
    process.send_signal(signal.SIGINT)
    try:
        process.wait(30)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait(5)


def measure_join(lab: NatLab, mode: str, ns: str, host: str, cluster_dir: Path, work: Path, window: float,
                 gateway: str, invite: str) -> dict[str, Any]:
    run_dir = work / f"join-{mode}"
    process = join(lab, ns, host, gateway, invite, run_dir)
    try:
        wait_for(lambda: record(run_dir).get("seconds", {}).get("firstGradient") or process.poll() is not None,
                 240, f"the {mode} volunteer's first gradient")
        try:  # a volunteer that never averages is a result too (its seconds say how far it got)
            wait_for(lambda: record(run_dir).get("seconds", {}).get("firstRound") or process.poll() is not None,
                     120, f"the {mode} volunteer's first averaging round")
        except RuntimeError as e:
            print(f"{mode}: {e}", file=sys.stderr)
        result: dict[str, Any] = {"mode": record(run_dir).get("mode"), "reason": record(run_dir).get("reason")}
        result["seconds"] = {k: record(run_dir)["seconds"].get(k) for k in MILESTONES}
        if window:
            started = time.time()
            time.sleep(window)
            result["withVolunteer"] = throughput(cluster_dir, started, time.time())
        return result
    finally:
        stop(process)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--window", type=float, default=60.0, help="seconds of training per throughput figure")
    args = parser.parse_args()
    console = Console(stderr=True)
    with tempfile.TemporaryDirectory(prefix="bench-join-") as tmp, NatLab() as lab:
        work = Path(tmp)
        document = yaml.safe_load((REPO / "examples/swarm-digits.yaml").read_text())
        document["metadata"]["name"] = NAME
        document["spec"].update(SPEC)
        manifest = work / "manifest.yaml"
        manifest.write_text(yaml.safe_dump(document))
        cluster_dir = work / "cluster"
        runner = hivekeeper(lab, lab.cluster, "up", str(manifest), "--run-dir", str(cluster_dir), "--host",
                            lab.cluster_ip, stdout=open(work / "up.log", "wb"), stderr=subprocess.STDOUT)
        try:
            wait_for(lambda: any(h["globalStep"] > 2 for h in read_history(cluster_dir)), 240, "the cluster to train")
            run = json.loads((cluster_dir / "run.json").read_text())
            invite = subprocess.run([sys.executable, "-m", "hivekeeper", "invite", str(cluster_dir), "--identity",
                                     "volunteer"], capture_output=True, text=True, check=True).stdout.strip()
            console.print("measuring the cluster alone...")
            started = time.time()
            time.sleep(args.window)
            alone = throughput(cluster_dir, started, time.time())
            results = {}
            for mode, ns, host in (("direct", lab.cluster, lab.cluster_ip), ("relay", lab.home, lab.home_ip),
                                   ("client", lab.home, lab.home_ip)):
                console.print(f"joining in {mode} mode...")
                blocked = block_relay(lab, cluster_dir) if mode == "client" else None
                try:
                    results[mode] = measure_join(lab, mode, ns, host, cluster_dir, work, args.window,
                                                 run["gateway"], invite)
                finally:
                    if blocked:
                        lab.run(lab.nat, ["iptables", "-w", "-D", *blocked])
                time.sleep(5)  # the volunteer's report expires before the next one joins
        finally:
            stop(runner)
    report(console, alone, results)


def block_relay(lab: NatLab, cluster_dir: Path) -> list[str]:
    """Home's router refuses the relay's port; the grant gets the backbone as an entry point."""
    info_path = cluster_dir / "keys" / "swarm-info.json"
    info = json.loads(info_path.read_text())
    run = json.loads((cluster_dir / "run.json").read_text())
    info["initialPeers"] = list(dict.fromkeys(info["initialPeers"] + run["initialPeers"]))
    info_path.write_text(json.dumps(info, indent=2))
    port = info["relays"][0].split("/tcp/")[1].split("/")[0]
    rule = ["FORWARD", "-d", lab.cluster_ip, "-p", "tcp", "--dport", port, "-j", "REJECT", "--reject-with", "tcp-reset"]
    lab.run(lab.nat, ["iptables", "-w", "-I", *rule])
    return rule


def report(console: Console, alone: Optional[dict], results: dict[str, dict[str, Any]]) -> None:
    table = Table(title="hivekeeper join: seconds since the command started")
    for column in ("mode", *MILESTONES):
        table.add_column(column, justify="left" if column == "mode" else "right")
    for mode, result in results.items():
        seconds = result.get("seconds", {})
        table.add_row(f"{mode} ({result.get('mode')})", *(str(seconds.get(m, "-")) for m in MILESTONES))
    Console().print(table)
    relayed = results.get("relay", {}).get("withVolunteer")
    throughput_table = Table(title="collaboration throughput (samples/s from optimizer steps; reported rates)")
    for column in ("configuration", "steps x batch / s", "reported (median)", "window s"):
        throughput_table.add_column(column)
    rows = [("anchor: cluster alone (1 trainer)", alone)]
    rows += [(f"+ {mode} volunteer", result.get("withVolunteer")) for mode, result in results.items()]
    for label, figures in rows:
        if figures:
            throughput_table.add_row(label, str(figures["stepsSamplesPerSecond"]),
                                     str(figures["reportedSamplesPerSecond"]), str(figures["seconds"]))
    Console().print(throughput_table)
    added = (relayed["stepsSamplesPerSecond"] - alone["stepsSamplesPerSecond"]) if relayed and alone else None
    print(json.dumps({"joins": results, "alone": alone, "withRelayedVolunteer": relayed,
                      "addedSamplesPerSecond": added}, indent=2))
    write_results("join", anchor="the cluster alone (1 trainer, same machine): collaboration samples/s from "
                  "optimizer steps x targetBatchSize", joins=results, alone=alone, withRelayedVolunteer=relayed,
                  addedSamplesPerSecond=added)


if __name__ == "__main__":
    main()
