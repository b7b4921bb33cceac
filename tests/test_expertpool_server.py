"""One real expert server (`hivekeeper run expert-server`) and a DMoE layer in the test process:
backward requests change exactly the experts the gating selected, bad requests get one clear
error and leave the server serving, and a restarted server serves its experts from checkpoints;
Transformer-block experts take token-shaped inputs, answer as the same block run here does, and
take the same update from a backward request; a server that hangs is timed out, its experts
left out of the average and of the backward pass."""

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


def write_pool(directory: Path, changes: dict) -> Path:
    manifest = directory / "pool.yaml"
    document = deep_update(yaml.safe_load((EXAMPLES / "expertpool.yaml").read_text()), deep_update(POOL, changes))
    manifest.write_text(yaml.safe_dump(document))
    return manifest


def start_server(manifest: Path, run_dir: Path, port: int, initial_peers: list[str],
                 index: int = 0) -> subprocess.Popen:
    log = open(run_dir / f"server-{index}.log", "ab")
    return subprocess.Popen([sys.executable, "-m", "hivekeeper", "run", "expert-server", "--manifest", str(manifest),
                             "--index", str(index), "--metrics-port", str(port), "--run-dir", str(run_dir),
                             "--initial-peers", *initial_peers], stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)


def serve(manifest: Path, run_dir: Path):
    """A DHT peer here and one expert server bootstrapped from it: (dht, the server's HTTP port, server)."""
    import hivemind

    port = free_port()
    dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    return dht, port, start_server(manifest, run_dir, port, [str(a) for a in dht.get_visible_maddrs()])


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
    from hivekeeper.experts.dmoe import DMoE, ExpertClient
    from hivemind.moe.expert_uid import ExpertInfo
    from hivemind.p2p import PeerID

    manifest = write_pool(tmp_path, {})
    dht, port, server = serve(manifest, tmp_path)
    try:
        client = ExpertClient(dht)
        experts = announced_experts(client, port)
        probe = torch.randn(4, 16)

        def outputs() -> dict[str, torch.Tensor]:
            return served_outputs(client, experts, probe)

        before = outputs()
        layer = prefer(DMoE(client, "expert", [2, 2], 16, k_best=1), (1, 0))  # top-1 is expert.1.0
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
        experts = [ExpertInfo(e.uid, new_peer) for e in experts]
        for uid, output in outputs().items():
            torch.testing.assert_close(output, after[uid])
    finally:
        if server.poll() is None:
            stop(server)
        dht.shutdown()


def announced_experts(client, port: int) -> list:
    """The server's 4 experts, once its status is up and the DHT has them all."""
    from hivemind.moe.expert_uid import ExpertInfo
    from hivemind.p2p import PeerID

    peer = PeerID.from_base58(wait_for(lambda: (status(port) or {}).get("peerId"), 120, "the server's status"))
    wait_for(lambda: len(client.find_best_experts("expert", [torch.zeros(1, 2)] * 2, 4)[0]) == 4, 60,
             "4 experts announced in the DHT")
    return [ExpertInfo(uid, peer) for uid in ("expert.0.0", "expert.0.1", "expert.1.0", "expert.1.1")]


def served_outputs(client, experts, probe: torch.Tensor) -> dict[str, torch.Tensor]:
    """Every expert's output for `probe` (forward requests have no side effects)."""
    return {e.uid: client.call(e, [probe]).result(timeout=30)[0] for e in experts}


def prefer(layer, cell: tuple[int, ...]):
    """Gating that puts grid cell `cell` first for every example."""
    with torch.no_grad():
        for gate, best in zip(layer.gates, cell):
            gate.weight.zero_()
            gate.bias.copy_(torch.tensor([5.0 if c == best else 0.0 for c in range(gate.out_features)]))
    return layer


