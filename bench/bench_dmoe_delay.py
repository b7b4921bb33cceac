"""DMoE throughput under network delay, against a model-parallel pipeline over the same blocks,
and the latency of beam search through the DHT for a few grid sizes (against the number of DHT
peers: bench_beam_search.py).

Anchor: Learning@home, Figure 4 (top): with an exponential delay per request of mean 0 to 200 ms,
asynchronous DMoE training keeps nearly the same throughput while model-parallel training
collapses; section 4.1: finding the top-4 experts (batch 64) took 317 +- 58 ms over 100 DHT nodes
in the cloud.

Setup, at small scale on this machine: 2 expert servers (`hivekeeper run expert-server`) hold the
feed-forward experts of a `--grid` (2x2: 4 blocks). Both schemes run `--layers` blocks per batch,
forward and backward, with the same client-side delay on every request:
  - model parallel: one batch at a time through the grid's experts in turn (one per layer,
    alternating servers), each request waiting for the previous one (no pipelining);
  - DMoE: `--layers` DMoE layers over the same experts with k=1 (the same expert compute per
    example) and `--in-flight` batches processed concurrently, as the trainer role does.
A bigger grid spreads each batch over more, smaller requests (more overhead per example).
Prints two tables and writes bench/results/dmoe_delay.json.

    .venv/bin/python bench/bench_dmoe_delay.py [--seconds 10] [--delays 0 50 100 200] [--in-flight 24]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

import torch
import yaml
from rich.console import Console
from rich.table import Table

from bench_beam_search import declare_grid, shutdown, start_dht_swarm
from bench_results import write_results
from hivekeeper.local.network import free_port

REPO = Path(__file__).resolve().parents[1]
HIDDEN = 64


def pool_manifest(directory: Path, grid: list[int]) -> Path:
    document = yaml.safe_load((REPO / "examples/expertpool.yaml").read_text())
    document["metadata"]["name"] = "bench-dmoe"
    spec = document["spec"]
    spec["grid"]["dimensions"] = grid
    spec["expert"]["hiddenSize"] = HIDDEN
    spec["servers"].update(replicas=2, maxBatchSize=4096)
    spec["checkpoint"]["enabled"] = False
    path = directory / "pool.yaml"
    path.write_text(yaml.safe_dump(document))
    return path


def start_servers(manifest: Path, directory: Path, initial_peers: list[str]) -> list[tuple[subprocess.Popen, int]]:
    servers = []
    for index in range(2):
        port = free_port()
        log = open(directory / f"server-{index}.log", "ab")
        process = subprocess.Popen(
            [sys.executable, "-m", "hivekeeper", "run", "expert-server", "--manifest", str(manifest), "--index",
             str(index), "--metrics-port", str(port), "--run-dir", str(directory), "--initial-peers", *initial_peers],
            stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        servers.append((process, port))
    for process, port in servers:
        deadline = time.monotonic() + 180
        while not _ready(port):
            if process.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"expert server did not start; see {directory}")
            time.sleep(0.5)
    return servers


def _ready(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=1) as reply:
            return reply.status == 200
    except OSError:
        return False


def stop_servers(servers: list[tuple[subprocess.Popen, int]]) -> None:
    for process, _ in servers:
        try:
            os.killpg(process.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
    for process, _ in servers:
        try:
            process.wait(20)
        except subprocess.TimeoutExpired:
            pass
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass


def measure(work, seconds: float, threads: int) -> float:
    """Samples/s of `work()` (returns samples done) run by `threads` threads for `seconds`."""
    done, stop, errors = [0], threading.Event(), []
    lock = threading.Lock()

    def loop() -> None:
        while not stop.is_set():
            try:
                n = work()
            except Exception as e:  # noqa: BLE001 - a failed batch counts nothing; say why once
                if not errors:
                    print(f"batch failed: {e!r}", file=sys.stderr)
                errors.append(e)
                continue
            with lock:
                done[0] += n

    workers = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
    for worker in workers:
        worker.start()
    time.sleep(5.0)  # warm-up: every thread has a batch in flight, even at 200 ms a request
    with lock:
        start_count, started = done[0], time.monotonic()
    time.sleep(seconds)
    with lock:
        count, elapsed = done[0] - start_count, time.monotonic() - started
    stop.set()
    for worker in workers:
        worker.join(timeout=60)
    return count / elapsed


def throughput(dht, peers: dict[str, object], grid: list[int], delays_ms: list[float], layers: int, batch: int,
               in_flight: int, seconds: float) -> list[dict]:
    from hivemind.moe.expert_uid import ExpertInfo

    from hivekeeper.experts.dmoe import DMoE, ExpertClient
    from hivekeeper.experts.grid import grid_uids

    rows = []
    # the pipeline's blocks: the grid's experts in row-major order, which alternates between the servers
    everyone = grid_uids("expert", grid)
    uids = [everyone[i % len(everyone)] for i in range(layers)]
    blocks = [ExpertInfo(uid, peers[uid]) for uid in uids]
    for delay in delays_ms:
        client = ExpertClient(dht, delay_mean=delay / 1000.0, seed=0)

        def pipeline_step() -> int:
            x = torch.randn(batch, HIDDEN)
            inputs = []
            for block in blocks:  # forward, block after block
                inputs.append(x)
                x = client.call(block, [x]).result()[0]
            grad = torch.ones_like(x) / x.numel()
            for block, x_in in zip(reversed(blocks), reversed(inputs)):  # backward, in reverse
                grad = client.call(block, [x_in, grad], backward=True).result()[0]
            return batch

        dmoe = torch.nn.Sequential(*[DMoE(client, "expert", grid, HIDDEN, k_best=1, k_min=1, forward_timeout=30,
                                          timeout_after_k_min=30, backward_timeout=30) for _ in range(layers)])

        def dmoe_step() -> int:
            x = torch.randn(batch, HIDDEN, requires_grad=True)
            dmoe(x).pow(2).mean().backward()
            return batch

        row = {"delayMs": delay,
               "modelParallel": round(measure(pipeline_step, seconds, threads=1), 1),
               "dmoe": round(measure(dmoe_step, seconds, threads=in_flight), 1)}
        row["ratio"] = round(row["dmoe"] / row["modelParallel"], 2) if row["modelParallel"] else None
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def beam_search_latency(grids: list[list[int]], announcers: int, batch: int, k: int, repeats: int) -> list[dict]:
    """Announcer peers declare every expert of the grid; a fresh client peer then selects each
    example's top-k: the first search fills its DHT cache (cold), the next ones use it (warm)."""
    import hivemind
    from hivemind.moe.client.beam_search import MoEBeamSearcher

    from hivekeeper.experts.dmoe import ExpertClient
    from hivekeeper.experts.grid import grid_uids

    rows = []
    for dims in grids:
        peers = start_dht_swarm(announcers)
        maddrs = [str(a) for a in peers[0].get_visible_maddrs()]
        client_dht = None
        try:
            uids = grid_uids(f"g{len(rows)}", dims)
            declare_seconds = declare_grid(peers, uids)
            client_dht = hivemind.DHT(start=True, initial_peers=maddrs, client_mode=True)
            client = ExpertClient(client_dht)
            gen = torch.Generator().manual_seed(0)
            scores = lambda: [torch.randn(batch, m, generator=gen) for m in dims]  # noqa: E731
            t0 = time.perf_counter()
            found = client.find_best_experts(f"g{len(rows)}", scores(), k)
            cold = time.perf_counter() - t0
            warm = []
            for _ in range(repeats):
                t0 = time.perf_counter()
                found = client.find_best_experts(f"g{len(rows)}", scores(), k)
                warm.append(time.perf_counter() - t0)
            assert all(len(row) == k for row in found), "every example found k experts"
            searcher = MoEBeamSearcher(client_dht, f"g{len(rows)}.", dims, negative_caching=False)
            per_example = []
            rows_per_request = max(1, 12_000 // (4 * sum(dims)))  # a larger request kills hivemind's DHT process
            for _ in range(max(1, repeats // 3)):
                batch_scores = [s.numpy() for s in scores()]
                t0 = time.perf_counter()
                for start in range(0, batch, rows_per_request):
                    searcher.batch_find_best_experts([s[start:start + rows_per_request] for s in batch_scores], k)
                per_example.append(time.perf_counter() - t0)
            row = {"grid": "x".join(map(str, dims)), "experts": len(uids), "dhtPeers": announcers + 1,
                   "declareSeconds": round(declare_seconds, 2), "coldMs": round(1000 * cold, 1),
                   "warmMedianMs": round(1000 * statistics.median(warm), 1),
                   "hivemindPerExampleMedianMs": round(1000 * statistics.median(per_example), 1)}
            print(json.dumps(row), flush=True)
            rows.append(row)
        finally:
            if client_dht is not None:
                client_dht.shutdown()
            shutdown(peers)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=10.0, help="measurement per configuration")
    parser.add_argument("--delays", type=float, nargs="+", default=[0, 25, 50, 100, 200], help="mean delay, ms")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--in-flight", type=int, default=24)
    parser.add_argument("--grid", default="2x2", help="the servers' expert grid (its experts are the pipeline's blocks)")
    parser.add_argument("--grids", default="8x8,16x16,32x32,16x16x16", help="beam-search grids")
    parser.add_argument("--announcers", type=int, default=3, help="DHT peers that announce the grid's experts")
    args = parser.parse_args()
    torch.set_num_threads(1)

    import hivemind
    from hivemind.p2p import PeerID

    grids = [[int(m) for m in g.split("x")] for g in args.grids.split(",") if g]
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        grid = [int(m) for m in args.grid.split("x")]
        servers = start_servers(pool_manifest(directory, grid), directory, [str(a) for a in dht.get_visible_maddrs()])
        try:
            peers = {}
            for _, port in servers:
                status = {}
                while "experts" not in status:  # the first report comes a second after readiness
                    time.sleep(0.5)
                    with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=5) as reply:
                        status = json.loads(reply.read())
                peers.update({uid: PeerID.from_base58(status["peerId"]) for uid in status["experts"]})
            rows = throughput(dht, peers, grid, args.delays, args.layers, args.batch, args.in_flight, args.seconds)
        finally:
            stop_servers(servers)
            dht.shutdown()
    beams = beam_search_latency(grids, args.announcers, batch=64, k=4, repeats=9)

    console = Console()
    table = Table(title=f"samples/s vs mean delay per request: {args.layers} blocks fwd+bwd, batch {args.batch}, "
                        f"{args.grid} experts on 2 servers, {os.cpu_count()} cores")
    for column in ("delay (ms)", "model parallel", f"DMoE async ({args.in_flight} in flight, k=1)", "DMoE / MP",
                   "MP vs no delay", "DMoE vs no delay"):
        table.add_column(column)
    base = rows[0]
    for r in rows:
        table.add_row(str(r["delayMs"]), str(r["modelParallel"]), str(r["dmoe"]), str(r["ratio"]),
                      f"{r['modelParallel'] / base['modelParallel']:.2f}", f"{r['dmoe'] / base['dmoe']:.2f}")
    console.print(table)
    beam_table = Table(title="beam search: top-4 experts for a batch of 64 through the DHT")
    for column in ("grid", "experts", "DHT peers", "cold ms", "warm median ms", "hivemind per-example ms"):
        beam_table.add_column(column)
    for b in beams:
        beam_table.add_row(b["grid"], str(b["experts"]), str(b["dhtPeers"]), str(b["coldMs"]),
                           str(b["warmMedianMs"]), str(b["hivemindPerExampleMedianMs"]))
    console.print(beam_table)
    write_results("dmoe_delay", "Learning@home Figure 4 (top): DMoE throughput nearly flat vs delay 0-200 ms, model "
                  "parallel collapses; section 4.1: top-4 beam search 317+-58 ms over 100 cloud DHT nodes",
                  grid=args.grid, layers=args.layers, batch=args.batch, in_flight=args.in_flight, seconds=args.seconds,
                  throughput=rows, beam_search=beams)


if __name__ == "__main__":
    main()
