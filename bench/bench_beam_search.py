"""Beam-search latency for a batch's top-k experts against the number of DHT peers.

Anchor: Learning@home, section 4.1: finding the top-4 experts for a batch of 64 took
317 +- 58 ms over 100 DHT nodes, 528 +- 127 ms over 1,000 and 764 +- 106 ms over 10,000 (cloud
instances in 3 regions, ~90 ms apart); sections 3.2 and appendix B: a search needs O(k d log N)
DHT lookups (d grid dimensions, N peers), so its latency should grow slowly with N.

Setup, on loopback: N hivemind DHT peers (each a process and a p2pd) join one DHT and announce
the experts of a `--grid` spread round-robin over them (hivemind's `declare_experts`, as the
expert servers do); a separate client-mode peer, the trainer's side, then selects each
example's top-k for random gating scores with the DMoE layer's batched beam search (`beam.py`:
one DHT request a grid step for the whole batch). Cold: the client's DHT cache emptied before
the search (every prefix looked up through the DHT; the very first search also fills the
client's routing table); warm: the next batch's search right after a cold one, as a trainer's
next batch goes: the prefixes the cold search fetched come from the cache, the ones it did not
still go through the DHT. Also counted, per cold search: the DHT find requests the client sent
and the distinct peers they reached. Memory: proportional set size of the peers' processes (the
DHT process and its p2pd), read before the searches: about 90 MiB a peer, so 100 peers need
some 9 GiB, more than a shared 24 GiB machine should give one benchmark (the default stops at 50).
Every peer is a Python process and a p2pd on the same few cores: the latencies here are CPU
time and scheduling, not network (Learning@home's peers were ~90 ms apart). Writes
bench/results/beam_search.json.

    .venv/bin/python bench/bench_beam_search.py [--peers 10 25 50] [--grid 8x8x8] [--repeats 15]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console
from rich.table import Table

from bench_results import write_results

ANCHOR = ("Learning@home 4.1: top-4 experts for a batch of 64 in 317+-58 ms over 100 DHT nodes (528 ms over 1,000, "
          "764 ms over 10,000; cloud, 3 regions); 3.2 / appendix B: O(k d log N) DHT lookups a search")


def start_dht_swarm(size: int) -> list:
    """`size` DHT peers on loopback, all bootstrapped from the first."""
    import hivemind

    root = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    maddrs = [str(a) for a in root.get_visible_maddrs()]
    return [root] + [hivemind.DHT(start=True, initial_peers=maddrs, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
                     for _ in range(size - 1)]


def declare_grid(peers: list, uids: list[str]) -> float:
    """Every uid announced by one of the peers (round-robin), for 10 minutes; returns the seconds taken."""
    from hivemind.moe import declare_experts
    from hivemind.utils import get_dht_time

    started = time.perf_counter()
    for i, peer in enumerate(peers):
        mine = uids[i::len(peers)]
        for start in range(0, len(mine), 100):  # hivemind's DHT drops requests over 16 KiB
            declare_experts(peer, mine[start:start + 100], expiration_time=get_dht_time() + 600)
    return time.perf_counter() - started


def shutdown(peers: list) -> None:
    for peer in peers:
        peer.shutdown()


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


def pss_mib(pid: int) -> float:
    """Proportional set size of a process and its children (the DHT process and its p2pd), MiB."""
    total, pids = 0, [pid]
    while pids:
        current = pids.pop()
        try:
            for line in Path(f"/proc/{current}/smaps_rollup").read_text().splitlines():
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
            for task in Path(f"/proc/{current}/task").iterdir():
                pids += [int(c) for c in (task / "children").read_text().split()]
        except OSError:
            continue
    return total / 1024


async def _empty_cache(dht, node) -> None:
    """Forget every cached DHT value and count the find requests from here on (runs in the DHT process)."""
    protocol = node.protocol
    protocol.cache.clear()
    if not hasattr(protocol, "bench_requests"):
        original = protocol.call_find

        async def counted(peer, keys):
            protocol.bench_requests.append(peer)
            return await original(peer, keys)

        protocol.call_find = counted
    protocol.bench_requests = []


async def _requests_sent(dht, node) -> tuple[int, int]:
    """(find requests, distinct peers asked) since the last `_empty_cache`."""
    sent = node.protocol.bench_requests
    return len(sent), len(set(sent))


def measure(dims: list[int], size: int, batch: int, k: int, repeats: int) -> dict:
    import hivemind

    from hivekeeper.experts.dmoe import ExpertClient
    from hivekeeper.experts.grid import grid_uids

    peers = start_dht_swarm(size)
    client_dht = None
    try:
        memory = sum(pss_mib(peer.pid) for peer in peers)
        uids = grid_uids("bench", dims)
        declare_seconds = declare_grid(peers, uids)
        maddrs = [str(a) for a in peers[0].get_visible_maddrs()]
        client_dht = hivemind.DHT(start=True, initial_peers=maddrs, client_mode=True)
        client = ExpertClient(client_dht)
        gen = torch.Generator().manual_seed(0)

        def search() -> float:
            scores = [torch.randn(batch, m, generator=gen) for m in dims]
            started = time.perf_counter()
            found = client.find_best_experts("bench", scores, k)
            seconds = time.perf_counter() - started
            assert all(len(row) == k for row in found), "every example found k experts"
            return seconds

        cold, warm, requests, asked = [], [], [], []
        for _ in range(repeats + 1):  # the first cold search also fills the client's routing table
            client_dht.run_coroutine(_empty_cache)
            cold.append(search())
            sent, distinct = client_dht.run_coroutine(_requests_sent)
            requests.append(sent)
            asked.append(distinct)
            warm.append(search())
        first, cold, requests, asked = cold[0], cold[1:], requests[1:], asked[1:]
        row = {"dhtPeers": size, "grid": "x".join(map(str, dims)), "experts": len(uids),
               "declareSeconds": round(declare_seconds, 2), "firstColdMs": round(1000 * first, 1),
               "coldMedianMs": round(1000 * statistics.median(cold), 1),
               "coldP90Ms": round(1000 * percentile(cold, 0.9), 1),
               "warmMedianMs": round(1000 * statistics.median(warm), 1),
               "warmP90Ms": round(1000 * percentile(warm, 0.9), 1),
               "findRequestsMedian": statistics.median(requests), "peersAskedMedian": statistics.median(asked),
               "peersPssMiB": round(memory), "pssPerPeerMiB": round(memory / size, 1)}
        print(json.dumps(row), flush=True)
        return row
    finally:
        if client_dht is not None:
            client_dht.shutdown()
        shutdown(peers)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--peers", type=int, nargs="+", default=[10, 25, 50], help="DHT sizes")
    parser.add_argument("--grid", default="8x8x8", help="the announced expert grid")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=15, help="cold and warm searches per DHT size")
    args = parser.parse_args()
    torch.set_num_threads(1)
    dims = [int(m) for m in args.grid.split("x")]
    rows = [measure(dims, size, args.batch, args.k, args.repeats) for size in args.peers]

    table = Table(title=f"beam search: top-{args.k} of a {args.grid} grid for a batch of {args.batch}, "
                        f"loopback, {os.cpu_count()} cores")
    columns = ("DHT peers", "first cold ms", "cold median ms", "cold p90 ms", "warm median ms", "warm p90 ms",
               "find requests", "peers asked", "PSS MiB/peer")
    keys = ("dhtPeers", "firstColdMs", "coldMedianMs", "coldP90Ms", "warmMedianMs", "warmP90Ms",
            "findRequestsMedian", "peersAskedMedian", "pssPerPeerMiB")
    for column in columns:
        table.add_column(column)
    for row in rows:
        table.add_row(*(str(row[key]) for key in keys))
    Console().print(table)
    write_results("beam_search", ANCHOR, grid=args.grid, batch=args.batch, k=args.k, repeats=args.repeats,
                  rows=rows)


if __name__ == "__main__":
    main()
