"""BlockServer (Petals) with real servers on loopback: four block-server processes hold spans
0:2, 2:4, 4:6 and a second 2:4 of a tiny seeded Llama-style model; the client runs in this
process. Generation through the servers equals the whole model's, survives a killed server,
routes around one that answers garbage, refuses bad requests in one clear line, and prompt
tuning/LoRA through the servers lowers a real task's loss without touching server weights."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import sysconfig
import threading
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import yaml

from conftest import EXAMPLES, deep_update, wait_for
from hivemind.p2p import P2PContext, ServicerBase
from hivemind.proto import runtime_pb2
from hivekeeper.blocks import protocol
from hivekeeper.blocks.client import RemoteBlocksError, RemoteCausalLM, RemoteSequence, ServerError, local_generate
from hivekeeper.blocks.finetune import LowRankAdapter, SoftPrompt, lm_loss, train
from hivekeeper.blocks.routing import Hop
from hivekeeper.spec import load_manifest

SPANS = ["0:2", "2:4", "4:6", "2:4"]
HIDDEN, BLOCKS = 64, 6
PROMPT = torch.tensor([list(b"def fibonacci(n):")])

pytestmark = [pytest.mark.swarm]


class Swarm:
    def __init__(self, tmp: Path):
        import hivemind

        document = deep_update(yaml.safe_load((EXAMPLES / "blockserver.yaml").read_text()), {
            "metadata": {"name": "bs-test"},
            "spec": {"servers": {"cacheTokens": 1024, "maxSessionTokens": 256}, "client": {"newTokens": 16}}})
        self.manifest_path = tmp / "manifest.yaml"
        self.manifest_path.write_text(yaml.safe_dump(document))
        self.manifest = load_manifest(self.manifest_path)
        self.run_id = self.manifest.metadata.name
        self.dht = hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"])
        self.peers = [str(a) for a in self.dht.get_visible_maddrs()]
        self.processes = [
            subprocess.Popen([sys.executable, "-m", "hivekeeper", "run", "block-server", "--manifest",
                              str(self.manifest_path), "--index", str(i), "--run-dir", str(tmp), "--blocks", span,
                              "--initial-peers", *self.peers],
                             stdout=open(tmp / f"server-{i}.log", "wb"), stderr=subprocess.STDOUT,
                             start_new_session=True)  # its own group: killpg takes its p2pd too
            for i, span in enumerate(SPANS)]

    def online(self) -> list[protocol.ServerInfo]:
        return [s for s in protocol.read_servers(self.dht, self.run_id) if s.state == protocol.ONLINE]

    def client(self, **kwargs) -> tuple[object, RemoteCausalLM]:
        import hivemind

        dht = hivemind.DHT(initial_peers=self.peers, client_mode=True, start=True)
        sequence = RemoteSequence(dht, kwargs.pop("run_id", self.run_id), BLOCKS, HIDDEN, **kwargs)
        return dht, RemoteCausalLM(self.manifest.spec.model, sequence)

    def kill(self, peer_id: str) -> None:
        index = next(int(s.name.rsplit("-", 1)[1]) for s in self.online() if s.peer_id == peer_id)
        os.killpg(self.processes[index].pid, signal.SIGKILL)  # a crash: no goodbye in the DHT

    def stop(self) -> None:
        for process in self.processes:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGTERM)
        for process in self.processes:
            try:
                process.wait(20)
            except subprocess.TimeoutExpired:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait(5)
        self.dht.shutdown()


@pytest.fixture(scope="module")
def swarm(tmp_path_factory):
    swarm = Swarm(tmp_path_factory.mktemp("blocks"))
    try:
        wait_for(lambda: len(swarm.online()) == len(SPANS), 120, "4 block servers online")
        yield swarm
    finally:
        swarm.stop()


def close(dht, model: RemoteCausalLM) -> None:
    model.sequence.close()
    dht.shutdown()


def _digests(sequence: RemoteSequence, servers) -> dict[str, str]:
    digests = {}
    for s in servers:
        reply = sequence.call("rpc_info", s.peer_id, protocol.make_request(0, 0, [], {"digest": True}))
        digests[s.peer_id] = protocol.read_metadata(reply)["digest"]
    return digests


@pytest.mark.timeout(240)
def test_greedy_and_sampled_generation_through_three_servers_equal_local(swarm, no_leaked_p2pd):
    dht, model = swarm.client()
    try:
        chains = []
        tokens = model.generate(PROMPT, 16, on_token=lambda n, session: chains.append(session.chain))
        assert torch.equal(tokens, local_generate(swarm.manifest.spec.model, PROMPT, 16))
        # ... and Hugging Face's own generate on the whole model agrees
        from hivekeeper.blocks.checkpoint import load_model

        reference = load_model(swarm.manifest.spec.model).generate(PROMPT, max_new_tokens=16, do_sample=False,
                                                                    pad_token_id=0)
        assert torch.equal(tokens, reference)
        chain = chains[-1]
        assert [(h.start, h.end) for h in chain] == [(0, 2), (2, 4), (4, 6)]
        assert len({h.peer_id for h in chain}) == 3
        sampled = model.generate(PROMPT, 12, do_sample=True, temperature=0.8, top_k=20, seed=7)
        assert torch.equal(sampled, local_generate(swarm.manifest.spec.model, PROMPT, 12, do_sample=True,
                                                   temperature=0.8, top_k=20, seed=7))
    finally:
        close(dht, model)


@pytest.mark.timeout(240)
def test_bad_requests_get_one_line_errors_and_nothing_crashes(swarm, no_leaked_p2pd):
    dht, model = swarm.client()
    sequence = model.sequence
    first = next(s for s in swarm.online() if s.start == 0)
    hop = Hop(first.peer_id, 0, 2)
    x = torch.randn(1, 3, HIDDEN)
    try:
        cases = [
            ("forward", Hop(first.peer_id, 0, 2), [torch.randn(1, 3, 32)], {}, "expected shape (batch, length, 64)"),
            ("forward", Hop(first.peer_id, 4, 6), [x], {}, "blocks 4:6 are not served here (this server holds 0:2)"),
            ("forward", Hop(first.peer_id, 0, 99), [x], {}, "are not served here"),
            ("forward", hop, [torch.full((1, 3, HIDDEN), float("nan"))], {}, "contains NaN"),
            ("backward", hop, [x, torch.randn(1, 2, HIDDEN)], {}, "differs from the inputs'"),
            ("forward", hop, [x, x], {}, "expected 1 tensor(s), got 2"),
            ("inference", hop, [x], {}, "metadata needs 'session'"),
            ("inference", hop, [x], {"session": "unknown"}, "unknown here"),
            ("inference", hop, [x], {"session": "short", "max_length": 2}, "exceed its max_length 2"),
            ("inference", hop, [x], {"session": "huge", "max_length": 10**6}, "outside 1..256"),
        ]
        for kind, target, tensors, meta, message in cases:
            with pytest.raises(ServerError, match=rf".*{_re(message)}") as error:
                sequence.call_hop(kind, target, tensors, meta, tuple(x.shape))
            assert "\n" not in str(error.value)
        with pytest.raises(ServerError, match="malformed request: blocks 'nonsense': expected 'start:end'"):
            sequence.call("rpc_forward", first.peer_id, runtime_pb2.ExpertRequest(uid="nonsense"))

        # The cache budget (1024 tokens) holds four sessions of 256; the fifth is refused.
        opened = [f"full-{i}" for i in range(4)]
        for session in opened:
            sequence.call_hop("inference", hop, [x], {"session": session, "max_length": 256}, tuple(x.shape))
        with pytest.raises(ServerError, match="attention cache exhausted: the session needs 256 tokens, 0 of 1024"):
            sequence.call_hop("inference", hop, [x], {"session": "one-more", "max_length": 256}, tuple(x.shape))
        for session in opened:
            sequence.close_session(hop, session)
        # Nothing crashed: the same server still serves, and sessions fit again.
        out = sequence.call_hop("inference", hop, [x], {"session": "after", "max_length": 8}, tuple(x.shape))
        assert out.shape == x.shape
        sequence.close_session(hop, "after")
        assert all(p.poll() is None for p in swarm.processes)
    finally:
        close(dht, model)


def _re(text: str) -> str:
    import re

    return re.escape(text)


class BlockServicer(ServicerBase):
    """A server that answers garbage. It has the real servicer's name: clients call its handlers."""

    async def rpc_info(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return protocol.make_response([], {})

    async def rpc_inference(self, request: runtime_pb2.ExpertRequest,
                            context: P2PContext) -> runtime_pb2.ExpertResponse:
        return protocol.make_response([torch.randn(1, 1, 7)], {})

    async def rpc_close(self, request: runtime_pb2.ExpertRequest, context: P2PContext) -> runtime_pb2.ExpertResponse:
        return protocol.make_response([], {})


@pytest.mark.timeout(240)
def test_a_server_answering_garbage_is_routed_around(swarm, no_leaked_p2pd):
    import hivemind
    from hivemind.moe.client.remote_expert_worker import RemoteExpertWorker

    fake = hivemind.DHT(initial_peers=swarm.peers, start=True)
    p2p = RemoteExpertWorker.run_coroutine(fake.replicate_p2p())
    RemoteExpertWorker.run_coroutine(BlockServicer().add_p2p_handlers(p2p))
    # It claims every block and to be very fast, so routing picks it first.
    for run_id in (swarm.run_id, "garbage-only"):
        protocol.announce(fake, run_id, protocol.ServerInfo(
            peer_id=str(fake.peer_id), name="liar", state=protocol.ONLINE, start=0, end=BLOCKS, throughput=1e9,
            inference_rps=1e9, forward_rps=1e9, network_rps=1e9, cache_tokens_left=10**6))
    dht, model = swarm.client()
    lonely_dht, lonely = swarm.client(run_id="garbage-only", route_wait=1.0)
    try:
        wait_for(lambda: any(s.name == "liar" for s in model.sequence.servers(refresh=True)), 30, "the liar's record")
        # The client has measured the liar as its fastest server: routing takes the one hop through
        # it over the three through the honest servers. (Measured for real, its first round trip
        # through p2pd, a new connection on a loaded host, can lose to the direct path's: the
        # client then never calls it and there is nothing to route around.)
        model.sequence.rtt[str(fake.peer_id)] = 0.0
        tokens = model.generate(PROMPT, 8)
        assert torch.equal(tokens, local_generate(swarm.manifest.spec.model, PROMPT, 8))
        assert model.sequence.failovers >= 1 and str(fake.peer_id) in model.sequence.banned
        with pytest.raises(RemoteBlocksError, match="garbage reply: expected one finite tensor of shape"):
            lonely.generate(PROMPT, 4)
    finally:
        close(dht, model)
        close(lonely_dht, lonely)
        RemoteExpertWorker.run_coroutine(p2p.shutdown())
        fake.shutdown()


def _task(name: str, length: int = 33, batch: int = 8):
    """Next-byte prediction on a file of the Python standard library (real text on every machine)."""
    tokens = torch.tensor(list(Path(sysconfig.get_paths()["stdlib"], name).read_bytes()))

    def batches(count: int, seed: int) -> list[torch.Tensor]:
        generator = torch.Generator().manual_seed(seed)
        starts = torch.randint(0, len(tokens) - length, (count, batch), generator=generator)
        return [torch.stack([tokens[i : i + length] for i in row]) for row in starts]

    return batches


@pytest.mark.timeout(240)
def test_prompt_tuning_and_lora_through_servers_lower_loss_and_leave_weights_unchanged(swarm, no_leaked_p2pd):
    torch.set_num_threads(1)
    dht_a, model_a = swarm.client(seed=1)
    dht_b, model_b = swarm.client(seed=2)
    try:
        servers = [s for s in swarm.online() if s.name.startswith("block-server")]  # not a liar's record
        before = _digests(model_a.sequence, servers)

        # Gradients through the servers equal the whole model's.
        from hivekeeper.blocks.checkpoint import load_model

        full = load_model(swarm.manifest.spec.model)
        batch = _task("textwrap.py")(1, 0)[0][:2]
        prompt = SoftPrompt(4, HIDDEN)
        lm_loss(model_a, batch, prompt).backward()
        remote_grad = prompt.embeddings.grad.clone()
        prompt.embeddings.grad = None
        embeds = torch.cat([prompt().expand(2, -1, -1), full.model.embed_tokens(batch[:, :-1])], dim=1)
        logits = full(inputs_embeds=embeds).logits[:, 4:]
        torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1)).backward()
        torch.testing.assert_close(remote_grad, prompt.embeddings.grad, rtol=1e-4, atol=1e-6)

        # Two clients train different tasks on the same servers at the same time.
        code, docs = _task("textwrap.py"), _task("this.py")
        held_a, held_b = code(1, 999)[0], docs(1, 999)[0]
        prompt_a, adapter_b = SoftPrompt(8, HIDDEN, seed=1), LowRankAdapter(HIDDEN, rank=8, seed=2)
        with torch.no_grad():
            start_a, start_b = lm_loss(model_a, held_a, prompt_a).item(), lm_loss(model_b, held_b, None, adapter_b).item()
        results = {}
        threads = [threading.Thread(target=lambda: results.update(a=train(model_a, code(15, 1), prompt=prompt_a,
                                                                          learning_rate=0.1))),
                   threading.Thread(target=lambda: results.update(b=train(model_b, docs(15, 2), adapter=adapter_b,
                                                                          learning_rate=0.02)))]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join()
        assert len(results["a"]) == len(results["b"]) == 15
        with torch.no_grad():
            end_a, end_b = lm_loss(model_a, held_a, prompt_a).item(), lm_loss(model_b, held_b, None, adapter_b).item()
        assert end_a < start_a - 0.1, (start_a, end_a)
        assert end_b < start_b - 0.1, (start_b, end_b)
        assert _digests(model_a.sequence, servers) == before  # bit-identical server weights
    finally:
        close(dht_a, model_a)
        close(dht_b, model_b)


