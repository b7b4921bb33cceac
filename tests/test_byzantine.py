"""One hostile trainer among honest ones: it sends its gradient scaled by -10 (well-formed, so
the non-finite guard lets it through). With hivemind's mean the collaboration climbs the loss;
with `averaging.aggregation: centeredClip` the honest peers' descent goes on. The attack is a
hook of this test only (it scales the peer's loss), never a product option.

Each peer runs in its own process (hivemind signs progress with one key per process)."""

from __future__ import annotations

import multiprocessing as mp
import queue

import pytest

from conftest import optimizer_peer, stop_processes, write_manifest

STEPS = 12
ATTACK_SCALE = -10.0


def _peer(manifest_path: str, scale: float, initial_peers: list[str], out: mp.Queue) -> None:
    import torch

    with optimizer_peer(manifest_path, "byzantine", initial_peers,
                        announce=lambda maddrs: out.put(("maddrs", maddrs))) as (task, model, _, opt):
        before = task.evaluate(model)["loss"]
        generator = torch.Generator().manual_seed(len(initial_peers))
        while opt.local_epoch < STEPS:
            indices = torch.randint(0, task.train_size, (16,), generator=generator).tolist()
            loss = task.loss(model, task.train_batch(indices)) * scale
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        out.put(("done", {"before": before, "after": task.evaluate(model)["loss"]}))


def run_swarm(directory, aggregation: str) -> dict[str, float]:
    directory.mkdir()
    manifest = str(write_manifest(directory, {"spec": {
        "targetBatchSize": 48, "trainers": {"replicas": 3, "batchSize": 16},
        "optimizer": {"learningRate": 0.05},
        "averaging": {"matchmakingSeconds": 2.0, "timeoutSeconds": 30, "aggregation": aggregation}}}))
    ctx = mp.get_context("fork")
    outs = [ctx.Queue() for _ in range(3)]
    processes: list = []
    try:
        processes.append(ctx.Process(target=_peer, args=(manifest, 1.0, [], outs[0])))
        processes[0].start()
        kind, maddrs = outs[0].get(timeout=60)
        assert kind == "maddrs"
        for index, scale in ((1, 1.0), (2, ATTACK_SCALE)):
            processes.append(ctx.Process(target=_peer, args=(manifest, scale, maddrs, outs[index])))
            processes[-1].start()
        for out in outs[1:]:
            assert out.get(timeout=60)[0] == "maddrs"
        try:
            kind, result = outs[0].get(timeout=240)
        except queue.Empty:
            pytest.fail("the honest peer did not finish its steps")
        assert kind == "done"
        return result
    finally:
        stop_processes(*processes)


@pytest.mark.swarm
@pytest.mark.timeout(600)
def test_centered_clip_keeps_descending_where_the_mean_climbs(tmp_path, no_leaked_p2pd):
    mean = run_swarm(tmp_path / "mean", "mean")
    clipped = run_swarm(tmp_path / "clip", "centeredClip")
    print(f"held-out loss before -> after {STEPS} steps: mean {mean}, centeredClip {clipped}")
    assert mean["after"] > mean["before"], mean  # the attacker steers the mean uphill
    assert clipped["after"] < 0.8 * clipped["before"], clipped
