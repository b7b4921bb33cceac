"""Weight merging and DiLoCo against synchronous gradient averaging, 4 peers, the digits task or
(`--task lm`) the small Llama-style language model of examples/swarm-lm.yaml.

Runs `hivekeeper up` per configuration (the real roles: backbone, 4 trainers, monitor) for the
same number of local steps: `gradients` (DeDLOC: every step is one synchronous step over 4
batches), `parameters` / `ties` merging every N local steps, and `diloco` with H inner steps
per outer step (float16 pseudo-gradients, outer Nesterov SGD 0.7 / 0.9), each `--repeat` times.
The monitor evaluates the merged (or outer, or shared) model every few steps; we record the
held-out metric against wall time and against steps, and the bytes each trainer sent in
averaging rounds, merges or outer rounds (after compression; in mode gradients the gradient
all-reduce and the parameter averaging that follows each step). A step processes 4 batches in
every mode (one per replica), so the step axis compares the same samples seen. One table
(mean and spread over the repeats), JSON, and a PNG plot (two panels).

Anchors: DiLoCo (Douillard et al. 2023): matched synchronous training on C4 with 500 times less
communication; the DDAP paper (section 4): frequent merging approaches synchronous accuracy at
lower cost, TIES at least as good as simple averaging on its larger task.

    .venv/bin/python bench/bench_merging.py --fresh [--steps 150] [--runs gradients diloco-10 ...] [--repeat 2]
    .venv/bin/python bench/bench_merging.py --task lm --steps 100 --fresh   # the larger task
    .venv/bin/python bench/bench_merging.py [--task lm] --replot   # table and plot from the stored runs
Runs are stored as they finish (bench/results/NAME.runs.jsonl), so an invocation can add runs
to those of the last one (without --fresh).
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).parent))
from bench_results import RESULTS_DIR, write_results  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
ANCHOR = ("DiLoCo (Douillard et al. 2023): synchronous quality with 500x less communication; DDAP sec. 4: "
          "frequent merging approaches synchronous accuracy at lower cost, TIES >= simple averaging")
MB = 1e6


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


def manifest(task: Task, mode: str, every: int | None, steps: int, repeat: int = 0,
             outer: tuple[float, float] = (0.7, 0.9)) -> dict:
    document = yaml.safe_load((REPO / "examples" / task.example).read_text())
    spec = document["spec"]
    spec["trainers"] = {"replicas": 4, "batchSize": task.batch_size}
    spec["stopping"] = {"targetSteps": steps}
    spec["monitor"] = {"evalEverySteps": 10, "checkpointEverySteps": 1000}
    averaging = {**spec.get("averaging", {}), "matchmakingSeconds": 2.0, "timeoutSeconds": 20, "mode": mode}
    averaging.pop("mergeEverySteps", None)
    averaging.pop("compression", None)
    if mode == "gradients":
        spec["targetBatchSize"] = 4 * task.batch_size  # one step = every replica's batch
        averaging["compression"] = "float16"
    elif mode == "diloco":
        averaging.update(innerSteps=every, compression="float16",
                         outerOptimizer={"learningRate": outer[0], "momentum": outer[1], "nesterov": True})
    else:
        averaging["mergeEverySteps"] = every
    spec["averaging"] = averaging
    variant = "" if mode != "diloco" or outer == (0.7, 0.9) else \
        f"-lr{outer[0]:g}m{outer[1]:g}".replace(".", "p")  # a name takes no dots
    document["metadata"]["name"] = f"bench-{mode}" + (f"-{every}" if every else "") + variant + f"-r{repeat}"
    return document


def configuration(result: dict) -> str:
    """The name that groups repeats: mode and its interval (H or merge steps)."""
    return result["name"].rsplit("-r", 1)[0].removeprefix("bench-")


def run(task: Task, config: dict, workdir: Path) -> dict:
    name = config["metadata"]["name"]
    path = workdir / f"{name}.yaml"
    path.write_text(yaml.safe_dump(config))
    run_dir = workdir / name
    done = subprocess.run([str(REPO / ".venv/bin/hivekeeper"), "up", str(path), "--run-dir", str(run_dir)],
                          capture_output=True, text=True, timeout=1800)
    if done.returncode != 0:
        raise RuntimeError(f"{name}: hivekeeper up failed: {done.stderr[-2000:]}")
    return read_run(task, config, run_dir)


def read_run(task: Task, config: dict, run_dir: Path) -> dict:
    """One finished `hivekeeper up` run's figures."""
    name = config["metadata"]["name"]
    summary = json.loads((run_dir / "summary.json").read_text())
    curve, seen, sent, samples = [], set(), None, 0
    for line in (run_dir / "history.jsonl").read_text().splitlines():
        entry = json.loads(line)
        if entry.get("averagingBytesSentPerTrainer") and entry.get("globalStep"):
            sent = (entry["averagingBytesSentPerTrainer"], entry["globalStep"])
        samples = entry.get("samples") or 0
        step, value = entry.get("evalStep"), (entry.get("evalMetrics") or {}).get(task.metric)
        if value is not None and step is not None and step >= 0 and step not in seen:
            seen.add(step)
            curve.append({"step": step, "seconds": entry["elapsedSeconds"], task.metric: value})
    averaging = config["spec"]["averaging"]
    return {"name": name, "configuration": configuration({"name": name}), "mode": averaging["mode"],
            "every": averaging.get("mergeEverySteps") or averaging.get("innerSteps"),
            "final": summary["metrics"].get(task.metric), "wallSeconds": summary["wallSeconds"],
            "steps": summary["globalStep"], "curve": curve,
            # bytes a trainer sent per step, from the monitor's last reading of the trainers' reports
            "bytesPerStep": round(sent[0] / sent[1]) if sent else None,
            "samples": samples,  # every trainer's, as the monitor last read their reports (they lag a little)
            **_rounds(run_dir)}


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


