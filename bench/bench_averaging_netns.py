"""Averaging round time on shaped links: the planner's shares against hivemind's split,
equal shares (all-reduce) and a parameter server, with real hivemind all-reduce.

Anchors: (1) the planner's own prediction, `averagingSeconds` of `hivekeeper plan averaging`
(P * bytes over the aggregation rate), from measured inputs as a running swarm's balancer
has them; the aim is the measurement within 30 % of it. (2) DeDLOC (section 3.2,
fig. 3): under heterogeneous bandwidth, adaptive averaging beats both all-reduce and a
parameter server.

Setup (as root): one network namespace per peer plus a hub namespace holding a bridge,
veth pairs between them, addresses in 10.77.0.0/24 inside those namespaces only, nothing
added to the host's namespace. Each peer's link is shaped with tc tbf both ways (its upload
on its own end, its download on the hub's end): FAST peers at --fast-mbps, SLOW at
--slow-mbps. One hivemind averager per namespace (bench/averaging_netns_worker.py; peer 0
is the DHT bootstrap), all in one group, averaging --numel float32 per round. Namespaces and
the processes inside them are removed on exit, error or signal.

Inputs. The declared tc rates overstate what averaging's payload gets through TCP and
libp2p (headers, framing, retransmissions: the links carry about 1.1 bytes per payload byte
here), so the planner gets u_i, d_i as a swarm's peers measure them
(`hivekeeper.runtime.bandwidth`), the best observation each way, every observation being a
lower bound of the capacity:
  probe    each peer in turn sends --probe-bytes while fetching as many back, over the
           transport averaging uses: to peer 0, and peer 0 to peer 1. A probe is also bounded
           by the other end's link; peers 0 and 1 are fast peers, as fast as any here, so a
           probe measures the prober's own link (a peer faster than its partner would read
           low: a lower bound, as every observation).
  warm-up  --warmup rounds on hivemind's split with no bandwidth typed in (a swarm's rounds
           before its first plan): payload bytes each way over the peer's own all-reduce time,
           counted as the balancer counts them; the tbf counters' rates are reported beside.
Every arrangement gets two predictions, from the declared rates and from the measured inputs.

Arrangements, interleaved round by round, medians over --rounds (all of them, also the rounds
where hivemind lost a part; the worker logs' all-reduce errors come with the result):
  plan        the planner's shares from the measured inputs (equal compute, everyone computes)
  hivemind    hivemind's own split, `load_balance_peers` fed each peer's declared bandwidth,
              run by hivemind's own code path. Its peers without a share get client treatment:
              results only after they have sent everything, so their upload and download add
              up, which the planner's model (both at once) does not describe.
  equal       equal shares: hivemind's split when no bandwidth is typed in (its default)
  server      one fast peer aggregates everything (parameter server)
Round time: from the first peer's start of all-reduce to the last peer's end (matchmaking
excluded); all namespaces share one clock. Every round checks the exact mean on every peer,
and the tbf counters give the bytes each link carried. Now and then hivemind loses a part: a
reducer's result stream ends one or two parts short ("sent 29 parts, but we expected 30")
with no error logged at either end, the receiver a peer with a slow download; it hits the
equal, hivemind and plan splits alike, so it does not come from the plan's shares.

Steps. The bench also reports predicted against achieved steps/s (efficiency). A round is
a step whose batches are all ready at once (no compute): from the command that triggers every
peer to the last peer's average. Its prediction is the planner's transfer time for the
arrangement plus the fixed cost (`planning/step_time.py`) measured in the warm-up rounds as a
swarm's peers measure it (the wait before the all-reduce) and held against every other
arrangement.

Transport. Planned rounds (plan, equal, server) run hivekeeper's runner, which keeps each
flow's unanswered parts within a window so that the answers clock the uploads (see
`hivekeeper.hivemind_ext.allreduce`, "Flow window"); the hivemind arrangement runs
hivemind's own. Without the window, a slow peer's averages come back slower than it uploads
(TCP splits its upload unevenly among its flows, and an aggregator answers part k only when
every sender's part k is in), the rest arriving after its upload has ended, and planned rounds
take 1.2-1.4x the prediction. A parameter server hardly shows it: each sender has one flow.

Sizes. The defaults (4 x 40 and 4 x 8 Mbit/s, 2M floats) keep the network, not the two
shared CPU cores, the bottleneck: at 200/20 Mbit/s a round on 2 cores is as much CPU as transfer.
With 4 fast and 4 slow peers the fast/slow ratio 5 also separates the baselines (at 200/20
the parameter server ties the plan: each slow peer must move its vector once either way).
Parts of 32 KiB instead of hivemind's 512 KiB: a part is the unit every aggregator waits for
from all senders, and at 2 Mbit/s per flow 512 KiB take 2 s.

    sudo PYTHONPATH=services .venv/bin/python bench/bench_averaging_netns.py [--rounds 8]
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import platform
import queue
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "services"))

from hivekeeper.planning.averaging_lp import (  # noqa: E402
    AveragingPlan,
    AveragingProblem,
    PeerCapacity,
    plan_averaging,
    plan_for_roles,
    throughput_of,
)
from hivekeeper.planning.step_time import FixedCosts, predict_step  # noqa: E402
from hivekeeper.runtime.bandwidth import PROBE_BYTES, Rates  # noqa: E402
from hivekeeper.hivemind_ext.allreduce import shares_by_peer_id  # noqa: E402

RESULTS = REPO / "bench" / "results" / "averaging_netns.json"
WORKER = REPO / "bench" / "averaging_netns_worker.py"
SUBNET = "10.77.0"
ARRANGEMENTS = ("plan", "hivemind", "equal", "server")
SAMPLES_PER_SECOND, TARGET_BATCH = 16.0, 1024  # equal compute, small enough that every peer computes


# --- namespaces ------------------------------------------------------------------------------


def sh(*command: str) -> None:
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)


class Network:
    """Namespaces hkbench-<pid>-hub and hkbench-<pid>-p<k>; `close` is idempotent."""

    def __init__(self, rates_mbps: list[float], queue_ms: float = 50.0):
        self.queue_ms = queue_ms
        self.prefix = f"hkbench-{os.getpid()}"
        self.hub = f"{self.prefix}-hub"
        self.peers = [f"{self.prefix}-p{k}" for k in range(len(rates_mbps))]
        self.addresses = [f"{SUBNET}.{k + 1}" for k in range(len(rates_mbps))]
        self.created: list[str] = []
        self.closed = False
        atexit.register(self.close)
        self._create(rates_mbps)

    def _add(self, name: str) -> None:
        sh("ip", "netns", "add", name)
        self.created.append(name)
        sh("ip", "-n", name, "link", "set", "lo", "up")

    def _create(self, rates_mbps: list[float]) -> None:
        self._add(self.hub)
        sh("ip", "-n", self.hub, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.hub, "link", "set", "br0", "up")
        for k, (name, address, mbps) in enumerate(zip(self.peers, self.addresses, rates_mbps)):
            self._add(name)
            port = f"hkport{k}"  # no prefix of an `ip link` keyword (`he` would read as `help`)
            # both ends are created inside the namespaces: the host's namespace never sees them
            sh("ip", "-n", self.hub, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", name)
            sh("ip", "-n", self.hub, "link", "set", port, "master", "br0", "up")
            sh("ip", "-n", name, "addr", "add", f"{address}/24", "dev", "eth0")
            sh("ip", "-n", name, "link", "set", "eth0", "up")
            self._shape(name, "eth0", mbps)  # the peer's upload
            self._shape(self.hub, port, mbps)  # the peer's download

    def _shape(self, namespace: str, device: str, mbps: float) -> None:
        burst = max(32_000, int(mbps * 1e6 / 8 * 0.004))  # 4 ms at line rate, at least 32 kB
        sh("ip", "netns", "exec", namespace, "tc", "qdisc", "add", "dev", device, "root", "tbf",
           "rate", f"{mbps}mbit", "burst", str(burst), "latency", f"{self.queue_ms:g}ms")

    def sent_bytes(self) -> list[tuple[int, int]]:
        """(upload, download) bytes each peer's link has carried so far, from the tbf counters."""

        def sent(namespace: str, device: str) -> int:
            stats = subprocess.run(["ip", "netns", "exec", namespace, "tc", "-s", "qdisc", "show", "dev", device],
                                   capture_output=True, text=True, check=True).stdout
            return int(stats.split(" Sent ", 1)[1].split()[0])

        return [(sent(name, "eth0"), sent(self.hub, f"hkport{k}")) for k, name in enumerate(self.peers)]

    def exec_prefix(self, k: int) -> list[str]:
        return ["ip", "netns", "exec", self.peers[k]]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        for name in reversed(self.created):
            # whatever still runs in our namespaces is ours (workers, their p2pd): end it by pid
            pids = subprocess.run(["ip", "netns", "pids", name], capture_output=True, text=True).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            subprocess.run(["ip", "netns", "del", name], stderr=subprocess.DEVNULL)


