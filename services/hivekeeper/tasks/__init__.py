"""Built-in training tasks, and loading a user's task from 'module:factory'. Checking a task's
options imports no torch (`options.py`); building a task does."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any, Callable, Mapping

from pydantic import ValidationError

from hivekeeper.errors import format_validation_error
from hivekeeper.tasks.options import BUILTIN_OPTIONS, TaskOptions

if TYPE_CHECKING:
    from hivekeeper.tasks.base import Task


def __getattr__(name: str) -> Any:
    if name == "Task":  # imports torch: only when asked for
        from hivekeeper.tasks.base import Task

        return Task
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _digits() -> type[Task]:
    from hivekeeper.tasks.digits import DigitsTask

    return DigitsTask


def _causal_lm() -> type[Task]:
    from hivekeeper.tasks.causal_lm import CausalLMTask

    return CausalLMTask


BUILTIN_TASKS: dict[str, Callable[[], type[Task]]] = {"digits": _digits, "causal-lm": _causal_lm}


def _is_factory_path(name: str) -> bool:
    module, _, attr = name.partition(":")
    return bool(module and attr)


def check_task_options(name: str, options: Mapping[str, Any]) -> str | None:
    """None if the task name and options are valid, else 'field: message' (relative to spec.task)."""
    if name in BUILTIN_OPTIONS:
        try:
            BUILTIN_OPTIONS[name].model_validate(dict(options))
        except ValidationError as e:
            return "options." + format_validation_error(e)
        return None
    if _is_factory_path(name):
        return None  # checked when imported: the module may exist only inside the image
    return f"name: expected one of {', '.join(sorted(BUILTIN_TASKS))} or 'module:factory' (got {name!r})"


def load_task(name: str, options: Mapping[str, Any] | None = None, seed: int = 0) -> Task:
    if name in BUILTIN_TASKS:
        return BUILTIN_TASKS[name]()(options, seed=seed)
    module_name, _, attr = name.partition(":")
    factory = getattr(importlib.import_module(module_name), attr)
    task = factory(options or {}, seed=seed)
    from hivekeeper.tasks.base import Task

    if not isinstance(task, Task):
        raise TypeError(f"{name} returned {type(task).__name__}, expected a hivekeeper.tasks.Task")
    return task


__all__ = ["BUILTIN_TASKS", "Task", "TaskOptions", "check_task_options", "load_task"]
