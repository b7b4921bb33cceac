"""CustomResourceDefinitions generated from the spec models, so the cluster accepts exactly the
fields `hivekeeper validate` accepts.

Each kind registers a `KindInfo` (plural, short names, scale path, printer columns, its status
model) in `KINDS`; `crd(kind)` turns the kind's pydantic spec model into a *structural*
OpenAPI v3 schema (every node typed, `$ref`s inlined, draft-2020 `exclusiveMinimum: x` as
OpenAPI 3.0's `minimum: x, exclusiveMinimum: true`, tuples as fixed-length arrays, no
`additionalProperties: false` beside `properties`: the apiserver prunes or, under kubectl's
default strict field validation, rejects unknown fields instead).
`x-kubernetes-preserve-unknown-fields` is allowed only where a kind says so (a Swarm's
`task.options`, which the task itself checks).

The API server stores what the models would fill in: every field's default (`default:`), an
object's in full (the API server checks a default as it stands, its own fields undefaulted);
`Optional[X]` is not `nullable`, so a null is pruned and the field left unset, as None is in
the models. The models' cross-field rules are CEL (`x-kubernetes-validations`, from each
model's `cel_rules`), so `kubectl apply` refuses what `hivekeeper validate` refuses; what CEL
cannot say (built-in task options) the operator checks with the same models and reports as the
`InvalidSpec` condition. `jsonschema_for(kind)` gives the equivalent JSON Schema (draft 4, as
the apiserver applies it) and `stored(kind, document)` the defaulting, for tests and tools.

The status models live here too: they are the Kubernetes face of a resource, not its spec.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, Field
from pydantic.fields import FieldInfo
from pydantic.json_schema import GenerateJsonSchema, JsonSchemaValue
from pydantic_core import core_schema, to_jsonable_python

from hivekeeper import API_GROUP, API_VERSION
from hivekeeper.spec.base import SpecModel
from hivekeeper.spec.join import host_owned_rules
from hivekeeper.spec.manifest import _NAME, SPEC_MODELS, Metadata
from hivekeeper.spec.placement import free_form_paths

CATEGORY = "hivekeeper"


# ---------------------------------------------------------------------------------------------
# Status models (what the operator writes under .status)


class Condition(SpecModel):
    """A Kubernetes-style condition (metav1.Condition)."""

    type: Literal["Ready", "Progressing", "Degraded", "Joined"] = Field(
        description="which condition (Joined: a resource with spec.join is admitted by the host's token service)")
    status: Literal["True", "False", "Unknown"] = Field(description="whether it holds")
    reason: str = Field(description="CamelCase reason, e.g. AllPeersReady, RollingOut, InvalidSpec")
    message: str = Field("", description="what a person should know, in a sentence")
    last_transition_time: str = Field(description="RFC 3339 time the status last changed")
    observed_generation: Optional[int] = None


class RoleStatus(SpecModel):
    desired: int = Field(0, ge=0, description="pods the spec asks for")
    replicas: int = Field(0, ge=0, description="pods that exist")
    ready: int = Field(0, ge=0, description="pods that pass their readiness probe")


class ResourceStatus(SpecModel):
    """What the operator writes for every kind; each kind adds its roles and live figures."""

    observed_generation: Optional[int] = Field(None, description="the metadata.generation this status describes")
    phase: Optional[Literal["Pending", "Running", "Succeeded", "Failed", "Invalid"]] = Field(
        None, description="Invalid: the spec is refused (the InvalidSpec condition says why)")
    conditions: list[Condition] = Field(default_factory=list)
    ready_peers: Optional[str] = Field(None, description="ready pods / desired pods, all roles")
    initial_peers: list[str] = Field(default_factory=list, description="multiaddrs of the backbone peers")
    backbone: Optional[RoleStatus] = Field(None, description="the backbone's pods")
    relays: Optional[RoleStatus] = Field(None, description="the relays' pods (spec.volunteers)")
    auth: Optional[RoleStatus] = Field(None, description="the token service's pods (spec.volunteers)")
    volunteer_gateway: Optional[str] = Field(
        None, description="host:port volunteers pass to `hivekeeper join` (spec.volunteers)")
    volunteer_relays: list[str] = Field(default_factory=list, description="the relays' public multiaddrs")


class LabStatus(SpecModel):
    """One party's part in a swarm: the host's own peers, or a lab's (or a volunteer's)."""

    name: str = Field(..., description="the lab's identity; the host's row is named after the resource")
    host: bool = Field(False, description="the host's own peers")
    peers: int = Field(0, ge=0, description="its peers reporting in the DHT")
    samples_per_second: float = Field(0.0, ge=0, description="its trainers' samples/s")
    samples: int = Field(0, ge=0, description="samples its trainers have computed")
    share: float = Field(0.0, ge=0, le=1, description="its part of the samples computed so far")
    averaging_bytes_sent: int = Field(0, ge=0, description="bytes its trainers sent in averaging rounds")


class SwarmStatus(ResourceStatus):
    trainers: Optional[RoleStatus] = Field(None, description="the trainers' pods")
    auxiliary: Optional[RoleStatus] = Field(None, description="the auxiliary peers' pods")
    monitor: Optional[RoleStatus] = Field(None, description="the monitor's pod")
    balancer: Optional[RoleStatus] = Field(None, description="the balancer's pod")
    selector: Optional[str] = Field(None, description="label selector of the trainer pods (scale subresource)")
    peers_alive: dict[str, int] = Field(default_factory=dict, description="peers reporting in the DHT, by role")
    labs: list[LabStatus] = Field(default_factory=list, max_length=1000,
                                  description="each party's peers and part, once labs or volunteers take part")
    global_step: Optional[int] = Field(None, ge=0, description="the collaboration's optimizer step (monitor)")
    samples_per_second: Optional[float] = Field(None, ge=0, description="collaboration throughput (monitor)")
    achieved_steps_per_second: Optional[float] = Field(
        None, ge=0, description="optimizer steps/s over the last minute (monitor)")
    predicted_steps_per_second: Optional[float] = Field(
        None, ge=0, description="steps/s the balancer's current averaging plan predicts")
    efficiency: Optional[float] = Field(
        None, ge=0, description="achieved / predicted steps/s: under 0.5 for long, something the plan does not model")
    outer_steps: Optional[int] = Field(
        None, ge=0, description="replicas that train alone: DiLoCo outer steps (merges in modes parameters, ties)")
    loss: Optional[float] = Field(None, description="mean training loss of the latest step (monitor)")
    eval_metrics: dict[str, float] = Field(default_factory=dict, description="latest held-out metrics")
    last_monitor_update: Optional[str] = Field(None, description="RFC 3339 time of the last monitor reading")


# ---------------------------------------------------------------------------------------------
# The registry of kinds


@dataclass(frozen=True)
class PrinterColumn:
    name: str
    type: str
    json_path: str
    description: str = ""
    priority: int = 0

    def render(self) -> dict[str, Any]:
        column = {"name": self.name, "type": self.type, "jsonPath": self.json_path}
        if self.description:
            column["description"] = self.description
        if self.priority:
            column["priority"] = self.priority
        return column


@dataclass(frozen=True)
class KindInfo:
    kind: str
    plural: str
    short_names: tuple[str, ...]
    description: str
    status_model: type[BaseModel]
    # The scale subresource: the field that sets how many workers run (`kubectl scale`, HPA).
    spec_replicas_path: str
    printer_columns: tuple[PrinterColumn, ...]
    label_selector_path: str = ".status.selector"
    # Dotted spec paths whose free-form content a schema cannot describe.
    preserve_unknown: frozenset[str] = frozenset()
    # Constraints a model states in a validator, restated for the schema: path -> extra keywords.
    extra_constraints: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def status_replicas_path(self) -> str:
        """The same role's count in the status (`.spec.trainers.replicas` -> `.status.trainers.replicas`)."""
        return self.spec_replicas_path.replace(".spec.", ".status.", 1)

    @property
    def singular(self) -> str:
        return self.kind.lower()

    @property
    def crd_name(self) -> str:
        return f"{self.plural}.{API_GROUP}"


