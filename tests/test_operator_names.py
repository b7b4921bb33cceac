"""The names kubectl resolves for hivekeeper's kinds: none may shadow or be shadowed by a
built-in resource (`kubectl get sw,bs,ep` listed core Endpoints, not ExpertPools)."""

from __future__ import annotations

import pytest
import yaml

from conftest import REPO
from hivekeeper.spec.crd import KINDS

# Short names and plurals of the resources every cluster serves (Kubernetes 1.34, `kubectl api-resources`).
BUILTIN_SHORT_NAMES = {
    "cs", "cm", "ep", "ev", "limits", "ns", "no", "pvc", "pv", "po", "rc", "quota", "sa", "svc",  # core
    "ds", "deploy", "rs", "sts", "hpa", "cj", "csr", "ing", "netpol", "pdb", "pc", "sc", "vac",
    "crd", "crds", "psp",  # psp: gone since 1.25, still in older kubectl's memory
}
BUILTIN_PLURALS = {
    "bindings", "componentstatuses", "configmaps", "endpoints", "events", "limitranges", "namespaces", "nodes",
    "persistentvolumeclaims", "persistentvolumes", "pods", "podtemplates", "replicationcontrollers",
    "resourcequotas", "secrets", "serviceaccounts", "services", "controllerrevisions", "daemonsets",
    "deployments", "replicasets", "statefulsets", "horizontalpodautoscalers", "cronjobs", "jobs",
    "certificatesigningrequests", "leases", "endpointslices", "ingressclasses", "ingresses", "networkpolicies",
    "poddisruptionbudgets", "priorityclasses", "storageclasses", "csidrivers", "csinodes", "volumeattachments",
    "customresourcedefinitions", "apiservices", "clusterroles", "clusterrolebindings", "roles", "rolebindings",
}


def crd_documents() -> list[dict]:
    paths = sorted((REPO / "crds").glob("*.yaml")) + sorted((REPO / "charts" / "hivekeeper" / "files" / "crds").glob("*.yaml"))
    assert paths, "no generated CRDs"
    return [yaml.safe_load(path.read_text()) for path in paths]


def kubectl_names(names: dict) -> set[str]:
    return {names["plural"], names["singular"], *names.get("shortNames", [])}


@pytest.mark.parametrize("kind", sorted(KINDS))
def test_short_names_and_plurals_collide_with_no_builtin_resource(kind):
    info = KINDS[kind]
    names = {info.plural, info.singular, *info.short_names}
    assert not names & (BUILTIN_SHORT_NAMES | BUILTIN_PLURALS), kind


def test_generated_crds_carry_names_that_collide_with_nothing():
    seen: dict[str, str] = {}
    for document in crd_documents():
        names = document["spec"]["names"]
        clashes = kubectl_names(names) & (BUILTIN_SHORT_NAMES | BUILTIN_PLURALS)
        assert not clashes, f"{names['kind']}: {sorted(clashes)} already name a built-in resource"
        for name in kubectl_names(names):  # nor one hivekeeper kind with another
            assert seen.setdefault(name, names["kind"]) == names["kind"], name
    assert {d["spec"]["names"]["kind"]: d["spec"]["names"]["shortNames"] for d in crd_documents()} == {
        "BlockServer": ["bs"], "ExpertPool": ["xp"], "Swarm": ["sw"]}
