"""The API server refuses at `kubectl apply` what `hivekeeper validate` refuses: the models'
cross-field rules are CEL rules in the CRDs (evaluated here with cel-python, on the document as
the API server stores it), quantities are Kubernetes quantities on both sides, and the defaults
the API server stores change nothing the models read."""

from __future__ import annotations

import copy
from functools import lru_cache
from typing import Any, Iterator

import pytest
import yaml

from conftest import EXAMPLES, deep_update
from hivekeeper.errors import UserError
from hivekeeper.spec import parse_manifest
from hivekeeper.spec.crd import crd, jsonschema_for, stored
from hivekeeper.spec.join import HOST_OWNED
from hivekeeper.spec.manifest import SPEC_MODELS

celpy = pytest.importorskip("celpy", reason="pip install -e '.[operator-test]'")
jsonschema = pytest.importorskip("jsonschema", reason="pip install -e '.[operator-test]'")


def load(name: str) -> dict[str, Any]:
    return yaml.safe_load((EXAMPLES / name).read_text())


BASES = {"Swarm": load("swarm-digits.yaml"), "BlockServer": load("blockserver.yaml"),
         "ExpertPool": load("expertpool.yaml")}


def schema_of(kind: str) -> dict[str, Any]:
    return crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]


# ---------------------------------------------------------------------------------------------
# The API server's side: structural schema, then CEL, on the stored (defaulted) document


@lru_cache(maxsize=None)
def _program(rule: str) -> Any:
    environment = celpy.Environment()
    return environment.program(environment.compile(rule))


def _typed(node: dict[str, Any], value: Any) -> Any:
    """JSON as CEL sees it under a schema: a `number` field is a double even when written 2."""
    if node.get("type") == "number" and isinstance(value, int):
        return float(value)
    if isinstance(value, dict) and "properties" in node:
        return {k: _typed(node["properties"][k], v) if k in node["properties"] else v for k, v in value.items()}
    if isinstance(value, dict) and isinstance(node.get("additionalProperties"), dict):
        return {k: _typed(node["additionalProperties"], v) for k, v in value.items()}
    if isinstance(value, list) and isinstance(node.get("items"), dict):
        return [_typed(node["items"], v) for v in value]
    return value


def _failures(node: dict[str, Any], value: Any, path: str) -> Iterator[str]:
    for rule in node.get("x-kubernetes-validations", ()):
        try:
            passed = _program(rule["rule"]).evaluate({"self": celpy.json_to_cel(_typed(node, value))})
        except celpy.CELEvalError as e:  # the API server refuses an object a rule cannot evaluate
            passed = f"error: {e}"
        if passed is not True and passed != celpy.celtypes.BoolType(True):
            yield f"{path}{rule.get('fieldPath', '')}: {rule['message']}" + (f" ({passed})" if isinstance(passed, str) else "")
    if isinstance(value, dict) and "properties" in node:
        for name, prop in node["properties"].items():
            if name in value:
                yield from _failures(prop, value[name], f"{path}.{name}" if path else name)
    elif isinstance(value, dict) and isinstance(node.get("additionalProperties"), dict):
        for key, item in value.items():
            yield from _failures(node["additionalProperties"], item, f"{path}.{key}")
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for i, item in enumerate(value):
            yield from _failures(node["items"], item, f"{path}[{i}]")


def schema_errors(document: dict[str, Any]) -> list[str]:
    kind = document["kind"]
    validator = jsonschema.Draft4Validator(jsonschema_for(kind))
    return [f"{'.'.join(map(str, e.path))}: {e.message}" for e in validator.iter_errors(stored(kind, document))]


def cel_failures(document: dict[str, Any]) -> list[str]:
    """'PATH: message' of every CEL rule the stored document fails, as the API server names it."""
    kind = document["kind"]
    return list(_failures(schema_of(kind), stored(kind, document), ""))


def model_error(document: dict[str, Any]) -> str | None:
    try:
        parse_manifest(copy.deepcopy(document))
    except UserError as e:
        return str(e)
    return None


