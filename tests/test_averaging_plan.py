"""The averaging planner (DeDLOC section 3.2, appendices B and C) and `hivekeeper plan averaging`."""

from __future__ import annotations

import itertools
import json
import random

import numpy as np
import pytest
import yaml

from hivekeeper.cli import main
from hivekeeper.planning.averaging_cli import RICH_MAX_ROWS
from hivekeeper.planning.averaging_lp import (
    AveragingPlan,
    AveragingProblem,
    PeerCapacity,
    all_reduce_baseline,
    literal_relaxation_lp,
    parameter_server_baseline,
    plan_averaging,
    plan_for_roles,
    relaxation_lp,
    solve_lp,
    solve_relaxation,
    throughput_of,
)
from hivekeeper.planning.averaging_lp import _closed_form, _scale, _single_flips
from hivekeeper.planning.group_size import expected_averaging_time, optimal_group_size

# 1e8 float32 parameters: 100 Mbps moves 1/32 of the vector per second
BIG_MODEL = 100_000_000


def random_problem(n: int, seed: int, clients: float = 0.2, links: float = 0.0,
                   spread: float = 1.2) -> AveragingProblem:
    rng = np.random.default_rng(seed)
    peers = []
    for k in range(n):
        samples = float(rng.lognormal(3, 1)) if k == 0 or rng.random() < 0.7 else 0.0
        upload = float(rng.lognormal(4.5, spread))  # a small spread: no single slow peer sets every rate
        client = bool(k > 0 and rng.random() < clients)
        peers.append(PeerCapacity(f"peer-{k:02d}", samples, upload, upload * float(rng.uniform(0.5, 4)), client))
    caps = {
        a.name: {b.name: float(rng.uniform(5, 100)) for b in peers if b is not a and rng.random() < links}
        for a in peers
    }
    return AveragingProblem(
        target_batch_size=float(rng.choice([512, 2048, 8192])),
        num_parameters=int(rng.choice([10_000_000, 100_000_000])),
        peers=peers,
        links={src: row for src, row in caps.items() if row},
    )


def roles(plan: AveragingPlan) -> dict[str, tuple[bool, float]]:
    return {peer.name: (peer.computes_gradients, peer.aggregation_share) for peer in plan.peers}


def uniform_peers(prefix: str, count: int, samples: float, mbps: float) -> list[PeerCapacity]:
    return [PeerCapacity(f"{prefix}-{k}", samples, mbps, mbps) for k in range(count)]


# --- the paper's special cases come out by themselves ----------------------------------


def test_homogeneous_peers_use_all_reduce():
    peers = uniform_peers("gpu", 8, 20, 100)
    problem = AveragingProblem(target_batch_size=16384, num_parameters=BIG_MODEL, peers=peers)
    plan = plan_averaging(problem)
    assert all(computes and share == pytest.approx(1 / 8) for computes, share in roles(plan).values())
    all_reduce = all_reduce_baseline(problem)
    assert plan.steps_per_second == pytest.approx(all_reduce.steps_per_second)
    assert plan.averaging_seconds == pytest.approx(all_reduce.averaging_seconds)


def test_one_fast_weak_peer_becomes_a_parameter_server():
    peers = [*uniform_peers("gpu", 8, 20, 100), PeerCapacity("hub", 1, 10_000, 10_000)]
    problem = AveragingProblem(target_batch_size=8192, num_parameters=BIG_MODEL, peers=peers)
    plan = plan_averaging(problem)
    shares = {name: share for name, (_, share) in roles(plan).items()}
    assert shares.pop("hub") == pytest.approx(1.0)
    assert all(share == pytest.approx(0.0, abs=1e-9) for share in shares.values())
    assert all(peer.computes_gradients for peer in plan.peers)
    assert plan.steps_per_second == pytest.approx(parameter_server_baseline(problem).steps_per_second)
    assert plan.steps_per_second > 1.1 * all_reduce_baseline(problem).steps_per_second