def table(task: Task, results: list[dict], steps: int) -> tuple[str, list[dict]]:
    """Per configuration, over its repeats (mean, and +- half the range): the metric at half the
    steps (same samples seen), the final metric, MB each trainer sent over `steps` steps, wall
    time to the task's target and the failed merges. Returns the text and the rows."""
    half = steps // 2
    short = task.short
    rows: list[dict] = []
    for name in dict.fromkeys(r["configuration"] for r in results):
        runs = [r for r in results if r["configuration"] == name]
        rows.append({"configuration": name, "mode": runs[0]["mode"], "every": runs[0]["every"], "runs": len(runs),
                     "atHalf": _spread([value_at(r["curve"], task.metric, "step", half) for r in runs]),
                     "final": _spread([r["final"] for r in runs]),
                     "mbPerTrainer": _spread([r["bytesPerStep"] * steps / MB if r.get("bytesPerStep") else None
                                              for r in runs]),
                     "secondsToTarget": _spread([seconds_to(task, r["curve"]) for r in runs]),
                     "wallSeconds": _spread([r["wallSeconds"] for r in runs]),
                     "failedMerges": sum(r["failedMerges"] for r in runs)})

    def cell(value: dict | None, spec: str) -> str:
        if value is None:
            return "-"
        text = format(value["mean"], spec)
        return text + (f" ±{format(value['spread'], spec)}" if value["spread"] else "") + \
            ("" if value["n"] == value["of"] else f" ({value['n']}/{value['of']})")
    header = (f"{'configuration':<16}{'runs':>5}{f'{short}@{half} steps':>20}{f'final {short}':>20}"
              f"{f'MB/trainer ({steps} st)':>24}{f's to {task.target:g}':>18}{'wall s':>16}{'failed merges':>15}")
    lines = [header] + [
        f"{row['configuration']:<16}{row['runs']:>5}{cell(row['atHalf'], '.3f'):>20}{cell(row['final'], '.3f'):>20}"
        f"{cell(row['mbPerTrainer'], '.2f'):>24}{cell(row['secondsToTarget'], '.1f'):>18}"
        f"{cell(row['wallSeconds'], '.0f'):>16}{row['failedMerges']:>15}" for row in rows]
    lines.append("mean ±half the range over the runs; (k/n): only k of n runs had a value (reached the target); "
                 "wall s includes start-up and shutdown")
    sync = next((row for row in rows if row["mode"] == "gradients" and row["final"]), None)
    if sync is not None:
        for row in rows:
            if row["mode"] != "gradients" and row["final"] and row["mbPerTrainer"] and sync["mbPerTrainer"]:
                ratio = row["final"]["mean"] / sync["final"]["mean"]
                row["finalVsGradients"] = round(ratio, 4)
                row["bytesFewerThanGradients"] = round(sync["mbPerTrainer"]["mean"] / row["mbPerTrainer"]["mean"], 1)
                lines.append(f"{row['configuration']}: final {short} {ratio:.3f}x gradients', "
                             f"{row['bytesFewerThanGradients']}x fewer bytes")
    return "\n".join(lines), rows


