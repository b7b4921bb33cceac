"""The alerting rules (charts/hivekeeper/files/alerts.yaml): promtool accepts them and their unit
tests pass, every alert is tested both firing and quiet, carries a summary, a description and a
runbook_url whose section in docs/metrics.md says the same, and the chart renders them as a
PrometheusRule only when asked. promtool comes with Debian's `prometheus` package."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest
import yaml

from conftest import REPO
from test_chart import CHART, needs_helm, render

RULES = CHART / "files" / "alerts.yaml"
RULES_TEST = CHART / "files" / "alerts_test.yaml"
CATALOGUE = REPO / "docs" / "metrics.md"  # its Runbooks section: where each runbook_url points
RUNBOOK_BASE = "https://github.com/hivekeeper/hivekeeper/blob/main/docs/metrics.md"
PROMTOOL = shutil.which("promtool")
needs_promtool = pytest.mark.skipif(
    PROMTOOL is None, reason="promtool is not installed: apt-get install prometheus (scripts/install.sh does, as root)")


def promtool(*args: str) -> str:
    result = subprocess.run([PROMTOOL, *args], capture_output=True, text=True, timeout=60, cwd=RULES.parent)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout + result.stderr


def alerts() -> list[dict]:
    return [rule for group in yaml.safe_load(RULES.read_text())["groups"] for rule in group["rules"]]


@needs_promtool
def test_promtool_accepts_the_rules():
    assert f"SUCCESS: {len(alerts())} rules found" in promtool("check", "rules", RULES.name)


@needs_promtool
def test_promtool_unit_tests_pass():
    assert "SUCCESS" in promtool("test", "rules", RULES_TEST.name)


def test_every_alert_is_documented_and_tested_firing_and_quiet():
    cases = [case for test in yaml.safe_load(RULES_TEST.read_text())["tests"] for case in test["alert_rule_test"]]
    for rule in alerts():
        name = rule["alert"]
        assert rule["for"] and rule["labels"]["severity"] in {"warning", "critical"}, name
        assert set(rule["annotations"]) == {"summary", "description", "runbook_url"}, name
        assert rule["annotations"]["summary"] and len(rule["annotations"]["description"]) > 200, name
        outcomes = [bool(case["exp_alerts"]) for case in cases if case["alertname"] == name]
        assert True in outcomes and False in outcomes, f"{name}: needs a case where it fires and one where it does not"


def runbooks() -> dict[str, str]:
    """docs/metrics.md's runbook sections: the alert's name -> its text, on one line."""
    text = CATALOGUE.read_text().split("\n## Runbooks\n", 1)[1]
    sections = re.split(r"^### (\w+)\n", text, flags=re.MULTILINE)[1:]
    return {name: " ".join(body.split()) for name, body in zip(sections[::2], sections[1::2])}


def test_each_runbook_url_is_the_alerts_section_of_the_docs_with_its_description():
    documented = runbooks()
    assert set(documented) == {rule["alert"] for rule in alerts()}
    for rule in alerts():
        name, annotations = rule["alert"], rule["annotations"]
        assert annotations["runbook_url"] == f"{RUNBOOK_BASE}#{name.lower()}", name  # GitHub's anchor of "### Name"
        assert documented[name] == " ".join(annotations["description"].split()), f"docs/metrics.md#{name.lower()}"


@needs_helm
def test_chart_renders_the_rules_as_a_prometheus_rule_only_when_enabled():
    assert "PrometheusRule" not in {d["kind"] for d in render()}
    documents = render("prometheusRule.enabled=true", "prometheusRule.labels.release=kube-prometheus-stack")
    rule = next(d for d in documents if d["kind"] == "PrometheusRule")
    assert rule["apiVersion"] == "monitoring.coreos.com/v1"
    assert rule["metadata"]["namespace"] == "hivekeeper"
    assert rule["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert rule["spec"] == yaml.safe_load(RULES.read_text())

    # Runbooks served elsewhere: every runbook_url moves, nothing else changes.
    moved = next(d for d in render("prometheusRule.enabled=true",
                                   "prometheusRule.runbookBaseUrl=https://docs.example.org/hivekeeper/alerts")
                 if d["kind"] == "PrometheusRule")
    urls = [r["annotations"]["runbook_url"] for g in moved["spec"]["groups"] for r in g["rules"]]
    assert urls == [f"https://docs.example.org/hivekeeper/alerts#{r['alert'].lower()}" for r in alerts()]
    assert moved["spec"] == yaml.safe_load(
        RULES.read_text().replace(RUNBOOK_BASE, "https://docs.example.org/hivekeeper/alerts"))
