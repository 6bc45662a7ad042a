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

The documents' layout is built on the host by the collate (``PackedLayout``, from the lengths it packs)
and reaches every layer, and the recomputation of a checkpointed one, as the model's keyword argument
``LAYOUT_KWARG`` (transformers passes its keyword arguments down to the attention function): with it the
attention makes no device->host sync (index selections only, no boolean ones). A row without one (a batch
built elsewhere) has its layout worked out from its position ids once per forward pass, as before.

On a CUDA device, with half-precision tensors (or autocast) and ``flash`` on (training.fast_path.flash_attention,
given to ``register``), a packed row runs torch's flash variable-length attention
(``torch.nn.attention.varlen.varlen_attn``) over the layout's cumulative lengths instead of the gather: one kernel
per layer, no padded copies. Its signature changed across torch versions (``_varlen`` adapts once); where it is
missing, the gather runs. Why not FlexAttention: on a CPU its document mask runs only compiled (inductor's C++
template, a compile per packed shape); uncompiled it falls back to materializing the full score matrix. The
gather is plain tensor ops on any device, and its results equal the dense-mask computation within float
rounding (tested).
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import inspect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kubetune.data import Carried
from kubetune.inference.attention import model_attention, wrap

ATTENTION = "kubetune_packed"
# The model's keyword argument that carries a packed row's host-built ``PackedLayout`` down to the attention.
LAYOUT_KWARG = "kubetune_layout"
# Where flash's variable-length kernel runs (its flash kernels are CUDA's); every other device gathers.
_FLASH_DEVICES = ("cuda",)
# The suffix of the names registered with flash attention off (training.fast_path.flash_attention: false).
_NO_FLASH = "_gather"
# Where a packed row's layout is kept on its ``position_ids`` tensor when it has no host-built one (``_layout``).
_LAYOUT = "_kubetune_layout"
# At most this many SDPA calls per layer: documents sorted by length, cut into groups of equal count.
GROUPS = 4

# True while a packed micro-batch runs through the model: the mask interface then builds no
# (length)² mask, which ``packed_attention`` would ignore anyway.
_PACKED = contextvars.ContextVar("kubetune_packed", default=False)


def register(fallback: str = "sdpa", flash: bool = True) -> str:
    """Register packed attention with transformers for this ``fallback`` (the attention every call
    that is not packed runs) and return its name, for ``from_pretrained(attn_implementation=...)``:
    ``ATTENTION`` over sdpa, ``ATTENTION_<fallback>`` over another, ``_gather`` appended where ``flash``
    is off (training.fast_path.flash_attention: packed rows on CUDA then gather as on a CPU). Idempotent;
    each setting has its own name, so no setting is shared between models."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    name = (ATTENTION if fallback == "sdpa" else f"{ATTENTION}_{fallback}") + ("" if flash else _NO_FLASH)
    wrap(name, fallback)  # the generation engine's packed step runs the fallback (``inference.attention``)
    AttentionInterface.register(name, functools.partial(_uncompiled(), fallback=fallback, flash=flash))
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


@dataclass
class PackedLayout(Carried):
    """A packed row's documents, built on the host from their lengths (``packed_layout``) and moved with the
    batch: what the attention needs without reading anything back from the device.

    ``groups``: per length group (documents sorted by length, ``GROUPS`` at most), the gather index
    (documents, padded length) into the row and its real slots as (document, slot) index pairs; ``back``:
    the permutation from the groups' real slots back to the row's order;
    ``cu_seqlens`` (int32, documents + 1) and ``max_length``: the documents' boundaries as flash's
    variable-length attention takes them. ``position_ids``: the row's position ids it was built for."""

    position_ids: torch.Tensor
    groups: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]
    back: torch.Tensor
    cu_seqlens: torch.Tensor
    max_length: int

    @property
    def length(self) -> int:
        """The row's length (no sync: a shape)."""
        return int(self.back.shape[0])

    @property
    def documents(self) -> int:
        """How many documents the row packs (no sync: a shape)."""
        return int(self.cu_seqlens.shape[0]) - 1


