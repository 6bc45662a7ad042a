"""The task registry: which tasks exist, as Python entry points of the group ``kubetune.tasks``.

Each entry point names a ``TaskEntry``: the light half of a task (pydantic models and plain
functions, no torch), which is all the spec needs; its ``runtime`` names the half that trains
(``kubetune.tasks.base.Task``), imported only when a job runs. The built-in tasks are declared in
pyproject.toml; a task installed from another distribution (or a ``*.dist-info`` directory on
``sys.path``) is found the same way, so a new task is one module plus one registry line and
nothing in kubetune names it. Entry points rather than a table in ``kubetune.tasks``: the spec
(this layer) is built from the registry, and a table there would be an import up the layers.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from importlib import metadata
from types import MappingProxyType
from typing import Any

from kubetune.config.base import DataCommon, Section

GROUP = "kubetune.tasks"


def _no_problems(data: Any, section: Any) -> list[str]:
    return []


@dataclass(frozen=True)
class TaskEntry:
    """A task as the spec sees it.

    Attributes:
        data: the model of the spec's ``data`` section for this task (a ``DataCommon`` whose ``task``
            field is ``Literal[<the task's name>]``).
        summary: one line for the ``task`` field's help and ``kubetune init``.
        runtime: ``"module:attribute"`` of the task's ``Task`` (imported on first use: torch).
        section: the model of the task's own top-level spec section, keyed by the task's name (absent
            from a spec: None, meaning its defaults); None when the task has none.
        checks: (data section, own section or None) -> the problems between them, one line each.
        default: the task of a spec that names none (one task only).
        order: where the task comes in listings (lower first); then by name.
        auto_model: the ``transformers`` Auto class a Kubeflow SDK call names for this task, if any.
        peft_task_type: the ``peft.TaskType`` name a Kubeflow SDK LoRA config implies for it, if any.
        streaming_needs_lora: ``data.streaming`` only with a ``lora`` section (the full fine-tune needs
            something of the whole training set before the first step).
        render_warnings: (the job spec) -> what a render must tell about the pods that it cannot check,
            one line each (e.g. the user's code the trainer image must hold).
        pipeline_tag: the transformers pipeline that serves the exported model, as the training half's
            ``Presentation.pipeline_tag`` says (`render --serve` picks the serving runtime's task by it
            without importing torch); None: ask the training half.
    """

    data: type[DataCommon]
    summary: str
    runtime: str
    section: type[Section] | None = None
    checks: Callable[[Any, Any], list[str]] = _no_problems
    default: bool = False
    order: int = 100
    auto_model: str | None = None
    peft_task_type: str | None = None
    streaming_needs_lora: bool = False
    render_warnings: Callable[[Any], list[str]] = lambda spec: []
    pipeline_tag: str | None = None


@functools.cache
def entries() -> Mapping[str, TaskEntry]:
    """Every registered task by name, in listing order (read once per process: installed
    distributions do not change while it runs).

    Raises:
        TypeError: an entry point of the group names something that is not a ``TaskEntry``.
    """
    found: dict[str, TaskEntry] = {}
    for point in metadata.entry_points(group=GROUP):
        entry = point.load()
        if not isinstance(entry, TaskEntry):
            raise TypeError(f"entry point {point.name} = {point.value} of {GROUP} is not a kubetune TaskEntry")
        found.setdefault(point.name, entry)  # the first on sys.path wins, as for imports
    ordered = sorted(found.items(), key=lambda item: (item[1].order, item[0]))
    return MappingProxyType(dict(ordered))


def default_task() -> str:
    """The task of a spec that names none."""
    return next((name for name, entry in entries().items() if entry.default), next(iter(entries()), ""))
