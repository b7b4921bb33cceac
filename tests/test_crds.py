"""The CRDs in crds/ (and the chart's copy) are generated from the spec models, are structural,
and accept and reject the same manifests as `hivekeeper validate` (their CEL rules:
test_crd_rules.py)."""

from __future__ import annotations

import copy
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from conftest import EXAMPLES, REPO, deep_update
from hivekeeper.errors import UserError
from hivekeeper.spec import parse_manifest
from hivekeeper.spec.crd import KINDS, crd, crd_files, jsonschema_for, missing_kinds, stored
from hivekeeper.spec.manifest import SPEC_MODELS

try:
    import jsonschema
except ImportError:  # only the schema-validation tests need it
    jsonschema = None
needs_jsonschema = pytest.mark.skipif(jsonschema is None, reason="jsonschema is not installed: pip install -e '.[operator-test]'")

CRD_DIRS = [REPO / "crds", REPO / "charts" / "hivekeeper" / "files" / "crds"]


def examples() -> list[Path]:
    return sorted(EXAMPLES.glob("*.yaml"))


def load(path: Path) -> dict[str, Any]:
    return yaml.safe_load(path.read_text())


def crd_accepts(document: dict[str, Any]) -> bool:
    kind = document.get("kind")
    if kind not in KINDS:
        return False
    return jsonschema.Draft4Validator(jsonschema_for(kind)).is_valid(stored(kind, document))


def model_accepts(document: dict[str, Any]) -> bool:
    try:
        parse_manifest(copy.deepcopy(document))
    except UserError:
        return False
    return True


# ---------------------------------------------------------------------------------------------
# Generated, committed, complete


@pytest.mark.parametrize("directory", CRD_DIRS, ids=lambda d: str(d.relative_to(REPO)))
def test_committed_crds_equal_freshly_generated_ones(directory):
    files = crd_files()
    committed = {p.name: p.read_text() for p in directory.glob("*.yaml")}
    assert committed == files, f"run `hivekeeper crds --out {directory.relative_to(REPO)}`"


def test_crds_command_checks_and_writes(tmp_path):
    run = lambda *args: subprocess.run([sys.executable, "-m", "hivekeeper", "crds", *args],  # noqa: E731
                                       capture_output=True, text=True, cwd=REPO)
    assert run("--out", str(tmp_path), "--check").returncode == 1
    assert run("--out", str(tmp_path)).returncode == 0
    assert run("--out", str(tmp_path), "--check").returncode == 0
    assert {p.name for p in tmp_path.iterdir()} == set(crd_files())
    # A chart's crds/ folder, which Helm never upgrades, is refused before anything is written.
    (tmp_path / "chart").mkdir()
    (tmp_path / "chart" / "Chart.yaml").write_text("name: chart\n")
    refused = run("--out", str(tmp_path / "chart" / "crds"))
    assert refused.returncode == 2 and "files/crds" in refused.stderr
    assert not (tmp_path / "chart" / "crds").exists()


def test_every_kind_with_a_spec_model_has_a_crd():
    assert missing_kinds() == []
    assert set(SPEC_MODELS) <= set(KINDS)


# ---------------------------------------------------------------------------------------------
# Structural, and what kubectl shows


def walk(node: dict[str, Any], path: str = ""):
    yield path, node
    for name, child in (node.get("properties") or {}).items():
        yield from walk(child, f"{path}.{name}")
    if isinstance(node.get("items"), dict):
        yield from walk(node["items"], f"{path}[]")
    if isinstance(node.get("additionalProperties"), dict):
        yield from walk(node["additionalProperties"], f"{path}{{}}")


@pytest.mark.parametrize("kind", sorted(SPEC_MODELS))
def test_schema_is_structural(kind):
    schema = crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    preserved = []
    for path, node in walk(schema):
        # Every node of a structural schema has a type; a Kubernetes quantity is an int-or-string.
        assert "type" in node or node.get("x-kubernetes-int-or-string"), path
        assert not ("properties" in node and "additionalProperties" in node), path
        assert not {"$ref", "anyOf", "oneOf", "allOf", "prefixItems", "title", "nullable"} & set(node), path
        assert not isinstance(node.get("exclusiveMinimum"), (int, float)) or isinstance(node["exclusiveMinimum"], bool), path
        if node.get("x-kubernetes-preserve-unknown-fields"):
            preserved.append(path)
    assert sorted(preserved) == [f".spec.{p}" for p in sorted(KINDS[kind].preserve_unknown)]
    assert set(schema["properties"]["metadata"]["properties"]) == {"name"}  # all the apiserver allows