def test_peers_without_accelerators_become_pure_aggregators():
    peers = [*uniform_peers("gpu", 4, 20, 100), *uniform_peers("cpu", 4, 0, 100)]
    problem = AveragingProblem(target_batch_size=2048, num_parameters=BIG_MODEL, peers=peers)
    plan = plan_averaging(problem)
    for name, (computes, share) in roles(plan).items():
        if name.startswith("gpu"):
            assert computes and share == pytest.approx(0.0, abs=1e-9)
        else:
            assert not computes and share == pytest.approx(0.25)
    # BytePS: every trainer sends and receives the vector once, instead of 2(n-1)/n of it
    assert plan.averaging_seconds == pytest.approx(32.0)
    assert plan.steps_per_second == pytest.approx(1.75 * all_reduce_baseline(problem).steps_per_second)


def test_averaging_time_counts_megabits():
    # 1e6 float32 = 32 Mbit; two peers at 80 Mbps each send half and get half back: 0.4 s
    problem = AveragingProblem(target_batch_size=8, num_parameters=1_000_000, peers=uniform_peers("gpu", 2, 4, 80))
    assert plan_averaging(problem).averaging_seconds == pytest.approx(0.4)
    assert all_reduce_baseline(problem).averaging_seconds == pytest.approx(0.4)


# --- eq. 5: the O(n^2) form has the literal form's optimum ------------------------------


@pytest.mark.parametrize("seed", range(8))
def test_compact_relaxation_has_the_literal_optimum(seed):
    problem = random_problem(3 + seed % 4, seed, clients=0.3, links=0.3 if seed % 2 else 0.0)
    n = len(problem.peers)
    literal, compact = literal_relaxation_lp(problem), relaxation_lp(problem)
    assert literal.num_rows >= n**3
    assert compact.num_rows <= 2 * n * n + 3 * n + 1 + n * (n - 1)
    literal_value = -literal.cost @ solve_lp(literal)
    compact_value = -compact.cost @ solve_lp(compact)
    assert compact_value == pytest.approx(literal_value, rel=1e-9, abs=1e-12)


# --- binary roles -------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(4))
def test_exact_plan_is_the_best_of_all_role_sets(seed):
    problem = random_problem(6, 100 + seed, clients=0.3, links=0.25 if seed % 2 else 0.0)
    plan = plan_averaging(problem, exact=True)
    assert plan.method == "milp"
    names = [peer.name for peer in problem.peers]
    forced = [peer.client_mode and peer.samples_per_second > 0 for peer in problem.peers]
    best = max(
        plan_for_roles(problem, dict(zip(names, choice))).steps_per_second
        for choice in itertools.product([False, True], repeat=len(names))
        if any(choice) and all(c or not f for c, f in zip(choice, forced))
    )
    assert plan.steps_per_second == pytest.approx(best, rel=1e-7)


def test_link_caps_that_never_bind_change_nothing():
    # without caps the shares come in closed form, with caps from an LP: same rates
    problem = random_problem(9, 17, clients=0.3)
    names = [peer.name for peer in problem.peers]
    loose = AveragingProblem(target_batch_size=problem.target_batch_size, num_parameters=problem.num_parameters,
                             peers=problem.peers, links={a: {b: 1e7 for b in names if b != a} for a in names})
    rng = np.random.default_rng(0)
    for _ in range(10):
        computes = dict(zip(names, rng.random(len(names)) < 0.6))
        computes[names[0]] = True
        free, capped = plan_for_roles(problem, computes), plan_for_roles(loose, computes)
        assert capped.aggregation_bound == pytest.approx(free.aggregation_bound, rel=1e-7)
    assert plan_averaging(loose).steps_per_second == pytest.approx(plan_averaging(problem).steps_per_second)


