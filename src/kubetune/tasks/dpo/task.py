"""Preference tuning with DPO (Direct Preference Optimization) of a causal LM: the task's pieces for
the shared trainer (``training/trainer.py``).

Data: pairs of a prompt and a chosen and a rejected answer, in TRL's conventions: strings joined as
they are (text), or message lists rendered with the chat template (chat; the prompt may be implicit:
the turns chosen and rejected share), tokenized as TRL's DPOTrainer does and cached like the other
tasks' tokens. A micro-batch is its pairs' chosen sequences, then their rejected ones; only answer
tokens carry log-probabilities. Model: the causal-LM task's (full fine-tune, LoRA, QLoRA), with
dropout off (TRL's default, so the policy and the reference see the same network). The reference
model is never a second copy: with LoRA it is the model with its adapter disabled, for a full
fine-tune its log-probabilities are computed once, before training, by the model itself, and cached
on disk keyed by the model, the data, the template and the precision (a resumed run reads them).
Loss: sigmoid (DPO, with conservative label smoothing) or IPO, averaged over the global step's
pairs; the rewards, their margin and the reward accuracy are logged in training and evaluation.
Export, ``predict`` and the Hub push are the causal-LM task's.
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import shutil
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from kubetune import distributed
from kubetune.config import JobSpec
from kubetune.data.feed import Feed
from kubetune.data.rows import column
from kubetune.data.tokenize import tokenizer_fingerprint
from kubetune.distributed import DistEnv
from kubetune.inference import kinds
from kubetune.paths import cache_root, set_default_modes
from kubetune.tasks.base import Prepared, Presentation, Task, rank_batches
from kubetune.tasks.causal_lm import task as causal_lm
from kubetune.tasks.common import (
    IGNORE,
    load_on_node,
    pair_steps,
    prepare_tokenizer,
    prepared,
    tokenize_split,
    without_dropout,
)
from kubetune.tasks.dpo import DPOSpec
from kubetune.tasks.dpo.data import Collate, PairBatch, encode_pairs
from kubetune.tasks.pairs import load_pair_frames, shard_normalizer, with_answers

log = logging.getLogger(__name__)

# What the training log lines and history.jsonl report beside the loss (means over the pairs since the
# last line); evaluation reports the same with the eval_ prefix. TRL's names: rewards/accuracies,
# rewards/chosen, rewards/rejected, rewards/margins, logps/chosen, logps/rejected.
METRICS = ("reward_accuracy", "reward_chosen", "reward_rejected", "reward_margin", "logps_chosen", "logps_rejected")

# ---------------------------------------------------------------- data


# ---------------------------------------------------------------- prepare and model


def prepare(spec: JobSpec, env: DistEnv, model_dir, tokenizer) -> Prepared:
    """The shared skeleton (``tasks.common``) around the task's own parts: pairs dropped whose prompt
    leaves no answer token, and micro-batches of pairs keyed for the reference's cache."""
    frames = load_on_node(load_pair_frames, spec, env)
    template = prepare_tokenizer(tokenizer, frames.format == "chat", spec.data.chat_template)
    max_length = spec.data.max_length

    encode = functools.partial(encode_pairs, tokenizer=tokenizer, max_length=max_length)

    fingerprint = f"dpo:{max_length}:{tokenizer_fingerprint(tokenizer)}"
    if spec.data.streaming:
        return _prepare_stream(spec, env, tokenizer, frames, encode, fingerprint, template)
    tokens = tokenize_split(frames, env, fingerprint, encode)
    dropped = dict(frames.dropped)
    # A pair whose prompt alone fills data.max_length keeps no answer token (TRL drops it too).
    tokens.train = with_answers(tokens.train, dropped, "train_truncated", max_length)
    tokens.eval = with_answers(tokens.eval, dropped, "eval_truncated", max_length)
    dpo = spec.dpo or DPOSpec()
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
    pad_id, model = tokenizer.pad_token_id, _model_identity(spec, model_dir)
    collate, collate_eval = (
        Collate(ds, pad_id, max_length, dpo, f"{model}:{key}")
        for ds, key in ((tokens.train, tokens.train_key), (tokens.eval, tokens.eval_key))
    )
    return prepared(tokens, collate=collate, collate_eval=collate_eval, dropped=dropped, info=info, raw=tokenizer)


