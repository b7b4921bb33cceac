"""ExpertPool without peers: the spec and its one-line errors, the grid and its assignment over
servers, the batched beam search against brute force, and the DMoE layer's renormalization over
the experts that answer (with in-process experts)."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from concurrent.futures import Future
from functools import partial

import numpy as np
import pytest
import torch

from conftest import EXAMPLES, deep_update, write_manifest
from hivekeeper.errors import UserError
from hivekeeper.experts.beam import batch_beam_search, beam_search, clear_decoded, fetch_from_dht, successors
from hivekeeper.experts.dmoe import DMoE, ExpertsUnavailable
from hivekeeper.experts.grid import assign_experts, grid_uids, pool_assignment, server_experts, uid_coordinates
from hivekeeper.spec import load_manifest, parse_manifest
from hivekeeper.spec.expertpool import ExpertPoolSpec
from hivemind.moe.expert_uid import ExpertInfo
from hivemind.p2p import PeerID

import yaml

EXAMPLE = yaml.safe_load((EXAMPLES / "expertpool.yaml").read_text())


def test_example_is_valid_and_spreads_every_prefix_over_both_servers():
    spec = load_manifest(EXAMPLES / "expertpool.yaml").spec
    assert isinstance(spec, ExpertPoolSpec)
    assignment = pool_assignment(spec)
    assert [len(a) for a in assignment] == [8, 8]
    assert sorted(sum(assignment, [])) == sorted(grid_uids("expert", [4, 4]))
    for uids in assignment:  # losing either server leaves every first-dimension prefix alive
        assert {uid.split(".")[1] for uid in uids} == {"0", "1", "2", "3"}


def test_grid_uids_assignment_and_coordinates():
    assert grid_uids("ffn", [2, 3]) == ["ffn.0.0", "ffn.0.1", "ffn.0.2", "ffn.1.0", "ffn.1.1", "ffn.1.2"]
    assert assign_experts(grid_uids("e", [5]), 2) == [["e.0", "e.2", "e.4"], ["e.1", "e.3"]]
    assert assign_experts(grid_uids("e", [8]), 3, experts_per_server=2) == [["e.0", "e.3"], ["e.1", "e.4"], ["e.2", "e.5"]]
    assert uid_coordinates("e.1.2", "e", [2, 3]) == (1, 2)
    assert uid_coordinates("e.2.0", "e", [2, 3]) is None and uid_coordinates("x.0.0", "e", [2, 3]) is None
    spec = ExpertPoolSpec.model_validate({"grid": {"dimensions": [8, 8]}, "servers": {"replicas": 3, "expertsPerServer": 4}})
    assert spec.hosted_experts == 12 and server_experts(spec, 2) == ["expert.0.2", "expert.0.5", "expert.1.0", "expert.1.3"]
    with pytest.raises(ValueError, match="outside servers.replicas"):
        server_experts(spec, 3)


BAD = {
    "kMin above kBest": ({"trainers": {"dmoe": {"kBest": 2, "kMin": 3}}}, "kMin (3) exceeds kBest (2)"),
    "kBest above the experts": ({"trainers": {"dmoe": {"kBest": 20}}}, "kBest (20) exceeds the experts"),
    "dot in the prefix": ({"grid": {"uidPrefix": "my.experts"}}, "spec.grid.uidPrefix"),
    "empty grid dimension": ({"grid": {"dimensions": [4, 0]}}, "spec.grid.dimensions.1"),
    "tokens that do not divide 64": ({"expert": {"type": "transformer", "sequenceLength": 5}}, "sequenceLength (5)"),
    "heads that do not divide": ({"expert": {"type": "transformer", "numHeads": 5}}, "divisible by numHeads"),
    "not the digits": ({"task": {"name": "causal-lm"}}, "ExpertPool trainers learn the digits task"),
    "bad task option": ({"task": {"options": {"testFraction": 2}}}, "task.options.testFraction"),
    "expiry within the period": ({"servers": {"announceExpirationSeconds": 1}}, "announceExpirationSeconds"),
    "unknown field": ({"servers": {"gpus": 1}}, "spec.servers.gpus: unknown field"),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_specs_get_one_line_naming_the_field(case):
    changes, expected = BAD[case]
    with pytest.raises(UserError) as error:
        parse_manifest(deep_update(EXAMPLE, {"spec": changes}))
    message = str(error.value)
    assert expected in message and "\n" not in message, message


def test_validate_command_rejects_a_bad_pool_with_exit_2(tmp_path):
    path = write_manifest(tmp_path, {"spec": {"trainers": {"dmoe": {"kMin": 9}}}}, base="expertpool.yaml")
    result = subprocess.run([sys.executable, "-m", "hivekeeper", "validate", str(path)], capture_output=True, text=True)
    assert result.returncode == 2 and len(result.stderr.strip().splitlines()) == 1, result.stderr


# ---------------------------------------------------------------------------------------------
# Beam search over DHT prefixes, with the DHT replaced by the records servers would announce


def announced(uids: list[str]):
    """hivemind's declare_experts records: every prefix -> {next coordinate: an expert under it}."""
    table: dict[str, dict[int, ExpertInfo]] = {}
    for uid in uids:
        parts = uid.split(".")
        if len(parts) == 2:  # a one-dimensional grid: hivemind's FLAT_EXPERT subkey
            table.setdefault(uid + ".", {})[-1] = ExpertInfo(uid, None)
        for depth in range(1, len(parts) - 1):
            prefix = ".".join(parts[:depth + 1]) + "."
            table.setdefault(prefix, {}).setdefault(int(parts[depth + 1]), ExpertInfo(uid, None))
    requests = []

    async def fetch(prefixes: list[str]):
        requests.append(len(prefixes))
        return {p: dict(table.get(p, {})) for p in prefixes}

    return fetch, requests


