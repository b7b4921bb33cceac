#!/usr/bin/env python3
"""CI's closing summary: how long each phase took (from the phases file `scripts/phases.sh`
writes) and the slowest tests of each tier (from the JUnit XML pytest writes per tier).

    scripts/ci_report.py PHASES_FILE REPORTS_DIR [--slowest N]
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


def slowest(report: Path, count: int) -> list[tuple[float, str, str]]:
    """(seconds, test id, outcome) of the slowest test cases: setup, call and teardown together."""
    cases = []
    for case in ET.parse(report).getroot().iter("testcase"):
        outcome = "failed" if case.find("failure") is not None or case.find("error") is not None else (
            "skipped" if case.find("skipped") is not None else "passed")
        name = f"{case.get('classname', '').replace('.', '/')}.py::{case.get('name')}"
        cases.append((float(case.get("time") or 0.0), name, outcome))
    return sorted(cases, reverse=True)[:count]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("phases", type=Path)
    parser.add_argument("reports", type=Path)
    parser.add_argument("--slowest", type=int, default=10)
    args = parser.parse_args()
    rows = phases(args.phases)
    if rows:
        origin = min(start for _, start, _, _ in rows)
        print(f"\n{'phase':<44} {'start':>8} {'took':>8}  status")
        for name, start, end, code in sorted(rows, key=lambda row: row[1]):
            status = "ok" if code == 0 else f"exit {code}"
            print(f"{name:<44} {_clock(start - origin):>8} {_clock(end - start):>8}  {status}")
        end = max(end for _, _, end, _ in rows)
        print(f"{'total':<44} {'':>8} {_clock(end - origin):>8}")
    for report in sorted(args.reports.glob("*.xml")) if args.reports.exists() else ():
        print(f"\nslowest tests of tier {report.stem} (setup, call and teardown):")
        for seconds, name, outcome in slowest(report, args.slowest):
            print(f"  {seconds:7.1f} s  {name}" + ("" if outcome == "passed" else f"  [{outcome}]"))


def _clock(seconds: float) -> str:
    minutes, rest = divmod(int(round(seconds)), 60)
    return f"{minutes}:{rest:02d}"


if __name__ == "__main__":
    main()