def packed_layout(lengths: Sequence[int], position_ids: torch.Tensor) -> PackedLayout:
    """The layout of a packed row of documents of these ``lengths`` (each ≥ 1), built on the host: what
    ``_layout`` works out on the device from the position ids, the same indices."""
    sizes = torch.tensor(list(lengths), dtype=torch.long)
    groups, back = _groups(sizes)
    cu = torch.zeros(len(sizes) + 1, dtype=torch.int32)
    cu[1:] = torch.cumsum(sizes, 0)
    return PackedLayout(position_ids, groups, back, cu, int(sizes.max()))


def _groups(lengths: torch.Tensor) -> tuple[list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]], torch.Tensor]:
    """Per length group the gather index and its real slots, and the permutation back
    (``PackedLayout``), from the documents' lengths (on the device: syncs; on the host: none that matter)."""
    starts = torch.cumsum(lengths, 0) - lengths
    order = torch.argsort(lengths, stable=True)
    groups, positions = [], []
    for part in order.tensor_split(min(GROUPS, len(order))):
        n = int(lengths[part].max())
        steps = torch.arange(n, device=lengths.device)
        valid = steps.unsqueeze(0) < lengths[part].unsqueeze(1)  # (docs, n)
        # padded slots repeat the document's last token: only ever seen by padded queries (causal)
        index = starts[part].unsqueeze(1) + torch.minimum(steps.unsqueeze(0), lengths[part].unsqueeze(1) - 1)
        doc, slot = valid.nonzero().unbind(1)  # the real slots, row-major as a boolean selection takes them
        groups.append((index, doc, slot))
        positions.append(index[doc, slot])
    # back to the row's order: every position appears exactly once across the groups
    return groups, torch.argsort(torch.cat(positions))


def _layout(position_ids: torch.Tensor | None, length: int) -> tuple[list, torch.Tensor] | None:
    """For a packed row without a host-built layout: its groups and permutation back (``PackedLayout``) worked
    out from its position ids; None when not packed.

    Every layer gets the same ``position_ids`` tensor (and so does the recomputation of a
    checkpointed layer), so the layout is worked out once per forward pass and kept on that tensor:
    its host syncs (the documents' count and lengths) happen once, not once per layer."""
    cached = getattr(position_ids, _LAYOUT, None)
    if cached is not None and cached[0] == length:
        return cached[1]
    lengths = documents(position_ids, length)
    if lengths is None:
        return None
    layout = _groups(lengths)
    setattr(position_ids, _LAYOUT, (length, layout))
    return layout


def layout_kwargs(model: torch.nn.Module, layout: Carried | None, position_ids: torch.Tensor | None) -> dict:
    """The keyword arguments that give a packed row's host-built ``layout`` to ``model`` (``LAYOUT_KWARG``):
    none where the model's attention is not kubetune's packed one (another's would not expect it), the model
    needs its mask (a sliding window: ``_mask``) or the layout was built for other position ids than the
    batch's own (a replaced input).

    With it goes an empty 4-D ``attention_mask``: transformers returns a 4-D mask as it is, instead of reading
    the position ids for packed documents first (``find_packed_sequence_indices``: a sync in every forward);
    ``packed_attention`` never reads it (the layout says where the documents are)."""
    config = getattr(model, "config", None)
    name = getattr(config, "_attn_implementation", None) or ""
    if (
        not isinstance(layout, PackedLayout)
        or layout.position_ids is not position_ids
        or not name.startswith(ATTENTION)
        or getattr(config, "sliding_window", None)
    ):
        return {}
    return {LAYOUT_KWARG: layout, "attention_mask": layout.position_ids.new_empty((1, 1, 0, 0), dtype=torch.bool)}


