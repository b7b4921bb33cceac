"""Errors a user can fix. They print as one line and exit with code 2."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # every command imports UserError; not every command needs pydantic
    from pydantic import ValidationError


class UserError(Exception):
    """Bad input from the user: a manifest, a flag, an input file."""


def format_validation_error(error: ValidationError, source: str = "") -> str:
    """One line naming the first offending field path and what was expected.

    pydantic reports every error; a user fixes them one at a time, and the first is
    the one that names the outermost problem. The count of the rest is appended.
    """
    errors = error.errors(include_url=False)
    first = errors[0]
    path = ".".join(str(part) for part in first["loc"] if part != "__root__") or "(top level)"
    kind = first["type"]
    if kind == "extra_forbidden":
        message = "unknown field"
    elif kind == "missing":
        message = "required field is missing"
    else:
        message = first["msg"]
        if "input" in first and kind not in ("model_type", "dict_type"):
            message += f" (got {first['input']!r})"
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    prefix = f"{source}: " if source else ""
    return f"{prefix}{path}: {message}{more}"
