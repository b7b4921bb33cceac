"""Live progress of a local run: the collaboration's figures from the monitor's /status, and
each process with its state, restarts and metrics address. A table that refreshes on a
terminal; one line every few seconds otherwise (CI logs, pipes)."""

from __future__ import annotations

import json
import time
import urllib.request
from typing import Any, Optional

from rich.console import Console, Group
from rich.live import Live
from rich.table import Table

from hivekeeper.local.supervisor import Supervisor


def fetch_status(port: int, timeout: float = 1.0, host: str = "127.0.0.1") -> Optional[dict[str, Any]]:
    try:
        with urllib.request.urlopen(f"http://{host}:{port}/status", timeout=timeout) as reply:
            return json.loads(reply.read())
    except (OSError, ValueError):
        return None


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec else str(value)


def describe_round(last_round: Optional[dict[str, Any]]) -> str:
    if not last_round:
        return "-"
    ago = time.time() - last_round.get("time", time.time())
    return f"{last_round['outcome']} ({last_round['groupSize']} peers, {last_round['seconds']:.2f}s, {ago:.0f}s ago)"


def describe_plan(plan: Optional[dict[str, Any]], achieved: Optional[float]) -> str:
    """The balancer's plan in one line: predicted vs achieved steps/s (efficiency), where a
    predicted step's time goes, the roles."""
    if not plan:
        return "-"
    predicted = plan["stepsPerSecond"]
    efficiency = f" (efficiency {achieved / predicted:.2f})" if achieved is not None and predicted else ""
    text = f"{predicted:.3f} steps/s predicted, achieved {_fmt(achieved, '.3f')}{efficiency}; "
    step = plan.get("step")
    if step:  # the full model: compute, transfer and the fixed costs the peers measured
        fixed = step["fixed"]
        text += (f"a step {step['seconds']:.3f} s = compute {step['compute']:.3f} + transfer {step['transfer']:.3f}"
                 f" + fixed {sum(fixed.values()):.3f} ({', '.join(f'{k} {v:.3f}' for k, v in fixed.items())}); ")
    else:
        unbounded = not plan["aggregationBound"]  # nothing to exchange: a lone trainer
        bound = "compute" if unbounded or plan["computeBound"] <= plan["aggregationBound"] else "aggregation"
        text += f"{bound}-bound, fixed costs not measured yet; "
    aggregators = [p for p in plan["peers"] if p["share"] > 0]
    only = [p["name"] for p in plan["peers"] if not p["computesGradients"]]
    text += f"{len(aggregators)} aggregators, shares " + " ".join(f"{p['name']}={p['share']:.2f}" for p in aggregators)
    return text + (f"; aggregate only: {', '.join(only)}" if only else "")


LOW_EFFICIENCY = 0.5
LOW_EFFICIENCY_SECONDS = 60.0


class EfficiencyWatch:
    """Warns once the swarm has achieved under half the plan's steps/s for a minute, naming the
    largest cost of the plan's step (issue 20: a gap nobody explains reads as a broken product)."""

    def __init__(self) -> None:
        self.low_since: Optional[float] = None

    def warning(self, status: Optional[dict[str, Any]], now: float) -> Optional[str]:
        efficiency = (status or {}).get("efficiency")
        if efficiency is None or efficiency >= LOW_EFFICIENCY:
            self.low_since = None
            return None
        self.low_since = self.low_since if self.low_since is not None else now
        if now - self.low_since < LOW_EFFICIENCY_SECONDS:
            return None
        step = (status.get("plan") or {}).get("step")
        cost = ""
        if step:
            parts = {"compute": step["compute"], "transfer": step["transfer"], **step["fixed"]}
            name, seconds = max(parts.items(), key=lambda item: item[1])
            cost = f"; the plan's largest cost per step is {name} ({seconds:.3f} s of {step['seconds']:.3f} s)"
        return (f"efficiency {efficiency:.2f}: the swarm has made under {LOW_EFFICIENCY:.0%} of the plan's steps/s "
                f"for {now - self.low_since:.0f} s{cost} (restarts, failed rounds and state loads are not in the plan)")


