"""BlockServer pieces that need no peers: the manifest, block selection, the balancer's
proposal, routing, the span backend's sessions, and 8-bit weights."""

from __future__ import annotations

import random

import pytest
import torch

from conftest import EXAMPLES
from hivekeeper.blocks.backend import BlockRequestError, SpanBackend
from hivekeeper.blocks.balancer import proposal
from hivekeeper.blocks.checkpoint import load_model, load_span
from hivekeeper.blocks.protocol import JOINING, ONLINE, ServerInfo
from hivekeeper.blocks.quantize import quantize_weights, weight_bytes
from hivekeeper.blocks.routing import NoRouteError, fastest_chain, throughput_chain
from hivekeeper.blocks.selection import choose_start, planned_span, wants_to_move
from hivekeeper.errors import UserError
from hivekeeper.spec import load_manifest, parse_manifest
from hivekeeper.spec.blockserver import ModelSpec, TinyModelSpec


def server(name: str, start: int, end: int, throughput: float = 1.0, state: str = ONLINE,
           rps: float = 100.0) -> ServerInfo:
    return ServerInfo(peer_id=name, name=name, state=state, start=start, end=end, throughput=throughput,
                      inference_rps=rps, forward_rps=throughput, network_rps=1e9, cache_tokens_left=100)


def document(spec: dict) -> dict:
    return {"apiVersion": "hivekeeper.dev/v1alpha1", "kind": "BlockServer", "metadata": {"name": "bs"}, "spec": spec}


def test_example_manifest_is_valid():
    manifest = load_manifest(EXAMPLES / "blockserver.yaml")
    assert manifest.spec.servers.replicas == 3 and manifest.spec.model.tiny.num_layers == 6


@pytest.mark.parametrize("spec, message", [
    ({"model": {"tiny": {"hiddenSize": 30, "numHeads": 4}}}, "spec.model.tiny: Value error, hiddenSize (30)"),
    ({"model": {"checkpoint": "/x", "tiny": {}}}, "set either checkpoint or tiny"),
    ({"servers": {"spanLength": 7}}, "servers.spanLength (7) exceeds the model's 6 blocks"),
    ({"servers": {"cacheTokens": 100, "maxSessionTokens": 200}}, "exceeds servers.cacheTokens"),
    ({"compression": "zip"}, "spec.compression: Input should be 'none', 'float16' or 'blockwise8bit'"),
    ({"servers": {"replicas": "many"}}, "spec.servers.replicas"),
])
def test_bad_manifests_fail_in_one_line(spec, message):
    with pytest.raises(UserError) as error:
        parse_manifest(document(spec))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_simultaneous_joiners_settle_on_disjoint_spans():
    # Three servers announce at once, each choosing in turn from what it sees, as server.choose does.
    servers = {name: server(name, 0, 2, state=JOINING) for name in ("a", "b", "c")}
    for _ in range(3):
        for name in servers:
            start = choose_start(list(servers.values()), 6, 2, name)
            servers[name] = server(name, start, start + 2, state=JOINING)
    assert sorted((s.start, s.end) for s in servers.values()) == [(0, 2), (2, 4), (4, 6)]


def test_an_online_server_moves_to_uncovered_blocks_and_the_balancer_agrees():
    crowded = [server("a", 0, 2), server("b", 0, 2), server("c", 2, 4)]
    assert wants_to_move(crowded, 6, "b", 0.75)
    assert choose_start([s for s in crowded if s.name != "b"], 6, 2, "b") == 4
    plan = proposal(crowded, 6, 0.75)
    assert plan is not None and sorted(plan.values()) == [(0, 2), (2, 4), (4, 6)]
    balanced = [server("a", 0, 2), server("b", 4, 6), server("c", 2, 4)]
    assert not wants_to_move(balanced, 6, "b", 0.75)
    assert proposal(balanced, 6, 0.75) is None  # nothing to gain: no plan, nobody moves


def test_plans_naming_bad_spans_are_ignored():
    assert planned_span({"assignments": {"me": [0, 2]}}, "me", 6) == (0, 2)
    for bad in ([4, 9], [3, 3], "0:2", [0.5, 2]):
        assert planned_span({"assignments": {"me": bad}}, "me", 6) is None
    assert planned_span({"assignments": {"other": [0, 2]}}, "me", 6) is None


