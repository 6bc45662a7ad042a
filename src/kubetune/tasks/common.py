"""Small pieces the tasks share (attention kernel, loading): plain functions."""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from kubetune.errors import KubetuneError

log = logging.getLogger(__name__)


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