def all_rules() -> set[tuple[str, str]]:
    """(rule, message) of every CEL rule in the CRDs."""
    found = set()

    def walk(node: dict[str, Any]) -> None:
        found.update((r["rule"], r["message"]) for r in node.get("x-kubernetes-validations", ()))
        for child in [*(node.get("properties") or {}).values(), node.get("items"), node.get("additionalProperties")]:
            if isinstance(child, dict):
                walk(child)

    for kind in SPEC_MODELS:
        walk(schema_of(kind))
    return found


# ---------------------------------------------------------------------------------------------
# Good manifests pass everything, and their stored defaults change nothing


VARIANTS = {  # manifests whose defaults are easy to get wrong
    "Swarm, an empty spec": ("Swarm", {"spec": {}}),
    "Swarm, a target metric alone stops the run": (
        "Swarm", {"spec": {"stopping": {"targetSteps": None, "targetMetric": {"name": "accuracy", "value": 0.9}}}}),
    "Swarm, auxiliary resources partly given": ("Swarm", {"spec": {"auxiliary": {"resources": {"cpu": 2}}}}),
    "Swarm, parameter averaging with its own merge period": (
        "Swarm", {"spec": {"auxiliary": {"replicas": 0}, "averaging": {"mode": "parameters", "mergeEverySteps": 5,
                                                                        "shiftEverySteps": 2}}}),
    "Swarm, the balancer off by hand": ("Swarm", {"spec": {"balancer": {"enabled": False}}}),
    "Swarm, group sized for volunteers": (
        "Swarm", {"spec": {"averaging": {"targetGroupSize": 9}, "volunteers": {"enabled": True, "allowlist": ["a"]}}}),
    "Swarm, a lab pooling trainers and a backbone": (
        "Swarm", {"spec": {"volunteers": {"enabled": True, "labs": [
            {"name": "lab-b", "maxPeers": 8, "roles": ["trainer", "backbone"]}]}}}),
    "BlockServer, a lab of servers": (
        "BlockServer", {"spec": {"volunteers": {"enabled": True, "labs": [
            {"name": "lab-b", "maxPeers": 2, "roles": ["server"]}]}}}),
    "BlockServer, an empty spec": ("BlockServer", {"spec": {}}),
    "BlockServer, an empty model": ("BlockServer", {"spec": {"model": {}}}),
    "BlockServer, a checkpoint": ("BlockServer", {"spec": {"model": {"tiny": None, "checkpoint": "/models/lm"},
                                                           "servers": {"spanLength": 7}}}),
    "BlockServer, a checkpoint on a volume": ("BlockServer", {"spec": {"model": {
        "tiny": None, "checkpoint": "/mnt/models/lm", "volume": {"mountPath": "/mnt/models/", "existingClaim": "lab"}}}}),
    "ExpertPool, an empty spec": ("ExpertPool", {"spec": {}}),
    "ExpertPool, a checkpoint claim": ("ExpertPool", {"spec": {"checkpoint": {"volumeClaim": {}, "dir": "/ckpt"}}}),
}


def good_documents() -> list[Any]:
    examples = [pytest.param(load(p.name), id=p.name) for p in sorted(EXAMPLES.glob("*.yaml"))]
    variants = [pytest.param(deep_update(BASES[kind], changes), id=name) for name, (kind, changes) in VARIANTS.items()]
    return examples + variants


@pytest.mark.parametrize("document", good_documents())
def test_good_manifests_pass_schema_rules_and_model(document):
    assert model_error(document) is None
    assert schema_errors(document) == []
    assert cel_failures(document) == []


@pytest.mark.parametrize("document", good_documents())
def test_stored_defaults_change_nothing_the_model_reads(document):
    kind = document["kind"]
    defaulted = stored(kind, document)
    assert stored(kind, defaulted) == defaulted
    # What the operator parses from the stored object is what `hivekeeper up` parses from the file.
    assert parse_manifest(copy.deepcopy(defaulted)).spec == parse_manifest(copy.deepcopy(document)).spec


