"""Base model for every manifest section: camelCase fields on the wire, snake_case in
Python, unknown fields rejected, values validated on assignment."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict
from pydantic.alias_generators import to_camel


class SpecModel(BaseModel):
    model_config = ConfigDict(
        alias_generator=to_camel,
        populate_by_name=True,
        extra="forbid",
        validate_assignment=True,
        frozen=False,
    )
