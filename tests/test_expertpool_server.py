"""One real expert server (`hivekeeper run expert-server`) and a DMoE layer in the test process:
backward requests change exactly the experts the gating selected, bad requests get one clear
error and leave the server serving, and a restarted server serves its experts from checkpoints."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
import yaml

from conftest import EXAMPLES, deep_update, wait_for
from hivekeeper.local.network import free_port

POOL = {"metadata": {"name": "server-test"}, "spec": {
    "grid": {"dimensions": [2, 2]},
    "expert": {"hiddenSize": 16},
    "optimizer": {"name": "sgd", "learningRate": 0.1},
    "servers": {"replicas": 1, "announcePeriodSeconds": 1, "announceExpirationSeconds": 3},
    "checkpoint": {"everySeconds": 1},
    "trainers": {"dmoe": {"kBest": 1}},
}}


def status(port: int) -> dict | None:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/status", timeout=2) as reply:
            return json.loads(reply.read())
    except OSError:
        return None


def start_server(manifest: Path, run_dir: Path, port: int, initial_peers: list[str]) -> subprocess.Popen:
    log = open(run_dir / "server.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "hivekeeper", "run", "expert-server", "--manifest", str(manifest),
                             "--index", "0", "--metrics-port", str(port), "--run-dir", str(run_dir),
                             "--initial-peers", *initial_peers], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def stop(server: subprocess.Popen) -> int:
    os.killpg(server.pid, signal.SIGTERM)
    try:
        return server.wait(30)
    finally:
        try:
            os.killpg(server.pid, signal.SIGKILL)  # hivemind's worker processes, if any lingered
        except ProcessLookupError:
            pass


@pytest.mark.swarm
@pytest.mark.timeout(180)
def test_updates_bad_requests_and_restart_from_checkpoints(tmp_path, no_leaked_p2pd):
    import hivemind

    from hivekeeper.experts.dmoe import DMoE, ExpertClient
    from hivemind.moe.expert_uid import ExpertInfo
    from hivemind.p2p import PeerID

    manifest = tmp_path / "pool.yaml"
    manifest.write_text(yaml.safe_dump(deep_update(yaml.safe_load((EXAMPLES / "expertpool.yaml").read_text()), POOL)))
    port = free_port()
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    server = start_server(manifest, tmp_path, port, [str(a) for a in dht.get_visible_maddrs()])
    try:
        client = ExpertClient(dht)
        uids = ["expert.0.0", "expert.0.1", "expert.1.0", "expert.1.1"]
        peer = wait_for(lambda: (status(port) or {}).get("peerId"), 120, "the server's status")
        wait_for(lambda: len(client.find_best_experts("expert", [torch.zeros(1, 2)] * 2, 4)[0]) == 4, 60,
                 "4 experts announced in the DHT")
        experts = [ExpertInfo(uid, PeerID.from_base58(peer)) for uid in uids]
        probe = torch.randn(4, 16)

        def outputs() -> dict[str, torch.Tensor]:  # forward requests have no side effects
            return {e.uid: client.call(e, [probe]).result(timeout=30)[0] for e in experts}

        before = outputs()
        # gating that prefers coordinate (1, 0) for every example: top-1 is expert.1.0
        layer = DMoE(client, "expert", [2, 2], 16, k_best=1)
        with torch.no_grad():
            for gate, best in zip(layer.gates, (1, 0)):
                gate.weight.zero_()
                gate.bias.copy_(torch.tensor([5.0 if c == best else 0.0 for c in range(2)]))
        x = torch.randn(8, 16, requires_grad=True)
        layer(x).pow(2).sum().backward()
        assert {e.uid for row in layer.last_choices for e in row} == {"expert.1.0"}
        assert x.grad is not None and x.grad.abs().sum() > 0  # the expert's input gradient came back
        after = outputs()
        assert not torch.equal(after["expert.1.0"], before["expert.1.0"])  # the backward request updated it
        for uid in ("expert.0.0", "expert.0.1", "expert.1.1"):
            assert torch.equal(after[uid], before[uid]), f"{uid} changed without being selected"
        assert wait_for(lambda: status(port)["experts"]["expert.1.0"]["updates"] == 1, 10, "the update count")
        assert {uid: e["updates"] for uid, e in status(port)["experts"].items() if uid != "expert.1.0"} == {
            "expert.0.0": 0, "expert.0.1": 0, "expert.1.1": 0}

        # bad requests: one clear line each, and the server keeps serving
        with pytest.raises(Exception) as wrong_shape:
            client.call(experts[0], [torch.randn(3, 5)]).result(timeout=30)
        assert "expert expert.0.0: forward tensor 0 has shape (3, 5), expected [batch, 16]" in str(wrong_shape.value)
        with pytest.raises(Exception) as unknown:
            client.call(ExpertInfo("expert.7.7", experts[0].peer_id), [probe]).result(timeout=30)
        assert "unknown expert uid 'expert.7.7': this server holds expert.0.0, expert.0.1" in str(unknown.value)
        with pytest.raises(Exception) as wrong_backward:
            client.call(experts[0], [probe, torch.randn(4, 3)], backward=True).result(timeout=30)
        assert "backward tensor 1 has shape (4, 3), expected [batch, 16]" in str(wrong_backward.value)
        assert torch.equal(outputs()["expert.0.0"], before["expert.0.0"])

        # a clean stop checkpoints; the restarted server resumes the same weights and update counts
        assert stop(server) == 0
        server = start_server(manifest, tmp_path, port, [str(a) for a in dht.get_visible_maddrs()])
        resumed = wait_for(lambda: (status(port) or {}).get("resumed"), 120, "the restarted server's status")
        assert resumed == {"expert.0.0": 0, "expert.0.1": 0, "expert.1.0": 1, "expert.1.1": 0}
        new_peer = PeerID.from_base58(status(port)["peerId"])
        experts = [ExpertInfo(uid, new_peer) for uid in uids]
        for uid, output in outputs().items():
            torch.testing.assert_close(output, after[uid])
    finally:
        if server.poll() is None:
            stop(server)
        dht.shutdown()
