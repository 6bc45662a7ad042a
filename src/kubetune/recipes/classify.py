"""Sequence classification: the task's pieces for the shared loop (``recipes/loop.py``).

Data: labeled text rows → token ids; model: a pretrained encoder with a fresh classification
head (LoRA optional); loss: cross-entropy per example; eval: loss, accuracy, macro-F1 and the
confusion matrix; export: the (merged) model, plus the adapter for LoRA, and a TF-IDF baseline.
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import torch
import torch.nn.functional as F

from kubetune import artifacts, distributed
from kubetune.config import JobSpec
from kubetune.data import collate, load_frames, tokenized
from kubetune.distributed import DistEnv
from kubetune.recipes import loop
from kubetune.recipes.common import to_device

log = logging.getLogger(__name__)


def train(spec: JobSpec, env: DistEnv) -> dict:
    """Fine-tune a sequence classifier as described by ``spec``; rank 0 exports the artifacts.

    Returns:
        The final metrics (identical on every rank).
    """
    return loop.train(spec, env, TASK)


def prepare(spec: JobSpec, env: DistEnv, model_dir, tokenizer) -> loop.Prepared:
    frames = load_frames(spec.data, spec.training.seed)

    def build(create: bool):
        train_ds, hit = tokenized(frames.train, tokenizer, spec.data.max_length, build=create)
        eval_ds, _ = tokenized(frames.eval, tokenizer, spec.data.max_length, build=create)
        return train_ds, eval_ds, hit

    train_ds, eval_ds, hit = loop.tokenize_on_node(env, build)
    if env.is_local_main:
        log.info("data: %d train / %d eval rows, %d classes %s; tokenization cache %s", len(frames.train), len(frames.eval), len(frames.labels), frames.labels, "hit" if hit else "miss (tokenized and cached)")
    return loop.Prepared(
        train_ds=train_ds, eval_ds=eval_ds, collate=functools.partial(collate, train_ds, tokenizer=tokenizer),
        train_rows=len(frames.train), eval_rows=len(frames.eval), labels=frames.labels, dropped=frames.dropped,
        info={"labels": frames.labels}, raw=(frames, tokenizer),
    )


def loss(model, micro: dict, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    labels = micro.pop("labels")
    with autocast:
        logits = model(**micro).logits
    return F.cross_entropy(logits.float(), labels, reduction="sum"), torch.tensor(float(len(labels)), device=labels.device)


def export(spec: JobSpec, model, tokenizer, data: loop.Prepared, out, metrics: dict) -> None:
    frames = data.raw[0]
    artifacts.export_classifier(spec, model, tokenizer, frames, out)
    if spec.output.report_baseline:
        metrics["baseline"] = artifacts.tfidf_baseline(frames)
        log.info("baseline (TF-IDF + logistic regression, same split): accuracy %.4f f1_macro %.4f", metrics["baseline"]["accuracy"], metrics["baseline"]["f1_macro"])


def build_model(spec: JobSpec, model_dir, data: loop.Prepared, device: torch.device, dtype: torch.dtype):
    """The pretrained encoder with a fresh classification head, wrapped with LoRA when asked."""
    from transformers import AutoModelForSequenceClassification

    from kubetune.recipes.common import attention_kwargs, load_pretrained

    model = load_pretrained(
        AutoModelForSequenceClassification,
        model_dir,
        **attention_kwargs(device, dtype),
        num_labels=len(data.labels),
        id2label=dict(enumerate(data.labels)),
        label2id={name: i for i, name in enumerate(data.labels)},
    )
    if spec.lora is None:
        return model.to(device)
    from peft import LoraConfig, TaskType, get_peft_model

    config = LoraConfig(
        task_type=TaskType.SEQ_CLS,  # also makes the classifier head fully trainable (modules_to_save)
        r=spec.lora.r,
        lora_alpha=spec.lora.alpha,
        lora_dropout=spec.lora.dropout,
        target_modules=spec.lora.target_modules,
    )
    return get_peft_model(model, config).to(device)


@torch.no_grad()
def evaluate(model, data: loop.Prepared, env: DistEnv, device, autocast, batch_size: int) -> dict:
    """Loss, accuracy and macro-F1 over the whole eval set, each example counted once across ranks."""
    eval_ds, tokenizer = data.eval_ds, data.raw[1]
    num_labels = len(data.labels)
    model.eval()
    lengths = np.asarray(eval_ds["length"])
    order = np.argsort(lengths, kind="stable")[env.rank :: env.world_size]  # length-sorted: little padding
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    confusion = torch.zeros(num_labels * num_labels, device=device, dtype=torch.float64)
    for start in range(0, len(order), batch_size):
        batch = to_device(collate(eval_ds, order[start : start + batch_size], tokenizer), device)
        batch.pop("weight")
        batch.pop("index")
        labels = batch.pop("labels")
        with autocast:
            logits = model(**batch).logits
        loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum").double()
        confusion += torch.bincount(labels * num_labels + logits.argmax(-1), minlength=num_labels**2).double()
    totals = distributed.all_reduce_sum(torch.cat([loss_sum.view(1), confusion]))
    model.train()
    cm = totals[1:].view(num_labels, num_labels).cpu().numpy()  # rows: true, cols: predicted
    n = cm.sum()
    tp = np.diag(cm)
    precision = np.divide(tp, cm.sum(0), out=np.zeros_like(tp), where=cm.sum(0) > 0)
    recall = np.divide(tp, cm.sum(1), out=np.zeros_like(tp), where=cm.sum(1) > 0)
    f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros_like(tp), where=(precision + recall) > 0)
    present = (cm.sum(0) + cm.sum(1)) > 0  # sklearn's macro average: classes that are true or predicted
    return {
        "eval_loss": float(totals[0].item() / max(n, 1)),
        "eval_accuracy": float(tp.sum() / max(n, 1)),
        "eval_f1_macro": float(f1[present].mean()) if present.any() else 0.0,
        "eval_samples": int(n),
        "eval_confusion": cm.astype(int).tolist(),
    }


TASK = loop.Task(
    name="sequence-classification",
    prepare=prepare,
    build_model=build_model,
    loss=loss,
    evaluate=evaluate,
    export=export,
    headline=("eval_accuracy", "eval_f1_macro"),
)
