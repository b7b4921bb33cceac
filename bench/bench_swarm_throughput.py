"""Collaboration throughput against the averaging plan's prediction: the demo Swarm
(`examples/swarm-digits.yaml`: 3 trainers and an auxiliary peer), the same with 1 trainer, and
the small language model of `examples/swarm-lm.yaml`, each run for a fixed number of steps with
`hivekeeper up`. Optionally side by side with the code at another git revision (`--baseline`),
interleaved, on the same machine.

Reports per run: achieved global steps/s (first step to last), the plans' median prediction and
their ratio (efficiency; the goal: 0.8 to 1.2), averaging round durations (median and
p90 of the rounds the monitor saw, one a second at most; goal on loopback: the demo's at or below
0.5 s), collaboration samples/s, and where the plan says a step's time goes.

Anchors: the plan's own prediction (efficiency), another revision run side by side
(`--baseline`), and the physical limit of this
machine: trainers share its cores, so 3 trainers can at best make min(3, cores) x one trainer's
samples/s. Prints a table and writes bench/results/swarm_throughput.json.

    .venv/bin/python bench/bench_swarm_throughput.py [--repeats 2] [--baseline REV]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Optional

import yaml
from rich.console import Console
from rich.table import Table

from bench_results import write_results

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {  # name: manifest, steps, overrides of its spec
    # the balancer renews its plan (and prediction) every 10 s: at 2-3 steps/s a 40-step run
    # lasts about one renewal, and its median prediction is the first plan's, from start-up steps
    "demo": ("examples/swarm-digits.yaml", 80, {}),
    # alone, a trainer steps many times a second: enough steps for the monitor to see a rate
    "demo, 1 trainer": ("examples/swarm-digits.yaml", 400, {"trainers": {"replicas": 1}, "auxiliary": {"replicas": 0}}),
    "swarm-lm": ("examples/swarm-lm.yaml", 20, {}),
}


def manifest(path: str, steps: int, overrides: dict, out: Path) -> Path:
    document = yaml.safe_load((REPO / path).read_text())
    spec = document["spec"]
    for key, value in overrides.items():
        spec[key] = {**spec.get(key, {}), **value}
    spec["stopping"] = {"targetSteps": steps}  # the same length for every run
    spec["monitor"]["evalEverySteps"] = steps
    out.write_text(yaml.safe_dump(document))
    return out


def run(manifest_path: Path, run_dir: Path, source: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": f"{source / 'services'}{os.pathsep}{source / 'operator'}"}
    done = subprocess.run([sys.executable, "-m", "hivekeeper", "up", str(manifest_path), "--run-dir", str(run_dir)],
                          env=env, cwd=source, capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"hivekeeper up failed ({done.returncode}): {done.stderr[-2000:]}")
    summary = json.loads((run_dir / "summary.json").read_text())
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines() if line.strip()]
    return measure(summary, history)


def measure(summary: dict, history: list[dict]) -> dict:
    steps = [(e["elapsedSeconds"], e["globalStep"]) for e in history if (e.get("globalStep") or 0) > 0]
    last = next((i for i in range(len(steps) - 1, 0, -1) if steps[i][1] > steps[i - 1][1]), 0)
    (t0, s0), (t1, s1) = steps[0], steps[last]
    achieved = (s1 - s0) / (t1 - t0) if t1 > t0 else None
    predictions = [e["plan"]["stepsPerSecond"] for e in history
                   if t0 <= e["elapsedSeconds"] <= t1 and (e.get("plan") or {}).get("stepsPerSecond")]
    predicted = statistics.median(predictions) if predictions else None
    rounds = {(r["time"], r["seconds"]) for e in history if (r := e.get("lastRound")) and r["outcome"] == "success"}
    seconds = sorted(s for _, s in rounds)
    plan = next((e["plan"] for e in reversed(history) if e.get("plan")), None) or {}
    samples = [e["samplesPerSecond"] for e in history if t0 <= e["elapsedSeconds"] <= t1 and e.get("samplesPerSecond")]
    return {
        "globalStep": summary["globalStep"], "wallSeconds": summary["wallSeconds"],
        "achievedStepsPerSecond": round(achieved, 4) if achieved else None,
        "predictedStepsPerSecond": round(predicted, 4) if predicted else None,
        "efficiency": round(achieved / predicted, 3) if achieved and predicted else None,
        "roundSecondsMedian": round(statistics.median(seconds), 3) if seconds else None,
        "roundSecondsP90": round(seconds[int(0.9 * (len(seconds) - 1))], 3) if seconds else None,
        "roundsSeen": len(seconds),
        "samplesPerSecond": round(statistics.median(samples), 1) if samples else None,
        "predictedStep": plan.get("step"),  # the last plan's split (absent before the plan had fixed costs)
        "metrics": summary.get("metrics"),
    }


def checkout(revision: str, where: Path) -> Path:
    subprocess.run(["git", "-C", str(REPO), "worktree", "add", "--detach", "-f", str(where), revision],
                   check=True, capture_output=True)
    return where


def median_of(runs: list[dict], key: str) -> Optional[float]:
    values = [r[key] for r in runs if r.get(key) is not None]
    return round(statistics.median(values), 4) if values else None


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--baseline", help="a git revision to run side by side (e.g. the commit before a change)")
    parser.add_argument("--only", nargs="*", choices=sorted(CONFIGS), help="run only these configurations")
    parser.add_argument("--keep", type=Path, help="keep the run directories here (logs, histories)")
    args = parser.parse_args()
    configs = {name: CONFIGS[name] for name in (args.only or CONFIGS)}
    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = args.keep or Path(tmp)
        tmp.mkdir(parents=True, exist_ok=True)
        sources = {"this code": REPO}
        if args.baseline:
            sources[f"baseline {args.baseline}"] = checkout(args.baseline, tmp / "baseline")
        try:
            for repeat in range(args.repeats):
                for name, (path, steps, overrides) in configs.items():
                    for label, source in sources.items():  # interleaved: the machine's load hits both alike
                        key = f"{name} [{label}]"
                        m = manifest(path, steps, overrides, tmp / f"{name.replace(' ', '_')}.yaml")
                        out = run(m, tmp / f"run-{name}-{label}-{repeat}".replace(" ", "_"), source)
                        results.setdefault(key, {"config": name, "code": label, "runs": []})["runs"].append(out)
                        print(f"{key} #{repeat + 1}: {out['achievedStepsPerSecond']} steps/s, "
                              f"efficiency {out['efficiency']}, round {out['roundSecondsMedian']} s", file=sys.stderr)
        finally:
            if args.baseline:
                subprocess.run(["git", "-C", str(REPO), "worktree", "remove", "--force", str(tmp / "baseline")],
                               capture_output=True)
    keys = ("achievedStepsPerSecond", "predictedStepsPerSecond", "efficiency", "roundSecondsMedian", "roundSecondsP90",
            "samplesPerSecond", "wallSeconds")
    for entry in results.values():
        entry.update({k: median_of(entry["runs"], k) for k in keys})
    cores = os.cpu_count() or 1
    table = Table(title=f"Swarm throughput against the plan, {cores} cores, median of {args.repeats} runs")
    for column in ("configuration", "code", "steps/s", "predicted", "efficiency", "round s (p50/p90)", "samples/s",
                   "wall s"):
        table.add_column(column)
    for entry in results.values():
        table.add_row(entry["config"], entry["code"], str(entry["achievedStepsPerSecond"]),
                      str(entry["predictedStepsPerSecond"]), str(entry["efficiency"]),
                      f"{entry['roundSecondsMedian']}/{entry['roundSecondsP90']}", str(entry["samplesPerSecond"]),
                      str(entry["wallSeconds"]))
    Console().print(table)
    one = results.get("demo, 1 trainer [this code]", {}).get("samplesPerSecond")
    three = results.get("demo [this code]", {}).get("samplesPerSecond")
    if one and three:
        Console().print(f"demo: 3 trainers make {three / one:.2f}x one trainer's samples/s "
                        f"(physical limit min(3, {cores} cores) = {min(3, cores)}x)")
    write_results("swarm_throughput", "the plan's prediction (efficiency 0.8-1.2); the previous code side by side; "
                  "min(trainers, cores) x one trainer (physical limit)",
                  repeats=args.repeats, baseline=args.baseline, results=results)


if __name__ == "__main__":
    main()
