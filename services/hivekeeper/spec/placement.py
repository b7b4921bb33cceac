"""Where a role group's pods run in a cluster and what they carry besides hivekeeper's own:
node selection, tolerations, affinity, priority and scheduler, extra labels and annotations
(a Kueue queue, a cost centre), environment variables and volumes a lab must mount.

Every kind has a spec-wide `placement` and one on each role group; the group's is merged over
the spec-wide one (`Placement.over`). `hivekeeper up` ignores placement: it runs processes on
one machine. Names the operator's own pods use (volumes, variables, mount paths) are checked
where the pod is assembled (`hivekeeper_operator.pods`), the rest here."""

from __future__ import annotations

import re
from typing import Any, Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, StrictBool, field_validator, model_validator

from hivekeeper.spec.base import CelRule, SpecModel

DNS_SUBDOMAIN = r"^[a-z0-9]([-a-z0-9.]*[a-z0-9])?$"
DNS_LABEL = r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$"
_NAME_PART = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_PREFIX = re.compile(DNS_SUBDOMAIN)
# Label and annotation prefixes whose keys the operator writes itself.
OWNED_PREFIXES = ("hivekeeper.dev/", "app.kubernetes.io/")
# The free-form parts (Kubernetes' own types), relative to a placement: the CRD keeps their content.
FREE_FORM = ("affinity", "volumes[]", "env[].valueFrom")
# The API server prices a CEL rule by the largest input the schema allows: these bound the rules' cost.
MAX_ENTRIES = 64
_OWNED = " || ".join(f"k.startsWith('{prefix}')" for prefix in OWNED_PREFIXES)


def label_key_error(key: str) -> str | None:
    """Why `key` is not a Kubernetes label or annotation key (None: it is one)."""
    prefix, _, name = key.rpartition("/")
    if prefix and (len(prefix) > 253 or not _PREFIX.match(prefix)):
        return f"{key!r}: the prefix before '/' must be a DNS subdomain"
    if len(name) > 63 or not _NAME_PART.match(name):
        return f"{key!r}: the name must be 1-63 letters, digits, '-', '_' or '.', starting and ending alphanumeric"
    return None


def _check_keys(values: dict[str, str], label_values: bool) -> dict[str, str]:
    for key, value in values.items():
        error = label_key_error(key)
        if error:
            raise ValueError(error)
        if label_values and value and (len(value) > 63 or not _NAME_PART.match(value)):
            raise ValueError(f"{key}={value!r}: a label value is at most 63 letters, digits, '-', '_' or '.', "
                             "starting and ending alphanumeric")
    return values


class Toleration(SpecModel):
    """A pod toleration, as in Kubernetes."""

    key: Optional[str] = Field(None, description="the taint's key; empty with operator Exists: every taint")
    operator: Literal["Equal", "Exists"] = Field("Equal", description="Equal: the taint's key and value; Exists: "
                                                                      "any value of the key")
    value: Optional[str] = Field(None, description="the taint's value (operator Equal)")
    effect: Optional[Literal["NoSchedule", "PreferNoSchedule", "NoExecute"]] = Field(
        None, description="the taint effect to tolerate; empty: all")
    toleration_seconds: Optional[int] = Field(
        None, description="NoExecute: how long the pod stays bound after the taint appears")

    cel_rules = (
        CelRule("has(self.key) && self.key != '' || self.operator == 'Exists'",
                "a toleration without a key needs operator Exists", ".operator"),
        CelRule("self.operator != 'Exists' || !has(self.value) || self.value == ''",
                "operator Exists takes no value", ".value"),
        CelRule("!has(self.tolerationSeconds) || has(self.effect) && self.effect == 'NoExecute'",
                "tolerationSeconds applies to effect NoExecute only", ".tolerationSeconds"),
    )

    @model_validator(mode="after")
    def _kubernetes_rules(self) -> "Toleration":
        if self.key is not None and label_key_error(self.key):
            raise ValueError(f"key: {label_key_error(self.key)}")
        if not self.key and self.operator != "Exists":
            raise ValueError("a toleration without a key needs operator Exists")
        if self.operator == "Exists" and self.value:
            raise ValueError("operator Exists takes no value")
        if self.toleration_seconds is not None and self.effect != "NoExecute":
            raise ValueError("tolerationSeconds applies to effect NoExecute only")
        return self


