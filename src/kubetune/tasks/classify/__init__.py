"""Sequence classification (a label per text; BERT-class encoders): the task's spec half, its data
section and registry entry. The training half is ``task.py`` (``TASK``), its data ``data.py``, the
starter spec `kubetune init sequence-classification` writes ``starter.yaml``."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kubetune.config.base import DataCommon
from kubetune.config.tasks import KServeRuntime, TaskEntry


class ClassificationData(DataCommon):
    """``data`` for task: sequence-classification."""

    task: Literal["sequence-classification"] = Field(
        "sequence-classification", exclude=True, description="(internal) the job's task, set from `task`"
    )
    text_pair_column: str | None = Field(
        None, description="Optional second text column (sentence pairs, e.g. NLI); encoded as [CLS] a [SEP] b [SEP]."
    )
    label_column: str = Field(
        "label",
        description="Column holding the class label: strings or numbers; mapped to ids in sorted order (numerically "
        "when every label is a number). None/NA/null are labels, not missing.",
    )
    max_classes: int = Field(
        1000,
        ge=2,
        le=100_000,
        description="Most distinct labels a classification dataset may have; "
        "more is almost always the wrong label column.",
    )


def _checks(data: ClassificationData, section: None) -> list[str]:
    out = []
    if data.text_pair_column and data.text_pair_column == data.text_column:
        out.append("data.text_pair_column must differ from data.text_column")
    if data.label_column in (data.text_column, data.text_pair_column):
        out.append("data.label_column must differ from the text columns")
    return out


ENTRY = TaskEntry(
    data=ClassificationData,
    summary="a label per text, for BERT-class encoders",
    runtime="kubetune.tasks.classify.task:TASK",
    starter="kubetune.tasks.classify:starter.yaml",
    checks=_checks,
    default=True,
    order=0,
    auto_model="AutoModelForSequenceClassification",
    peft_task_type="SEQ_CLS",
    kserve=KServeRuntime("sequence_classification"),
)
