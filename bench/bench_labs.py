"""Two labs pooling compute across a WAN: lab A alone against labs A and B together, in
`gradients` mode (with and without the averaging plan) and in `diloco` mode, at 1 Gbit/s,
100 Mbit/s and 20 Mbit/s with a 40 ms round trip.

Anchor: lab A alone, the same manifest on the same machine. The figure is the ratio of A+B's
samples/s to A's. Goals (issue 29): at least 1.8x at 100 Mbit/s in gradients mode, and at
least 1.8x at 20 Mbit/s with diloco, each lab with equal simulated compute and a step sized so
that compute dominates (as in DeDLOC, whose steps take minutes).

Setup (as root): tests/netns.py's WanLab, two lab namespaces joined by a WAN namespace whose
links are delayed (20 ms each way, bench/wandelay: this kernel has no netem) and capped (tc tbf).
Lab A runs `hivekeeper up` (its backbone, token service, relay, monitor, balancer and
--trainers-a trainers); lab B's --trainers-b trainers join it across the WAN with `hivekeeper
join` and invites A minted, as a lab's pods join a host (they take the host's task and
settings from its token service). Every trainer's compute is simulated (bench/simulated_task.py:
a sleep per sample, a model of --parameters floats), so the two shared cores run every
trainer's compute at once, as two clusters' GPUs would, and what the WAN and the coordination
cost shows against it.

Equal work. gradients: both arms run --steps optimizer steps of targetBatchSize samples,
timed from the monitor's first record of step s0 to its first record of step s0 + steps (after
--warmup steps; B's trainers all in). diloco: A alone runs twice the outer steps of A+B, since
an outer step of A+B takes twice the replicas' inner steps; samples are those computed between
the two outer-step boundaries (every one enters an outer step). The WAN's bytes are counted
over the same window. A+B is one run per mode and plan, measured at each rate in turn (the tc
settings change between windows); A alone does not cross the WAN and runs once per mode and
plan. --repeats runs everything again; the table gives the median and the range.

    sudo .venv/bin/python bench/bench_labs.py [--repeats 2] [--rates 1000,100,20]

Writes bench/results/labs.json."""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Optional

import yaml
from rich.console import Console
from rich.table import Table

from bench_results import write_results
from hivekeeper.local.runner import read_history

REPO = Path(__file__).resolve().parents[1]
BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(REPO / "tests"))
from netns import WanLab  # noqa: E402  (the two-lab network the tests can use too)

NAME = "labs"
RTT_MS = 40.0
GATEWAY_PORT, RELAY_PORT = 31336, 31337
console = Console(stderr=True)


def manifest(args: argparse.Namespace, mode: str, plan: bool, b_identities: list[str]) -> dict[str, Any]:
    averaging: dict[str, Any] = {"mode": mode, "matchmakingSeconds": 2.0, "timeoutSeconds": 60}
    if mode == "gradients":
        averaging["averageStateEvery"] = args.average_state_every
    else:
        averaging["innerSteps"] = args.inner_steps
    return {
        "apiVersion": "hivekeeper.dev/v1alpha1", "kind": "Swarm", "metadata": {"name": NAME},
        "spec": {
            "task": {"name": "simulated_task:make",
                     "options": {"parameters": args.parameters, "secondsPerSample": args.seconds_per_sample}},
            "optimizer": {"name": "sgd", "learningRate": 0.01},
            "targetBatchSize": args.target_batch,
            "trainers": {"replicas": args.trainers_a, "batchSize": args.batch_size},
            "auxiliary": {"replicas": 0},
            "balancer": {"enabled": plan},
            "averaging": averaging,
            "monitor": {"evalEverySteps": 1_000_000, "checkpointEverySteps": 1_000_000},
            "stopping": {"targetSteps": 1_000_000, "targetMetric": None},
            "volunteers": {"enabled": True, "relays": 1, "relayPort": RELAY_PORT, "gatewayPort": GATEWAY_PORT,
                           "allowlist": b_identities},
        },
    }


def progress(entry: dict[str, Any], mode: str) -> int:
    return (entry.get("outerSteps") or 0) if mode == "diloco" else entry.get("globalStep", 0)


