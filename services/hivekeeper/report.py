"""`hivekeeper report RUN_DIR`: plots and a short Markdown summary of a local run, finished or
running, from what the monitor writes each second (RUN_DIR/history.jsonl) and the summary.

Writes RUN_DIR/report/: loss.png (training loss and held-out metrics against step and time),
throughput.png (collaboration samples/s and steps/s), rounds.png (averaging round durations by
outcome, group sizes), peers.png (peers alive by role), and report.md linking them."""

from __future__ import annotations

import json
import math
import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hivekeeper.errors import UserError

COLORS = {"backbone": "#7f7f7f", "trainer": "#1f77b4", "auxiliary": "#2ca02c", "monitor": "#9467bd",
          "balancer": "#ff7f0e", "success": "#2ca02c", "failure": "#d62728", "skipped": "#7f7f7f"}


@dataclass
class RunHistory:
    """The monitor's once-a-second snapshots, as columns."""

    name: str
    entries: list[dict[str, Any]]
    summary: dict[str, Any] = field(default_factory=dict)

    def series(self, key: str) -> tuple[list[float], list[float]]:
        """(elapsed seconds, value) where the value is a finite number."""
        return _finite([(e["elapsedSeconds"], e.get(key)) for e in self.entries])

    def by_step(self, key: str, step_key: str) -> tuple[list[float], list[float]]:
        seen: dict[float, float] = {}
        for entry in self.entries:
            step, value = entry.get(step_key), entry.get(key)
            if isinstance(step, (int, float)) and step >= 0 and _is_number(value):
                seen[step] = value
        steps = sorted(seen)
        return steps, [seen[s] for s in steps]

    def eval_metrics(self) -> dict[str, tuple[list[float], list[float]]]:
        out: dict[str, dict[float, float]] = {}
        for entry in self.entries:
            step = entry.get("evalStep")
            for name, value in (entry.get("evalMetrics") or {}).items():
                if isinstance(step, (int, float)) and step >= 0 and _is_number(value):
                    out.setdefault(name, {})[step] = value
        return {name: (sorted(points), [points[s] for s in sorted(points)]) for name, points in out.items()}

    def rounds(self) -> list[dict[str, Any]]:
        """Distinct averaging rounds (or merges) the monitor saw, by their end time."""
        seen: dict[float, dict[str, Any]] = {}
        for entry in self.entries:
            last = entry.get("lastRound")
            if isinstance(last, dict) and _is_number(last.get("time")) and _is_number(last.get("seconds")):
                seen[last["time"]] = last
        return [seen[t] for t in sorted(seen)]

    def peers(self) -> dict[str, tuple[list[float], list[float]]]:
        roles = sorted({role for e in self.entries for role in (e.get("peersAlive") or {})})
        return {role: ([e["elapsedSeconds"] for e in self.entries],
                       [float((e.get("peersAlive") or {}).get(role, 0)) for e in self.entries]) for role in roles}


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _finite(points: list[tuple[Any, Any]]) -> tuple[list[float], list[float]]:
    kept = [(x, y) for x, y in points if _is_number(x) and _is_number(y)]
    return [x for x, _ in kept], [y for _, y in kept]


def load_history(run_dir: Path) -> RunHistory:
    path = run_dir / "history.jsonl"
    if not path.exists():
        raise UserError(f"{run_dir}: no history.jsonl (not a run directory, or the monitor has not started)")
    entries = []
    for line in path.read_text().splitlines():
        try:
            entry = json.loads(line)
        except ValueError:
            continue  # a line cut short by a kill
        if isinstance(entry, dict) and _is_number(entry.get("elapsedSeconds")):
            entries.append(entry)
    if not entries:
        raise UserError(f"{path}: no snapshots yet")
    summary, manifest = run_dir / "summary.json", run_dir / "manifest.json"
    name = json.loads(manifest.read_text())["metadata"]["name"] if manifest.exists() else run_dir.name
    return RunHistory(name=name, entries=entries, summary=json.loads(summary.read_text()) if summary.exists() else {})