def test_bottleneck_links_get_no_sliver_of_the_vector():
    """Slow computing peers already load their links with their own vector: a split handing them
    what their links have left (the few percent by which their measured rates differ) would fill
    them to the brim for the same predicted rate. The levelled split leaves them out."""
    peers = [*uniform_peers("fast", 4, 16, 40), *(PeerCapacity(f"slow-{k}", 16, mbps, mbps)
                                                  for k, mbps in enumerate((6.1, 6.4, 7.0, 7.2)))]
    problem = AveragingProblem(target_batch_size=1024, num_parameters=2_000_000, peers=peers)
    everyone = {peer.name: True for peer in peers}
    plan = plan_for_roles(problem, everyone)
    shares = {name: share for name, (_, share) in roles(plan).items()}
    assert all(shares[f"slow-{k}"] == 0 for k in range(4))
    assert all(shares[f"fast-{k}"] == pytest.approx(0.25) for k in range(4))
    # the same rate as the shares LP (loose link caps take that path), bound by the slowest link
    loose = AveragingProblem(target_batch_size=1024, num_parameters=2_000_000, peers=peers,
                             links={"fast-0": {"fast-1": 1e6}})
    assert plan.aggregation_bound == pytest.approx(plan_for_roles(loose, everyone).aggregation_bound, rel=1e-9)
    assert plan.averaging_seconds == pytest.approx(2_000_000 * 32 / 6.1e6)


def test_rounding_stays_close_to_the_exact_plan():
    gaps = []
    for n, seed in itertools.product((8, 11, 14), range(4)):
        problem = random_problem(n, 200 + seed, links=0.1 if seed == 3 else 0.0)
        exact, rounded = plan_averaging(problem, exact=True), plan_averaging(problem, exact=False)
        assert exact.method == "milp" and rounded.method == "rounding"
        assert rounded.steps_per_second <= exact.steps_per_second * (1 + 1e-9)
        if sum(peer.computes_gradients for peer in exact.peers) > 1:  # eq. 5 leaves out lone trainers
            assert solve_relaxation(problem).steps_per_second >= exact.steps_per_second * (1 - 1e-7)
        gaps.append(1 - rounded.steps_per_second / exact.steps_per_second)
    assert np.mean(gaps) < 0.01 and max(gaps) < 0.05


@pytest.mark.parametrize("n", [10, 20])  # exact and rounded
def test_plan_is_deterministic_and_ignores_input_order(n):
    problem = random_problem(n, 7, links=0.1)
    shuffled = list(problem.peers)
    random.Random(0).shuffle(shuffled)
    again = AveragingProblem(target_batch_size=problem.target_batch_size, num_parameters=problem.num_parameters,
                             peers=shuffled, links=problem.links)
    plans = [plan_averaging(problem), plan_averaging(problem), plan_averaging(again)]
    assert len({(plan.steps_per_second, plan.averaging_seconds, plan.peers) for plan in plans}) == 1


@pytest.mark.parametrize("exact", [True, False])
def test_client_mode_peers_aggregate_nothing(exact):
    for seed in range(5):
        problem = random_problem(12, 300 + seed, clients=0.4, links=0.1)
        plan = plan_averaging(problem, exact=exact)
        clients = {peer.name for peer in problem.peers if peer.client_mode}
        assert clients
        assert all(role.aggregation_share == 0 for role in plan.peers if role.name in clients)
        assert sum(role.aggregation_share for role in plan.peers) == pytest.approx(1.0)


@pytest.mark.parametrize("exact", [True, False])
def test_client_mode_peers_with_samples_always_compute(exact):
    """hivemind cannot make a client-mode peer an auxiliary, so it sends its gradients whatever
    the plan says: a plan counting it out would report figures of roles nobody follows."""
    peers = [*uniform_peers("gpu", 4, 20, 100), PeerCapacity("laptop", 1, 5, 5, client_mode=True)]
    problem = AveragingProblem(target_batch_size=4096, num_parameters=BIG_MODEL, peers=peers)
    without_laptop = plan_for_roles(problem, {peer.name: peer.name != "laptop" for peer in peers})
    plan = plan_averaging(problem, exact=exact)
    assert roles(plan)["laptop"] == (True, 0.0)
    followed = plan_for_roles(problem, {role.name: role.computes_gradients for role in plan.peers})
    assert plan.steps_per_second == pytest.approx(followed.steps_per_second)
    assert plan.steps_per_second < 0.5 * without_laptop.steps_per_second  # the slow link costs, and is reported

    for seed in range(6):
        problem = random_problem(12 if exact else 24, 500 + seed, clients=0.4)
        plan = plan_averaging(problem, exact=exact)
        computes = {role.name: role.computes_gradients for role in plan.peers}
        assert all(computes[peer.name] for peer in problem.peers if peer.client_mode and peer.samples_per_second > 0)


