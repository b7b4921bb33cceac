"""A trainer alone in its swarm steps on its own gradients without ever scheduling an
averaging round: hivemind would schedule one before every epoch's end and cancel it, and such
a cancel racing matchmaking once left a lone trainer unable to group with peers that joined
later (see InstrumentedOptimizer._maybe_schedule_gradient_averaging)."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from conftest import forked_result, optimizer_peer, write_manifest

EPOCHS = 4


def _lone_peer(manifest_path: str, out: mp.Queue) -> None:
    with optimizer_peer(manifest_path, "lone") as (task, model, metrics, opt):
        scheduled, schedule_step = [], opt.grad_averager.schedule_step

        def counting_schedule_step(*args, **kwargs):
            scheduled.append(opt.local_epoch)
            return schedule_step(*args, **kwargs)

        opt.grad_averager.schedule_step = counting_schedule_step
        batch, steps = task.train_batch(list(range(16))), 0
        while opt.local_epoch < EPOCHS:
            task.loss(model, batch).backward()
            opt.step()
            opt.zero_grad(set_to_none=False)
            steps += 1
        skipped = metrics.averaging_rounds.labels("skipped")._value.get()
        out.put({"scheduled": scheduled, "steps": steps, "skipped": skipped, "epoch": opt.local_epoch})


@pytest.mark.swarm
@pytest.mark.timeout(120)
def test_a_lone_trainer_steps_alone_and_schedules_no_round(tmp_path, no_leaked_p2pd):
    manifest = str(write_manifest(tmp_path, {"spec": {
        "targetBatchSize": 64, "trainers": {"replicas": 1, "batchSize": 16},
        "averaging": {"matchmakingSeconds": 2.0, "timeoutSeconds": 30}}}))
    result = forked_result(_lone_peer, manifest, timeout=100, what="the lone peer")
    assert result["epoch"] >= EPOCHS and result["skipped"] >= EPOCHS - 1, result  # it stepped alone
    assert result["scheduled"] == [], result
