"""The Grafana dashboards: the files in the chart are the generated ones, every panel's PromQL
parses (promtool), and the variables are the ones the panels use. That every panel returns
data from a real Prometheus scraping a real local swarm is checked in test_swarm_local.py."""

from __future__ import annotations

import json
import shutil
import subprocess

import pytest
import yaml

from conftest import REPO
from hivekeeper.dashboards import DASHBOARDS, expressions, files

CHART_DASHBOARDS = REPO / "charts" / "hivekeeper" / "dashboards"
SUBSTITUTIONS = {"swarm": ".*", "namespace": ".*", "kind": ".*", "__rate_interval": "1m"}


def test_chart_dashboards_are_the_generated_ones():
    on_disk = {p.name: p.read_text() for p in CHART_DASHBOARDS.glob("*.json")}
    assert on_disk == files(), "run `hivekeeper dashboards --out charts/hivekeeper/dashboards`"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool is not installed (apt install prometheus)")
def test_every_panel_query_parses(tmp_path):
    rules = [{"record": f"hivekeeper:panel_{i}", "expr": expr}
             for i, (_, _, _, expr) in enumerate(expressions(SUBSTITUTIONS))]
    path = tmp_path / "panels.yaml"
    path.write_text(yaml.safe_dump({"groups": [{"name": "panels", "rules": rules}]}))
    result = subprocess.run(["promtool", "check", "rules", str(path)], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stdout + result.stderr


def test_panels_use_only_declared_variables_and_name_their_source():
    for dashboard in DASHBOARDS:
        document = json.loads(files()[f"{dashboard.uid}.json"])
        declared = {v["name"] for v in document["templating"]["list"]}
        for panel in document["panels"]:
            assert panel["hivekeeper"]["source"] in ("swarm", "blocks", "experts", "operator"), panel["title"]
            for target in panel["targets"]:
                used = {name for name in ("swarm", "namespace", "kind") if f"${name}" in target["expr"]}
                assert used <= declared, (dashboard.uid, panel["title"], used - declared)
