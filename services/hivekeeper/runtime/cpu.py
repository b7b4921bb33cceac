"""The cores a role is given, for its torch thread count: its container's CPU limit (the
cgroup's quota), else the CPU its spec requests, never more than the CPUs it may run on.
Pods carry only requests, so on a cluster without limits the request decides; locally
(`hivekeeper up`) the roles share the machine, and the request keeps them from crowding it."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Optional, Union

from hivekeeper.spec.quantity import quantity_value

CGROUP = Path("/sys/fs/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP) -> Optional[float]:
    """The CPU limit in cores of this process's cgroup (v2 `cpu.max`, or v1's CFS quota), or None."""
    try:
        quota, period = (root / "cpu.max").read_text().split()[:2]  # "max 100000" when unlimited
        return None if quota == "max" else int(quota) / int(period)
    except (OSError, ValueError):
        pass
    try:
        quota = int((root / "cpu" / "cpu.cfs_quota_us").read_text())
        period = int((root / "cpu" / "cpu.cfs_period_us").read_text())
        return None if quota <= 0 or period <= 0 else quota / period
    except (OSError, ValueError):
        return None


def usable_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def cores_given(requested: Union[int, str, None], root: Path = CGROUP) -> int:
    """Whole cores (at least 1) for a role that requested `requested` CPU (a Kubernetes quantity)."""
    bounds = [float(usable_cpus())]
    limit = cgroup_cpu_limit(root)
    if limit is not None:
        bounds.append(limit)
    if requested is not None:
        bounds.append(quantity_value(requested))
    return max(1, math.ceil(min(bounds) - 1e-9))


def torch_threads(explicit: Optional[int], requested: Union[int, str, None]) -> int:
    """`explicit` when the spec sets it, else the cores given."""
    return explicit if explicit is not None else cores_given(requested)