def _spread(values: list) -> dict | None:
    present = [v for v in values if v is not None]
    if not present:
        return None
    mean = sum(present) / len(present)
    return {"mean": round(mean, 4), "spread": round((max(present) - min(present)) / 2, 4), "n": len(present),
            "of": len(values), "values": present}


def plot(task: Task, results: list[dict], path: Path) -> None:
    """The held-out metric against wall time and against steps, one line per configuration."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (by_time, by_step) = plt.subplots(1, 2, figsize=(12, 4.5), constrained_layout=True, sharey=True)
    fig.suptitle(f"Weight merging and DiLoCo against synchronous gradient averaging ({task.example}, 4 peers)",
                 fontsize=13)
    styles = {"gradients": "-", "parameters": "--", "ties": ":", "diloco": "-."}
    colors = {name: f"C{i}" for i, name in enumerate(dict.fromkeys(r["configuration"] for r in results))}
    labelled: set[str] = set()
    for result in results:
        curve, name = result["curve"], result["configuration"]
        style = dict(linestyle=styles[result["mode"]], marker="o", markersize=3, color=colors[name],
                     label=None if name in labelled else name, alpha=0.8)
        labelled.add(name)
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
    parser.add_argument("--runs", nargs="+", default=["gradients", "parameters-10", "ties-10", "diloco-5", "diloco-10",
                                                      "diloco-20"],
                        help="configurations: gradients, parameters-N, ties-N (merge every N), diloco-H, "
                             "diloco-H@LR:MOMENTUM (outer optimizer; default the paper's 0.7:0.9)")
    parser.add_argument("--repeat", type=int, default=2, help="runs per configuration (round robin)")
    parser.add_argument("--first-repeat", type=int, default=0, help="number the repeats from here (adding runs)")
    parser.add_argument("--fresh", action="store_true", help="forget the runs stored by earlier invocations")
    parser.add_argument("--import-runs", metavar="WORKDIR", help="store the finished runs of an interrupted "
                                                                   "invocation's work directory, run nothing")
    parser.add_argument("--replot", action="store_true", help="print the table and plot from the stored runs "
                                                              "without running anything")
    args = parser.parse_args()
    task = TASKS[args.task]
    runs_path = RESULTS_DIR / f"{task.results}.runs.jsonl"  # every finished run, as it finishes
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    if args.fresh:
        runs_path.unlink(missing_ok=True)

    def store(result: dict) -> None:
        with runs_path.open("a") as out:
            out.write(json.dumps(result) + "\n")
        print(f"  {result['name']}: {task.metric} {result['final']}, {result['bytesPerStep']} B/step/trainer, "
              f"{result['wallSeconds']} s", flush=True)

    if args.import_runs:
        for path in sorted(Path(args.import_runs).glob("bench-*.yaml")):
            if (path.with_suffix("") / "summary.json").exists():
                store(read_run(task, yaml.safe_load(path.read_text()), path.with_suffix("")))
    elif not args.replot:
        configs = []
        for repeat in range(args.first_repeat, args.first_repeat + args.repeat):
            for token in args.runs:  # interleaved, so that a slow spell of the machine hits every one alike
                token, _, outer = token.partition("@")  # diloco-10@1:0.5: outer learning rate 1, momentum 0.5
                mode, _, every = token.partition("-")
                configs.append(manifest(task, mode, int(every) if every else None, args.steps, repeat,
                                        tuple(map(float, outer.split(":"))) if outer else (0.7, 0.9)))
        with tempfile.TemporaryDirectory(prefix="bench-merging-") as workdir:
            for config in configs:
                store(run(task, config, Path(workdir)))
    if not runs_path.exists():
        raise SystemExit(f"no runs stored yet in {runs_path}")
    results = [json.loads(line) for line in runs_path.read_text().splitlines() if line.strip()]
    text, rows = table(task, results, args.steps)
    print("\n" + text)
    plot(task, results, RESULTS_DIR / f"{task.results}.png")
    write_results(task.results, ANCHOR, task=args.task, metric=task.metric, steps=args.steps, summary=rows,
                  results=results)


if __name__ == "__main__":
    main()
