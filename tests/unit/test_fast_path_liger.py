"""training.fast_path.liger on the CPU: Liger-Kernel's kernels need Triton and CUDA, so here the plain path must be
chosen, with the reason logged once; the kernels themselves are compared with the plain path on a GPU
(tests/gpu/test_fast_path_liger.py)."""

from __future__ import annotations

import importlib.util
import logging

import pytest
import torch

from kubetune.tasks import fused


def _model() -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    return LlamaForCausalLM(config)


def test_cpu_and_flag_off_keep_the_plain_modules(caplog):
    model = _model()
    before = {name: type(m) for name, m in model.named_modules()}
    with caplog.at_level(logging.INFO, logger="kubetune.tasks.fused"):
        assert fused.patch(model, torch.device("cpu"), enabled=True) is False
        assert fused.patch(model, torch.device("cuda"), enabled=False) is False
    assert {name: type(m) for name, m in model.named_modules()} == before
    assert not caplog.records  # nothing to say: the CPU and a turned-off flag are not asked for it
    assert not fused.wants_fused_loss(model.get_output_embeddings())


@pytest.mark.skipif(importlib.util.find_spec("liger_kernel") is not None, reason="liger-kernel is installed here")
def test_cuda_without_liger_says_why_once(caplog):
    """On a GPU machine without liger-kernel the run goes on with the plain path and says so (one line)."""
    model = _model()
    with caplog.at_level(logging.INFO, logger="kubetune.tasks.fused"):
        assert fused.patch(model, torch.device("cuda"), enabled=True) is False
        assert fused.patch(model, torch.device("cuda"), enabled=True, quiet=True) is False
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 1 and "liger-kernel is not importable" in lines[0], lines
    assert not fused.wants_fused_loss(model.get_output_embeddings())


def test_the_fused_loss_serves_gradient_steps_only():
    """A marked head takes the fused loss only where gradients are taken: evaluation and a frozen reference keep the
    chunked loss (it also counts the right guesses)."""
    head = torch.nn.Linear(4, 8, bias=False)
    setattr(head, fused.FUSED_LOSS, True)
    assert fused.wants_fused_loss(head)
    with torch.no_grad():
        assert not fused.wants_fused_loss(head)
