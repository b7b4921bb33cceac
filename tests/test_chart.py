"""The Helm chart: lint clean, what it renders validates against Kubernetes 1.33's own schemas
(kubernetes-validate --strict), values.schema.json refuses bad values, the CRDs are templates
that `helm upgrade` upgrades. helm comes from scripts/get-helm.sh (.tools/bin)."""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from conftest import REPO

CHART = REPO / "charts" / "hivekeeper"
K8S_VERSION = "1.33.0"
CHART_META = yaml.safe_load((CHART / "Chart.yaml").read_text())


def find_helm() -> str | None:
    local = REPO / ".tools" / "bin" / "helm"
    return str(local) if local.exists() else shutil.which("helm")


HELM = find_helm()
needs_helm = pytest.mark.skipif(HELM is None, reason="helm is not installed: run scripts/get-helm.sh")


def run_helm(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([HELM, *args], capture_output=True, text=True, timeout=120)


def helm(*args: str) -> str:
    result = run_helm(*args)
    assert result.returncode == 0, result.stdout + result.stderr
    return result.stdout


def render(*values: str) -> list[dict]:
    flags = [item for value in values for item in ("--set", value)]
    text = helm("template", "hk", str(CHART), "--namespace", "hivekeeper", *flags)
    return [doc for doc in yaml.safe_load_all(text) if doc]


def kinds(documents: list[dict]) -> list[tuple[str, str]]:
    return [(d["kind"], d["metadata"]["name"]) for d in documents]


@needs_helm
def test_helm_lint_is_clean():
    output = helm("lint", str(CHART), "--strict")
    assert "0 chart(s) failed" in output
    assert "[WARNING]" not in output and "[ERROR]" not in output


VALUE_SETS = {
    "defaults": (),
    "namespaced": ("watchNamespaces={ml,research}",),
    "monitoring": ("serviceMonitor.enabled=true", "swarmServiceMonitors=off", "imagePullSecrets={regcred}",
                   "grafanaDashboards.enabled=true"),
    "gpu-image": ("swarmImage.repository=registry.example/hivekeeper-cuda", "swarmImage.tag=0.1.0-cu128"),
    "overrides": ("fullnameOverride=ops", "crds.install=false", "rbac.aggregatedRoles=false",
                  "swarmServiceMonitorLabels.release=kube-prometheus-stack", "prometheusRule.enabled=true",
                  "prometheusRule.runbookBaseUrl=https://docs.example.org/hivekeeper/alerts"),
}


@needs_helm
@pytest.mark.parametrize("name", sorted(VALUE_SETS))
def test_rendered_chart_validates_strictly_against_kubernetes_1_33(name, tmp_path):
    validator = shutil.which("kubernetes-validate") or (
        str(Path(__import__("sys").executable).parent / "kubernetes-validate"))
    if not Path(validator).exists():
        pytest.skip("kubernetes-validate is not installed: pip install -e '.[operator-test]'")
    documents = render(*VALUE_SETS[name])
    path = tmp_path / "rendered.yaml"
    path.write_text(yaml.safe_dump_all(documents))
    result = subprocess.run([validator, "--strict", "-k", K8S_VERSION, str(path)], capture_output=True, text=True,
                            timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    assert "ERROR" not in result.stdout + result.stderr
    # Every kind is known to Kubernetes 1.33 except the Prometheus Operator's.
    unknown = [line for line in (result.stdout + result.stderr).splitlines() if "Couldn't find schema" in line]
    assert all("ServiceMonitor" in line or "PrometheusRule" in line for line in unknown), unknown


@needs_helm
def test_chart_installs_the_crds_the_operator_and_its_rbac():
    documents = render()
    assert ("CustomResourceDefinition", "swarms.hivekeeper.dev") in kinds(documents)
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    container = deployment["spec"]["template"]["spec"]["containers"][0]
    assert container["command"] == ["hivekeeper-operator"]
    image = f"hivekeeper:{CHART_META['appVersion']}"
    assert container["image"] == image
    env = {e["name"]: e["value"] for e in container["env"]}
    assert env["HIVEKEEPER_WATCH_NAMESPACES"] == "" and env["HIVEKEEPER_IMAGE"] == image
    assert {p["path"] for p in (container["livenessProbe"]["httpGet"], container["readinessProbe"]["httpGet"])} == {
        "/healthz", "/readyz"}
    assert deployment["spec"]["template"]["spec"]["securityContext"]["runAsNonRoot"] is True
    assert ("ClusterRole", "hk-hivekeeper") in kinds(documents)


@needs_helm
def test_operator_replicas_elect_a_leader_and_are_evicted_one_at_a_time():
    documents = render()
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    # Two replicas, rolled one by one: a standby is safe, so a rollout never leaves none.
    assert deployment["spec"]["replicas"] == 2 and deployment["spec"]["strategy"]["type"] == "RollingUpdate"
    env = {e["name"]: e["value"] for e in deployment["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert (env["HIVEKEEPER_LEADER_ELECT"], env["HIVEKEEPER_LEADER_ELECT_NAMESPACE"],
            env["HIVEKEEPER_LEADER_ELECT_LEASE"]) == ("true", "hivekeeper", "hk-hivekeeper-leader")
    budget = next(d for d in documents if d["kind"] == "PodDisruptionBudget")
    assert budget["spec"] == {"maxUnavailable": 1,
                              "selector": {"matchLabels": deployment["spec"]["selector"]["matchLabels"]}}
    # The Lease: in the release's namespace only, and no other Lease but its own.
    role = next(d for d in documents if d["kind"] == "Role")
    assert role["metadata"] == {**role["metadata"], "name": "hk-hivekeeper-leader-election", "namespace": "hivekeeper"}
    assert role["rules"] == [
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "verbs": ["create"]},
        {"apiGroups": ["coordination.k8s.io"], "resources": ["leases"], "resourceNames": ["hk-hivekeeper-leader"],
         "verbs": ["get", "update"]}]
    assert [k for k in kinds(documents) if k[0] in ("Role", "RoleBinding")] == [
        ("Role", "hk-hivekeeper-leader-election"), ("RoleBinding", "hk-hivekeeper-leader-election")]
    assert not [d for d in render("podDisruptionBudget.enabled=false") if d["kind"] == "PodDisruptionBudget"]


def operator_role(documents: list[dict]) -> dict:
    return next(d for d in documents if d["kind"] == "ClusterRole" and d["metadata"]["name"] == "hk-hivekeeper")


def rules(document: dict) -> dict[tuple[str, str], set[str]]:
    out = {}
    for rule in document["rules"]:
        for group in rule["apiGroups"]:
            for resource in rule["resources"]:
                out[(group, resource)] = set(rule["verbs"])
    return out


@needs_helm
def test_rbac_is_least_privilege():
    role = rules(operator_role(render()))
    # Nothing cluster-scoped, no wildcards, no rights to change RBAC or CRDs; pods only listed (a
    # finished Job's pod holds its run's final figures in its termination message).
    assert all("*" not in verbs for verbs in role.values())
    assert not {r for (_, r) in role} & {"nodes", "namespaces", "customresourcedefinitions", "roles",
                                         "clusterroles", "rolebindings", "clusterrolebindings"}
    assert role[("", "pods")] == {"list"}
    assert role[("hivekeeper.dev", "swarms")] == {"get", "list", "watch", "patch"}
    assert role[("hivekeeper.dev", "swarms/status")] == {"get", "patch", "update"}
    for plural in ("blockservers", "expertpools"):
        assert role[("hivekeeper.dev", plural)] == {"get", "list", "watch", "patch"}
        assert role[("hivekeeper.dev", f"{plural}/status")] == {"get", "patch", "update"}
    assert role[("", "secrets")] == {"get", "create", "patch", "delete"}  # never list or watch secrets
    assert role[("", "events")] == {"create", "patch"}  # a repeated Event's count is patched
    assert ("monitoring.coreos.com", "servicemonitors") in role

    # Watching namespaces: a Role in each, no cluster-wide rights (the people's roles grant nothing by themselves).
    documents = render("watchNamespaces={ml,research}", "swarmServiceMonitors=off")
    assert [k for k in kinds(documents) if k[0].startswith("Cluster")] == [
        ("ClusterRole", "hk-hivekeeper-editor"), ("ClusterRole", "hk-hivekeeper-viewer")]
    roles = [d for d in documents if d["kind"] == "Role" and d["metadata"]["name"] == "hk-hivekeeper"]
    assert sorted(r["metadata"]["namespace"] for r in roles) == ["ml", "research"]
    assert ("monitoring.coreos.com", "servicemonitors") not in rules(roles[0])
    bindings = [d for d in documents if d["kind"] == "RoleBinding"]
    assert {b["subjects"][0]["namespace"] for b in bindings} == {"hivekeeper"}
    env = {e["name"]: e["value"] for e in next(d for d in documents if d["kind"] == "Deployment")
           ["spec"]["template"]["spec"]["containers"][0]["env"]}
    assert env["HIVEKEEPER_WATCH_NAMESPACES"] == "ml,research"


def recording_kube(api_client):
    """A Kube that notes each request as the (group, resource, verb) that RBAC checks; discovery
    (GET apis/GROUP/VERSION) needs no rule."""
    from hivekeeper_operator.kube import Kube

    method_verbs = {"POST": "create", "PATCH": "patch", "PUT": "update", "DELETE": "delete"}

    class Recording(Kube):
        def __init__(self, client):
            super().__init__(client)
            self.requests: set[tuple[str, str, str]] = set()

        def request(self, method, path, body=None, content_type=None, query=None):
            parts = path.strip("/").split("/")
            group, rest = ("", parts[2:]) if parts[0] == "api" else (parts[1], parts[3:])
            if rest[:1] == ["namespaces"] and len(rest) > 2:
                rest = rest[2:]
            if rest:
                resource = "/".join(rest[:1] + rest[2:3])  # plural, or plural/subresource
                self.requests.add((group, resource, method_verbs.get(method) or ("get" if rest[1:] else "list")))
                if (content_type or "").startswith("application/apply-patch"):  # an apply may create
                    self.requests.add((group, resource, "create"))
            return super().request(method, path, body, content_type, query)

    return Recording(api_client)


# Each example, then an edit that makes the operator patch and delete children too.
RECONCILED = [
    ("swarm-digits.yaml", {}, {"spec": {"trainers": {"replicas": 5}, "monitor": {"enabled": False},
                                   "stopping": {"targetMetric": None}}}),
    ("swarm-digits-volunteers.yaml", {}, {"spec": {"trainers": {"replicas": 5}}}),
    ("blockserver.yaml", {}, {"spec": {"servers": {"replicas": 4}, "balancer": {"enabled": False}}}),
    ("expertpool.yaml", {"spec": {"checkpoint": {"volumeClaim": {"size": "2Gi"}}}},
     {"spec": {"servers": {"replicas": 3}}}),
]


@needs_helm
def test_rbac_covers_every_child_the_operator_writes(tmp_path):
    """Every request the operator's reconcilers make, for each kind (an ExpertPool with a checkpoint
    claim among them) when it is made and when it is edited, is allowed by the chart's rules, and
    the checkpoint claim gets exactly the verbs the operator uses. Also every child kind the
    planner makes (each can be deleted when no longer wanted), edit or not, and the owner scan
    may list the kinds it scans."""
    pytest.importorskip("kopf")
    pytest.importorskip("kmock")
    import kubernetes

    from conftest import EXAMPLES, deep_update
    from hivekeeper.spec.crd import KINDS, crd
    from hivekeeper_operator.kube import Kube
    from hivekeeper_operator.metrics import OperatorMetrics
    from hivekeeper_operator.plan import SCANNED
    from hivekeeper_operator.pods import WorkloadSettings
    from hivekeeper_operator.reconcile import API, OperatorConfig, controllers
    from kube_emulator import EmulatedCluster

    role = rules(operator_role(render()))
    with EmulatedCluster(tmp_path, crds=[crd(kind) for kind in sorted(KINDS)], service_monitors=True) as cluster:
        api_client = kubernetes.config.new_client_from_config(config_file=str(cluster.kubeconfig))
        kube, user = recording_kube(api_client), Kube(api_client)
        config = OperatorConfig(settings=WorkloadSettings(image="hivekeeper:test"), metrics_port=None,
                                status_reader=lambda namespace, name, url: None)
        reconcilers = controllers(kube, config, OperatorMetrics())
        for example, changes, edit in RECONCILED:
            document = deep_update(yaml.safe_load((EXAMPLES / example).read_text()), changes)
            document["metadata"]["namespace"] = "default"
            name = document["metadata"]["name"]
            user.create(document)
            assert reconcilers[document["kind"]].reconcile("default", name) not in (None, "Invalid")
            user.merge_patch(user.path(API, document["kind"], "default", name), edit)
            assert reconcilers[document["kind"]].reconcile("default", name) not in (None, "Invalid")

    made: dict[tuple[str, str], set[str]] = {}
    for group, resource, verb in kube.requests:
        made.setdefault((group, resource), set()).add(verb)
    assert {"create", "patch", "delete"} <= made[("apps", "statefulsets")]  # the edits were applied
    denied = {key: verbs - role.get(key, set()) for key, verbs in made.items() if not verbs <= role.get(key, set())}
    assert denied == {}
    assert role[("", "persistentvolumeclaims")] == made[("", "persistentvolumeclaims")] == {"get", "create"}

    plural = {"Secret": "secrets", "ConfigMap": "configmaps", "Service": "services", "StatefulSet": "statefulsets",
              "Job": "jobs", "PodDisruptionBudget": "poddisruptionbudgets", "ServiceMonitor": "servicemonitors"}
    for api_version, kind in {("v1", "Secret"), ("v1", "ConfigMap"), ("v1", "Service"), ("apps/v1", "StatefulSet"),
                              ("batch/v1", "Job"), ("policy/v1", "PodDisruptionBudget"),
                              ("monitoring.coreos.com/v1", "ServiceMonitor")}:
        group = api_version.rpartition("/")[0]
        assert {"get", "create", "patch", "delete"} <= role[(group, plural[kind])], kind
    for api_version, kind in SCANNED:
        assert "list" in role[(api_version.rpartition("/")[0], plural[kind])], kind


@needs_helm
def test_notes_tell_the_user_what_to_apply_next(tmp_path):
    # `helm install --dry-run` wants a cluster; render NOTES.txt through a template instead.
    chart = tmp_path / "hivekeeper"
    shutil.copytree(CHART, chart)
    shutil.copy(chart / "templates" / "NOTES.txt", chart / "notes.txt")
    (chart / "templates" / "zz-notes.yaml").write_text(
        'apiVersion: v1\nkind: ConfigMap\nmetadata: {name: notes}\n'
        'data:\n  notes: {{ tpl (.Files.Get "notes.txt") . | quote }}\n')
    text = helm("template", "hk", str(chart), "--namespace", "hivekeeper", "--show-only", "templates/zz-notes.yaml")
    notes = yaml.safe_load(text)["data"]["notes"]
    assert "kubectl apply -f examples/swarm-digits.yaml" in notes
    assert "kubectl get swarms" in notes
    assert "kubectl scale swarm/digits --replicas=5" in notes
    assert "curl localhost:8080/metrics" in notes


@needs_helm
def test_dashboards_ship_as_configmaps_for_the_grafana_sidecar():
    from hivekeeper.dashboards import files

    assert not [d for d in render() if d["kind"] == "ConfigMap"]  # off by default
    maps = [d for d in render("grafanaDashboards.enabled=true", "grafanaDashboards.namespace=monitoring")
            if d["kind"] == "ConfigMap"]
    shipped = {name: json.loads(text) for m in maps for name, text in m["data"].items()}
    assert shipped == {name: json.loads(text) for name, text in files().items()}
    assert all(m["metadata"]["labels"]["grafana_dashboard"] == "1" for m in maps)
    assert {m["metadata"]["namespace"] for m in maps} == {"monitoring"}


# -- the CRDs: templates, so that `helm upgrade` upgrades them ---------------------------------


def crd_documents(documents: list[dict]) -> dict[str, dict]:
    return {d["metadata"]["name"]: d for d in documents if d["kind"] == "CustomResourceDefinition"}


def test_the_chart_has_no_crds_folder():
    # Helm installs a chart's crds/ once and never upgrades it; with templates/crds.yaml beside it
    # the same CRDs would be created twice and the install would fail.
    assert not (CHART / "crds").exists()


@needs_helm
def test_crds_render_as_the_generated_ones_kept_on_uninstall():
    # The chart's files/crds: generated, the same as crds/ (tests/test_crds.py), rendered as they are.
    crds = crd_documents(render())
    generated = {p.name.removesuffix(".yaml"): yaml.safe_load(p.read_text())
                 for p in (CHART / "files" / "crds").glob("*.yaml")}
    assert set(crds) == set(generated) == {"swarms.hivekeeper.dev", "blockservers.hivekeeper.dev",
                                           "expertpools.hivekeeper.dev"}
    for name, crd in crds.items():
        assert {k: v for k, v in crd.items() if k != "metadata"} == {
            k: v for k, v in generated[name].items() if k != "metadata"}, name
        assert crd["metadata"]["annotations"] == {"helm.sh/resource-policy": "keep"}
        assert crd["metadata"]["labels"] == {**generated[name]["metadata"]["labels"],
                                             "helm.sh/chart": f"hivekeeper-{CHART_META['version']}"}

    assert crd_documents(render("crds.install=false")) == {}
    assert all("annotations" not in crd["metadata"] for crd in crd_documents(render("crds.keep=false")).values())


# -- values.schema.json ------------------------------------------------------------------------


@needs_helm
@pytest.mark.parametrize(("value", "complaint"), [
    ("swarmServiceMonitors=bogus", "swarmServiceMonitors"),
    ("swarmServiceMonitorLabels.release=a\\,b", "swarmServiceMonitorLabels.release"),
    ("watchNamespaces={ML}", "watchNamespaces"),
    ("metrics.port=0", "metrics.port"),
    ("resyncSeconds=0", "resyncSeconds"),
    ("image.pullPolicy=Sometimes", "image.pullPolicy"),
    ("crds.install=yes", "crds.install"),
    ("rbac.aggregatedRole=false", "aggregatedRole"),  # a misspelt key
    ("replicas=2", "replicas"),
    ("prometheusRule.runbookBaseUrl=docs/metrics.md", "runbookBaseUrl"),
])
def test_schema_refuses_bad_values(value, complaint):
    result = run_helm("template", "hk", str(CHART), "--set", value)
    assert result.returncode != 0 and result.stdout == "", value
    assert "don't meet the specifications of the schema" in result.stderr and complaint in result.stderr, result.stderr


@needs_helm
def test_every_default_value_is_in_the_schema():
    schema = json.loads((CHART / "values.schema.json").read_text())
    defaults = yaml.safe_load((CHART / "values.yaml").read_text())

    def undescribed(values: dict, node: dict, path: str) -> list[str]:
        out = []
        for key, value in values.items():
            child = (node.get("properties") or {}).get(key)
            if child is None:
                out.append(path + key)
            elif isinstance(value, dict) and "properties" in child:
                out += undescribed(value, child, f"{path}{key}.")
        return out

    assert undescribed(defaults, schema, "") == []


# -- names, and roles for people ---------------------------------------------------------------


@needs_helm
def test_name_overrides():
    assert {name for kind, name in kinds(render("fullnameOverride=ops")) if kind != "CustomResourceDefinition"} == {
        "ops", "ops-metrics", "ops-editor", "ops-viewer", "ops-leader-election"}
    documents = render("nameOverride=keeper")
    assert {name for kind, name in kinds(documents) if kind in ("Deployment", "ClusterRole")} == {
        "hk-keeper", "hk-keeper-editor", "hk-keeper-viewer"}
    deployment = next(d for d in documents if d["kind"] == "Deployment")
    assert deployment["spec"]["selector"]["matchLabels"]["app.kubernetes.io/name"] == "keeper"


KINDS = {"swarms", "blockservers", "expertpools"}


@needs_helm
def test_editor_and_viewer_roles_aggregate_to_edit_and_view():
    roles = {d["metadata"]["name"]: d for d in render() if d["kind"] == "ClusterRole"}
    editor, viewer = roles["hk-hivekeeper-editor"], roles["hk-hivekeeper-viewer"]
    aggregation = {k: v for k, v in editor["metadata"]["labels"].items() if k.startswith("rbac.authorization.k8s.io/")}
    assert aggregation == {"rbac.authorization.k8s.io/aggregate-to-edit": "true",
                           "rbac.authorization.k8s.io/aggregate-to-admin": "true"}
    aggregation = {k: v for k, v in viewer["metadata"]["labels"].items() if k.startswith("rbac.authorization.k8s.io/")}
    assert aggregation == {"rbac.authorization.k8s.io/aggregate-to-view": "true"}

    edit, view = rules(editor), rules(viewer)
    for plural in KINDS:
        assert edit[("hivekeeper.dev", plural)] == {"create", "delete", "deletecollection", "get", "list", "patch",
                                                    "update", "watch"}
        assert {"patch", "update"} <= edit[("hivekeeper.dev", f"{plural}/scale")]
        assert edit[("hivekeeper.dev", f"{plural}/status")] == {"get"}  # status is the operator's to write
        assert view[("hivekeeper.dev", plural)] == {"get", "list", "watch"}
        assert view[("hivekeeper.dev", f"{plural}/status")] == {"get", "list", "watch"}
    assert {r for _, r in edit} <= {f"{p}{s}" for p in KINDS for s in ("", "/scale", "/status")}
    # Not bound to anyone: they only add to the built-in roles.
    bound = {d["roleRef"]["name"] for d in render() if d["kind"] == "ClusterRoleBinding"}
    assert bound == {"hk-hivekeeper"}
    assert not {"hk-hivekeeper-editor", "hk-hivekeeper-viewer"} & {
        name for _, name in kinds(render("rbac.aggregatedRoles=false"))}


# -- the ServiceMonitors the operator makes ----------------------------------------------------


@needs_helm
def test_service_monitor_labels_reach_each_resources_service_monitor():
    """The chart's swarmServiceMonitorLabels, through the operator's environment, label the
    ServiceMonitor the operator plans for a resource (kube-prometheus-stack selects on release)."""
    from conftest import EXAMPLES
    from hivekeeper.kinds import runtime
    from hivekeeper.spec import load_manifest
    from hivekeeper_operator.__main__ import key_values
    from hivekeeper_operator.plan import Request, plan
    from hivekeeper_operator.pods import WorkloadSettings

    documents = render("swarmServiceMonitorLabels.release=kube-prometheus-stack",
                       "swarmServiceMonitorLabels.team=ml")
    env = {e["name"]: e["value"] for e in next(d for d in documents if d["kind"] == "Deployment")
           ["spec"]["template"]["spec"]["containers"][0]["env"]}
    settings = WorkloadSettings(image="hivekeeper:test",
                                service_monitor_labels=key_values(env["HIVEKEEPER_SERVICE_MONITOR_LABELS"]))
    manifest = load_manifest(EXAMPLES / "blockserver.yaml")
    owner = {"apiVersion": "hivekeeper.dev/v1alpha1", "kind": manifest.kind,
             "metadata": {"name": manifest.metadata.name, "namespace": "ml", "uid": "u1"}}
    peer_ids = {role: "QmcMnYTosWBs1ZaJR1dwEV3eRk1SHoPoTggxmWwZJGKG96"
                for role in runtime(manifest.kind).identity_roles(manifest)}
    keys = {f"{role}.key": "a2V5" for role in peer_ids}
    children = plan(Request(owner, manifest, peer_ids, keys, settings, service_monitor=True)).children
    monitor = next(c for c in children if c["kind"] == "ServiceMonitor")
    assert monitor["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert monitor["metadata"]["labels"]["team"] == "ml"
    assert monitor["metadata"]["labels"]["hivekeeper.dev/swarm"] == manifest.metadata.name
    assert env["HIVEKEEPER_SERVICE_MONITOR_LABELS"] == "release=kube-prometheus-stack,team=ml"
