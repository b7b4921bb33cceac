"""Peers follow a signed averaging plan in a real local swarm: the test plays the balancer
(it holds the key whose peer ID the peers were given) and makes a trainer a pure aggregator,
then a computing peer again. The collaboration keeps stepping throughout."""

from __future__ import annotations

import json
import urllib.request

import pytest

from conftest import wait_for, write_manifest
from hivekeeper.local.runner import prepare_run
from hivekeeper.local.supervisor import Supervisor
from hivekeeper.spec import load_manifest
from hivekeeper.runtime.reports import read_peer_reports
from hivekeeper.swarm.plan_record import PeerAssignment, SignedPlan, load_signing_key, publish_plan
from hivekeeper.hivemind_ext.allreduce import plan_digest

pytestmark = pytest.mark.isolated  # its DHT is forked from the test process (see test_planned_averaging)

SWARM = {"spec": {
    "targetBatchSize": 128,
    "trainers": {"replicas": 2, "batchSize": 32},
    "auxiliary": {"replicas": 1},
    "monitor": {"evalEverySteps": 1000, "checkpointEverySteps": 1000},
    "stopping": {"targetSteps": 10_000, "targetMetric": None},
}}


def status(port: int) -> dict:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=2) as reply:
            return json.loads(reply.read())
    except (OSError, ValueError):
        return {}


def publish(dht, key, swarm: str, peers: dict[str, tuple[str, bool, float]]) -> str:
    """Sign and store a plan: peer id -> (name, computes gradients, share)."""
    from hivemind.utils import get_dht_time

    shares = {peer_id: share for peer_id, (_, _, share) in peers.items()}
    now = get_dht_time()
    plan = SignedPlan(swarm=swarm, digest=plan_digest(shares), issued=now, expires=now + 120, steps_per_second=0.1,
                      compute_bound=0.1, aggregation_bound=1.0, averaging_seconds=1.0, group_size=len(peers),
                      peers=tuple(PeerAssignment(peer_id, name, computes, share)
                                  for peer_id, (name, computes, share) in peers.items()))
    publish_plan(dht, plan, key)
    return plan.digest


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_a_planned_aggregator_stops_computing_and_rejoins(tmp_path, no_leaked_p2pd):
    import hivemind

    run_dir = tmp_path / "run"
    manifest = load_manifest(write_manifest(tmp_path, SWARM))
    _, roles = prepare_run(manifest, run_dir)
    ports = {role.name: role.ports["metrics"] for role in roles}
    trainer = next(role for role in roles if role.component == "trainer")
    initial_peers = list(trainer.args[trainer.args.index("--initial-peers") + 1:])
    supervisor = Supervisor([role for role in roles if role.component != "balancer"], run_dir / "logs")
    dht = None
    try:
        supervisor.start(ready_first=lambda role: role.backbone)
        dht = hivemind.DHT(initial_peers=initial_peers, client_mode=True, start=True)
        key = load_signing_key(str(run_dir / "keys" / "balancer-0.key"))
        step = lambda: status(ports["monitor-0"]).get("globalStep", -1)  # noqa: E731
        # start from a collaboration in step: both trainers at the global step, having averaged
        def in_sync() -> bool:
            trainers = [status(ports[name]) for name in ("trainer-0", "trainer-1")]
            return (step() >= 2 and trainers[0].get("epoch") == trainers[1].get("epoch")
                    and all((t.get("lastRound") or {}).get("outcome") == "success" for t in trainers))

        wait_for(in_sync, 180, "both trainers in step after an averaging round")
        ids = wait_for(lambda: (found := {r["name"]: r["peerId"] for r in read_peer_reports(dht, "digits")
                                          if r.get("role") in ("trainer", "auxiliary")}) and len(found) == 3 and found,
                       30, "every averaging peer's report")

        # trainer-1 only aggregates; trainer-0 computes and sends, the auxiliary aggregates too
        digest = publish(dht, key, "digits", {ids["trainer-0"]: ("trainer-0", True, 0.0),
                                              ids["trainer-1"]: ("trainer-1", False, 0.5),
                                              ids["auxiliary-0"]: ("auxiliary-0", False, 0.5)})
        wait_for(lambda: status(ports["trainer-1"]).get("computesGradients") is False, 30, "trainer-1 to aggregate")
        # trainer-0 reports between its steps: an averaging round in progress delays its status
        wait_for(lambda: status(ports["trainer-0"]).get("plan") == digest, 30, "trainer-0 to follow the plan")
        samples = status(ports["trainer-1"])["samples"]
        planned = status(ports["trainer-0"]).get("plannedRounds", 0)
        start = step()
        # Rounds run on the plan's shares once every member's step carries the plan: a peer looks
        # for its next group as soon as its previous step ends, so the step after the plan arrives
        # may still have begun without it.
        wait_for(lambda: step() >= start + 2 and status(ports["trainer-0"]).get("plannedRounds", 0) > planned
                 and (status(ports["trainer-1"]).get("plannedRounds") or 0) > 0, 120,
                 "rounds on the plan's shares with trainer-1 aggregating")
        assert step() <= start + 10, "the plan took over within a few steps"
        assert status(ports["trainer-1"])["samples"] == samples  # it computed nothing meanwhile

        # back to computing: it reloads the averaged state and contributes samples again
        publish(dht, key, "digits", {ids["trainer-0"]: ("trainer-0", True, 0.5),
                                     ids["trainer-1"]: ("trainer-1", True, 0.5),
                                     ids["auxiliary-0"]: ("auxiliary-0", False, 0.0)})
        wait_for(lambda: status(ports["trainer-1"]).get("samples", 0) > samples, 60, "trainer-1 to compute again")
        start = step()
        wait_for(lambda: step() > start, 120, "a step with trainer-1 computing")
        logs = (run_dir / "logs" / "trainer-1.log").read_text()
        assert '"computes_gradients": false' in logs and '"computes_gradients": true' in logs
        assert not supervisor.poll(), "no role exited"
        assert supervisor.restarts == 0
    finally:
        if dht is not None:
            dht.shutdown()
        supervisor.stop()
