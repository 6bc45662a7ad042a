"""Reward modelling: a sequence classifier with one output learns a score per (prompt, answer) from preference
pairs, with TRL's RewardTrainer loss (Bradley-Terry), for the shared trainer (``training/trainer.py``).

Data: pairs in DPO's shapes (``tasks.pairs``; text or chat, an optional margin column), each answer tokenized as
TRL does: prompt + answer as one text (ending with EOS where the tokenizer has one), or the whole conversation
rendered by the chat template; pairs with a sequence over ``data.max_length`` dropped (counted), as TRL filters
them. A micro-batch is its pairs' chosen sequences, then their rejected ones, right-padded. Model: the base
model's ``AutoModelForSequenceClassification`` with one output (an encoder's pooled first token, a decoder's last
real token), full fine-tune or LoRA (the head trained whole). Loss: −log σ(r_chosen − r_rejected − margin), plus
``center_rewards_coefficient`` × (r_chosen + r_rejected)² when set, averaged over the global step's pairs; the
pairwise accuracy, the margin and the mean reward are logged in training and evaluation under TRL's names.
Export: the scorer (merged for LoRA, with ``adapter/``), which ``predict`` and ``serve`` answer with the raw
score of each text, never a softmaxed label.
"""

from __future__ import annotations

import functools
import json
import logging
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F

from kubetune.artifacts.presentation import Presentation
from kubetune.config import JobSpec
from kubetune.data import Batch
from kubetune.data.rows import column
from kubetune.data.tokenize import tokenizer_fingerprint
from kubetune.distributed import DistEnv
from kubetune.errors import KubetuneError
from kubetune.inference.seam import KSERVE, Inference
from kubetune.providers import S3Settings
from kubetune.tasks.base import Prepared, Task
from kubetune.tasks.common import (
    data_card_line,
    data_rows,
    export_merged,
    load_on_node,
    pair_steps,
    prepare_tokenizer,
    prepared,
    right_pad,
    sequence_classifier,
    tokenize_split,
    without_dropout,
)
from kubetune.tasks.pairs import load_pair_frames
from kubetune.tasks.reward_model import RewardData, RewardSpec
from kubetune.tasks.reward_models import INPUT, LABEL, Scorer, answer_ids, is_reward_model

log = logging.getLogger(__name__)

# What the log lines and history.jsonl report beside the loss (means over the pairs since the last line); the
# evaluation reports the same with the eval_ prefix. TRL's RewardTrainer names: accuracy (the pairwise accuracy),
# margin (r_chosen − r_rejected), mean_reward (over both answers).
METRICS = ("accuracy", "margin", "mean_reward")


def load_frames(data: RewardData, seed: int, s3: S3Settings = S3Settings()):
    """The pairs (``tasks.pairs``), each with its margin when data.margin_column is set."""
    return load_pair_frames(data, seed, s3, numbers={"margin": "margin_column"})


def encode(frame, tokenizer) -> dict[str, list]:
    """Token ids of each pair's two sequences (``answer_ids``). Columns chosen_ids, rejected_ids, margin, length
    (the longer sequence)."""
    cols: dict[str, list] = {"chosen_ids": [], "rejected_ids": [], "margin": [], "length": []}
    for rec in frame["record"]:
        r = json.loads(rec)
        ids = [answer_ids(tokenizer, r["prompt"], r[k]) for k in ("chosen", "rejected")]
        cols["chosen_ids"].append(ids[0])
        cols["rejected_ids"].append(ids[1])
        cols["margin"].append(float(r.get("margin", 0.0)))
        cols["length"].append(max(len(ids[0]), len(ids[1])))
    return cols


@dataclass
class RewardBatch(Batch):
    """A micro-batch of pairs: rows 0..n-1 the chosen sequences, rows n..2n-1 the rejected ones; ``labels`` the
    pairs' margins (0 without a margin column)."""

    center: float | None = None  # center_rewards_coefficient (the trainer passes no spec to the loss)


