"""A resource's .status, for every kind: role counts from its workloads, phase and conditions,
and live figures. One function (`resource_status`); what a kind shows beyond counts is a hook
(`FIGURES`): the Swarm's monitor figures, or by default the fields of the kind's status model
found in its reporter's /status (a BlockServer's blocks, an ExpertPool's experts) and, once the
run is over, in its final report."""

from __future__ import annotations

from typing import Any, Callable

from pydantic import ValidationError

from hivekeeper.kinds import runtime
from hivekeeper.spec.crd import KINDS, LabStatus, RoleStatus

from hivekeeper_operator.conditions import Cond, render_conditions, seconds_in_state
from hivekeeper_operator.plan import JOB_BACKOFF_LIMIT, Component, Plan, scaled_component
from hivekeeper_operator.pods import CONFIG_HASH, WorkloadSettings, selector

Workloads = dict[str, "dict[str, Any] | None"]  # component -> its live StatefulSet or Job
# (kind, reading or None, previous status, now) -> status figures; None keeps the previous ones
Figures = Callable[[str, "dict[str, Any] | None", dict[str, Any], str], dict[str, Any]]
# Fields that are never figures from a reading.
LIVE_FIGURES_EXCLUDED = {"observedGeneration", "phase", "conditions", "readyPeers", "selector", "initialPeers",
                         "volunteerGateway", "volunteerRelays"}


# -- workloads ----------------------------------------------------------------------------------


def job_finished(job: dict[str, Any] | None) -> str | None:
    """'Complete' or 'Failed' when a Job has that condition, else None."""
    for cond in ((job or {}).get("status") or {}).get("conditions") or []:
        if cond.get("type") in ("Complete", "Failed") and cond.get("status") == "True":
            return cond["type"]
    return None


def _indexes(text: str) -> set[int]:
    """Kubernetes' completedIndexes ("0,2-4") as a set."""
    out: set[int] = set()
    for part in filter(None, text.split(",")):
        first, _, last = part.partition("-")
        out.update(range(int(first), int(last or first) + 1))
    return out


def run_completed(plan: Plan, jobs: Workloads) -> bool:
    """Every role that ends the run has succeeded (its index is among its Job's completed
    ones), in a Job of the current configuration (a Job of an older one is replaced instead)."""
    enders = [c for c in plan.components if c.job]
    for component in enders:
        job = jobs.get(component.name) or {}
        template = (job.get("spec") or {}).get("template") or {}
        if ((template.get("metadata") or {}).get("annotations") or {}).get(CONFIG_HASH) != plan.hashes[component.name]:
            return False
        done = _indexes((job.get("status") or {}).get("completedIndexes") or "")
        if job_finished(job) != "Complete" and not all(r.index in done for r in component.roles if r.completes_run):
            return False
    return bool(enders)


def role_counts(component: Component, workload: dict[str, Any] | None, completed: bool) -> dict[str, int]:
    desired = 0 if completed else component.replicas
    status = (workload or {}).get("status") or {}
    if not component.job:
        return {"desired": desired, "replicas": int(status.get("replicas") or 0),
                "ready": int(status.get("readyReplicas") or 0)}
    if job_finished(workload) == "Complete":
        return {"desired": desired, "replicas": 0, "ready": 0}
    return {"desired": desired, "replicas": int(status.get("active") or 0), "ready": int(status.get("ready") or 0)}


def rolling_out(workload: dict[str, Any] | None, desired: int) -> bool:
    """A StatefulSet whose controller has not caught up with its spec or its template yet."""
    if workload is None:
        return desired > 0
    meta, status = workload.get("metadata") or {}, workload.get("status") or {}
    if int(status.get("observedGeneration") or 0) < int(meta.get("generation") or 1):
        return True
    return int(status.get("updatedReplicas") or 0) < desired


# -- phase and conditions -----------------------------------------------------------------------


def invalid_status(generation: int | None, previous: dict[str, Any] | None, now: str, message: str,
                   reason: str = "InvalidSpec") -> dict[str, Any]:
    """The status of a resource whose spec failed validation: children are left as they were."""
    return {"observedGeneration": generation, "phase": "Invalid", "conditions": render_conditions([
        Cond("Ready", False, reason, message),
        Cond("Progressing", False, reason, "nothing was changed"),
        Cond("Degraded", True, reason, message),
    ], (previous or {}).get("conditions"), generation, now)}


