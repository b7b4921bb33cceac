"""Manifests: Kubernetes-shaped documents (apiVersion, kind, metadata, spec) parsed into
typed models. Every error names the field path and what was expected, in one line."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Generic, TypeVar

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from hivekeeper import API_GROUP, API_VERSION
from hivekeeper.errors import UserError, format_validation_error
from hivekeeper.spec.blockserver import BlockServerSpec
from hivekeeper.spec.expertpool import ExpertPoolSpec
from hivekeeper.spec.swarm import SwarmSpec

API = f"{API_GROUP}/{API_VERSION}"
# RFC 1123 label: names become pod, service and DNS names.
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")

SPEC_MODELS: dict[str, type[BaseModel]] = {"Swarm": SwarmSpec, "ExpertPool": ExpertPoolSpec,
                                            "BlockServer": BlockServerSpec}

SpecT = TypeVar("SpecT", bound=BaseModel)


class Metadata(BaseModel):
    # Kubernetes adds many metadata fields (uid, resourceVersion, managedFields...): keep them, check the name.
    model_config = ConfigDict(extra="allow")
    name: str = Field(min_length=1, max_length=40)
    namespace: str = "default"
    labels: dict[str, str] = Field(default_factory=dict)


class Manifest(BaseModel, Generic[SpecT]):
    model_config = ConfigDict(extra="forbid")
    api_version: str = Field(alias="apiVersion")
    kind: str
    metadata: Metadata
    spec: SpecT
    status: dict[str, Any] | None = None


def parse_manifest(document: Any, source: str = "") -> Manifest:
    """Validate one manifest document (already loaded from YAML/JSON)."""
    prefix = f"{source}: " if source else ""
    if not isinstance(document, dict):
        raise UserError(f"{prefix}a manifest must be a mapping with apiVersion, kind, metadata and spec")
    if document.get("apiVersion") != API:
        raise UserError(f"{prefix}apiVersion: expected {API!r} (got {document.get('apiVersion')!r})")
    kind = document.get("kind")
    if kind not in SPEC_MODELS:
        raise UserError(f"{prefix}kind: expected one of {', '.join(sorted(SPEC_MODELS))} (got {kind!r})")
    model = Manifest[SPEC_MODELS[kind]]  # type: ignore[index]
    try:
        manifest = model.model_validate(document)
    except ValidationError as e:
        raise UserError(format_validation_error(e, source)) from None
    if not _NAME.match(manifest.metadata.name):
        raise UserError(
            f"{prefix}metadata.name: must be lowercase letters, digits and '-' (got {manifest.metadata.name!r})"
        )
    _check_task(manifest, prefix)
    return manifest


def load_manifest(path: str | Path) -> Manifest:
    """Read a YAML (or JSON) file holding exactly one manifest."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as e:
        raise UserError(f"{path}: cannot read: {e.strerror}") from None
    try:
        documents = [d for d in yaml.safe_load_all(text) if d is not None]
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML: {str(e).splitlines()[0]}") from None
    if len(documents) != 1:
        raise UserError(f"{path}: expected exactly one manifest, found {len(documents)}")
    return parse_manifest(documents[0], source=str(path))


def _check_task(manifest: Manifest, prefix: str) -> None:
    """Built-in tasks validate their options now, so a typo fails before anything starts."""
    spec = manifest.spec
    if not isinstance(spec, SwarmSpec):
        return
    from hivekeeper.tasks import check_task_options

    error = check_task_options(spec.task.name, spec.task.options)
    if error:
        raise UserError(f"{prefix}spec.task.{error}")
