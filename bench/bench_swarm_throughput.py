"""Collaboration throughput: the digits Swarm with 1 trainer alone vs 3 trainers and an
auxiliary peer, same global batch, on this machine.

Anchor: the physical limit. Trainers here share the machine's CPU cores, so the ideal is
min(trainers, cores) x one trainer's samples/s; averaging and hivemind's background work
take the rest. Prints a table and writes bench/results/swarm_throughput.json.

    .venv/bin/python bench/bench_swarm_throughput.py [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

import yaml
from rich.console import Console
from rich.table import Table

from bench_results import write_results
from hivekeeper.local.runner import run_locally
from hivekeeper.spec import parse_manifest

REPO = Path(__file__).resolve().parents[1]
CONFIGS = {"1 trainer": {"trainers": 1, "auxiliary": 0}, "3 trainers + 1 auxiliary": {"trainers": 3, "auxiliary": 1}}


def run(config: dict[str, int], steps: int, run_dir: Path) -> dict:
    document = yaml.safe_load((REPO / "examples/swarm-digits.yaml").read_text())
    spec = document["spec"]
    spec["trainers"]["replicas"] = config["trainers"]
    spec["auxiliary"]["replicas"] = config["auxiliary"]
    spec["stopping"] = {"targetSteps": steps}
    spec["monitor"]["evalEverySteps"] = steps
    summary = run_locally(parse_manifest(document), run_dir, console=Console(stderr=True, quiet=True))
    history = [json.loads(line) for line in (run_dir / "history.jsonl").read_text().splitlines() if line.strip()]
    training = [h for h in history if h["globalStep"] > 0]
    span = training[-1]["elapsedSeconds"] - training[0]["elapsedSeconds"] if len(training) > 1 else 0
    steps_done = training[-1]["globalStep"] - training[0]["globalStep"] if training else 0
    return {
        "state": summary["state"],
        "globalStep": summary["globalStep"],
        "wallSeconds": summary["wallSeconds"],
        "medianSamplesPerSecond": summary["samplesPerSecond"],
        "stepsPerSecond": round(steps_done / span, 3) if span else None,
        "samplesPerSecondFromSteps": round(steps_done * spec["targetBatchSize"] / span, 1) if span else None,
        "accuracy": summary["metrics"].get("accuracy"),
    }


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=40)
    args = parser.parse_args()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for name, config in CONFIGS.items():
            results[name] = run(config, args.steps, Path(tmp) / name.replace(" ", "-"))
    single = results["1 trainer"]["samplesPerSecondFromSteps"] or 0
    cores = os.cpu_count() or 1
    table = Table(title=f"digits Swarm, targetBatchSize 256, {args.steps} steps, {cores} cores")
    for column in ("configuration", "steps/s", "samples/s (steps x batch)", "median samples/s (monitor)",
                   "vs 1 trainer", "ideal", "wall s", "accuracy"):
        table.add_column(column)
    for name, r in results.items():
        ratio = (r["samplesPerSecondFromSteps"] or 0) / single if single else 0
        ideal = min(CONFIGS[name]["trainers"], cores)
        table.add_row(name, str(r["stepsPerSecond"]), str(r["samplesPerSecondFromSteps"]), str(r["medianSamplesPerSecond"]),
                      f"{ratio:.2f}x", f"{ideal}x", str(r["wallSeconds"]), str(r["accuracy"]))
    Console().print(table)
    write_results("swarm_throughput", "min(trainers, cores) x one trainer (physical limit)",
                  steps=args.steps, results=results)


if __name__ == "__main__":
    main()
