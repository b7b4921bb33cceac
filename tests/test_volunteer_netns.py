"""Volunteers joining from behind a NAT, with real networking (issue 7): a Swarm runs in a
"cluster" network namespace (`hivekeeper up --host`, its relay and token service included);
`hivekeeper join` runs in a "home" namespace behind a masquerading router that lets nothing in
(tests/netns.py). Every address is inside those namespaces.

Polling stays light (HTTP /status with curl inside a namespace): the machine has two cores and
the swarm, the volunteer and the test share them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

import pytest

from conftest import wait_for, write_manifest
from netns import NatLab, skip_unless_possible

pytestmark = [pytest.mark.swarm, pytest.mark.netns]

VOLUNTEER = "alice"
LAB = "lab-b"
NAME = "hkt-volunteers"
MANIFEST = {  # over examples/swarm-digits-volunteers.yaml
    "metadata": {"name": NAME},
    "spec": {
        # a lone cluster trainer (~600 samples/s here) must not outrun a volunteer that joins
        # minutes later: hivemind groups only peers at the same epoch
        "targetBatchSize": 2048,
        "trainers": {"replicas": 1, "batchSize": 16},
        "auxiliary": {"replicas": 0},
        # the example's matchmaking time (5 s): join requests time out at half of it, and 1 s
        # was too tight for a volunteer on 2 loaded cores
        "averaging": {"timeoutSeconds": 15, "targetGroupSize": 4},
        "monitor": {"evalEverySteps": 1000, "checkpointEverySteps": 1000},
        # the balancer plans the volunteer too: it cannot scrape a NATed peer's /metrics, so it
        # reads the volunteer's own DHT report
        "balancer": {"replanSeconds": 5},
        "stopping": {"targetSteps": 100_000, "targetMetric": None},  # the tests end the run
        # a lab's machine joins in direct mode (test_direct_volunteer_contributes)
        "volunteers": {"allowlist": [VOLUNTEER], "labs": [{"name": LAB, "maxPeers": 2, "roles": ["trainer"]}]},
    },
}

# A hivemind peer with no authorizer: its requests carry no token, so peers answer nothing.
INTRUDER = """
import sys, hivemind
try:
    dht = hivemind.DHT(initial_peers=sys.argv[2:], client_mode=True, start=True)
except Exception as e:
    print("refused:", type(e).__name__, e)
else:
    try:
        found = dht.get(sys.argv[1] + "_peers", latest=True)
        print("records:", len(found.value) if found is not None else 0)
    finally:
        dht.shutdown()
"""

# A hivemind peer that knows every peer's ID and addresses (the test reads them from the swarm's
# DHT for it) and calls each RPC those peers serve, with the product's own stubs. Without a swarm
# key it holds no token (a stranger). With one, it mints itself a token that lives TTL seconds
# (a volunteer whose renewals stop once it is off the allowlist), calls, waits out the token and
# calls again.
CALLER = """
import asyncio, json, struct, sys, time
from hivemind.p2p import P2P, PeerID
from hivemind.proto import averaging_pb2
from hivemind.utils.crypto import RSAPrivateKey
from hivemind.utils.multiaddr import Multiaddr
from hivekeeper.auth.keys import load_swarm_key
from hivekeeper.auth.tokens import issue_access_token
from hivekeeper.hivemind_ext import admission
from hivekeeper.hivemind_ext.allreduce import PlannedCountingGradientAverager
from hivekeeper.hivemind_ext.optimizer import FiniteStateAverager
from hivekeeper.runtime.bandwidth import PROBE_HANDLER

class Credentials:
    def __init__(self, swarm_key, ttl):
        self.private_key, self.swarm_public_key = RSAPrivateKey(), swarm_key.get_public_key()
        self.token = issue_access_token(swarm_key, "leaving", self.private_key.get_public_key().to_bytes(), ttl)
    async def get_token(self):
        return self.token

async def outcome(call):
    try:
        return "answer: " + str(await asyncio.wait_for(call(), 20))[:120]
    except Exception as e:
        return type(e).__name__ + ": " + str(e)

