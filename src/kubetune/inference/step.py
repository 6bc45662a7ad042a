"""What one forward of the generation engine computes with: the KV cache of per-request slots (``SlotCache``) and
the packed step that prefills new prompts inside the decode forward.

**The packed step.** A step is one forward of one row of tokens: one token per request in flight (its next
position) followed by every new prompt's tokens (positions from 0). Every weight is read once for all of them:
on a CPU a forward is mostly reading the weights, and a 12-token prefill alone costs about as much as a 16-row
decode step (28M Llama, 2-core Xeon: 11.0 and 11.3 ms), while the two packed in one forward of 28 rows take 14.0
ms (benchmarks/engine_step.py). The linear layers see the row as it is; only the attention needs to know
which slot each token belongs to, so a packed step runs the model with ``step_attention`` as its attention
implementation (``packed_forward``): it writes every token's keys and values into its slot at its position,
then runs the model's own attention (``sdpa`` or ``eager``, unchanged) twice — once for the requests in flight
(one query each, over their slot's positions) and once for the new prompts (right-padded, causal). A padded
query position is never read back, and a real one only sees its own slot's positions up to its own.

The packed step needs a model whose every layer's attention goes through transformers' attention interface and
its cache's ``update`` with no sliding window or soft-capping (``packs``): the Llama family and its kin. Every
other model runs the engine's plain steps: a prefill forward of right-padded prompts with a 4D mask, then a
decode forward. Nothing here knows a model family's code: a family's own forward of a packed step (a flat one,
``families``) attends through ``step_attention`` and writes through ``SlotCache`` as ``model(...)`` does.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from kubetune.inference.attention import base_attention, model_attention

STEP_ATTENTION = "kubetune_step"
# Model types whose attention is transformers' attention interface over ``past_key_values.update``, per layer, and
# nothing else (``packs`` also checks that the config asks for no sliding window and no soft-capping).
PACKED_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "granite"})


def packs(model: Any) -> bool:
    """Whether the engine may run ``model`` in packed steps (see the module's docstring)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in PACKED_MODELS:
        return False
    if any(getattr(config, k, None) for k in ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping")):
        return False
    return base_attention(getattr(config, "_attn_implementation", None) or "sdpa") in ("sdpa", "eager")


@dataclass
class Packed:
    """One packed step's layout: ``n`` requests in flight (slots ``[0, n)``, one token each, reading ``width``
    positions), then the new prompts (slots ``n + j``), right-padded to ``longest`` by ``gather``
    (``[prompts, longest]`` indices into the row) where ``valid``. ``slot`` and ``where`` place every token of the
    row in the cache; ``decode_mask`` and ``prompt_mask`` are additive attention masks."""

    n: int
    width: int
    prompts: int
    longest: int
    gather: torch.Tensor
    valid: torch.Tensor
    slot: torch.Tensor
    where: torch.Tensor
    decode_mask: torch.Tensor | None
    prompt_mask: torch.Tensor | None
    attention: str = "sdpa"  # the model's own attention, run for each group
    updates: int = 0  # cache writes and attention calls made in the forward (they must agree)
    calls: int = 0


_STEP: contextvars.ContextVar[Packed | None] = contextvars.ContextVar("kubetune_step", default=None)


def layout(pos: list[int], prompts: list[int], dtype: torch.dtype, device: torch.device) -> Packed:
    """The packed step of requests in flight at positions ``pos`` and new prompts of lengths ``prompts``."""
    n, longest = len(pos), max(prompts, default=0)
    position = torch.tensor(pos, dtype=torch.long)
    steps = torch.arange(longest)
    lengths = torch.tensor(prompts, dtype=torch.long)
    starts = n + torch.cumsum(lengths, 0) - lengths
    valid = steps[None, :] < lengths[:, None]
    # padded positions repeat the prompt's last token: only padded queries (never read back) see them
    gather = starts[:, None] + torch.minimum(steps[None, :], (lengths - 1).clamp(min=0)[:, None])
    slot = torch.cat([torch.arange(n), torch.arange(n, n + len(prompts)).repeat_interleave(lengths)])
    where = torch.cat([position, steps[None, :].expand(len(prompts), longest)[valid]])
    floor = torch.finfo(dtype).min
    width = int(position.max()) + 1 if n else 0
    decode_mask = prompt_mask = None
    if n:
        decode_mask = torch.where(torch.arange(width)[None, :] <= position[:, None], 0.0, floor)[:, None, None]
        decode_mask = decode_mask.to(device=device, dtype=dtype)
    if prompts:
        prompt_mask = torch.where(steps[None, :] <= steps[:, None], 0.0, floor)[None, None]
        prompt_mask = prompt_mask.to(device=device, dtype=dtype)
    return Packed(
        n, width, len(prompts), longest, gather.to(device), valid.to(device),
        slot.to(device), where.to(device), decode_mask, prompt_mask,
    )  # fmt: skip


def step_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    """The attention of a packed step (``_STEP``): ``key`` and ``value`` are the layer's whole cache
    ``[slots, kv heads, capacity, dim]`` (``SlotCache.update``). Returns ``(1, tokens, heads, dim)`` and no
    weights, as transformers' attention functions do."""
    step = _STEP.get()
    if step is None:
        raise RuntimeError("kubetune_step attention runs only inside the generation engine's packed step")
    step.calls += 1
    attention = model_attention(module, step.attention)
    kwargs.pop("position_ids", None)
    q, out = query[0].transpose(0, 1), []  # (tokens, heads, dim)
    if step.n:
        k, v = key[: step.n, :, : step.width], value[: step.n, :, : step.width]
        if step.attention == "sdpa" and q.shape[1] % k.shape[1] == 0 and not kwargs.get("softcap"):
            # what transformers' sdpa runs for one query per row (``pack_gqa``: each kv head's query heads as its
            # queries), called here directly: the same values, without its per-call checks and copies
            qd = q[: step.n].reshape(step.n, k.shape[1], q.shape[1] // k.shape[1], q.shape[2])
            if qd.stride(-1) != 1:
                # the swapped GEMM's output is transposed in memory, and so are the rotary embedding's results of
                # it: with a strided last dimension the CPU's SDPA falls back to its math path, 0.2 ms a layer
                # where its flash kernel takes 0.05 (16 rows; engine 5 % faster on a 2-core Xeon). A contiguous
                # output from the swapped GEMM itself was slower: every product pays the copy, not this one query
                qd = qd.contiguous()
            o = F.scaled_dot_product_attention(qd, k, v, attn_mask=step.decode_mask, scale=scaling)
            out.append(o.reshape(step.n, q.shape[1], q.shape[2]))
        else:
            o, _ = attention(module, q[: step.n, :, None], k, v, step.decode_mask, scaling=scaling, **kwargs)
            out.append(o[:, 0])  # (n, heads, dim)
    if step.prompts:
        end = step.n + step.prompts
        k, v = key[step.n : end, :, : step.longest], value[step.n : end, :, : step.longest]
        qp = q[step.gather].transpose(1, 2)  # (prompts, heads, longest, dim)
        o, _ = attention(module, qp, k, v, step.prompt_mask, scaling=scaling, **kwargs)
        out.append(o[step.valid])  # (prompt tokens, heads, dim)
    return torch.cat(out)[None], None


@functools.cache
def _registered() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(STEP_ATTENTION, step_attention)
    return STEP_ATTENTION


@contextlib.contextmanager
def packed_forward(model: Any, step: Packed) -> Iterator[None]:
    """Around a forward of a packed step: ``model`` runs ``step_attention`` (its config's attention named so for
    the forward, its own restored after); afterwards, every layer that wrote the cache must have attended
    through it (a model that does not is a bug in ``packs``, not a wrong answer)."""
    config = model.config
    own = config._attn_implementation
    step.attention = base_attention(own or "sdpa")
    token = _STEP.set(step)
    config._attn_implementation = _registered()
    try:
        yield
    finally:
        config._attn_implementation = own
        _STEP.reset(token)
    if step.calls != step.updates or not step.calls:
        raise RuntimeError(
            f"generation engine: {type(model).__name__} attended {step.calls} time(s) for {step.updates} cache "
            "write(s) in a packed step; its model type cannot run packed"
        )


class SlotCache:
    """transformers' cache protocol over preallocated per-request slots: layer ``i``'s keys and values are
    ``[slots, kv heads, capacity, head dim]``, allocated at the first write (shapes and dtype from the model).

    In a packed step (``_STEP`` set) every token of the row is written at its slot and position and the whole
    layer is returned (``step_attention`` reads its slots). Otherwise the engine says, before each forward, which
    slots it computes (``lo:hi``), how many positions the attention reads (``width``) and, for a step of one token
    per row, each row's position (``pos``)."""

    def __init__(self, slots: int, capacity: int):
        self.slots, self.capacity = slots, capacity
        self.keys: list[torch.Tensor] = []
        self.values: list[torch.Tensor] = []
        self.lo = self.hi = self.width = 0
        self.pos: torch.Tensor | None = None

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.width

    def update(
        self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args: Any, **kwargs: Any
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if layer_idx == len(self.keys):
            shape = (self.slots, k.shape[1], self.capacity, k.shape[3])
            self.keys.append(torch.zeros(shape, dtype=k.dtype, device=k.device))
            self.values.append(torch.zeros(shape, dtype=v.dtype, device=v.device))
        keys, values, lo, hi = self.keys[layer_idx], self.values[layer_idx], self.lo, self.hi
        step = _STEP.get()
        if step is not None:  # a packed row: each token at its slot and position
            step.updates += 1
            keys[step.slot, :, step.where] = k[0].transpose(0, 1)
            values[step.slot, :, step.where] = v[0].transpose(0, 1)
            return keys, values
        if self.pos is not None:  # one token per row, each at its own position
            rows = torch.arange(lo, hi, device=k.device)
            keys[rows, :, self.pos] = k[:, :, 0]
            values[rows, :, self.pos] = v[:, :, 0]
        else:  # a prefill: the prompts from position 0
            keys[lo:hi, :, : k.shape[2]] = k
            values[lo:hi, :, : v.shape[2]] = v
        return keys[lo:hi, :, : self.width], values[lo:hi, :, : self.width]

    def grow(self, capacity: int) -> None:
        """Room for ``capacity`` positions per slot (one copy of what is cached)."""
        for store in (self.keys, self.values):
            for i, t in enumerate(store):
                bigger = torch.zeros((*t.shape[:2], capacity, t.shape[3]), dtype=t.dtype, device=t.device)
                bigger[:, :, : t.shape[2]] = t
                store[i] = bigger
        self.capacity = capacity

    def move(self, src: int, dst: int) -> None:
        """Slot ``src``'s cache into slot ``dst`` (a finished request's slot taken by the last one, or a shared
        prompt's cache given to its copies)."""
        for store in (self.keys, self.values):
            for t in store:
                t[dst] = t[src]