def test_fastest_chain_weighs_round_trips_against_compute():
    servers = [server("whole", 0, 6, rps=100.0), server("x", 0, 3, rps=1000.0), server("y", 3, 6, rps=1000.0)]
    # Far away fast servers lose to one near server; near fast servers win.
    slow_links = {"whole": 0.001, "x": 0.1, "y": 0.1}
    assert [h.peer_id for h in fastest_chain(servers, 0, 6, slow_links)] == ["whole"]
    fast_links = {"whole": 0.001, "x": 0.001, "y": 0.001}
    assert [(h.peer_id, h.start, h.end) for h in fastest_chain(servers, 0, 6, fast_links)] == [("x", 0, 3), ("y", 3, 6)]
    # A sub-range of a span can be used; banned and offline servers are not.
    assert [(h.start, h.end) for h in fastest_chain(servers, 1, 5, fast_links, banned={"whole"})] == [(1, 3), (3, 5)]
    with pytest.raises(NoRouteError, match="no online server holds block 3"):
        fastest_chain(servers, 0, 6, fast_links, banned={"whole", "y"})


def test_throughput_chains_spread_parts_in_proportion_to_throughput():
    servers = [server("fast", 0, 6, throughput=3.0), server("slow", 0, 6, throughput=1.0)]
    rng = random.Random(0)
    picks = [throughput_chain(servers, 0, 6, rng)[0].peer_id for _ in range(400)]
    assert 0.65 < picks.count("fast") / len(picks) < 0.85


@pytest.fixture(scope="module")
def tiny():
    return ModelSpec(tiny=TinyModelSpec(num_layers=2, hidden_size=32, num_heads=2))


def test_sessions_reserve_cache_and_refuse_in_one_line(tiny):
    backend = SpanBackend(load_span(tiny, 0, 2), cache_tokens=64, max_session_tokens=32, session_timeout=60)
    x = torch.randn(1, 4, 32)
    backend.inference_step("a", x, 0, 2, max_length=32)
    backend.inference_step("b", x, 0, 2, max_length=32)
    assert backend.cache_tokens_left == 0
    with pytest.raises(BlockRequestError, match="attention cache exhausted: the session needs 8 tokens, 0 of 64"):
        backend.inference_step("c", x, 0, 2, max_length=8)
    with pytest.raises(BlockRequestError, match="opened for blocks 0:2, batch 1; got blocks 1:2"):
        backend.inference_step("a", x, 1, 2, max_length=None)
    backend.close_session("a")
    backend.inference_step("c", x, 0, 2, max_length=8)
    backend.session_timeout = 0.0
    backend.expire_sessions()
    assert backend.cache_tokens_left == 64


def test_int8_weights_quarter_memory_and_stay_close(tiny):
    for architecture in ("llama", "gpt2"):
        spec = ModelSpec(tiny=TinyModelSpec(architecture=architecture, num_layers=2, hidden_size=32, num_heads=2))
        exact = SpanBackend(load_span(spec, 0, 2), 64, 32, 60)
        weights = load_span(spec, 0, 2)
        before = weight_bytes(weights.blocks)
        assert quantize_weights(weights.blocks) > 0
        assert weight_bytes(weights.blocks) < 0.4 * before
        quantized = SpanBackend(weights, 64, 32, 60)
        x = torch.randn(2, 5, 32)
        a, b = exact.forward(x, 0, 2), quantized.forward(x, 0, 2)
        assert (a - b).abs().max() < 0.05 * a.abs().max()
    assert load_model(tiny).config.num_hidden_layers == 2


def test_wire_codecs_round_trip_and_refuse_mismatched_parts():
    from hivekeeper.blocks import protocol

    x = torch.randn(2, 7, 64)
    sizes = {}
    for compression, tolerance in (("none", 0.0), ("float16", 1e-3), ("blockwise8bit", 0.02)):
        request = protocol.make_request(0, 2, [x], {"session": "s"}, compression)
        (y,) = protocol.read_tensors(request)
        assert y.shape == x.shape and (x - y).abs().max() <= tolerance * x.abs().max()
        assert protocol.read_metadata(request)["session"] == "s"
        sizes[compression] = len(request.SerializeToString())
    assert sizes["blockwise8bit"] < 0.6 * sizes["float16"] < 0.6 * sizes["none"]
    request = protocol.make_request(0, 2, [x], {}, "blockwise8bit")
    del request.tensors[1]
    with pytest.raises(ValueError, match="blockwise8bit: expected codes and scales"):
        protocol.read_tensors(request)


