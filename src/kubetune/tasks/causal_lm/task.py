"""Causal-LM fine-tuning (Llama-class decoders): the task's pieces for the shared trainer (``training/trainer.py``).

Data: text, instruction or chat rows → token ids with response-only labels (``data.py``),
optionally packed padding-free; model: ``AutoModelForCausalLM``, full fine-tune, LoRA, or QLoRA
(bitsandbytes 4-bit NF4 / 8-bit, GPU only, each rank loading its quantized copy on its own
device); loss: next-token cross-entropy summed over target tokens (the loop divides by the
target tokens of the whole global step, so long and short examples weigh per token, as in
Hugging Face Trainer); eval: loss and perplexity; export: ``adapter/`` and ``model/`` (the
adapter merged into the base reloaded in full precision).
"""

from __future__ import annotations

import contextlib
import functools
import logging
import math
import os

import numpy as np
import pandas as pd
import torch
import torch.nn.functional as F

from kubetune import artifacts
from kubetune.config import JobSpec
from kubetune.data import Batch
from kubetune.data.feed import Feed
from kubetune.data.rows import column
from kubetune.data.tokenize import tokenizer_fingerprint
from kubetune.distributed import DistEnv
from kubetune.errors import KubetuneError
from kubetune.inference import kinds
from kubetune.tasks import attention
from kubetune.tasks.base import LossOutput, Prepared, Presentation, Task
from kubetune.tasks.causal_lm.data import collate, load_lm_frames, shard_normalizer, tokenize_frame
from kubetune.tasks.common import (
    attention_kwargs,
    head_forward,
    load_on_node,
    load_pretrained,
    next_token_targets,
    prepare_tokenizer,
    prepared,
    replaceable_head,
    target_mask,
    tokenize_split,
)

log = logging.getLogger(__name__)


def _encode(frame: pd.DataFrame, tokenizer, max_length: int, train_on_prompt: bool) -> dict[str, list]:
    return tokenize_frame(frame[["record"]], tokenizer, max_length, train_on_prompt=train_on_prompt)


def prepare(spec: JobSpec, env: DistEnv, model_dir, tokenizer) -> Prepared:
    """The shared skeleton (``tasks.common``) around the task's own parts: instruction and chat rows both
    render with the chat template; the tokens' mode says whether prompts carry a loss; rows left without
    a target token are dropped."""
    frames = load_on_node(load_lm_frames, spec, env)
    template = prepare_tokenizer(tokenizer, chat=frames.format != "text")
    mode = "causal-lm+prompt" if spec.data.train_on_prompt else "causal-lm"
    encode = functools.partial(
        _encode, tokenizer=tokenizer, max_length=spec.data.max_length, train_on_prompt=spec.data.train_on_prompt
    )
    fingerprint = f"{mode}:{spec.data.max_length}:{tokenizer_fingerprint(tokenizer)}"
    if spec.data.streaming:
        return _prepare_stream(spec, env, tokenizer, frames, encode, fingerprint, template)
    tokens = tokenize_split(frames, env, fingerprint, encode)
    dropped = dict(frames.dropped)
    # Rows whose response lies wholly beyond data.max_length teach nothing: drop them (counted).
    tokens.train = _with_targets(tokens.train, dropped, "train_truncated", spec.data.max_length)
    tokens.eval = _with_targets(tokens.eval, dropped, "eval_truncated", spec.data.max_length)
    train_ds, eval_ds = tokens.train, tokens.eval
    units = column(train_ds, "n_targets")  # int32: 4 bytes per row (its sums are int64)
    lengths = column(train_ds, "length")
    info = {
        "data_format": frames.format,
        "chat_template": template,
        # Per epoch, of the training data; the loop reports train_tokens over every epoch trained.
        "train_data_tokens": int(lengths.sum()),
        "train_data_target_tokens": int(units.sum()),
        "packing": spec.data.packing,
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
        collate=functools.partial(collate, train_ds, pad_id=tokenizer.pad_token_id, packing=spec.data.packing),
        collate_eval=functools.partial(collate, eval_ds, pad_id=tokenizer.pad_token_id),
        units=units,
        dropped=dropped,
        info=info,
        raw=tokenizer,
    )


