"""Weight merging against synchronous gradient averaging, 4 peers, the digits task or (`--task lm`)
the small Llama-style language model of examples/swarm-lm.yaml.

Runs `hivekeeper up` once per configuration (the real roles: backbone, 4 trainers, monitor)
for the same number of local steps: `gradients` (DeDLOC: every step is one synchronous
step over 4 x 32 samples) and `parameters` / `ties` merging every N local steps. The
monitor evaluates the merged (or shared) model every few steps; we record accuracy against
wall time and against steps, print one table, and write JSON and a PNG plot (two panels).
A step processes 4 x 32 samples in every mode (one batch per replica), so the step axis
compares the same data seen; the time axis compares cost.

Anchor: the DDAP paper's qualitative findings (Asynchronous Training of Deep Learning
Models, section 4): frequent merging approaches synchronous accuracy at lower communication
cost, and TIES is at least as good as simple averaging (on its larger task).

    .venv/bin/python bench/bench_merging.py [--steps 150] [--every 5 20]
    .venv/bin/python bench/bench_merging.py --task lm --steps 100 --every 10   # the larger task
    .venv/bin/python bench/bench_merging.py [--task lm] --replot   # table and plot from the stored JSON
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from bench_results import RESULTS_DIR, write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ANCHOR = ("DDAP (Asynchronous Training of Deep Learning Models), sec. 4: frequent merging approaches "
          "synchronous accuracy at lower cost; TIES >= simple averaging on the larger task")


@dataclass(frozen=True)
class Task:
    example: str  # the manifest the configurations start from
    batch_size: int  # per replica: a step is 4 of these batches in every mode
    metric: str  # the monitor's held-out metric
    short: str  # its column heading
    target: float  # the table's "time to" column
    lower_is_better: bool
    results: str  # bench/results/<results>.json and .png

    def reached(self, value: float) -> bool:
        return value <= self.target if self.lower_is_better else value >= self.target


TASKS = {
    "digits": Task("swarm-digits-ties.yaml", 32, "accuracy", "acc", 0.95, False, "bench_merging"),
    "lm": Task("swarm-lm.yaml", 8, "perplexity", "ppl", 20.0, True, "bench_merging_lm"),
}


def manifest(task: Task, mode: str, every: int | None, steps: int) -> dict:
    document = yaml.safe_load((REPO / "examples" / task.example).read_text())
    spec = document["spec"]
    spec["trainers"] = {"replicas": 4, "batchSize": task.batch_size}
    spec["stopping"] = {"targetSteps": steps}
    spec["monitor"] = {"evalEverySteps": 10, "checkpointEverySteps": 1000}
    averaging = {**spec.get("averaging", {}), "matchmakingSeconds": 2.0, "timeoutSeconds": 20, "mode": mode}
    averaging.pop("mergeEverySteps", None)
    if mode == "gradients":
        spec["targetBatchSize"] = 4 * task.batch_size  # one step = every replica's batch
    else:
        averaging["mergeEverySteps"] = every
    spec["averaging"] = averaging
    document["metadata"]["name"] = f"bench-{mode}" + (f"-{every}" if every else "")
    return document


def run(task: Task, config: dict, workdir: Path) -> dict:
    name = config["metadata"]["name"]
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    run_dir = workdir / name
    started = time.time()
    done = subprocess.run([str(REPO / ".venv/bin/hivekeeper"), "up", str(path), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=900)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: hivekeeper up failed: {done.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    curve, seen = [], set()
    for line in (run_dir / "history.jsonl").read_text().splitlines():
        entry = json.loads(line)
        step, value = entry.get("evalStep"), (entry.get("evalMetrics") or {}).get(task.metric)
        if value is not None and step is not None and step >= 0 and step not in seen:
            seen.add(step)
            curve.append({"step": step, "seconds": entry["elapsedSeconds"], task.metric: value})
    return {"name": name, "mode": config["spec"]["averaging"]["mode"],
            "mergeEverySteps": config["spec"]["averaging"].get("mergeEverySteps"),
            "final": summary["metrics"].get(task.metric), "wallSeconds": round(time.time() - started, 1),
            "steps": summary["globalStep"], "curve": curve, **_rounds(run_dir)}


def _rounds(run_dir: Path) -> dict:
    """Merges that found no group or failed, over all trainers (from their logs)."""
    failed = sum(log.read_text().count('"merge failed"') for log in (run_dir / "logs").glob("trainer-*.log"))
    return {"failedMerges": failed}


def value_at(curve: list[dict], metric: str, key: str, limit: float) -> float | None:
    """The latest value evaluated at or before `limit` (steps or seconds); None before the first."""
    points = [p[metric] for p in curve if p[key] <= limit]
    return points[-1] if points else None


def seconds_to(task: Task, curve: list[dict]) -> float | None:
    return next((p["seconds"] for p in curve if task.reached(p[task.metric])), None)


def table(task: Task, results: list[dict], steps: int) -> str:
    """The metric at half the steps (same data seen), at the wall time the fastest configuration
    finished (same cost), the time to reach the task's target, and the final figures."""
    half = steps // 2
    finish = min(r["curve"][-1]["seconds"] for r in results)
    short = task.short

    def cell(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)
    header = (f"{'configuration':<22}{f'{short}@{half} steps':>16}{f'{short}@{finish:.1f} s':>14}"
              f"{f's to {task.target:g}':>10}{f'final {short}':>12}{'steps':>7}{'wall s':>8}{'failed merges':>15}")
    rows = [header] + [
        f"{r['name']:<22}{cell(value_at(r['curve'], task.metric, 'step', half), '.4f'):>16}"
        f"{cell(value_at(r['curve'], task.metric, 'seconds', finish), '.4f'):>14}"
        f"{cell(seconds_to(task, r['curve']), '.1f'):>10}{cell(r['final'], '.4f'):>12}"
        f"{r['steps']:>7}{r['wallSeconds']:>8.1f}{r['failedMerges']:>15}" for r in results]
    notes = [f"{short}@{finish:.1f} s: held-out {task.metric} each had reached when the fastest finished (- : none "
             "evaluated yet); wall s includes start-up and shutdown"]
    return "\n".join(rows + notes)


