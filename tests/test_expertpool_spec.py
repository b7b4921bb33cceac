"""ExpertPool without peers: the spec and its one-line errors, the grid and its assignment over
servers, the batched beam search against brute force, and the DMoE layer's renormalization over
the experts that answer (with in-process experts)."""

from __future__ import annotations

import asyncio
import random
import subprocess
import sys
from concurrent.futures import Future

import pytest
import torch

from conftest import EXAMPLES, deep_update, write_manifest
from hivekeeper.errors import UserError
from hivekeeper.experts.beam import batch_beam_search
from hivekeeper.experts.dmoe import DMoE, ExpertsUnavailable
from hivekeeper.experts.grid import assign_experts, grid_uids, pool_assignment, server_experts, uid_coordinates
from hivekeeper.spec import load_manifest, parse_manifest
from hivekeeper.spec.expertpool import ExpertPoolSpec
from hivemind.moe.expert_uid import ExpertInfo

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
