"""Whether the members of an averaging round hold one model: a fingerprint of each replica's
parameters, and the group's verdict on who agrees with whom.

A collaborative step is one large-batch SGD step of one model only while every member starts it
from the same parameters. Each member therefore gathers a fingerprint of its parameters with the
data matchmaking already collects (`hivemind_ext.state_round`), and every member derives, from
the identical gathered data, the same verdict: the *reference* replica (the one most members
hold) and the members that differ from it. Those send their gradients with weight 0, drop their
update and reload the state before they compute again.

The fingerprint is a sketch, not a hash: replicas in lockstep differ by float rounding (each
member adds the averages it receives to its own values, and parts may travel compressed), so a
bit-exact digest would split every group. It projects a fixed sample of each tensor's elements
(at most `SAMPLE_PER_TENSOR`, evenly spaced) onto `PROJECTIONS` fixed pseudo-random directions
and keeps the sample's norm: two replicas agree when every projection differs by at most
`TOLERANCE` of that norm. Rounding noise (about 1e-7 relative) is far below it, and a real
divergence (replicas a step or more apart, 1e-3 relative and up) moves the projections by its
whole size times a standard normal factor, so it escapes all four only with negligible odds.
A member without a fingerprint (another version's, garbage) is not judged.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Optional, Sequence

import torch

__all__ = ["Fingerprint", "ReplicaVerdict", "fingerprint", "replica_verdict"]

PROJECTIONS = 4
SAMPLE_PER_TENSOR = 4096
TOLERANCE = 1e-3  # relative to the sample's norm
_SEED = 0x5EED


@dataclass(frozen=True)
class Fingerprint:
    projections: tuple[float, ...]
    norm: float

    def to_wire(self) -> list[float]:
        return [*self.projections, self.norm]

    @classmethod
    def from_wire(cls, value: Any) -> Optional["Fingerprint"]:
        """The fingerprint a member gathered, or None for anything malformed."""
        if (not isinstance(value, (list, tuple)) or len(value) != PROJECTIONS + 1
                or not all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in value)
                or value[-1] < 0):
            return None
        return cls(tuple(float(x) for x in value[:-1]), float(value[-1]))

    def agrees_with(self, other: "Fingerprint") -> bool:
        bound = TOLERANCE * max(self.norm, other.norm, 1e-12)
        return all(abs(a - b) <= bound for a, b in zip(self.projections, other.projections))

    def distance(self, other: "Fingerprint") -> float:
        """How far apart the two replicas are, estimated from the projections (random
        projections keep distances, roughly, with so few of them)."""
        return math.dist(self.projections, other.projections)


class _Projector:
    """The sampled elements and projection weights of one parameter layout, made once."""

    def __init__(self, shapes: Sequence[torch.Size]):
        generator = torch.Generator().manual_seed(_SEED)
        self.indices: list[torch.Tensor] = []
        self.weights: list[torch.Tensor] = []
        for shape in shapes:
            numel = math.prod(shape)
            count = min(numel, SAMPLE_PER_TENSOR)
            self.indices.append(torch.linspace(0, max(numel - 1, 0), count).round().long() if count else
                                torch.zeros(0, dtype=torch.long))
            self.weights.append(torch.randn(PROJECTIONS, count, generator=generator, dtype=torch.float64))

    @torch.no_grad()
    def __call__(self, tensors: Sequence[torch.Tensor]) -> Fingerprint:
        projections = torch.zeros(PROJECTIONS, dtype=torch.float64)
        squares = 0.0
        for tensor, indices, weights in zip(tensors, self.indices, self.weights):
            sample = tensor.detach().reshape(-1)[indices.to(tensor.device)].to("cpu", torch.float64)
            projections += weights @ sample
            squares += float(sample.square().sum())
        return Fingerprint(tuple(projections.tolist()), math.sqrt(squares))


_projectors: dict[tuple, _Projector] = {}


def fingerprint(tensors: Sequence[torch.Tensor]) -> Fingerprint:
    """The sketch of a replica's parameters (the same tensors in the same order at every member)."""
    shapes = tuple(tuple(t.shape) for t in tensors)
    projector = _projectors.get(shapes)
    if projector is None:
        projector = _projectors[shapes] = _Projector([torch.Size(s) for s in shapes])
    return projector(tensors)


@dataclass(frozen=True)
class ReplicaVerdict:
    """Which members of a group hold the reference replica. `diverged` lists the indices (in the
    group's order) of judged members that differ from it; empty when all agree."""

    diverged: frozenset[int]

    @property
    def agreed(self) -> bool:
        return not self.diverged


def replica_verdict(fingerprints: Sequence[Optional[Fingerprint]], epochs: Sequence[Optional[int]],
                    judged: Sequence[bool]) -> ReplicaVerdict:
    """The group's verdict from its members' gathered fingerprints and epochs. Only `judged`
    members (those that send data and gathered a fingerprint) are compared. The reference is the
    replica most judged members hold. Among replicas held by equally many, it is the medoid: the
    one closest to all the others in sum. After a round that failed for everyone, each member
    stepped alone and all differ; the medoid is then one of the honest majority's replicas, who
    stepped near each other, never a hostile member's that stepped far away (the honest members
    reload from the reference, so the choice decides whose model the swarm goes on with). Then
    the highest epoch, then the member first in the group's order (every member sees the same
    order), so every member reaches the same verdict."""
    classes: list[list[int]] = []  # member indices per replica, in order of first appearance
    for index, (print_, judge) in enumerate(zip(fingerprints, judged)):
        if not judge or print_ is None:
            continue
        for members in classes:
            if fingerprints[members[0]].agrees_with(print_):
                members.append(index)
                break
        else:
            classes.append([index])
    if len(classes) <= 1:
        return ReplicaVerdict(frozenset())

    held = [i for members in classes for i in members]

    def rank(members: list[int]) -> tuple:
        spread = sum(fingerprints[members[0]].distance(fingerprints[i]) for i in held)
        top_epoch = max((epochs[i] for i in members if isinstance(epochs[i], int)), default=-1)
        return (len(members), -spread, top_epoch, -members[0])

    reference = max(classes, key=rank)
    return ReplicaVerdict(frozenset(i for members in classes if members is not reference for i in members))