def plot(task: Task, results: list[dict], path: Path) -> None:
    """The held-out metric against wall time and against steps, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True, sharey=True)
    fig.suptitle(f"Weight merging against synchronous gradient averaging ({task.example}, 4 peers)", fontsize=13)
    styles = {"gradients": "-", "parameters": "--", "ties": ":"}
    for result in results:
        curve = result["curve"]
        style = dict(linestyle=styles[result["mode"]], marker="o", markersize=3, label=result["name"])
        by_time.plot([p["seconds"] for p in curve], [p[task.metric] for p in curve], **style)
        by_step.plot([p["step"] for p in curve], [p[task.metric] for p in curve], **style)
    by_time.set_xlabel("wall time since start (s)")
    by_step.set_xlabel(f"step (4 x {task.batch_size} samples each, all modes)")
    by_time.set_ylabel(f"held-out {task.metric}")
    if task.lower_is_better:
        by_time.set_yscale("log")
    by_time.set_title("against wall time")
    by_step.set_title("against steps")
    for ax in (by_time, by_step):
        ax.grid(alpha=0.3)
        ax.legend(loc="upper right" if task.lower_is_better else "lower right", fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--task", choices=sorted(TASKS), default="digits")
    parser.add_argument("--steps", type=int, default=150, help="local optimizer steps per replica")
    parser.add_argument("--every", type=int, nargs="+", default=[5, 20], help="merge frequencies (steps)")
    parser.add_argument("--replot", action="store_true", help="print the table and plot from the stored JSON "
                                                              "without running anything")
    args = parser.parse_args()
    task = TASKS[args.task]
    stored_path, plot_path = RESULTS_DIR / f"{task.results}.json", RESULTS_DIR / f"{task.results}.png"
    if args.replot:
        stored = json.loads(stored_path.read_text())
        print(table(task, stored["results"], stored["steps"]))
        plot(task, stored["results"], plot_path)
        return
    configs = [manifest(task, "gradients", None, args.steps)]
    configs += [manifest(task, mode, every, args.steps) for mode in ("parameters", "ties") for every in args.every]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-merging-") as workdir:
        for config in configs:
            results.append(run(task, config, Path(workdir)))
            print(f"  {results[-1]['name']}: {task.metric} {results[-1]['final']} in {results[-1]['wallSeconds']} s",
                  flush=True)
    print("\n" + table(task, results, args.steps))
    plot_path.parent.mkdir(parents=True, exist_ok=True)
    plot(task, results, plot_path)
    write_results(task.results, ANCHOR, task=args.task, metric=task.metric, steps=args.steps, results=results)


if __name__ == "__main__":
    main()
