#!/usr/bin/env python3
"""CI's closing summary: how long each phase took (from the phases file `scripts/phases.sh`
writes), how busy the machine's CPUs were meanwhile (from `sample_cpu`'s samples: near 100%, a
phase waits for the CPU, and running more beside it only slows both; far below, it waits for
something else), and the slowest tests of each tier, with the CPU time each used (from the JUnit
XML pytest writes per tier; tests/helpers/cpu_time.py records the CPU time).

    scripts/ci_report.py PHASES_FILE REPORTS_DIR [--cpu SAMPLES_FILE] [--slowest N]
"""

from __future__ import annotations

import argparse
import xml.etree.ElementTree as ET
from pathlib import Path


def phases(path: Path) -> list[tuple[str, float, float, int]]:
    rows = []
    for line in path.read_text().splitlines() if path.exists() else ():
        name, start, end, code = line.split("\t")
        rows.append((name, float(start), float(end), int(code)))
    return rows


def cpu_samples(path: Path | None) -> list[tuple[float, int, int]]:
    """(time, busy jiffies, total jiffies) of each sample, in time order; none without a file."""
    rows = []
    for line in path.read_text().splitlines() if path is not None and path.exists() else ():
        fields = line.split("\t")
        if len(fields) == 3:  # the last line may be cut by the kill
            rows.append((float(fields[0]), int(fields[1]), int(fields[2])))
    return rows


def busy_share(samples: list[tuple[float, int, int]], start: float, end: float) -> float | None:
    """The CPUs' busy share between the first sample at or after `start` and the last at or
    before `end`; None when fewer than two samples fall in between."""
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2 or inside[-1][2] == inside[0][2]:
        return None
    return (inside[-1][1] - inside[0][1]) / (inside[-1][2] - inside[0][2])


def slowest(report: Path, count: int) -> list[tuple[float, str, str, float | None]]:
    """(seconds, test id, outcome, CPU seconds or None) of the slowest test cases: setup, call
    and teardown together."""
    cases = []
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else (
            "skipped" if case.find("skipped") is not None else "passed")
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        cpu = next((float(p.get("value")) for p in case.iter("property") if p.get("name") == "cpu_seconds"), None)
        cases.append((float(case.get("time") or 0.0), name, outcome, cpu))
    return sorted(cases, reverse=True)[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phases", type=Path)
    parser.add_argument("reports", type=Path)
    parser.add_argument("--cpu", type=Path, help="the samples of scripts/phases.sh's sample_cpu")
    parser.add_argument("--slowest", type=int, default=10)
    args = parser.parse_args()
    rows = phases(args.phases)
    samples = cpu_samples(args.cpu)
    if rows:
        origin = min(start for _, start, _, _ in rows)
        print(f"\n{'phase':<44} {'start':>8} {'took':>8} {'cpu':>5}  status")
        for name, start, end, code in sorted(rows, key=lambda row: row[1]):
            status = "ok" if code == 0 else f"exit {code}"
            print(f"{name:<44} {_clock(start - origin):>8} {_clock(end - start):>8} "
                  f"{_share(busy_share(samples, start, end)):>5}  {status}")
        end = max(end for _, _, end, _ in rows)
        print(f"{'total':<44} {'':>8} {_clock(end - origin):>8} {_share(busy_share(samples, origin, end)):>5}")
    for report in sorted(args.reports.glob("*.xml")) if args.reports.exists() else ():
        print(f"\nslowest tests of tier {report.stem} (setup, call and teardown; their CPU time):")
        for seconds, name, outcome, cpu in slowest(report, args.slowest):
            used = "" if cpu is None else f"{cpu:7.1f} s cpu"
            print(f"  {seconds:7.1f} s {used:>13}  {name}" + ("" if outcome == "passed" else f"  [{outcome}]"))


def _share(share: float | None) -> str:
    return "-" if share is None else f"{100 * share:.0f}%"


def _clock(seconds: float) -> str:
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}:{rest:02d}"


if __name__ == "__main__":
    main()