def not_joined_status(generation: int | None, previous: dict[str, Any] | None, now: str, joined: Cond,
                      stopped: bool) -> dict[str, Any]:
    """The status of a joining resource that is not admitted (its Joined condition says why).
    `stopped`: its peers were stopped, so it is Pending; otherwise (a gateway that does not
    answer) its peers run on and retry, and the rest of the status stays as it was."""
    previous = previous or {}
    if not stopped:
        kept = [Cond(c["type"], {"True": True, "False": False}.get(c.get("status")), c.get("reason", ""),
                     c.get("message", "")) for c in previous.get("conditions") or [] if c.get("type") != joined.type]
        return {"observedGeneration": generation, "phase": previous.get("phase", "Pending"),
                "conditions": render_conditions([*kept, joined], previous.get("conditions"), generation, now)}
    return {"observedGeneration": generation, "phase": "Pending", "conditions": render_conditions([
        Cond("Ready", False, joined.reason, "this lab's peers were stopped: " + joined.message),
        Cond("Progressing", False, joined.reason, "waiting to be admitted"),
        Cond("Degraded", True, joined.reason, joined.message),
        joined,
    ], previous.get("conditions"), generation, now)}


def lifecycle(*, previous: dict[str, Any], generation: int | None, now: str, settings: WorkloadSettings,
              completed: bool, failed: str | None, running: bool, not_ready: list[str], rolling: list[str],
              ready_total: int, desired_total: int, error: str | None, error_reason: str,
              extra: tuple[Cond, ...] = ()) -> dict[str, Any]:
    """phase and the Ready / Progressing / Degraded conditions, and `extra` ones (Joined)."""
    if completed:
        phase = "Succeeded"
        ready = Cond("Ready", False, "Completed", "the run is done; peers were stopped")
        progressing = Cond("Progressing", False, "Completed", "")
    elif failed:
        phase = "Failed"
        ready = Cond("Ready", False, "JobFailed", failed)
        progressing = Cond("Progressing", False, "JobFailed", "")
    else:
        phase = "Running" if running else "Pending"
        if not_ready:
            ready = Cond("Ready", False, "PeersNotReady", "not ready: " + ", ".join(not_ready))
        else:
            ready = Cond("Ready", True, "AllPeersReady", f"{ready_total}/{desired_total} pods ready")
        if rolling:
            progressing = Cond("Progressing", True, "RollingOut", "updating: " + ", ".join(rolling))
        elif not_ready:
            progressing = Cond("Progressing", True, "WaitingForPeers", "starting: " + ", ".join(not_ready))
        else:
            progressing = Cond("Progressing", False, "Stable", "every role runs its current configuration")

    if error:
        degraded = Cond("Degraded", True, error_reason, error)
    elif failed:
        degraded = Cond("Degraded", True, "JobFailed", failed)
    elif progressing.status and seconds_in_state(previous, "Progressing", "True", now) > settings.progress_deadline_seconds:
        degraded = Cond("Degraded", True, "ProgressDeadlineExceeded",
                        f"no steady state after {int(settings.progress_deadline_seconds)}s: {progressing.message}")
    else:
        degraded = Cond("Degraded", False, "AsExpected", "")
    return {"phase": phase,
            "conditions": render_conditions([ready, progressing, degraded, *extra], previous.get("conditions"),
                                            generation, now)}


# -- figures ------------------------------------------------------------------------------------


def model_figures(kind: str, reading: dict[str, Any] | None, previous: dict[str, Any], now: str) -> dict[str, Any]:
    """Fields of the kind's status model found in a reading (the last ones stay while there is
    none); a value the model refuses is dropped, not written."""
    model = KINDS[kind].status_model
    keys = [f.alias or n for n, f in model.model_fields.items()
            if (f.alias or n) not in LIVE_FIGURES_EXCLUDED
            and RoleStatus not in getattr(f.annotation, "__args__", (f.annotation,))]  # counts are not figures
    if not reading:
        return {k: previous[k] for k in keys if k in previous}
    out = {}
    for key in (k for k in keys if k in reading):
        try:
            model.model_validate({key: reading[key]})
        except ValidationError:
            continue
        out[key] = reading[key]
    return out