def _prepare_stream(spec: JobSpec, env: DistEnv, tokenizer, frames, encode, fingerprint: str, template):
    """data.streaming: data.train as a ``Feed`` of rank 0's listing (every rank reads it; each
    tokenizes its own rows as they come), data.eval tokenized whole as without streaming."""
    feed = Feed.for_spec(
        spec,
        env,
        normalizer=shard_normalizer(spec.data),
        encode=lambda rows: encode(pd.DataFrame(rows)),
        collate=functools.partial(collate, pad_id=tokenizer.pad_token_id, packing=spec.data.packing),
        units=lambda cols: np.asarray(cols["n_targets"], dtype=np.int64),
    )
    tokens = tokenize_split(frames, env, fingerprint, encode, train=False)
    dropped = dict(frames.dropped)
    tokens.eval = _with_targets(tokens.eval, dropped, "eval_truncated", spec.data.max_length)
    if env.is_local_main:
        log.info("data: %s; %d eval rows (%s format)", feed.describe(), len(tokens.eval), frames.format)
    info = {
        "data_format": frames.format,
        "chat_template": template,
        "packing": spec.data.packing,
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


def build_model(spec: JobSpec, model_dir, data: Prepared, device: torch.device, dtype: torch.dtype, where=None):
    """The pretrained decoder: full fine-tune, LoRA, or QLoRA (quantized frozen base + LoRA); on
    ``where`` (default: the training device; meta: the modules without weights)."""
    from transformers import AutoModelForCausalLM

    cfg, lora = spec.training, spec.lora
    quant = lora.quantization if lora else None
    kwargs: dict = {}
    if quant:
        kwargs = _quantized_load(quant, device, dtype)
    elif lora is not None and device.type == "cuda" and dtype in (torch.bfloat16, torch.float16):
        # The frozen base in half precision halves its memory; the adapters peft adds stay fp32.
        kwargs = {"dtype": dtype}
    else:
        kwargs = {"dtype": torch.float32}  # full fine-tune: fp32 master weights under autocast
    where = where or device
    attn = attention_kwargs(device, dtype)
    # Packed rows: each document attends to itself only, no (length)² mask. KUBETUNE_PACKED_ATTENTION=0
    # keeps transformers' dense-mask attention (benchmarks/sft_trl.py --ablations measures both).
    if getattr(spec.data, "packing", False) and os.environ.get("KUBETUNE_PACKED_ATTENTION", "1") != "0":
        attn = {"attn_implementation": attention.register(fallback=attn.get("attn_implementation", "sdpa"))}
    model = load_pretrained(AutoModelForCausalLM, model_dir, where, **kwargs, **attn)
    model.config.use_cache = False  # no KV cache while training
    # Non-reentrant checkpointing works under DDP and with frozen inputs (LoRA).
    ckpt_kwargs = {"use_reentrant": False}
    if quant and dtype == torch.float16:
        from peft import prepare_model_for_kbit_training

        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=cfg.gradient_checkpointing, gradient_checkpointing_kwargs=ckpt_kwargs
        )
    elif quant:
        # What peft's prepare_model_for_kbit_training does, less its cast of every unquantized weight
        # to fp32 (meant for fp16 training): under bf16 autocast the frozen embeddings and norms need
        # no upcast, and at Llama-3.2-1B size that cast alone costs 0.5 GiB (benchmarks/README.md).
        for p in model.parameters():
            p.requires_grad_(False)
        if cfg.gradient_checkpointing:
            model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
            # frozen embeddings: checkpointed blocks still need an input that requires grad
            model.enable_input_require_grads()
    elif cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=ckpt_kwargs)
    if lora is not None:
        from peft import LoraConfig, TaskType, get_peft_model

        model = get_peft_model(
            model,
            LoraConfig(
                task_type=TaskType.CAUSAL_LM,
                r=lora.r,
                lora_alpha=lora.alpha,
                lora_dropout=lora.dropout,
                target_modules=lora.target_modules,
            ),
        )
    return model if quant else model.to(where)  # a quantized model is already on its device


def _quantized_load(quant: str, device: torch.device, dtype: torch.dtype) -> dict:
    if device.type != "cuda":
        raise KubetuneError(
            f"{quant} quantization (QLoRA) needs a CUDA GPU and this worker runs on {device.type}",
            field="lora.quantization",
            fix="remove lora.quantization to train LoRA unquantized on CPU, or run on GPU nodes (resources.gpus)",
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise KubetuneError(
            "bitsandbytes is not installed",
            field="lora.quantization",
            fix="pip install bitsandbytes (the CUDA trainer image has it)",
        ) from None
    from transformers import BitsAndBytesConfig

    compute = dtype if dtype != torch.float32 else torch.float32
    if quant == "4bit":
        config = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True, bnb_4bit_compute_dtype=compute
        )
    else:
        config = BitsAndBytesConfig(load_in_8bit=True)
    # Each rank loads its own quantized copy onto its own GPU (device_map pins every module there).
    return {"quantization_config": config, "device_map": {"": device.index or 0}, "dtype": compute}


