"""A joining resource (spec.join) states only what its lab contributes: a host-owned field set
away from its default is refused at apply (CEL, evaluated here on the stored document) and by the
model, each naming the field; lab-owned fields and a manifest that states every default pass."""

from __future__ import annotations

import copy
from typing import Any

import pytest

from conftest import deep_update
from hivekeeper.spec.crd import stored
from hivekeeper.spec.join import host_owned_paths
from hivekeeper.spec.manifest import SPEC_MODELS
from test_crd_rules import _failures, _rule_nodes, _typed, cel_failures, model_error, schema_errors, schema_of

JOIN = {"gateway": "gateway.lab-a.example.org:31336", "inviteSecret": "lab-a-invite"}
JOINING = {  # each kind's joining manifest, lab-owned fields only
    "Swarm": {"join": JOIN, "backbone": {"replicas": 1},
              "trainers": {"replicas": 4, "resources": {"cpu": 2, "gpu": 1}, "clientMode": True,
                           "bandwidth": {"uploadMbps": 100}, "placement": {"nodeSelector": {"gpu": "a100"}}},
              "auxiliary": {"replicas": 1}, "placement": {"labels": {"team": "b"}}},
    "BlockServer": {"join": JOIN, "servers": {"replicas": 1, "device": "auto", "torchThreads": 4,
                                              "resources": {"memory": "8Gi"}}},
    "ExpertPool": {"join": JOIN, "servers": {"replicas": 1}, "trainers": {"replicas": 0}},
}
# kind -> host-owned path -> a value away from its default that breaks no other rule
HOST_OWNED: dict[str, dict[str, Any]] = {
    "Swarm": {"task": {"name": "causal-lm"}, "optimizer": {"learningRate": 0.01}, "targetBatchSize": 512,
              "trainers.batchSize": 16, "averaging": {"timeoutSeconds": 10}, "monitor": {"evalEverySteps": 2},
              "balancer": {"drift": 0.5}, "stopping": {"targetSteps": 10},
              "volunteers": {"enabled": True, "allowlist": ["someone"]}},
    "BlockServer": {"model": {"tiny": {"numLayers": 4}}, "servers.spanLength": 2, "servers.cacheTokens": 4096,
                    "servers.maxSessionTokens": 512, "servers.sessionTimeoutSeconds": 60,
                    "servers.weights": "int8", "servers.dtype": "bfloat16", "servers.balanceQuality": 0.5,
                    "servers.rebalanceSeconds": 5, "compression": "float16", "balancer": {"enabled": False},
                    "client": {"newTokens": 8}, "volunteers": {"relays": 2}},
    "ExpertPool": {"task": {"options": {"hiddenSize": 32}}, "grid": {"dimensions": [8, 8]},
                   "expert": {"hiddenSize": 32}, "optimizer": {"name": "sgd"}, "servers.expertsPerServer": 8,
                   "servers.maxBatchSize": 64, "servers.announcePeriodSeconds": 1,
                   "servers.announceExpirationSeconds": 8, "checkpoint": {"enabled": False},
                   "trainers.batchSize": 16, "trainers.batchesInFlight": 2,
                   "trainers.optimizer": {"learningRate": 0.01}, "trainers.dmoe": {"kBest": 2},
                   "trainers.evalEverySteps": 5, "stopping": {"targetSteps": 10},
                   "volunteers": {"gatewayPort": 31400}},
}