async def calls(p2p, name, target):
    peer = PeerID.from_base58(target["peerId"])
    found = {}
    if target["role"] == "backbone":
        async def probe():
            _, reader, writer = await p2p.call_binary_stream_handler(peer, PROBE_HANDLER)
            writer.write(struct.pack("!QQ", 4096, 4096) + bytes(4096))
            data = await reader.read(-1)
            return data.decode(errors="replace") if b"refused" in data else f"probe of {len(data)} bytes"
        found["bandwidth probe"] = probe
    if target["role"] == "trainer":
        state = FiniteStateAverager.get_stub(p2p, peer, namespace=name + "_state_averager")
        grads = PlannedCountingGradientAverager.get_stub(p2p, peer, namespace=name + "_grad_averager")
        async def download():
            async for message in await state.rpc_download_state(averaging_pb2.DownloadRequest()):
                return "state, first part " + str(len(message.tensor_part.buffer)) + " bytes"
        async def join():
            request = averaging_pb2.JoinRequest(schema_hash=b"x", expiration=time.time() + 5, gather=b"")
            async for message in await grads.rpc_join_group(request):
                return "join group: code " + str(message.code)
        found.update({"state download": download, "join group": join})
    return {target["role"] + " " + what: await outcome(call) for what, call in found.items()}

async def main(name, targets, swarm_key, ttl):
    if swarm_key:
        credentials = Credentials(load_swarm_key(swarm_key), ttl)
        admission.install(credentials)
    p2p = await P2P.create(host_maddrs=["/ip4/0.0.0.0/tcp/0"])
    rounds = []
    for target in targets:
        await p2p._client.connect(PeerID.from_base58(target["peerId"]),
                                  [Multiaddr(m.split("/p2p/")[0]) for m in target["maddrs"]])
    for _ in range(2 if swarm_key else 1):
        if rounds:  # the token has run out and is not renewed
            await asyncio.sleep(max(0.0, ttl + 1 - (time.time() - started)))
        started = time.time() if not rounds else started
        results = {}
        for target in targets:
            results.update(await calls(p2p, name, target))
        rounds.append(results)
    await p2p.shutdown()
    print(json.dumps(rounds))

asyncio.run(main(sys.argv[1], json.loads(sys.argv[2]), sys.argv[3], float(sys.argv[4])))
"""


def get_json(lab: NatLab, ns: str, url: str) -> Optional[Any]:
    done = lab.run(ns, ["curl", "-sf", "--max-time", "3", url], check=False, timeout=10)
    try:
        return json.loads(done.stdout) if done.returncode == 0 else None
    except ValueError:
        return None


@dataclass
class Cluster:
    lab: NatLab
    run_dir: Path
    runner: subprocess.Popen
    invites: dict[str, Future] = field(default_factory=dict, repr=False)  # identity: its invite, minted once

    @property
    def run(self) -> dict[str, Any]:
        return json.loads((self.run_dir / "run.json").read_text())

    @property
    def gateway(self) -> str:
        return self.run["gateway"]

    def invite(self, identity: str = VOLUNTEER) -> str:
        """What an admin hands a volunteer: `hivekeeper invite RUN_DIR --identity NAME`. Minted
        once per identity and cluster (the command imports hivemind: seconds of CPU) and handed
        to each volunteer of that identity: an invite serves again until it expires (a week)."""
        return self.mint_invite(identity).result()

    def mint_invite(self, identity: str = VOLUNTEER) -> Future:
        """Starts minting the invite in the background, once the run has its signing key, unless
        it is under way or done: the cluster's start-up need not wait for it."""
        if identity not in self.invites:
            def mint() -> str:
                wait_for(lambda: (self.run_dir / "keys" / "swarm-auth.pem").is_file(), 60, "the swarm's signing key")
                done = subprocess.run([sys.executable, "-m", "hivekeeper", "invite", str(self.run_dir), "--identity",
                                       identity], capture_output=True, text=True, timeout=120)
                assert done.returncode == 0, done.stderr
                return done.stdout.strip()

            pool = ThreadPoolExecutor(1)
            self.invites[identity] = pool.submit(mint)
            pool.shutdown(wait=False)
        return self.invites[identity]

    def status(self, role: str) -> Optional[dict[str, Any]]:
        port = json.loads((self.run_dir / "ports.json").read_text())[role]
        return get_json(self.lab, self.lab.cluster, f"http://{self.lab.cluster_ip}:{port}/status")

    def reports(self) -> list[dict[str, Any]]:
        """Every peer's report as the swarm's DHT has it, read from inside the cluster."""
        done = self.lab.run(self.lab.cluster, [sys.executable, "-m", "hivekeeper", "status", str(self.run_dir),
                                               "--swarm", NAME, "--json"], check=False, timeout=180)
        return json.loads(done.stdout) if done.returncode == 0 else []

    def relay_groups(self) -> set[int]:
        """Process groups of the relay roles (each with its DHT process and p2pd)."""
        groups = set()
        for pid in self.lab.pids(self.lab.cluster):
            try:
                if b" run relay " in b" " + Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" "):
                    groups.add(os.getpgid(pid))
            except (OSError, ProcessLookupError):
                pass
        return groups


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    skip_unless_possible()
    tmp = tmp_path_factory.mktemp("volunteers")
    manifest = write_manifest(tmp, MANIFEST, base="swarm-digits-volunteers.yaml")
    with NatLab() as lab:
        run_dir = tmp / "cluster"
        with open(tmp / "up.log", "wb") as log:
            runner = lab.popen(lab.cluster, [sys.executable, "-m", "hivekeeper", "up", str(manifest), "--run-dir",
                                             str(run_dir), "--host", lab.cluster_ip], stdout=log, stderr=subprocess.STDOUT)
        swarm = Cluster(lab, run_dir, runner)
        try:
            swarm.mint_invite()  # meanwhile
            wait_for(lambda: (run_dir / "ports.json").exists() and (swarm.status("monitor-0") or {}).get("globalStep"),
                     150, "the cluster to train")
            yield swarm
        finally:
            runner.send_signal(signal.SIGINT)  # up stops every process it started
            try:
                runner.wait(20)
            except subprocess.TimeoutExpired:
                pass


