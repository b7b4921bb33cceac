"""Input files of the offline commands (`hivekeeper plan ...`): YAML or JSON, validated by a
model, every error one line naming the file and the field."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError
from pydantic.alias_generators import to_camel

from hivekeeper.errors import UserError, format_validation_error

ModelT = TypeVar("ModelT", bound=BaseModel)
# Text that JSON and YAML read alike where it is JSON: printable ASCII, without tabs (YAML takes
# none between tokens) or backslashes (the two languages' escapes differ at the edges)
_PLAIN_TEXT = re.compile(r"[\n\r\x20-\x5b\x5d-\x7e]*")
_YAML_FLOAT = re.compile(r"-?[0-9]+\.[0-9]+(?:[eE][-+][0-9]+)?")  # YAML 1.1 reads 1e5 and 1.5e5 as strings


class InputModel(BaseModel):
    """An input file's model, with the manifests' conventions (`hivekeeper.spec.base.SpecModel`:
    camelCase on the wire, unknown fields rejected), minus the import of every spec model."""

    model_config = ConfigDict(alias_generator=to_camel, populate_by_name=True, extra="forbid",
                              validate_assignment=True, frozen=False)


class _ReadDifferently(ValueError):
    """JSON that YAML reads otherwise."""


def _yaml_float(literal: str) -> float:
    if not _YAML_FLOAT.fullmatch(literal):
        raise _ReadDifferently(literal)
    return float(literal)


def _yaml_constant(literal: str) -> Any:
    raise _ReadDifferently(literal)  # NaN, Infinity: strings to YAML


def _parse(text: str, path: str) -> Any:
    """What YAML reads in the text (JSON is YAML too), or where YAML refuses valid JSON (a key
    over 1,024 characters, a colon on the key's next line, some escapes), what JSON reads.
    Through the json module first where the two read it alike: libyaml takes a third of a
    second for 4,096 peers, json a hundredth."""
    if _PLAIN_TEXT.fullmatch(text):
        try:
            return json.loads(text, parse_float=_yaml_float, parse_constant=_yaml_constant)
        except ValueError:  # not JSON, or JSON that YAML reads otherwise
            pass
    import yaml

    try:
        # libyaml's safe loader when PyYAML has it: the pure-Python one takes seconds for thousands of peers
        return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    except yaml.YAMLError as e:
        try:
            return json.loads(text)
        except ValueError:
            pass
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"{path}: not valid YAML or JSON{where}") from e


def load_input(path: str, model: type[ModelT]) -> ModelT:
    try:
        text = Path(path).read_text()
    except OSError as e:
        raise UserError(f"{path}: cannot read: {e.strerror}") from e
    data = _parse(text, path)
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise UserError(format_validation_error(e, source=path)) from e