def test_plan_is_never_slower_than_the_baselines():
    for seed in range(8):
        problem = random_problem(10 if seed % 2 else 40, 400 + seed, links=0.1 if seed % 4 == 1 else 0.0)
        plan = plan_averaging(problem)
        for baseline in (all_reduce_baseline(problem), parameter_server_baseline(problem)):
            assert plan.steps_per_second >= baseline.steps_per_second * (1 - 1e-9)


# --- baselines: closed forms against the model, peer by peer and link by link ----------


def straightforward_throughput(problem: AveragingProblem, computes: dict[str, bool],
                               shares: dict[str, float]) -> tuple[float, float]:
    """(compute bound, aggregation rate) in steps/s, from the model's definition in Mbps: every
    peer and every capped link moves its vectors, and the slowest of them sets the rate."""
    megabits = problem.num_parameters * problem.bytes_per_parameter * 8 / 1e6
    k = sum(computes.values())
    seconds = 0.0
    for peer in problem.peers:
        c, a = computes[peer.name], shares[peer.name]
        seconds = max(seconds, (c * (1 - a) + (k - c) * a) * megabits / min(peer.upload_mbps, peer.download_mbps))
    for src, row in problem.links.items():
        for dst, mbps in row.items():  # src's part to aggregator dst, and src's average back to dst
            vectors = computes[src] * shares[dst] + computes[dst] * shares[src]
            seconds = max(seconds, vectors * megabits / mbps)
    compute = sum(peer.samples_per_second for peer in problem.peers if computes[peer.name])
    return compute / problem.target_batch_size, 1 / seconds if seconds > 0 else np.inf


def assert_same(throughput, expected: tuple[float, float]) -> None:
    assert (throughput.compute_bound, throughput.aggregation_bound) == pytest.approx(expected, rel=1e-9)