def monitor_figures(kind: str, reading: dict[str, Any] | None, previous: dict[str, Any], now: str) -> dict[str, Any]:
    """A Swarm monitor's /status, rounded (a status write per digit would be churn), with the
    balancer's planned rate; the last reading stays while the monitor does not answer."""
    keys = ("globalStep", "samplesPerSecond", "achievedStepsPerSecond", "predictedStepsPerSecond", "efficiency",
            "outerSteps", "loss", "evalMetrics", "peersAlive", "labs")
    if not reading:
        return {k: previous[k] for k in keys + ("lastMonitorUpdate",) if k in previous}

    def number(value: Any) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool)

    figures: dict[str, Any] = {}
    for key in ("globalStep", "outerSteps"):
        if isinstance(reading.get(key), int) and not isinstance(reading[key], bool):
            figures[key] = max(0, reading[key])
    predicted = (reading.get("plan") or {}).get("stepsPerSecond") if isinstance(reading.get("plan"), dict) else None
    achieved = reading.get("achievedStepsPerSecond", reading.get("stepsPerSecond"))  # an earlier monitor says the latter
    for key, value, digits in (("samplesPerSecond", reading.get("samplesPerSecond"), 1),
                               ("achievedStepsPerSecond", achieved, 4),
                               ("predictedStepsPerSecond", predicted, 4)):
        if number(value):
            figures[key] = round(max(0.0, float(value)), digits)
    if figures.get("predictedStepsPerSecond") and "achievedStepsPerSecond" in figures:
        figures["efficiency"] = round(figures["achievedStepsPerSecond"] / figures["predictedStepsPerSecond"], 2)
    if number(reading.get("loss")):
        figures["loss"] = round(float(reading["loss"]), 6)
    if isinstance(reading.get("evalMetrics"), dict):
        figures["evalMetrics"] = {k: float(v) for k, v in reading["evalMetrics"].items() if number(v)}
    if isinstance(reading.get("peersAlive"), dict):
        figures["peersAlive"] = {k: int(v) for k, v in reading["peersAlive"].items() if isinstance(v, int)}
    if isinstance(reading.get("labs"), list):
        figures["labs"] = [lab for lab in reading["labs"] if _valid(LabStatus, lab)]
    changed = any(previous.get(k) != v for k, v in figures.items())
    figures["lastMonitorUpdate"] = now if changed or "lastMonitorUpdate" not in previous else previous["lastMonitorUpdate"]
    return figures


def _valid(model: Any, value: Any) -> bool:
    try:
        model.model_validate(value)
    except ValidationError:
        return False
    return True


FIGURES: dict[str, Figures] = {"Swarm": monitor_figures}  # every other kind: model_figures


def report_reading(report: dict[str, Any]) -> dict[str, Any]:
    """A finished role's final report (`readers.final_report_of`) as a reading."""
    reading = {"step": report.get("globalStep"), "globalStep": report.get("globalStep"),
               "evalMetrics": report.get("metrics"), "loss": report.get("loss"), "outerSteps": report.get("outerSteps")}
    return {k: v for k, v in reading.items() if v is not None}


# -- the status ---------------------------------------------------------------------------------


def resource_status(*, kind: str, generation: int | None, previous: dict[str, Any] | None, now: str, plan: Plan,
                    workloads: Workloads, name: str, reading: dict[str, Any] | None = None,
                    reports: list[dict[str, Any]] = (), completed: bool = False, error: str | None = None,
                    error_reason: str = "ReconcileError",
                    settings: WorkloadSettings = WorkloadSettings(), extra: tuple[Cond, ...] = ()) -> dict[str, Any]:
    """The whole .status of a resource. `reading`: its reporter's /status; `reports`: the final
    reports of the roles that ended the run; `extra`: conditions besides the lifecycle's."""
    previous = previous or {}
    status: dict[str, Any] = {"observedGeneration": generation}
    counts = {c.status_key: role_counts(c, workloads.get(c.name), completed) for c in plan.components}
    for key in runtime(kind).status_keys.values():  # a component switched off shows as none wanted
        counts.setdefault(key, {"desired": 0, "replicas": 0, "ready": 0})
    status.update(counts)
    desired_total = sum(c["desired"] for c in counts.values())
    ready_total = sum(min(c["ready"], c["desired"]) for c in counts.values())
    status["readyPeers"] = f"{ready_total}/{desired_total}"
    scaled = scaled_component(plan, kind)
    if scaled is not None:
        status["selector"] = selector(name, scaled.name)
    status["initialPeers"] = plan.initial_peers
    if plan.volunteer_gateway:
        status["volunteerGateway"] = plan.volunteer_gateway
    if plan.volunteer_relays:
        status["volunteerRelays"] = plan.volunteer_relays

    failed = next((c for c in plan.components if c.job and job_finished(workloads.get(c.name)) == "Failed"), None)
    backbone_ready = all(counts[c.status_key]["ready"] >= 1 for c in plan.components if c.backbone)
    needed = next((c for c in plan.components if c.name == runtime(kind).running_component), None)
    needed_counts = counts.get(needed.status_key) if needed is not None else None
    status.update(lifecycle(
        previous=previous, generation=generation, now=now, settings=settings, completed=completed,
        failed=f"{failed.status_key} failed {JOB_BACKOFF_LIMIT} times" if failed else None,
        running=backbone_ready and ready_total > 0 and (not needed_counts or needed_counts["ready"] >= 1
                                                        or needed_counts["desired"] == 0),
        not_ready=[f"{key} {c['ready']}/{c['desired']}" for key, c in counts.items() if c["ready"] < c["desired"]],
        rolling=[c.status_key for c in plan.components
                 if not c.job and rolling_out(workloads.get(c.name), 0 if completed else c.replicas)],
        ready_total=ready_total, desired_total=desired_total, error=error, error_reason=error_reason, extra=extra))
    figures = FIGURES.get(kind, model_figures)
    status.update(figures(kind, reading, previous, now))
    for report in reports:  # the run's last figures, over the last live reading
        status.update(figures(kind, report_reading(report), previous, now))
    return status