# Target positions projected onto the vocabulary together: a chunk's logits, their fp32 copy and
# softmax (about 10 bytes x LOSS_CHUNK x vocabulary) are the loss's transient peak.
LOSS_CHUNK = 512


def loss(model, batch: Batch, autocast) -> LossOutput:
    """Summed next-token cross-entropy over the target tokens of a micro-batch, and their count."""
    loss_sum, count, _ = _token_loss(model, batch, autocast)
    return LossOutput(loss_sum, count)


def eval_step(model, batch: Batch, autocast) -> dict:
    loss_sum, count, correct = _token_loss(model, batch, autocast, count_correct=True)
    return {"loss": loss_sum, "count": count, "correct": correct}


def target_logps(model, batch: Batch, autocast) -> torch.Tensor:
    """The log-probability (fp32) of every target token of a micro-batch (labels not IGNORE), in
    row-major order, computed as the loss is (no full logits): what the DPO task sums per answer."""
    nll, _, _ = _token_loss(model, batch, autocast, per_token=True)
    return -nll


def sequence_logps(model, batch: Batch, autocast) -> torch.Tensor:
    """Each row's summed target-token log-probability (fp32), computed as the loss is: what the preference tasks
    (DPO, KTO) compare between the policy and the reference. Scattered into the sequence layout and summed per row:
    deterministic, unlike index_add on a GPU."""
    per_token = target_logps(model, batch, autocast)
    mask = target_mask(batch.labels)
    dense = torch.zeros(mask.shape, dtype=per_token.dtype, device=per_token.device)
    return dense.masked_scatter(mask, per_token).sum(dim=1)


def _token_loss(model, batch: Batch, autocast, count_correct: bool = False, per_token: bool = False):
    """The causal token loss, shared by training and evaluation: next-token cross-entropy summed
    over the target tokens (labels not IGNORE), their count, and (``count_correct``, evaluation)
    how many the argmax got right, else None.

    The logits of a whole micro-batch (length x vocabulary: 4 GB in bf16 for 16k tokens and a 128k
    vocabulary) never exist. The model keeps the final hidden states of the positions that predict
    a target only (``logits_to_keep`` as a boolean mask, transformers' own argument), and for this
    one call its output projection is the loss itself (``_loss_as_head``): it projects those states
    onto the vocabulary ``LOSS_CHUNK`` positions at a time, each chunk's logits recomputed in the
    backward pass (activation checkpointing) instead of kept. Inside the model's forward, so DDP
    and FSDP see the projection's weight used where they expect (FSDP gathers it again before the
    backward reaches it). Other models' loss is taken from the target rows of their logits, chunked
    the same way. ``per_token``: the cross-entropy of each target token instead of their sum."""
    mask, chosen, keep = next_token_targets(batch.labels)  # position t predicts token t + 1
    head = replaceable_head(model)
    packed = "position_ids" in batch.inputs and "attention_mask" not in batch.inputs
    with autocast, attention.packed_call() if packed else contextlib.nullcontext():
        if head is not None:
            with _loss_as_head(head, chosen, count_correct, per_token) as hits:
                total = model(**batch.inputs, logits_to_keep=keep).logits
            correct = hits[0]
        else:
            total, correct = _chunked_loss(model(**batch.inputs).logits[keep], chosen, None, count_correct, per_token)
    return total, mask.sum(), correct