def _prepare_stream(spec: JobSpec, env: DistEnv, tokenizer, frames, encode, fingerprint: str, template) -> Prepared:
    """data.streaming (with LoRA: the reference is the base model, on the fly): data.train as a
    ``Feed``, each rank tokenizing its own pairs as they come; data.eval tokenized whole."""
    max_length, dpo, pad_id = spec.data.max_length, spec.dpo or DPOSpec(), tokenizer.pad_token_id
    feed = Feed.for_spec(
        spec,
        env,
        normalizer=shard_normalizer(spec.data),
        encode=lambda rows: encode(pd.DataFrame(rows)),
        collate=lambda cols, ids: Collate(cols, pad_id, max_length, dpo, "")(ids),
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
        collate_eval=Collate(tokens.eval, pad_id, max_length, dpo, tokens.eval_key),
        dropped=dropped,
        info=info,
        raw=tokenizer,
        stream=feed,
    )


def build_model(spec: JobSpec, model_dir, data: Prepared, device: torch.device, dtype: torch.dtype, where=None):
    """The causal-LM task's model (full, LoRA or QLoRA) with every dropout off: the policy's and the
    reference's log-probabilities come from the same network (TRL's disable_dropout, on by default)."""
    return without_dropout(causal_lm.build_model(spec, model_dir, data, device, dtype, where))


# ---------------------------------------------------------------- the reference, once (full fine-tune)


def setup(spec: JobSpec, model, data: Prepared, env: DistEnv, device, autocast, lockstep: bool) -> None:
    """Full fine-tune: the reference log-probabilities of every train and eval pair, from the model
    before its first step, read from the cache or computed (each pair on one rank, then gathered;
    local rank 0 caches them). With LoRA the reference is the adapter-less model, on the fly."""
    if spec.lora is not None:
        return
    collates = (data.collate, data.collate_eval)
    key = f"{data.collate.key}:{data.collate_eval.key}:{spec.training.precision}:{device.type}"
    path = cache_root() / "reference" / hashlib.sha256(key.encode()).hexdigest()[:32]
    names = ("train", "eval")
    (missing,) = distributed.any_rank(not all((path / f"{n}.npy").exists() for n in names), device=device)
    if missing:
        size = spec.training.eval_batch_size or 2 * spec.training.batch_size
        values = [_reference_pass(model, c, env, device, autocast, size, lockstep) for c in collates]
        if env.is_local_main:
            _write_cache(path, dict(zip(names, values)))
        how = "computed and cached"
    else:
        values = [np.load(path / f"{n}.npy") for n in names]
        how = "read from the cache"
    for c, v in zip(collates, values):
        c.reference = v
    if env.is_main:
        log.info("dpo reference log-probabilities of %d + %d pairs %s: %s", len(values[0]), len(values[1]), how, path)


def _model_identity(spec: JobSpec, model_dir) -> str:
    """What names the base model's weights: its URI, its config and its weight files (name, size,
    modification time: a new download changes them), without reading the weights."""
    h = hashlib.sha256(f"kubetune-dpo-reference-v1:{spec.model.uri}@{spec.model.revision}".encode())
    for f in sorted(Path(model_dir).iterdir()):
        if f.name == "config.json":
            h.update(f.read_bytes())
        elif f.suffix in (".safetensors", ".bin") and f.is_file():
            st = f.stat()
            h.update(f"{f.name}:{st.st_size}:{st.st_mtime_ns}".encode())
    return h.hexdigest()[:32]


@torch.no_grad()
def _reference_pass(model, collate: Collate, env: DistEnv, device, autocast, batch_size: int, lockstep: bool):
    """[rows, 2] log-probabilities (chosen, rejected) of ``collate``'s dataset under ``model``."""
    batches, extra = rank_batches(column(collate.ds, "length"), env, batch_size, lockstep)
    model.eval()
    parts = [
        causal_lm.sequence_logps(model, collate(rows).to(device), autocast).view(2, -1).T.double().cpu().numpy()
        for rows in batches
    ]
    for _ in range(extra):
        causal_lm.sequence_logps(model, collate(np.zeros(1, dtype=np.int64)).to(device), autocast)
    model.train()
    mine = np.concatenate(batches) if batches else np.zeros(0, dtype=np.int64)
    out = np.zeros((len(collate.ds), 2), dtype=np.float64)
    for rows, vals in distributed.all_gather_object((mine, np.concatenate(parts) if parts else np.zeros((0, 2)))):
        out[rows] = vals
    return out


