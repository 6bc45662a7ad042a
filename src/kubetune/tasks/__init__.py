"""The tasks: one self-contained module per task, each defining a ``TASK`` (``tasks/base.py``),
and the registry that maps the spec's ``task`` value to it. A new task is its module, its line in
``REGISTRY`` and its data section's model in ``config.schema.DATA_SPECS``."""

from __future__ import annotations

import importlib

from kubetune.tasks.base import Prepared, Presentation, Task

__all__ = ["REGISTRY", "Prepared", "Presentation", "Task", "get"]

# task name -> the module that defines its TASK (imported on first use: each pulls in torch and transformers)
REGISTRY = {
    "sequence-classification": "kubetune.tasks.classify",
    "causal-lm": "kubetune.tasks.causal_lm",
    "dpo": "kubetune.tasks.dpo",
}


def get(name: str) -> Task:
    """The task registered as ``name`` (a validated spec's ``task``)."""
    return importlib.import_module(REGISTRY[name]).TASK
