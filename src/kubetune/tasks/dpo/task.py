"""Preference tuning with DPO (Direct Preference Optimization) of a causal LM: the task's pieces for
the shared trainer (``training/trainer.py``).

Data: pairs of a prompt and a chosen and a rejected answer, in TRL's conventions: strings joined as
they are (text), or message lists rendered with the chat template (chat; the prompt may be implicit:
the turns chosen and rejected share), tokenized as TRL's DPOTrainer does and cached like the other
tasks' tokens. A micro-batch is its pairs' chosen sequences, then their rejected ones; only answer
tokens carry log-probabilities. Model: the causal LM (``tasks.causal``: full fine-tune, LoRA, QLoRA), with
dropout off (TRL's default, so the policy and the reference see the same network). The reference
model is never a second copy: with LoRA it is the model with its adapter disabled, for a full
fine-tune its log-probabilities are computed once, before training, by the model itself, and cached
on disk keyed by the model, the data, the template and the precision (a resumed run reads them).
Loss: sigmoid (DPO, with conservative label smoothing) or IPO, averaged over the global step's
pairs; the rewards, their margin and the reward accuracy are logged in training and evaluation.
Export, ``predict`` and the Hub push are the causal LM's (``tasks.causal``).
"""

from __future__ import annotations

import functools
import logging

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from kubetune.config import JobSpec
from kubetune.data.feed import Feed
from kubetune.data.rows import column
from kubetune.data.tokenize import tokenizer_fingerprint
from kubetune.distributed import DistEnv
from kubetune.tasks import causal, common
from kubetune.tasks.base import Prepared
from kubetune.tasks.common import IGNORE, load_on_node, pair_steps, prepare_tokenizer, prepared, tokenize_split
from kubetune.tasks.dpo import DPOSpec, PreferenceData
from kubetune.tasks.logprobs import sequence_logps
from kubetune.tasks.pair_batches import PairBatch, PairCollate, encode_pairs
from kubetune.tasks.pairs import load_pair_frames, shard_normalizer, with_answers
from kubetune.tasks.reference import Reference, model_identity, precompute

log = logging.getLogger(__name__)

# What the training log lines and history.jsonl report beside the loss (means over the pairs since the
# last line); evaluation reports the same with the eval_ prefix. TRL's names: rewards/accuracies,
# rewards/chosen, rewards/rejected, rewards/margins, logps/chosen, logps/rejected.
METRICS = ("reward_accuracy", "reward_chosen", "reward_rejected", "reward_margin", "logps_chosen", "logps_rejected")

# ---------------------------------------------------------------- prepare


def prepare(spec: JobSpec, env: DistEnv, model_dir, tokenizer) -> Prepared:
    """The shared skeleton (``tasks.common``) around the task's own parts: pairs dropped whose prompt
    leaves no answer token, and micro-batches of pairs keyed for the reference's cache."""
    data = spec.data_as(PreferenceData)
    frames = load_on_node(load_pair_frames, spec, env)
    template = prepare_tokenizer(tokenizer, frames.format == "chat", data.chat_template)
    max_length = data.max_length

    encode = functools.partial(encode_pairs, tokenizer=tokenizer, max_length=max_length)

    fingerprint = f"dpo:{max_length}:{tokenizer_fingerprint(tokenizer)}"
    if data.streaming:
        return _prepare_stream(spec, env, tokenizer, frames, encode, fingerprint, template)
    tokens = tokenize_split(frames, env, fingerprint, encode)
    dropped = dict(frames.dropped)
    # A pair whose prompt alone fills data.max_length keeps no answer token (TRL drops it too).
    tokens.train = with_answers(tokens.train, dropped, "train_truncated", max_length)
    tokens.eval = with_answers(tokens.eval, dropped, "eval_truncated", max_length)
    dpo = spec.section(DPOSpec) or DPOSpec()
    info = {
        "data_format": frames.format,
        "chat_template": template,
        "dpo_loss": dpo.loss_type,
        "dpo_beta": dpo.beta,
        "dpo_label_smoothing": dpo.label_smoothing,
        "dpo_reference": "the base model (LoRA adapter disabled)" if spec.lora else "precomputed (full fine-tune)",
    }
    if env.is_local_main:
        lengths = column(tokens.train, "length")
        log.info(
            "data: %d train / %d eval pairs (%s format%s); longest sequence %d tokens, mean %.0f; "
            "tokenization cache %s",
            len(tokens.train),
            len(tokens.eval),
            frames.format,
            f", {template} chat template" if template else "",
            lengths.max(),
            lengths.mean(),
            tokens.cache,
        )
    pad_id, model = tokenizer.pad_token_id, model_identity(spec, model_dir)
    collate, collate_eval = (
        PairCollate(ds, pad_id, max_length, dpo, f"{model}:{key}")
        for ds, key in ((tokens.train, tokens.train_key), (tokens.eval, tokens.eval_key))
    )
    return prepared(tokens, collate=collate, collate_eval=collate_eval, dropped=dropped, info=info, raw=tokenizer)