AGE = PrinterColumn("Age", "date", ".metadata.creationTimestamp")
PHASE = PrinterColumn("Phase", "string", ".status.phase")
READY = PrinterColumn("Ready", "string", ".status.readyPeers", "ready pods / desired pods")

KINDS: dict[str, KindInfo] = {}


# A list of labs is a map by name: the API server refuses a name twice, at no CEL cost (a CEL
# uniqueness rule is quadratic, and the API server's cost estimate refused the CRD).
LABS_BY_NAME = {"volunteers.labs": {"x-kubernetes-list-type": "map", "x-kubernetes-list-map-keys": ["name"]}}


def register_kind(info: KindInfo) -> KindInfo:
    KINDS[info.kind] = info
    return info


register_kind(KindInfo(
    kind="Swarm",
    plural="swarms",
    short_names=("sw",),
    description="A DeDLOC collaborative training run: backbone DHT peers, trainers, auxiliary averagers and a "
                "monitor (`hivekeeper up` runs the same manifest on one machine).",
    status_model=SwarmStatus,
    spec_replicas_path=".spec.trainers.replicas",
    printer_columns=(
        PHASE,
        READY,
        PrinterColumn("Trainers", "integer", ".status.trainers.ready", "ready trainer pods", priority=1),
        PrinterColumn("Step", "integer", ".status.globalStep", "global optimizer step"),
        PrinterColumn("Samples/s", "number", ".status.samplesPerSecond", "collaboration throughput"),
        PrinterColumn("Steps/s", "number", ".status.achievedStepsPerSecond", "optimizer steps/s achieved",
                      priority=1),
        PrinterColumn("Efficiency", "number", ".status.efficiency", "achieved / predicted steps/s", priority=1),
        AGE,
    ),
    preserve_unknown=frozenset({"task.options"})
    | free_form_paths("backbone", "trainers", "auxiliary", "monitor", "balancer", "volunteers"),
    extra_constraints={"optimizer.betas[]": {"minimum": 0, "maximum": 1, "exclusiveMaximum": True}, **LABS_BY_NAME},
))


