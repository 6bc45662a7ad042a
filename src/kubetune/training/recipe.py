"""The training recipe's small builders, picked by spec fields: seeding, precision, the optimizer
(``training.optimizer``) and the learning-rate schedule (``training.lr_scheduler``). A choice is one
builder and one line of its table (``OPTIMIZERS``, ``SCHEDULES``); the schedules are transformers'
own functions."""

from __future__ import annotations

import random
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from torch.optim.lr_scheduler import LRScheduler

from kubetune.config import TrainSpec
from kubetune.errors import KubetuneError


def seed_everything(seed: int) -> None:
    """Seed python's, numpy's and torch's global generators (every device's) with ``seed``."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_precision(precision: str, device: torch.device) -> torch.dtype:
    """Map training.precision to an autocast dtype (float32 = no autocast).

    Raises:
        KubetuneError: fp16 on a device other than a CUDA GPU.
    """
    if precision == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        if device.type == "cpu" and cpu_has_bf16():
            # AMX / AVX512-BF16: a MiniLM training step 2.2× faster than fp32 (benchmarks/README.md)
            return torch.bfloat16
        return torch.float32
    if precision == "fp16" and device.type != "cuda":
        raise KubetuneError("fp16 needs a CUDA GPU", field="training.precision", fix="use auto, fp32 or bf16 on CPU")
    return {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]


def cpu_has_bf16() -> bool:
    """Does this CPU compute bf16 natively (AMX or AVX512-BF16)? Elsewhere bf16 is emulated and slower than fp32."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    return bool(flags & {"amx_bf16", "avx512_bf16"})
    except OSError:
        pass
    return False


# ---- the optimizer: one builder per training.optimizer, from the parameter groups ----
Groups = list[dict[str, Any]]


def _adamw(groups: Groups, cfg: TrainSpec) -> torch.optim.Optimizer:
    # Fused: one kernel over all parameters, on the CPU too (5× faster than the per-tensor loop there), and it
    # takes the non-finite guard's found_inf flag on the device (training.trainer.FiniteGuard).
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, fused=True)


def _adamw_foreach(groups: Groups, cfg: TrainSpec) -> torch.optim.Optimizer:
    return torch.optim.AdamW(groups, lr=cfg.learning_rate, foreach=True)


def _sgd(groups: Groups, cfg: TrainSpec) -> torch.optim.Optimizer:
    # Fused as AdamW is, for the same found_inf flag.
    return torch.optim.SGD(groups, lr=cfg.learning_rate, momentum=cfg.momentum, fused=True)


def _adamw_8bit(groups: Groups, cfg: TrainSpec) -> torch.optim.Optimizer:
    import bitsandbytes as bnb  # available: check_available ran first

    optimizer: torch.optim.Optimizer = bnb.optim.AdamW8bit(groups, lr=cfg.learning_rate)  # bitsandbytes: untyped
    return optimizer


OPTIMIZERS: dict[str, Callable[[Groups, TrainSpec], torch.optim.Optimizer]] = {
    "adamw": _adamw,
    "adamw_foreach": _adamw_foreach,
    "sgd": _sgd,
    "adamw_8bit": _adamw_8bit,
}


def check_available(cfg: TrainSpec, device: torch.device) -> None:
    """Refuse, before the model and data are set up, an optimizer this worker cannot build.

    Raises:
        KubetuneError: adamw_8bit without a CUDA GPU or without bitsandbytes; one line naming the fix.
    """
    if cfg.optimizer != "adamw_8bit":
        return
    if device.type != "cuda":
        raise KubetuneError(
            f"adamw_8bit (bitsandbytes' 8-bit AdamW) needs a CUDA GPU and this worker runs on {device.type}",
            field="training.optimizer",
            fix="use training.optimizer: adamw on CPU, or run on GPU nodes (resources.gpu)",
        )
    try:
        import bitsandbytes  # noqa: F401
    except ImportError:
        raise KubetuneError(
            "adamw_8bit needs bitsandbytes, which is not installed",
            field="training.optimizer",
            fix="pip install bitsandbytes (the CUDA trainer image has it), or use training.optimizer: adamw",
        ) from None


def param_groups(model: torch.nn.Module, weight_decay: float) -> Groups:
    """The trainable parameters in two groups, in the model's order: with ``weight_decay``, and without
    it (biases and norms: a 1-d tensor, or a name with "norm")."""
    decay: list[torch.nn.Parameter] = []
    no_decay: list[torch.nn.Parameter] = []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]


# ---- the schedule: one builder per training.lr_scheduler, after warmup steps of linear warmup ----
def _linear(optimizer: torch.optim.Optimizer, warmup: int, total: int, cfg: TrainSpec) -> LRScheduler:
    from transformers import get_linear_schedule_with_warmup

    schedule: LRScheduler = get_linear_schedule_with_warmup(optimizer, warmup, total)  # transformers: untyped
    return schedule


def _cosine(optimizer: torch.optim.Optimizer, warmup: int, total: int, cfg: TrainSpec) -> LRScheduler:
    from transformers import get_cosine_schedule_with_warmup

    schedule: LRScheduler = get_cosine_schedule_with_warmup(optimizer, warmup, total)  # transformers: untyped
    return schedule


def _constant(optimizer: torch.optim.Optimizer, warmup: int, total: int, cfg: TrainSpec) -> LRScheduler:
    from transformers import get_constant_schedule_with_warmup

    schedule: LRScheduler = get_constant_schedule_with_warmup(optimizer, warmup)  # transformers: untyped
    return schedule


def _wsd(optimizer: torch.optim.Optimizer, warmup: int, total: int, cfg: TrainSpec) -> LRScheduler:
    from transformers import get_wsd_schedule

    # bounded by what the warmup leaves: the two ratios' rounded steps may add up to one past the run
    decay = min(int(round(cfg.decay_ratio * total)), total - warmup)
    schedule: LRScheduler = get_wsd_schedule(
        optimizer, warmup, num_decay_steps=decay, num_training_steps=total
    )  # transformers: untyped
    return schedule


SCHEDULES: dict[str, Callable[[torch.optim.Optimizer, int, int, TrainSpec], LRScheduler]] = {
    "linear": _linear,
    "cosine": _cosine,
    "constant": _constant,
    "wsd": _wsd,
}


def build_optimizer(
    model: torch.nn.Module, cfg: TrainSpec, total_steps: int, device: torch.device
) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    """The optimizer of ``cfg.optimizer`` over ``model``'s trainable parameters (no weight decay on
    biases and norms) and the schedule of ``cfg.lr_scheduler`` over ``total_steps`` optimizer steps,
    the first ``round(warmup_ratio × total_steps)`` of them a linear warmup.

    Returns:
        (optimizer, scheduler).

    Raises:
        KubetuneError: the optimizer cannot be built on this worker (``check_available``).
    """
    check_available(cfg, device)
    optimizer = OPTIMIZERS[cfg.optimizer](param_groups(model, cfg.weight_decay), cfg)
    warmup = int(round(cfg.warmup_ratio * total_steps))
    return optimizer, SCHEDULES[cfg.lr_scheduler](optimizer, warmup, total_steps, cfg)