def _paths(sequence: RemoteSequence) -> set[str]:
    return {entry["via"] for entry in sequence.hop_log}


@pytest.mark.timeout(240)
def test_generation_over_the_direct_path_and_through_p2pd_equal_local(swarm, no_leaked_p2pd):
    servers = [s for s in swarm.online() if s.name.startswith("block-server")]
    assert all(s.direct.startswith("127.0.0.1:") and s.version == protocol.PROTOCOL_VERSION for s in servers)
    expected = local_generate(swarm.manifest.spec.model, PROMPT, 12)
    for direct, path in ((True, "direct"), (False, "p2pd")):
        dht, model = swarm.client(direct=direct)
        try:
            model.sequence.hop_log = []
            assert torch.equal(model.generate(PROMPT, 12), expected)
            assert _paths(model.sequence) == {path}
        finally:
            close(dht, model)


@pytest.mark.timeout(240)
def test_a_direct_port_that_does_not_answer_falls_back_to_p2pd(swarm, no_leaked_p2pd, monkeypatch):
    """Three ways an announced direct address fails: nothing listens there (refused), something
    listens and never answers (the hello times out), another server answers (its peer ID)."""
    import socket

    refusing, silent = socket.socket(), socket.socket()
    refusing.bind(("127.0.0.1", 0))  # bound, not listening: connections are refused
    silent.bind(("127.0.0.1", 0))
    silent.listen()  # the kernel accepts; nobody speaks
    servers = [s for s in swarm.online() if s.name.startswith("block-server")]
    first = next(s for s in servers if s.start == 0)
    wrong = {s.peer_id: {0: f"127.0.0.1:{refusing.getsockname()[1]}", 2: f"127.0.0.1:{silent.getsockname()[1]}",
                         4: first.direct}[s.start] for s in servers}
    read_servers = protocol.read_servers
    monkeypatch.setattr(protocol, "read_servers", lambda dht, run_id: [
        replace(s, direct=wrong.get(s.peer_id, s.direct)) for s in read_servers(dht, run_id)])
    dht, model = swarm.client()
    try:
        model.sequence.hop_log = []
        tokens = model.generate(PROMPT, 8)
        assert torch.equal(tokens, local_generate(swarm.manifest.spec.model, PROMPT, 8))
        assert _paths(model.sequence) == {"p2pd"}
        assert model.sequence.failovers == 0  # a path that does not answer is no failure of its server
        assert not any(model.sequence.direct.reachable(peer, target) for peer, target in wrong.items())
    finally:
        close(dht, model)
        refusing.close()
        silent.close()


