"""CustomResourceDefinitions generated from the spec models, so the cluster accepts exactly the
fields `hivekeeper validate` accepts.

Each kind registers a `KindInfo` (plural, short names, scale path, printer columns, its status
model) in `KINDS`; `crd(kind)` turns the kind's pydantic spec model into a *structural*
OpenAPI v3 schema (every node typed, `$ref`s inlined, `Optional[X]` as `nullable`, draft-2020
`exclusiveMinimum: x` as OpenAPI 3.0's `minimum: x, exclusiveMinimum: true`, tuples as
fixed-length arrays, no `additionalProperties: false` beside `properties`: the apiserver prunes
or, under kubectl's default strict field validation, rejects unknown fields instead).
`x-kubernetes-preserve-unknown-fields` is allowed only where a kind says so (a Swarm's
`task.options`, which the task itself checks).

What a schema cannot say (cross-field rules of the model validators, built-in task options)
the operator checks with the same models and reports as the `InvalidSpec` condition.
`jsonschema_for(kind)` gives the equivalent JSON Schema (draft 4, as the apiserver applies it)
for tests and tools.

The status models live here too: they are the Kubernetes face of a resource, not its spec.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Optional

import yaml
from pydantic import BaseModel, Field

from hivekeeper import API_GROUP, API_VERSION
from hivekeeper.spec.base import SpecModel
from hivekeeper.spec.manifest import _NAME, SPEC_MODELS, Metadata

CATEGORY = "hivekeeper"


# ---------------------------------------------------------------------------------------------
# Status models (what the operator writes under .status)


class Condition(SpecModel):
    """A Kubernetes-style condition (metav1.Condition)."""

    type: Literal["Ready", "Progressing", "Degraded"]
    status: Literal["True", "False", "Unknown"]
    reason: str = Field(description="CamelCase reason, e.g. AllPeersReady, RollingOut, InvalidSpec")
    message: str = ""
    last_transition_time: str = Field(description="RFC 3339 time the status last changed")
    observed_generation: Optional[int] = None


class RoleStatus(SpecModel):
    desired: int = Field(0, ge=0, description="pods the spec asks for")
    replicas: int = Field(0, ge=0, description="pods that exist")
    ready: int = Field(0, ge=0, description="pods that pass their readiness probe")


class ResourceStatus(SpecModel):
    """What the operator writes for every kind; each kind adds its roles and live figures."""

    observed_generation: Optional[int] = Field(None, description="the metadata.generation this status describes")
    phase: Optional[Literal["Pending", "Running", "Succeeded", "Failed", "Invalid"]] = None
    conditions: list[Condition] = Field(default_factory=list)
    ready_peers: Optional[str] = Field(None, description="ready pods / desired pods, all roles")
    initial_peers: list[str] = Field(default_factory=list, description="multiaddrs of the backbone peers")
    backbone: Optional[RoleStatus] = None
    relays: Optional[RoleStatus] = None
    auth: Optional[RoleStatus] = None
    volunteer_gateway: Optional[str] = Field(
        None, description="host:port volunteers pass to `hivekeeper join` (spec.volunteers)")
    volunteer_relays: list[str] = Field(default_factory=list, description="the relays' public multiaddrs")


class SwarmStatus(ResourceStatus):
    trainers: Optional[RoleStatus] = None
    auxiliary: Optional[RoleStatus] = None
    monitor: Optional[RoleStatus] = None
    balancer: Optional[RoleStatus] = None
    selector: Optional[str] = Field(None, description="label selector of the trainer pods (scale subresource)")
    peers_alive: dict[str, int] = Field(default_factory=dict, description="peers reporting in the DHT, by role")
    global_step: Optional[int] = Field(None, ge=0, description="the collaboration's optimizer step (monitor)")
    samples_per_second: Optional[float] = Field(None, ge=0, description="collaboration throughput (monitor)")
    steps_per_second: Optional[float] = Field(None, ge=0, description="optimizer steps/s over the last minute (monitor)")
    planned_steps_per_second: Optional[float] = Field(
        None, ge=0, description="steps/s the balancer's current averaging plan predicts")
    loss: Optional[float] = None
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
        PrinterColumn("Plan steps/s", "number", ".status.plannedStepsPerSecond",
                      "steps/s the averaging plan predicts", priority=1),
        AGE,
    ),
    preserve_unknown=frozenset({"task.options"}),
    extra_constraints={"optimizer.betas[]": {"minimum": 0, "maximum": 1, "exclusiveMaximum": True}},
))


class ExpertPoolStatus(ResourceStatus):
    servers: Optional[RoleStatus] = None
    trainers: Optional[RoleStatus] = None
    selector: Optional[str] = Field(None, description="label selector of the expert server pods (scale subresource)")
    experts_hosted: Optional[int] = Field(None, ge=0, description="experts the spec spreads over the servers")
    experts_alive: Optional[int] = Field(None, ge=0, description="experts announced in the DHT and not expired")
    assignment: dict[str, list[str]] = Field(default_factory=dict, description="expert uids each server holds")
    step: Optional[int] = Field(None, ge=0, description="batches done by the furthest trainer")
    samples_per_second: Optional[float] = Field(None, ge=0, description="samples/s summed over live trainers")
    loss: Optional[float] = None
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
    preserve_unknown=frozenset({"task.options"}),
))


class BlockServerStatus(ResourceStatus):
    servers: Optional[RoleStatus] = None
    balancer: Optional[RoleStatus] = None
    client: Optional[RoleStatus] = None
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
))


# ---------------------------------------------------------------------------------------------
# pydantic JSON Schema -> structural OpenAPI v3


class SchemaError(ValueError):
    """The model has a field the generator cannot express as a structural schema."""


_KEEP = {"type", "description", "properties", "required", "items", "enum", "minimum", "maximum",
         "exclusiveMinimum", "exclusiveMaximum", "minLength", "maxLength", "pattern", "minItems",
         "maxItems", "additionalProperties", "nullable", "format"}


def openapi_schema(model: type[BaseModel], preserve_unknown: frozenset[str] = frozenset(),
                   extra_constraints: dict[str, dict[str, Any]] | None = None,
                   describe_defaults: bool = True) -> dict[str, Any]:
    """The structural OpenAPI v3 schema of a pydantic model (camelCase fields).

    Defaults are not part of the schema (the models apply them, so a manifest stays what its
    author wrote); with `describe_defaults` each description names the default, read from an
    instance of the model so that nested defaults (auxiliary peers' smaller memory) are right."""
    source = model.model_json_schema(by_alias=True, mode="validation")
    defs = source.pop("$defs", {})
    extra = dict(extra_constraints or {})
    defaults: Any = _MISSING
    if describe_defaults:
        try:
            defaults = model().model_dump(by_alias=True, mode="json")
        except ValueError:  # a model with required fields: fall back to the schema's defaults
            defaults = None
    schema = _convert(source, defs, "", preserve_unknown, extra, defaults)
    if extra:
        raise SchemaError(f"extra constraints for unknown paths: {', '.join(sorted(extra))}")
    return schema


_MISSING = object()


def _convert(node: dict[str, Any], defs: dict[str, Any], path: str, preserve: frozenset[str],
             extra: dict[str, dict[str, Any]], defaults: Any = _MISSING) -> dict[str, Any]:
    node = _resolve(node, defs)
    description = node.get("description")
    if defaults is _MISSING:
        default = None
    elif isinstance(defaults, (bool, int, float, str)):
        default = defaults
    else:
        default = node.get("default")
    nullable = False
    if "anyOf" in node:  # Optional[X] is anyOf [X, null]
        options = [_resolve(o, defs) for o in node["anyOf"]]
        non_null = [o for o in options if o.get("type") != "null"]
        if len(non_null) != 1 or len(options) - len(non_null) != 1:
            raise SchemaError(f"{path or '(root)'}: only Optional[X] unions can be expressed")
        nullable = True
        node = {**non_null[0], **{k: v for k, v in node.items() if k not in ("anyOf",)}}
    if "const" in node:
        node = {**node, "enum": [node.pop("const")]}

    out: dict[str, Any] = {}
    kind = node.get("type")
    if path in preserve:
        out = {"type": "object", "x-kubernetes-preserve-unknown-fields": True}
    elif kind == "object" and "properties" in node:
        props = {}
        for name, sub in node["properties"].items():
            sub_defaults = defaults.get(name) if isinstance(defaults, dict) else (
                _MISSING if defaults is _MISSING else None)
            props[name] = _convert(sub, defs, f"{path}.{name}" if path else name, preserve, extra, sub_defaults)
        out = {"type": "object", "properties": props}
        if node.get("required"):
            out["required"] = list(node["required"])
    elif kind == "object":
        values = node.get("additionalProperties")
        if not isinstance(values, dict) or not values:
            raise SchemaError(f"{path}: a free-form object needs an entry in preserve_unknown")
        out = {"type": "object", "additionalProperties": _convert(values, defs, f"{path}{{}}", preserve, extra)}
    elif kind == "array":
        if "prefixItems" in node:  # a fixed-length tuple of one item type
            items = [_convert(i, defs, f"{path}[]", preserve, {}) for i in node["prefixItems"]]
            if any(i != items[0] for i in items):
                raise SchemaError(f"{path}: tuples of mixed types cannot be expressed")
            out = {"type": "array", "items": _convert(node["prefixItems"][0], defs, f"{path}[]", preserve, extra),
                   "minItems": len(items), "maxItems": len(items)}
        else:
            if not node.get("items"):
                raise SchemaError(f"{path}: arrays need a typed item")
            out = {"type": "array", "items": _convert(node["items"], defs, f"{path}[]", preserve, extra)}
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
    if nullable:
        out["nullable"] = True
    text = description or ""
    if default is not None and default != "" and isinstance(default, (bool, int, float, str)):
        shown = str(default).lower() if isinstance(default, bool) else default
        text = f"{text} (default: {shown})" if text else f"default: {shown}"
    if text:
        out = {"description": text, **out}
    unknown = set(out) - _KEEP - {"x-kubernetes-preserve-unknown-fields"}
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
    spec_schema = openapi_schema(SPEC_MODELS[kind], info.preserve_unknown, info.extra_constraints)
    status_schema = openapi_schema(info.status_model, describe_defaults=False)
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
    field validation: unknown fields rejected (except under preserve-unknown-fields), `nullable`
    allowing null, `metadata.name` checked."""
    schema = copy.deepcopy(crd(kind)["spec"]["versions"][0]["schema"]["openAPIV3Schema"])
    schema["properties"]["apiVersion"]["enum"] = [f"{API_GROUP}/{API_VERSION}"]
    schema["properties"]["kind"]["enum"] = [kind]
    schema["required"] = ["apiVersion", "kind", "metadata", "spec"]
    schema["properties"]["metadata"]["required"] = ["name"]
    schema["properties"]["metadata"]["additionalProperties"] = True
    return {"$schema": "http://json-schema.org/draft-04/schema#", **_strict(schema, top=True)}


def _strict(node: dict[str, Any], top: bool = False) -> dict[str, Any]:
    node = dict(node)
    if node.pop("nullable", False):
        node["type"] = [node["type"], "null"]
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