def document(kind: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {"apiVersion": "hivekeeper.dev/v1alpha1", "kind": kind, "metadata": {"name": "lab-b"},
            "spec": copy.deepcopy(spec)}


def nested(path: str, value: Any) -> dict[str, Any]:
    for part in reversed(path.split(".")):
        value = {part: value}
    return value


def test_every_host_owned_field_has_a_case():
    assert {kind: sorted(paths) for kind, paths in HOST_OWNED.items()} == \
           {kind: sorted(host_owned_paths(model, model.lab_owned)) for kind, model in SPEC_MODELS.items()}


@pytest.mark.parametrize("kind", sorted(JOINING))
def test_a_joining_manifest_with_lab_owned_fields_passes(kind):
    doc = document(kind, JOINING[kind])
    assert schema_errors(doc) == [] and cel_failures(doc) == [] and model_error(doc) is None


@pytest.mark.parametrize("kind", sorted(JOINING))
def test_a_joining_manifest_stating_every_default_passes(kind):
    """`hivekeeper validate` output, or a manifest read back from the API server, states every
    default: that is no host-owned field set."""
    doc = stored(kind, document(kind, JOINING[kind]))
    assert cel_failures(doc) == [] and model_error(doc) is None


@pytest.mark.parametrize("kind,path", [pytest.param(kind, path, id=f"{kind}: {path}")
                                       for kind in sorted(HOST_OWNED) for path in sorted(HOST_OWNED[kind])])
def test_a_host_owned_field_is_refused_at_apply_and_by_the_model(kind, path):
    doc = document(kind, deep_update(JOINING[kind], nested(path, HOST_OWNED[kind][path])))
    assert schema_errors(doc) == []
    assert cel_failures(doc) == [f"spec.{path}: a joining {kind} takes this from the host (spec.join); remove it"]
    error = model_error(doc)
    assert error is not None and f"{path}" in error and "takes this from the host" in error, error
    hosting = document(kind, deep_update({k: v for k, v in JOINING[kind].items() if k != "join"},
                                         nested(path, HOST_OWNED[kind][path])))
    if kind == "ExpertPool":
        hosting["spec"]["trainers"]["replicas"] = 1
    assert model_error(hosting) is None, "the same field is the host's to set"


def test_a_joining_pool_runs_trainers_only_if_it_asks():
    """An ExpertPool's trainers default to one where it hosts, none where it joins (a lab may
    contribute servers only): the API server stores no count, the model decides by spec.join."""
    from hivekeeper.spec.manifest import parse_manifest

    joining = document("ExpertPool", {"join": JOIN, "servers": {"replicas": 1}})
    hosting = document("ExpertPool", {})
    for doc in (joining, hosting):
        assert "replicas" not in stored("ExpertPool", doc)["spec"]["trainers"]
        assert cel_failures(doc) == [] and model_error(doc) is None
    assert parse_manifest(joining).spec.trainers.replicas == 0
    assert parse_manifest(hosting).spec.trainers.replicas == 1
    asked = document("ExpertPool", {"join": JOIN, "trainers": {"replicas": 2}})
    assert parse_manifest(asked).spec.trainers.replicas == 2
    none = document("ExpertPool", {"trainers": {"replicas": 0}})
    assert cel_failures(none) == ["spec.trainers.replicas: a pool needs a trainer (only one that joins another "
                                  "may have none)"]
    assert "a pool needs a trainer" in (model_error(none) or "")


def test_every_host_owned_rule_has_a_bad_manifest():
    """A rule no case breaks could drift from the model's check unnoticed."""
    broken, rules = set(), set()
    for kind, table in HOST_OWNED.items():
        spec = schema_of(kind)["properties"]["spec"]
        rules |= {r["rule"] for r in spec["x-kubernetes-validations"] if "takes this from the host" in r["message"]}
        for path, value in table.items():
            doc = stored(kind, document(kind, deep_update(JOINING[kind], nested(path, value))))
            for node, value_at in _rule_nodes(schema_of(kind), doc):
                for rule in node["x-kubernetes-validations"]:
                    if list(_failures({"x-kubernetes-validations": [rule]}, _typed(node, value_at), "")):
                        broken.add(rule["rule"])
    assert rules and rules - broken == set()



@pytest.mark.parametrize("gateway,accepted", [("lab-a.example.org:31336", True), ("10.0.0.7:443", True),
                                              ("[fd00::1]:31336", True), ("lab-a.example.org", False),
                                              ("https://lab-a:31336", False), (":31336", False)])
def test_the_gateway_is_host_and_port(gateway, accepted):
    doc = document("Swarm", {"join": {**JOIN, "gateway": gateway}})
    assert (schema_errors(doc) == []) == accepted
    assert (model_error(doc) is None) == accepted


def test_up_refuses_a_joining_manifest_and_names_hivekeeper_join(tmp_path, capsys):
    import yaml

    from hivekeeper.cli import main

    path = tmp_path / "lab-b.yaml"
    path.write_text(yaml.safe_dump(document("Swarm", JOINING["Swarm"])))
    assert main(["up", str(path), "--run-dir", str(tmp_path / "run")]) == 2
    err = capsys.readouterr().err
    assert f"hivekeeper join {JOIN['gateway']}" in err and len(err.strip().splitlines()) == 1, err
    assert not (tmp_path / "run").exists()
    assert main(["validate", str(path)]) == 0  # the manifest itself is fine
