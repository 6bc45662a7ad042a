"""Direct Preference Optimization (preference tuning of a causal LM on chosen/rejected answer
pairs): the task's spec half, its data section, its own ``dpo:`` section and registry entry. The
training half is ``task.py`` (``TASK``); reading and tokenizing pairs is ``data.py``; ``starter.yaml``
is the starter spec `kubetune init dpo` writes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kubetune.config.base import Section, StreamingData, streaming_problems
from kubetune.config.tasks import KServeRuntime, TaskEntry


class PreferenceData(StreamingData):
    """``data`` for task: dpo (preference pairs, TRL's conventions)."""

    task: Literal["dpo"] = Field("dpo", exclude=True, description="(internal) the job's task, set from `task`")
    format: Literal["auto", "text", "chat"] = Field(
        "auto",
        description="dpo data layout. text: prompt, chosen and rejected are strings, joined as they are (the "
        "chosen and rejected answers end with the EOS token), as TRL's standard format. chat: rendered with the chat "
        "template; the columns hold {role, content} message lists (TRL's conversational format: answers that start "
        "with the prompt's turns need no prompt column, the prompt is the turns they share), or strings, which "
        "become a user turn and an "
        "assistant turn. auto: chat when the chosen column holds message lists, else text.",
    )
    prompt_column: str = Field("prompt", description="dpo: the prompt column (string or message list).")
    chosen_column: str = Field("chosen", description="dpo: the preferred answer (string or message list).")
    rejected_column: str = Field("rejected", description="dpo: the dispreferred answer (string or message list).")
    system_prompt: str | None = Field(
        None, description="dpo chat format: a system message put first in every prompt that has none."
    )
    chat_template: str | None = Field(
        None,
        description="dpo chat format: a Jinja chat template used instead of the tokenizer's (saved with the exported "
        "tokenizer). Absent: the tokenizer's, else kubetune's fallback template (as for causal-lm).",
    )
    max_length: int = Field(
        512,
        ge=8,
        le=32768,
        description="Token limit of prompt + answer; longer sequences lose their end (TRL's keep_start), and pairs "
        "whose prompt alone fills it are dropped (counted).",
    )


class DPOSpec(Section):
    """The preference loss of task: dpo (the names of TRL's DPOConfig)."""

    beta: float = Field(
        default=0.1,
        gt=0,
        description="How far the policy may move from the reference model: the reward of an answer is beta × (its "
        "log-probability under the policy − under the reference). Lower: further.",
    )
    loss_type: Literal["sigmoid", "ipo"] = Field(
        default="sigmoid",
        description="sigmoid: the DPO loss −log σ(beta × (chosen reward margin)); ipo: the IPO squared loss on "
        "per-token log-ratios, (margin − 1/(2·beta))².",
    )
    label_smoothing: float = Field(
        default=0.0,
        ge=0,
        lt=0.5,
        description="sigmoid only: the assumed fraction of pairs whose preference is flipped (conservative DPO): "
        "−(1−ε) log σ(βΔ) − ε log σ(−βΔ).",
    )


def _checks(data: PreferenceData, section: DPOSpec | None) -> list[str]:
    out = streaming_problems(data)
    if section is not None and section.label_smoothing and section.loss_type != "sigmoid":
        out.append(f"dpo.label_smoothing applies to dpo.loss_type sigmoid, not {section.loss_type} — remove it")
    return out


ENTRY = TaskEntry(
    data=PreferenceData,
    summary="preference tuning of a causal LM on chosen/rejected answer pairs, Direct Preference Optimization",
    runtime="kubetune.tasks.dpo.task:TASK",
    starter="kubetune.tasks.dpo:starter.yaml",
    section=DPOSpec,
    checks=_checks,
    order=2,
    streaming_needs_lora=True,  # the full fine-tune's reference log-probabilities: the whole training set
    kserve=KServeRuntime("text_generation", adapters=True),
    language_model=True,
)