def test_defaults_are_stored_in_full():
    spec = stored("Swarm", deep_update(BASES["Swarm"], {"spec": {"trainers": None, "stopping": None}}))["spec"]
    assert spec["trainers"]["batchSize"] == 32 and spec["trainers"]["resources"] == {
        "cpu": "1", "memory": "2Gi", "gpu": 0, "gpuResource": "nvidia.com/gpu"}
    assert spec["auxiliary"]["resources"]["memory"] == "1Gi"  # the section's default, not Resources'
    assert spec["stopping"] == {"targetSteps": 100}
    assert "enabled" not in spec["balancer"]  # it follows averaging.mode
    # A section the user gives gets its own fields' defaults, as the model fills them in.
    given = stored("Swarm", deep_update(BASES["Swarm"], {"spec": {"auxiliary": {"resources": {"cpu": 2}}}}))
    assert given["spec"]["auxiliary"]["resources"]["memory"] == "2Gi"
    assert parse_manifest(given).spec.auxiliary.resources.memory == "2Gi"


@pytest.mark.parametrize("kind", sorted(SPEC_MODELS))
def test_every_default_is_valid_where_it_stands(kind):
    """The API server checks each default against its node's schema and CEL rules, as it stands."""
    def walk(node: dict[str, Any], strict: dict[str, Any], path: str) -> Iterator[tuple[str, dict[str, Any], dict[str, Any]]]:
        if "default" in node:
            yield path, node, strict
        for name, child in (node.get("properties") or {}).items():
            yield from walk(child, strict["properties"][name], f"{path}.{name}")

    spec = schema_of(kind)["properties"]["spec"]
    for path, node, strict in walk(spec, jsonschema_for(kind)["properties"]["spec"], "spec"):
        errors = [e.message for e in jsonschema.Draft4Validator(strict).iter_errors(node["default"])]
        assert errors == [], path
        assert list(_failures(node, node["default"], path)) == [], path


# ---------------------------------------------------------------------------------------------
# Bad manifests: refused by CEL at apply, and by the model, naming the same field