@pytest.mark.parametrize("seed", range(16))
def test_baselines_match_the_straightforward_evaluation(seed):
    """The parameter-server baseline is one closed form over all candidate servers (it used to
    evaluate each server in O(n^2)); all-reduce and `throughput_of` look only at capped links."""
    rng = np.random.default_rng(seed)
    problem = random_problem(1 + seed * 5 // 2 + int(rng.integers(3)), 600 + seed, clients=0.3,
                             links=(0.0, 0.1, 0.5, 1.0)[seed // 2 % 4], spread=(1.2, 0.05)[seed % 2])
    names = [peer.name for peer in problem.peers]
    servers = [peer.name for peer in problem.peers if not peer.client_mode]
    everyone = dict.fromkeys(names, True)
    options = [straightforward_throughput(problem, everyone, {name: float(name == server) for name in names})
               for server in servers]
    assert_same(parameter_server_baseline(problem), max(options, key=lambda o: (min(o), o[1])))
    equal = {name: 1 / len(servers) if name in servers else 0.0 for name in names}
    assert_same(all_reduce_baseline(problem), straightforward_throughput(problem, everyone, equal))
    for _ in range(5):
        computes = dict(zip(names, (bool(b) for b in rng.random(len(names)) < 0.6)))
        computes[names[0]] = True
        raw = {name: float(rng.random()) if name in servers else 0.0 for name in names}
        shares = {name: share / sum(raw.values()) for name, share in raw.items()}
        assert_same(throughput_of(problem, computes, raw), straightforward_throughput(problem, computes, shares))


@pytest.mark.parametrize("seed", range(4))
def test_single_flips_match_the_closed_form_of_each_flip(seed):
    """Local search scores every one-peer flip from the current sums in O(n); the same figures
    as the closed form of each flipped role set."""
    m = _scale(random_problem(5 + 9 * seed, 700 + seed, clients=0.3))
    rng = np.random.default_rng(seed)
    for roles in (rng.random(m.n) < 0.5, np.ones(m.n, dtype=bool), np.eye(m.n, dtype=bool)[0]):
        steps, rate = _single_flips(m, roles)
        expected_steps, expected_rate = _closed_form(m, roles[None] ^ np.eye(m.n, dtype=bool))
        assert steps == pytest.approx(expected_steps, rel=1e-12)
        assert rate == pytest.approx(expected_rate, rel=1e-12)


# --- group size (appendix C) ----------------------------------------------------------


def test_reliable_peers_average_in_one_group():
    assert [optimal_group_size(n, 0.0) for n in (2, 5, 64, 300)] == [2, 5, 64, 300]
    # one global group succeeds when all n peers do: 1 / q attempts on average
    assert expected_averaging_time(100, 100, 0.01) == pytest.approx(0.99**-100)


def test_failures_shrink_the_group():
    sizes = [optimal_group_size(100, p) for p in (0.0, 0.001, 0.01, 0.05, 0.1, 0.3)]
    assert sizes == sorted(sizes, reverse=True) and sizes[0] == 100 and sizes[-1] < 10
    chosen = optimal_group_size(100, 0.05)
    for other in (2, 10, 50, 100):
        assert expected_averaging_time(100, chosen, 0.05) <= expected_averaging_time(100, other, 0.05)
    with pytest.raises(ValueError):
        optimal_group_size(10, 1.0)


# --- the command --------------------------------------------------------------------


def write_input(tmp_path, document: dict) -> str:
    path = tmp_path / "peers.yaml"
    path.write_text(yaml.safe_dump(document))
    return str(path)


BYTEPS_INPUT = {
    "targetBatchSize": 2048,
    "numParameters": BIG_MODEL,
    "peers": [
        *({"name": f"gpu-{k}", "samplesPerSecond": 20, "uploadMbps": 100, "downloadMbps": 100} for k in range(4)),
        {"name": "laptop", "samplesPerSecond": 5, "uploadMbps": 20, "downloadMbps": 50, "clientMode": True},
        *({"name": f"cpu-{k}", "samplesPerSecond": 0, "uploadMbps": 100, "downloadMbps": 100} for k in range(4)),
    ],
}


def test_command_prints_the_plan_as_json(tmp_path, capsys):
    assert main(["plan", "averaging", "--input", write_input(tmp_path, BYTEPS_INPUT), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert [peer["name"] for peer in report["peers"]] == [peer["name"] for peer in BYTEPS_INPUT["peers"]]
    shares = {peer["name"]: peer["aggregationShare"] for peer in report["peers"]}
    assert sum(shares.values()) == pytest.approx(1.0) and shares["laptop"] == 0
    assert report["groupSize"] == 9 and report["solveSeconds"] > 0
    assert report["stepsPerSecond"] * report["averagingSeconds"] <= 1 + 1e-9  # a step waits for its average
    baselines = report["baselines"]
    assert set(baselines) == {"allReduce", "parameterServer"}
    assert all(report["stepsPerSecond"] >= b["stepsPerSecond"] for b in baselines.values())


def test_command_prints_a_table(tmp_path, capsys):
    assert main(["plan", "averaging", "--input", write_input(tmp_path, BYTEPS_INPUT)]) == 0
    out = capsys.readouterr().out
    assert "this plan" in out and "allReduce" in out and "laptop (client)" in out


def test_command_predicts_dilocos_outer_rounds_on_the_same_peers(tmp_path, capsys):
    """Four replicas at 20 samples/s, batch 10, H = 50: 25 s computing per round (the slowest
    sets the pace), then one all-reduce of the vector; overlapped, the round takes the longer."""
    peers = [{"name": f"gpu-{k}", "samplesPerSecond": 20, "uploadMbps": 100, "downloadMbps": 100} for k in range(4)]
    document = {"targetBatchSize": 2048, "numParameters": BIG_MODEL, "peers": peers,
                "diloco": {"innerSteps": 50, "batchSize": 10}}
    assert main(["plan", "averaging", "--input", write_input(tmp_path, document), "--json"]) == 0
    rounds = json.loads(capsys.readouterr().out)["outerRounds"]
    all_reduce = 2 * 3 / 4 * BIG_MODEL * 4 * 8 / 100e6  # each peer moves 2(n-1)/n vectors over 100 Mbit/s
    assert rounds["computeSeconds"] == pytest.approx(25.0)
    assert rounds["averagingSeconds"] == pytest.approx(all_reduce, rel=1e-6)
    assert rounds["samplesPerSecond"] == pytest.approx(4 * 500 / (25.0 + all_reduce))
    assert rounds["bytesPerReplicaPerRound"] == pytest.approx(1.5 * BIG_MODEL * 4)
    document["diloco"]["overlap"] = True
    assert main(["plan", "averaging", "--input", write_input(tmp_path, document)]) == 0
    out = capsys.readouterr().out
    assert "an outer round every 50 inner steps" in out and f"{max(25.0, all_reduce):.3g} s a round" in out


def test_command_predicts_whole_steps_with_the_fixed_costs_a_swarm_measured(tmp_path, capsys):
    """The LP's steps/s assume a round costs only its bytes; with the fixed costs (the balancer's
    hivekeeper_plan_step_seconds), the prediction is compute + transfer + fixed, for the plan and
    the baselines alike."""
    fixed = {"lag": 0.06, "wait": 0.3, "roundTrips": 0.04, "after": 0.05}
    document = {**BYTEPS_INPUT, "fixedSeconds": fixed}
    assert main(["plan", "averaging", "--input", write_input(tmp_path, document), "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    step = report["step"]
    assert step["fixed"] == fixed and not step["overlap"]
    assert step["seconds"] == pytest.approx(step["compute"] + step["transfer"] + 0.45, abs=1e-3)
    assert report["predictedStepsPerSecond"] == pytest.approx(1 / step["seconds"], rel=1e-3)
    assert report["predictedStepsPerSecond"] < report["stepsPerSecond"]
    assert all("predictedStepsPerSecond" in b for b in report["baselines"].values())
    document["overlap"] = True  # delayed parameter updates: the round hides behind the next batch
    assert main(["plan", "averaging", "--input", write_input(tmp_path, document), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["predictedStepsPerSecond"] > report["predictedStepsPerSecond"]
    assert main(["plan", "averaging", "--input", write_input(tmp_path, document)]) == 0
    assert "fixed 0.45 s (lag 0.06, wait 0.3, roundTrips 0.04, after 0.05)" in capsys.readouterr().out


def test_command_prints_plain_columns_for_a_large_swarm(tmp_path, capsys):
    many = {**BYTEPS_INPUT, "peers": [*BYTEPS_INPUT["peers"], *(
        {"name": f"edge-{k}", "samplesPerSecond": 1 + k % 7, "uploadMbps": 10 + k, "downloadMbps": 40}
        for k in range(RICH_MAX_ROWS))]}
    assert main(["plan", "averaging", "--input", write_input(tmp_path, many)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == f"Averaging plan ({RICH_MAX_ROWS + 9} peers)"
    assert lines[1].split() == ["peer", "samples/s", "up", "Mbps", "down", "Mbps", "computes", "share"]
    rows = {line.split()[0]: line for line in lines[3:3 + RICH_MAX_ROWS + 9]}
    assert set(rows) == {peer["name"] for peer in many["peers"]}
    assert "laptop (client)" in rows["laptop"] and len({len(row) for row in rows.values()}) == 1  # aligned
    assert any("this plan" in line for line in lines) and any("parameterServer" in line for line in lines)


@pytest.mark.parametrize(
    ("change", "field"),
    [
        (lambda doc: doc["peers"][1].update(uploadMbps=-5), "peers.1.uploadMbps"),
        (lambda doc: doc["peers"][0].update(bandwidth=5), "peers.0.bandwidth"),
        (lambda doc: doc["peers"][2].update(name="gpu-0"), "peers.2.name"),
        (lambda doc: doc.update(links={"gpu-0": {"nowhere": 10}}), "links.gpu-0"),
        (lambda doc: doc.pop("targetBatchSize"), "targetBatchSize"),
    ],
)
def test_bad_input_is_one_line_naming_the_field(tmp_path, capsys, change, field):
    document = json.loads(json.dumps(BYTEPS_INPUT))
    change(document)
    assert main(["plan", "averaging", "--input", write_input(tmp_path, document), "--json"]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err.count("\n") == 1 and field in captured.err