class Collate:
    """Dataset row ids -> a ``RewardBatch`` (TRL's DataCollatorForPreference: right padding)."""

    def __init__(self, ds, pad_id: int, center: float | None):
        self.ds, self.pad_id, self.center = ds, pad_id, center

    def __call__(self, indices: np.ndarray) -> RewardBatch:
        weight = 1.0
        if len(indices) == 0:  # a rank's empty share of the last step: computed, weighs nothing
            indices, weight = np.zeros(1, dtype=np.int64), 0.0
        rows = self.ds[[int(i) for i in indices]]
        ids, mask = right_pad(list(rows["chosen_ids"]) + list(rows["rejected_ids"]), self.pad_id)
        margins = torch.as_tensor(rows["margin"], dtype=torch.float32)
        index = torch.as_tensor(indices, dtype=torch.long)
        return RewardBatch({"input_ids": ids, "attention_mask": mask}, margins, weight, index, self.center)


def prepare(spec: JobSpec, env: DistEnv, model_dir, tokenizer) -> Prepared:
    """The shared skeleton (``tasks.common``) around the task's own parts: pairs over data.max_length dropped."""
    data = spec.data_as(RewardData)
    frames = load_on_node(load_frames, spec, env)
    template = prepare_tokenizer(tokenizer, frames.format == "chat", data.chat_template)
    max_length = data.max_length
    fingerprint = f"reward-model:{tokenizer_fingerprint(tokenizer)}"
    tokens = tokenize_split(frames, env, fingerprint, functools.partial(encode, tokenizer=tokenizer))
    dropped = dict(frames.dropped)
    tokens.train = _within(tokens.train, dropped, "train_too_long", max_length)
    tokens.eval = _within(tokens.eval, dropped, "eval_too_long", max_length)
    own = _own(spec)
    info = {
        "data_format": frames.format,
        "chat_template": template,
        "center_rewards_coefficient": own.center_rewards_coefficient,
        "margin_column": data.margin_column,
    }
    if env.is_local_main:
        lengths = column(tokens.train, "length")
        log.info(
            "data: %d train / %d eval pairs (%s format%s%s); longest sequence %d tokens, mean %.0f; tokenization "
            "cache %s",
            len(tokens.train),
            len(tokens.eval),
            frames.format,
            f", {template} chat template" if template else "",
            f", margins from {data.margin_column!r}" if data.margin_column else "",
            lengths.max(),
            lengths.mean(),
            tokens.cache,
        )
    pad_id, center = tokenizer.pad_token_id, own.center_rewards_coefficient
    return prepared(
        tokens,
        collate=Collate(tokens.train, pad_id, center),
        collate_eval=Collate(tokens.eval, pad_id, center),
        dropped=dropped,
        info=info,
        raw=tokenizer,
    )


def _own(spec: JobSpec) -> RewardSpec:
    return spec.section(RewardSpec) or RewardSpec()


def _within(ds, dropped: dict, key: str, max_length: int):
    """The pairs whose both sequences fit ``max_length`` (TRL's filter), the others counted in ``dropped``."""
    keep = np.flatnonzero(column(ds, "length") <= max_length)  # encode's length: the longer of the two
    if len(keep) == len(ds):
        return ds
    dropped[key] = len(ds) - len(keep)
    split = key.split("_")[0]
    log.warning(
        "%d %s pairs have a sequence over data.max_length %d tokens; they are skipped", dropped[key], split, max_length
    )
    if len(keep) == 0:
        raise KubetuneError(
            f"every one of the {len(ds)} {split} pairs has a sequence over data.max_length {max_length} tokens",
            field="data.max_length",
            fix="raise data.max_length, or shorten the prompts and answers",
        )
    return ds.select(keep)


def build_model(spec: JobSpec, model_dir, data: Prepared, device: torch.device, dtype: torch.dtype, where=None):
    """The base model with a one-output sequence-classification head (a fresh head), wrapped with LoRA when asked
    (the head trained whole); the tokenizer's pad token on its config, which a decoder needs to find each row's
    last real token. Every dropout off, as TRL's RewardTrainer has it by default (``disable_dropout``): the chosen
    and the rejected answer are scored by the same network (and a step is about 10% cheaper)."""
    model = sequence_classifier(
        spec,
        model_dir,
        device,
        dtype,
        where,
        num_labels=1,
        id2label={0: LABEL},
        label2id={LABEL: 0},
        problem_type="regression",  # a score, not a label: the label classifiers' inference does not claim it
        pad_token_id=data.raw.pad_token_id,
    )
    return without_dropout(model)


# ---------------------------------------------------------------- the loss