class ExpertPoolStatus(ResourceStatus):
    servers: Optional[RoleStatus] = Field(None, description="the expert servers' pods")
    trainers: Optional[RoleStatus] = Field(None, description="the trainers' pods")
    selector: Optional[str] = Field(None, description="label selector of the expert server pods (scale subresource)")
    experts_hosted: Optional[int] = Field(None, ge=0, description="experts the spec spreads over the servers")
    experts_alive: Optional[int] = Field(None, ge=0, description="experts announced in the DHT and not expired")
    assignment: dict[str, list[str]] = Field(default_factory=dict, description="expert uids each server holds")
    step: Optional[int] = Field(None, ge=0, description="batches done by the furthest trainer")
    samples_per_second: Optional[float] = Field(None, ge=0, description="samples/s summed over live trainers")
    loss: Optional[float] = Field(None, description="training loss the trainers last reported")
    eval_metrics: dict[str, float] = Field(default_factory=dict, description="latest held-out metrics")


register_kind(KindInfo(
    kind="ExpertPool",
    plural="expertpools",
    short_names=("xp",),  # not "ep": that is core Endpoints' short name
    description="A Learning@home decentralized mixture-of-experts: expert servers holding the experts of a "
                "d-dimensional grid, announced in the DHT, and trainers whose DMoE layers pick top-k experts by "
                "beam search (`hivekeeper up` runs the same manifest on one machine).",
    status_model=ExpertPoolStatus,
    spec_replicas_path=".spec.servers.replicas",
    printer_columns=(
        PHASE,
        READY,
        PrinterColumn("Servers", "integer", ".status.servers.ready", "ready expert server pods"),
        PrinterColumn("Experts", "integer", ".status.expertsAlive", "experts announced in the DHT"),
        PrinterColumn("Step", "integer", ".status.step", "trainer batches done"),
        PrinterColumn("Samples/s", "number", ".status.samplesPerSecond", "trainer throughput", priority=1),
        AGE,
    ),
    preserve_unknown=frozenset({"task.options"}) | free_form_paths("backbone", "servers", "trainers", "volunteers"),
    extra_constraints=LABS_BY_NAME,
))