# kind -> case -> (changes to the kind's example, the path the API server's error names)
CROSS_FIELD: dict[str, dict[str, tuple[dict[str, Any], str]]] = {
    "Swarm": {
        "batch larger than the global batch": ({"trainers": {"batchSize": 512}}, "spec.trainers.batchSize"),
        "group larger than the averaging peers": ({"averaging": {"targetGroupSize": 9}}, "spec.averaging.targetGroupSize"),
        "auxiliary peers while merging weights": ({"averaging": {"mode": "ties"}}, "spec.auxiliary.replicas"),
        "the balancer while merging weights": (
            {"averaging": {"mode": "parameters"}, "auxiliary": {"replicas": 0}, "balancer": {"enabled": True}},
            "spec.balancer.enabled"),
        "target metric without a monitor": ({"monitor": {"enabled": False}}, "spec.stopping.targetMetric"),
        "nothing stops the run": ({"stopping": {"targetSteps": None, "targetMetric": None}}, "spec.stopping"),
        "merge period with gradient averaging": ({"averaging": {"mergeEverySteps": 5}}, "spec.averaging.mergeEverySteps"),
        "merge epochs with gradient averaging": ({"averaging": {"mergeEveryEpochs": 0.5}},
                                                 "spec.averaging.mergeEveryEpochs"),
        "shifts with gradient averaging": ({"averaging": {"shiftEverySteps": 2}}, "spec.averaging.shiftEverySteps"),
        "optimizer state with gradient averaging": ({"averaging": {"mergeOptimizerState": False}},
                                                    "spec.averaging.mergeOptimizerState"),
        "DiLoCo's H with gradient averaging": ({"averaging": {"innerSteps": 5}}, "spec.averaging.innerSteps"),
        "an outer optimizer with gradient averaging": ({"averaging": {"outerOptimizer": {"learningRate": 0.5}}},
                                                       "spec.averaging.outerOptimizer"),
        "an overlapped outer round with ties": (
            {"averaging": {"mode": "ties", "overlapOuterRound": True}, "auxiliary": {"replicas": 0}},
            "spec.averaging.overlapOuterRound"),
        "a merge period with DiLoCo": ({"averaging": {"mode": "diloco", "mergeEverySteps": 5},
                                        "auxiliary": {"replicas": 0}}, "spec.averaging.mergeEverySteps"),
        "merged optimizer state with DiLoCo": ({"averaging": {"mode": "diloco", "mergeOptimizerState": False},
                                                "auxiliary": {"replicas": 0}}, "spec.averaging.mergeOptimizerState"),
        "blockwise 8-bit pseudo-gradients": ({"averaging": {"mode": "diloco", "compression": "blockwise8bit"},
                                              "auxiliary": {"replicas": 0}}, "spec.averaging.compression"),
        "auxiliary peers with DiLoCo": ({"averaging": {"mode": "diloco"}}, "spec.auxiliary.replicas"),
        "clipping settings with the mean": ({"averaging": {"centeredClip": {"radius": 0.1}}},
                                            "spec.averaging.centeredClip"),
        "centeredClip in groups of two": ({"averaging": {"aggregation": "centeredClip", "targetGroupSize": 2}},
                                          "spec.averaging.targetGroupSize"),
        "trim without ties": ({"averaging": {"mode": "parameters", "trim": 0.5}, "auxiliary": {"replicas": 0}},
                              "spec.averaging.trim"),
        "merge period in steps and epochs": (
            {"averaging": {"mode": "ties", "mergeEverySteps": 5, "mergeEveryEpochs": 0.5}, "auxiliary": {"replicas": 0}},
            "spec.averaging.mergeEveryEpochs"),
        "shifts not between merges": ({"averaging": {"mode": "ties", "shiftEverySteps": 10}, "auxiliary": {"replicas": 0}},
                                      "spec.averaging.shiftEverySteps"),
        "volunteers nobody may be": ({"volunteers": {"enabled": True}}, "spec.volunteers.allowlist"),
        "a lab running servers": ({"volunteers": {"labs": [{"name": "b", "maxPeers": 1, "roles": ["server"]}]}},
                                  "spec.volunteers.labs"),
        "a lab naming a role twice": ({"volunteers": {"labs": [
            {"name": "b", "maxPeers": 1, "roles": ["trainer", "trainer"]}]}}, "spec.volunteers.labs[0].roles"),
        "node ports without a public host": (
            {"volunteers": {"enabled": True, "allowlist": ["a"], "serviceType": "NodePort", "relayPort": 31000,
                            "gatewayPort": 31100}}, "spec.volunteers.publicHost"),
        "a relay's node port out of range": (
            {"volunteers": {"serviceType": "NodePort", "relayPort": 29999, "relays": 2, "gatewayPort": 31100}},
            "spec.volunteers.relayPort"),
        "the gateway's node port out of range": (
            {"volunteers": {"serviceType": "NodePort", "relayPort": 31000, "gatewayPort": 8080}},
            "spec.volunteers.gatewayPort"),
        "the gateway on a relay's port": ({"volunteers": {"relayPort": 31337, "relays": 2, "gatewayPort": 31338}},
                                          "spec.volunteers.gatewayPort"),
        "node ports without a port": ({"trainers": {"network": {"expose": "NodePort"}}}, "spec.trainers.network.port"),
        "a port on peers not exposed": ({"auxiliary": {"network": {"port": 31000}}}, "spec.auxiliary.network.port"),
        "a public host for host ports": ({"backbone": {"network": {"expose": "HostPort", "publicHost": "lab.example"}}},
                                         "spec.backbone.network.publicHost"),
        "a trainer's node port out of range": ({"trainers": {"replicas": 3, "network": {"expose": "NodePort",
                                                                                          "port": 32766}}},
                                               "spec.trainers.network.port"),
        "a backbone's node port out of range": ({"backbone": {"network": {"expose": "NodePort", "port": 8080}}},
                                                "spec.backbone.network.port"),
        "an auxiliary's node port out of range": ({"auxiliary": {"network": {"expose": "NodePort", "port": 29000}}},
                                                  "spec.auxiliary.network.port"),
        "a client-only backbone": ({"backbone": {"network": {"expose": "ClientOnly"}}}, "spec.backbone.network.expose"),
        "client-only auxiliaries": ({"auxiliary": {"network": {"expose": "ClientOnly"}}}, "spec.auxiliary.network.expose"),
        "client-mode trainers with a public address": ({"trainers": {"clientMode": True, "network": {"expose": "HostPort"}}},
                                                       "spec.trainers.clientMode"),
        "two monitor claims": ({"monitor": {"volumeClaim": {}, "existingClaim": "lab-nfs"}}, "spec.monitor.existingClaim"),
        "a monitor claim without a monitor": (
            {"monitor": {"enabled": False, "existingClaim": "lab-nfs"}, "stopping": {"targetMetric": None}},
            "spec.monitor.enabled"),
        "a monitor claim mounted at a relative dir": ({"monitor": {"volumeClaim": {}, "checkpointDir": "ckpt"}},
                                                      "spec.monitor.checkpointDir"),
        "a toleration of no key that is not Exists": ({"trainers": {"placement": {"tolerations": [{"effect": "NoSchedule"}]}}},
                                                      "spec.trainers.placement.tolerations[0].operator"),
        "a toleration Exists with a value": (
            {"placement": {"tolerations": [{"key": "gpu", "operator": "Exists", "value": "a100"}]}},
            "spec.placement.tolerations[0].value"),
        "tolerationSeconds without NoExecute": (
            {"backbone": {"placement": {"tolerations": [{"key": "gpu", "value": "x", "tolerationSeconds": 30}]}}},
            "spec.backbone.placement.tolerations[0].tolerationSeconds"),
        "an env var with a value and valueFrom": (
            {"monitor": {"placement": {"env": [{"name": "A", "value": "1", "valueFrom": {"fieldRef": {}}}]}}},
            "spec.monitor.placement.env[0].valueFrom"),
        "a label the operator writes": ({"trainers": {"placement": {"labels": {"hivekeeper.dev/component": "x"}}}},
                                        "spec.trainers.placement.labels"),
        "an annotation the operator writes": ({"placement": {"annotations": {"app.kubernetes.io/name": "x"}}},
                                              "spec.placement.annotations"),
        "an env var twice": ({"trainers": {"placement": {"env": [{"name": "A", "value": "1"}, {"name": "A", "value": "2"}]}}},
                             "spec.trainers.placement.env"),
        "a mount path twice": (
            {"auxiliary": {"placement": {"volumeMounts": [{"name": "a", "mountPath": "/d"}, {"name": "b", "mountPath": "/d"}]}}},
            "spec.auxiliary.placement.volumeMounts"),
    },
    "BlockServer": {
        "heads do not divide the width": ({"model": {"tiny": {"hiddenSize": 66}}}, "spec.model.tiny.hiddenSize"),
        "a checkpoint and a tiny model": ({"model": {"checkpoint": "/models/lm"}}, "spec.model"),
        "prompt and new tokens beyond a session": ({"client": {"newTokens": 500}}, "spec.client.newTokens"),
        "span longer than the model": ({"servers": {"spanLength": 7}}, "spec.servers.spanLength"),
        "session longer than the cache": ({"servers": {"maxSessionTokens": 8192}}, "spec.servers.maxSessionTokens"),
        "a lab running trainers": ({"volunteers": {"labs": [{"name": "b", "maxPeers": 1, "roles": ["trainer"]}]}},
                                   "spec.volunteers.labs"),
        "client-only servers": ({"servers": {"network": {"expose": "ClientOnly"}}}, "spec.servers.network.expose"),
        "a model volume with a claim and a source": (
            {"model": {"tiny": None, "checkpoint": "/models/lm",
                       "volume": {"existingClaim": "lab", "source": {"nfs": {"server": "nas", "path": "/m"}}}}},
            "spec.model.volume"),
        "a checkpoint outside its volume": (
            {"model": {"tiny": None, "checkpoint": "/modelsx/lm", "volume": {"existingClaim": "lab"}}},
            "spec.model.checkpoint"),
    },
    "ExpertPool": {
        "a task other than digits": ({"task": {"name": "causal-lm"}}, "spec.task.name"),
        "a server's node port out of range": ({"servers": {"replicas": 2, "network": {"expose": "NodePort", "port": 32767}}},
                                              "spec.servers.network.port"),
        "a lab running auxiliaries": ({"volunteers": {"labs": [{"name": "b", "maxPeers": 1, "roles": ["auxiliary"]}]}},
                                      "spec.volunteers.labs"),
        "no trainer in a pool that joins no other": ({"trainers": {"replicas": 0}}, "spec.trainers.replicas"),
        "kMin above kBest": ({"trainers": {"dmoe": {"kMin": 5}}}, "spec.trainers.dmoe.kMin"),
        "kBest above the grid": ({"grid": {"dimensions": [3]}}, "spec.trainers.dmoe.kBest"),
        "kBest above the experts the servers hold": ({"servers": {"expertsPerServer": 1}}, "spec.trainers.dmoe.kBest"),
        "heads do not divide the expert width": ({"expert": {"type": "transformer", "numHeads": 3}},
                                                 "spec.expert.hiddenSize"),
        "tokens do not divide the pixels": ({"expert": {"type": "transformer", "sequenceLength": 5}},
                                            "spec.expert.sequenceLength"),
        "entries expire between announcements": ({"servers": {"announceExpirationSeconds": 1}},
                                                 "spec.servers.announceExpirationSeconds"),
        "two checkpoint claims": ({"checkpoint": {"volumeClaim": {}, "existingClaim": "lab-nfs"}},
                                  "spec.checkpoint.existingClaim"),
        "a claim without checkpoints": ({"checkpoint": {"enabled": False, "existingClaim": "lab-nfs"}},
                                        "spec.checkpoint.enabled"),
        "a claim mounted at a relative dir": ({"checkpoint": {"volumeClaim": {}, "dir": "experts"}},
                                              "spec.checkpoint.dir"),
    },
}