# --- workers ---------------------------------------------------------------------------------


class Worker:
    def __init__(self, network: Network, rank: int, args, initial_peers: list[str], log_dir: Path):
        env = dict(os.environ, PYTHONPATH=str(REPO / "services"), OMP_NUM_THREADS="1",
                   HIVEMIND_LOGLEVEL=os.environ.get("HIVEMIND_LOGLEVEL", "WARNING"))
        command = [*network.exec_prefix(rank), "nice", "-n", str(args.nice), sys.executable, str(WORKER),
                   "--ip", network.addresses[rank], "--rank", str(rank), "--peers", str(len(network.peers)),
                   "--numel", str(args.numel), "--part-bytes", str(args.part_bytes),
                   "--initial-peers", json.dumps(initial_peers)]
        self.log = open(log_dir / f"worker{rank}.log", "w")
        self.process = subprocess.Popen(command, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self.log,
                                        text=True, cwd=REPO, env=env)
        self.lines: queue.Queue[dict] = queue.Queue()
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        for line in self.process.stdout:
            try:
                self.lines.put(json.loads(line))
            except json.JSONDecodeError:
                continue

    def send(self, message: dict) -> None:
        self.process.stdin.write(json.dumps(message) + "\n")
        self.process.stdin.flush()

    def receive(self, timeout: float) -> dict:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                return self.lines.get(timeout=1.0)
            except queue.Empty:
                if self.process.poll() is not None and self.lines.empty():
                    raise RuntimeError(f"worker exited with code {self.process.returncode}; see {self.log.name}")
        raise TimeoutError(f"worker {self.process.pid} sent nothing in {timeout:.0f} s; see {self.log.name}")

    def stop(self) -> None:
        if self.process.poll() is None:
            try:
                self.send({"cmd": "quit"})
                self.process.wait(timeout=20)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self.log.close()


