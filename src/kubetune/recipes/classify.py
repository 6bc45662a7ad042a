"""Sequence classification: the task's pieces for the shared trainer (``training/trainer.py``).

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
from kubetune.recipes.common import to_device
from kubetune.recipes.task import Prepared, Task, tokenize_on_node

log = logging.getLogger(__name__)


def prepare(spec: JobSpec, env: DistEnv, model_dir, tokenizer) -> Prepared:
    frames = load_frames(spec.data, spec.training.seed)

    def build(create: bool):
        train_ds, hit = tokenized(frames.train, tokenizer, spec.data.max_length, build=create)
        eval_ds, _ = tokenized(frames.eval, tokenizer, spec.data.max_length, build=create)
        return train_ds, eval_ds, hit

    train_ds, eval_ds, hit = tokenize_on_node(env, build)
    if env.is_local_main:
        log.info(
            "data: %d train / %d eval rows, %d classes %s; tokenization cache %s",
            len(frames.train),
            len(frames.eval),
            len(frames.labels),
            frames.labels,
            "hit" if hit else "miss (tokenized and cached)",
        )
    return Prepared(
        train_ds=train_ds,
        eval_ds=eval_ds,
        collate=functools.partial(collate, train_ds, tokenizer=tokenizer),
        train_rows=len(frames.train),
        eval_rows=len(frames.eval),
        labels=frames.labels,
        dropped=frames.dropped,
        info={"labels": frames.labels},
        raw=(frames, tokenizer),
    )


def loss(model, micro: dict, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    labels = micro.pop("labels")
    with autocast:
        logits = model(**micro).logits
    return F.cross_entropy(logits.float(), labels, reduction="sum"), torch.tensor(
        float(len(labels)), device=labels.device
    )


def export(spec: JobSpec, model, tokenizer, data: Prepared, out, metrics: dict) -> None:
    frames = data.raw[0]
    artifacts.export_classifier(spec, model, tokenizer, frames, out)
    if spec.output.report_baseline:
        baseline = artifacts.tfidf_baseline(frames)  # None where it cannot fit in memory (it logs why)
        if baseline is not None:
            metrics["baseline"] = baseline
            log.info(
                "baseline (TF-IDF + logistic regression, same split): accuracy %.4f f1_macro %.4f",
                baseline["accuracy"],
                baseline["f1_macro"],
            )


def build_model(spec: JobSpec, model_dir, data: Prepared, device: torch.device, dtype: torch.dtype):
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


# A confusion matrix is returned (metrics.json, the report) only up to this many classes: it grows with
# the classes squared, and a bigger one is unreadable.
MAX_CONFUSION_CLASSES = 100


@torch.no_grad()
def evaluate(model, data: Prepared, env: DistEnv, device, autocast, batch_size: int) -> dict:
    """Loss, accuracy and macro-F1 over the whole eval set, each example counted once across ranks.

    Labels and predictions are kept per batch and counted once at the end: per class the true
    positives, the true and the predicted counts (all the metrics need), all-reduced across ranks.
    The full confusion matrix (``eval_confusion``, rows true, columns predicted) is built only for
    at most ``MAX_CONFUSION_CLASSES`` classes.
    """
    eval_ds, tokenizer = data.eval_ds, data.raw[1]
    num_labels = len(data.labels)
    model.eval()
    lengths = np.asarray(eval_ds["length"])
    order = np.argsort(lengths, kind="stable")[env.rank :: env.world_size]  # length-sorted: little padding
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    trues, preds = [torch.zeros(0, dtype=torch.long, device=device)], [torch.zeros(0, dtype=torch.long, device=device)]
    for start in range(0, len(order), batch_size):
        batch = to_device(collate(eval_ds, order[start : start + batch_size], tokenizer), device)
        batch.pop("weight")
        batch.pop("index")
        labels = batch.pop("labels")
        with autocast:
            logits = model(**batch).logits
        loss_sum += F.cross_entropy(logits.float(), labels, reduction="sum").double()
        trues.append(labels)
        preds.append(logits.argmax(-1))
    y, p = torch.cat(trues), torch.cat(preds)
    counts = [
        loss_sum.view(1),
        torch.bincount(y[y == p], minlength=num_labels).double(),
        torch.bincount(y, minlength=num_labels).double(),
        torch.bincount(p, minlength=num_labels).double(),
    ]
    with_confusion = num_labels <= MAX_CONFUSION_CLASSES  # the same on every rank: the same tensor size
    if with_confusion:
        counts.append(torch.bincount(y * num_labels + p, minlength=num_labels**2).double())
    totals = distributed.all_reduce_sum(torch.cat(counts)).cpu().numpy()
    model.train()
    tp, true, pred = (totals[1 + k * num_labels : 1 + (k + 1) * num_labels] for k in range(3))
    n = true.sum()
    precision = np.divide(tp, pred, out=np.zeros_like(tp), where=pred > 0)
    recall = np.divide(tp, true, out=np.zeros_like(tp), where=true > 0)
    f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros_like(tp), where=(precision + recall) > 0)
    present = (pred + true) > 0  # sklearn's macro average: classes that are true or predicted
    metrics = {
        "eval_loss": float(totals[0] / max(n, 1)),
        "eval_accuracy": float(tp.sum() / max(n, 1)),
        "eval_f1_macro": float(f1[present].mean()) if present.any() else 0.0,
        "eval_samples": int(n),
    }
    if with_confusion:
        metrics["eval_confusion"] = totals[1 + 3 * num_labels :].reshape(num_labels, num_labels).astype(int).tolist()
    return metrics


TASK = Task(
    prepare=prepare,
    build_model=build_model,
    loss=loss,
    evaluate=evaluate,
    export=export,
    headline=("eval_accuracy", "eval_f1_macro"),
)
