"""The Llama family's fast path: transformers' Llama, as loaded for inference (``runs``), run in a packed step as
its operations called directly (``forward``), its linear layers as the swapped GEMM computes them
(``kernels.swapped_linear``). Registered for the ``llama`` model type (``families``); every other model (and
a Llama with hooks, in training, or of another class) runs the generic path, ``model(...)``."""

from __future__ import annotations

from typing import Any

import torch

from kubetune.inference.families.base import Family
from kubetune.inference.kernels import swapped_linear
from kubetune.inference.step import SlotCache, packs, step_attention


def runs(model: Any) -> bool:
    """Whether ``model`` is transformers' Llama itself, as loaded for inference (``forward`` runs it): the
    exact classes, in eval mode, with no hooks on any module (FSDP, PEFT or a user's would be bypassed)."""
    from transformers.activations import ACT2CLS
    from transformers.models.llama import modeling_llama as ml

    if type(model) is not ml.LlamaForCausalLM or model.training or not packs(model):
        return False
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return False
    kinds: set[object] = {
        ml.LlamaDecoderLayer,
        ml.LlamaAttention,
        ml.LlamaMLP,
        ml.LlamaRMSNorm,
        ml.LlamaModel,
        ml.LlamaForCausalLM,
    }
    kinds |= {ml.LlamaRotaryEmbedding, torch.nn.Linear, torch.nn.Embedding, torch.nn.ModuleList, torch.nn.SiLU}
    kinds.add(ACT2CLS["silu"])
    for m in model.modules():
        if type(m) not in kinds or m._forward_hooks or m._forward_pre_hooks:
            return False
    return getattr(model.config, "pretraining_tp", 1) == 1 and model.config.hidden_act == "silu"


def forward(
    model: Any,
    input_ids: torch.Tensor,
    position_ids: torch.Tensor,
    cache: SlotCache,
    keep: torch.Tensor | None,
    head: bool = True,
) -> torch.Tensor:
    """The logits (``keep``: of those positions; ``head`` False: the final norm's output there, for the caller's
    head) of a packed step of transformers' Llama (``runs``): the
    operations of its modules' forwards, in their order, called directly. Why not ``model(...)``: its per-call
    machinery (output capture, mask preparation, keyword plumbing, a module call per linear layer and norm)
    cost a twentieth to a tenth of a 16-row step of the 28M Llama on a 2-core Xeon (benchmarks/README.md,
    "Serving"); the logits are bitwise the same (tested). Its linear layers compute as ``swapped_linear``, as
    under ``swapped_gemm``."""
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    linear = swapped_linear

    def norm(layer, x):  # LlamaRMSNorm.forward
        h = x.to(torch.float32)
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + layer.variance_epsilon)
        return layer.weight * h.to(x.dtype)

    base = model.model
    x = base.embed_tokens(input_ids)
    cos, sin = base.rotary_emb(x, position_ids)
    tokens = input_ids.shape[1]
    for layer in base.layers[: base.config.num_hidden_layers]:
        a, mlp = layer.self_attn, layer.mlp
        h = norm(layer.input_layernorm, x)
        shape = (1, tokens, -1, a.head_dim)
        q = linear(a.q_proj, h).view(shape).transpose(1, 2)
        k = linear(a.k_proj, h).view(shape).transpose(1, 2)
        v = linear(a.v_proj, h).view(shape).transpose(1, 2)
        q, k = apply_rotary_pos_emb(q, k, cos, sin)
        k, v = cache.update(k, v, a.layer_idx)
        o, _ = step_attention(a, q, k, v, None, scaling=a.scaling)
        x = x + linear(a.o_proj, o.reshape(1, tokens, -1))
        h = norm(layer.post_attention_layernorm, x)
        x = x + linear(mlp.down_proj, mlp.act_fn(linear(mlp.gate_proj, h)) * linear(mlp.up_proj, h))
    x = norm(base.norm, x)
    x = x if keep is None else x[:, keep]
    return linear(model.lm_head, x) if head else x


def project(model: Any, hidden: torch.Tensor) -> torch.Tensor:
    """The logits of ``hidden`` (``forward``'s output with ``head`` False), as ``forward`` would have made them."""
    return swapped_linear(model.lm_head, hidden)


def head(model: Any) -> torch.nn.Linear:
    """The output projection ``forward`` leaves out with ``head`` False (what the greedy head screens)."""
    return model.lm_head


FAMILY = Family(name="llama", model_types=frozenset({"llama"}), runs=runs, forward=forward, project=project, head=head)
