"""The tasks: one package per task, each with its spec half in ``__init__.py`` (an ``ENTRY``,
``config.tasks.TaskEntry``: pydantic only) and its training half in ``task.py`` (a ``TASK``,
``tasks.base.Task``), registered by one entry point line (pyproject.toml, group ``kubetune.tasks``).
Nothing outside this package names a task; what every task shares is ``base`` and ``common``.

This module stays light (no torch): importing a task's spec half imports it first."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from kubetune.config.tasks import entries

if TYPE_CHECKING:
    from kubetune.tasks.base import Task

__all__ = ["get", "names"]


def names() -> list[str]:
    """The registered tasks' names, in listing order."""
    return list(entries())


def get(name: str) -> Task:
    """The training half of the task registered as ``name`` (a validated spec's ``task``).

    Raises:
        KeyError: no task of that name is registered.
    """
    module, _, attr = entries()[name].runtime.partition(":")
    return getattr(importlib.import_module(module), attr)
