"""Reward modelling (a score per answer learned from chosen/rejected pairs, TRL's RewardTrainer): the task's
spec half, its data section, its own ``reward-model:`` section and registry entry. The training half is
``task.py`` (``TASK``); the pairs are read by ``tasks.pairs`` (DPO's shapes, and a margin column);
``starter.yaml`` is the starter spec `kubetune init reward-model` writes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kubetune.config.base import DataCommon, Section
from kubetune.config.tasks import TaskEntry

NAME = "reward-model"


class RewardData(DataCommon):
    """``data`` for task: reward-model (preference pairs, TRL's conventions)."""

    task: Literal["reward-model"] = Field(
        "reward-model", exclude=True, description="(internal) the job's task, set from `task`"
    )
    format: Literal["auto", "text", "chat"] = Field(
        "auto",
        description="reward-model data layout. text: prompt, chosen and rejected are strings, each answer scored "
        "as prompt + answer (ending with the EOS token where the tokenizer has one), as TRL's standard format. chat: "
        "message lists rendered with the chat template (answers that start with the prompt's turns need no prompt "
        "column), or strings, which become a user turn and an assistant turn. auto: chat when the chosen column "
        "holds message lists, else text.",
    )
    prompt_column: str = Field("prompt", description="reward-model: the prompt column (string or message list).")
    chosen_column: str = Field("chosen", description="reward-model: the preferred answer (string or message list).")
    rejected_column: str = Field(
        "rejected", description="reward-model: the dispreferred answer (string or message list)."
    )
    margin_column: str | None = Field(
        None,
        description="reward-model: a numeric column, how much better the chosen answer is: the loss is "
        "−log σ(r_chosen − r_rejected − margin) (TRL's margin). Empty cells drop their pair (counted).",
    )
    system_prompt: str | None = Field(
        None, description="reward-model chat format: a system message put first in every prompt that has none."
    )
    chat_template: str | None = Field(
        None,
        description="reward-model chat format: a Jinja chat template used instead of the tokenizer's (saved with the "
        "exported tokenizer). Absent: the tokenizer's, else kubetune's fallback template.",
    )
    max_length: int = Field(
        512,
        ge=8,
        le=32768,
        description="Token limit of prompt + answer: pairs with a longer sequence are dropped (counted), as TRL's "
        "RewardTrainer filters them.",
    )


class RewardSpec(Section):
    """The reward model's loss (the names of TRL's RewardConfig)."""

    center_rewards_coefficient: float | None = Field(
        default=None,
        ge=0,
        description="Adds this × (r_chosen + r_rejected)² to each pair's loss, keeping the rewards centred on 0 "
        "(TRL's center_rewards_coefficient; 0.01 is the value its paper uses). Absent: no centring.",
    )


def _checks(data: RewardData, section: RewardSpec | None) -> list[str]:
    columns = [data.prompt_column, data.chosen_column, data.rejected_column]
    if data.margin_column is not None and data.margin_column in columns:
        return [f"data.margin_column {data.margin_column!r} is also a text column — name the numeric margin column"]
    return []


ENTRY = TaskEntry(
    data=RewardData,
    summary="a reward model: a score per answer learned from chosen/rejected pairs (Bradley-Terry, TRL's "
    "RewardTrainer)",
    runtime="kubetune.tasks.reward_model.task:TASK",
    starter="kubetune.tasks.reward_model:starter.yaml",
    section=RewardSpec,
    checks=_checks,
    order=4,
    peft_task_type="SEQ_CLS",
)