# What CEL cannot say: each task's own options, a volume source's content. `kubectl apply`
# accepts them; the operator refuses them with the model's message and reports phase Invalid.
OPERATOR_ONLY = {
    "Swarm": {"an unknown task option": {"task": {"options": {"bogus": 1}}},
              # a CEL rule over both lists was too costly for the API server's estimate
              "a lab on the allowlist too": {"volunteers": {"allowlist": ["b"], "labs": [
                  {"name": "b", "maxPeers": 1, "roles": ["trainer"]}]}},
              "a volume twice": {"placement": {"volumes": [{"name": "data", "emptyDir": {}},
                                                           {"name": "data", "emptyDir": {}}]}},
              # a rule over every group's and the door's ports: more CEL than it is worth
              "a node port of two groups": {"trainers": {"network": {"expose": "NodePort", "port": 31000}},
                                            "backbone": {"network": {"expose": "NodePort", "port": 31001}}}},
    "BlockServer": {"a model volume source that is no volume source": {"model": {
        "tiny": None, "checkpoint": "/models/lm", "volume": {"source": {"nfs": "nas"}}}}},
    "ExpertPool": {"an unknown task option": {"task": {"options": {"bogus": 1}}}},
}


def cases(table: dict[str, dict[str, Any]]) -> list[Any]:
    return [pytest.param(kind, case, id=f"{kind}: {case}") for kind in sorted(table) for case in sorted(table[kind])]


