"""hivemind's collaborative Optimizer, configured from the Swarm spec (the instrumented
subclass, which turns every averaging round into metrics, is `hivekeeper.hivemind_ext.optimizer`).
Importing this module does not import hivemind."""

from __future__ import annotations

from typing import Optional

import torch

from hivekeeper.metrics import SwarmMetrics
from hivekeeper.spec.swarm import ROBUST_MIN_GROUP_SIZE, AveragingSpec, SwarmSpec
from hivekeeper.training.optimizers import scheduler_factory, torch_optimizer_factory

# Bytes a tensor element takes on the wire under each compression (hivemind's serializers).
WIRE_BYTES_PER_ELEMENT = {"none": 4.0, "float16": 2.0, "uniform8bit": 1.0, "blockwise8bit": 1.0}


def compression(name: str):
    from hivemind.compression import BlockwiseQuantization, Float16Compression, NoCompression, Uniform8BitQuantization

    return {
        "none": NoCompression,
        "float16": Float16Compression,
        "uniform8bit": Uniform8BitQuantization,
        "blockwise8bit": BlockwiseQuantization,
    }[name]()


def averaging_group_size(spec: SwarmSpec) -> int:
    """The all-reduce group: as the spec says, else the size that reaches the global average
    fastest when each peer fails a round with `peerFailureProbability` (DeDLOC appendix C):
    every averaging peer (trainers and auxiliaries) at once when peers do not fail."""
    from hivekeeper.planning.group_size import optimal_group_size

    if spec.averaging.target_group_size:
        return spec.averaging.target_group_size
    peers = spec.trainers.replicas + spec.auxiliary.replicas
    smallest = ROBUST_MIN_GROUP_SIZE if spec.averaging.aggregation == "centeredClip" else 2
    return max(smallest, optimal_group_size(peers, spec.averaging.peer_failure_probability))


NEVER = 2**31 - 1  # an averageStateEvery no run reaches


def hivemind_parameter_rounds(spec: SwarmSpec, auxiliary: bool = False) -> bool:
    """Whether this peer averages parameters in hivemind's own rounds (matched apart from the
    gradient rounds, in the background) rather than on each gradient round's group right after
    it (`hivekeeper.hivemind_ext.state_round`). Only with DPU: there the optimizer steps in the
    background while the next gradient round runs, so no parameters are settled at the round."""
    return spec.averaging.delayed_parameter_updates and not auxiliary


def state_group_size(spec: SwarmSpec) -> int:
    """The parameter-averaging group: the gradient group's size, of trainers only (auxiliaries
    do not average parameters), so that a whole group assembles at once."""
    return max(2, min(averaging_group_size(spec), spec.trainers.replicas))


# how often a peer's progress record is refreshed in the DHT (hivemind's defaults are far slower)
TRACKER_REFRESH = dict(min_refresh_period=0.25, max_refresh_period=2.0)


def chunk_timeout(matchmaking_seconds: float, timeout_seconds: float) -> float:
    """How long a peer in a formed group may go silent between two parts before the others drop
    it from the round (its parts then stay local: peers step on different averages). hivemind
    ties it to the matchmaking time, so a 1 s matchmaking window drops a peer that a loaded host
    stalls for a second; a quarter of the round's timeout still leaves a hung peer's group the
    time to finish without it (the reducer's limit is twice this)."""
    return max(matchmaking_seconds, timeout_seconds / 4)


def robust_aggregation(averaging: AveragingSpec):
    """The CenteredClip the spec asks aggregators to apply, or None for hivemind's mean."""
    if averaging.aggregation != "centeredClip":
        return None
    from hivekeeper.hivemind_ext.robust import CenteredClip

    return CenteredClip(radius=averaging.centered_clip.radius, iterations=averaging.centered_clip.iterations)


def averager_options(target_group_size: Optional[int], matchmaking_seconds: float, robust: bool = False) -> dict:
    """hivemind advises a request timeout below the matchmaking time (rare deadlocks otherwise)."""
    options = dict(target_group_size=target_group_size, request_timeout=min(3.0, matchmaking_seconds / 2))
    if robust:
        options["min_group_size"] = ROBUST_MIN_GROUP_SIZE
    return options


def make_collaborative_optimizer(
    spec: SwarmSpec,
    run_id: str,
    dht,
    model: torch.nn.Module,
    metrics: SwarmMetrics,
    *,
    auxiliary: bool = False,
    batch_size: Optional[int] = None,
):
    from functools import partial

    from hivekeeper.hivemind_ext.allreduce import PlannedCountingGradientAverager
    from hivekeeper.hivemind_ext.optimizer import InstrumentedOptimizer

    averaging = spec.averaging
    aggregation = robust_aggregation(averaging)
    group_options = averager_options(averaging_group_size(spec), averaging.matchmaking_seconds,
                                     robust=aggregation is not None)
    grad_compression = compression(averaging.compression)
    optimizer = InstrumentedOptimizer(
        dht=dht,
        run_id=run_id,
        params=model.parameters(),
        optimizer=torch_optimizer_factory(spec.optimizer),
        scheduler=scheduler_factory(spec.optimizer),
        target_batch_size=spec.target_batch_size,
        batch_size_per_step=None if auxiliary else batch_size,
        matchmaking_time=averaging.matchmaking_seconds,
        averaging_timeout=averaging.timeout_seconds,
        next_chunk_timeout=chunk_timeout(averaging.matchmaking_seconds, averaging.timeout_seconds),
        delay_optimizer_step=averaging.delayed_parameter_updates,
        delay_grad_averaging=averaging.delayed_parameter_updates,
        # parameter rounds ride the gradient rounds' groups (`parameters_every`), except with DPU,
        # whose optimizer steps in the background while the next round runs: hivemind's own
        # rounds then (an auxiliary holds no parameters of its own to keep in line)
        average_state_every=averaging.average_state_every if hivemind_parameter_rounds(spec, auxiliary) else NEVER,
        parameters_every=None if averaging.delayed_parameter_updates else averaging.average_state_every,
        auxiliary=auxiliary,
        client_mode=dht.client_mode,
        grad_compression=grad_compression,
        state_averaging_compression=grad_compression,
        grad_averager_factory=partial(
            PlannedCountingGradientAverager, wire_bytes_per_element=WIRE_BYTES_PER_ELEMENT[averaging.compression],
            aggregation=aggregation,
            # hivemind 1.1.12 passes averager_opts to the state averager only: without these, a
            # gradient round never assembled a full group early and always waited out matchmaking
            **group_options,
        ),
        state_aggregation=aggregation,  # parameters averaged every averageStateEvery steps
        averager_opts={**group_options, "target_group_size": state_group_size(spec)},
        tracker_opts=TRACKER_REFRESH,
        metrics=metrics,
        expected_peers=spec.trainers.replicas,  # the progress tracker counts trainers only
        verbose=False,
    )
    reset_step_counters(optimizer.state_averager.optimizer)
    return optimizer


def reset_step_counters(optimizer: torch.optim.Optimizer) -> None:
    """hivemind creates the optimizer's state with one speculative step on zero gradients, which
    leaves Adam's step count at 1: the first real step then uses the bias correction of the
    second, a different update than single-process training makes. Start the count at 0."""
    for state in optimizer.state.values():
        step = state.get("step")
        if isinstance(step, torch.Tensor):
            step.zero_()
        elif step is not None:
            state["step"] = 0