def wait_for(condition, timeout: float, what: str, processes: list[subprocess.Popen]):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        for process in processes:
            if process.poll() is not None:
                raise RuntimeError(f"{what}: {' '.join(map(str, process.args[-6:]))} exited with {process.returncode}")
        time.sleep(0.5)
    raise RuntimeError(f"timed out after {timeout:.0f}s waiting for {what}")


class Arm:
    """One run of lab A (and lab B joined to it, if `joined`)."""

    def __init__(self, lab: WanLab, work: Path, args: argparse.Namespace, mode: str, plan: bool, joined: bool):
        self.lab, self.args, self.mode = lab, args, mode
        self.identities = [f"lab-b-{i}" for i in range(args.trainers_b)]
        self.dir = work / f"{mode}-{'plan' if plan else 'noplan'}-{'ab' if joined else 'a'}-{int(time.time())}"
        self.dir.mkdir(parents=True)
        path = self.dir / "manifest.yaml"
        path.write_text(yaml.safe_dump(manifest(args, mode, plan, self.identities)))
        self.env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(BENCH), os.environ.get("PYTHONPATH")]))}
        self.run_dir = self.dir / "a"
        self.processes = [self._hivekeeper(lab.a, "a.log", "up", str(path), "--run-dir", str(self.run_dir),
                                           "--host", lab.a_ip)]
        self.trainers = args.trainers_a + (args.trainers_b if joined else 0)
        if joined:  # B joins a running swarm, as a lab joins a host
            wait_for(lambda: self.latest().get("peersAlive", {}).get("trainer", 0) >= args.trainers_a, 600,
                     "lab A's trainers", self.processes)
            for identity in self.identities:
                invite = subprocess.run([sys.executable, "-m", "hivekeeper", "invite", str(self.run_dir), "--identity",
                                         identity], capture_output=True, text=True, check=True, env=self.env).stdout.strip()
                self.processes.append(self._hivekeeper(
                    lab.b, f"{identity}.log", "join", f"{lab.a_ip}:{GATEWAY_PORT}", "--token", invite,
                    "--run-dir", str(self.dir / identity), "--host", lab.b_ip, "--mode", "direct"))

    def _hivekeeper(self, ns: str, log: str, *argv: str) -> subprocess.Popen:
        return self.lab.popen(ns, [sys.executable, "-m", "hivekeeper", *argv], env=self.env,
                              stdout=open(self.dir / log, "wb"), stderr=subprocess.STDOUT)

    def latest(self) -> dict[str, Any]:
        entries = read_history(self.run_dir)
        return entries[-1] if entries else {}

    def warm(self) -> None:
        """Every trainer in, then --warmup steps taken with all of them."""
        wait_for(lambda: self.latest().get("peersAlive", {}).get("trainer", 0) >= self.trainers, 600,
                 f"all {self.trainers} trainers", self.processes)
        start = progress(self.latest(), self.mode)
        wait_for(lambda: progress(self.latest(), self.mode) >= start + self.args.warmup, 900, "the warm-up steps",
                 self.processes)

    def first_at(self, step: int) -> Optional[dict[str, Any]]:
        """The monitor's first record of `step` (its records come about once a second)."""
        return next((e for e in read_history(self.run_dir) if progress(e, self.mode) >= step), None)

    def measure(self, steps: int) -> dict[str, Any]:
        """Samples/s over `steps` steps (outer steps in diloco) from the next step boundary."""
        begin = progress(self.latest(), self.mode) + 1
        first = wait_for(lambda: self.first_at(begin), 900, f"step {begin}", self.processes)
        bytes_before = self.lab.wan_bytes()
        last = wait_for(lambda: self.first_at(begin + steps), 600 + steps * 300, f"step {begin + steps}",
                        self.processes)
        bytes_after = self.lab.wan_bytes()
        seconds = last["time"] - first["time"]
        taken = progress(last, self.mode) - progress(first, self.mode)
        computed = last["samples"] - first["samples"]
        applied = taken * self.args.target_batch if self.mode == "gradients" else computed
        return {"steps": taken, "seconds": round(seconds, 1), "samplesApplied": applied, "samplesComputed": computed,
                "samplesPerSecond": round(applied / seconds, 1), "wanBytes": bytes_after - bytes_before,
                "trainers": (last.get("peersAlive") or {}).get("trainer"), "labs": last.get("labs")}

    def stop(self) -> None:
        for process in reversed(self.processes):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGINT)
        for process in self.processes:
            try:
                process.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(10)


