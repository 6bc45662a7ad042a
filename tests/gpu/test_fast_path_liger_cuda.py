"""training.fast_path.liger on a CUDA GPU: Liger-Kernel's RMSNorm, SwiGLU, RoPE and fused linear cross-entropy
against the plain modules and the chunked loss, on the same packed micro-batch of the shipped tiny Llama (fp32
weights under bf16 autocast, as a full fine-tune runs on one GPU; and bf16 weights, as under FSDP's mixed precision).
Needs liger-kernel (`make gpu-wheels` carries it to the GPU machine)."""

from __future__ import annotations

import copy

import pytest
import torch
from conftest import ROOT

pytestmark = pytest.mark.gpu
TINY = ROOT / "src" / "kubetune" / "assets" / "tiny-llama"
CUDA = torch.device("cuda")


@pytest.fixture(autouse=True)
def cuda():
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible (torch.cuda.is_available() is False)")
    pytest.importorskip("liger_kernel", reason="liger-kernel is not installed (make gpu-wheels carries it)")


def _batch(vocab: int):
    from datasets import Dataset

    from kubetune.tasks.causal_lm.data import collate

    gen = torch.Generator().manual_seed(0)
    lengths = [int(n) for n in torch.randint(20, 200, (24,), generator=gen)]
    ids = [torch.randint(3, vocab, (n,), generator=gen).tolist() for n in lengths]
    labels = [[-100] * (n // 3) + seq[n // 3 :] for n, seq in zip(lengths, ids)]  # a prompt without loss
    ds = Dataset.from_dict({"input_ids": ids, "labels": labels})
    return collate(ds, torch.arange(len(ids)).numpy(), pad_id=0, packing=True).to(CUDA)


def _loss_and_grads(model, batch):
    from kubetune.tasks.logprobs import token_loss

    model.zero_grad(set_to_none=True)
    total, count, _ = token_loss(model, batch, torch.autocast("cuda", dtype=torch.bfloat16))
    (total / count).backward()
    grads = torch.cat([p.grad.float().flatten() for p in model.parameters() if p.grad is not None])
    return (total / count).item(), grads


@pytest.mark.parametrize("weights", [torch.float32, torch.bfloat16])
def test_liger_equals_the_plain_path(weights, monkeypatch):
    from transformers import AutoModelForCausalLM
    from transformers.models.llama import modeling_llama

    from kubetune.tasks import attention, fused

    # Liger also replaces modeling_llama's RoPE function and block classes for the whole process (a training
    # process's models all run on its GPU): put them back for the tests after this one.
    for attr in ("apply_rotary_pos_emb", "LlamaRMSNorm", "LlamaMLP"):
        monkeypatch.setattr(modeling_llama, attr, getattr(modeling_llama, attr))
    name = attention.register("sdpa")
    plain = AutoModelForCausalLM.from_pretrained(TINY, dtype=weights, attn_implementation=name).to(CUDA)
    plain.config.use_cache = False
    liger = copy.deepcopy(plain)
    batch = _batch(plain.config.vocab_size)
    loss_plain, grads_plain = _loss_and_grads(plain, batch)  # before the patch: the RoPE function is global
    assert fused.patch(liger, CUDA, enabled=True)
    assert type(liger.model.norm).__name__.startswith("Liger"), type(liger.model.norm)
    calls = []
    real = fused.linear_cross_entropy
    monkeypatch.setattr(fused, "linear_cross_entropy", lambda *a, **k: calls.append(1) or real(*a, **k))
    loss_liger, grads_liger = _loss_and_grads(liger, batch)
    cosine = torch.nn.functional.cosine_similarity(grads_plain, grads_liger, dim=0).item()
    print(f"liger {weights}: loss {loss_liger:.5f} vs plain {loss_plain:.5f}, gradient cosine {cosine:.6f}")
    assert calls, "the loss did not go through the fused linear cross-entropy"
    assert abs(loss_liger - loss_plain) <= 2e-2 * abs(loss_plain)  # bf16: 8 bits of mantissa, 2^-7 relative
    assert cosine >= 0.999