def test_a_saved_checkpoint_folder_serves_the_same_blocks(tiny, tmp_path):
    from hivekeeper.blocks.checkpoint import num_blocks

    load_model(tiny).save_pretrained(tmp_path / "hf")
    folder = ModelSpec(checkpoint=str(tmp_path / "hf"))
    assert num_blocks(folder) == 2
    x = torch.randn(1, 4, 32)
    exact = SpanBackend(load_span(tiny, 1, 2), 64, 32, 60).forward(x, 1, 2)
    # (the folder's config asks for SDPA attention; the tiny config for eager: equal to rounding)
    torch.testing.assert_close(SpanBackend(load_span(folder, 1, 2), 64, 32, 60).forward(x, 1, 2), exact)
    with pytest.raises(FileNotFoundError, match="is not a Hugging Face folder"):
        num_blocks(ModelSpec(checkpoint=str(tmp_path)))


def _random_llama_folder(tmp_path):
    import transformers

    from hivekeeper.blocks.checkpoint import write_random_checkpoint

    config = transformers.LlamaConfig(hidden_size=64, intermediate_size=160, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, vocab_size=300,
                                      max_position_embeddings=256, tie_word_embeddings=False)
    return ModelSpec(checkpoint=str(write_random_checkpoint(tmp_path / "random", config, seed=3)))


def test_random_weights_folder_builds_the_same_parts_without_the_whole(tmp_path):
    """A server's span and a client's embeddings and head, each built alone, equal the same
    parts of the whole model: every parameter is a hash of (seed, name, index)."""
    from hivekeeper.blocks.checkpoint import hashed_uniform_, load_client_model

    spec = _random_llama_folder(tmp_path)
    whole = load_model(spec).state_dict()
    span = load_span(spec, 1, 3)
    for name, tensor in span.blocks.state_dict().items():
        index, rest = name.split(".", 1)
        assert torch.equal(tensor, whole[f"model.layers.{int(index) + 1}.{rest}"]), name
    client = load_client_model(spec)
    assert sorted(client.state_dict()) == ["lm_head.weight", "model.embed_tokens.weight", "model.norm.weight"]
    for name, tensor in client.state_dict().items():
        assert torch.equal(tensor, whole[name]), name
    weight = whole["model.layers.0.mlp.up_proj.weight"]
    assert abs(weight.std().item() - 0.02) < 0.001 and abs(weight.mean().item()) < 0.001
    assert torch.equal(whole["model.norm.weight"], torch.ones(64))
    # the same bits in another dtype's rounding, and for a chunked fill
    a, b = torch.empty(5, 7), torch.empty(35)
    assert torch.equal(hashed_uniform_(a, 1, "w", 0.02).view(-1), hashed_uniform_(b, 1, "w", 0.02))
    assert not torch.equal(hashed_uniform_(torch.empty(35), 1, "v", 0.02), b)
    assert torch.equal(load_span(spec, 1, 3, dtype=torch.bfloat16).blocks[0].mlp.up_proj.weight,
                       whole["model.layers.1.mlp.up_proj.weight"].to(torch.bfloat16))


