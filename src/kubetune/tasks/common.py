"""Small pieces the tasks share (precision, attention kernel, loading, the optimizer): plain functions."""

from __future__ import annotations

import logging
import random
from pathlib import Path

import numpy as np
import torch

from kubetune.config import TrainSpec
from kubetune.errors import KubetuneError

log = logging.getLogger(__name__)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def resolve_precision(precision: str, device: torch.device) -> torch.dtype:
    """Map training.precision to an autocast dtype (float32 = no autocast)."""
    if precision == "auto":
        if device.type == "cuda" and torch.cuda.is_bf16_supported():
            return torch.bfloat16
        if device.type == "cpu" and cpu_has_bf16():
            return (
                torch.bfloat16
            )  # AMX / AVX512-BF16: a MiniLM training step 2.2× faster than fp32 (benchmarks/README.md)
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


def attention_kwargs(device: torch.device, dtype: torch.dtype) -> dict:
    """from_pretrained arguments for the attention kernel. bf16 on a CPU: eager attention, whose
    backward is plain matmuls on the bf16 units; a MiniLM training step (dropout on) is 9% faster
    than with SDPA's CPU kernels (benchmarks/README.md). Everywhere else: the default (SDPA)."""
    return {"attn_implementation": "eager"} if device.type == "cpu" and dtype == torch.bfloat16 else {}


def _quiet_transformers() -> None:
    import transformers

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()


def load_tokenizer(model_dir: Path):
    from transformers import AutoTokenizer

    _quiet_transformers()
    try:
        return AutoTokenizer.from_pretrained(model_dir)
    except (OSError, ValueError) as e:
        raise KubetuneError(
            f"no usable tokenizer in {model_dir}: {str(e).splitlines()[0]}",
            field="model.uri",
            fix="point it at a directory saved with save_pretrained (config + tokenizer files)",
        ) from None


# from_pretrained arguments that go to the model class; the rest go to its config.
_MODEL_KWARGS = ("dtype", "attn_implementation")


def load_pretrained(auto_cls, model_dir: Path, where: torch.device | None = None, **kwargs):
    """The pretrained model; with ``where`` on the meta device, the same modules without weights
    (built from the config: no file is read beyond it, no memory is taken)."""
    _quiet_transformers()
    try:
        if where is not None and where.type == "meta":
            from transformers import AutoConfig

            model_kwargs = {k: kwargs.pop(k) for k in _MODEL_KWARGS if k in kwargs}
            config = AutoConfig.from_pretrained(model_dir, **kwargs)
            with torch.device("meta"):
                return auto_cls.from_config(config, **model_kwargs)
        return auto_cls.from_pretrained(model_dir, **kwargs)
    except (OSError, ValueError) as e:
        raise KubetuneError(
            f"cannot load a model from {model_dir}: {str(e).splitlines()[0]}",
            field="model.uri",
            fix="point it at a Hugging Face model directory or hf://ORG/NAME",
        ) from None


def build_optimizer(model: torch.nn.Module, cfg: TrainSpec, total_steps: int, device: torch.device):
    """AdamW (no decay on biases and norms) with a linear schedule and warmup."""
    from transformers import get_linear_schedule_with_warmup

    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (no_decay if p.ndim < 2 or "norm" in name.lower() else decay).append(p)
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # Fused: one kernel over all parameters, on the CPU too (5× faster than the per-tensor loop there).
    optimizer = torch.optim.AdamW(groups, lr=cfg.learning_rate, fused=True)
    warmup = int(round(cfg.warmup_ratio * total_steps))
    scheduler = get_linear_schedule_with_warmup(optimizer, warmup, total_steps)
    return optimizer, scheduler
