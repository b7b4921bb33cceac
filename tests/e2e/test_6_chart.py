"""The chart on the real cluster, as an operator of the cluster uses it: `helm upgrade` upgrades
the CRDs (from an older chart, and the first time from 0.1.0, whose CRDs sat in the chart's crds/
folder, with --take-ownership), values.schema.json refuses a bad value before anything changes,
people bound to the built-in edit and view roles get the three kinds by aggregation, and the
ServiceMonitor labels of the values reach a resource's ServiceMonitor. Each test leaves the
release as `release` installed it."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any, Iterator

import pytest
import yaml

from e2e.support import (NAMESPACE, OPERATOR_NAMESPACE, RELEASE, REPO, Cluster, applied, example, install_release,
                         wait_for)

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(600)]

CHART = REPO / "charts" / "hivekeeper"
CRDS = ("swarms.hivekeeper.dev", "blockservers.hivekeeper.dev", "expertpools.hivekeeper.dev")
SWARMS = "swarms.hivekeeper.dev"
KINDS = ("swarms", "blockservers", "expertpools")
OWNERSHIP_ANNOTATIONS = ("meta.helm.sh/release-name", "meta.helm.sh/release-namespace")


def chart_crd(name: str) -> dict[str, Any]:
    return yaml.safe_load((CHART / "files" / "crds" / f"{name}.yaml").read_text())


def live_crd(cluster: Cluster, name: str) -> dict[str, Any]:
    return cluster.get("customresourcedefinition", name, namespace=None)


def printer_columns(crd: dict[str, Any]) -> list[str]:
    return [column["name"] for column in crd["spec"]["versions"][0]["additionalPrinterColumns"]]


def upgrade(cluster: Cluster, chart: Path, *flags: str, check: bool = True):
    return cluster.helm("upgrade", RELEASE, str(chart), "-n", OPERATOR_NAMESPACE, *flags, "--wait", "--timeout", "5m",
                        check=check)


def revision(cluster: Cluster) -> int:
    return json.loads(cluster.helm("status", RELEASE, "-n", OPERATOR_NAMESPACE, "-o", "json").stdout)["version"]


def adopt_crds(cluster: Cluster) -> None:
    """The manual adoption docs/upgrading.md gives for Helm before 3.17 (no --take-ownership)."""
    for name in CRDS:
        cluster.kubectl("label", "--overwrite", "crd", name, "app.kubernetes.io/managed-by=Helm")
        cluster.kubectl("annotate", "--overwrite", "crd", name, f"meta.helm.sh/release-name={RELEASE}",
                        f"meta.helm.sh/release-namespace={OPERATOR_NAMESPACE}")


@pytest.fixture
def restored(cluster: Cluster, release: str) -> Iterator[None]:
    """The release as `release` installed it afterwards, whatever the test left."""
    yield
    if all(cluster.kubectl("get", "crd", name, check=False).returncode == 0 for name in CRDS):
        adopt_crds(cluster)
    install_release(cluster)


def older_chart(tmp_path: Path, without_column: str) -> Path:
    """A copy of the chart whose Swarm CRD lacks one printer column, as an older chart's did."""
    chart = tmp_path / "hivekeeper"
    shutil.copytree(CHART, chart)
    path = chart / "files" / "crds" / f"{SWARMS}.yaml"
    crd = yaml.safe_load(path.read_text())
    version = crd["spec"]["versions"][0]
    version["additionalPrinterColumns"] = [
        column for column in version["additionalPrinterColumns"] if column["name"] != without_column]
    path.write_text(yaml.safe_dump(crd, sort_keys=False))
    return chart


def chart_0_1_0(tmp_path: Path, without_column: str) -> Path:
    """The chart as 0.1.0 laid it out: the CRDs in its crds/ folder (installed once, never
    upgraded), no CRD templates, no values schema and none of the values added since."""
    chart = older_chart(tmp_path, without_column)
    (chart / "files" / "crds").rename(chart / "crds")
    for added in ("templates/crds.yaml", "templates/aggregated-roles.yaml", "values.schema.json"):
        (chart / added).unlink()
    values = yaml.safe_load((chart / "values.yaml").read_text())
    for key in ("nameOverride", "fullnameOverride", "crds", "swarmServiceMonitorLabels"):
        values.pop(key)
    values["rbac"].pop("aggregatedRoles")
    values["prometheusRule"].pop("runbookBaseUrl")
    (chart / "values.yaml").write_text(yaml.safe_dump(values, sort_keys=False))
    chart_yaml = yaml.safe_load((chart / "Chart.yaml").read_text())
    (chart / "Chart.yaml").write_text(yaml.safe_dump({**chart_yaml, "version": "0.1.0"}, sort_keys=False))
    return chart


