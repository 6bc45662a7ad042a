"""ORPO (Odds Ratio Preference Optimization: a causal LM tuned on chosen/rejected answer pairs in one stage, no
reference model, TRL's ORPOTrainer): the task's spec half, its data section, its own ``orpo:`` section and registry
entry. The training half is ``task.py`` (``TASK``); the pairs are read by ``tasks.pairs`` and tokenized as DPO's
are; ``starter.yaml`` is the starter spec `kubetune init orpo` writes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kubetune.config.base import DataCommon, Section
from kubetune.config.tasks import KServeRuntime, TaskEntry


class ORPOData(DataCommon):
    """``data`` for task: orpo (preference pairs, TRL's conventions)."""

    task: Literal["orpo"] = Field("orpo", exclude=True, description="(internal) the job's task, set from `task`")
    format: Literal["auto", "text", "chat"] = Field(
        "auto",
        description="orpo data layout. text: prompt, chosen and rejected are strings, joined as they are (the answers "
        "end with the EOS token). chat: message lists rendered with the chat template (answers that start with the "
        "prompt's turns need no prompt column), or strings, which become a user turn and an assistant turn. auto: "
        "chat when the chosen column holds message lists, else text.",
    )
    prompt_column: str = Field("prompt", description="orpo: the prompt column (string or message list).")
    chosen_column: str = Field("chosen", description="orpo: the preferred answer (string or message list).")
    rejected_column: str = Field("rejected", description="orpo: the dispreferred answer (string or message list).")
    system_prompt: str | None = Field(
        None, description="orpo chat format: a system message put first in every prompt that has none."
    )
    chat_template: str | None = Field(
        None,
        description="orpo chat format: a Jinja chat template used instead of the tokenizer's (saved with the exported "
        "tokenizer). Absent: the tokenizer's, else kubetune's fallback template.",
    )
    max_length: int = Field(
        512,
        ge=8,
        le=32768,
        description="Token limit of prompt + answer; longer sequences lose their end, and pairs whose prompt alone "
        "fills it are dropped (counted).",
    )


class ORPOSpec(Section):
    """The ORPO loss (the names of TRL's ORPOConfig)."""

    beta: float = Field(
        default=0.1,
        gt=0,
        description="λ, the weight of the odds-ratio term: loss = NLL of the chosen sequence − λ × log σ(log odds "
        "ratio of chosen over rejected), the odds from the answers' mean token log-probabilities.",
    )


ENTRY = TaskEntry(
    data=ORPOData,
    summary="reference-free preference tuning of a causal LM in one stage: the SFT loss on the chosen answer plus "
    "λ × an odds-ratio loss (ORPO, TRL's ORPOTrainer)",
    runtime="kubetune.tasks.orpo.task:TASK",
    starter="kubetune.tasks.orpo:starter.yaml",
    section=ORPOSpec,
    order=5,
    kserve=KServeRuntime("text_generation", adapters=True),
    language_model=True,
)
