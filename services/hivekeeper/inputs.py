"""Input files of the offline commands (`hivekeeper plan ...`): YAML or JSON, validated by a
model, every error one line naming the file and the field."""

from __future__ import annotations

from pathlib import Path
from typing import TypeVar

import yaml
from pydantic import BaseModel, ValidationError

from hivekeeper.errors import UserError, format_validation_error

ModelT = TypeVar("ModelT", bound=BaseModel)
# libyaml's safe loader when PyYAML has it: the pure-Python one takes seconds for thousands of peers
_SafeLoader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)


def load_input(path: str, model: type[ModelT]) -> ModelT:
    try:
        data = yaml.load(Path(path).read_text(), Loader=_SafeLoader)  # JSON is YAML too
    except OSError as e:
        raise UserError(f"{path}: cannot read: {e.strerror}") from e
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" at line {mark.line + 1}" if mark else ""
        raise UserError(f"{path}: not valid YAML or JSON{where}") from e
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise UserError(format_validation_error(e, source=path)) from e