def brute_force(uids: list[str], scores: list[list[float]], k: int) -> list[str]:
    def score(uid: str) -> float:
        return sum(scores[d][int(c)] for d, c in enumerate(uid.split(".")[1:]))
    return sorted(uids, key=score, reverse=True)[:k]


@pytest.mark.parametrize("dims", [[6], [4, 5], [3, 4, 5]])
def test_beam_search_finds_the_exact_top_k_of_a_full_grid_with_few_requests(dims):
    rng = random.Random(0)
    uids = grid_uids("e", dims)
    fetch, requests = announced(uids)
    batch = [[[rng.gauss(0, 1) for _ in range(m)] for m in dims] for _ in range(16)]
    found = asyncio.run(batch_beam_search("e", batch, 3, fetch))
    assert [[e.uid for e in row] for row in found] == [brute_force(uids, scores, 3) for scores in batch]
    assert len(requests) == max(1, len(dims) - 1)  # one DHT request per prefix depth for the whole batch


def test_beam_search_returns_only_announced_experts():
    rng = random.Random(1)
    uids = [u for u in grid_uids("e", [4, 4]) if rng.random() < 0.5]
    fetch, _ = announced(uids)
    batch = [[[rng.gauss(0, 1) for _ in range(4)] for _ in range(2)] for _ in range(8)]
    for row in asyncio.run(batch_beam_search("e", batch, 4, fetch)):
        assert row and {e.uid for e in row} <= set(uids) and len({e.uid for e in row}) == len(row) <= 4


def reference_beam_search(uid_prefix, grid_scores, k, level_of):
    """The sequential search over Python tuples this module ran before it scored a step with numpy
    (kept verbatim as the reference order, ties included). `level_of(prefixes)` is a plain fetch."""
    import heapq

    dims, root, first = len(grid_scores[0]), uid_prefix + ".", len(grid_scores[0][0])
    level = level_of([f"{root}{c}." for c in range(first)])
    beams = []
    for scores in grid_scores:
        live = ((scores[0][c], f"{root}{c}.") for c in range(first))
        beams.append(heapq.nlargest(k, ((s, p) for s, p in live if level.get(p))))
    for dim in range(1, dims):
        candidates = []
        for scores, beam in zip(grid_scores, beams):
            extended = [(score + scores[dim][coord], f"{prefix}{coord}", expert)
                        for score, prefix in beam for coord, expert in level.get(prefix, {}).items()
                        if 0 <= coord < len(scores[dim])]
            candidates.append(heapq.nlargest(k, extended, key=lambda c: c[0]))
        if dim == dims - 1:
            return [[expert for _, name, expert in best if expert.uid == name] for best in candidates]
        wanted = sorted({name + "." for best in candidates for _, name, _ in best})
        level = level_of(wanted)
        beams = [[(s, name + ".") for s, name, _ in best if level.get(name + ".")] for best in candidates]
    return [[next(iter(level[prefix].values())) for _, prefix in beam] for beam in beams]


