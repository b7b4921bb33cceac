"""Base model for every manifest section: camelCase fields on the wire, snake_case in
Python, unknown fields rejected, values validated on assignment. A section whose validator
checks rules across its fields states them in CEL too (`cel_rules`), so the API server
refuses what `hivekeeper validate` refuses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


@dataclass(frozen=True)
class CelRule:
    """One rule of a model's validator as the CRD states it (`x-kubernetes-validations` on the
    model's schema node). `rule` is CEL over `self`, the section as the API server stores it
    (every default filled in; a field that is None in Python is absent: test it with has());
    `field_path` (relative, e.g. `.trainers.batchSize`) is the field the error names."""

    rule: str
    message: str
    field_path: str = ""
    reason: str = ""  # FieldValueInvalid unless FieldValueForbidden, FieldValueRequired, FieldValueDuplicate

    def render(self) -> dict[str, Any]:
        out = {"rule": self.rule, "message": self.message}
        if self.field_path:
            out["fieldPath"] = self.field_path
        if self.reason:
            out["reason"] = self.reason
        return out


class SpecModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        frozen=False,
    )
    # The validator's rules the API server checks too; keep each beside its Python check.
    cel_rules: ClassVar[tuple[CelRule, ...]] = ()
