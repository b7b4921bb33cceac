"""`hivekeeper up` runs a BlockServer manifest end to end: a backbone, three block servers that
pick disjoint spans on their own, the balancer, and the scripted client, whose generation
through the servers matches the whole model's; then every process is gone."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from conftest import write_manifest
from hivekeeper.local.prometheus import LocalPrometheus
from test_swarm_local import processes_of, silent_dashboard_panels


@pytest.mark.swarm
@pytest.mark.timeout(300)
def test_up_generates_through_the_servers(tmp_path, no_leaked_p2pd):
    # GPT-2-style blocks here; the other BlockServer tests use the example's Llama-style model.
    manifest = write_manifest(tmp_path, {"spec": {"model": {"tiny": {"architecture": "gpt2"}},
                                                  "client": {"newTokens": 12}}}, base="blockserver.yaml")
    run_dir = tmp_path / "run"
    done = subprocess.run([sys.executable, "-m", "hivekeeper", "up", str(manifest), "--run-dir", str(run_dir),
                           "--json", "--prometheus"], capture_output=True, text=True, timeout=280)
    assert done.returncode == 0, done.stderr[-3000:]
    summary = json.loads(done.stdout)
    assert summary["state"] == "completed" and summary["globalStep"] == 12
    assert summary["metrics"]["matchesLocal"] is True
    assert summary["restarts"] == 0
    assert set(summary["processes"]) == {"backbone-blocks-0", "block-server-0", "block-server-1", "block-server-2",
                                         "block-balancer-0", "block-client-0"}
    result = json.loads((run_dir / "result.json").read_text())
    spans = [tuple(int(b) for b in hop.split("@")[0].split(":")) for hop in result["chain"]]
    assert spans[0][0] == 0 and spans[-1][1] == 6 and all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
    assert not processes_of(run_dir)

    # `--prometheus` recorded the run: every BlockServer dashboard panel has data from the moment
    # the client finished (read back from the run's Prometheus data, the run being over).
    finished = (run_dir / "result.json").stat().st_mtime
    with LocalPrometheus.reopen(run_dir) as prometheus:
        silent = silent_dashboard_panels(prometheus.url, "tiny-llama", source="blocks", at=finished)
    assert not silent, f"panels without data: {silent}"