def resolve(schema: dict[str, Any], json_path: str) -> dict[str, Any]:
    node = schema
    for part in json_path.strip(".").split("."):
        node = node["properties"][part]
    return node


@pytest.mark.parametrize("kind", sorted(SPEC_MODELS))
def test_scale_subresource_and_printer_columns_point_at_real_fields(kind):
    document = crd(kind)
    names = document["spec"]["names"]
    assert names["categories"] == ["hivekeeper"] and names["shortNames"]
    version = document["spec"]["versions"][0]
    schema = version["schema"]["openAPIV3Schema"]
    assert version["subresources"]["status"] == {}
    scale = version["subresources"]["scale"]
    assert resolve(schema, scale["specReplicasPath"])["type"] == "integer"
    assert resolve(schema, scale["statusReplicasPath"])["type"] == "integer"
    assert resolve(schema, scale["labelSelectorPath"])["type"] == "string"
    for column in version["additionalPrinterColumns"]:
        if column["jsonPath"].startswith(".metadata"):
            continue
        field = resolve(schema, column["jsonPath"])
        assert field["type"] == column["type"] or (field["type"], column["type"]) == ("integer", "number"), column
    assert [c["name"] for c in version["additionalPrinterColumns"] if not c.get("priority")][-1] == "Age"


def test_swarm_columns_and_names():
    version = crd("Swarm")["spec"]["versions"][0]
    assert [c["name"] for c in version["additionalPrinterColumns"]] == ["Phase", "Ready", "Trainers", "Step",
                                                                        "Samples/s", "Steps/s", "Efficiency", "Age"]
    assert version["subresources"]["scale"]["specReplicasPath"] == ".spec.trainers.replicas"
    assert crd("Swarm")["spec"]["names"]["shortNames"] == ["sw"]


def test_crds_are_valid_kubernetes_objects():
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    for directory in CRD_DIRS:
        for path in directory.glob("*.yaml"):
            kubernetes_validate.validate(load(path), "1.33.0", strict=True)


# ---------------------------------------------------------------------------------------------
# Both sides accept the examples and reject the same bad manifests


@needs_jsonschema
@pytest.mark.parametrize("path", examples(), ids=lambda p: p.name)
def test_every_example_validates_against_its_crd_and_the_model(path):
    document = load(path)
    validator = jsonschema.Draft4Validator(jsonschema_for(document["kind"]))
    errors = [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(stored(document["kind"], document))]
    assert errors == []
    assert model_accepts(document)


SWARM = load(EXAMPLES / "swarm-digits.yaml")
BASES = {"Swarm": SWARM, "BlockServer": load(EXAMPLES / "blockserver.yaml"),
         "ExpertPool": load(EXAMPLES / "expertpool.yaml")}

