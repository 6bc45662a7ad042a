"""Causal-LM fine-tuning (next-token prediction on text, instruction or chat data; Llama-class
decoders): the task's spec half, its data section and registry entry. The training half is
``task.py`` (``TASK``); reading and tokenizing records is ``data.py``; ``starter.yaml`` is the starter
spec `kubetune init causal-lm` writes."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from kubetune.config.base import StreamingData, streaming_problems
from kubetune.config.tasks import KServeRuntime, TaskEntry


class CausalLMData(StreamingData):
    """``data`` for task: causal-lm."""

    task: Literal["causal-lm"] = Field(
        "causal-lm", exclude=True, description="(internal) the job's task, set from `task`"
    )
    format: Literal["auto", "text", "instruction", "chat"] = Field(
        "auto",
        description="causal-lm data layout: text = one document per row (data.text_column); instruction = alpaca-style "
        "records (data.instruction_column, data.input_column, data.output_column); chat = a list of {role, content} "
        "messages per row (data.messages_column). auto: chat if the messages column exists, else instruction if the "
        "instruction and output columns exist, else text.",
    )
    instruction_column: str = Field("instruction", description="causal-lm instruction format: the instruction column.")
    input_column: str | None = Field(
        "input",
        description="causal-lm instruction format: optional extra input "
        "appended to the instruction (absent or empty = none).",
    )
    output_column: str = Field(
        "output", description="causal-lm instruction format: the response the model learns to produce."
    )
    messages_column: str = Field(
        "messages", description="causal-lm chat format: column holding the list of {role, content} messages."
    )
    system_prompt: str | None = Field(
        None,
        description="causal-lm instruction/chat formats: a system message "
        "put first in every conversation that has none.",
    )
    train_on_prompt: bool = Field(
        False,
        description="causal-lm: also compute the loss on prompt tokens (instruction, user and system turns). Default: "
        "loss on response (assistant) tokens only; text-format rows are all response.",
    )
    packing: bool = Field(
        False,
        description="causal-lm: padding-free packing: each micro-batch is one row of concatenated examples with "
        "per-example position ids, so examples cannot attend to each other and no compute goes to padding.",
    )
    max_tokens_per_batch: int | None = Field(
        None,
        ge=8,
        description="causal-lm with packing: fill each micro-batch with whole examples up to this many tokens "
        "instead of taking training.batch_size examples, so every micro-batch does similar work; a global step is "
        "then world size × training.grad_accum micro-batches. At least data.max_length. Absent: batch_size examples.",
    )


def _checks(data: CausalLMData, section: None) -> list[str]:
    out = streaming_problems(data)
    if data.streaming and data.max_tokens_per_batch is not None:
        out.append(
            "data.max_tokens_per_batch is not supported with data.streaming (its micro-batches are cut from a "
            "whole epoch's lengths) — remove it; data.packing still packs each micro-batch"
        )
    if data.max_tokens_per_batch is not None:
        if not data.packing:
            out.append("data.max_tokens_per_batch needs data.packing: true (micro-batches of packed tokens)")
        if data.max_tokens_per_batch < data.max_length:
            out.append(
                f"data.max_tokens_per_batch {data.max_tokens_per_batch} is below data.max_length "
                f"{data.max_length}: raise it to at least data.max_length, so the longest example fits"
            )
    return out


ENTRY = TaskEntry(
    data=CausalLMData,
    summary="next-token prediction on text, instruction or chat data, for Llama-class decoders",
    runtime="kubetune.tasks.causal_lm.task:TASK",
    starter="kubetune.tasks.causal_lm:starter.yaml",
    checks=_checks,
    order=1,
    auto_model="AutoModelForCausalLM",
    peft_task_type="CAUSAL_LM",
    kserve=KServeRuntime("text_generation", adapters=True),
    language_model=True,
)