# --- the run ---------------------------------------------------------------------------------


def problem_for(names: list[str], upload_mbps: list[float], download_mbps: list[float],
                numel: int) -> AveragingProblem:
    return AveragingProblem(
        target_batch_size=TARGET_BATCH, num_parameters=numel,
        peers=[PeerCapacity(name, SAMPLES_PER_SECOND, up, down)
               for name, up, down in zip(names, upload_mbps, download_mbps)],
    )


def planned_shares(problem: AveragingProblem) -> tuple[AveragingPlan, list[float]]:
    plan = plan_averaging(problem)
    if not all(role.computes_gradients for role in plan.peers):  # compare shares under the same roles
        plan = plan_for_roles(problem, {peer.name: True for peer in problem.peers})
    by_name = {role.name: role.aggregation_share for role in plan.peers}
    return plan, [by_name[peer.name] for peer in problem.peers]


def predicted_seconds(problem: AveragingProblem, fractions: list[float]) -> float:
    """The planner's averagingSeconds for fixed shares, everyone computing."""
    names = [peer.name for peer in problem.peers]
    return throughput_of(problem, dict.fromkeys(names, True), dict(zip(names, fractions))).averaging_seconds


def payload_bytes(elements: list[int], numel: int, bytes_per_element: float = 4.0) -> list[float]:
    """Bytes each peer moves each way in a round where peer i aggregates elements[i], everyone
    sending: its vector less its own part out and the averages back, the others' shares of its
    part in and their averages out (the balancer counts a round's bytes the same way)."""
    n = len(elements)
    return [(numel - e + (n - 1) * e) * bytes_per_element for e in elements]


def mbps(bytes_per_second: float) -> float:
    return bytes_per_second * 8 / 1e6


def probe_all(workers: list[Worker], peer_ids: list[str], size: int) -> list[Rates]:
    """Peer 0 probes peer 1, every other peer probes peer 0, one at a time so that no two
    probes share a link."""
    rates = []
    for k, worker in enumerate(workers):
        worker.send({"cmd": "probe", "peer": peer_ids[1 if k == 0 else 0], "size": size})
        reply = worker.receive(timeout=120)
        if "error" in reply:
            raise RuntimeError(f"peer {k}: {reply['error']}")
        rates.append(Rates(reply["upload"], reply["download"]))
    return rates