def _gated(out, peers: list[str], run_id: str, manifest_path: str) -> None:
    """In a process that admits peers by token: neither a server's direct port nor a client's use of one."""
    import hivemind
    from hivemind.utils.crypto import RSAPrivateKey

    from hivekeeper.blocks.server import open_direct
    from hivekeeper.hivemind_ext.admission import install, installed_gate
    from test_admission import credentials

    install(credentials(RSAPrivateKey()))
    try:
        server, announced = open_direct("QmSelf", lambda kind, data: b"", "127.0.0.1", None, False)
        dht = hivemind.DHT(initial_peers=peers, client_mode=True, start=True)
        try:
            sequence = RemoteSequence(dht, run_id, BLOCKS, HIDDEN)
            model = RemoteCausalLM(load_manifest(manifest_path).spec.model, sequence)
            sequence.hop_log = []
            tokens = model.generate(PROMPT, 6)
            out.put({"server": server is None and announced == "", "client_direct": sequence.direct,
                     "paths": sorted(_paths(sequence)), "tokens": tokens.tolist()})
            sequence.close()
        finally:
            dht.shutdown()
    except Exception as e:  # noqa: BLE001 (reported to the test)
        out.put({"error": f"{type(e).__name__}: {e}"})
    finally:
        import shutil

        shutil.rmtree(installed_gate().admitted.directory, ignore_errors=True)