def _prepare_stream(spec: JobSpec, env: DistEnv, tokenizer, frames, encode, fingerprint: str, template) -> Prepared:
    """data.streaming (with LoRA: the reference is the base model, on the fly): data.train as a
    ``Feed``, each rank tokenizing its own pairs as they come; data.eval tokenized whole."""
    max_length, dpo, pad_id = spec.data.max_length, spec.section(DPOSpec) or DPOSpec(), tokenizer.pad_token_id
    feed = Feed.for_spec(
        spec,
        env,
        normalizer=shard_normalizer(spec.data),
        encode=lambda rows: encode(pd.DataFrame(rows)),
        collate=lambda cols, ids: PairCollate(cols, pad_id, max_length, dpo, "")(ids),
        # a pair whose prompt alone fills data.max_length keeps no answer token: dropped, as without streaming
        units=lambda cols: np.asarray([len(p) < max_length for p in cols["prompt_ids"]], dtype=np.int64),
    )
    tokens = tokenize_split(frames, env, fingerprint, encode, train=False)
    dropped = dict(frames.dropped)
    tokens.eval = with_answers(tokens.eval, dropped, "eval_truncated", max_length)
    if env.is_local_main:
        log.info("data: %s; %d eval pairs (%s format)", feed.describe(), len(tokens.eval), frames.format)
    info = {
        "data_format": frames.format,
        "chat_template": template,
        "dpo_loss": dpo.loss_type,
        "dpo_beta": dpo.beta,
        "dpo_label_smoothing": dpo.label_smoothing,
        "dpo_reference": "the base model (LoRA adapter disabled)",
        "streamed_shards": len(feed.listing.shards),
    }
    return prepared(
        tokens,
        collate=feed.collate,
        # its key names a precomputed reference
        collate_eval=PairCollate(tokens.eval, pad_id, max_length, dpo, tokens.eval_key),
        dropped=dropped,
        info=info,
        raw=tokenizer,
        stream=feed,
    )


# ---------------------------------------------------------------- the reference, once (full fine-tune)


def setup(
    spec: JobSpec,
    model: torch.nn.Module,
    data: Prepared,
    env: DistEnv,
    device: torch.device,
    autocast: torch.autocast,
    lockstep: bool,
) -> None:
    """Full fine-tune: the reference log-probabilities of every train and eval pair, from the model
    before its first step, read from the cache or computed (``tasks.reference.precompute``). With LoRA
    the reference is the adapter-less model, on the fly."""
    if spec.lora is not None:
        return
    train, held_out = data.collate, data.collate_eval
    assert isinstance(train, PairCollate) and isinstance(held_out, PairCollate)  # prepare's (a stream needs LoRA)
    path, values, how = precompute(spec, model, (train, held_out), env, device, autocast, lockstep)
    if env.is_main:
        log.info("dpo reference log-probabilities of %d + %d pairs %s: %s", len(values[0]), len(values[1]), how, path)


# ---------------------------------------------------------------- the loss


def _reference_logps(
    model: torch.nn.Module, batch: PairBatch[DPOSpec], autocast: torch.autocast
) -> tuple[torch.Tensor, torch.Tensor]:
    if batch.reference is not None:  # precomputed (a full fine-tune)
        return batch.reference[:, 0], batch.reference[:, 1]
    chosen, rejected = Reference.adapter().logps(model, batch, autocast).chunk(2)
    return chosen, rejected