class BlockServerStatus(ResourceStatus):
    servers: Optional[RoleStatus] = Field(None, description="the block servers' pods")
    balancer: Optional[RoleStatus] = Field(None, description="the balancer's pod")
    client: Optional[RoleStatus] = Field(None, description="the scripted client's pod")
    selector: Optional[str] = Field(None, description="label selector of the block server pods (scale subresource)")
    num_blocks: Optional[int] = Field(None, ge=0, description="transformer blocks of the model")
    served_blocks: Optional[str] = Field(None, description="blocks held by an online server / all blocks")
    min_block_throughput: Optional[float] = Field(
        None, ge=0, description="tokens/s of the worst-served block, online servers summed")
    spans: dict[str, str] = Field(default_factory=dict, description="server -> 'first-last' block it holds")


register_kind(KindInfo(
    kind="BlockServer",
    plural="blockservers",
    short_names=("bs",),
    description="Petals: servers that each hold a contiguous span of a causal language model's transformer "
                "blocks; clients run inference and parameter-efficient fine-tuning through chains of servers "
                "(`hivekeeper up` runs the same manifest on one machine).",
    status_model=BlockServerStatus,
    spec_replicas_path=".spec.servers.replicas",
    printer_columns=(
        PHASE,
        READY,
        PrinterColumn("Blocks", "string", ".status.servedBlocks", "blocks served / all blocks"),
        PrinterColumn("Throughput", "number", ".status.minBlockThroughput", "tokens/s of the worst-served block"),
        AGE,
    ),
    preserve_unknown=frozenset({"model.volume.source"})
    | free_form_paths("backbone", "servers", "balancer", "client", "volunteers"),
    extra_constraints=LABS_BY_NAME,
))


# ---------------------------------------------------------------------------------------------
# pydantic JSON Schema -> structural OpenAPI v3


class SchemaError(ValueError):
    """The model has a field the generator cannot express as a structural schema."""


_KEEP = {"type", "description", "properties", "required", "items", "enum", "minimum", "maximum",
         "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems",
         "maxItems", "maxProperties", "additionalProperties", "format", "default", "x-kubernetes-int-or-string",
         "x-kubernetes-preserve-unknown-fields", "x-kubernetes-validations", "x-kubernetes-list-type",
         "x-kubernetes-list-map-keys"}


class _CrdJsonSchema(GenerateJsonSchema):
    """pydantic's JSON Schema plus what only a CRD says: each model's CEL rules and, on each of
    its properties, the default the API server stores."""

    def model_schema(self, schema: core_schema.ModelSchema) -> JsonSchemaValue:
        out = super().model_schema(schema)
        cls = schema["cls"]
        if getattr(cls, "cel_rules", ()):
            out["x-kubernetes-validations"] = [rule.render() for rule in cls.cel_rules]
        properties = out.get("properties", {})
        for name, info in cls.model_fields.items():
            prop = properties.get(info.alias or name)
            if prop is None:
                continue
            prop.pop("default", None)
            default = stored_default(info)
            if default is not None:
                prop["default"] = default
        return out


