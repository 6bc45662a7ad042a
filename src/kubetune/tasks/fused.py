"""Liger-Kernel's fused operations on a CUDA GPU (``training.fast_path.liger``): RMSNorm, SwiGLU and RoPE as one
Triton kernel each in the model's blocks, and the fused linear cross-entropy for a causal LM's loss, which
projects the hidden states onto the vocabulary a chunk at a time and computes the gradients in the same pass, so
neither the logits nor their gradient exist whole (at 32k tokens and a 128k vocabulary the logits alone are 8 GB
in bf16).

Why a library: these kernels are what Liger-Kernel is made for, and TRL's ``use_liger_kernel=True`` runs the same
ones, so the baseline and kubetune compare the step, not the kernels. It needs Triton and a CUDA device: the CPU,
and a GPU machine without liger-kernel installed, keep the plain modules and ``tasks.logprobs``' chunked loss
(a log line says which). The model is patched in place before LoRA or a strategy wraps it: LoRA's layers are
called by Liger's SwiGLU module as by transformers'.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

# The attribute on a model's output projection that says its loss may be the fused linear cross-entropy
# (set by ``patch``; read by ``tasks.logprobs`` where the projection's forward is replaced by the loss).
FUSED_LOSS = "_kubetune_fused_loss"


def patch(model: torch.nn.Module, device: torch.device, enabled: bool, quiet: bool = False) -> bool:
    """Liger's RMSNorm, SwiGLU and RoPE in ``model``'s blocks, and the fused loss marked on its output projection,
    where they apply: ``enabled`` (the spec's flag), a CUDA ``device``, liger-kernel importable and the model's
    family known to it. Returns whether it did; logs why not where the flag asked for it (``quiet``: no log, for
    the modules built without weights to size a run)."""
    say = (lambda *a: None) if quiet else log.info
    if not enabled or device.type != "cuda":
        return False
    try:
        from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN
    except ImportError as e:  # no liger-kernel (or no Triton) on this machine: the plain path, said once
        say("training.fast_path.liger: liger-kernel is not importable here (%s); the plain modules run", e)
        return False
    model_type = getattr(getattr(model, "config", None), "model_type", None)
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(str(model_type))
    if apply is None:
        say("training.fast_path.liger: Liger-Kernel has no kernels for %s models; the plain modules run", model_type)
        return False
    import inspect

    # The blocks' kernels only: the loss is kubetune's own head replacement (tasks.logprobs), which the fused
    # loss serves through ``linear_cross_entropy``; Liger's forward replacement would bypass it.
    wanted = {
        "rope": True,
        "rms_norm": True,
        "swiglu": True,
        "cross_entropy": False,
        "fused_linear_cross_entropy": False,
    }
    accepted = inspect.signature(apply).parameters
    apply(model=model, **{k: v for k, v in wanted.items() if k in accepted})
    inner: Any = model  # a transformers model: get_output_embeddings is not nn.Module's
    head = inner.get_output_embeddings() if hasattr(inner, "get_output_embeddings") else None
    if isinstance(head, torch.nn.Linear):
        setattr(head, FUSED_LOSS, True)
    say(
        "training.fast_path.liger: Liger-Kernel's RMSNorm, SwiGLU, RoPE and fused linear cross-entropy (%s)", model_type
    )
    return True


def wants_fused_loss(head: torch.nn.Module) -> bool:
    """Whether the loss projected by ``head`` is the fused linear cross-entropy: ``patch`` marked it, and gradients
    are being taken (evaluation and a frozen reference's scores keep the chunked loss, which also counts the right
    guesses)."""
    return bool(getattr(head, FUSED_LOSS, False)) and torch.is_grad_enabled()


def linear_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, ids: torch.Tensor, per_token: bool
) -> torch.Tensor:
    """The summed (``per_token``: each row's) cross-entropy of ``hidden`` (rows × hidden size) projected by
    ``weight`` (vocabulary × hidden size) against ``ids``, fused: Liger's kernel, in fp32 where it accumulates.

    Under autocast both operands are cast to its dtype here and autocast is off inside the kernel: Liger computes
    the gradients in its forward with in-place matrix products, which autocast would hand tensors of another
    dtype. The cast of an fp32 weight is an op autograd sees, so its fp32 gradient is still formed."""
    from liger_kernel.transformers import LigerFusedLinearCrossEntropyLoss

    dtype = hidden.dtype
    if torch.is_autocast_enabled(hidden.device.type):
        dtype = torch.get_autocast_dtype(hidden.device.type)
    loss: Any = LigerFusedLinearCrossEntropyLoss(reduction="none" if per_token else "sum", accum_dtype=torch.float32)
    with torch.autocast(hidden.device.type, enabled=False):
        out = loss(weight.to(dtype), hidden.to(dtype), ids)
    return out.float()