def _chunked_loss(
    states: torch.Tensor,
    chosen: torch.Tensor,
    weight: torch.Tensor | None,
    count_correct: bool,
    per_token: bool = False,
):
    """Summed cross-entropy of ``states`` (logits, or hidden states that ``weight`` projects) against
    ``chosen`` (``per_token``: each row's), ``LOSS_CHUNK`` rows at a time, and how many argmax
    guesses are right (``count_correct``)."""
    parts = []
    correct = torch.zeros((), dtype=torch.long, device=states.device) if count_correct else None
    for rows, ids in zip(states.split(LOSS_CHUNK), chosen.split(LOSS_CHUNK)):
        if torch.is_grad_enabled():
            part, _ = torch.utils.checkpoint.checkpoint(
                _chunk_loss, rows, ids, weight, False, per_token, use_reentrant=False
            )
        else:
            part, hits = _chunk_loss(rows, ids, weight, count_correct, per_token)
            if count_correct:
                correct += hits
        parts.append(part)
    if per_token:
        return (torch.cat(parts) if parts else states.new_zeros(0, dtype=torch.float32)), correct
    total = states.new_zeros((), dtype=torch.float32)
    for part in parts:
        total = total + part
    return total, correct


def _chunk_loss(
    rows: torch.Tensor,
    ids: torch.Tensor,
    weight: torch.Tensor | None,
    count_correct: bool = False,
    per_token: bool = False,
):
    logits = rows if weight is None else F.linear(rows, weight)
    hits = (logits.argmax(-1) == ids).sum() if count_correct else None
    return F.cross_entropy(logits.float(), ids, reduction="none" if per_token else "sum"), hits


@contextlib.contextmanager
def _loss_as_head(head: torch.nn.Linear, chosen: torch.Tensor, count_correct: bool, per_token: bool = False):
    """For one forward call, the output projection returns the chunked loss of the hidden states it
    is given against ``chosen``; yields a list that then holds the count of right guesses (or None)."""
    hits: list[torch.Tensor | None] = []

    def forward(hidden: torch.Tensor) -> torch.Tensor:
        total, correct = _chunked_loss(hidden, chosen, head.weight, count_correct, per_token)
        hits.append(correct)
        return total

    with head_forward(head, forward):
        yield hits


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


def export(spec: JobSpec, model, tokenizer, data: Prepared, out, metrics: dict) -> None:
    """``adapter/`` for LoRA; ``model/``: the full model (LoRA merged in fp32), with the tokenizer
    and the chat template it was trained with."""
    from transformers import AutoModelForCausalLM

    model_dir = artifacts.resolve_model(spec)
    if spec.lora is not None:
        artifacts.replace_dir(lambda d: (model.save_pretrained(d), tokenizer.save_pretrained(d)), out / "adapter")
        # Merge into the base reloaded unquantized in fp32 on the CPU, not into the training copy
        # (which may be 4-bit or bf16): the merged weights are rounded once, to the base's dtype.
        from peft import PeftModel

        base = load_pretrained(AutoModelForCausalLM, model_dir, dtype=torch.float32)
        saved_dtype = _config_dtype(base.config)
        merged = PeftModel.from_pretrained(base, out / "adapter").merge_and_unload()
        merged = merged.to(saved_dtype)
    else:
        merged = model
        saved_dtype = next(model.parameters()).dtype
    merged.config.use_cache = True
    if merged.generation_config is not None and merged.generation_config.pad_token_id is None:
        merged.generation_config.pad_token_id = tokenizer.pad_token_id

    def save(d) -> None:
        merged.save_pretrained(d, max_shard_size=artifacts.SHARD_SIZE)  # safetensors, sharded above 5 GB
        tokenizer.save_pretrained(d)

    artifacts.replace_dir(save, out / "model")
    metrics["exported_dtype"] = str(saved_dtype).removeprefix("torch.")
    log.info("exported %s", "the adapter and the merged model" if spec.lora else "the model")


def _config_dtype(config) -> torch.dtype:
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else torch.float32


def _report_rows(m: dict) -> list[tuple[str, object]]:
    return [
        ("eval perplexity", m.get("eval_perplexity")),
        ("eval next-token accuracy (target tokens)", m.get("eval_token_accuracy")),
        ("eval target tokens", m.get("eval_tokens")),
        ("data format", m.get("data_format")),
        ("chat template", m.get("chat_template") or "none (plain text)"),
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
        card_usage=lambda repo: [
            f'gen = pipeline("text-generation", model="{repo}")',
            'print(gen([{"role": "user", "content": "Hello"}], max_new_tokens=64))',
        ],
        card_about=lambda m: [
            f"Data format: {m.get('data_format')}; chat template: {m.get('chat_template') or 'none'}."
        ],
        headline=lambda m: f"eval perplexity {m.get('eval_perplexity', float('nan')):.2f}",
        summary=_summary,
        card_metrics=("eval_perplexity", "eval_token_accuracy", "eval_loss", "train_loss"),
    ),
)