@pytest.mark.parametrize("kind,case", cases(CROSS_FIELD))
def test_cross_field_rules_refuse_at_apply_and_in_the_model(kind, case):
    changes, path = CROSS_FIELD[kind][case]
    document = deep_update(BASES[kind], {"spec": changes})
    assert schema_errors(document) == []
    assert [failure.split(":")[0] for failure in cel_failures(document)] == [path]
    error = model_error(document)
    assert error is not None, f"the model accepts: {case}"
    assert path.rsplit(".", 1)[-1] in error, error  # both name the field


def test_every_cel_rule_has_a_bad_manifest():
    """A rule no case breaks could drift from its Python twin unnoticed."""
    broken = set()
    for kind, table in CROSS_FIELD.items():
        for changes, _ in table.values():
            document = stored(kind, deep_update(BASES[kind], {"spec": changes}))
            for rule_node, value in _rule_nodes(schema_of(kind), document):
                for rule in rule_node["x-kubernetes-validations"]:
                    if list(_failures({"x-kubernetes-validations": [rule]}, _typed(rule_node, value), "")):
                        broken.add((rule["rule"], rule["message"]))
    host_owned = {rule for rule in all_rules() if HOST_OWNED in rule[1]}  # test_join_spec's
    assert all_rules() - host_owned - broken == set()


