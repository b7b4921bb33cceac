"""One peer of bench_averaging_netns.py, run inside its network namespace.

Starts a DHT peer that answers bandwidth probes (`hivekeeper.runtime.bandwidth.serve_probes`)
and a PlannedAverager on the namespace's address, prints one JSON line
{"ready": peer_id, "maddrs": [...]}, then serves JSON commands on stdin, one a line:

    {"cmd": "probe", "peer": peer_id, "size": bytes}
    {"cmd": "round", "round": k, "scheduled_time": t, "shares": {peer_id: share} | null,
     "bandwidth": Mbps | null}
    {"cmd": "quit"}

A probe sends `size` bytes to `peer` while fetching as many back, over the transport the
averager uses, and answers {"upload": bytes/s, "download": bytes/s}.

A round fills the vector with a_r * u + b_r (u a fixed random vector, a_r and b_r known
functions of peer rank and round), so every peer can check the exact mean without the
others' vectors, and answers one JSON line with the all-reduce's start, end, whether the
plan's shares were used, the elements this peer aggregated and the largest error.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import time

import torch


def coefficients(rank: int, round_index: int) -> tuple[float, float]:
    return 1.0 + 0.1 * ((7 * rank + 3 * round_index) % 11), 0.01 * ((5 * rank + round_index) % 13)


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--ip", required=True)
    parser.add_argument("--rank", type=int, required=True)
    parser.add_argument("--peers", type=int, required=True, help="group size (every peer averages)")
    parser.add_argument("--numel", type=int, required=True)
    parser.add_argument("--part-bytes", type=int, required=True)
    parser.add_argument("--initial-peers", default="[]", help="JSON list of multiaddrs")
    parser.add_argument("--prefix", default="hkbench")
    args = parser.parse_args()
    torch.set_num_threads(1)

    import hivemind
    from hivekeeper.runtime.bandwidth import probe, serve_probes

    # the reasons hivemind gives for a part that never arrived are DEBUG lines; the rest stays quiet
    for name in ("hivemind.averaging.allreduce", "hivemind.p2p.p2p_daemon"):
        logging.getLogger(name).setLevel(logging.DEBUG)
    from hivekeeper.hivemind_ext.allreduce import PlannedAverager

    u = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    for attempt in range(3):  # on a loaded machine p2pd now and then misses its bootstrap peer
        try:
            dht = hivemind.DHT(start=True, host_maddrs=[f"/ip4/{args.ip}/tcp/0"],
                               initial_peers=json.loads(args.initial_peers))
            break
        except hivemind.p2p.P2PDaemonError:
            if attempt == 2:
                raise
            time.sleep(2)
    serve_probes(dht)
    averager = PlannedAverager(
        [torch.zeros(args.numel)], dht, prefix=args.prefix, start=True,
        target_group_size=args.peers, min_group_size=args.peers, min_matchmaking_time=2.0,
        request_timeout=1.0, part_size_bytes=args.part_bytes, allreduce_timeout=300.0,
    )
    reply({"ready": str(dht.peer_id), "maddrs": [str(m) for m in dht.get_visible_maddrs()]})
    try:
        for line in sys.stdin:
            if not line.strip():
                continue
            command = json.loads(line)
            if command["cmd"] == "quit":
                break
            if command["cmd"] == "probe":
                rates = probe(dht, [command["peer"]], size=command["size"])
                reply({"upload": rates.upload, "download": rates.download} if rates else
                      {"error": f"probe of {command['peer']} failed; see this worker's log"})
            else:
                reply(run_round(averager, u, args, command))
    finally:
        averager.shutdown()
        dht.shutdown()


def run_round(averager, u: torch.Tensor, args, command: dict) -> dict:
    k = command["round"]
    a, b = coefficients(args.rank, k)
    with averager.get_tensors() as (tensor,):
        torch.add(u * a, b, out=tensor)
    if command.get("shares"):
        averager.set_plan(command["shares"], expires_at=time.time() + 300)
    else:
        averager.clear_plan()
    averager.bandwidth = command.get("bandwidth")  # read by hivemind's step when it gathers
    try:
        averager.step(scheduled_time=command["scheduled_time"], timeout=120)
    except Exception as e:  # noqa: BLE001 - report, the orchestrator decides
        return {"round": k, "error": repr(e)}
    means = [coefficients(rank, k) for rank in range(args.peers)]
    mean_a, mean_b = (sum(c[i] for c in means) / args.peers for i in (0, 1))
    with averager.get_tensors() as (tensor,):
        error = float((tensor - (u * mean_a + mean_b)).abs().max())
    r = averager.last_round
    return {"round": k, "planned": r.planned, "started": r.started, "finished": r.finished,
            "elements": r.aggregated_elements, "groupSize": r.group_size, "maxError": error,
            "missingElements": r.missing_elements}


def reply(message: dict) -> None:
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()


if __name__ == "__main__":
    main()
