"""Causal-LM fine-tuning (Llama-class decoders): the task's pieces for the shared trainer (``training/trainer.py``).

Data: text, instruction or chat rows → token ids with response-only labels (``data.py``),
optionally packed padding-free; model: ``AutoModelForCausalLM``, full fine-tune, LoRA, or QLoRA
(bitsandbytes 4-bit NF4 / 8-bit, GPU only, each rank loading its quantized copy on its own
device; ``tasks.causal``, which the preference tasks share); loss: next-token cross-entropy summed over
target tokens (``tasks.logprobs``; the loop divides by the target tokens of the whole global step, so long
and short examples weigh per token, as in Hugging Face Trainer); eval: loss and perplexity; export
(``tasks.causal``): ``adapter/`` and ``model/`` (the adapter merged into the base reloaded in full precision).
"""

from __future__ import annotations

import functools
import logging
import math

import numpy as np
import pandas as pd
import torch

from kubetune.artifacts.presentation import Presentation
from kubetune.config import JobSpec
from kubetune.data import Batch
from kubetune.data.feed import Feed
from kubetune.data.rows import column
from kubetune.data.tokenize import tokenizer_fingerprint
from kubetune.distributed import DistEnv
from kubetune.errors import KubetuneError
from kubetune.inference import kinds
from kubetune.tasks.base import LossOutput, Prepared, Task
from kubetune.tasks.causal import build_model, card_usage, export
from kubetune.tasks.causal_lm import CausalLMData
from kubetune.tasks.causal_lm.data import collate, load_lm_frames, shard_normalizer, tokenize_frame
from kubetune.tasks.common import data_card_line, data_rows, load_on_node, prepare_tokenizer, prepared, tokenize_split
from kubetune.tasks.logprobs import token_loss

log = logging.getLogger(__name__)


def _encode(frame: pd.DataFrame, tokenizer, max_length: int, train_on_prompt: bool) -> dict[str, list]:
    return tokenize_frame(frame[["record"]], tokenizer, max_length, train_on_prompt=train_on_prompt)


def prepare(spec: JobSpec, env: DistEnv, model_dir, tokenizer) -> Prepared:
    """The shared skeleton (``tasks.common``) around the task's own parts: instruction and chat rows both
    render with the chat template; the tokens' mode says whether prompts carry a loss; rows left without
    a target token are dropped."""
    data = spec.data_as(CausalLMData)
    frames = load_on_node(load_lm_frames, spec, env)
    template = prepare_tokenizer(tokenizer, chat=frames.format != "text")
    mode = "causal-lm+prompt" if data.train_on_prompt else "causal-lm"
    encode = functools.partial(
        _encode, tokenizer=tokenizer, max_length=data.max_length, train_on_prompt=data.train_on_prompt
    )
    fingerprint = f"{mode}:{data.max_length}:{tokenizer_fingerprint(tokenizer)}"
    if data.streaming:
        return _prepare_stream(spec, env, tokenizer, frames, encode, fingerprint, template)
    tokens = tokenize_split(frames, env, fingerprint, encode)
    dropped = dict(frames.dropped)
    # Rows whose response lies wholly beyond data.max_length teach nothing: drop them (counted).
    tokens.train = _with_targets(tokens.train, dropped, "train_truncated", data.max_length)
    tokens.eval = _with_targets(tokens.eval, dropped, "eval_truncated", data.max_length)
    train_ds, eval_ds = tokens.train, tokens.eval
    units = column(train_ds, "n_targets")  # int32: 4 bytes per row (its sums are int64)
    lengths = column(train_ds, "length")
    info = {
        "data_format": frames.format,
        "chat_template": template,
        # Per epoch, of the training data; the loop reports train_tokens over every epoch trained.
        "train_data_tokens": int(lengths.sum()),
        "train_data_target_tokens": int(units.sum()),
        "packing": data.packing,
    }
    if env.is_local_main:
        log.info(
            (
                "data: %d train / %d eval rows (%s format%s); %d tokens, %d with loss (%.0f%%), mean length %.0f, "
                "max %d; tokenization cache %s"
            ),
            len(train_ds),
            len(eval_ds),
            frames.format,
            ", fallback chat template" if template == "fallback" else "",
            lengths.sum(),
            units.sum(),
            100 * units.sum() / max(lengths.sum(), 1),
            lengths.mean(),
            lengths.max(),
            tokens.cache,
        )
    return prepared(
        tokens,
        collate=functools.partial(collate, train_ds, pad_id=tokenizer.pad_token_id, packing=data.packing),
        collate_eval=functools.partial(collate, eval_ds, pad_id=tokenizer.pad_token_id),
        units=units,
        dropped=dropped,
        info=info,
        raw=tokenizer,
    )