@pytest.mark.timeout(240)
def test_with_admission_on_the_direct_path_is_never_opened_nor_used(swarm, no_leaked_p2pd):
    import multiprocessing as mp

    ctx = mp.get_context("fork")
    out = ctx.Queue()
    process = ctx.Process(target=_gated, args=(out, swarm.peers, swarm.run_id, str(swarm.manifest_path)))
    process.start()
    try:
        result = out.get(timeout=180)
    finally:
        process.join(20)
        if process.is_alive():
            process.kill()
    assert "error" not in result, result
    assert result["server"] and result["client_direct"] is None and result["paths"] == ["p2pd"]
    assert torch.equal(torch.tensor(result["tokens"]), local_generate(swarm.manifest.spec.model, PROMPT, 6))


@pytest.mark.timeout(240)
def test_killing_a_server_mid_generation_completes_with_the_same_tokens(swarm, no_leaked_p2pd):
    dht, model = swarm.client()
    killed = []

    def kill_middle(count: int, session) -> None:
        if count == 5:
            middle = next(h for h in session.chain if (h.start, h.end) == (2, 4))
            swarm.kill(middle.peer_id)
            killed.append(middle.peer_id)

    try:
        chains = []
        tokens = model.generate(PROMPT, 16, on_token=lambda n, s: (kill_middle(n, s), chains.append(s.chain)))
        assert torch.equal(tokens, local_generate(swarm.manifest.spec.model, PROMPT, 16))
        assert killed and model.sequence.failovers >= 1
        assert killed[0] not in {h.peer_id for h in chains[-1]}
        assert [(h.start, h.end) for h in chains[-1]] == [(0, 2), (2, 4), (4, 6)]
    finally:
        close(dht, model)