def test_static_cache_decodes_as_the_dynamic_cache(tmp_path):
    """fast.py's static cache (the GPU path, here run eagerly on the CPU in float32) gives what
    transformers' blocks with a DynamicCache give: prefill, one-token steps, several tokens at
    once, a session over part of the span; and the same cache accounting and refusals."""
    spec = _random_llama_folder(tmp_path)
    dynamic = SpanBackend(load_span(spec, 0, 4), 100, 20, 60)
    static = SpanBackend(load_span(spec, 0, 4), 100, 20, 60, static_cache=True)
    assert dynamic.runner is None and static.runner is not None and static.runner.fused is not None
    x = torch.randn(2, 5, 64)
    steps = [("s", x, 0, 4, 20)] + [("s", torch.randn(2, 1, 64), 0, 4, None) for _ in range(4)]
    steps += [("s", torch.randn(2, 3, 64), 0, 4, None), ("t", x[:1], 1, 3, 10), ("t", x[:1, :1], 1, 3, None)]
    for args in steps:
        torch.testing.assert_close(static.inference_step(*args), dynamic.inference_step(*args), atol=1e-5, rtol=1e-5)
    assert static.cache_tokens_left == dynamic.cache_tokens_left == 100 - 2 * 20 - 10
    with pytest.raises(BlockRequestError, match="session s: 12 \\+ 9 tokens exceed its max_length 20"):
        static.inference_step("s", torch.randn(2, 9, 64), 0, 4, None)
    # greedy decoding through the static cache equals the whole model's
    from hivekeeper.blocks.checkpoint import load_client_model
    from hivekeeper.blocks.client import local_generate

    client = load_client_model(spec)
    prompt = torch.tensor([[5, 17, 42, 7]])
    tokens, hidden = prompt, client.model.embed_tokens(prompt)
    for i in range(8):
        out = static.inference_step("g", hidden, 0, 4, 12 if i == 0 else None)
        token = client.lm_head(client.model.norm(out[:, -1:]))[:, -1].argmax(-1)
        tokens = torch.cat([tokens, token[:, None]], dim=1)
        hidden = client.model.embed_tokens(token[:, None])
    assert torch.equal(tokens, local_generate(load_model(spec), prompt, 8))


def test_static_cache_runs_blocks_it_cannot_fuse(tmp_path):
    """8-bit weights are no nn.Linear to fuse: the static cache runs the blocks' own modules."""
    spec = _random_llama_folder(tmp_path)
    spans = [load_span(spec, 0, 4) for _ in range(2)]
    for span in spans:
        quantize_weights(span.blocks)
    dynamic, static = SpanBackend(spans[0], 100, 20, 60), SpanBackend(spans[1], 100, 20, 60, static_cache=True)
    assert static.runner.fused is None
    for args in [("s", torch.randn(1, 4, 64), 0, 4, 20), ("s", torch.randn(1, 1, 64), 0, 4, None)]:
        torch.testing.assert_close(static.inference_step(*args), dynamic.inference_step(*args), atol=1e-5, rtol=1e-5)


def test_the_direct_address_is_an_optional_field_of_protocol_1_1():
    info = server("a", 0, 2)
    assert info.version == "hivekeeper-blocks/1.1" and info.direct == ""
    older = {k: v for k, v in info.to_record().items() if k != "direct"} | {"version": "hivekeeper-blocks/1"}
    assert ServerInfo.from_record(older).direct == ""  # a 1.0 server: p2pd only
    record = info.to_record() | {"direct": "10.0.0.7:41234"}
    assert ServerInfo.from_record(record).direct == "10.0.0.7:41234"


def test_the_direct_client_checks_who_answers_and_leaves_bad_addresses_alone():
    """Sockets alone (no peers): the hello names the server's peer ID; a wrong peer, a refused port
    and a silent one mean "use p2pd" (None), noted for a while; a failure after hello is the server's."""
    import socket

    from hivekeeper.blocks.direct import DirectCallError, DirectClient, DirectServer

    served = DirectServer("QmServer", lambda kind, data: kind.encode() + b" " + data, "127.0.0.1")
    client = DirectClient(connect_timeout=0.5)
    target = f"127.0.0.1:{served.port}"
    refusing, silent = socket.socket(), socket.socket()
    refusing.bind(("127.0.0.1", 0))
    silent.bind(("127.0.0.1", 0))
    silent.listen()
    try:
        assert client.call("QmServer", target, "inference", b"step", 5.0) == b"inference step"
        assert client.call("QmSomeoneElse", target, "inference", b"step", 5.0) is None
        for address in (refusing, silent):
            bad = f"127.0.0.1:{address.getsockname()[1]}"
            assert client.call("QmServer2", bad, "forward", b"x", 5.0) is None
            assert not client.reachable("QmServer2", bad)
        assert client.reachable("QmServer", target) and not client.reachable("QmSomeoneElse", target)
        served.stop()
        with pytest.raises(DirectCallError, match="connection closed|Connection"):
            client.call("QmServer", target, "inference", b"step", 5.0)
    finally:
        client.close()
        served.stop()
        refusing.close()
        silent.close()