def _write_cache(path: Path, arrays: dict[str, np.ndarray]) -> None:
    """Written into a temporary sibling, then renamed: a crash never leaves half a cache entry."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}-", dir=path.parent))
    for name, values in arrays.items():
        np.save(tmp / f"{name}.npy", values)
    set_default_modes(tmp)
    try:
        os.replace(tmp, path)
    except OSError:  # another node's process sharing this cache won the race: its values are the same
        shutil.rmtree(tmp, ignore_errors=True)


# ---------------------------------------------------------------- the loss


def _inner(model):
    return model.module if isinstance(model, torch.nn.parallel.DistributedDataParallel) else model


def _reference_logps(model, batch: PairBatch, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    if batch.reference is not None:
        return batch.reference[:, 0], batch.reference[:, 1]
    inner = _inner(model)
    if not hasattr(inner, "disable_adapter"):
        raise RuntimeError("dpo: no reference log-probabilities (full fine-tune without the setup pass)")
    with torch.no_grad(), inner.disable_adapter():
        ref = causal_lm.sequence_logps(inner, batch, autocast)
    return ref.chunk(2)


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


def _pairs(model, batch: PairBatch, autocast) -> tuple[torch.Tensor, torch.Tensor]:
    ref_chosen, ref_rejected = _reference_logps(model, batch, autocast)  # first: no graph is held meanwhile
    chosen, rejected = causal_lm.sequence_logps(model, batch, autocast).chunk(2)
    answer_tokens = (batch.labels != IGNORE).sum(dim=1).float()  # IPO's length normalization
    losses, stats = pair_losses(chosen, rejected, ref_chosen, ref_rejected, batch.dpo, answer_tokens)
    return losses.sum(), stats


loss, eval_step, eval_totals, eval_metrics = pair_steps(METRICS, _pairs)


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
        ("data format", m.get("data_format")),
        ("chat template", m.get("chat_template") or "none (text pairs)"),
    ]


def _card_about(m: dict) -> list[str]:
    return [
        f"Preference-tuned with DPO ({m.get('dpo_loss')} loss, beta {m.get('dpo_beta')}); the reference model is "
        f"{m.get('dpo_reference')}. On {m.get('eval_pairs')} held-out pairs the reward accuracy is "
        f"{m.get('eval_reward_accuracy', float('nan')):.4f} and the mean reward margin "
        f"{m.get('eval_reward_margin', float('nan')):.4f}.",
        f"Data format: {m.get('data_format')}; chat template: {m.get('chat_template') or 'none'}.",
    ]


def _summary(m: dict) -> str:
    return (
        f"reward accuracy {m['eval_reward_accuracy']:.4f}, margin {m['eval_reward_margin']:.4f}, "
        f"eval loss {m['eval_loss']:.4f} on {m['eval_pairs']} held-out pairs"
    )


TASK = Task(
    load_frames=load_pair_frames,
    prepare=prepare,
    build_model=build_model,
    loss=loss,
    eval_step=eval_step,
    eval_totals=eval_totals,
    eval_metrics=eval_metrics,
    export=causal_lm.export,
    headline=("eval_reward_accuracy", "eval_reward_margin"),
    inference=kinds.CAUSAL_LM,  # the export is a causal LM
    present=Presentation(
        pipeline_tag="text-generation",
        report_rows=_report_rows,
        eval_curves=(),  # the step plots show the evaluations beside the training values
        eval_log_scale=False,
        card_usage=causal_lm.TASK.present.card_usage,
        card_about=_card_about,
        headline=lambda m: f"reward accuracy {m.get('eval_reward_accuracy', float('nan')):.4f}",
        summary=_summary,
        step_plots=(
            ("Reward accuracy", ("reward_accuracy", "eval_reward_accuracy")),
            ("Rewards", ("reward_chosen", "reward_rejected", "reward_margin", "eval_reward_margin")),
        ),
        loss_label="DPO loss",
    ),
    train_metrics=METRICS,
    setup=setup,
)
