"""A replica that got only part of a round's average back steps on nothing: hivemind would leave
its own gradients where the average is missing and step on that mix, apart from every other
replica. Seen in CI with every member missing a part: the replicas drifted apart for good
(test_equivalence). Here the optimizer's own step after `_drop_update` must leave the
parameters exactly as they were, though the gradients it held were not zero."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from conftest import forked_result, optimizer_peer, write_manifest


def _peer(manifest_path: str, out: mp.Queue) -> None:
    import torch

    with optimizer_peer(manifest_path, "partial") as (task, model, metrics, opt):
        task.loss(model, task.train_batch(list(range(16)))).backward()
        optimized = [p for group in opt.state_averager.optimizer.param_groups for p in group["params"]]
        for param, local in zip(optimized, model.parameters()):  # what hivemind loads before a step
            param.grad = local.grad.clone()
        had_gradients = all(bool(p.grad.abs().sum() > 0) for p in optimized if p.grad is not None)
        before = [p.detach().clone() for p in optimized]
        opt._drop_update()
        opt.state_averager.optimizer.step()
        unchanged = all(torch.equal(a, p.detach()) for a, p in zip(before, optimized))
        out.put({"had_gradients": had_gradients, "unchanged": unchanged})


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_a_replica_missing_part_of_the_average_steps_on_nothing(tmp_path, no_leaked_p2pd):
    manifest = str(write_manifest(tmp_path, {"spec": {
        "optimizer": {"name": "sgd", "learningRate": 0.5},
        "trainers": {"replicas": 1, "batchSize": 16}}}))
    result = forked_result(_peer, manifest, timeout=100, what="the peer")
    assert result == {"had_gradients": True, "unchanged": True}, result