def stored_default(info: FieldInfo) -> Any:
    """What the API server stores for an omitted field: the model's default as JSON, an object's
    in full; None for a required field, or one whose default says nothing (None means unset, and
    empty lists and maps are left out, as the models read them)."""
    if info.is_required():
        return None
    value = _without_empties(to_jsonable_python(info.get_default(call_default_factory=True), by_alias=True,
                                                exclude_none=True))
    return None if value in (None, {}, []) else value


def _without_empties(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: v for k, v in ((k, _without_empties(v)) for k, v in value.items()) if v not in ({}, [])}
    if isinstance(value, list):
        return [_without_empties(v) for v in value]
    return value


def openapi_schema(model: type[BaseModel], preserve_unknown: frozenset[str] = frozenset(),
                   extra_constraints: dict[str, dict[str, Any]] | None = None,
                   store_defaults: bool = True) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of a pydantic model (camelCase fields): with
    `store_defaults` each field's default, named in its description too (kubectl explain)."""
    source = model.model_json_schema(by_alias=True, mode="validation", schema_generator=_CrdJsonSchema)
    defs = source.pop("$defs", {})
    extra = dict(extra_constraints or {})
    schema = _convert(source, defs, "", preserve_unknown, extra, store_defaults)
    if extra:
        raise SchemaError(f"extra constraints for unknown paths: {', '.join(sorted(extra))}")
    return json.loads(json.dumps(schema))  # no node shared between paths (YAML would write anchors)


def _convert(node: dict[str, Any], defs: dict[str, Any], path: str, preserve: frozenset[str],
             extra: dict[str, dict[str, Any]], store_defaults: bool) -> dict[str, Any]:
    node = _resolve(node, defs)
    description = node.get("description")
    default = node.get("default") if store_defaults else None
    if "anyOf" in node:  # Optional[X] is anyOf [X, null]: unset when null, which the apiserver prunes
        options = [_resolve(o, defs) for o in node["anyOf"]]
        non_null = [o for o in options if o.get("type") != "null"]
        if len(non_null) != 1 or len(options) - len(non_null) != 1:
            raise SchemaError(f"{path or '(root)'}: only Optional[X] unions can be expressed")
        node = {**non_null[0], **{k: v for k, v in node.items() if k not in ("anyOf",)}}
    if "const" in node:
        node = {**node, "enum": [node.pop("const")]}

    def child(sub: dict[str, Any], sub_path: str, constraints: dict[str, dict[str, Any]] = extra) -> dict[str, Any]:
        return _convert(sub, defs, sub_path, preserve, constraints, store_defaults)

    out: dict[str, Any] = {}
    kind = node.get("type")
    if path in preserve:
        out = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    elif node.get("x-kubernetes-int-or-string"):  # a Kubernetes quantity
        out = {k: node[k] for k in ("x-kubernetes-int-or-string", "minimum", "pattern") if k in node}
    elif kind == "object" and "properties" in node:
        props = {name: child(sub, f"{path}.{name}" if path else name) for name, sub in node["properties"].items()}
        out = {"type": "object", "properties": props}
        if node.get("required"):
            out["required"] = list(node["required"])
        if node.get("x-kubernetes-validations"):
            out["x-kubernetes-validations"] = node["x-kubernetes-validations"]
    elif kind == "object":
        values = node.get("additionalProperties")
        if not isinstance(values, dict) or not values:
            raise SchemaError(f"{path}: a free-form object needs an entry in preserve_unknown")
        out = {"type": "object", "additionalProperties": child(values, f"{path}{{}}")}
        if "maxProperties" in node:  # bounds what a CEL rule over the map may cost
            out["maxProperties"] = node["maxProperties"]
    elif kind == "array":
        if "prefixItems" in node:  # a fixed-length tuple of one item type
            items = [child(i, f"{path}[]", {}) for i in node["prefixItems"]]
            if any(i != items[0] for i in items):
                raise SchemaError(f"{path}: tuples of mixed types cannot be expressed")
            out = {"type": "array", "items": child(node["prefixItems"][0], f"{path}[]"),
                   "minItems": len(items), "maxItems": len(items)}
        else:
            if not node.get("items"):
                raise SchemaError(f"{path}: arrays need a typed item")
            out = {"type": "array", "items": child(node["items"], f"{path}[]")}
        for key in ("minItems", "maxItems"):
            if key in node:
                out[key] = node[key]
    elif kind in ("string", "integer", "number", "boolean"):
        out = {"type": kind}
        for key in ("enum", "minimum", "maximum", "minLength", "maxLength", "pattern", "format"):
            if key in node:
                out[key] = node[key]
        for key, bound in (("exclusiveMinimum", "minimum"), ("exclusiveMaximum", "maximum")):
            if key in node and not isinstance(node[key], bool):
                out[bound] = node[key]
                out[key] = True
    elif "enum" in node:
        values = node["enum"]
        types = {type(v) for v in values}
        if types != {str}:
            raise SchemaError(f"{path}: only string enums can be expressed")
        out = {"type": "string", "enum": values}
    else:
        raise SchemaError(f"{path or '(root)'}: untyped field (type {kind!r}); give it a type or preserve_unknown")

    if path in extra:
        out.update(extra.pop(path))
    if default is not None:
        out["default"] = default
    text = description or ""
    if isinstance(default, (bool, int, float, str)) and default != "":
        shown = str(default).lower() if isinstance(default, bool) else default
        text = f"{text} (default: {shown})" if text else f"default: {shown}"
    if text:
        out = {"description": text, **out}
    unknown = set(out) - _KEEP
    assert not unknown, unknown
    return out


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    while "$ref" in node:
        target = defs[node["$ref"].rsplit("/", 1)[1]]
        node = {**target, **{k: v for k, v in node.items() if k != "$ref"}}
    return node