def _rule_nodes(node: dict[str, Any], value: Any) -> Iterator[tuple[dict[str, Any], Any]]:
    if node.get("x-kubernetes-validations"):
        yield node, value
    if isinstance(value, dict):
        for name, prop in (node.get("properties") or {}).items():
            if name in value:
                yield from _rule_nodes(prop, value[name])
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for item in value:
            yield from _rule_nodes(node["items"], item)


@pytest.mark.parametrize("kind,case", cases(OPERATOR_ONLY))
def test_task_options_are_the_operators(kind, case):
    document = deep_update(BASES[kind], {"spec": OPERATOR_ONLY[kind][case]})
    assert schema_errors(document) == [] and cel_failures(document) == []
    assert model_error(document) is not None


# ---------------------------------------------------------------------------------------------
# Quantities


RESOURCES = {"Swarm": "trainers", "BlockServer": "servers", "ExpertPool": "servers"}


@pytest.mark.parametrize("kind", sorted(RESOURCES))
@pytest.mark.parametrize("field,value,accepted", [
    ("cpu", 2, True), ("cpu", "500m", True), ("cpu", "0.5", True), ("memory", "1.5Gi", True), ("memory", "1e9", True),
    ("memory", 1073741824, True),
    ("cpu", "lots", False), ("cpu", 0.5, False), ("cpu", -1, False), ("cpu", True, False), ("memory", "1Gb", False),
    ("memory", "", False), ("memory", "-1Gi", False),
])
def test_quantities_are_kubernetes_quantities(kind, field, value, accepted):
    document = deep_update(BASES[kind], {"spec": {RESOURCES[kind]: {"resources": {field: value}}}})
    assert (schema_errors(document) == []) is accepted
    assert (model_error(document) is None) is accepted


def test_a_claim_size_is_a_quantity():
    for size, accepted in (("10Gi", True), (10737418240, True), ("ten", False)):
        document = deep_update(BASES["ExpertPool"], {"spec": {"checkpoint": {"volumeClaim": {"size": size}}}})
        assert (schema_errors(document) == []) is accepted
        assert (model_error(document) is None) is accepted


def test_cel_evaluation_here_catches_what_the_api_server_would():
    """The evaluator refuses a rule that reads a field the stored object lacks, as the API server does."""
    failures = list(_failures({"x-kubernetes-validations": [{"rule": "self.missing > 0", "message": "m"}]}, {}, "spec"))
    assert len(failures) == 1 and failures[0].startswith("spec: m (error")


@pytest.mark.parametrize("cpu,memory", [(2, "1.5Gi"), ("500m", 1073741824), ("1e3", "512Mi")])
def test_quantities_render_into_valid_pod_resources(cpu, memory):
    kubernetes_validate = pytest.importorskip("kubernetes_validate", reason="pip install kubernetes-validate")
    pytest.importorskip("kopf")
    from hivekeeper.spec.common import Resources
    from hivekeeper_operator.pods import quantity_resources

    resources = quantity_resources(Resources(cpu=cpu, memory=memory))
    assert resources["requests"]["cpu"] == cpu and resources["requests"]["memory"] == memory  # as written
    pod = {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": "p"},
           "spec": {"containers": [{"name": "c", "image": "i", "resources": resources}]}}
    kubernetes_validate.validate(pod, "1.33.0", strict=True)


@pytest.mark.parametrize("kind", sorted(BASES))
def test_a_lab_named_twice_is_refused_by_the_list_map_and_the_model(kind):
    """The API server keeps `volunteers.labs` as a map by name (x-kubernetes-list-type), so it
    refuses a name twice itself; the model says so too."""
    labs = schema_of(kind)["properties"]["spec"]["properties"]["volunteers"]["properties"]["labs"]
    assert labs["x-kubernetes-list-type"] == "map" and labs["x-kubernetes-list-map-keys"] == ["name"]
    assert "name" in labs["items"]["required"]
    twice = deep_update(BASES[kind], {"spec": {"volunteers": {"labs": [
        {"name": "b", "maxPeers": 1, "roles": ["backbone"]}, {"name": "b", "maxPeers": 2, "roles": ["backbone"]}]}}})
    assert "a lab's name appears once" in model_error(twice)