def link_check(lab: WanLab, mbit: float) -> dict[str, float]:
    """What the shaped WAN carries: a TCP connection's round trip and one bulk transfer's rate."""
    server = ("import socket\ns=socket.socket();s.setsockopt(socket.SOL_SOCKET,socket.SO_REUSEADDR,1)\n"
              "s.bind(('0.0.0.0',5301));s.listen()\nc,_=s.accept();c.close()\nc,_=s.accept()\n"
              "while c.recv(1<<20): pass\nc.sendall(b'k')")
    megabytes = max(2, int(mbit / 8 * 3))  # about 3 s at the cap
    client = (f"import socket,time\nt=time.perf_counter();s=socket.create_connection(('{lab.b_ip}',5301))\n"
              f"rtt=time.perf_counter()-t;s.close();s=socket.create_connection(('{lab.b_ip}',5301))\n"
              f"t=time.perf_counter();s.sendall(b'x'*({megabytes}<<20));s.shutdown(1);s.recv(1)\n"
              f"print(rtt*1000,{megabytes}*8*1.048576/(time.perf_counter()-t))")
    listener = lab.popen(lab.b, [sys.executable, "-c", server])
    try:
        time.sleep(1.0)
        rtt, rate = map(float, lab.run(lab.a, [sys.executable, "-c", client]).stdout.split())
    finally:
        listener.kill()
        listener.wait(10)
    return {"rttMs": round(rtt, 1), "bulkMbit": round(rate, 1)}


def run_once(lab: WanLab, work: Path, args: argparse.Namespace, rates: list[float],
             measured: Callable[[dict[str, Any]], None]) -> list[dict[str, Any]]:
    """Every arm once; `measured` sees each row as it is measured."""
    rows = []
    arms = [("gradients", True), ("gradients", False), ("diloco", False)]
    for mode, plan in arms:
        if mode not in args.modes:
            continue
        steps_ab = args.steps
        steps_a = steps_ab * 2 if mode == "diloco" else steps_ab
        console.print(f"{mode}, plan {'on' if plan else 'off'}: lab A alone...")
        lab.shape(rates[0], RTT_MS)
        arm = Arm(lab, work, args, mode, plan, joined=False)
        try:
            arm.warm()
            alone = arm.measure(steps_a)
        finally:
            arm.stop()
        console.print(f"  A alone: {alone['samplesPerSecond']} samples/s over {alone['seconds']} s")
        arm = Arm(lab, work, args, mode, plan, joined=True)
        try:
            arm.warm()
            for mbit in rates:
                lab.shape(mbit, RTT_MS)
                arm.measure(1)  # a step at the new rate before the window
                pooled = arm.measure(steps_ab)
                ratio = round(pooled["samplesPerSecond"] / alone["samplesPerSecond"], 2)
                console.print(f"  A+B at {mbit:g} Mbit/s: {pooled['samplesPerSecond']} samples/s ({ratio}x)")
                rows.append({"mode": mode, "plan": plan, "mbit": mbit, "alone": alone, "pooled": pooled,
                             "ratio": ratio})
                measured(rows[-1])
        finally:
            arm.stop()
    return rows


def summarize(runs: list[list[dict[str, Any]]]) -> list[dict[str, Any]]:
    keyed: dict[tuple, list[dict[str, Any]]] = {}
    for rows in runs:
        for row in rows:
            keyed.setdefault((row["mode"], row["plan"], row["mbit"]), []).append(row)
    summary = []
    for (mode, plan, mbit), rows in keyed.items():
        ratios = [r["ratio"] for r in rows]
        summary.append({
            "mode": mode, "plan": plan, "mbit": mbit, "repeats": len(rows),
            "aloneSamplesPerSecond": statistics.median(r["alone"]["samplesPerSecond"] for r in rows),
            "pooledSamplesPerSecond": statistics.median(r["pooled"]["samplesPerSecond"] for r in rows),
            "ratioMedian": statistics.median(ratios), "ratioMin": min(ratios), "ratioMax": max(ratios),
            "wanMegabytesPerStep": round(statistics.median(r["pooled"]["wanBytes"] / max(1, r["pooled"]["steps"])
                                                           for r in rows) / 1e6, 1),
        })
    return summary


