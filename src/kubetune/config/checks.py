"""The problems between sections of a job spec, each valid on its own.

One line each: run by the spec's own validation (``schema.JobSpec``), and by ``load.parse_spec`` on the sections
that are valid when others are not, so that every problem of a spec is reported at once."""

from __future__ import annotations

from collections.abc import Mapping

from kubetune.config.base import DataCommon
from kubetune.config.cluster import KubernetesSpec
from kubetune.config.sections import DistributedSpec, EvaluationSpec, LoraSpec, OutputSpec, TrackingSpec, TrainSpec
from kubetune.config.tasks import registered

CROSS_SEPARATOR = "\n"


# A task's own section that is present but does not validate (``cross_problems``' ``own``): its task's checks
# are skipped rather than told the section is missing.
INVALID = object()


def cross_problems(
    data: DataCommon | None,
    distributed: DistributedSpec | None,
    kubernetes: KubernetesSpec | None,
    output: OutputSpec | None = None,
    tracking: TrackingSpec | None = None,
    own: Mapping[str, object] | None = None,
    training: TrainSpec | None = None,
    lora: LoraSpec | None = None,
    evaluation: EvaluationSpec | None = None,
) -> list[str]:
    """The problems between fields of different sections (each section valid on its own); ``None``
    for a section that is not valid (its checks are skipped); ``own``: the tasks' own sections by
    task name (None: absent; ``INVALID``: present but not valid, its own errors already reported). Also
    run by ``load.parse_spec`` when other fields fail, so that every problem of a spec is reported at once."""
    out: list[str] = []
    own = own or {}
    tasks = registered()
    if data is not None:
        if own.get(data.task) is not INVALID:  # an invalid section's own errors say it all (not "needs a section")
            out += tasks[data.task].checks(data, own.get(data.task))
        out += [
            f"{name}: applies to task {name}, and this job's task is {data.task} — remove the {name} section, "
            f"or set task: {name}"
            for name, section in own.items()
            if section is not None and section is not INVALID and name != data.task
        ]
    if data is not None and getattr(data, "streaming", False) and training is not None and not training.max_steps:
        out.append(
            "data.streaming needs training.max_steps: the stream's length is not known before it is read — set "
            "training.max_steps (training.epochs then bounds how often the stream is read)"
        )
    if training is not None and training.lr_scheduler == "wsd" and training.warmup_ratio + training.decay_ratio > 1:
        out.append(
            f"training.decay_ratio {training.decay_ratio} and training.warmup_ratio {training.warmup_ratio} add up to "
            "more than the whole run: lr_scheduler wsd warms up, holds, then decays — lower one of them so that they "
            "add up to at most 1"
        )
    if data is not None and getattr(data, "streaming", False) and tasks[data.task].streaming_needs_lora and not lora:
        out.append(
            f"data.streaming with task {data.task} needs lora: its full fine-tune computes a reference over the "
            "whole training set before the first step, which a stream does not have — add a lora section, or set "
            "data.streaming: false"
        )
    mlflow = tracking.mlflow if tracking is not None else None
    if mlflow and mlflow.register_model and output is not None and not output.uri.startswith("s3://"):
        out.append(
            f"tracking.mlflow.register_model needs output.uri on s3:// (the registry references the model where it "
            f"is, and refuses a local path such as {output.uri!r}) — write the output to s3://, or drop register_model"
        )
    if distributed is not None and distributed.strategy == "fsdp":
        # refused here rather than by every worker after start-up (strategy.for_job says the same)
        if lora is not None and lora.quantization:
            out.append(
                "lora.quantization (QLoRA) under distributed.strategy fsdp is not supported yet — use "
                "distributed.strategy: ddp (every GPU holds the quantized base, which is what QLoRA saves)"
            )
        if data is not None and tasks[data.task].fsdp_needs_lora and lora is None:
            out.append(
                f"task {data.task} under distributed.strategy fsdp needs lora: its full fine-tune keeps a frozen copy "
                "of the base model as the reference, which a sharded model cannot be copied into — add a lora section "
                "(the reference is then the base with the adapter off), or use distributed.strategy: ddp"
            )
    if evaluation is not None and data is not None and not tasks[data.task].language_model:
        language = [name for name, entry in tasks.items() if entry.language_model]
        out.append(
            f"evaluation: lm-evaluation-harness scores causal language models, and task {data.task} trains "
            f"something else — remove the evaluation section, or use one of the tasks {', '.join(language)}"
        )
    if evaluation is not None and evaluation.every and distributed is not None and distributed.strategy == "fsdp":
        out.append(
            "evaluation.every under distributed.strategy fsdp is not supported yet (each rank holds a shard of the "
            "model) — drop evaluation.every (the evaluation after training still runs), or use "
            "distributed.strategy: ddp"
        )
    elastic = kubernetes.elastic if kubernetes is not None else None
    if elastic and distributed is not None and not elastic.min_nodes <= distributed.nodes <= elastic.max_nodes:
        out.append("distributed.nodes must lie between kubernetes.elastic.min_nodes and max_nodes")
    return out