class EnvVar(SpecModel):
    """An environment variable of the pod's container, as in Kubernetes."""

    name: str = Field(pattern=r"^[-._a-zA-Z][-._a-zA-Z0-9]*$", max_length=253, description="the variable's name")
    value: Optional[str] = Field(None, description="its value (or valueFrom)")
    value_from: Optional[dict[str, Any]] = Field(
        None, description="as a container's env valueFrom: secretKeyRef, configMapKeyRef, fieldRef, resourceFieldRef")

    cel_rules = (CelRule("!(has(self.value) && has(self.valueFrom))", "set value or valueFrom, not both", ".valueFrom"),)

    @model_validator(mode="after")
    def _one_source(self) -> "EnvVar":
        if self.value is not None and self.value_from is not None:
            raise ValueError(f"env {self.name}: set value or valueFrom, not both")
        return self


class Volume(BaseModel):
    """A pod volume, as in Kubernetes: a name and one volume source (persistentVolumeClaim, nfs,
    hostPath, configMap, secret, csi, image, ...), given as Kubernetes takes it."""

    model_config = ConfigDict(extra="allow")

    name: str = Field(pattern=DNS_LABEL, max_length=63, description="the volume's name, for volumeMounts")

    @model_validator(mode="after")
    def _one_source(self) -> "Volume":
        sources = self.model_extra or {}
        if len(sources) != 1 or not isinstance(next(iter(sources.values())), dict):
            raise ValueError(f"volume {self.name}: give exactly one volume source, e.g. "
                             "persistentVolumeClaim: {claimName: NAME} (got "
                             f"{', '.join(sorted(sources)) or 'none'})")
        return self


class VolumeMount(SpecModel):
    name: str = Field(pattern=DNS_LABEL, max_length=63, description="a volume of this placement or the spec-wide one")
    mount_path: str = Field(pattern=r"^/", max_length=4096, description="absolute path in the container")
    read_only: StrictBool = Field(False, description="mount it read-only")
    sub_path: Optional[str] = Field(None, pattern=r"^[^/]", description="a path inside the volume")