def write_report(run_dir: Path, out_dir: Path | None = None) -> list[Path]:
    try:
        import matplotlib
    except ImportError:
        raise UserError("hivekeeper report needs matplotlib: pip install -e '.[report]'") from None
    matplotlib.use("Agg")
    history = load_history(run_dir)
    out = out_dir or run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    paths = [plot(history, out) for plot in (_plot_loss, _plot_throughput, _plot_rounds, _plot_peers)]
    return paths + [_markdown(history, out, paths)]


def _figure(title: str, columns: int = 2):
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, columns, figsize=(6 * columns, 4), constrained_layout=True)
    fig.suptitle(title, fontsize=13)
    return fig, (axes if columns > 1 else [axes])


def _save(fig, path: Path) -> Path:
    import matplotlib.pyplot as plt

    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _empty(ax, what: str) -> None:
    ax.text(0.5, 0.5, f"no {what} yet", ha="center", va="center", transform=ax.transAxes, color="#7f7f7f")


def _line(ax, points: tuple[list[float], list[float]], what: str, **style: Any) -> None:
    if points[0]:
        ax.plot(*points, **style)
    else:
        _empty(ax, what)


def _label(ax, title: str | None, xlabel: str, ylabel: str) -> None:
    if title is not None:
        ax.set_title(title)
    ax.set_xlabel(xlabel)
    ax.set_ylabel(ylabel)
    ax.grid(alpha=0.3)


def _plot_loss(history: RunHistory, out: Path) -> Path:
    fig, (by_step, by_time) = _figure(f"{history.name}: loss and held-out metrics")
    steps, losses = history.by_step("loss", "lossStep")
    if steps:
        by_step.plot(steps, losses, color="#1f77b4", label="training loss")
    metrics = history.eval_metrics()
    twin = by_step.twinx() if metrics else None
    for i, (name, (eval_steps, values)) in enumerate(sorted(metrics.items())):
        twin.plot(eval_steps, values, marker="o", markersize=3, linestyle="--",
                  color=["#d62728", "#ff7f0e", "#9467bd"][i % 3], label=f"held-out {name}")
    if twin is not None:
        twin.set_ylabel("held-out metric")
        lines = by_step.get_legend_handles_labels()
        extra = twin.get_legend_handles_labels()
        by_step.legend(lines[0] + extra[0], lines[1] + extra[1], loc="center right", fontsize=8)
    if not steps and not metrics:
        _empty(by_step, "loss")
    _label(by_step, "against step", "global step", "training loss")
    _line(by_time, history.series("loss"), "loss", color="#1f77b4")
    _label(by_time, "against time", "wall time (s)", "training loss")
    return _save(fig, out / "loss.png")


def _plot_throughput(history: RunHistory, out: Path) -> Path:
    fig, (samples, steps) = _figure(f"{history.name}: throughput")
    _line(samples, history.series("samplesPerSecond"), "throughput", color="#1f77b4")
    _label(samples, "collaboration samples/s", "wall time (s)", "samples/s")
    times, step_rates = history.series("stepsPerSecond")
    if times:
        steps.plot(times, step_rates, color="#2ca02c", label="achieved (last minute)")
    planned = [(e["elapsedSeconds"], (e.get("plan") or {}).get("stepsPerSecond")) for e in history.entries]
    planned_times, planned_rates = _finite(planned)
    if planned_times:
        steps.plot(planned_times, planned_rates, color="#ff7f0e", linestyle="--", label="the averaging plan predicts")
    if times or planned_times:
        steps.legend(fontsize=8)
    else:
        _empty(steps, "steps/s")
    _label(steps, "optimizer steps/s", "wall time (s)", "steps/s")
    return _save(fig, out / "throughput.png")


