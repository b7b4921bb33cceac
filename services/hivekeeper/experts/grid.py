"""The expert grid: uids PREFIX.u0.u1...u(d-1) (Learning@home 3.2) and how the hosted experts
are spread over the server replicas. Pure functions: the servers, the trainer and the operator
compute the same assignment from the spec."""

from __future__ import annotations

import itertools
import math
from typing import Sequence

from hivekeeper.spec.expertpool import ExpertPoolSpec
from hivekeeper.topology import VOLUNTEER_INDEX

UID_DELIMITER = "."  # hivemind.moe's: the DHT stores every prefix of a uid split at it


def grid_uids(prefix: str, dimensions: Sequence[int]) -> list[str]:
    """Every uid of the grid, in row-major order."""
    return [UID_DELIMITER.join([prefix, *map(str, cell)]) for cell in itertools.product(*map(range, dimensions))]


def uid_coordinates(uid: str, prefix: str, dimensions: Sequence[int]) -> tuple[int, ...] | None:
    """The grid cell of `uid`, or None if it is not a uid of this grid."""
    head, _, rest = uid.partition(UID_DELIMITER)
    parts = rest.split(UID_DELIMITER) if rest else []
    if head != prefix or len(parts) != len(dimensions) or not all(p.isdigit() for p in parts):
        return None
    cell = tuple(int(p) for p in parts)
    return cell if all(0 <= c < m for c, m in zip(cell, dimensions)) else None


def assign_experts(uids: Sequence[str], replicas: int, experts_per_server: int | None = None) -> list[list[str]]:
    """Which uids each server holds: round-robin over the grid in row-major order, so the experts
    of every first-dimension prefix are spread over all servers and losing one server never
    empties a prefix the beam search starts from. Cells beyond replicas x expertsPerServer stay
    free (room for more servers later)."""
    per_server = experts_per_server or math.ceil(len(uids) / replicas)
    hosted = list(uids)[: per_server * replicas]
    return [hosted[index::replicas] for index in range(replicas)]


def pool_assignment(spec: ExpertPoolSpec) -> list[list[str]]:
    uids = grid_uids(spec.grid.uid_prefix, spec.grid.dimensions)
    return assign_experts(uids, spec.servers.replicas, spec.servers.experts_per_server)


def server_experts(spec: ExpertPoolSpec, index: int) -> list[str]:
    """The uids server `index` holds; a replacement with the same index resumes the same experts.
    A volunteer's server (index VOLUNTEER_INDEX and up) holds free cells: `volunteer_experts`."""
    if index >= VOLUNTEER_INDEX:
        return volunteer_experts(spec, index)
    assignment = pool_assignment(spec)
    if not 0 <= index < len(assignment):
        raise ValueError(f"server index {index} is outside servers.replicas ({spec.servers.replicas})")
    return assignment[index]


def volunteer_experts(spec: ExpertPoolSpec, index: int) -> list[str]:
    """What a volunteer's server holds: the grid's free cells (those beyond the servers' share),
    cut into shares of expertsPerServer spread like the servers' own; its index picks one. None
    when the servers hold the whole grid."""
    free = grid_uids(spec.grid.uid_prefix, spec.grid.dimensions)[spec.hosted_experts:]
    shares = math.ceil(len(free) / (spec.servers.experts_per_server or len(free) or 1))
    return free[index % shares::shares] if free else []