class Volunteer:
    """`hivekeeper join` running in a namespace; its join.json is read as it is rewritten."""

    def __init__(self, cluster: Cluster, ns: str, host: str, run_dir: Path, *extra: str, identity: str = VOLUNTEER):
        self.lab, self.ns, self.run_dir = cluster.lab, ns, run_dir
        with open(run_dir.with_suffix(".log"), "wb") as log:
            self.process = self.lab.popen(ns, [sys.executable, "-m", "hivekeeper", "join", cluster.gateway, "--token",
                                               cluster.invite(identity), "--run-dir", str(run_dir), "--host", host,
                                               *extra],
                                          stdout=log, stderr=subprocess.STDOUT)

    def record(self) -> dict[str, Any]:
        try:
            return json.loads((self.run_dir / "join.json").read_text())
        except (OSError, ValueError):
            return {}

    def seconds(self, milestone: str) -> Optional[float]:
        return self.record().get("seconds", {}).get(milestone)

    def status(self) -> Optional[dict[str, Any]]:
        url = self.record().get("status")
        return get_json(self.lab, self.ns, url) if url else None

    def averaged(self, after: float = 0.0) -> Optional[dict[str, Any]]:
        """Its status once its latest averaging round succeeded with others, after `after` (wall time)."""
        status = self.status() or {}
        last = status.get("lastRound") or {}
        if status.get("samples") and last.get("outcome") == "success" and last.get("groupSize", 0) >= 2 \
                and last.get("time", 0) > after:
            return status
        return None

    def stop(self) -> dict[str, Any]:
        if self.process.poll() is None:
            self.process.send_signal(signal.SIGINT)
            try:
                self.process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait(5)
        summary = self.run_dir / "summary.json"
        return json.loads(summary.read_text()) if summary.exists() else {}

    def __enter__(self) -> "Volunteer":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def contributes(cluster: Cluster, volunteer: Volunteer, mode: str) -> dict[str, Any]:
    """The volunteer runs in `mode`, averages with the swarm, and the collaboration counts it:
    the monitor sees a second trainer and the volunteer's report (samples, rounds) is in the
    swarm's DHT. Its report, as the DHT has it."""
    wait_for(lambda: volunteer.record().get("mode") or volunteer.process.poll() is not None, 90, "its mode")
    assert volunteer.record().get("mode") == mode, volunteer.record()
    wait_for(volunteer.averaged, 240, f"a successful averaging round with the {mode}-mode volunteer")
    wait_for(lambda: volunteer.seconds("firstGradient"), 10, "join to record the first gradient")
    wait_for(lambda: (cluster.status("monitor-0") or {}).get("peersAlive", {}).get("trainer", 0) >= 2, 60,
             "the monitor to count the volunteer's trainer")
    name = volunteer.record()["peerName"]
    report = next((r for r in cluster.reports() if r.get("name") == name), None)
    assert report and report["role"] == "trainer" and report["samples"] > 0, report
    wait_for(lambda: name in {p["name"] for p in ((cluster.status("balancer-0") or {}).get("plan") or {}).get("peers", [])},
             90, "the balancer to plan the volunteer")
    wait_for(lambda: (volunteer.status() or {}).get("plannedRounds", 0) >= 1, 120,
             "a round on the balancer's plan with the volunteer")
    return report