class ProgressView:
    def __init__(self, name: str, supervisor: Supervisor, target_steps: Optional[int], console: Console | None = None):
        self.name = name
        self.supervisor = supervisor
        self.target_steps = target_steps
        self.console = console or Console(stderr=True)
        self.interactive = self.console.is_terminal
        self._live: Optional[Live] = None
        self._last_line = 0.0
        self.started = time.monotonic()
        self.seen_status = False  # the monitor answered once: silence after that is the run ending
        self.efficiency = EfficiencyWatch()

    def __enter__(self) -> "ProgressView":
        if self.interactive:
            self._live = Live(console=self.console, refresh_per_second=2, transient=False)
            self._live.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._live is not None:
            self._live.__exit__(*exc)

    def update(self, status: Optional[dict[str, Any]]) -> None:
        self.seen_status = self.seen_status or bool(status)
        warning = self.efficiency.warning(status, time.monotonic()) if status else None
        if self._live is not None:
            self._live.update(self._render(status, warning))
        elif time.monotonic() - self._last_line >= 5.0:
            self._last_line = time.monotonic()
            self.console.print(self._line(status), highlight=False, soft_wrap=True)
            if warning:
                self.console.print(f"warning: {warning}", style="yellow", highlight=False, soft_wrap=True)

    def _line(self, status: Optional[dict[str, Any]]) -> str:
        elapsed = time.monotonic() - self.started
        if not status:
            return f"[{elapsed:5.0f}s] {self.name}: {self._waiting()} ({self._process_summary()})"
        peers = status.get("peersAlive", {})
        evals = " ".join(f"{k}={v:.4f}" for k, v in (status.get("evalMetrics") or {}).items())
        return (
            f"[{elapsed:5.0f}s] step {status['globalStep']}{self._of_target()}  loss {_fmt(status.get('loss'), '.4f')}  "
            f"{status.get('samplesPerSecond', 0):.0f} samples/s  peers {sum(peers.values())}  "
            f"eval@{status.get('evalStep')} {evals or '-'}  restarts {self.supervisor.restarts}"
            + (f"  outer steps {status['outerSteps']}" if status.get("outerSteps") is not None else "")
            + (f"  {status['achievedStepsPerSecond']:.3f} steps/s" if status.get("achievedStepsPerSecond") else "")
            + (f"  plan {status['plan']['stepsPerSecond']:.3f} steps/s" if status.get("plan") else "")
            + (f"  efficiency {status['efficiency']:.2f}" if status.get("efficiency") is not None else "")
        )

    def _waiting(self) -> str:
        """No status from the monitor: it has not started yet, or it has finished the run (its
        final evaluation and report) and stopped answering."""
        return "finishing" if self.seen_status else "starting"

    def _of_target(self) -> str:
        return f"/{self.target_steps}" if self.target_steps else ""

    def _process_summary(self) -> str:
        states = [child.state for child in self.supervisor.children]
        return ", ".join(f"{states.count(s)} {s}" for s in sorted(set(states)))

    def _render(self, status: Optional[dict[str, Any]], warning: Optional[str] = None) -> Group:
        summary = Table.grid(padding=(0, 2))
        summary.add_column(style="bold")
        summary.add_column()
        elapsed = time.monotonic() - self.started
        summary.add_row("swarm", f"{self.name}  ({elapsed:.0f}s)")
        if status:
            summary.add_row("global step", f"{status['globalStep']}{self._of_target()}")
            summary.add_row("loss", _fmt(status.get("loss"), ".4f"))
            summary.add_row("samples/s", f"{status.get('samplesPerSecond', 0):.0f} (whole collaboration)")
            summary.add_row("peers alive", ", ".join(f"{n} {r}" for r, n in sorted(status.get("peersAlive", {}).items())))
            summary.add_row("last averaging", describe_round(status.get("lastRound")))
            if status.get("outerSteps") is not None:  # replicas that train alone
                summary.add_row("outer steps / merges", str(status["outerSteps"]))
            if status.get("averagingBytesSentPerTrainer") is not None:
                summary.add_row("sent per trainer", f"{status['averagingBytesSentPerTrainer'] / 1e6:.1f} MB")
            summary.add_row("averaging plan", describe_plan(status.get("plan"), status.get("stepsPerSecond")))
            if status.get("efficiency") is not None:
                summary.add_row("efficiency", f"{status['efficiency']:.2f} (achieved / predicted steps/s)")
            if warning:
                summary.add_row("warning", f"[yellow]{warning}[/yellow]")
            evals = ", ".join(f"{k} {v:.4f}" for k, v in (status.get("evalMetrics") or {}).items())
            summary.add_row("held-out", f"{evals or '-'} (step {status.get('evalStep')})")
        else:
            summary.add_row("status", self._waiting())
        processes = Table(title=None, box=None, header_style="bold dim")
        for column in ("process", "pid", "state", "restarts", "metrics"):
            processes.add_column(column)
        for child in self.supervisor.children:
            pid = str(child.process.pid) if child.process is not None else "-"
            url = f"http://{self.supervisor.host}:{child.role.ports['metrics']}/metrics"
            processes.add_row(child.role.name, pid, child.state, str(child.restarts), url)
        return Group(summary, processes)