def run_round(workers: list[Worker], network: Network, args, index: int, arrangement: str,
              shares: dict | None, declared_mbps: list[float], warmup: bool) -> dict:
    counters = network.sent_bytes()
    sent = time.time()
    command = {"cmd": "round", "round": index, "scheduled_time": sent + args.matchmaking_seconds, "shares": shares}
    for worker, rate in zip(workers, declared_mbps):
        worker.send({**command, "bandwidth": rate if arrangement == "hivemind" else None})
    replies = [worker.receive(timeout=args.round_timeout) for worker in workers]
    moved = [(up - up0, down - down0) for (up, down), (up0, down0) in zip(network.sent_bytes(), counters)]
    errors = [reply["error"] for reply in replies if "error" in reply]
    if errors:
        raise RuntimeError(f"round {index} ({arrangement}) failed: {errors[0]}")
    planned = {reply["planned"] for reply in replies}
    assert planned == {shares is not None}, f"round {index}: {arrangement} ran with planned={planned}"
    max_error = max(reply["maxError"] for reply in replies)
    payload = payload_bytes([reply["elements"] for reply in replies], args.numel)
    return {"arrangement": arrangement, "warmup": warmup,
            "seconds": max(r["finished"] for r in replies) - min(r["started"] for r in replies),
            # a step of a swarm whose batches are all ready at once: from the peers' trigger (the
            # command) to the last peer's average; its fixed part is the wait before the all-reduce
            "stepSeconds": max(r["finished"] for r in replies) - sent,
            "waitSeconds": min(r["started"] for r in replies) - sent,
            # hivemind can finish a round with parts missing (it logs "received 98% results" and
            # keeps the local values there); the worker logs show why (allreduceFailures)
            "exact": max_error < 1e-4, "maxError": max_error,
            "missingElements": [reply.get("missingElements", 0) for reply in replies],
            "peerSeconds": [round(r["finished"] - r["started"], 3) for r in replies],
            "elements": [reply["elements"] for reply in replies],
            "payloadBytes": payload, "linkBytes": moved,
            "wireOverhead": sum(u + d for u, d in moved) / (2 * sum(payload)),
            "loadAverage": os.getloadavg()[0]}


def describe(record: dict, predicted: dict[str, float]) -> str:
    guesses = "; ".join(f"{seconds:.2f} s from {inputs} rates" for inputs, seconds in predicted.items())
    inexact = "" if record["exact"] else f"; NOT EXACT, off by {record['maxError']:.3g}"
    return (f"  round {'warm-up' if record['warmup'] else 'measured':8s} {record['arrangement']:9s}"
            f"{record['seconds']:6.2f} s  (predicted {guesses}{inexact}; "
            f"load {record['loadAverage']:.1f}; slowest peer {max(record['peerSeconds']):.2f} s; "
            f"wire/payload {record['wireOverhead']:.2f})")


def achieved_rates(warmup: list[dict], peers: int, key: str) -> list[Rates]:
    """The best rate each peer achieved in the warm-up rounds: `key` bytes ("payloadBytes", the same
    each way, or "linkBytes", the tbf counters' (up, down)) over its all-reduce's duration. Rounds
    that lost a part count too: a swarm's peer cannot tell them, and they moved all but that part."""
    best = [Rates(0.0, 0.0)] * peers
    for record in warmup:
        for k, (moved, seconds) in enumerate(zip(record[key], record["peerSeconds"])):
            up, down = (moved, moved) if key == "payloadBytes" else moved
            best[k] = Rates(max(best[k].upload, up / seconds), max(best[k].download, down / seconds))
    return best


def allreduce_failures(log_dir: Path, peers: int) -> list[str]:
    """Why parts went missing: the workers log hivemind's all-reduce errors (its DEBUG lines
    "Caught ... when communicating") and the p2p layer's; one entry per line, per worker."""
    found = []
    for k in range(peers):
        for line in (log_dir / f"worker{k}.log").read_text(errors="replace").splitlines():
            if "Caught" in line or "Exception while" in line or "Handler failed" in line:
                found.append(f"worker{k}: {line.strip()[:400]}")
    return found


