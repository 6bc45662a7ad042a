"""KTO (Kahneman-Tversky Optimization: a causal LM tuned on unpaired answers, each flagged desirable or not, TRL's
KTOTrainer): the task's spec half, its data section, its own ``kto:`` section and registry entry. The training half
is ``task.py`` (``TASK``); reading the examples is ``data.py``; ``starter.yaml`` is the starter spec
`kubetune init kto` writes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kubetune.config.base import DataCommon, Section
from kubetune.config.tasks import KServeRuntime, TaskEntry


class KTOData(DataCommon):
    """``data`` for task: kto (unpaired preference data, TRL's conventions)."""

    task: Literal["kto"] = Field("kto", exclude=True, description="(internal) the job's task, set from `task`")
    format: Literal["auto", "text", "chat"] = Field(
        "auto",
        description="kto data layout. text: prompt and completion are strings, joined as they are (the completion "
        "ends with the EOS token). chat: message lists rendered with the chat template, or strings, which become a "
        "user turn and an assistant turn. auto: chat when the completion (or chosen) column holds message lists, "
        "else text.",
    )
    prompt_column: str = Field("prompt", description="kto: the prompt column (string or message list).")
    completion_column: str = Field("completion", description="kto: the answer column (string or message list).")
    label_column: str = Field(
        "label",
        description="kto: whether the answer is desirable: true/false, 1/0, yes/no (any case); anything else is "
        "refused, naming the row.",
    )
    chosen_column: str = Field(
        "chosen",
        description="kto: paired data instead (no completion column): each pair gives its chosen answer as a "
        "desirable example and its rejected one as an undesirable one (TRL's unpairing).",
    )
    rejected_column: str = Field("rejected", description="kto, paired data: the dispreferred answer.")
    system_prompt: str | None = Field(
        None, description="kto chat format: a system message put first in every prompt that has none."
    )
    chat_template: str | None = Field(
        None,
        description="kto chat format: a Jinja chat template used instead of the tokenizer's (saved with the exported "
        "tokenizer). Absent: the tokenizer's, else kubetune's fallback template.",
    )
    max_length: int = Field(
        512,
        ge=8,
        le=32768,
        description="Token limit of prompt + answer; longer sequences lose their end, and examples whose prompt "
        "alone fills it are dropped (counted).",
    )


class KTOSpec(Section):
    """The KTO loss (the names of TRL's KTOConfig)."""

    beta: float = Field(
        default=0.1,
        gt=0,
        description="How far the policy may move from the reference model: an answer's reward is beta × (its "
        "log-probability under the policy − under the reference).",
    )
    desirable_weight: float = Field(
        default=1.0, gt=0, description="The weight of each desirable example's loss (raise it when they are the fewer)."
    )
    undesirable_weight: float = Field(
        default=1.0,
        gt=0,
        description="The weight of each undesirable example's loss (raise it when they are the fewer).",
    )


ENTRY = TaskEntry(
    data=KTOData,
    summary="preference tuning of a causal LM on unpaired answers flagged desirable or undesirable (KTO, TRL's "
    "KTOTrainer)",
    runtime="kubetune.tasks.kto.task:TASK",
    starter="kubetune.tasks.kto:starter.yaml",
    section=KTOSpec,
    order=6,
    fsdp_needs_lora=True,  # the full fine-tune's reference: a frozen copy of the model, which FSDP cannot make
    kserve=KServeRuntime("text_generation", adapters=True),
    language_model=True,
)