def test_helm_upgrade_upgrades_the_crds(cluster: Cluster, restored, tmp_path):
    column = printer_columns(chart_crd(SWARMS))[-2]
    upgrade(cluster, older_chart(tmp_path, column), "--reuse-values")
    assert column not in printer_columns(live_crd(cluster, SWARMS))

    upgrade(cluster, CHART, "--reuse-values")
    live = live_crd(cluster, SWARMS)
    assert live["spec"]["versions"] == chart_crd(SWARMS)["spec"]["versions"]
    assert column in printer_columns(live)
    assert live["metadata"]["annotations"]["helm.sh/resource-policy"] == "keep"


def test_first_upgrade_from_the_crds_folder_of_0_1_0_takes_ownership(cluster: Cluster, restored, tmp_path):
    column = printer_columns(chart_crd(SWARMS))[-2]
    # Down to 0.1.0's layout: the CRDs leave the release's manifest, and the keep policy keeps them.
    repository, _, tag = cluster.image.rpartition(":")
    upgrade(cluster, chart_0_1_0(tmp_path, column), "--reset-values", "--set", f"image.repository={repository}",
            "--set", f"image.tag={tag}", "--set", "image.pullPolicy=Never", "--set", "resyncSeconds=5")
    assert all(cluster.kubectl("get", "crd", name, check=False).returncode == 0 for name in CRDS)
    # What a 0.1.0 install left: CRDs made from crds/ carry no release of their own, with 0.1.0's schema.
    for name in CRDS:
        cluster.kubectl("annotate", "crd", name, *(f"{key}-" for key in OWNERSHIP_ANNOTATIONS),
                        "helm.sh/resource-policy-")
        cluster.kubectl("label", "crd", name, "app.kubernetes.io/managed-by-", "helm.sh/chart-")
    position = printer_columns(live_crd(cluster, SWARMS)).index(column)
    cluster.kubectl("patch", "crd", SWARMS, "--type=json", "-p", json.dumps(
        [{"op": "remove", "path": f"/spec/versions/0/additionalPrinterColumns/{position}"}]))
    before = revision(cluster)

    # A plain upgrade stops: Helm will not take over objects another tool (its own crds/ step) made.
    refused = upgrade(cluster, CHART, "--reset-then-reuse-values", check=False)
    assert refused.returncode != 0 and "invalid ownership metadata" in refused.stderr, refused.stderr
    assert column not in printer_columns(live_crd(cluster, SWARMS))

    upgrade(cluster, CHART, "--reset-then-reuse-values", "--take-ownership")
    assert revision(cluster) > before
    for name in CRDS:
        live = live_crd(cluster, name)
        assert live["spec"]["versions"] == chart_crd(name)["spec"]["versions"], name
        annotations = live["metadata"]["annotations"]
        assert {key: annotations.get(key) for key in (*OWNERSHIP_ANNOTATIONS, "helm.sh/resource-policy")} == {
            "meta.helm.sh/release-name": RELEASE, "meta.helm.sh/release-namespace": OPERATOR_NAMESPACE,
            "helm.sh/resource-policy": "keep"}, name
    # The values 0.1.0 did not have come from the new chart's defaults.
    assert cluster.kubectl("get", "clusterrole", f"{RELEASE}-editor", check=False).returncode == 0


def test_a_bad_value_is_refused_before_anything_changes(cluster: Cluster, restored):
    before = revision(cluster)
    for value, field in (("swarmServiceMonitors=bogus", "swarmServiceMonitors"), ("replicaCount=two", "replicaCount"),
                         ("crds.install=maybe", "crds.install")):
        refused = upgrade(cluster, CHART, "--reuse-values", "--set", value, check=False)
        assert refused.returncode != 0, value
        assert "don't meet the specifications of the schema" in refused.stderr, refused.stderr
        assert field in refused.stderr, refused.stderr
    assert revision(cluster) == before
    status = json.loads(cluster.helm("status", RELEASE, "-n", OPERATOR_NAMESPACE, "-o", "json").stdout)
    assert status["info"]["status"] == "deployed"