# ---------------------------------------------------------------------------------------------
# The CRD documents


def crd(kind: str) -> dict[str, Any]:
    """The CustomResourceDefinition of one kind, as a plain dict ready for YAML."""
    info = KINDS[kind]
    model = SPEC_MODELS[kind]
    spec_schema = openapi_schema(model, info.preserve_unknown, info.extra_constraints)
    # a joining resource's host-owned fields (spec.join): rules over the whole spec's schema
    spec_schema.setdefault("x-kubernetes-validations", []).extend(
        rule.render() for rule in host_owned_rules(model, model.lab_owned, kind, spec_schema))
    status_schema = openapi_schema(info.status_model, store_defaults=False)
    name_field = Metadata.model_fields["name"]
    max_name = next(m.max_length for m in name_field.metadata if hasattr(m, "max_length"))
    schema = {
        "type": "object", "description": info.description, "required": ["spec"],
        "properties": {
            "apiVersion": {"type": "string"}, "kind": {"type": "string"},
            "metadata": {"type": "object", "properties": {
                "name": {"type": "string", "maxLength": max_name, "pattern": _NAME.pattern}}},
            "spec": spec_schema, "status": status_schema,
        },
    }
    version = {
        "name": API_VERSION, "served": True, "storage": True, "schema": {"openAPIV3Schema": schema},
        "subresources": {"status": {}, "scale": {"specReplicasPath": info.spec_replicas_path,
                                                 "statusReplicasPath": info.status_replicas_path,
                                                 "labelSelectorPath": info.label_selector_path}},
        "additionalPrinterColumns": [c.render() for c in info.printer_columns],
    }
    return {
        "apiVersion": "apiextensions.k8s.io/v1", "kind": "CustomResourceDefinition",
        "metadata": {"name": info.crd_name,
                     "labels": {"app.kubernetes.io/name": "hivekeeper", "app.kubernetes.io/part-of": "hivekeeper"}},
        "spec": {
            "group": API_GROUP, "scope": "Namespaced",
            "names": {"kind": kind, "listKind": f"{kind}List", "plural": info.plural, "singular": info.singular,
                      "shortNames": list(info.short_names), "categories": [CATEGORY]},
            "versions": [version],
        },
    }