def pair_losses(
    chosen: torch.Tensor,
    rejected: torch.Tensor,
    ref_chosen: torch.Tensor,
    ref_rejected: torch.Tensor,
    dpo: DPOSpec,
    answer_tokens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-pair loss and the statistics of ``METRICS`` (one row per pair) from the summed answer
    log-probabilities. sigmoid: −(1−ε) log σ(βΔ) − ε log σ(−βΔ), Δ the chosen minus the rejected
    log-ratio; ipo: (Δ' − 1/(2β))², Δ' with each log-ratio divided by its answer's tokens, as TRL."""
    chosen_ratio, rejected_ratio = chosen - ref_chosen, rejected - ref_rejected
    beta = dpo.beta
    if dpo.loss_type == "ipo":
        assert answer_tokens is not None, "ipo normalizes by the answers' tokens"
        n_chosen, n_rejected = answer_tokens.chunk(2)
        delta = chosen_ratio / n_chosen.clamp(min=1.0) - rejected_ratio / n_rejected.clamp(min=1.0)
        losses = (delta - 1 / (2 * beta)) ** 2
    else:
        delta = chosen_ratio - rejected_ratio
        losses = -F.logsigmoid(beta * delta) * (1 - dpo.label_smoothing)
        if dpo.label_smoothing:
            losses = losses - F.logsigmoid(-beta * delta) * dpo.label_smoothing
    reward_chosen, reward_rejected = beta * chosen_ratio.detach(), beta * rejected_ratio.detach()
    stats = torch.stack(
        [
            (reward_chosen > reward_rejected).float(),
            reward_chosen,
            reward_rejected,
            reward_chosen - reward_rejected,
            chosen.detach(),
            rejected.detach(),
        ],
        dim=1,
    )
    return losses, stats


def _pairs(
    model: torch.nn.Module, batch: PairBatch[DPOSpec], autocast: torch.autocast
) -> tuple[torch.Tensor, torch.Tensor]:
    ref_chosen, ref_rejected = _reference_logps(model, batch, autocast)  # first: no graph is held meanwhile
    chosen, rejected = sequence_logps(model, batch, autocast).chunk(2)
    answer_tokens = (batch.labels != IGNORE).sum(dim=1).float()  # IPO's length normalization
    dpo = batch.settings or DPOSpec()
    losses, stats = pair_losses(chosen, rejected, ref_chosen, ref_rejected, dpo, answer_tokens)
    return losses.sum(), stats


STEPS = pair_steps(METRICS, _pairs)
loss, eval_step, eval_totals, eval_metrics = STEPS


# ---------------------------------------------------------------- how the results read


def _report_rows(m: dict) -> list[tuple[str, object]]:
    return [
        ("eval reward accuracy (chosen reward > rejected)", m.get("eval_reward_accuracy")),
        ("eval reward margin (mean)", m.get("eval_reward_margin")),
        ("eval rewards chosen / rejected", f"{m.get('eval_reward_chosen'):.4f} / {m.get('eval_reward_rejected'):.4f}"),
        ("eval pairs", m.get("eval_pairs")),
        (
            "dpo loss, beta, label smoothing",
            f"{m.get('dpo_loss')}, {m.get('dpo_beta')}, {m.get('dpo_label_smoothing')}",
        ),
        ("reference model", m.get("dpo_reference")),
        *common.data_rows(m, "none (text pairs)"),
    ]


def _card_about(m: dict) -> list[str]:
    return [
        f"Preference-tuned with DPO ({m.get('dpo_loss')} loss, beta {m.get('dpo_beta')}); the reference model is "
        f"{m.get('dpo_reference')}. On {m.get('eval_pairs')} held-out pairs the reward accuracy is "
        f"{m.get('eval_reward_accuracy', float('nan')):.4f} and the mean reward margin "
        f"{m.get('eval_reward_margin', float('nan')):.4f}.",
        common.data_card_line(m),
    ]


TASK = causal.generation_task(
    load_frames=load_pair_frames,
    prepare=prepare,
    steps=STEPS,
    headline=("eval_reward_accuracy", "eval_reward_margin"),
    present=causal.presentation(
        report_rows=_report_rows,
        card_about=_card_about,
        headline=causal.reward_accuracy_headline,
        summary=causal.pair_summary,
        step_plots=(
            causal.REWARD_ACCURACY_PLOT,
            causal.REWARDS_PLOT,
        ),
        loss_label="DPO loss",
    ),
    train_metrics=METRICS,
    setup=setup,
)
