#!/usr/bin/env python3
"""CI's closing summary: how long each phase took (from the phases file `scripts/phases.sh`
writes), how busy the machine's CPUs were meanwhile (from `sample_cpu`'s samples: near 100%, a
phase waits for the CPU, and running more beside it only slows both; far below, it waits for
something else) with the shares the hypervisor took (steal) and the disk held up (I/O wait),
and the slowest tests of each tier, with the CPU time each used (from the JUnit
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


Sample = tuple[float, int, int, int, int]
BUSY, TOTAL, IOWAIT, STEAL = 1, 2, 3, 4  # a sample's fields after its time


def cpu_samples(path: Path | None) -> list[Sample]:
    """(time, busy, total, I/O-wait and stolen jiffies) of each sample, in time order (busy
    includes stolen); none without a file."""
    rows = []
    for line in path.read_text().splitlines() if path is not None and path.exists() else ():
        fields = line.split("\t")
        if len(fields) == 5:  # the last line may be cut by the kill
            rows.append((float(fields[0]), *(int(field) for field in fields[1:])))
    return rows


def share(samples: list[Sample], start: float, end: float, field: int = BUSY) -> float | None:
    """The share of the CPUs' time in `field` (BUSY, IOWAIT or STEAL) between the first sample
    at or after `start` and the last at or before `end`; None when fewer than two samples fall
    in between."""
    inside = [s for s in samples if start <= s[0] <= end]
    if len(inside) < 2 or inside[-1][TOTAL] == inside[0][TOTAL]:
        return None
    return (inside[-1][field] - inside[0][field]) / (inside[-1][TOTAL] - inside[0][TOTAL])


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
        print(f"\n{'phase':<44} {'start':>8} {'took':>8} {'cpu':>5} {'steal':>5} {'iowait':>6}  status")
        for name, start, end, code in sorted(rows, key=lambda row: row[1]):
            status = "ok" if code == 0 else f"exit {code}"
            print(f"{name:<44} {_clock(start - origin):>8} {_clock(end - start):>8} {_shares(samples, start, end)}"
                  f"  {status}")
        end = max(end for _, _, end, _ in rows)
        print(f"{'total':<44} {'':>8} {_clock(end - origin):>8} {_shares(samples, origin, end)}")
    for report in sorted(args.reports.glob("*.xml")) if args.reports.exists() else ():
        print(f"\nslowest tests of tier {report.stem} (setup, call and teardown; their CPU time):")
        for seconds, name, outcome, cpu in slowest(report, args.slowest):
            used = "" if cpu is None else f"{cpu:7.1f} s cpu"
            print(f"  {seconds:7.1f} s {used:>13}  {name}" + ("" if outcome == "passed" else f"  [{outcome}]"))


def _shares(samples: list[Sample], start: float, end: float) -> str:
    """The busy, stolen and I/O-wait shares of a phase, as the table's three columns."""
    cells = [share(samples, start, end, field) for field in (BUSY, STEAL, IOWAIT)]
    return " ".join(f"{'-' if cell is None else f'{100 * cell:.0f}%':>{width}}"
                    for cell, width in zip(cells, (5, 5, 6)))


def _clock(seconds: float) -> str:
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}:{rest:02d}"


if __name__ == "__main__":
    main()
