"""A peer that sends garbage (non-finite gradients) must not poison the others: the averaged
gradients of its group are refused and each honest peer steps on its own gradients, the round
counts as failed, and training goes on. The same guard covers hivemind's 0/0 average when no
sender in a group brought samples (a restarted peer tagging along with weight 0).

Each peer runs in its own process: hivemind signs progress records with one key per process,
so two optimizers in one process overwrite each other's progress and never meet."""

from __future__ import annotations

import multiprocessing as mp
import queue

import pytest

from conftest import optimizer_peer, stop_processes, write_manifest

EPOCHS = 3


def _peer(manifest_path: str, garbage: bool, initial_peers: list[str], out: mp.Queue) -> None:
    import torch

    with optimizer_peer(manifest_path, "garbage", initial_peers,
                        announce=lambda maddrs: out.put(("maddrs", maddrs))) as (task, model, metrics, opt):
        batch = task.train_batch(list(range(16)))
        while opt.local_epoch < EPOCHS:
            loss = task.loss(model, batch)
            if garbage:
                loss = loss * float("nan")
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
        rounds = {outcome: metrics.averaging_rounds.labels(outcome)._value.get()
                  for outcome in ("success", "failure", "skipped")}
        finite = all(bool(torch.isfinite(p).all()) for p in model.parameters())
        out.put(("done", {"finite": finite, "rounds": rounds}))


@pytest.mark.swarm
@pytest.mark.timeout(180)
def test_non_finite_gradients_from_a_peer_are_refused(tmp_path, no_leaked_p2pd):
    manifest = str(write_manifest(tmp_path, {"spec": {
        "targetBatchSize": 32, "trainers": {"replicas": 2, "batchSize": 16},
        "averaging": {"matchmakingSeconds": 2.0, "timeoutSeconds": 30}}}))
    ctx = mp.get_context("fork")
    honest_out, garbage_out = ctx.Queue(), ctx.Queue()
    honest = ctx.Process(target=_peer, args=(manifest, False, [], honest_out))
    honest.start()
    garbage = None
    try:
        kind, maddrs = honest_out.get(timeout=60)
        assert kind == "maddrs"
        garbage = ctx.Process(target=_peer, args=(manifest, True, maddrs, garbage_out))
        garbage.start()
        try:
            kind, result = honest_out.get(timeout=150)
        except queue.Empty:
            pytest.fail("the honest peer did not finish its epochs")
        assert kind == "done"
        assert result["finite"], "the honest peer's weights stay finite"
        # It met the garbage peer (its gradients reached the group) and refused the average.
        assert result["rounds"]["failure"] >= 1, result
    finally:
        stop_processes(honest, garbage)