def missing_kinds() -> list[str]:
    """Kinds with a spec model but no CRD registration (a test keeps this empty)."""
    return sorted(set(SPEC_MODELS) - set(KINDS))


def crd_files() -> dict[str, str]:
    """File name -> YAML text, one file per registered kind that has a spec model."""
    header = "# Generated by `hivekeeper crds` from the spec models; do not edit by hand.\n"
    return {f"{KINDS[kind].crd_name}.yaml": header + yaml.safe_dump(crd(kind), sort_keys=False, width=120)
            for kind in sorted(set(KINDS) & set(SPEC_MODELS))}


def write_crds(out_dir: str | Path) -> list[Path]:
    """Write every CRD into `out_dir`, removing generated CRDs of kinds that no longer exist."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = crd_files()
    for stale in out.glob(f"*.{API_GROUP}.yaml"):
        if stale.name not in files:
            stale.unlink()
    written = []
    for name, text in files.items():
        path = out / name
        if not path.exists() or path.read_text() != text:
            path.write_text(text)
        written.append(path)
    return written


# ---------------------------------------------------------------------------------------------
# The same schema as JSON Schema, for tests and tools


def jsonschema_for(kind: str) -> dict[str, Any]:
    """The CRD's schema as a draft-4 JSON Schema that behaves as the apiserver does with strict
    field validation, for a document as the API server stores it (`stored`): unknown fields
    rejected (except under preserve-unknown-fields), `metadata.name` checked. CEL rules are not
    JSON Schema: the tests evaluate them."""
    schema = copy.deepcopy(crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"]["enum"] = [f"{API_GROUP}/{API_VERSION}"]
    schema["properties"]["kind"]["enum"] = [kind]
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    schema["properties"]["metadata"]["required"] = ["name"]
    schema["properties"]["metadata"]["additionalProperties"] = True
    return {"$schema": "http://json-schema.org/draft-04/schema#", **_strict(schema)}


def _strict(node: dict[str, Any]) -> dict[str, Any]:
    node = dict(node)
    if node.pop("x-kubernetes-int-or-string", False):
        node["type"] = ["integer", "string"]
    preserve = node.pop("x-kubernetes-preserve-unknown-fields", False)
    if "properties" in node:
        node["properties"] = {k: _strict(v) for k, v in node["properties"].items()}
        if not preserve:
            node.setdefault("additionalProperties", False)
    elif isinstance(node.get("additionalProperties"), dict):
        node["additionalProperties"] = _strict(node["additionalProperties"])
    if isinstance(node.get("items"), dict):
        node["items"] = _strict(node["items"])
    return node


def stored(kind: str, document: dict[str, Any]) -> dict[str, Any]:
    """`document` as the API server stores it, before it validates it: nulls pruned (no field is
    nullable), then every absent field that has a default set to it and defaulted in turn (the
    apiserver's structural defaulting)."""
    schema = crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    return _defaulted(schema, copy.deepcopy(document))


def _defaulted(node: dict[str, Any], value: Any) -> Any:
    if isinstance(value, dict) and "properties" in node:
        for name, prop in node["properties"].items():
            if name in value and value[name] is None:
                del value[name]
            if name not in value and "default" in prop:
                value[name] = copy.deepcopy(prop["default"])
            if name in value:
                _defaulted(prop, value[name])
    elif isinstance(value, dict) and isinstance(node.get("additionalProperties"), dict):
        for key in [k for k, v in value.items() if v is None]:
            del value[key]
        for item in value.values():
            _defaulted(node["additionalProperties"], item)
    elif isinstance(value, list) and isinstance(node.get("items"), dict):
        for item in value:
            _defaulted(node["items"], item)
    return value
