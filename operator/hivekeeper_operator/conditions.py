"""Kubernetes-style status conditions, shared by every kind: a condition's lastTransitionTime
moves only when its status does, so a status that describes the same state twice is written
once."""

from __future__ import annotations

import datetime
from dataclasses import dataclass
from typing import Any


def now_rfc3339() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def parse_rfc3339(value: str | None) -> datetime.datetime | None:
    if not value:
        return None
    try:
        return datetime.datetime.strptime(value, "%Y-%m-%dT%H:%M:%SZ").replace(tzinfo=datetime.timezone.utc)
    except ValueError:
        return None


@dataclass(frozen=True)
class Cond:
    type: str
    status: bool | None  # None: Unknown
    reason: str
    message: str = ""

    @property
    def status_text(self) -> str:
        return "Unknown" if self.status is None else ("True" if self.status else "False")


def render_conditions(conditions: list[Cond], previous: list[dict[str, Any]] | None, generation: int | None,
                      now: str) -> list[dict[str, Any]]:
    """metav1.Condition dicts; a condition whose status is unchanged keeps its transition time."""
    before = {c.get("type"): c for c in previous or []}
    out = []
    for cond in conditions:
        old = before.get(cond.type) or {}
        changed = old.get("status") != cond.status_text
        item = {"type": cond.type, "status": cond.status_text, "reason": cond.reason, "message": cond.message,
                "lastTransitionTime": now if changed or not old.get("lastTransitionTime") else old["lastTransitionTime"]}
        if generation is not None:
            item["observedGeneration"] = generation
        out.append(item)
    return out


def condition(status: dict[str, Any] | None, type_: str) -> dict[str, Any] | None:
    return next((c for c in (status or {}).get("conditions") or [] if c.get("type") == type_), None)


def seconds_in_state(status: dict[str, Any] | None, type_: str, state: str, now: str) -> float:
    """How long a condition has had `state` ("True"/"False"), per the previous status; 0 if not."""
    cond = condition(status, type_)
    if not cond or cond.get("status") != state:
        return 0.0
    since, current = parse_rfc3339(cond.get("lastTransitionTime")), parse_rfc3339(now)
    if since is None or current is None:
        return 0.0
    return max(0.0, (current - since).total_seconds())
