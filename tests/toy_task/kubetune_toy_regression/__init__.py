"""A toy task that lives outside kubetune: regression of a number per text (a sequence classifier
with one output and a squared-error loss). tests/unit/test_task_seam.py registers it through an
entry point of the group ``kubetune.tasks`` and runs it end to end; nothing in src/ names it.

This half is what the spec needs (pydantic only): the data section, the task's own section and
the registry entry, which names the task's starter spec (``starter.yaml`` beside this file, its
package data)."""

from __future__ import annotations

import dataclasses
from typing import Literal

from pydantic import Field

from kubetune.config.base import DataCommon, Section
from kubetune.config.tasks import TaskEntry


class RegressionData(DataCommon):
    """``data`` for task: regression."""

    task: Literal["regression"] = Field("regression", exclude=True, description="(internal) the job's task")
    target_column: str = Field("target", description="regression: the numeric column to predict.")


class RegressionSpec(Section):
    """How the target is learned."""

    target_scale: float = Field(1.0, gt=0, description="The target is learned (and predicted) times this.")


def _checks(data: RegressionData | None, section: RegressionSpec | None) -> list[str]:
    if data is not None and data.target_column == data.text_column:
        return ["data.target_column must differ from data.text_column"]
    return []


ENTRY = TaskEntry(
    data=RegressionData,
    summary="a number per text (a toy task registered by the tests)",
    runtime="kubetune_toy_regression.task:TASK",
    starter="kubetune_toy_regression:starter.yaml",
    section=RegressionSpec,
    checks=_checks,
)

# The same task registered without a starter (tests/integration/test_task_plugin.py): `kubetune init`
# then writes one built from this entry.
BARE = dataclasses.replace(ENTRY, starter=None)