@pytest.mark.parametrize("seed", range(8))
def test_beam_search_keeps_the_sequential_order_on_sparse_grids_and_ties(seed):
    """Beyond full grids (where it equals brute force): the same choices, in the same order, as the
    sequential search, with experts missing, subkeys listed in any order and many equal scores
    (first-dimension ties go to the greater prefix string: e.9. before e.11.)."""
    rng = random.Random(seed)
    dims = [[5], [6, 7], [4, 3, 5], [12, 3]][seed % 4]
    uids = [u for u in grid_uids("e", dims) if rng.random() < 0.6]
    table: dict[str, dict[int, ExpertInfo]] = {}
    for uid in rng.sample(uids, len(uids)):  # subkeys in any order
        parts = uid.split(".")
        if len(parts) == 2:
            table.setdefault(uid + ".", {})[-1] = ExpertInfo(uid, None)
        for depth in range(1, len(parts) - 1):
            table.setdefault(".".join(parts[:depth + 1]) + ".", {})[int(parts[depth + 1])] = ExpertInfo(uid, None)
    table["e.0."] = {**table.get("e.0.", {}), 99: ExpertInfo("e.0.99", None)}  # outside the grid: never chosen

    async def fetch(prefixes):
        return {p: dict(table.get(p, {})) for p in prefixes}

    for round_scores in (True, False):  # small integers: ties everywhere; gaussians: none
        batch = [[[float(rng.randint(-2, 2)) if round_scores else rng.gauss(0, 1) for _ in range(m)] for m in dims]
                 for _ in range(24)]
        for k in (1, 3, 8):
            found = asyncio.run(batch_beam_search("e", batch, k, fetch))
            expected = reference_beam_search("e", batch, k, lambda ps: {p: dict(table.get(p, {})) for p in ps})
            assert [[e.uid for e in row] for row in found] == [[e.uid for e in row] for row in expected]


# The DHT node's side: records as hivemind's declare_experts stores them, read from the node's
# storage and cache (hivemind's own structures) or, when not there, through the DHT (a stub).

class StubNode:
    """A DHTNode's storage, cache and get_many; the 'network' holds every announced record and
    get_many caches what it finds, as hivemind does."""

    def __init__(self, network):
        from hivemind.dht.storage import DHTLocalStorage
        from hivemind.dht.validation import CompositeValidator

        self.network = network
        self.protocol = type("Protocol", (), {})()
        self.protocol.storage, self.protocol.cache = DHTLocalStorage(), DHTLocalStorage()
        self.protocol.record_validator = CompositeValidator([])
        self.cache_refresh_before_expiry = 0
        self.looked_up: list[list[str]] = []

    async def get_many(self, keys, num_workers=None):
        from hivemind.dht.routing import DHTID
        from hivemind.utils import MSGPackSerializer, ValueWithExpiration

        self.looked_up.append(list(keys))
        await asyncio.sleep(0)
        found = {}
        for key in keys:
            entry = self.network.get(DHTID.generate(key))
            if entry is None:
                found[key] = None
                continue
            self.protocol.cache.store(DHTID.generate(key), entry.value, entry.expiration_time)
            found[key] = ValueWithExpiration({subkey: ValueWithExpiration(MSGPackSerializer.loads(v), exp)
                                              for subkey, (v, exp) in entry.value.items()}, entry.expiration_time)
        return found


