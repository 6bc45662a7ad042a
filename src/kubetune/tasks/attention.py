"""Packed causal attention without a (length)² mask: each packed document attends only to itself.

A packed micro-batch is one row of several documents with position ids restarting at 0 for each.
transformers' own attention (``sdpa``, ``eager``) reads the documents from the position ids and
builds a dense causal mask of (row length)² that every layer applies: for 64 short examples packed
into 2,400 tokens the score matrices are 22x larger than the documents' own, almost all of it masked.

``packed_attention`` (registered with transformers' ``AttentionInterface`` as ``ATTENTION``) gathers
the row's documents into a batch of right-padded sequences and runs causal SDPA on that batch, so the
work is about the sum of the documents' squared lengths. A padded query position is never read back,
and a real query at position j sees keys 0..j of its own document only (causal), all real tokens, so
no mask is needed at all. Documents are grouped by length (``GROUPS``) so that a few long ones do not
pad every short one to their length. Everything else (padded batches in evaluation, generation with a
KV cache, models that pass a sliding window or soft-capping to their attention) goes to the attention
the model would use without kubetune (``sdpa``, or ``eager`` for bf16 on a CPU: ``common.attention_kwargs``).

Why not FlexAttention: on a CPU its document mask runs only compiled (inductor's C++ template, a
compile per packed shape); uncompiled it falls back to materializing the full score matrix. And why
not ``torch.nn.attention.varlen``: flash kernels, CUDA only. The gather below is plain tensor ops on
any device, and its results equal the dense-mask computation within float rounding (tested).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools

import torch
import torch.nn.functional as F

from kubetune.inference.attention import model_attention, wrap

ATTENTION = "kubetune_packed"
# Where a packed row's layout is kept on its ``position_ids`` tensor (``_layout``).
_LAYOUT = "_kubetune_layout"
# At most this many SDPA calls per layer: documents sorted by length, cut into groups of equal count.
GROUPS = 4

# True while a packed micro-batch runs through the model: the mask interface then builds no
# (length)² mask, which ``packed_attention`` would ignore anyway.
_PACKED = contextvars.ContextVar("kubetune_packed", default=False)


def register(fallback: str = "sdpa") -> str:
    """Register packed attention with transformers for this ``fallback`` (the attention every call
    that is not packed runs) and return its name, for ``from_pretrained(attn_implementation=...)``:
    ``ATTENTION`` over sdpa, ``ATTENTION_<fallback>`` over another. Idempotent; each fallback has its
    own name, so no setting is shared between models."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = ATTENTION if fallback == "sdpa" else f"{ATTENTION}_{fallback}"
    wrap(name, fallback)  # the generation engine's packed step runs the fallback (``inference.attention``)
    AttentionInterface.register(name, functools.partial(_uncompiled(), fallback=fallback))
    AttentionMaskInterface.register(name, functools.partial(_mask, fallback=fallback))
    return name


@functools.cache
def _uncompiled():
    """``packed_attention`` outside torch.compile (training.compile compiles each block around it): the
    layout's host syncs and per-row shapes would break the graph or recompile it for every packed row.
    Applied here, when a model is registered, not as a decorator: ``torch.compiler.disable`` imports
    torch._dynamo (1.1 s), which `kubetune run`'s own process, reading the data before any worker starts,
    never needs (benchmarks/README.md, "GRPO")."""
    return torch.compiler.disable(packed_attention)


@contextlib.contextmanager
def packed_call():
    """Around a forward pass of a packed micro-batch (one row, restarting position ids, no mask)."""
    token = _PACKED.set(True)
    try:
        yield
    finally:
        _PACKED.reset(token)


def _mask(*args, fallback: str = "sdpa", **kwargs):
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    config = kwargs.get("config")
    if _PACKED.get() and kwargs.get("attention_mask") is None and not getattr(config, "sliding_window", None):
        return None
    return ALL_MASK_ATTENTION_FUNCTIONS[fallback](*args, **kwargs)


def documents(position_ids: torch.Tensor | None, length: int) -> torch.Tensor | None:
    """The documents' lengths of a packed row (position ids restarting at 0), else None."""
    if position_ids is None or position_ids.dim() != 2 or position_ids.shape != (1, length):
        return None
    starts = torch.nonzero(position_ids[0] == 0).flatten()
    if len(starts) < 2 or starts[0].item() != 0:
        return None
    bounds = torch.cat([starts, starts.new_tensor([length])])
    return bounds.diff()


def _layout(position_ids: torch.Tensor | None, length: int):
    """For a packed row: per length group, the gather index (documents, padded length) and its
    mask of real slots, and the permutation back to the row's order; None when not packed.

    Every layer gets the same ``position_ids`` tensor (and so does the recomputation of a
    checkpointed layer), so the layout is worked out once per forward pass and kept on that tensor:
    its host syncs (the documents' count and lengths) happen once, not once per layer."""
    cached = getattr(position_ids, _LAYOUT, None)
    if cached is not None and cached[0] == length:
        return cached[1]
    lengths = documents(position_ids, length)
    if lengths is None:
        return None
    starts = torch.cumsum(lengths, 0) - lengths
    order = torch.argsort(lengths, stable=True)
    groups, positions = [], []
    for part in order.tensor_split(min(GROUPS, len(order))):
        n = int(lengths[part].max())
        steps = torch.arange(n, device=lengths.device)
        valid = steps.unsqueeze(0) < lengths[part].unsqueeze(1)  # (docs, n)
        # padded slots repeat the document's last token: only ever seen by padded queries (causal)
        index = starts[part].unsqueeze(1) + torch.minimum(steps.unsqueeze(0), lengths[part].unsqueeze(1) - 1)
        groups.append((index, valid))
        positions.append(index[valid])
    # back to the row's order: every position appears exactly once across the groups
    layout = (groups, torch.argsort(torch.cat(positions)))
    setattr(position_ids, _LAYOUT, (length, layout))
    return layout


def packed_attention(
    module, query, key, value, attention_mask, dropout=0.0, scaling=None, fallback: str = "sdpa", **kwargs
):
    """Attention of a packed row, document by document; every other call goes to the fallback.

    query: (1, heads, length, dim); key, value: (1, kv heads, length, dim). Returns (1, length, heads, dim)
    and no weights, as transformers' attention functions do."""
    layout = None
    plain = not any(kwargs.get(k) is not None for k in ("sliding_window", "softcap", "s_aux", "cache"))
    if plain and query.shape[0] == 1 and query.shape[2] == key.shape[2]:
        layout = _layout(kwargs.get("position_ids"), query.shape[2])
    if layout is None:
        if _PACKED.get() and attention_mask is None and not plain:
            # Cannot happen for the models the mask interface skips; never attend across documents.
            raise RuntimeError("packed attention: this model's attention needs its mask; set data.packing: false")
        return model_attention(module, fallback)(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads != heads:  # grouped-query attention: each kv head serves heads // kv_heads query heads
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    groups, back = layout
    p = dropout if module.training else 0.0
    outputs = []
    for index, valid in groups:
        q, k, v = (t[0][:, index].transpose(0, 1) for t in (query, key, value))  # (docs, heads, n, dim)
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=scaling)
        outputs.append(o.transpose(1, 2)[valid])  # (real tokens, heads, dim)
    return torch.cat(outputs)[back].unsqueeze(0), None
