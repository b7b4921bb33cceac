"""`hivekeeper up` of a Swarm that admits peers by token, on loopback with real hivemind peers:
the runner starts the token service and the relay, every role of its own gets in with its
invite and the swarm trains; an invited, allowlisted volunteer gets a token, an invite for an
identity off the allowlist and a DHT peer without any token get nothing, and training goes on."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from conftest import deep_update, wait_for, write_manifest
from hivekeeper.local.network import free_port
from test_swarm_local import global_step, start_up

DOOR = {"spec": {
    "targetBatchSize": 128,
    "trainers": {"replicas": 2, "batchSize": 32},
    "auxiliary": {"replicas": 1},
    "monitor": {"evalEverySteps": 4, "checkpointEverySteps": 8},
    "stopping": {"targetSteps": 40, "targetMetric": None},
}}


def hivekeeper(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "hivekeeper", *args], capture_output=True, text=True, timeout=120)


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_swarm_with_volunteers_admits_only_invited_allowlisted_peers(tmp_path, no_leaked_p2pd):
    from hivekeeper.auth.client import AccessRefused, request_access
    from hivekeeper.auth.keys import load_swarm_key
    from hivekeeper.auth.tokens import verify_access_token
    from hivemind.utils.crypto import RSAPrivateKey

    run_dir = tmp_path / "run"
    relay_port, gateway_port = free_port(), free_port()
    door = deep_update(DOOR, {"spec": {"volunteers": {"relayPort": relay_port, "gatewayPort": gateway_port}}})
    runner = start_up(write_manifest(tmp_path, door, base="swarm-digits-volunteers.yaml"), run_dir)
    try:
        wait_for(lambda: global_step(run_dir) >= 3, 180, "three global steps with every peer on a token")
        run = json.loads((run_dir / "run.json").read_text())
        assert run["gateway"] == f"127.0.0.1:{gateway_port}"

        # An allowlisted volunteer's invite buys a token for its key, and the swarm's relays.
        invite = hivekeeper("invite", str(run_dir), "--identity", "alice")
        assert invite.returncode == 0, invite.stderr
        key = RSAPrivateKey()
        grant = request_access(run["gateway"], invite.stdout.strip(), key)
        swarm_key = load_swarm_key(run_dir / "keys" / "swarm-auth.pem").get_public_key()
        assert verify_access_token(grant.token, swarm_key) and grant.identity == "alice"
        assert grant.swarm["relays"] and f"/tcp/{relay_port}/" in grant.swarm["relays"][0]
        assert grant.swarm["manifest"]["metadata"]["name"] == "digits-open"
        # Invited, but not on the allowlist: refused.
        mallory = hivekeeper("invite", str(run_dir), "--identity", "mallory").stdout.strip()
        with pytest.raises(AccessRefused, match="allowlist"):
            request_access(run["gateway"], mallory, RSAPrivateKey())

        # A peer without a token reads nothing from the swarm's DHT.
        step_before = global_step(run_dir)
        intruder = subprocess.run([sys.executable, "-c", INTRUDER, *grant.swarm["relays"]], capture_output=True,
                                  text=True, timeout=90)
        assert "records: 0" in intruder.stdout or "refused" in intruder.stdout, intruder.stdout + intruder.stderr[-2000:]
        # The swarm's own view through the admin invite: every role reports.
        def roles() -> set[str]:
            status = hivekeeper("status", str(run_dir), "--swarm", "digits-open", "--json")
            assert status.returncode == 0, status.stderr
            return {report["role"] for report in json.loads(status.stdout)}

        wait_for(lambda: {"trainer", "auxiliary"} <= roles(), 60, "the trainers' and the auxiliary's reports")
        wait_for(lambda: global_step(run_dir) > step_before, 90, "training to go on")
    finally:
        if runner.poll() is None:
            runner.send_signal(signal.SIGINT)
            runner.wait(60)


# A hivemind peer with no authorizer: its requests carry no token, so peers answer nothing.
INTRUDER = """
import sys, hivemind
try:
    dht = hivemind.DHT(initial_peers=sys.argv[1:], client_mode=True, start=True)
except Exception as e:
    print("refused:", type(e).__name__, e)
else:
    try:
        found = dht.get("digits-open_peers", latest=True)
        print("records:", len(found.value) if found is not None else 0)
    finally:
        dht.shutdown()
"""