@pytest.mark.swarm
@pytest.mark.timeout(180)
def test_transformer_experts_serve_tokens_and_update_like_the_local_block(tmp_path, no_leaked_p2pd):
    from hivekeeper.experts.backend import make_backend
    from hivekeeper.experts.dmoe import DMoE, ExpertClient
    from hivekeeper.spec import load_manifest

    tokens, hidden = 4, 16
    manifest = write_pool(tmp_path, {"metadata": {"name": "transformer-test"}, "spec": {
        "expert": {"type": "transformer", "hiddenSize": hidden, "numHeads": 2, "sequenceLength": tokens},
        "checkpoint": {"enabled": False}}})
    spec = load_manifest(manifest).spec
    dht, port, server = serve(manifest, tmp_path)
    try:
        client = ExpertClient(dht)
        experts = announced_experts(client, port)
        uids = [e.uid for e in experts]
        # the same experts built here: a fresh expert's weights depend only on its uid and the seed
        local = {uid: make_backend(spec, uid) for uid in uids}
        probe = torch.randn(3, tokens, hidden)
        before = served_outputs(client, experts, probe)
        with torch.no_grad():
            for uid in uids:
                torch.testing.assert_close(before[uid], local[uid].module(probe))

        layer = prefer(DMoE(client, "expert", [2, 2], hidden, k_best=1), (0, 1))  # top-1 is expert.0.1
        x = torch.randn(6, tokens, hidden, requires_grad=True)
        out = layer(x)
        assert out.shape == (6, tokens, hidden)
        assert {e.uid for row in layer.last_choices for e in row} == {"expert.0.1"}
        with torch.no_grad():
            expected = local["expert.0.1"].module(x)
        torch.testing.assert_close(out, expected)  # one expert, weight 1: its output unchanged
        out.pow(2).sum().backward()
        assert x.grad is not None and x.grad.abs().sum() > 0

        # the server applied the update the same block takes here from the same output gradient
        local["expert.0.1"].backward(x.detach(), 2 * expected)
        after = served_outputs(client, experts, probe)
        assert not torch.allclose(after["expert.0.1"], before["expert.0.1"])
        with torch.no_grad():
            torch.testing.assert_close(after["expert.0.1"], local["expert.0.1"].module(probe))
        for uid in ("expert.0.0", "expert.1.0", "expert.1.1"):
            assert torch.equal(after[uid], before[uid]), f"{uid} changed without being selected"
        assert wait_for(lambda: status(port)["experts"]["expert.0.1"]["updates"] == 1, 10, "the update count")
        assert {uid: e["updates"] for uid, e in status(port)["experts"].items()} == {
            "expert.0.0": 0, "expert.0.1": 1, "expert.1.0": 0, "expert.1.1": 0}
    finally:
        if server.poll() is None:
            stop(server)
        dht.shutdown()


@pytest.mark.swarm
@pytest.mark.timeout(240)
def test_a_hung_server_is_timed_out_and_the_others_average_renormalized(tmp_path, no_leaked_p2pd):
    """Server 1 is frozen (SIGSTOP: its processes and p2pd keep their sockets open but never
    answer). A DMoE layer over all 4 experts still completes its batch at the forward timeout,
    with the softmax weights renormalized over server 0's experts, and sends backward requests
    only to those."""
    from hivemind.moe.expert_uid import ExpertInfo
    from hivemind.p2p import PeerID

    from hivekeeper.experts.backend import make_backend
    from hivekeeper.experts.dmoe import DMoE, ExpertClient
    from hivekeeper.experts.grid import server_experts
    from hivekeeper.spec import load_manifest

    # announcements outlive the freeze: the frozen server's experts stay in the DHT and get chosen
    manifest = write_pool(tmp_path, {"spec": {"servers": {"replicas": 2, "announcePeriodSeconds": 2,
                                                          "announceExpirationSeconds": 120},
                                              "checkpoint": {"enabled": False}}})
    spec = load_manifest(manifest).spec
    live, frozen = server_experts(spec, 0), server_experts(spec, 1)
    dht, port, server = serve(manifest, tmp_path)
    hung_port = free_port()
    hung = start_server(manifest, tmp_path, hung_port, [str(a) for a in dht.get_visible_maddrs()], index=1)
    try:
        client = ExpertClient(dht)
        hung_peer = PeerID.from_base58(wait_for(lambda: (status(hung_port) or {}).get("peerId"), 120,
                                                "server 1's status"))
        live_experts = [e for e in announced_experts(client, port) if e.uid in live]
        frozen_experts = [ExpertInfo(uid, hung_peer) for uid in frozen]
        local = {uid: make_backend(spec, uid) for uid in live + frozen}
        probe = torch.randn(2, 16)
        assert set(served_outputs(client, live_experts + frozen_experts, probe)) == set(local)

        os.killpg(hung.pid, signal.SIGSTOP)
        layer = DMoE(client, "expert", [2, 2], 16, k_best=4, k_min=1, forward_timeout=3,
                     timeout_after_k_min=60, backward_timeout=10)
        x = torch.randn(5, 16, requires_grad=True)
        out = layer(x)  # returns at the forward timeout, without the frozen server's replies
        assert all({e.uid for e in row} == set(local) for row in layer.last_choices)
        with torch.no_grad():
            scores = [gate(x) for gate in layer.gates]
            logits = torch.stack([sum(s[:, int(c)] for s, c in zip(scores, uid.split(".")[1:])) for uid in live], 1)
            weights = torch.softmax(logits, dim=1)  # over the live experts only
            expected = sum(weights[:, [i]] * local[uid].module(x) for i, uid in enumerate(live))
        torch.testing.assert_close(out, expected)
        assert (client.stats.ok, client.stats.failed) == (len(live), len(frozen))
        out.sum().backward()
        assert x.grad is not None and all(gate.weight.grad is not None for gate in layer.gates)
        assert (client.stats.ok, client.stats.failed) == (2 * len(live), len(frozen))  # no backward to the frozen
        wait_for(lambda: all(status(port)["experts"][uid]["updates"] == 1 for uid in live), 10,
                 "server 0's experts updated")

        os.killpg(hung.pid, signal.SIGCONT)  # thawed, it serves its experts as they were
        with torch.no_grad():
            for uid, output in served_outputs(client, frozen_experts, probe).items():
                torch.testing.assert_close(output, local[uid].module(probe))
    finally:
        for process in (server, hung):
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGCONT)
                stop(process)
        dht.shutdown()