def pair_losses(
    chosen: torch.Tensor, rejected: torch.Tensor, margin: torch.Tensor, center: float | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair loss and the statistics of ``METRICS`` (one row per pair) from the two rewards (fp32): TRL's
    −log σ(r_c − r_r − margin) + center × (r_c + r_r)²."""
    losses = -F.logsigmoid(chosen - rejected - margin)
    if center is not None:
        losses = losses + center * (chosen + rejected) ** 2
    c, r = chosen.detach(), rejected.detach()
    stats = torch.stack([(c > r).float(), c - r, (c + r) / 2], dim=1)
    return losses, stats


def _pairs(model, batch: RewardBatch, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    with autocast:
        logits = model(**batch.inputs).logits
    chosen, rejected = logits.float().squeeze(-1).chunk(2)
    losses, stats = pair_losses(chosen, rejected, batch.labels, batch.center)
    return losses.sum(), stats


loss, eval_step, eval_totals, eval_metrics = pair_steps(METRICS, _pairs)


# ---------------------------------------------------------------- export and inference


def export(spec: JobSpec, model, tokenizer, data: Prepared, out, metrics: dict) -> None:
    """``model/``: the scorer (merged for LoRA) and its tokenizer, its config naming how its training tokenized a
    sequence (``INPUT``: chat or text), which ``Scorer`` repeats; ``adapter/`` for LoRA."""
    setattr(getattr(model, "config", None) or model.get_base_model().config, INPUT, data.info["data_format"])
    export_merged(spec, model, tokenizer, out)


def predict(path: str, texts: list[str], options: dict, warn) -> list[dict]:
    return [{"text": t, **r} for t, r in zip(texts, Scorer(path).run(texts))]


INFERENCE = Inference(
    noun="reward model",
    claims=is_reward_model,
    predict=predict,
    show=lambda r: f"{r['score']:.4f}\t{r['text']}",
    serve=lambda path, adapter: Scorer(path),
    routes=KSERVE,
)


# ---------------------------------------------------------------- how the results read


def _report_rows(m: dict) -> list[tuple[str, object]]:
    return [
        ("eval pairwise accuracy (chosen scored above rejected)", m.get("eval_accuracy")),
        ("eval reward margin (mean r_chosen − r_rejected)", m.get("eval_margin")),
        ("eval mean reward", m.get("eval_mean_reward")),
        ("eval pairs", m.get("eval_pairs")),
        ("center_rewards_coefficient", m.get("center_rewards_coefficient")),
        ("margin column", m.get("margin_column") or "none"),
        *data_rows(m, "none (text pairs)"),
    ]


def _card_about(m: dict) -> list[str]:
    return [
        f"A reward model (one score per text) trained on preference pairs with the Bradley-Terry loss. On "
        f"{m.get('eval_pairs')} held-out pairs it scores the chosen answer above the rejected one "
        f"{m.get('eval_accuracy', float('nan')):.2%} of the time, by {m.get('eval_margin', float('nan')):.4f} on "
        "average.",
        data_card_line(m),
    ]


def _summary(m: dict) -> str:
    return (
        f"pairwise accuracy {m['eval_accuracy']:.4f}, margin {m['eval_margin']:.4f}, eval loss {m['eval_loss']:.4f} "
        f"on {m['eval_pairs']} held-out pairs"
    )


TASK = Task(
    load_frames=load_frames,
    prepare=prepare,
    build_model=build_model,
    loss=loss,
    eval_step=eval_step,
    eval_totals=eval_totals,
    eval_metrics=eval_metrics,
    export=export,
    headline=("eval_accuracy", "eval_margin"),
    inference=INFERENCE,
    present=Presentation(
        pipeline_tag="text-classification",
        report_rows=_report_rows,
        eval_curves=(),  # the step plots show the evaluations beside the training values
        eval_log_scale=False,
        card_usage=lambda repo: [
            f'scorer = pipeline("text-classification", model="{repo}", function_to_apply="none")',
            'scorer("Question: ...\\nAnswer: ...")[0]["score"]  # the raw reward',
        ],
        card_about=_card_about,
        headline=lambda m: f"pairwise accuracy {m.get('eval_accuracy', float('nan')):.4f}",
        summary=_summary,
        step_plots=(
            ("Pairwise accuracy", ("accuracy", "eval_accuracy")),
            ("Reward margin", ("margin", "eval_margin")),
        ),
        loss_label="Bradley-Terry loss",
        card_metrics=("eval_accuracy", "eval_margin", "train_loss"),
    ),
    train_metrics=METRICS,
)