class Placement(SpecModel):
    """Cluster only (`hivekeeper up` ignores it): where the pods run and what they carry besides
    hivekeeper's own. A role group's placement is merged over the spec-wide one: maps key by key,
    env and volumes by name, volumeMounts by mountPath, tolerations added; affinity,
    priorityClassName and schedulerName replaced."""

    node_selector: dict[str, str] = Field(default_factory=dict, max_length=MAX_ENTRIES,
                                          description="node labels the pods require")
    tolerations: list[Toleration] = Field(default_factory=list, max_length=MAX_ENTRIES)
    affinity: Optional[dict[str, Any]] = Field(
        None, description="a pod affinity as Kubernetes takes it: nodeAffinity, podAffinity, podAntiAffinity")
    priority_class_name: Optional[str] = Field(None, pattern=DNS_SUBDOMAIN, max_length=253,
                                               description="the pods' PriorityClass")
    scheduler_name: Optional[str] = Field(None, min_length=1, description="default: the cluster's default scheduler")
    labels: dict[str, str] = Field(
        default_factory=dict, max_length=MAX_ENTRIES,
        description="on the pods and their workload, e.g. kueue.x-k8s.io/queue-name "
                    "(keys under hivekeeper.dev/ and app.kubernetes.io/ are the operator's)")
    annotations: dict[str, str] = Field(default_factory=dict, max_length=MAX_ENTRIES,
                                        description="on the pods and their workload")
    env: list[EnvVar] = Field(default_factory=list, max_length=MAX_ENTRIES,
                              description="besides hivekeeper's own variables")
    volumes: list[Volume] = Field(default_factory=list, max_length=MAX_ENTRIES,
                                  description="besides hivekeeper's own volumes")
    volume_mounts: list[VolumeMount] = Field(default_factory=list, max_length=MAX_ENTRIES,
                                             description="of this placement's volumes or the spec-wide ones")

    # Empty maps and lists are not stored: each rule first asks whether its field is there.
    cel_rules = (
        *(CelRule(f"!has(self.{field}) || !self.{field}.exists(k, {_OWNED})",
                  "keys under hivekeeper.dev/ and app.kubernetes.io/ are the operator's", f".{field}")
          for field in ("labels", "annotations")),
        *(CelRule(f"!has(self.{field}) || self.{field}.all(a, self.{field}.exists_one(b, b.{key} == a.{key}))",
                  f"a {key} appears twice", f".{field}", "FieldValueDuplicate")
          # (a volume is free-form to the schema, so its name is the model's to check)
          for field, key in (("env", "name"), ("volumeMounts", "mountPath"))),
    )

    @field_validator("node_selector")
    @classmethod
    def _selector_is_labels(cls, value: dict[str, str]) -> dict[str, str]:
        return _check_keys(value, label_values=True)

    @field_validator("labels", "annotations")
    @classmethod
    def _not_the_operators(cls, value: dict[str, str], info) -> dict[str, str]:
        owned = [k for k in value if k.startswith(OWNED_PREFIXES)]
        if owned:
            raise ValueError(f"{owned[0]}: keys under {' and '.join(OWNED_PREFIXES)} are the operator's")
        return _check_keys(value, label_values=info.field_name == "labels")

    @model_validator(mode="after")
    def _unique(self) -> "Placement":
        for field, items, key in (("env", self.env, lambda e: e.name), ("volumes", self.volumes, lambda v: v.name),
                                  ("volumeMounts", self.volume_mounts, lambda m: m.mount_path)):
            seen: set[str] = set()
            for item in items:
                if key(item) in seen:
                    raise ValueError(f"{field}: {key(item)!r} appears twice")
                seen.add(key(item))
        return self

    def over(self, default: "Placement") -> "Placement":
        """This placement merged over `default` (the spec-wide one)."""

        def by(key, first: list, second: list) -> list:
            return list({key(item): item for item in [*first, *second]}.values())

        return Placement.model_construct(
            node_selector={**default.node_selector, **self.node_selector},
            tolerations=[*default.tolerations, *(t for t in self.tolerations if t not in default.tolerations)],
            affinity=self.affinity if self.affinity is not None else default.affinity,
            priority_class_name=self.priority_class_name or default.priority_class_name,
            scheduler_name=self.scheduler_name or default.scheduler_name,
            labels={**default.labels, **self.labels}, annotations={**default.annotations, **self.annotations},
            env=by(lambda e: e.name, default.env, self.env),
            volumes=by(lambda v: v.name, default.volumes, self.volumes),
            volume_mounts=by(lambda m: m.mount_path, default.volume_mounts, self.volume_mounts))


def check_placements(spec: Any) -> None:
    """Every section's placement, merged over the spec-wide one, mounts only volumes it has."""
    for name in type(spec).model_fields:
        section = getattr(spec, name)
        group = getattr(section, "placement", None)
        if not isinstance(group, Placement):
            continue
        merged = group.over(spec.placement)
        volumes = {v.name for v in merged.volumes}
        alias = type(spec).model_fields[name].alias or name
        for mount in merged.volume_mounts:
            if mount.name not in volumes:
                raise ValueError(f"{alias}.placement.volumeMounts: {mount.name!r} names no volume of "
                                 f"{alias}.placement or placement")


def free_form_paths(*groups: str) -> frozenset[str]:
    """The CRD paths whose content Kubernetes' own types define, for the spec-wide placement and
    each group's (`KindInfo.preserve_unknown`)."""
    return frozenset(f"{prefix}placement.{part}" for prefix in ("", *(f"{g}." for g in groups)) for part in FREE_FORM)