def packed_attention(
    module,
    query,
    key,
    value,
    attention_mask,
    dropout=0.0,
    scaling=None,
    fallback: str = "sdpa",
    flash: bool = True,
    **kwargs,
):
    """Attention of a packed row, document by document; every other call goes to the fallback.

    query: (1, heads, length, dim); key, value: (1, kv heads, length, dim). Returns (1, length, heads, dim)
    and no weights, as transformers' attention functions do. ``kwargs[LAYOUT_KWARG]``: the row's host-built
    ``PackedLayout`` (no sync), else the layout is read from ``kwargs["position_ids"]``."""
    host: PackedLayout | None = kwargs.pop(LAYOUT_KWARG, None)
    if host is not None and attention_mask is not None and attention_mask.numel() == 0:
        attention_mask = None  # ``layout_kwargs``' stand-in: no mask, as ``_mask`` gives a packed row
    layout = None
    plain = not any(kwargs.get(k) is not None for k in ("sliding_window", "softcap", "s_aux", "cache"))
    if plain and query.shape[0] == 1 and query.shape[2] == key.shape[2]:
        if host is None or host.length != query.shape[2]:
            layout = _layout(kwargs.get("position_ids"), query.shape[2])
        elif host.documents > 1:  # one document: the fallback's causal attention, as ``documents`` decides
            if flash and not (dropout and module.training):  # flash's varlen kernel has no dropout
                out = _varlen_attention(query, key, value, host, scaling)
                if out is not None:
                    return out, None
            layout = host.groups, host.back
    if layout is None:
        if _PACKED.get() and attention_mask is None and not plain:
            # Cannot happen for the models the mask interface skips; never attend across documents.
            raise RuntimeError("packed attention: this model's attention needs its mask; set data.packing: false")
        return model_attention(module, fallback)(
            module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs
        )
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads != heads:  # grouped-query attention: each kv head serves heads // kv_heads query heads
        key = key.repeat_interleave(heads // kv_heads, dim=1)  # an int count: expand and copy, no sync
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    groups, back = layout
    p = dropout if module.training else 0.0
    outputs = []
    for index, doc, slot in groups:
        q, k, v = (t[0][:, index].transpose(0, 1) for t in (query, key, value))  # (docs, heads, n, dim)
        o = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True, scale=scaling)
        # (real tokens, heads, dim): integer indices, not a boolean mask, which reads its count back from the device
        outputs.append(o.transpose(1, 2)[doc, slot])
    return torch.cat(outputs)[back].unsqueeze(0), None


@functools.cache
def _varlen() -> tuple[Callable[..., Any], dict[str, Any], bool, bool] | None:
    """torch's flash variable-length attention, adapted to its signature once: (the function, its causal
    argument, whether it takes ``enable_gqa``, whether it takes ``scale``); None where torch has none.
    torch 2.10 took ``is_causal``; later versions a ``window_size`` ((-1, 0) is causal), then also ``enable_gqa``."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    if "window_size" in params:
        causal: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return varlen_attn, causal, "enable_gqa" in params, "scale" in params


def _half_dtype(query: torch.Tensor) -> torch.dtype | None:
    """The half-precision dtype flash attention would run in: the tensors' own, or autocast's (it does not
    reach a custom op); None for fp32 outside autocast."""
    if query.dtype in (torch.bfloat16, torch.float16):
        return query.dtype
    if torch.is_autocast_enabled(query.device.type):
        dtype = torch.get_autocast_dtype(query.device.type)
        return dtype if dtype in (torch.bfloat16, torch.float16) else None
    return None


def _varlen_attention(query, key, value, layout: PackedLayout, scaling) -> torch.Tensor | None:
    """A packed row through flash's variable-length attention, (1, length, heads, dim); None where it cannot
    run (not CUDA, fp32, a head size flash does not take, no such function in this torch)."""
    found = _varlen()
    dtype = _half_dtype(query)
    dim = query.shape[-1]
    if found is None or query.device.type not in _FLASH_DEVICES or dtype is None or dim % 8 or dim > 256:
        return None
    fn, causal, gqa, takes_scale = found
    if scaling is not None and not takes_scale and scaling != dim**-0.5:
        return None
    heads, kv_heads = query.shape[1], key.shape[1]
    if kv_heads != heads and not gqa:
        key = key.repeat_interleave(heads // kv_heads, dim=1)
        value = value.repeat_interleave(heads // kv_heads, dim=1)
    # (1, heads, length, dim) -> (length, heads, dim), contiguous as the kernel reads it
    q, k, v = (t[0].transpose(0, 1).to(dtype).contiguous() for t in (query, key, value))
    extra = dict(causal)
    if gqa and kv_heads != heads:
        extra["enable_gqa"] = True
    if takes_scale:
        extra["scale"] = scaling
    cu, longest = layout.cu_seqlens, layout.max_length
    return fn(q, k, v, cu, cu, longest, longest, **extra).unsqueeze(0)