def can_i(cluster: Cluster, user: str, verb: str, resource: str, subresource: str | None = None) -> bool:
    args = ["auth", "can-i", verb, f"{resource}.hivekeeper.dev", "-n", NAMESPACE, f"--as={user}"]
    if subresource:
        args.append(f"--subresource={subresource}")
    answer = cluster.kubectl(*args, check=False).stdout.split()
    assert answer[:1] in (["yes"], ["no"]), answer
    return answer[0] == "yes"


def test_editors_and_viewers_get_the_three_kinds_through_the_built_in_roles(cluster: Cluster, restored):
    bindings = {"hk-e2e-editor": ("edit", "alice"), "hk-e2e-viewer": ("view", "bob")}
    for binding, (role, user) in bindings.items():
        cluster.kubectl("create", "rolebinding", binding, f"--clusterrole={role}", f"--user={user}", "-n", NAMESPACE)
    try:
        # The controller-manager aggregates the chart's roles into edit and view.
        wait_for(lambda: can_i(cluster, "alice", "create", "swarms") and can_i(cluster, "bob", "list", "swarms"), 60,
                 "the aggregated rules to reach edit and view")
        for kind in KINDS:
            assert all(can_i(cluster, "alice", verb, kind) for verb in ("create", "get", "list", "watch", "patch",
                                                                        "update", "delete")), kind
            assert can_i(cluster, "alice", "patch", kind, "scale"), kind  # kubectl scale
            assert not can_i(cluster, "alice", "patch", kind, "status"), kind  # status is the operator's
            assert all(can_i(cluster, "bob", verb, kind) for verb in ("get", "list", "watch")), kind
            assert not any(can_i(cluster, "bob", verb, kind) for verb in ("create", "patch", "update", "delete")), kind
            assert not can_i(cluster, "carol", "get", kind), kind  # bound to nothing
        # And for real, as the API server decides a request (validated, not stored).
        swarm = yaml.safe_dump(example("swarm-digits.yaml", {"metadata": {"name": "by-alice", "namespace": NAMESPACE}}))
        assert cluster.kubectl("create", "--dry-run=server", "-f", "-", "--as=alice", input=swarm).returncode == 0
        denied = cluster.kubectl("create", "--dry-run=server", "-f", "-", "--as=bob", input=swarm, check=False)
        assert denied.returncode != 0 and "forbidden" in denied.stderr, denied.stderr
    finally:
        cluster.kubectl("delete", "rolebinding", *bindings, "-n", NAMESPACE, check=False)


SERVICE_MONITOR_CRD = {
    "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
    "metadata": {"name": "servicemonitors.monitoring.coreos.com"},
    "spec": {"group": "monitoring.coreos.com", "scope": "Namespaced",
             "names": {"kind": "ServiceMonitor", "listKind": "ServiceMonitorList", "plural": "servicemonitors",
                       "singular": "servicemonitor"},
             "versions": [{"name": "v1", "served": True, "storage": True, "schema": {"openAPIV3Schema": {
                 "type": "object", "x-kubernetes-preserve-unknown-fields": True}}}]},
}


@pytest.fixture
def service_monitor_crd(cluster: Cluster) -> Iterator[None]:
    """The Prometheus Operator's ServiceMonitor kind, as far as the API server needs it."""
    cluster.kubectl("apply", "-f", "-", input=yaml.safe_dump(SERVICE_MONITOR_CRD))
    cluster.kubectl("wait", "--for=condition=Established", f"crd/{SERVICE_MONITOR_CRD['metadata']['name']}",
                    "--timeout=60s")
    yield
    cluster.kubectl("delete", "crd", SERVICE_MONITOR_CRD["metadata"]["name"], "--wait=true", check=False)


def test_service_monitor_labels_from_the_values(cluster: Cluster, service_monitor_crd, restored):
    upgrade(cluster, CHART, "--reuse-values", "--set", "swarmServiceMonitorLabels.release=kube-prometheus-stack")
    swarm = example("swarm-digits.yaml", {"metadata": {"name": "monitored"},
                                          "spec": {"trainers": {"replicas": 0}, "auxiliary": {"replicas": 0},
                                                   "balancer": {"enabled": False}}})
    with applied(cluster, swarm):
        monitor = wait_for(lambda: cluster.kubectl("get", "servicemonitor", "monitored", "-n", NAMESPACE, "-o", "json",
                                                   check=False).stdout, 90, "the Swarm's ServiceMonitor")
        labels = json.loads(monitor)["metadata"]["labels"]
        assert labels["release"] == "kube-prometheus-stack"
        assert labels["hivekeeper.dev/swarm"] == "monitored"