def announce(network, uids, peer: str, expiration: float) -> None:
    """What hivemind's declare_experts stores for these uids (the prefix records)."""
    from hivemind.dht.routing import DHTID
    from hivemind.utils import MSGPackSerializer

    for uid in uids:
        parts = uid.split(".")
        if len(parts) == 2:
            parts = [*parts, "-1"]  # FLAT_EXPERT
        for depth in range(1, len(parts) - 1):
            prefix = ".".join(parts[:depth + 1]) + "."
            network.store_subkey(DHTID.generate(prefix), int(parts[depth + 1]), MSGPackSerializer.dumps((uid, peer)),
                                 expiration)


PEER_IDS = [PeerID(bytes([0, 36, i]) + bytes(35)).to_base58() for i in range(3)]


@pytest.mark.parametrize("dims", [[32, 32], [8, 8, 8], [6]])
def test_dht_beam_search_picks_the_exhaustive_top_k_cold_and_warm(dims):
    """The trainer's path (scores by dimension, prefixes read from the DHT node): exactly the
    experts brute force over the whole grid picks, in its order, whether the prefixes come
    through the DHT (cold) or from the node's cache (warm: no DHT request)."""
    from hivemind.dht.storage import DHTLocalStorage
    from hivemind.utils import get_dht_time

    clear_decoded()
    uids = grid_uids("g", dims)
    network = DHTLocalStorage()
    for i, peer in enumerate(PEER_IDS):
        announce(network, uids[i::len(PEER_IDS)], peer, get_dht_time() + 600)
    node = StubNode(network)
    rng = np.random.default_rng(0)
    for search in ("cold", "warm"):
        scores = [rng.standard_normal((64, m)).astype(np.float32) for m in dims]
        found = asyncio.run(beam_search("g", scores, 4, partial(fetch_from_dht, node)))
        for row, example in zip(found, range(64)):
            expected = brute_force(uids, [[float(v) for v in s[example]] for s in scores], 4)
            assert [e.uid for e in row] == expected
            assert all(e.peer_id.to_base58() == PEER_IDS[uids.index(e.uid) % len(PEER_IDS)] for e in row)
        if search == "cold":
            assert node.looked_up and all(keys for keys in node.looked_up)
            known = {key for keys in node.looked_up for key in keys}
            node.looked_up.clear()
        else:  # the prefixes known from the cold search come from the node's cache, never the DHT again
            assert not {key for keys in node.looked_up for key in keys} & known
            assert len(dims) > 2 or node.looked_up == []


def test_dht_beam_search_never_chooses_expired_records(monkeypatch):
    """Experts whose records expire vanish from the search, read from the cache or the node's own
    storage; a server that announces again is found again."""
    import hivemind.utils.timed_storage as timed_storage
    from hivemind.dht.routing import DHTID
    from hivemind.dht.storage import DHTLocalStorage
    from hivemind.utils import MSGPackSerializer, ValueWithExpiration

    import hivekeeper.experts.beam as beam

    now = [1_000_000.0]
    monkeypatch.setattr(timed_storage, "get_dht_time", lambda: now[0])
    monkeypatch.setattr(beam, "get_dht_time", lambda: now[0])
    clear_decoded()
    dims, k = [6, 6], 4
    uids = grid_uids("g", dims)
    rows_lost = {u for u in uids if u.split(".")[1] in ("1", "4")}  # whole prefixes whose server left
    scattered = set(random.Random(2).sample(sorted(set(uids) - rows_lost), 8))  # single experts that left
    network = DHTLocalStorage()
    announce(network, sorted(set(uids) - rows_lost - scattered), PEER_IDS[0], now[0] + 100)
    announce(network, sorted(rows_lost | scattered), PEER_IDS[1], now[0] + 10)
    node = StubNode(network)
    node.protocol.storage = network  # the node itself stores these prefixes: read before its cache
    rng = random.Random(3)
    batch = [[[rng.gauss(0, 1) for _ in range(m)] for m in dims] for _ in range(32)]
    fetch = partial(fetch_from_dht, node)
    before = asyncio.run(batch_beam_search("g", batch, k, fetch))
    assert [[e.uid for e in row] for row in before] == [brute_force(uids, s, k) for s in batch]

    now[0] += 50  # the second server's records expired
    after = asyncio.run(batch_beam_search("g", batch, k, fetch))
    live = sorted(set(uids) - rows_lost - scattered)
    for row, scores in zip(after, batch):
        assert row and not {e.uid for e in row} & (rows_lost | scattered)
        assert {e.uid for e in row} <= set(live) and len({e.uid for e in row}) == len(row) <= k

    def level_of(prefixes):  # what the sequential search read: hivemind's get (storage first), then the parser
        found = {}
        for prefix in prefixes:
            entry = node.protocol.storage.get(DHTID.generate(prefix))
            found[prefix] = successors(entry and ValueWithExpiration(
                {c: ValueWithExpiration(MSGPackSerializer.loads(v), e) for c, (v, e) in entry.value.items()},
                entry.expiration_time))
        return found

    assert [[e.uid for e in row] for row in after] == [[e.uid for e in row] for row in
                                                       reference_beam_search("g", batch, k, level_of)]
    # without the lost rows the rest is a full grid again: exact against brute force over the live experts
    full = sorted(set(uids) - rows_lost)
    announce(network, sorted(scattered), PEER_IDS[2], now[0] + 100)
    again = asyncio.run(batch_beam_search("g", batch, k, fetch))
    assert [[e.uid for e in row] for row in again] == [brute_force(full, s, k) for s in batch]
    assert {e.peer_id.to_base58() for row in again for e in row if e.uid in scattered} <= {PEER_IDS[2]}