def test_dry_run_tells_the_mode_and_refuses_clearly(cluster, tmp_path):
    """Behind the NAT: relay mode, and a refusal when direct mode is demanded. (An identity off
    the allowlist and a silent gateway: tests/test_auth.py, without namespaces.)"""
    lab, alice = cluster.lab, cluster.invite()
    runs = {"home": (), "forced": ("--mode", "direct")}  # name: extra arguments

    def dry_run(name: str) -> subprocess.CompletedProcess:
        return lab.run(lab.home, [sys.executable, "-m", "hivekeeper", "join", cluster.gateway, "--token", alice,
                                  "--run-dir", str(tmp_path / name), "--host", lab.home_ip, "--dry-run", *runs[name]],
                       check=False, timeout=150)

    with ThreadPoolExecutor(len(runs)) as pool:
        done = dict(zip(runs, pool.map(dry_run, runs)))
    mode = json.loads((tmp_path / "home" / "join.json").read_text()).get("mode")  # direct: test_direct_volunteer_...
    assert done["home"].returncode == 0 and mode == "relay" and "relay mode" in done["home"].stderr, \
        done["home"].stderr
    assert done["forced"].returncode == 2 and "cannot run in direct mode" in done["forced"].stderr, done["forced"].stderr


def test_a_peer_without_a_token_gets_nothing(cluster):
    """A plain hivemind peer at home, through the relay: its DHT requests carry no token, so the
    swarm's peers answer nothing, and the swarm trains on."""
    lab = cluster.lab
    step = (cluster.status("monitor-0") or {}).get("globalStep", 0)
    relays = json.loads((cluster.run_dir / "keys" / "swarm-info.json").read_text())["relays"]
    intruder = lab.run(lab.home, [sys.executable, "-c", INTRUDER, NAME, *relays], check=False, timeout=120)
    assert "records: 0" in intruder.stdout or "refused" in intruder.stdout, intruder.stdout + intruder.stderr[-2000:]
    wait_for(lambda: (cluster.status("monitor-0") or {}).get("globalStep", 0) > step, 90, "training to go on")


