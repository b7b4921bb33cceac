"""The balancer's pieces that need no swarm: signed plan records, the LP inputs it builds from
measurements and the manifest's limits, and when it replaces the plan peers follow."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from hivekeeper.local.identity import ensure_identity
from hivekeeper.planning.averaging_lp import AveragingProblem, PeerCapacity, plan_averaging, throughput_of
from hivekeeper.spec import load_manifest
from hivekeeper.swarm.balancer import drifted, plan_inputs, signed_plan
from hivekeeper.swarm.metrics_source import PeerMeasurement
from hivekeeper.swarm.plan_record import (
    PeerAssignment,
    PlanRecordError,
    SignedPlan,
    load_signing_key,
    sign_plan,
    verify_plan,
)

from conftest import write_manifest

MB = 1e6 / 8  # bytes/s in one Mbit/s


@pytest.fixture(scope="module")
def keys(tmp_path_factory) -> dict[str, tuple[str, object]]:
    out = {}
    for name in ("balancer", "intruder"):
        path = tmp_path_factory.mktemp(name) / "key"
        out[name] = (ensure_identity(path), load_signing_key(str(path)))
    return out


def a_plan(**changes) -> SignedPlan:
    plan = SignedPlan(swarm="digits", digest="d1", issued=100.0, expires=160.0, steps_per_second=0.5,
                      compute_bound=0.5, aggregation_bound=2.0, averaging_seconds=0.5, group_size=3,
                      peers=(PeerAssignment("QmA", "trainer-0", True, 0.6), PeerAssignment("QmB", "auxiliary-0", False, 0.4)))
    return replace(plan, **changes)


def test_a_signed_plan_verifies_and_every_forgery_is_refused(keys):
    signer, key = keys["balancer"]
    record = sign_plan(a_plan(), key)
    assert verify_plan(record, signer=signer, swarm="digits", now=120.0) == a_plan()

    tampered = dict(record, payload=record["payload"].replace(b"0.6", b"0.9"))
    other_key = sign_plan(a_plan(), keys["intruder"][1])  # validly signed, by someone else
    stolen_name = dict(other_key, publicKey=record["publicKey"])  # claims the balancer's key
    cases = {
        "bad signature": (tampered, {}),
        "another key": (other_key, {}),
        "bad signature ": (stolen_name, {}),
        "for swarm": (record, {"swarm": "other"}),
        "expired": (record, {"now": 161.0}),
        "not a plan record": ({"payload": "text"}, {}),
    }
    for reason, (forged, overrides) in cases.items():
        kwargs = {"signer": signer, "swarm": "digits", "now": 120.0, **overrides}
        with pytest.raises(PlanRecordError, match=reason.strip()):
            verify_plan(forged, **kwargs)
    garbage = sign_plan(a_plan(), key) | {"payload": b"[1, 2]"}
    garbage["signature"] = key.sign(b"[1, 2]", *_signature_args())
    with pytest.raises(PlanRecordError, match="not an object"):
        verify_plan(garbage, signer=signer, swarm="digits", now=120.0)


def _signature_args():
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import padding

    return padding.PKCS1v15(), hashes.SHA256()


def measurement(name: str, role: str, samples: float, up_mbps: float | None, down_mbps: float | None,
                client: bool = False) -> PeerMeasurement:
    rate = lambda mbps: None if mbps is None else mbps * MB  # noqa: E731
    return PeerMeasurement(peer_id=f"id-{name}", name=name, role=role, client_mode=client, samples_per_second=samples,
                           upload_bytes_per_second=rate(up_mbps), download_bytes_per_second=rate(down_mbps))


def test_inputs_come_from_measurements_capped_by_the_manifest(tmp_path):
    spec = load_manifest(write_manifest(tmp_path, {"spec": {
        "trainers": {"bandwidth": {"uploadMbps": 50}},
        "auxiliary": {"bandwidth": {"uploadMbps": 100, "downloadMbps": 100}}}})).spec
    measured = [
        measurement("trainer-0", "trainer", 300.0, 80.0, 90.0),
        measurement("trainer-1", "trainer", 200.0, None, 40.0),  # upload not measured yet, cap known
        measurement("trainer-2", "trainer", 100.0, 10.0, None),  # download unknown, no cap: waits
        measurement("auxiliary-0", "auxiliary", 55.0, None, None),  # caps stand in; never computes
        measurement("monitor-0", "monitor", 0.0, 5.0, 5.0),  # not an averaging peer
        measurement("trainer-3", "trainer", 100.0, 10.0, 10.0),  # its DHT record expired: gone
        measurement("trainer-4", "trainer", 0.0, 10.0, 10.0),  # speed not measured yet: waits
    ]
    alive = {f"id-{n}" for n in ("trainer-0", "trainer-1", "trainer-2", "auxiliary-0", "monitor-0", "trainer-4")}
    inputs = plan_inputs(spec, measured, num_parameters=1000, alive=alive)
    peers = {inputs.names[p.name]: p for p in inputs.problem.peers}
    assert set(peers) == {"trainer-0", "trainer-1", "auxiliary-0"} and inputs.waiting == ("trainer-2", "trainer-4")
    assert peers["trainer-0"].upload_mbps == pytest.approx(50.0) and peers["trainer-0"].download_mbps == pytest.approx(90)
    assert peers["trainer-1"].upload_mbps == 50.0 and peers["trainer-1"].download_mbps == pytest.approx(40.0)
    assert peers["auxiliary-0"].samples_per_second == 0.0 and peers["auxiliary-0"].upload_mbps == 100.0
    assert inputs.problem.target_batch_size == spec.target_batch_size and inputs.problem.num_parameters == 1000

    # a restarted trainer's new report and its predecessor's name one metrics address: the one
    # process scraped twice is planned once
    twice = [measurement("trainer-0", "trainer", 300.0, 80.0, 90.0)] * 2
    assert len(plan_inputs(spec, twice, num_parameters=1000).problem.peers) == 1

    # no plan while no peer computes, or every peer is in client mode
    assert plan_inputs(spec, [measurement("auxiliary-0", "auxiliary", 0.0, 5.0, 5.0)], 1000) is None
    assert plan_inputs(spec, [measurement("trainer-0", "trainer", 9.0, 5.0, 5.0, client=True)], 1000) is None


def problem(*peers: tuple[str, float, float]) -> AveragingProblem:
    return AveragingProblem(target_batch_size=256, num_parameters=10**6,
                            peers=[PeerCapacity(n, s, bw, bw) for n, s, bw in peers])


def test_replanning_is_triggered_by_membership_and_drift_only():
    base = problem(("a", 100.0, 50.0), ("b", 100.0, 50.0))
    assert drifted(base, base, 0.25) is None
    assert drifted(base, problem(("a", 110.0, 45.0), ("b", 90.0, 55.0)), 0.25) is None  # noise
    assert drifted(base, problem(("a", 100.0, 50.0)), 0.25).startswith("peers")
    assert drifted(base, problem(("a", 100.0, 50.0), ("b", 100.0, 20.0)), 0.25).startswith("inputs")


def test_the_plan_peers_follow_is_evaluated_under_new_inputs(tmp_path):
    """`throughput_of` (the balancer's yardstick for keeping a plan) gives a plan's own figures
    for its roles and shares, and holds it to account when the inputs change."""
    before = problem(("a", 100.0, 80.0), ("b", 100.0, 80.0), ("c", 100.0, 10.0))
    plan = plan_averaging(before)
    roles = {p.name: p.computes_gradients for p in plan.peers}
    shares = {p.name: p.aggregation_share for p in plan.peers}
    again = throughput_of(before, roles, shares)
    assert again.aggregation_bound == pytest.approx(plan.aggregation_bound)
    assert again.compute_bound == pytest.approx(plan.compute_bound)
    after = problem(("a", 100.0, 10.0), ("b", 100.0, 80.0), ("c", 100.0, 80.0))  # a and c swap links
    assert throughput_of(after, roles, shares).aggregation_bound < plan_averaging(after).aggregation_bound


def test_a_signed_plan_carries_the_solution_by_peer_id(tmp_path):
    spec = load_manifest(write_manifest(tmp_path)).spec
    measured = [measurement("trainer-0", "trainer", 300.0, 80.0, 80.0),
                measurement("auxiliary-0", "auxiliary", 0.0, 100.0, 100.0)]
    inputs = plan_inputs(spec, measured, 10_000)
    solved = plan_averaging(inputs.problem)
    plan = signed_plan("digits", inputs, solved, issued=10.0, ttl=60.0)
    assert plan.expires == 70.0 and {p.name for p in plan.peers} == {"trainer-0", "auxiliary-0"}
    assert sum(plan.shares().values()) == pytest.approx(1.0)
    assert plan.assignment("id-auxiliary-0").computes_gradients is False
    assert math.isfinite(plan.steps_per_second) and plan.steps_per_second == pytest.approx(solved.steps_per_second)
    assert SignedPlan.from_json(plan.to_json()) == plan


def test_the_default_group_size_follows_the_failure_probability(tmp_path):
    """DeDLOC appendix C: with reliable peers everyone averages at once; with failing peers,
    smaller groups reach the global average sooner."""
    from hivekeeper.swarm.optimizer import averaging_group_size

    def spec(**averaging):
        return load_manifest(write_manifest(tmp_path, {"spec": {"trainers": {"replicas": 14},
                                                                "auxiliary": {"replicas": 2},
                                                                "averaging": averaging}})).spec

    assert averaging_group_size(spec()) == 16
    assert averaging_group_size(spec(peerFailureProbability=0.1)) == 4
    assert averaging_group_size(spec(peerFailureProbability=0.1, targetGroupSize=8)) == 8


def test_a_peer_no_source_can_read_is_planned_from_its_own_report(tmp_path):
    """A volunteer behind a NAT serves /metrics where the cluster cannot scrape it: its DHT
    report stands in, and garbage in a report is no measurement."""
    from hivekeeper.swarm.balancer import with_reported

    scraped = [measurement("trainer-0", "trainer", 300.0, 80.0, 80.0)]
    reports = [
        {"peerId": "id-trainer-0", "role": "trainer", "name": "trainer-0", "samplesPerSecond": 1.0},  # scraped wins
        {"peerId": "id-alice", "role": "trainer", "name": "trainer-alice", "samplesPerSecond": 120.0,
         "uploadBytesPerSecond": 2 * MB, "downloadBytesPerSecond": 4 * MB, "clientMode": False},
        {"peerId": "id-bob", "role": "trainer", "name": "trainer-bob", "samplesPerSecond": "fast",
         "uploadBytesPerSecond": float("nan"), "downloadBytesPerSecond": None, "clientMode": "yes"},
        {"role": "trainer", "samplesPerSecond": 50.0},  # no identity
    ]
    merged = {m.name: m for m in with_reported(scraped, reports)}
    assert set(merged) == {"trainer-0", "trainer-alice", "trainer-bob"}
    assert merged["trainer-0"] == scraped[0]
    assert merged["trainer-alice"].samples_per_second == 120.0 and not merged["trainer-alice"].client_mode
    assert merged["trainer-alice"].upload_bytes_per_second == 2 * MB
    bob = merged["trainer-bob"]
    assert (bob.samples_per_second, bob.upload_bytes_per_second, bob.client_mode) == (0.0, None, False)

    spec = load_manifest(write_manifest(tmp_path)).spec
    inputs = plan_inputs(spec, list(merged.values()), 10_000)
    assert {inputs.names[p.name] for p in inputs.problem.peers} == {"trainer-0", "trainer-alice"}
    assert inputs.waiting == ("trainer-bob",)