# ---------------------------------------------------------------------------------------------
# The layer: weighted average over the experts that answer


class LocalExperts:
    """An ExpertClient stand-in: experts are local modules; `down` experts fail their requests."""

    def __init__(self, dims: list[int], hidden: int, down: set[str] = frozenset()):
        torch.manual_seed(0)
        self.uids = grid_uids("e", dims)
        self.experts = {uid: torch.nn.Linear(hidden, hidden) for uid in self.uids}
        self.down = set(down)
        self.dims = dims

    def find_best_experts(self, prefix, scores, k):
        batch = [[[float(v) for v in dim[i]] for dim in scores] for i in range(len(scores[0]))]
        return [[ExpertInfo(uid, None) for uid in brute_force(self.uids, s, k)] for s in batch]

    def call(self, expert, tensors, backward=False):
        future: Future = Future()
        if expert.uid in self.down:
            future.set_exception(ConnectionError(f"{expert.uid} is down"))
        elif backward:
            x, grad = tensors
            x = x.clone().requires_grad_(True)
            with torch.enable_grad():
                self.experts[expert.uid](x).backward(grad)
            future.set_result([x.grad])
        else:
            with torch.no_grad():
                future.set_result([self.experts[expert.uid](tensors[0])])
        return future

    def call_many(self, requests, backward=False):
        return [self.call(expert, tensors, backward) for expert, tensors in requests]

    stats = type("Stats", (), {"ok": 0, "failed": 0})()


def expected_output(client: LocalExperts, layer: DMoE, x: torch.Tensor, k: int) -> torch.Tensor:
    scores = [gate(x) for gate in layer.gates]
    rows = []
    for i in range(len(x)):
        chosen = brute_force(client.uids, [s[i].tolist() for s in scores], k)
        alive = [uid for uid in chosen if uid not in client.down]
        logits = torch.stack([sum(scores[d][i, int(c)] for d, c in enumerate(uid.split(".")[1:])) for uid in alive])
        weights = torch.softmax(logits, 0)
        rows.append(sum(w * client.experts[uid](x[i:i + 1])[0] for w, uid in zip(weights, alive)))
    return torch.stack(rows)


def test_dmoe_averages_the_answering_experts_and_renormalizes_without_the_failed_ones():
    x = torch.randn(12, 8, requires_grad=True)
    for down in (set(), {"e.0.0", "e.1.1", "e.2.3"}):
        client = LocalExperts([3, 4], 8, down)
        layer = DMoE(client, "e", [3, 4], 8, k_best=3, k_min=1)
        out = layer(x)
        torch.testing.assert_close(out, expected_output(client, layer, x, 3), rtol=1e-5, atol=1e-5)
        out.sum().backward()  # gradients flow to the input through the answering experts, and to the gates
        assert x.grad is not None and all(g.weight.grad is not None for g in layer.gates)
        x.grad = None


