"""Averaging round time on shaped links: the planner's shares against hivemind's split,
equal shares (all-reduce) and a parameter server, with real hivemind all-reduce.

Anchors: (1) the planner's own prediction, `averagingSeconds` of `hivekeeper plan averaging`
(P * bytes over the aggregation rate); the issue asks for the measurement within 30 % of
it. (2) DeDLOC (section 3.2, fig. 3): under heterogeneous bandwidth, adaptive averaging
beats both all-reduce and a parameter server.

Setup (as root): one network namespace per peer plus a hub namespace holding a bridge,
veth pairs between them, addresses in 10.77.0.0/24 inside those namespaces only, nothing
added to the host's namespace. Each peer's link is shaped with tc tbf both ways (its upload
on its own end, its download on the hub's end): FAST peers at --fast-mbps, SLOW at
--slow-mbps. One hivemind averager per namespace (bench/averaging_netns_worker.py; peer 0
is the DHT bootstrap), all in one group, averaging --numel float32 per round. Namespaces and
the processes inside them are removed on exit, error or signal.

Arrangements, interleaved round by round, medians over --rounds:
  plan        the planner's shares (plan from the declared bandwidths, equal compute)
  hivemind    hivemind's own split, `load_balance_peers` fed each peer's declared bandwidth,
              run by hivemind's own code path
  equal       equal shares: hivemind's split when no bandwidth is typed in (its default)
  server      one fast peer aggregates everything (parameter server)
Round time: from the first peer's start of all-reduce to the last peer's end (matchmaking
excluded); all namespaces share one clock. Every round checks the exact mean on every peer,
and the tbf counters give the bytes each link carried.

Sizes. The defaults (4 x 40 and 4 x 8 Mbit/s, 2M floats) keep the network, not the two
shared CPU cores, the bottleneck: at 200/20 Mbit/s a round here was as much CPU as transfer.
With 4 fast and 4 slow peers the fast/slow ratio 5 also separates the baselines (at 200/20
the parameter server ties the plan: each slow peer must move its vector once either way).
Parts of 32 KiB instead of hivemind's 512 KiB: a part is the unit every aggregator waits for
from all senders, and at 2 Mbit/s per flow 512 KiB take 2 s.

    sudo PYTHONPATH=services .venv/bin/python bench/bench_averaging_netns.py [--rounds 5]
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
    AveragingProblem,
    PeerCapacity,
    all_reduce_baseline,
    parameter_server_baseline,
    plan_averaging,
    plan_for_roles,
)
from hivekeeper.swarm.planned_averaging import shares_by_peer_id  # noqa: E402

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


def problem_for(names: list[str], rates: list[float], numel: int) -> AveragingProblem:
    return AveragingProblem(
        target_batch_size=TARGET_BATCH, num_parameters=numel,
        peers=[PeerCapacity(name, SAMPLES_PER_SECOND, mbps, mbps) for name, mbps in zip(names, rates)],
    )


def traffic(fractions: list[float], numel: int, bytes_per_element: float = 4.0) -> list[float]:
    """The planner's model for fixed shares, everyone sending: peer i moves (1 - f_i) + (n - 1) f_i
    vectors each way (its parts out and their averages back, the others' parts in and averages out)."""
    n = len(fractions)
    return [((1 - f) + (n - 1) * f) * numel * bytes_per_element for f in fractions]


def predicted_seconds(fractions: list[float], rates: list[float], numel: int) -> float:
    return max(8 * size / (mbps * 1e6) for size, mbps in zip(traffic(fractions, numel), rates))


def run(args) -> dict:
    from hivemind.averaging.load_balancing import load_balance_peers

    names = [f"fast{k}" for k in range(args.fast)] + [f"slow{k}" for k in range(args.slow)]
    rates = [args.fast_mbps] * args.fast + [args.slow_mbps] * args.slow
    problem = problem_for(names, rates, args.numel)
    plan = plan_averaging(problem)
    if not all(role.computes_gradients for role in plan.peers):  # compare shares under the same roles
        plan = plan_for_roles(problem, {name: True for name in names})
    by_name = {role.name: role.aggregation_share for role in plan.peers}
    hivemind_elements = load_balance_peers(args.numel, rates)
    fractions = {
        "plan": [by_name[name] for name in names],
        "hivemind": [e / args.numel for e in hivemind_elements],
        "equal": [1 / len(names)] * len(names),
        "server": [1.0 if k == 0 else 0.0 for k in range(len(names))],
    }
    predictions = {
        "plan": plan.averaging_seconds,
        "hivemind": predicted_seconds(fractions["hivemind"], rates, args.numel),
        "equal": all_reduce_baseline(problem).averaging_seconds,
        "server": parameter_server_baseline(problem).averaging_seconds,
    }
    print(f"{len(names)} peers ({args.fast} x {args.fast_mbps:g} Mbit/s, {args.slow} x {args.slow_mbps:g} Mbit/s), "
          f"{args.numel:,} float32 ({args.numel * 4 / 1e6:.1f} MB); plan ({plan.method}): "
          + ", ".join(f"{n} {s:.3f}" for n, s in by_name.items()), flush=True)

    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    network = Network(rates, args.queue_ms)
    workers: list[Worker] = []
    try:
        workers.append(Worker(network, 0, args, [], log_dir))
        first = workers[0].receive(timeout=120)
        for k in range(1, len(names)):
            workers.append(Worker(network, k, args, first["maddrs"], log_dir))
        ready = [first] + [worker.receive(timeout=180) for worker in workers[1:]]
        peer_ids = {name: message["ready"] for name, message in zip(names, ready)}
        shares = {
            "plan": shares_by_peer_id(plan, peer_ids),
            "server": {peer_ids[name]: share for name, share in zip(names, fractions["server"])},
        }
        chosen = [a for a in ARRANGEMENTS if a in args.arrangements]
        schedule = [chosen[0]] * args.warmup + [chosen[(r + i) % len(chosen)] for r in range(args.rounds)
                                                 for i in range(len(chosen))]
        rounds = []
        for index, arrangement in enumerate(schedule):
            command = {"cmd": "round", "round": index, "scheduled_time": time.time() + args.matchmaking_seconds,
                       "shares": shares.get(arrangement)}
            counters = network.sent_bytes()
            for worker, mbps in zip(workers, rates):
                worker.send({**command, "bandwidth": mbps if arrangement == "hivemind" else None})
            replies = [worker.receive(timeout=args.round_timeout) for worker in workers]
            moved = [(up - up0, down - down0) for (up, down), (up0, down0) in zip(network.sent_bytes(), counters)]
            errors = [reply["error"] for reply in replies if "error" in reply]
            if errors:
                raise RuntimeError(f"round {index} ({arrangement}) failed: {errors[0]}")
            planned = {reply["planned"] for reply in replies}
            assert planned == {arrangement in shares}, f"round {index}: {arrangement} ran with planned={planned}"
            max_error = max(reply["maxError"] for reply in replies)
            seconds = max(r["finished"] for r in replies) - min(r["started"] for r in replies)
            payload = 2 * sum(traffic(fractions[arrangement], args.numel))
            record = {"arrangement": arrangement, "seconds": seconds, "warmup": index < args.warmup,
                      # hivemind can finish a round with parts missing (it logs "received 98% results"
                      # and keeps the local values there): such a round is kept out of the medians
                      "exact": max_error < 1e-4, "maxError": max_error,
                      "missingElements": [reply.get("missingElements", 0) for reply in replies],
                      "peerSeconds": [round(r["finished"] - r["started"], 3) for r in replies],
                      "elements": [reply["elements"] for reply in replies],
                      "linkBytes": moved, "wireOverhead": sum(u + d for u, d in moved) / payload,
                      "loadAverage": os.getloadavg()[0]}
            rounds.append(record)
            print(f"  round {index:2d} {arrangement:9s} {seconds:6.2f} s  (predicted {predictions[arrangement]:.2f} s"
                  f"{'' if record['exact'] else f'; NOT EXACT, off by {max_error:.3g}'}; "
                  f"load {record['loadAverage']:.1f}; slowest peer {max(record['peerSeconds']):.2f} s; "
                  f"wire/payload {record['wireOverhead']:.2f})", flush=True)
    finally:
        for worker in workers:
            worker.stop()
        network.close()

    summary = {}
    for arrangement in chosen:
        measured = [r for r in rounds if r["arrangement"] == arrangement and not r["warmup"]]
        good = [r for r in measured if r["exact"]]
        if not good:
            raise RuntimeError(f"no exact round for {arrangement}")
        times = [r["seconds"] for r in good]
        wire = statistics.median(r["wireOverhead"] for r in good)
        summary[arrangement] = {
            "medianSeconds": statistics.median(times),
            "minSeconds": min(times),
            "maxSeconds": max(times),
            "rounds": len(good),
            "inexactRounds": len(measured) - len(good),
            "predictedSeconds": predictions[arrangement],
            "measuredOverPredicted": statistics.median(times) / predictions[arrangement],
            "wireOverhead": wire,  # bytes on the links over the model's payload
            "predictedWithWireOverheadSeconds": predictions[arrangement] * wire,
            "fractions": dict(zip(names, fractions[arrangement])),
            "elementsAggregated": dict(zip(names, good[-1]["elements"])),
            "linkMegabytes": {name: {"up": round(statistics.median(r["linkBytes"][k][0] for r in good) / 1e6, 2),
                                     "down": round(statistics.median(r["linkBytes"][k][1] for r in good) / 1e6, 2)}
                              for k, name in enumerate(names)},
        }
    for arrangement in chosen:
        base = summary.get("plan", summary[chosen[0]])["medianSeconds"]
        summary[arrangement]["planSpeedup"] = summary[arrangement]["medianSeconds"] / base
    return {
        "benchmark": "averaging_netns",
        "anchor": {
            "prediction": "planner's averagingSeconds (hivekeeper plan averaging); aim: measured within 30 %",
            "paper": "DeDLOC sec. 3.2 / fig. 3: adaptive averaging beats all-reduce and a parameter server "
                     "under heterogeneous bandwidth",
        },
        "setup": {
            "peers": [{"name": n, "uploadMbps": r, "downloadMbps": r} for n, r in zip(names, rates)],
            "numel": args.numel, "bytesPerElement": 4, "partSizeBytes": args.part_bytes,
            "rounds": args.rounds, "warmupRounds": args.warmup,
            "shaping": "tc tbf on both ends of each peer's veth (upload and download), bridge in a hub namespace",
            "plan": {"method": plan.method, "averagingSeconds": plan.averaging_seconds,
                     "stepsPerSecond": plan.steps_per_second,
                     "computesGradients": {r.name: r.computes_gradients for r in plan.peers}},
            "machine": {"cpus": os.cpu_count(), "kernel": platform.release(), "python": platform.python_version()},
        },
        "summary": summary,
        "rounds": rounds,
    }


def print_table(result: dict) -> None:
    summary = result["summary"]
    header = (f"{'arrangement':12s}{'shares fast/slow':>18s}{'predicted s':>13s}{'x wire':>8s}{'measured s':>12s}"
              f"{'(min-max)':>14s}{'meas/pred':>11s}{'plan speedup':>14s}")
    print()
    print(header)
    print("-" * len(header))
    for arrangement, row in summary.items():
        spread = f"{row['minSeconds']:.2f}-{row['maxSeconds']:.2f}"
        fast = [f for name, f in row["fractions"].items() if name.startswith("fast")]
        slow = [f for name, f in row["fractions"].items() if name.startswith("slow")]
        shares = "/".join("-".join(sorted({f"{f:.2f}" for f in group})) for group in (fast, slow) if group)
        print(f"{arrangement:12s}{shares:>18s}{row['predictedSeconds']:13.2f}"
              f"{row['predictedWithWireOverheadSeconds']:8.2f}{row['medianSeconds']:12.2f}{spread:>14s}"
              f"{row['measuredOverPredicted']:11.2f}{row['planSpeedup']:13.2f}x")
    print()
    print("predicted: the planner's averagingSeconds (its model for the fixed shares of the baselines);")
    print("x wire: the same with the bytes the links really carried (TCP/IP, noise, yamux, protobuf);")
    print("plan speedup: the arrangement's median round time over the plan's.")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--fast", type=int, default=4)
    parser.add_argument("--slow", type=int, default=4)
    parser.add_argument("--fast-mbps", type=float, default=40.0)
    parser.add_argument("--slow-mbps", type=float, default=8.0)
    parser.add_argument("--numel", type=int, default=2_000_000)
    parser.add_argument("--part-bytes", type=int, default=2**15, help="hivemind's part size (its default: 2**19)")
    parser.add_argument("--rounds", type=int, default=5, help="measured rounds per arrangement")
    parser.add_argument("--warmup", type=int, default=1)
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
