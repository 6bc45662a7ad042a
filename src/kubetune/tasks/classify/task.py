"""Sequence classification: the task's pieces for the shared trainer (``training/trainer.py``).

Data: labeled text rows → token ids; model: a pretrained encoder with a fresh classification
head (LoRA optional); loss: cross-entropy per example; eval: loss, accuracy, macro-F1 and the
confusion matrix; export: the (merged) model, plus the adapter for LoRA, and a TF-IDF baseline.
"""

from __future__ import annotations

import functools
import html
import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from kubetune.artifacts.presentation import Presentation
from kubetune.artifacts.report import fmt
from kubetune.config import JobSpec
from kubetune.data import Batch
from kubetune.data.tokenize import tokenizer_fingerprint
from kubetune.distributed import DistEnv
from kubetune.inference import kinds
from kubetune.tasks.base import LossOutput, Prepared, Task
from kubetune.tasks.classify.baseline import tfidf_baseline
from kubetune.tasks.classify.data import collate, encode, load_frames
from kubetune.tasks.common import export_merged, load_on_node, prepared, sequence_classifier, tokenize_split

log = logging.getLogger(__name__)


# The tokenization's name in the cache key (data/rows.py).
MODE = "classify"


def prepare(spec: JobSpec, env: DistEnv, model_dir, tokenizer) -> Prepared:
    """The shared skeleton (``tasks.common``) around the task's own parts: the classes, read from the
    data, are the label ids and part of the tokens' cache key."""
    frames = load_on_node(load_frames, spec, env)
    label2id = {name: i for i, name in enumerate(frames.labels)}
    enc = functools.partial(encode, tokenizer=tokenizer, max_length=spec.data.max_length, label2id=label2id)
    fingerprint = f"{MODE}:{spec.data.max_length}:{json.dumps(frames.labels)}:{tokenizer_fingerprint(tokenizer)}"
    tokens = tokenize_split(frames, env, fingerprint, enc)
    if env.is_local_main:
        log.info(
            "data: %d train / %d eval rows, %d classes %s; tokenization cache %s",
            len(tokens.train),
            len(tokens.eval),
            len(frames.labels),
            frames.labels,
            tokens.cache,
        )
    return prepared(
        tokens,
        collate=functools.partial(collate, tokens.train, tokenizer=tokenizer),
        collate_eval=functools.partial(collate, tokens.eval, tokenizer=tokenizer),
        labels=frames.labels,
        dropped=frames.dropped,
        info={"labels": frames.labels},
        raw=(frames, tokenizer),
    )


def loss(model, batch: Batch, autocast) -> LossOutput:
    """Summed cross-entropy over the micro-batch's examples, and their count."""
    with autocast:
        logits = model(**batch.inputs).logits
    labels = batch.labels
    return LossOutput(
        F.cross_entropy(logits.float(), labels, reduction="sum"), torch.tensor(float(len(labels)), device=labels.device)
    )


def export(spec: JobSpec, model, tokenizer, data: Prepared, out, metrics: dict) -> None:
    frames = data.raw[0]
    _export_model(spec, model, tokenizer, out)
    if spec.output.report_baseline and len(frames.train_ids) > BASELINE_MAX_ROWS:
        log.warning(
            "no TF-IDF baseline: %d training rows, over the %d it fits in memory",
            len(frames.train_ids),
            BASELINE_MAX_ROWS,
        )
    elif spec.output.report_baseline:
        baseline = tfidf_baseline(frames)  # None where it cannot fit in memory (it logs why)
        if baseline is not None:
            metrics["baseline"] = baseline
            log.info(
                "baseline (TF-IDF + logistic regression, same split): accuracy %.4f f1_macro %.4f",
                baseline["accuracy"],
                baseline["f1_macro"],
            )


# The baseline holds its training texts and their TF-IDF matrix in memory; past this many rows it is
# skipped (the model's training itself reads its rows from disk, in flat memory).
BASELINE_MAX_ROWS = 500_000


def _export_model(spec: JobSpec, model, tokenizer, out: Path) -> None:
    """Save ``model/`` (merged for LoRA; loadable by transformers.pipeline) and ``adapter/`` for LoRA."""
    export_merged(spec, model, tokenizer, out)
    log.info("exported the model%s", " and the adapter" if spec.lora is not None else "")


def build_model(spec: JobSpec, model_dir, data: Prepared, device: torch.device, dtype: torch.dtype, where=None):
    """The pretrained encoder with a fresh classification head, wrapped with LoRA when asked; on
    ``where`` (default: the training device; meta: the modules without weights)."""
    return sequence_classifier(
        spec,
        model_dir,
        device,
        dtype,
        where,
        num_labels=len(data.labels),
        id2label=dict(enumerate(data.labels)),
        label2id={name: i for i, name in enumerate(data.labels)},
    )


# A confusion matrix is returned (metrics.json, the report) only up to this many classes: it grows with
# the classes squared, and a bigger one is unreadable.
MAX_CONFUSION_CLASSES = 100


def eval_step(model, batch: Batch, autocast) -> dict:
    with autocast:
        logits = model(**batch.inputs).logits
    loss_sum = F.cross_entropy(logits.float(), batch.labels, reduction="sum").double()
    return {"loss": loss_sum, "true": batch.labels, "pred": logits.argmax(-1)}