def test_dmoe_refuses_a_batch_whose_examples_reach_fewer_than_k_min_experts():
    client = LocalExperts([2, 2], 4, down={"e.0.0", "e.0.1", "e.1.0"})
    with pytest.raises(ExpertsUnavailable, match="fewer than kMin=2"):
        DMoE(client, "e", [2, 2], 4, k_best=4, k_min=2)(torch.randn(5, 4))
    assert DMoE(client, "e", [2, 2], 4, k_best=4, k_min=1)(torch.randn(5, 4)).shape == (5, 4)


def test_transformer_experts_take_tokens_and_the_classifier_trains_through_them():
    from hivekeeper.experts.layers import build_expert, example_shape
    from hivekeeper.experts.model import DMoEClassifier

    spec = ExpertPoolSpec.model_validate({"grid": {"dimensions": [2, 2]}, "expert": {
        "type": "transformer", "hiddenSize": 16, "numHeads": 2, "sequenceLength": 8}, "trainers": {"dmoe": {"kBest": 2}}})
    assert example_shape(spec.expert) == (8, 16)
    block = build_expert(spec.expert, "expert.0.1")
    assert block(torch.randn(3, 8, 16)).shape == (3, 8, 16)
    torch.testing.assert_close(build_expert(spec.expert, "expert.0.1").state_dict(), block.state_dict())

    client = LocalExperts([2, 2], 16)
    client.uids = grid_uids("expert", [2, 2])
    client.experts = {uid: build_expert(spec.expert, uid) for uid in client.uids}
    model = DMoEClassifier(spec, client)
    logits = model(torch.rand(5, 64))
    assert logits.shape == (5, 10)
    logits.sum().backward()
    assert model.embed.weight.grad is not None and model.position.grad is not None


class StubDHT:
    """What ExpertClient asks of hivemind's DHT: run a callable in the DHT process (here, at once
    against a StubNode)."""

    def __init__(self, node):
        self.node, self.ran = node, []

    async def replicate_p2p(self):
        return None

    def run_coroutine(self, fn, return_future=False):
        self.ran.append(fn)
        future = Future()
        future.set_result(asyncio.run(fn(self, self.node)))
        return future if return_future else future.result()


def test_a_trainer_searches_in_its_own_process_over_prefixes_read_recently():
    """With search_cache_seconds the client runs the beam search itself, over prefix entries it
    read from the DHT process at most that long ago: the same experts as the search in the DHT
    process, one DHT request per level for the first search, none for the next ones until the
    entries are that old; then experts announced meanwhile are found."""
    import time

    from hivemind.dht.storage import DHTLocalStorage
    from hivemind.utils import get_dht_time

    from hivekeeper.experts.dmoe import ExpertClient

    clear_decoded()
    dims = [3, 4, 2]
    uids = grid_uids("g", dims)
    network = DHTLocalStorage()
    announce(network, uids[:-6], PEER_IDS[0], get_dht_time() + 600)
    dht = StubDHT(StubNode(network))
    local, remote = ExpertClient(dht, search_cache_seconds=0.5), ExpertClient(dht)
    gen = torch.Generator().manual_seed(0)
    for search in range(3):
        scores = [torch.randn(16, m, generator=gen) for m in dims]
        dht.ran.clear()
        found = local.find_best_experts("g", scores, 4)
        assert len(dht.ran) == (len(dims) - 1 if search == 0 else 0)
        assert [[e.uid for e in row] for row in found] == [
            [e.uid for e in row] for row in remote.find_best_experts("g", scores, 4)]
        assert [[e.uid for e in row] for row in found] == [
            brute_force(uids[:-6], [s[i].tolist() for s in scores], 4) for i in range(16)]

    announce(network, uids[-6:], PEER_IDS[1], get_dht_time() + 600)  # a new server's experts
    time.sleep(0.6)
    scores = [torch.randn(16, m, generator=gen) for m in dims]
    found = local.find_best_experts("g", scores, 4)
    assert [[e.uid for e in row] for row in found] == [brute_force(uids, [s[i].tolist() for s in scores], 4)
                                                       for i in range(16)]
