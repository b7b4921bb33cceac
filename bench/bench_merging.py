"""Weight merging against synchronous gradient averaging, 4 peers, the digits task.

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
    .venv/bin/python bench/bench_merging.py --replot   # table and plot from the stored JSON
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from bench_results import RESULTS_DIR, write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
RESULTS = RESULTS_DIR / "bench_merging.json"
PLOT = RESULTS_DIR / "bench_merging.png"
TARGET_ACCURACY = 0.95
ANCHOR = ("DDAP (Asynchronous Training of Deep Learning Models), sec. 4: frequent merging approaches "
          "synchronous accuracy at lower cost; TIES >= simple averaging on the larger task")


def manifest(mode: str, every: int | None, steps: int) -> dict:
    document = yaml.safe_load((REPO / "examples/swarm-digits-ties.yaml").read_text())
    spec = document["spec"]
    spec["stopping"] = {"targetSteps": steps}
    spec["monitor"] = {"evalEverySteps": 10, "checkpointEverySteps": 1000}
    averaging = {"matchmakingSeconds": 2.0, "timeoutSeconds": 20, "mode": mode}
    if mode == "gradients":
        spec["targetBatchSize"] = 4 * spec["trainers"]["batchSize"]  # one step = every replica's batch
    else:
        averaging["mergeEverySteps"] = every
    spec["averaging"] = averaging
    document["metadata"]["name"] = f"bench-{mode}" + (f"-{every}" if every else "")
    return document


def run(config: dict, workdir: Path) -> dict:
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
        step, acc = entry.get("evalStep"), (entry.get("evalMetrics") or {}).get("accuracy")
        if acc is not None and step is not None and step >= 0 and step not in seen:
            seen.add(step)
            curve.append({"step": step, "seconds": entry["elapsedSeconds"], "accuracy": acc})
    return {"name": name, "mode": config["spec"]["averaging"]["mode"],
            "mergeEverySteps": config["spec"]["averaging"].get("mergeEverySteps"),
            "finalAccuracy": summary["metrics"].get("accuracy"), "wallSeconds": round(time.time() - started, 1),
            "steps": summary["globalStep"], "curve": curve, **_rounds(run_dir)}


def _rounds(run_dir: Path) -> dict:
    """Merges that found no group or failed, over all trainers (from their logs)."""
    failed = sum(log.read_text().count('"merge failed"') for log in (run_dir / "logs").glob("trainer-*.log"))
    return {"failedMerges": failed}


def accuracy_at(curve: list[dict], key: str, limit: float) -> float | None:
    """The latest accuracy evaluated at or before `limit` (steps or seconds); None before the first."""
    points = [p["accuracy"] for p in curve if p[key] <= limit]
    return points[-1] if points else None


def seconds_to(curve: list[dict], accuracy: float) -> float | None:
    return next((p["seconds"] for p in curve if p["accuracy"] >= accuracy), None)


def table(results: list[dict], steps: int) -> str:
    """Accuracy at half the steps (same data seen), at the wall time the fastest configuration
    finished (same cost), the time to reach TARGET_ACCURACY, and the final figures."""
    half = steps // 2
    finish = min(r["curve"][-1]["seconds"] for r in results)

    def cell(value: float | None, spec: str) -> str:
        return "-" if value is None else format(value, spec)
    header = (f"{'configuration':<22}{f'acc@{half} steps':>15}{f'acc@{finish:.1f} s':>12}"
              f"{f's to {TARGET_ACCURACY:g}':>10}{'final acc':>11}{'steps':>7}{'wall s':>8}{'failed merges':>15}")
    rows = [header] + [
        f"{r['name']:<22}{cell(accuracy_at(r['curve'], 'step', half), '.4f'):>15}"
        f"{cell(accuracy_at(r['curve'], 'seconds', finish), '.4f'):>12}"
        f"{cell(seconds_to(r['curve'], TARGET_ACCURACY), '.1f'):>10}{r['finalAccuracy']:>11.4f}"
        f"{r['steps']:>7}{r['wallSeconds']:>8.1f}{r['failedMerges']:>15}" for r in results]
    notes = [f"acc@{finish:.1f} s: the accuracy each had reached when the fastest finished (- : none evaluated "
             "yet); wall s includes start-up and shutdown"]
    return "\n".join(rows + notes)


def plot(results: list[dict], path: Path) -> None:
    """Held-out accuracy against wall time and against steps, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True, sharey=True)
    fig.suptitle("Weight merging against synchronous gradient averaging (digits, 4 peers)", fontsize=13)
    styles = {"gradients": "-", "parameters": "--", "ties": ":"}
    for result in results:
        curve = result["curve"]
        style = dict(linestyle=styles[result["mode"]], marker="o", markersize=3, label=result["name"])
        by_time.plot([p["seconds"] for p in curve], [p["accuracy"] for p in curve], **style)
        by_step.plot([p["step"] for p in curve], [p["accuracy"] for p in curve], **style)
    by_time.set_xlabel("wall time since start (s)")
    by_step.set_xlabel("step (4 x 32 samples each, all modes)")
    by_time.set_ylabel("held-out accuracy")
    by_time.set_title("against wall time")
    by_step.set_title("against steps")
    for ax in (by_time, by_step):
        ax.grid(alpha=0.3)
        ax.legend(loc="lower right", fontsize=8)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    print(f"wrote {path}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="local optimizer steps per replica")
    parser.add_argument("--every", type=int, nargs="+", default=[5, 20], help="merge frequencies (steps)")
    parser.add_argument("--replot", action="store_true", help=f"print the table and plot from {RESULTS.name} "
                                                              "without running anything")
    args = parser.parse_args()
    if args.replot:
        stored = json.loads(RESULTS.read_text())
        print(table(stored["results"], stored["steps"]))
        plot(stored["results"], PLOT)
        return
    configs = [manifest("gradients", None, args.steps)]
    configs += [manifest(mode, every, args.steps) for mode in ("parameters", "ties") for every in args.every]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-merging-") as workdir:
        for config in configs:
            results.append(run(config, Path(workdir)))
            print(f"  {results[-1]['name']}: {results[-1]['finalAccuracy']} in {results[-1]['wallSeconds']} s",
                  flush=True)
    print("\n" + table(results, args.steps))
    PLOT.parent.mkdir(parents=True, exist_ok=True)
    plot(results, PLOT)
    write_results("bench_merging", ANCHOR, steps=args.steps, results=results)


if __name__ == "__main__":
    main()
