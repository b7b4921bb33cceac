"""Weight merging against synchronous gradient averaging, 4 peers, the digits task.

Runs `hivekeeper up` once per configuration (the real roles: backbone, 4 trainers, monitor)
for the same number of local steps: `gradients` (DeDLOC: every step is one synchronous
step over 4 x 32 samples) and `parameters` / `ties` merging every N local steps. The
monitor evaluates the merged (or shared) model every few steps; we record accuracy against
wall time and against steps, print one table, and write JSON and an SVG plot.

Anchor: the DDAP paper's qualitative findings (Asynchronous Training of Deep Learning
Models, section 4): frequent merging approaches synchronous accuracy at lower communication
cost, and TIES is at least as good as simple averaging (on its larger task).

    .venv/bin/python bench/bench_merging.py [--steps 150] [--every 5 20]
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
    points = [p["accuracy"] for p in curve if p[key] <= limit]
    return points[-1] if points else None


def svg(results: list[dict], path: Path) -> None:
    """Accuracy against steps, one polyline per configuration (no plotting library needed)."""
    width, height, pad = 640, 360, 40
    max_step = max(p["step"] for r in results for p in r["curve"]) or 1
    colors = ["#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    lines = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}">',
             f'<rect width="{width}" height="{height}" fill="white"/>',
             f'<text x="{pad}" y="20" font-size="14">held-out accuracy vs local steps (digits, 4 peers)</text>']
    for i, result in enumerate(results):
        points = " ".join(f"{pad + (width - 2 * pad) * p['step'] / max_step:.1f},"
                          f"{height - pad - (height - 2 * pad) * p['accuracy']:.1f}" for p in result["curve"])
        color = colors[i % len(colors)]
        lines.append(f'<polyline fill="none" stroke="{color}" stroke-width="2" points="{points}"/>')
        lines.append(f'<text x="{width - 170}" y="{pad + 16 * i}" font-size="12" fill="{color}">{result["name"]}</text>')
    lines.append(f'<text x="{pad}" y="{height - 10}" font-size="12">0 .. {max_step} steps; y: 0 .. 1</text></svg>')
    path.write_text("\n".join(lines))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=150, help="local optimizer steps per replica")
    parser.add_argument("--every", type=int, nargs="+", default=[5, 20], help="merge frequencies (steps)")
    args = parser.parse_args()
    configs = [manifest("gradients", None, args.steps)]
    configs += [manifest(mode, every, args.steps) for mode in ("parameters", "ties") for every in args.every]
    results = []
    with tempfile.TemporaryDirectory(prefix="bench-merging-") as workdir:
        for config in configs:
            results.append(run(config, Path(workdir)))
            print(f"  {results[-1]['name']}: {results[-1]['finalAccuracy']} in {results[-1]['wallSeconds']} s",
                  flush=True)
    half = args.steps // 2
    print(f"\n{'configuration':<22}{'acc@' + str(half) + ' steps':>14}{'final acc':>11}{'steps':>7}"
          f"{'wall s':>8}{'failed merges':>15}")
    for r in results:
        mid = accuracy_at(r["curve"], "step", half)
        print(f"{r['name']:<22}{mid if mid is not None else float('nan'):>14.4f}{r['finalAccuracy']:>11.4f}"
              f"{r['steps']:>7}{r['wallSeconds']:>8.1f}{r['failedMerges']:>15}")
    plot = RESULTS_DIR / "bench_merging.svg"
    plot.parent.mkdir(parents=True, exist_ok=True)
    svg(results, plot)
    print(f"wrote {plot}")
    write_results("bench_merging", ANCHOR, steps=args.steps, results=results)


if __name__ == "__main__":
    main()