def call_every_rpc(cluster: Cluster, swarm_key: str = "", ttl: float = 0.0) -> list[dict[str, str]]:
    """CALLER's outcomes, a round of calls each (see above), to the backbone and the trainer."""
    lab = cluster.lab
    targets = [{"role": r["role"], "peerId": r["peerId"], "maddrs": r["maddrs"]} for r in cluster.reports()
               if r.get("role") in ("backbone", "trainer") and r.get("maddrs")]
    assert {t["role"] for t in targets} == {"backbone", "trainer"}, targets
    done = lab.run(lab.cluster, [sys.executable, "-c", CALLER, NAME, json.dumps(targets), swarm_key, str(ttl)],
                   check=False, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    rounds = json.loads(done.stdout.strip().splitlines()[-1])
    for results in rounds:
        assert set(results) == {"backbone bandwidth probe", "trainer state download", "trainer join group"}, results
    return rounds


def refused(results: dict[str, str]) -> dict[str, str]:
    return {call: outcome for call, outcome in results.items() if "hivekeeper admission refused" in outcome}


def trainer_refusals(cluster: Cluster) -> dict[str, float]:
    port = json.loads((cluster.run_dir / "ports.json").read_text())["trainer-0"]
    text = cluster.lab.run(cluster.lab.cluster, ["curl", "-sf", "--max-time", "3",
                                                 f"http://{cluster.lab.cluster_ip}:{port}/metrics"],
                           check=False, timeout=10).stdout
    found = re.findall(r'^hivekeeper_rpc_refused_total\{reason="(\w+)"\} (\S+)$', text, re.MULTILINE)
    return {reason: float(value) for reason, value in found}


def test_a_stranger_who_knows_every_address_gets_no_rpc_served(cluster):
    """Addresses and peer IDs are no secret: a peer without a token dials the backbone and the
    trainer directly and calls their RPCs (state download, matchmaking, bandwidth probe). Each
    is refused, the refusals are counted, and the swarm trains on."""
    step = (cluster.status("monitor-0") or {}).get("globalStep", 0)
    before = trainer_refusals(cluster).get("not_admitted", 0.0)
    [results] = call_every_rpc(cluster)
    assert refused(results) == results, results
    assert trainer_refusals(cluster).get("not_admitted", 0.0) >= before + 2  # its two calls to the trainer
    wait_for(lambda: (cluster.status("monitor-0") or {}).get("globalStep", 0) > step, 90, "training to go on")


def test_a_revoked_identity_loses_access_when_its_token_runs_out(cluster):
    """A token holder is served every RPC; once its token runs out (the token service renews no
    token for an identity taken off the allowlist: test_auth), every RPC is refused."""
    ttl = 15.0
    first, second = call_every_rpc(cluster, str(cluster.run_dir / "keys" / "swarm-auth.pem"), ttl)
    assert not refused(first) and all(outcome.startswith("answer: ") for outcome in first.values()), first
    assert refused(second) == second, second


@pytest.mark.timeout(420)
def test_direct_volunteer_contributes(cluster, tmp_path):
    """A volunteer the relay can dial back (here: inside the cluster's network) runs direct. It is
    a lab's machine: its trainer asks for a token naming its role and itself, and the token
    service counts it against the lab's quota."""
    lab = cluster.lab
    cluster.mint_invite(LAB)
    with Volunteer(cluster, lab.cluster, lab.cluster_ip, tmp_path / "direct", identity=LAB) as volunteer:
        report = contributes(cluster, volunteer, "direct")
        assert report.get("lab") == LAB, report  # the swarm's DHT tells whose peer it is
        assert (cluster.status("auth-0") or {}).get("labPeers") == {LAB: 1}
        def parts() -> Optional[dict[str, Any]]:
            found = {p["name"]: p for p in (cluster.status("monitor-0") or {}).get("labs") or []}
            return found if LAB in found else None

        found = wait_for(parts, 30, "the monitor to show the lab's part")
        assert found[LAB]["peers"] == 1 and found[LAB]["samples"] > 0 and found[NAME]["host"], found


@pytest.mark.timeout(600)
def test_relayed_volunteer_contributes_and_survives_a_relay_restart(cluster, tmp_path):
    lab = cluster.lab
    with Volunteer(cluster, lab.home, lab.home_ip, tmp_path / "relayed") as volunteer:
        contributes(cluster, volunteer, "relay")
        wait_for(lambda: volunteer.seconds("relayedReachable"), 60, "the relay to dial the volunteer back")

        # The relay restarts (up brings it back). Its reservation gone, the volunteer must get it
        # back on its own: the new relay instance dials it back through a fresh reservation.
        groups = cluster.relay_groups()
        assert groups
        restarted = time.time()
        for group in groups:
            os.killpg(group, signal.SIGKILL)  # the role and its p2pd: a crash, as far as up can tell
        since_start = restarted - volunteer.record()["startedAt"]
        wait_for(lambda: (volunteer.record().get("relayedReachableSince") or 0) > since_start, 300,
                 "the volunteer reachable through the restarted relay")
        wait_for(lambda: (cluster.status("relay-0") or {}).get("reachabilityChecks", {}).get("reachable"), 30,
                 "the new relay instance to count a successful dial-back")
        wait_for(lambda: volunteer.averaged(after=restarted + 1), 180, "a successful round after the restart")
        summary = volunteer.stop()
    assert summary["mode"] == "relay" and summary["watchdogRestarts"] >= 1, summary


@pytest.mark.timeout(420)
def test_client_mode_without_a_reachable_relay(cluster, tmp_path):
    """Home's router refuses the relay's port. The backbone is a second entry point here (a
    local run's backbone listens on the same public host; the test adds it to what the token
    service hands out if the runner does not list it), so the volunteer joins dialing out only."""
    lab = cluster.lab
    info_path = cluster.run_dir / "keys" / "swarm-info.json"
    info = json.loads(info_path.read_text())
    info["initialPeers"] = list(dict.fromkeys(info["initialPeers"] + cluster.run["initialPeers"]))
    info_path.write_text(json.dumps(info))
    relay_port = info["relays"][0].split("/tcp/")[1].split("/")[0]
    rule = ["FORWARD", "-d", lab.cluster_ip, "-p", "tcp", "--dport", relay_port, "-j", "REJECT", "--reject-with",
            "tcp-reset"]
    lab.run(lab.nat, ["iptables", "-w", "-I", *rule])
    try:
        with Volunteer(cluster, lab.home, lab.home_ip, tmp_path / "client") as volunteer:
            contributes(cluster, volunteer, "client")
    finally:
        lab.run(lab.nat, ["iptables", "-w", "-D", *rule])