GOALS = {("gradients", 100.0): 1.8, ("diloco", 20.0): 1.8}


def report(summary: list[dict[str, Any]], links: dict[float, dict[str, float]], args: argparse.Namespace) -> None:
    table = Table(title=f"lab A alone vs A+B across a {RTT_MS:g} ms WAN ({args.trainers_a}+{args.trainers_b} trainers, "
                        f"{args.parameters / 1e6:g}M parameters, {args.seconds_per_sample * 1e3:g} ms/sample simulated)")
    for column in ("mode", "plan", "WAN Mbit/s", "link: bulk Mbit/s, rtt ms", "A samples/s", "A+B samples/s",
                   "A+B / A (median, range)", "WAN MB/step", "goal"):
        table.add_column(column, justify="right")
    for row in summary:
        goal = GOALS.get((row["mode"], row["mbit"]))
        link = links.get(row["mbit"], {})
        table.add_row(row["mode"], "on" if row["plan"] else "off", f"{row['mbit']:g}",
                      f"{link.get('bulkMbit', '-')}, {link.get('rttMs', '-')}",
                      str(row["aloneSamplesPerSecond"]), str(row["pooledSamplesPerSecond"]),
                      f"{row['ratioMedian']} ({row['ratioMin']}-{row['ratioMax']}, n={row['repeats']})",
                      str(row["wanMegabytesPerStep"]),
                      "-" if goal is None else f">= {goal} {'met' if row['ratioMin'] >= goal else 'NOT met'} in every run")
    Console(width=220).print(table)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="1000,100,20", help="WAN caps in Mbit/s, measured in this order")
    parser.add_argument("--modes", default="gradients,diloco")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--trainers-a", type=int, default=2)
    parser.add_argument("--trainers-b", type=int, default=2)
    parser.add_argument("--parameters", type=int, default=2_000_000, help="model size (floats)")
    parser.add_argument("--seconds-per-sample", type=float, default=0.025, help="simulated compute per sample")
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--target-batch", type=int, default=2400,
                        help="gradients: samples per optimizer step (A alone: about 30 s of compute)")
    parser.add_argument("--average-state-every", type=int, default=5, help="gradients: parameter rounds every N steps")
    parser.add_argument("--inner-steps", type=int, default=75, help="diloco: H (about 30 s of compute per outer step)")
    parser.add_argument("--steps", type=int, default=3, help="steps (A+B's outer steps in diloco) per window")
    parser.add_argument("--warmup", type=int, default=1)
    args = parser.parse_args()
    args.modes = args.modes.split(",")
    rates = [float(r) for r in args.rates.split(",")]
    with tempfile.TemporaryDirectory(prefix="bench-labs-") as tmp, WanLab() as lab:
        links = {}
        for mbit in rates:
            lab.shape(mbit, RTT_MS)
            links[mbit] = link_check(lab, mbit)
            console.print(f"WAN at {mbit:g} Mbit/s: {links[mbit]}")
        runs: list[list[dict[str, Any]]] = []

        def save(complete: bool) -> list[dict[str, Any]]:
            """The results so far: a run cut short keeps the rows it measured (`complete` false)."""
            summary = summarize(runs)
            write_results(NAME, anchor="lab A alone (same manifest, same machine): samples/s over equal applied work",
                          complete=complete, summary=summary, runs=runs, links={str(k): v for k, v in links.items()},
                          settings=vars(args), rttMs=RTT_MS)
            return summary

        for repeat in range(args.repeats):
            console.print(f"repeat {repeat + 1} of {args.repeats}")
            runs.append([])
            run_once(lab, Path(tmp), args, rates, lambda row: (runs[-1].append(row), save(complete=False)))
    summary = save(complete=True)
    report(summary, links, args)
    print(json.dumps({"summary": summary, "links": links, "settings": vars(args)}, indent=2))


if __name__ == "__main__":
    main()
