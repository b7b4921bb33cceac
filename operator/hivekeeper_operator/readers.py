"""Reading a resource's live figures. The operator asks its reporter's /status (the same JSON
`hivekeeper status` shows locally: a Swarm's monitor, another kind's first backbone peer, which
sums up what the peers announce); tests pass their own reader instead.

Once the run is over the reporter no longer answers, and its last /status reading predates the
final evaluation: the run's final figures are in the role's result.json, which the pod launcher
puts in the container's termination message (`final_report_message`) and the operator reads
back from the Job's pod (`final_report_of`)."""

from __future__ import annotations

import json
import logging
import urllib.error
import urllib.request
from typing import Any, Callable, Optional

from hivekeeper_operator.network import METRICS_PORT

log = logging.getLogger("hivekeeper.operator")

# (namespace, resource name, URL) -> the reporter's /status JSON, or None if it does not answer
StatusReader = Callable[[str, str, str], Optional[dict[str, Any]]]


def status_url(name: str, namespace: str, cluster_domain: str, component: str, job: bool) -> str:
    """A Job's pods have no stable names: ask its Service; a StatefulSet's: ask pod 0."""
    service = f"{name}-{component}.{namespace}.svc.{cluster_domain}"
    host = service if job else f"{name}-{component}-0.{service}"
    return f"http://{host}:{METRICS_PORT}/status"


def http_status_reader(timeout: float = 2.0) -> StatusReader:
    def read(namespace: str, name: str, url: str) -> dict[str, Any] | None:
        try:
            with urllib.request.urlopen(url, timeout=timeout) as response:  # noqa: S310 (cluster-internal URL)
                value = json.loads(response.read())
                return value if isinstance(value, dict) else None
        except (OSError, urllib.error.URLError, ValueError) as e:
            log.debug("status unavailable", extra={"fields": {"url": url, "error": str(e)}})
            return None

    return read


FINAL_REPORT = "finalReport"  # the key that marks a termination message as a final report
MESSAGE_LIMIT = 4096  # bytes of a termination message the kubelet keeps


def final_report_message(result: dict[str, Any]) -> str:
    """A role's result.json, cut to the figures a status shows (its loss curve would not fit)."""
    report: dict[str, Any] = {k: result[k] for k in ("globalStep", "reason", "metrics", "outerSteps") if k in result}
    if isinstance(report.get("reason"), str):
        report["reason"] = report["reason"][:200]
    losses = result.get("losses") if isinstance(result.get("losses"), dict) else {}
    steps = [int(k) for k in losses if str(k).isdigit()]
    if steps:
        report["loss"], report["lossStep"] = losses[str(max(steps))], max(steps)
    text = json.dumps({FINAL_REPORT: report}, separators=(",", ":"))
    if len(text.encode()) > MESSAGE_LIMIT:  # many metrics: keep the step and the loss
        text = json.dumps({FINAL_REPORT: {k: v for k, v in report.items() if k in ("globalStep", "loss", "lossStep", "outerSteps")}})
    return text


def parse_final_report(message: str | None) -> dict[str, Any] | None:
    try:
        value = json.loads(message or "")
    except ValueError:
        return None
    report = value.get(FINAL_REPORT) if isinstance(value, dict) else None
    return report if isinstance(report, dict) else None


def final_report_of(pods: list[dict[str, Any]], job_uid: str | None) -> dict[str, Any] | None:
    """The final report of the Job's pod that succeeded (the latest, should there be several)."""
    found: list[tuple[str, dict[str, Any]]] = []
    for pod in pods:
        owners = (pod.get("metadata") or {}).get("ownerReferences") or []
        if not any(o.get("uid") == job_uid for o in owners):
            continue
        for container in (pod.get("status") or {}).get("containerStatuses") or []:
            terminated = (container.get("state") or {}).get("terminated") or {}
            report = parse_final_report(terminated.get("message")) if terminated.get("exitCode") == 0 else None
            if report is not None:
                found.append((terminated.get("finishedAt") or "", report))
    return max(found, key=lambda item: item[0])[1] if found else None

