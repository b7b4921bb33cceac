"""CI's closing summary (scripts/ci_report.py): each phase's CPU use, stolen and I/O-wait
shares from /proc/stat samples,
and each slow test's CPU time from the JUnit property tests/helpers/cpu_time.py records."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "ci_report.py"
spec = importlib.util.spec_from_file_location("ci_report", SCRIPT)
assert spec and spec.loader
ci_report = importlib.util.module_from_spec(spec)
spec.loader.exec_module(ci_report)


def test_a_phases_cpu_use_comes_from_the_samples_inside_it(tmp_path):
    samples = tmp_path / "cpu.tsv"
    # busy/total/iowait/steal jiffies: 50 of 200 busy in the first 5 s (10 stolen), 100 of 200
    # in the next (20 waiting for the disk); a cut last line
    samples.write_text("0.0\t0\t0\t0\t0\n5.0\t50\t200\t0\t10\n10.0\t150\t400\t20\t10\n12.0\t1")
    rows = ci_report.cpu_samples(samples)
    assert len(rows) == 3
    assert ci_report.share(rows, 0, 10) == 150 / 400
    assert ci_report.share(rows, 4, 10) == 100 / 200
    assert ci_report.share(rows, 0, 5, ci_report.STEAL) == 10 / 200
    assert ci_report.share(rows, 5, 10, ci_report.IOWAIT) == 20 / 200
    assert ci_report.share(rows, 6, 10) is None  # one sample inside: no interval
    assert ci_report.cpu_samples(None) == [] and ci_report.cpu_samples(tmp_path / "none") == []


def test_the_table_shows_cpu_use_and_the_slowest_tests_cpu_time(tmp_path):
    phases = tmp_path / "phases.tsv"
    phases.write_text("tier: unit\t0.0\t10.0\t0\ntier: swarm\t10.0\t20.0\t1\n")
    samples = tmp_path / "cpu.tsv"
    samples.write_text("0.0\t0\t0\t0\t0\n10.0\t180\t200\t0\t60\n20.0\t280\t400\t40\t60\n")
    reports = tmp_path / "reports"
    reports.mkdir()
    (reports / "swarm.xml").write_text(
        '<testsuites><testsuite name="pytest">'
        '<testcase classname="tests.test_a" name="test_slow" time="12.5">'
        '<properties><property name="cpu_seconds" value="20.1"/></properties></testcase>'
        '<testcase classname="tests.test_a" name="test_quick" time="0.5"><failure message="x"/></testcase>'
        '</testsuite></testsuites>')
    out = subprocess.run([sys.executable, str(SCRIPT), str(phases), str(reports), "--cpu", str(samples)],
                         capture_output=True, text=True, check=True).stdout
    lines = out.splitlines()
    assert any(line.startswith("tier: unit") and " 90%   30%     0%  ok" in line for line in lines), out
    assert any(line.startswith("tier: swarm") and " 50%    0%    20%  exit 1" in line for line in lines), out
    assert any("12.5 s" in line and "20.1 s cpu" in line and "tests/test_a.py::test_slow" in line for line in lines), out
    assert any("tests/test_a.py::test_quick  [failed]" in line and "cpu" not in line for line in lines), out