def run(args) -> dict:
    from hivemind.averaging.load_balancing import load_balance_peers

    names = [f"fast{k}" for k in range(args.fast)] + [f"slow{k}" for k in range(args.slow)]
    declared = [args.fast_mbps] * args.fast + [args.slow_mbps] * args.slow
    declared_problem = problem_for(names, declared, declared, args.numel)
    declared_plan, declared_plan_fractions = planned_shares(declared_problem)
    fractions = {
        "hivemind": [e / args.numel for e in load_balance_peers(args.numel, declared)],
        "equal": [1 / len(names)] * len(names),
        "server": [1.0 if k == 0 else 0.0 for k in range(len(names))],
    }
    print(f"{len(names)} peers ({args.fast} x {args.fast_mbps:g} Mbit/s, {args.slow} x {args.slow_mbps:g} Mbit/s), "
          f"{args.numel:,} float32 ({args.numel * 4 / 1e6:.1f} MB); plan from declared rates "
          f"({declared_plan.method}, {declared_plan.averaging_seconds:.2f} s): "
          + ", ".join(f"{n} {f:.3f}" for n, f in zip(names, declared_plan_fractions)), flush=True)

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    network = Network(declared, args.queue_ms)
    workers: list[Worker] = []
    try:
        workers.append(Worker(network, 0, args, [], log_dir))
        first = workers[0].receive(timeout=120)
        for k in range(1, len(names)):
            workers.append(Worker(network, k, args, first["maddrs"], log_dir))
        ready = [first] + [worker.receive(timeout=180) for worker in workers[1:]]
        peer_ids = [message["ready"] for message in ready]

        probes = probe_all(workers, peer_ids, args.probe_bytes)
        print("probes (Mbit/s up/down): " + ", ".join(f"{n} {mbps(r.upload):.1f}/{mbps(r.download):.1f}"
                                                       for n, r in zip(names, probes)), flush=True)
        # warm-up: hivemind's own split with no bandwidth typed in, as a swarm runs before its first plan
        warmup = []
        for index in range(args.warmup):
            warmup.append(run_round(workers, network, args, index, "equal", None, declared, warmup=True))
            print(describe(warmup[-1], {"declared": predicted_seconds(declared_problem, fractions["equal"])}),
                  flush=True)
        achieved = achieved_rates(warmup, len(names), "payloadBytes")
        measured = [Rates(max(p.upload, a.upload), max(p.download, a.download)) for p, a in zip(probes, achieved)]
        measured_problem = problem_for(names, [mbps(r.upload) for r in measured],
                                       [mbps(r.download) for r in measured], args.numel)
        plan, fractions["plan"] = planned_shares(measured_problem)
        print(f"plan from measured rates ({plan.method}, {plan.averaging_seconds:.2f} s): "
              + ", ".join(f"{n} {f:.3f}" for n, f in zip(names, fractions["plan"])), flush=True)
        problems = {"declared": declared_problem, "measured": measured_problem}
        predictions = {arrangement: {inputs: predicted_seconds(problem, fractions[arrangement])
                                     for inputs, problem in problems.items()} for arrangement in ARRANGEMENTS}
        # the fixed cost of a step, measured in the warm-up rounds (hivemind's equal split) as a
        # swarm's peers measure it, then held against the other arrangements (planning/step_time.py):
        # the wait before the all-reduce. The all-reduce's excess over the transfer model is not
        # fixed here (at these rates round trips are milliseconds): it depends on the split, and
        # it is the model's error, which the /meas column shows per arrangement.
        fixed = FixedCosts(wait=statistics.median(r["waitSeconds"] for r in warmup))
        print(f"fixed costs from the warm-up: wait {fixed.wait:.2f} s", flush=True)

        by_id = dict(zip(names, peer_ids))
        shares = {"plan": shares_by_peer_id(plan, by_id),
                  "server": {peer_id: share for peer_id, share in zip(peer_ids, fractions["server"])}}
        chosen = [a for a in ARRANGEMENTS if a in args.arrangements]
        rounds = []
        for r in range(args.rounds):
            for i in range(len(chosen)):
                arrangement = chosen[(r + i) % len(chosen)]
                rounds.append(run_round(workers, network, args, args.warmup + len(rounds), arrangement,
                                        shares.get(arrangement), declared, warmup=False))
                print(describe(rounds[-1], predictions[arrangement]), flush=True)
    finally:
        for worker in workers:
            worker.stop()
        network.close()

    summary = {}
    for arrangement in chosen:
        timed = [r for r in rounds if r["arrangement"] == arrangement]
        # every round counts, exact or not: a swarm's peer cannot tell them apart either
        median = statistics.median(r["seconds"] for r in timed)
        step = predict_step(0.0, 1 / predictions[arrangement]["measured"], fixed, overlap=False)  # no compute here
        achieved_step = statistics.median(r["stepSeconds"] for r in timed)
        summary[arrangement] = {
            "stepSeconds": achieved_step,
            "predictedStepSeconds": step.transfer + fixed.total,
            "achievedStepsPerSecond": 1 / achieved_step,
            "predictedStepsPerSecond": 1 / (step.transfer + fixed.total),
            "efficiency": (step.transfer + fixed.total) / achieved_step,
            "medianSeconds": median,
            "minSeconds": min(r["seconds"] for r in timed),
            "maxSeconds": max(r["seconds"] for r in timed),
            "slowestPeerMedianSeconds": statistics.median(max(r["peerSeconds"]) for r in timed),
            "rounds": len(timed),
            "inexactRounds": sum(not r["exact"] for r in timed),
            "missingElements": [sum(r["missingElements"]) for r in timed if not r["exact"]],
            "predictedSeconds": predictions[arrangement],
            "measuredOverPredicted": {inputs: median / seconds for inputs, seconds in predictions[arrangement].items()},
            "wireOverhead": statistics.median(r["wireOverhead"] for r in timed),  # link bytes over payload bytes
            "fractions": dict(zip(names, fractions[arrangement])),
            "elementsAggregated": dict(zip(names, timed[-1]["elements"])),
            "linkMegabytes": {name: {"up": round(statistics.median(r["linkBytes"][k][0] for r in timed) / 1e6, 2),
                                     "down": round(statistics.median(r["linkBytes"][k][1] for r in timed) / 1e6, 2)}
                              for k, name in enumerate(names)},
        }
    for arrangement in chosen:
        base = summary.get("plan", summary[chosen[0]])["medianSeconds"]
        summary[arrangement]["planSpeedup"] = summary[arrangement]["medianSeconds"] / base

    def pair(rates: Rates) -> dict:
        return {"up": round(mbps(rates.upload), 3), "down": round(mbps(rates.download), 3)}

    wire = achieved_rates(warmup, len(names), "linkBytes")
    return {
        "benchmark": "averaging_netns",
        "anchor": {
            "prediction": "planner's averagingSeconds (hivekeeper plan averaging) from measured inputs; "
                          "aim: measured within 30 %",
            "paper": "DeDLOC sec. 3.2 / fig. 3: adaptive averaging beats all-reduce and a parameter server "
                     "under heterogeneous bandwidth",
        },
        "setup": {
            "peers": [{"name": n, "uploadMbps": r, "downloadMbps": r} for n, r in zip(names, declared)],
            "numel": args.numel, "bytesPerElement": 4, "partSizeBytes": args.part_bytes,
            "rounds": args.rounds, "warmupRounds": args.warmup, "probeBytes": args.probe_bytes,
            "shaping": "tc tbf on both ends of each peer's veth (upload and download), bridge in a hub namespace",
            "plan": {"inputs": "measured", "method": plan.method, "averagingSeconds": plan.averaging_seconds,
                     "stepsPerSecond": plan.steps_per_second,
                     "computesGradients": {r.name: r.computes_gradients for r in plan.peers}},
            "declaredPlan": {"method": declared_plan.method, "averagingSeconds": declared_plan.averaging_seconds,
                             "fractions": dict(zip(names, declared_plan_fractions))},
            "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        },
        # Mbit/s; probe and warm-up rates count payload bytes, warmupWire the tbf counters
        "inputs": {name: {"declared": declared[k], "probe": pair(probes[k]), "warmup": pair(achieved[k]),
                          "warmupWire": pair(wire[k]), "measured": pair(measured[k])}
                   for k, name in enumerate(names)},
        "fixedCosts": fixed.to_json(),
        "summary": summary,
        "allreduceFailures": allreduce_failures(Path(args.log_dir), len(names)),
        "rounds": warmup + rounds,
    }


def print_table(result: dict) -> None:
    print()
    header = (f"{'peer':8s}{'declared':>10s}{'probe up/down':>16s}{'warm-up up/down':>18s}"
              f"{'(wire)':>14s}{'measured up/down':>19s}")
    print(header)
    print("-" * len(header))
    for name, row in result["inputs"].items():
        cells = [f"{row[key]['up']:.2f}/{row[key]['down']:.2f}"
                 for key in ("probe", "warmup", "warmupWire", "measured")]
        print(f"{name:8s}{row['declared']:10g}{cells[0]:>16s}{cells[1]:>18s}{cells[2]:>14s}{cells[3]:>19s}")
    print("Mbit/s; probe and warm-up: payload bytes over time (warm-up: over the peer's all-reduce, the best")
    print("warm-up round); (wire): the tbf counters in the warm-up; measured = max(probe, warm-up).")
    print()
    header = (f"{'arrangement':12s}{'shares fast/slow':>18s}{'pred decl s':>13s}{'pred meas s':>13s}"
              f"{'measured s':>12s}{'(min-max)':>14s}{'/decl':>7s}{'/meas':>7s}{'plan speedup':>14s}{'inexact':>9s}")
    print(header)
    print("-" * len(header))
    for arrangement, row in result["summary"].items():
        spread = f"{row['minSeconds']:.2f}-{row['maxSeconds']:.2f}"
        fast = [f for name, f in row["fractions"].items() if name.startswith("fast")]
        slow = [f for name, f in row["fractions"].items() if name.startswith("slow")]
        shares = "/".join(f"{min(group):.2f}" + (f"-{max(group):.2f}" if max(group) - min(group) >= 0.005 else "")
                          for group in (fast, slow) if group)
        predicted, ratio = row["predictedSeconds"], row["measuredOverPredicted"]
        print(f"{arrangement:12s}{shares:>18s}{predicted['declared']:13.2f}{predicted['measured']:13.2f}"
              f"{row['medianSeconds']:12.2f}{spread:>14s}{ratio['declared']:7.2f}{ratio['measured']:7.2f}"
              f"{row['planSpeedup']:13.2f}x{row['inexactRounds']:>5d}/{row['rounds']}")
    print()
    print("pred decl / pred meas: the planner's averagingSeconds for the arrangement's shares from the declared")
    print("tc rates / from the measured inputs; /decl, /meas: the measured median over each;")
    print("plan speedup: the arrangement's median round time over the plan's; inexact: rounds in which")
    print("hivemind lost a part (all rounds count in the medians).")
    print()
    fixed = result["fixedCosts"]
    print(f"Steps (batches ready at once; the fixed cost from the warm-up: wait {fixed['wait']:.2f} s)")
    header = f"{'arrangement':12s}{'predicted steps/s':>19s}{'achieved steps/s':>18s}{'efficiency':>12s}"
    print(header)
    print("-" * len(header))
    for arrangement, row in result["summary"].items():
        print(f"{arrangement:12s}{row['predictedStepsPerSecond']:19.4f}{row['achievedStepsPerSecond']:18.4f}"
              f"{row['efficiency']:12.2f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fast", type=int, default=4)
    parser.add_argument("--slow", type=int, default=4)
    parser.add_argument("--fast-mbps", type=float, default=40.0)
    parser.add_argument("--slow-mbps", type=float, default=8.0)
    parser.add_argument("--numel", type=int, default=2_000_000)
    parser.add_argument("--part-bytes", type=int, default=2**15, help="hivemind's part size (its default: 2**19)")
    parser.add_argument("--rounds", type=int, default=8, help="measured rounds per arrangement")
    parser.add_argument("--warmup", type=int, default=2, help="rounds on hivemind's split before the plan")
    parser.add_argument("--probe-bytes", type=int, default=PROBE_BYTES, help="each way, per peer's probe")
    parser.add_argument("--arrangements", nargs="+", choices=ARRANGEMENTS, default=list(ARRANGEMENTS))
    parser.add_argument("--matchmaking-seconds", type=float, default=3.0)
    parser.add_argument("--round-timeout", type=float, default=240.0)
    parser.add_argument("--nice", type=int, default=10)
    parser.add_argument("--queue-ms", type=float, default=50.0, help="tbf queue, as the time to drain it")
    parser.add_argument("--log-dir", default="/tmp/hkbench-logs")
    parser.add_argument("--output", default=str(RESULTS))
    args = parser.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench_averaging_netns.py needs root (network namespaces and tc)")
    # a signal ends the run through the finally blocks and atexit, which remove the namespaces
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    result = run(args)
    print_table(result)
    output = Path(args.output)
    output.parent.mkdir(parents=True, exist_ok=True)
    output.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {output}")


if __name__ == "__main__":
    main()
