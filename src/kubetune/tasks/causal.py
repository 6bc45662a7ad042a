"""The causal LM that several tasks train and export (causal-LM fine-tuning, DPO, KTO, ORPO, GRPO): the model
built (full fine-tune, LoRA, or QLoRA: bitsandbytes 4-bit NF4 / 8-bit, GPU only, each rank loading its quantized
copy on its own device), the preference tasks' model with every dropout off, the export (``adapter/`` and
``model/``: the adapter merged into the base reloaded in full precision), how the results of a task whose
export is a causal LM read (``presentation``; the pieces the preference tasks share: ``pair_summary``,
``reward_accuracy_headline``, ``REWARD_ACCURACY_PLOT``, ``REWARDS_PLOT``), and such a task's ``Task``
(``generation_task``)."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path

import torch

from kubetune import artifacts
from kubetune.artifacts.presentation import Presentation
from kubetune.config import JobSpec
from kubetune.errors import KubetuneError
from kubetune.inference import kinds
from kubetune.tasks import attention, fused
from kubetune.tasks.base import Export, LoadFrames, Prepare, Prepared, Setup, Steps, Task
from kubetune.tasks.common import attention_kwargs, load_pretrained, without_dropout

log = logging.getLogger(__name__)


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
        fallback, flash = attn.get("attn_implementation", "sdpa"), spec.training.fast_path.flash_attention
        attn = {"attn_implementation": attention.register(fallback=fallback, flash=flash)}
    model = load_pretrained(AutoModelForCausalLM, model_dir, where, **kwargs, **attn)
    model.config.use_cache = False  # no KV cache while training
    # On the meta device too: FSDP builds every rank's modules there and fills the weights in later.
    fused.patch(model, device, spec.training.fast_path.liger, quiet=where.type == "meta")
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
                lora_alpha=lora.alpha,  # a float: peft's scale is lora_alpha / r
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


def build_preference_model(
    spec: JobSpec,
    model_dir: Path,
    data: Prepared,
    device: torch.device,
    dtype: torch.dtype,
    where: torch.device | None = None,
) -> torch.nn.Module:
    """``build_model``'s model with every dropout off (TRL's disable_dropout, on by default): a policy and its
    reference, a pair's two answers, a sampled completion and its training step are scored by the same network."""
    return without_dropout(build_model(spec, model_dir, data, device, dtype, where))


def export(spec: JobSpec, model, tokenizer, data: Prepared, out, metrics: dict) -> None:
    """``adapter/`` for LoRA; ``model/``: the full model (LoRA merged in fp32), with the tokenizer
    and the chat template it was trained with."""
    from transformers import AutoModelForCausalLM

    model_dir = artifacts.resolve_model(spec)
    if spec.lora is not None:
        artifacts.replace_dir(lambda d: (model.save_pretrained(d), tokenizer.save_pretrained(d)), out / "adapter")
        # Merge into the base reloaded unquantized in fp32 on the CPU, not into the training copy
        # (which may be 4-bit or bf16): the merged weights are rounded once, to the base's dtype.
        from kubetune.inference.causal import with_adapter  # the one loader of an export's adapter

        base = load_pretrained(AutoModelForCausalLM, model_dir, dtype=torch.float32)
        saved_dtype = _config_dtype(base.config)
        merged = with_adapter(base, out / "adapter", merge=True)
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


def card_usage(repo: str) -> list[str]:
    """The model card's usage lines of a causal-LM export: a text-generation pipeline over a chat."""
    return [
        f'gen = pipeline("text-generation", model="{repo}")',
        'print(gen([{"role": "user", "content": "Hello"}], max_new_tokens=64))',
    ]


def presentation(
    report_rows: Callable[[dict], list[tuple[str, object]]],
    card_about: Callable[[dict], list[str]],
    headline: Callable[[dict], str],
    summary: Callable[[dict], str],
    step_plots: tuple[tuple[str, tuple[str, ...]], ...],
    loss_label: str,
    card_metrics: tuple[str, ...] = ("eval_loss", "train_loss"),
) -> Presentation:
    """How the results of a task whose export is a causal LM read (DPO, KTO, ORPO, GRPO): a text-generation
    model card with ``card_usage``, no evaluation curves of their own (the step plots show the evaluations beside
    the training values); the other arguments are ``Presentation``'s fields."""
    return Presentation(
        pipeline_tag="text-generation",
        report_rows=report_rows,
        eval_curves=(),
        eval_log_scale=False,
        card_usage=card_usage,
        card_about=card_about,
        headline=headline,
        summary=summary,
        step_plots=step_plots,
        loss_label=loss_label,
        card_metrics=card_metrics,
    )


# The step plots several preference tasks share: the reward accuracy (DPO, ORPO) and the rewards with their
# margin (DPO, KTO), each with its evaluations.
REWARD_ACCURACY_PLOT = ("Reward accuracy", ("reward_accuracy", "eval_reward_accuracy"))
REWARDS_PLOT = ("Rewards", ("reward_chosen", "reward_rejected", "reward_margin", "eval_reward_margin"))


def reward_accuracy_headline(m: dict) -> str:
    """The Hub commit's headline of a pairwise preference task (DPO, ORPO): the eval reward accuracy."""
    return f"reward accuracy {m.get('eval_reward_accuracy', float('nan')):.4f}"


def pair_summary(m: dict) -> str:
    """The summary's first line of a pairwise preference task (DPO, ORPO): the eval reward accuracy and margin,
    the eval loss and the held-out pairs."""
    return (
        f"reward accuracy {m['eval_reward_accuracy']:.4f}, margin {m['eval_reward_margin']:.4f}, "
        f"eval loss {m['eval_loss']:.4f} on {m['eval_pairs']} held-out pairs"
    )


def generation_task(
    load_frames: LoadFrames,
    prepare: Prepare,
    steps: Steps,
    headline: tuple[str, ...],
    present: Presentation,
    train_metrics: tuple[str, ...] = (),
    setup: Setup | None = None,
    export: Export = export,
    artifact_files: tuple[str, ...] = (),
) -> Task:
    """The ``Task`` of a task that tunes the causal LM with every dropout off (``build_preference_model``) and
    exports it as a causal LM (``export``, or the task's own that writes it and more), which ``kubetune predict``
    and ``serve`` answer as one (``inference.kinds.CAUSAL_LM``): DPO, KTO, ORPO, GRPO."""
    return Task(
        load_frames=load_frames,
        prepare=prepare,
        build_model=build_preference_model,
        loss=steps.loss,
        eval_step=steps.eval_step,
        eval_totals=steps.eval_totals,
        eval_metrics=steps.eval_metrics,
        export=export,
        headline=headline,
        present=present,
        train_metrics=train_metrics,
        artifact_files=artifact_files,
        setup=setup,
        inference=kinds.CAUSAL_LM,
    )