def _plot_rounds(history: RunHistory, out: Path) -> Path:
    fig, (durations, groups) = _figure(f"{history.name}: averaging rounds (as the monitor saw them)")
    rounds = history.rounds()
    start = history.entries[0]["time"] - history.entries[0]["elapsedSeconds"] if "time" in history.entries[0] else 0
    for outcome in ("success", "failure", "skipped"):
        chosen = [r for r in rounds if r.get("outcome") == outcome]
        if chosen:
            durations.scatter([r["time"] - start for r in chosen], [r["seconds"] for r in chosen], s=12,
                              color=COLORS[outcome], label=f"{outcome} ({len(chosen)})")
    if rounds:
        durations.legend(fontsize=8)
        sizes = [int(r.get("groupSize", 0)) for r in rounds if r.get("outcome") == "success"]
        if sizes:
            values = list(range(min(sizes), max(sizes) + 1))
            groups.bar(values, [sizes.count(v) for v in values], width=0.6, color="#1f77b4")
            groups.set_xticks(values)
        else:
            _empty(groups, "successful rounds")
    else:
        _empty(durations, "rounds")
        _empty(groups, "rounds")
    _label(durations, "round durations", "wall time (s)", "seconds")
    _label(groups, "group sizes of successful rounds", "peers in the group", "rounds")
    return _save(fig, out / "rounds.png")


def _plot_peers(history: RunHistory, out: Path) -> Path:
    from matplotlib.ticker import MaxNLocator

    fig, (ax,) = _figure(f"{history.name}: peers alive by role (reports in the DHT), stacked", columns=1)
    peers = history.peers()
    if peers:
        times = next(iter(peers.values()))[0]
        roles = list(peers)
        ax.stackplot(times, [peers[role][1] for role in roles], labels=roles, step="post",
                     colors=[COLORS.get(role, "#bcbd22") for role in roles], alpha=0.85)
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    else:
        _empty(ax, "peers")
    ax.yaxis.set_major_locator(MaxNLocator(integer=True))
    _label(ax, None, "wall time (s)", "peers")
    return _save(fig, out / "peers.png")


def _markdown(history: RunHistory, out: Path, plots: list[Path]) -> Path:
    last = history.entries[-1]
    summary = history.summary
    rounds = history.rounds()
    durations = [r["seconds"] for r in rounds if r.get("outcome") == "success"]
    rates = [e["samplesPerSecond"] for e in history.entries if _is_number(e.get("samplesPerSecond"))
             and e["samplesPerSecond"] > 0]
    # a finished run's summary has the final evaluation, made after the monitor's last history row
    final_step = summary["globalStep"] if summary.get("globalStep") is not None else last.get("globalStep")
    eval_step, eval_metrics = (final_step, summary.get("metrics") or {}) if summary.get("state") == "completed" \
        else (last.get("evalStep"), last.get("evalMetrics") or {})
    lines = [
        f"# {history.name}",
        "",
        f"- state: {summary.get('state', 'running')}" + (f" ({summary['reason']})" if summary.get("reason") else ""),
        f"- global step: {final_step} after {last['elapsedSeconds']:.0f} s",
        f"- held-out metrics at step {eval_step}: "
        + (", ".join(f"{k} {v:.4f}" for k, v in eval_metrics.items() if _is_number(v)) or "none"),
        f"- training loss: {last['loss']:.4f} (step {last.get('lossStep')})" if _is_number(last.get("loss"))
        else "- training loss: none yet",
        f"- collaboration samples/s: median {statistics.median(rates):.0f}" if rates else "- samples/s: none yet",
        f"- averaging rounds seen: {len(rounds)}, {len(durations)} successful"
        + (f", median {statistics.median(durations):.2f} s" if durations else ""),
        f"- restarts: {summary['restarts']}" if "restarts" in summary else "- restarts: (run in progress)",
        "",
    ]
    lines += [f"![{p.stem}]({p.name})" for p in plots]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path
