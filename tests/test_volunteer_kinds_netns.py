"""Volunteers behind a NAT serving a BlockServer and an ExpertPool (issue 16), with real
networking as in tests/test_volunteer_netns.py: the resource runs in a "cluster" network
namespace (`hivekeeper up --host`, its relay and token service included); `hivekeeper join`
runs in a "home" namespace behind a masquerading router that lets nothing in. A server there
is useless unless the cluster's peers can dial it, so it must be reachable through the relay's
circuit, and the resource must use it.

Each resource is set up so that it needs the volunteer: the BlockServer's own server covers
half the model (its client waits for the rest), the ExpertPool's server half the grid (the
volunteer's server holds the free cells). The BlockServer's client, a DHT client nobody dials,
first reaches the volunteer through the relay's circuit, which libp2p cuts after 128 KiB: the
volunteer dials it back directly (hivemind_ext.p2pd.keep_direct_connections), and the client's
~200 KiB of hidden states get through."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import pytest

from conftest import wait_for, write_manifest
from netns import NatLab, skip_unless_possible
from test_volunteer_netns import INTRUDER, VOLUNTEER, Cluster, Volunteer

pytestmark = [pytest.mark.swarm, pytest.mark.netns]

ACCESS = {"enabled": True, "allowlist": [VOLUNTEER]}
NEW_TOKENS = 100
BLOCKS = {  # over examples/blockserver.yaml: 6 blocks, the cluster's one server holds 3
    "metadata": {"name": "hkt-blocks"},
    "spec": {
        "servers": {"replicas": 1, "spanLength": 3},
        "balancer": {"enabled": False},  # nothing to balance: each server holds what the other lacks
        # hidden states of 2 KiB: the volunteer's hop moves ~200 KiB each way, beyond a relayed
        # connection's 128 KiB (docs/limits.md, Volunteers), so a relay-only path would be cut
        "model": {"tiny": {"hiddenSize": 512, "numHeads": 8}},
        "client": {"newTokens": NEW_TOKENS},
        "volunteers": ACCESS,
    },
}
EXPERTS = {  # over examples/expertpool.yaml: a 2x4 grid, the cluster's one server holds row 0
    "metadata": {"name": "hkt-experts"},
    "spec": {
        "grid": {"dimensions": [2, 4]},
        "expert": {"hiddenSize": 32},
        "servers": {"replicas": 1, "expertsPerServer": 4, "announcePeriodSeconds": 2,
                    "announceExpirationSeconds": 6},
        "checkpoint": {"everySeconds": 5},
        "trainers": {"replicas": 1, "batchSize": 32, "batchesInFlight": 2,
                     # relayed requests take longer: timeouts a loaded machine meets
                     "dmoe": {"layers": 1, "kBest": 2, "kMin": 1, "forwardTimeoutSeconds": 10,
                              "timeoutAfterKMinSeconds": 2, "backwardTimeoutSeconds": 10},
                     "evalEverySteps": 50},
        "stopping": {"targetMetric": None, "targetSteps": 100_000},  # the test ends the run
        "volunteers": ACCESS,
    },
}


@contextmanager
def cluster_running(tmp: Path, changes: dict[str, Any], base: str) -> Iterator[Cluster]:
    """`hivekeeper up MANIFEST --host CLUSTER_IP` in the cluster namespace; stopped (SIGINT:
    up stops every process it started) and the namespaces deleted on the way out."""
    skip_unless_possible()
    manifest = write_manifest(tmp, changes, base=base)
    with NatLab() as lab:
        run_dir = tmp / "cluster"
        with open(tmp / "up.log", "wb") as log:
            runner = lab.popen(lab.cluster, [sys.executable, "-m", "hivekeeper", "up", str(manifest), "--run-dir",
                                             str(run_dir), "--host", lab.cluster_ip],
                               stdout=log, stderr=subprocess.STDOUT)
        try:
            cluster = Cluster(lab, run_dir, runner)
            cluster.mint_invite()  # while the resource starts
            yield cluster
        finally:
            if runner.poll() is None:
                runner.send_signal(signal.SIGINT)
                try:
                    runner.wait(30)
                except subprocess.TimeoutExpired:
                    pass


def joined(volunteer: Volunteer) -> dict[str, Any]:
    """Its join.json once the role serves, after checking that auto picked relay mode."""
    wait_for(lambda: volunteer.record().get("mode") or volunteer.process.poll() is not None, 120, "its mode")
    assert volunteer.record().get("mode") == "relay", volunteer.record()
    wait_for(lambda: volunteer.seconds("ready") or volunteer.process.poll() is not None, 240,
             "the volunteer's server to serve")
    assert volunteer.process.poll() is None, volunteer.record()
    return volunteer.record()


def served(volunteer: Volunteer) -> int:
    return (volunteer.status() or {}).get("served") or 0


@pytest.mark.timeout(600)
def test_relayed_block_server_completes_the_chain(tmp_path, no_leaked_p2pd):
    with cluster_running(tmp_path, BLOCKS, "blockserver.yaml") as cluster:
        wait_for(lambda: (cluster.run_dir / "ports.json").exists()
                 and (cluster.status("block-server-0") or {}).get("state") == "online", 180,
                 "the cluster's block server to serve")
        wait_for(lambda: (cluster.status("block-client-0") or {}).get("globalStep") == 0, 60,
                 "the client to wait for blocks 3:6")
        with Volunteer(cluster, cluster.lab.home, cluster.lab.home_ip, tmp_path / "alice") as volunteer:
            record = joined(volunteer)
            # the client generates through both servers, then the run is done and up exits
            wait_for(lambda: cluster.runner.poll() is not None, 300, "the client to generate and the run to end")
            assert cluster.runner.returncode == 0, (tmp_path / "up.log").read_text()[-3000:]
            wait_for(lambda: served(volunteer), 30, "the volunteer to count the requests it served")
            requests = served(volunteer)
            summary = volunteer.stop()
    result = json.loads((cluster.run_dir / "result.json").read_text())
    hops = {hop.split("@")[1]: hop.split("@")[0] for hop in result["chain"]}
    assert hops.get(record["peerId"][-8:]) == "3:6", (result["chain"], record["peerId"])
    assert result["metrics"]["matchesLocal"] is True and result["globalStep"] == NEW_TOKENS, result
    assert requests >= NEW_TOKENS, requests  # the prompt, then one inference step per token at least
    assert summary["role"] == "block-server" and summary["mode"] == "relay" and summary["served"] >= requests
    print(f"\nblock-server volunteer: joined {summary['seconds']}, served {requests} requests, "
          f"chain {result['chain']}, client {result['metrics']}")


@pytest.mark.timeout(600)
def test_relayed_expert_server_serves_the_trainers(tmp_path, no_leaked_p2pd):
    with cluster_running(tmp_path, EXPERTS, "expertpool.yaml") as cluster:
        lab = cluster.lab
        trainer = lambda: cluster.status("expert-trainer-0") or {}  # noqa: E731
        wait_for(lambda: (cluster.run_dir / "ports.json").exists() and trainer().get("globalStep"), 240,
                 "the cluster to train on its own experts")
        relays = json.loads((cluster.run_dir / "keys" / "swarm-info.json").read_text())["relays"]
        with ThreadPoolExecutor(1) as pool, \
                Volunteer(cluster, lab.home, lab.home_ip, tmp_path / "alice") as volunteer:
            # meanwhile, a plain hivemind peer at home without a token: the pool's peers answer nothing
            intruder = pool.submit(lab.run, lab.home, [sys.executable, "-c", INTRUDER, EXPERTS["metadata"]["name"],
                                                       *relays], check=False, timeout=150)
            joined(volunteer)
            experts = sorted(wait_for(lambda: (volunteer.status() or {}).get("experts"), 30, "its first report"))
            assert experts == [f"expert.1.{i}" for i in range(4)], experts  # the free half of the grid
            # its experts are found by beam search: the trainer sends them requests and steps on
            wait_for(lambda: served(volunteer), 180, "the trainer's first request to a volunteer expert")
            wait_for(lambda: trainer().get("expertsAlive") == 8, 60, "the trainer to count the volunteer's experts")
            step, requests = trainer()["globalStep"], served(volunteer)
            wait_for(lambda: served(volunteer) >= requests + 10 and trainer().get("globalStep", 0) >= step + 10, 180,
                     "training to go on through the volunteer's experts")
            requests, status = served(volunteer), trainer()
            summary = volunteer.stop()
            refused = intruder.result()
        assert "records: 0" in refused.stdout or "refused" in refused.stdout, refused.stdout + refused.stderr[-2000:]
    assert summary["role"] == "expert-server" and summary["mode"] == "relay" and summary["served"] >= requests
    print(f"\nexpert-server volunteer: joined {summary['seconds']}, served {requests} forward batches; "
          f"trainer at step {status['globalStep']}, expert requests {status['expertRequests']}")