def eval_totals(stats: list[dict], data: Prepared, device) -> dict[str, torch.Tensor]:
    """The loss sum and, per class, the true positives, the true and the predicted counts (all the
    metrics need); the confusion matrix too for at most ``MAX_CONFUSION_CLASSES`` classes."""
    num_labels = len(data.labels)
    loss_sum = torch.zeros((), device=device, dtype=torch.float64)
    for st in stats:
        loss_sum += st["loss"]
    empty = torch.zeros(0, dtype=torch.long, device=device)
    y = torch.cat([empty, *(st["true"] for st in stats)])
    p = torch.cat([empty, *(st["pred"] for st in stats)])
    totals = {
        "loss": loss_sum,
        "tp": torch.bincount(y[y == p], minlength=num_labels).double(),
        "true": torch.bincount(y, minlength=num_labels).double(),
        "pred": torch.bincount(p, minlength=num_labels).double(),
    }
    if num_labels <= MAX_CONFUSION_CLASSES:  # the same on every rank: the same totals
        totals["confusion"] = torch.bincount(y * num_labels + p, minlength=num_labels**2).double()
    return totals


def eval_metrics(totals: dict[str, np.ndarray], data: Prepared) -> dict:
    """Loss, accuracy and macro-F1 (scikit-learn's definition) over the whole eval set, and the
    confusion matrix (``eval_confusion``, rows true, columns predicted) when it was counted."""
    num_labels = len(data.labels)
    tp, true, pred = totals["tp"], totals["true"], totals["pred"]
    n = true.sum()
    precision = np.divide(tp, pred, out=np.zeros_like(tp), where=pred > 0)
    recall = np.divide(tp, true, out=np.zeros_like(tp), where=true > 0)
    f1 = np.divide(2 * precision * recall, precision + recall, out=np.zeros_like(tp), where=(precision + recall) > 0)
    present = (pred + true) > 0  # sklearn's macro average: classes that are true or predicted
    metrics: dict[str, Any] = {
        "eval_loss": float(totals["loss"] / max(n, 1)),
        "eval_accuracy": float(tp.sum() / max(n, 1)),
        "eval_f1_macro": float(f1[present].mean()) if present.any() else 0.0,
        "eval_samples": int(n),
    }
    if "confusion" in totals:
        metrics["eval_confusion"] = totals["confusion"].reshape(num_labels, num_labels).astype(int).tolist()
    return metrics


def _report_rows(m: dict) -> list[tuple[str, object]]:
    return [("eval accuracy", m.get("eval_accuracy")), ("eval macro-F1", m.get("eval_f1_macro"))]


def _summary(m: dict) -> str:
    return (
        f"eval accuracy {m['eval_accuracy']:.4f}, macro-F1 {m['eval_f1_macro']:.4f} on {m['eval_rows']} held-out rows"
    )


def _reference_line(m: dict) -> tuple[float, str] | None:
    base = m.get("baseline")
    return (base["accuracy"], "baseline accuracy (TF-IDF + LR)") if base else None


def _reference_html(m: dict, model: str) -> str:
    base = m.get("baseline")
    if not base:
        return ""
    verdict = "beats" if m["eval_accuracy"] > base["accuracy"] else "does NOT beat"
    return (
        "<h2>Against a baseline on the same split</h2><table><tr><th></th><th>accuracy</th><th>macro-F1</th></tr>"
        f"<tr><th>fine-tuned {html.escape(model)}</th>"
        f"<td>{fmt(m['eval_accuracy'])}</td><td>{fmt(m['eval_f1_macro'])}</td></tr>"
        f"<tr><th>{html.escape(base['method'])}</th><td>{fmt(base['accuracy'])}</td><td>{fmt(base['f1_macro'])}</td>"
        "</tr></table>"
        f"<p>The fine-tuned model {verdict} the baseline by "
        f"{100 * (m['eval_accuracy'] - base['accuracy']):+.1f} accuracy points.</p>"
    )


def _reference_summary(m: dict) -> list[str]:
    base = m.get("baseline")
    if not base:
        return []
    return [
        f"baseline {base['method']}: accuracy {base['accuracy']:.4f}, macro-F1 {base['f1_macro']:.4f} "
        f"-> fine-tuned model {'beats' if m['eval_accuracy'] > base['accuracy'] else 'does NOT beat'} it by "
        f"{100 * (m['eval_accuracy'] - base['accuracy']):+.1f} points"
    ]


def _reference_card(m: dict) -> list[str]:
    base = m.get("baseline")
    return [f"| baseline accuracy ({base['method']}) | {base['accuracy']:.4f} |"] if base else []


TASK = Task(
    load_frames=load_frames,
    prepare=prepare,
    build_model=build_model,
    loss=loss,
    eval_step=eval_step,
    eval_totals=eval_totals,
    eval_metrics=eval_metrics,
    export=export,
    headline=("eval_accuracy", "eval_f1_macro"),
    inference=kinds.TEXT_CLASSIFIER,
    present=Presentation(
        pipeline_tag="text-classification",
        report_rows=_report_rows,
        eval_curves=("eval_accuracy", "eval_f1_macro"),
        eval_log_scale=False,
        card_usage=lambda repo: [f'clf = pipeline("text-classification", model="{repo}")'],
        card_about=lambda m: [f"Labels: {', '.join(map(str, m.get('labels') or []))}."],
        headline=lambda m: f"eval accuracy {m.get('eval_accuracy', float('nan')):.4f}",
        summary=_summary,
        card_metrics=("eval_accuracy", "eval_f1_macro", "eval_loss", "train_loss"),
        reference_line=_reference_line,
        reference_html=_reference_html,
        reference_summary=_reference_summary,
        reference_card=_reference_card,
    ),
)
