"""The tasks: one package per task, each with its spec half in ``__init__.py`` (an ``ENTRY``,
``config.tasks.TaskEntry``: pydantic only) and its training half in ``task.py`` (a ``TASK``,
``tasks.base.Task``), registered by one entry point line (pyproject.toml, group ``kubetune.tasks``).
Nothing outside this package names a task; what every task shares is ``base`` and ``common``. A model a
task exported is predicted with and served through ``for_model`` (the task's ``Inference``).

This module stays light (no torch): importing a task's spec half imports it first."""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import TYPE_CHECKING

from kubetune.config.tasks import entries

if TYPE_CHECKING:
    from kubetune.tasks.base import Task

__all__ = ["artifact_files", "for_model", "get", "names"]


def names() -> list[str]:
    """The registered tasks' names, in listing order."""
    return list(entries())


def get(name: str) -> Task:
    """The training half of the task registered as ``name`` (a validated spec's ``task``).

    Raises:
        KeyError: no task of that name is registered.
        TypeError: its ``artifact_files`` names a file that is not a plain name or is one of kubetune's own.
    """
    from kubetune.artifacts.output import artifact_file_problem

    module, _, attr = entries()[name].runtime.partition(":")
    task = getattr(importlib.import_module(module), attr)
    # a plugin's mistake, found when its task is first used rather than at the export after training
    for file in task.artifact_files:
        problem = artifact_file_problem(file)
        if problem is not None:
            raise TypeError(f"task {name}: artifact_files entry {file!r} {problem}")
    return task


def for_model(path: Path) -> tuple[str, Task]:
    """The task whose inference takes the exported model in ``path`` (a model directory): the task of
    the run that exported it (its metrics.json beside ``model/``) where that task has an inference, else
    the first registered task whose inference claims the model's config.json (which is checked).

    Raises:
        KubetuneError: the model cannot be loaded (``inference.model.check_model``), or no registered
            task's inference takes it.
    """
    from kubetune.errors import KubetuneError
    from kubetune.inference.model import check_model, run_task, short

    config = check_model(path)
    name = run_task(path)
    if name is not None and name in entries() and get(name).inference is not None:
        return name, get(name)
    inferring = [(n, get(n), inference) for n in names() if (inference := get(n).inference) is not None]
    for n, task, inference in inferring:
        if inference.claims(config):
            return n, task
    nouns = list(dict.fromkeys(inference.noun for _, _, inference in inferring))
    archs = config.get("architectures") or ["?"]
    raise KubetuneError(
        f"{short(str(path / 'config.json'))} describes a {short(archs[0], 60)}, neither a {' nor a '.join(nouns)}",
        field="MODEL",
        fix="pass a model kubetune exported (a job's output or its model/ directory)",
    )


def reported_metrics(name: str) -> set[str]:
    """The metrics every run of task ``name`` reports (metrics.json, its log's evaluation and ``done:`` lines):
    what a hyperparameter search may optimize, besides lm-eval scores."""
    task = get(name)
    names = {"eval_loss", "train_loss", *task.headline, *task.present.eval_curves}
    return names | {f"eval_{m}" for m in task.train_metrics}


def artifact_files(name: str | None) -> tuple[str, ...]:
    """The artifact files (``Task.artifact_files``) of the task registered as ``name``: e.g. of the task of
    the finished run a new run replaces (``artifacts.output.Output.replaced_task``), which kubetune wrote
    and so removes; () for None, and for a task not installed or not loading here (its files unknown: they
    stay, logged)."""
    import logging

    if name is None:
        return ()
    try:
        return get(name).artifact_files
    except (KeyError, ImportError, AttributeError, TypeError) as e:
        logging.getLogger(__name__).warning(
            "the finished run being replaced was of task %r, which does not load here (%s): the files its export "
            "wrote beside kubetune's own, if any, are kept",
            name,
            e,
        )
        return ()