def _prepare_stream(spec: JobSpec, env: DistEnv, tokenizer, frames, encode, fingerprint: str, template):
    """data.streaming: data.train as a ``Feed`` of rank 0's listing (every rank reads it; each
    tokenizes its own rows as they come), data.eval tokenized whole as without streaming."""
    data = spec.data_as(CausalLMData)
    feed = Feed.for_spec(
        spec,
        env,
        normalizer=shard_normalizer(data),
        encode=lambda rows: encode(pd.DataFrame(rows)),
        collate=functools.partial(collate, pad_id=tokenizer.pad_token_id, packing=data.packing),
        units=lambda cols: np.asarray(cols["n_targets"], dtype=np.int64),
    )
    tokens = tokenize_split(frames, env, fingerprint, encode, train=False)
    dropped = dict(frames.dropped)
    tokens.eval = _with_targets(tokens.eval, dropped, "eval_truncated", data.max_length)
    if env.is_local_main:
        log.info("data: %s; %d eval rows (%s format)", feed.describe(), len(tokens.eval), frames.format)
    info = {
        "data_format": frames.format,
        "chat_template": template,
        "packing": data.packing,
        "streamed_shards": len(feed.listing.shards),
    }
    return prepared(
        tokens,
        collate=feed.collate,
        collate_eval=functools.partial(collate, tokens.eval, pad_id=tokenizer.pad_token_id),
        dropped=dropped,
        info=info,
        raw=tokenizer,
        stream=feed,
    )


def _with_targets(ds, dropped: dict, key: str, max_length: int):
    n_targets = column(ds, "n_targets")
    keep = np.flatnonzero(n_targets > 0)
    if len(keep) == len(ds):
        return ds
    dropped[key] = len(ds) - len(keep)
    log.warning(
        "%d rows have no response tokens within data.max_length %d; they are skipped", len(ds) - len(keep), max_length
    )
    if len(keep) == 0:
        raise KubetuneError(
            f"no row has response tokens within the first {max_length} tokens",
            field="data.max_length",
            fix="raise data.max_length, or check data.format and the column settings",
        )
    return ds.select(keep)


def loss(model, batch: Batch, autocast) -> LossOutput:
    """Summed next-token cross-entropy over the target tokens of a micro-batch, and their count."""
    loss_sum, count, _ = token_loss(model, batch, autocast)
    return LossOutput(loss_sum, count)


def eval_step(model, batch: Batch, autocast) -> dict:
    loss_sum, count, correct = token_loss(model, batch, autocast, count_correct=True)
    return {"loss": loss_sum, "count": count, "correct": correct}


def eval_totals(stats: list[dict], data: Prepared, device) -> dict[str, torch.Tensor]:
    """The loss sum, the target tokens and the correct greedy next-token guesses among them."""
    totals = {name: torch.zeros((), device=device, dtype=torch.float64) for name in ("loss", "tokens", "correct")}
    for st in stats:
        totals["loss"] += st["loss"].double()
        totals["tokens"] += st["count"]
        totals["correct"] += st["correct"]
    return totals


def eval_metrics(totals: dict[str, np.ndarray], data: Prepared) -> dict:
    """Token-level loss and perplexity over the whole eval set, and the greedy next-token accuracy."""
    n = max(float(totals["tokens"]), 1.0)
    eval_loss = float(totals["loss"]) / n
    return {
        "eval_loss": eval_loss,
        "eval_perplexity": math.exp(min(eval_loss, 50.0)),
        "eval_token_accuracy": float(totals["correct"]) / n,  # greedy next-token matches on target tokens
        "eval_tokens": int(totals["tokens"]),
        "eval_samples": data.eval_rows,
    }


def _report_rows(m: dict) -> list[tuple[str, object]]:
    return [
        ("eval perplexity", m.get("eval_perplexity")),
        ("eval next-token accuracy (target tokens)", m.get("eval_token_accuracy")),
        ("eval target tokens", m.get("eval_tokens")),
        *data_rows(m, "none (plain text)"),
        ("packing", m.get("packing")),
        (
            "training data tokens / with loss (one epoch)",
            f"{m.get('train_data_tokens')} / {m.get('train_data_target_tokens')}",
        ),
    ]


def _summary(m: dict) -> str:
    return (
        f"eval loss {m['eval_loss']:.4f}, perplexity {m['eval_perplexity']:.2f} "
        f"on {m['eval_tokens']} target tokens of {m['eval_rows']} held-out rows"
    )


TASK = Task(
    load_frames=load_lm_frames,
    prepare=prepare,
    build_model=build_model,
    loss=loss,
    eval_step=eval_step,
    eval_totals=eval_totals,
    eval_metrics=eval_metrics,
    export=export,
    headline=("eval_perplexity",),
    inference=kinds.CAUSAL_LM,
    present=Presentation(
        pipeline_tag="text-generation",
        report_rows=_report_rows,
        eval_curves=("eval_perplexity",),
        eval_log_scale=True,
        card_usage=card_usage,
        card_about=lambda m: [data_card_line(m)],
        headline=lambda m: f"eval perplexity {m.get('eval_perplexity', float('nan')):.2f}",
        summary=_summary,
        card_metrics=("eval_perplexity", "eval_token_accuracy", "eval_loss", "train_loss"),
    ),
)
