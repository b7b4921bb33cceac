"""`helm uninstall` leaves nothing of the release behind but the CRDs, by design: the chart marks
them helm.sh/resource-policy: keep (crds.keep), since deleting a CRD deletes every resource of its
kind, in every namespace. `kubectl delete -f crds/` removes them for good (docs/upgrading.md)."""

from __future__ import annotations

import pytest

from e2e.support import OPERATOR_NAMESPACE, RELEASE, Cluster, wait_for

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(300)]

CLUSTER_KINDS = "clusterroles,clusterrolebindings"
NAMESPACED_KINDS = "deployments,replicasets,pods,services,serviceaccounts,configmaps,secrets,roles,rolebindings"


def release_objects(cluster: Cluster) -> list[str]:
    selector = f"app.kubernetes.io/instance={RELEASE}"
    found = cluster.kubectl("get", CLUSTER_KINDS, "-l", selector, "-o", "name").stdout.split()
    found += cluster.kubectl("get", NAMESPACED_KINDS, "-A", "-l", selector, "-o", "name").stdout.split()
    return found


def test_helm_uninstall_leaves_nothing_behind(cluster: Cluster, release: str):
    assert release_objects(cluster), "the release installed nothing with its instance label"
    cluster.helm("uninstall", RELEASE, "-n", OPERATOR_NAMESPACE, "--wait")
    wait_for(lambda: not release_objects(cluster), 120, "every object of the release to go")
    assert cluster.helm("list", "-A", "-q").stdout.split() == []
    left = cluster.kubectl("get", "swarms,blockservers,expertpools", "-A", "-o", "name").stdout.split()
    assert left == [], left
    # The CRDs stay, still naming the release, so that installing it again takes them back.
    for name in ("swarms.hivekeeper.dev", "blockservers.hivekeeper.dev", "expertpools.hivekeeper.dev"):
        annotations = cluster.get("customresourcedefinition", name, namespace=None)["metadata"]["annotations"]
        assert annotations["helm.sh/resource-policy"] == "keep", name
        assert annotations["meta.helm.sh/release-name"] == RELEASE, name