# Rejected by the CRD schema (so by `kubectl apply`) and by the spec model (so by `hivekeeper validate`).
BAD = {
    "Swarm": {
        "unknown spec field": {"spec": {"trainer": {"replicas": 2}}},
        "unknown nested field": {"spec": {"trainers": {"gpus": 1}}},
        "replicas as text": {"spec": {"trainers": {"replicas": "three"}}},
        "negative replicas": {"spec": {"trainers": {"replicas": -1}}},
        "no backbone": {"spec": {"backbone": {"replicas": 0}}},
        "zero learning rate": {"spec": {"optimizer": {"learningRate": 0}}},
        "momentum of one": {"spec": {"optimizer": {"momentum": 1.0}}},
        "unknown optimizer": {"spec": {"optimizer": {"name": "lamb"}}},
        "unknown compression": {"spec": {"averaging": {"compression": "gzip"}}},
        "three betas": {"spec": {"optimizer": {"betas": [0.9, 0.99, 0.999]}}},
        "beta of one": {"spec": {"optimizer": {"betas": [0.9, 1.0]}}},
        "group of one": {"spec": {"averaging": {"targetGroupSize": 1}}},
        "zero timeout": {"spec": {"averaging": {"timeoutSeconds": 0}}},
        "boolean as text": {"spec": {"trainers": {"clientMode": "yes"}}},
        # null is pruned by the apiserver, and then the required value is missing
        "metric without value": {"spec": {"stopping": {"targetMetric": {"name": "accuracy", "value": None}}}},
        "unknown metric mode": {"spec": {"stopping": {"targetMetric": {"name": "loss", "value": 0.1, "mode": "avg"}}}},
        "gpu count as text": {"spec": {"trainers": {"resources": {"gpu": "one"}}}},
        "cpu in words": {"spec": {"trainers": {"resources": {"cpu": "lots"}}}},
        "cpu as a fraction": {"spec": {"trainers": {"resources": {"cpu": 0.5}}}},
        "negative seed": {"spec": {"task": {"seed": -1}}},
        "upper-case name": {"metadata": {"name": "Digits"}},
        "name too long": {"metadata": {"name": "d" * 41}},
        "no spec": None,
    },
    "BlockServer": {
        "unknown spec field": {"spec": {"server": {"replicas": 2}}},
        "unknown architecture": {"spec": {"model": {"tiny": {"architecture": "mamba"}}}},
        "vocabulary of one": {"spec": {"model": {"tiny": {"vocabSize": 1}}}},
        "negative servers": {"spec": {"servers": {"replicas": -1}}},
        "span of zero blocks": {"spec": {"servers": {"spanLength": 0}}},
        "unknown device": {"spec": {"servers": {"device": "tpu"}}},
        "unknown weight format": {"spec": {"servers": {"weights": "int4"}}},
        "unknown compression": {"spec": {"compression": "gzip"}},
        "empty prompt": {"spec": {"client": {"prompt": ""}}},
        "boolean as text": {"spec": {"client": {"doSample": "yes"}}},
        "zero temperature": {"spec": {"client": {"temperature": 0}}},
    },
    "ExpertPool": {
        "unknown spec field": {"spec": {"experts": {"replicas": 2}}},
        "dot in the uid prefix": {"spec": {"grid": {"uidPrefix": "ex.pert"}}},
        "five grid dimensions": {"spec": {"grid": {"dimensions": [2, 2, 2, 2, 2]}}},
        "grid dimension of zero": {"spec": {"grid": {"dimensions": [4, 0]}}},
        "unknown expert type": {"spec": {"expert": {"type": "mixer"}}},
        "no servers": {"spec": {"servers": {"replicas": 0}}},
        "no batches in flight": {"spec": {"trainers": {"batchesInFlight": 0}}},
        "zero forward timeout": {"spec": {"trainers": {"dmoe": {"forwardTimeoutSeconds": 0}}}},
        "claim size in words": {"spec": {"checkpoint": {"volumeClaim": {"size": "lots"}}}},
        "read-only claim": {"spec": {"checkpoint": {"volumeClaim": {"accessMode": "ReadOnlyMany"}}}},
        "unknown claim field": {"spec": {"checkpoint": {"volumeClaim": {"storageClass": "nfs"}}}},
        "claim name not a Kubernetes name": {"spec": {"checkpoint": {"existingClaim": "Lab_NFS"}}},
    },
}

def bad(kind: str, changes: dict[str, Any] | None) -> dict[str, Any]:
    if changes is None:
        document = copy.deepcopy(BASES[kind])
        del document["spec"]
        return document
    return deep_update(BASES[kind], changes)


def cases(table: dict[str, dict[str, Any]]) -> list[Any]:
    return [pytest.param(kind, case, id=f"{kind}: {case}") for kind in sorted(table) for case in sorted(table[kind])]


@needs_jsonschema
@pytest.mark.parametrize("kind,case", cases(BAD))
def test_bad_manifests_are_rejected_by_both_sides(kind, case):
    document = bad(kind, BAD[kind][case])
    assert not crd_accepts(document), f"the CRD accepts: {case}"
    assert not model_accepts(document), f"the model accepts: {case}"


@needs_jsonschema
def test_status_written_by_the_operator_is_accepted():
    document = copy.deepcopy(SWARM)
    document["status"] = {
        "observedGeneration": 3, "phase": "Running", "readyPeers": "6/6",
        "conditions": [{"type": "Ready", "status": "True", "reason": "AllPeersReady", "message": "",
                        "lastTransitionTime": "2026-01-01T00:00:00Z", "observedGeneration": 3}],
        "trainers": {"desired": 3, "replicas": 3, "ready": 3}, "selector": "a=b",
        "peersAlive": {"trainer": 3}, "globalStep": 10, "samplesPerSecond": 12.5, "evalMetrics": {"accuracy": 0.9},
    }
    assert crd_accepts(document)
    document["status"]["phase"] = "Exploded"
    assert not crd_accepts(document)
