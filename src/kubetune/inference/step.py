"""What one forward of the generation engine computes with: the KV cache of per-request slots, the packed step
that prefills new prompts inside the decode forward, and the swapped GEMM of a CPU step.

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

**The greedy head** (``GreedyHead``). The head is the largest matrix of a small LLM (58 % of the 28M Llama's
weights), and a CPU decode step mostly waits for weights to arrive from memory. For a step whose every request
is greedy, a bf16 copy of the head (half the bytes) ranks the vocabulary; a bound on its error leaves a few
candidates a row, whose fp32 logits decide.

**A prompt's log-probabilities** (``score_rows``, OpenAI's ``echo``): the log-softmax of a chunk of positions at a
time, projected from the decoder's last hidden states where the logits are the head's projection alone
(``plain_head``), else read from the logits: a long prompt's logits never all exist (or, read from the model's
logits, never with their log-softmax beside them).

The packed step needs a model whose every layer's attention goes through transformers' attention interface and
its cache's ``update`` with no sliding window or soft-capping (``packs``): the Llama family. Every other model
runs the engine's plain steps: a prefill forward of right-padded prompts with a 4D mask, then a decode forward.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import types
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

STEP_ATTENTION = "kubetune_step"
# Model types whose attention is transformers' attention interface over ``past_key_values.update``, per layer, and
# nothing else (``packs`` also checks that the config asks for no sliding window and no soft-capping).
PACKED_MODELS = frozenset({"llama", "mistral", "qwen2", "qwen3", "phi3", "granite"})


def packs(model) -> bool:
    """Whether the engine may run ``model`` in packed steps (see the module's docstring)."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "model_type", None) not in PACKED_MODELS:
        return False
    if any(getattr(config, k, None) for k in ("sliding_window", "attn_logit_softcapping", "final_logit_softcapping")):
        return False
    return _base_attention(getattr(config, "_attn_implementation", None) or "sdpa") in ("sdpa", "eager")


# Attention implementations registered as another one underneath (kubetune's packed training attention,
# ``tasks.attention``, over ``sdpa`` or ``eager``): name -> the one it runs for everything but a packed row.
WRAPPED: dict[str, str] = {}


def _base_attention(name: str) -> str:
    return WRAPPED.get(name, name)


def model_attention(module, name: str):
    """The attention function transformers runs for ``name`` in ``module``. ``eager`` is not in transformers'
    registry: each model file defines its own ``eager_attention_forward`` beside the attention module, which
    is what transformers itself calls for it."""
    import sys

    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if name == "eager":
        eager = getattr(sys.modules[type(module).__module__], "eager_attention_forward", None)
        if eager is not None:
            return eager
        name = "sdpa"  # a model file without its own eager function: the same result through SDPA
    return ALL_ATTENTION_FUNCTIONS[name]


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


def layout(pos: list[int], prompts: list[int], dtype, device) -> Packed:
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
def packed_forward(model, step: Packed):
    """Around a forward of a packed step: ``model`` runs ``step_attention`` (its config's attention named so for
    the forward, its own restored after); afterwards, every layer that wrote the cache must have attended
    through it (a model that does not is a bug in ``packs``, not a wrong answer)."""
    config = model.config
    own = config._attn_implementation
    step.attention = _base_attention(own or "sdpa")
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

    def update(self, k: torch.Tensor, v: torch.Tensor, layer_idx: int, *args, **kwargs):
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


def flat_llama(model) -> bool:
    """Whether ``model`` is transformers' Llama itself, as loaded for inference (``llama_forward`` runs it): the
    exact classes, in eval mode, with no hooks on any module (FSDP, PEFT or a user's would be bypassed)."""
    from transformers.activations import ACT2CLS
    from transformers.models.llama import modeling_llama as ml

    if type(model) is not ml.LlamaForCausalLM or model.training or not packs(model):
        return False
    if torch.nn.modules.module._global_forward_hooks or torch.nn.modules.module._global_forward_pre_hooks:
        return False
    kinds = {ml.LlamaDecoderLayer, ml.LlamaAttention, ml.LlamaMLP, ml.LlamaRMSNorm, ml.LlamaModel, ml.LlamaForCausalLM}
    kinds |= {ml.LlamaRotaryEmbedding, torch.nn.Linear, torch.nn.Embedding, torch.nn.ModuleList, torch.nn.SiLU}
    kinds.add(ACT2CLS["silu"])
    for m in model.modules():
        if type(m) not in kinds or m._forward_hooks or m._forward_pre_hooks:
            return False
    return getattr(model.config, "pretraining_tp", 1) == 1 and model.config.hidden_act == "silu"


def llama_forward(model, input_ids: torch.Tensor, position_ids: torch.Tensor, cache, keep, head: bool = True):
    """The logits (``keep``: of those positions; ``head`` False: the final norm's output there, for the caller's
    head) of a packed step of transformers' Llama (``flat_llama``): the
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


# Rows per forward where, on a CPU, MKL's fp32 GEMM of ``x @ W.T`` (what ``F.linear`` runs) is slow: from 10 to 48
# rows ``(W @ x.T).T`` — the same product, the operands swapped — made the 28M Llama's whole forward 1.1x (10-12
# rows) to 1.3x (15-16 rows) faster on a 2-core Xeon (AVX-512), and no faster or slower at 8 and at 64 rows
# (benchmarks/engine_step.py; benchmarks/README.md "Serving"). 16 is serve's default slot count, so a full decode
# step is there, and so is one with a prompt or two packed in. A fixed range, not a timing taken at start-up: the
# choice changes the result's last bits, and predict and serve must agree.
GEMM_ROWS = (10, 48)
GEMM_MIN_WEIGHT = 1 << 18  # elements: smaller weights cost too little to matter (the tiny test models' all do)


def large_linears(model) -> list[torch.nn.Linear]:
    """The linear layers whose product ``swapped_gemm`` may swap: fp32 weights of ``GEMM_MIN_WEIGHT`` elements
    and more (looked at again at each step: a weight may be sharded or cast since)."""
    return [m for m in model.modules() if type(m) is torch.nn.Linear and m.weight.numel() >= GEMM_MIN_WEIGHT]


def swapped_linear(layer: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """``layer(x)``, as ``(W @ x.T).T`` for a CPU fp32 weight of ``GEMM_MIN_WEIGHT`` elements and more on
    ``GEMM_ROWS`` rows (decided per call, by this call's own rows), else ``F.linear``."""
    w, rows = layer.weight, x.numel() // x.shape[-1]
    if (
        type(w) is not torch.nn.Parameter
        or w.device.type != "cpu"
        or w.dtype != torch.float32
        or w.numel() < GEMM_MIN_WEIGHT
        or not GEMM_ROWS[0] <= rows <= GEMM_ROWS[1]
    ):
        return torch.nn.functional.linear(x, w, layer.bias)
    out = torch.mm(w, x.reshape(rows, x.shape[-1]).t()).t()
    if layer.bias is not None:
        out = out + layer.bias
    return out.reshape(*x.shape[:-1], w.shape[0])


@contextlib.contextmanager
def swapped_gemm(device: torch.device, linears: list[torch.nn.Linear]):
    """For a forward on the CPU: ``linears`` compute as ``swapped_linear`` during it (their instances' ``forward``,
    removed after). Not a ``TorchFunctionMode``: a mode sends every torch call of the forward through Python,
    which cost about 1.5 ms of a 13 ms step."""
    if device.type != "cpu":
        yield
        return
    for m in linears:
        m.forward = types.MethodType(swapped_linear, m)
    try:
        yield
    finally:
        for m in linears:
            del m.forward


# Model types whose logits are their output projection of the decoder's last hidden states and nothing after it
# (Gemma 2, Cohere and Granite scale or soft-cap them), so that a prompt's log-probabilities may project those
# states a few positions at a time (``plain_head``); the families of the tasks' chunked head too.
PLAIN_HEAD = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3"})


def plain_head(model) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """For a ``PLAIN_HEAD`` causal LM (under a PEFT wrapper too): its decoder, whose output's first element is
    the last hidden states, and its output projection, whose output alone is the logits; else None."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(getattr(inner, "config", None), "model_type", None) not in PLAIN_HEAD:
        return None
    decoder, head = inner.get_decoder(), inner.get_output_embeddings()
    return None if decoder is None or head is None else (decoder, head)


@contextlib.contextmanager
def hidden_states(decoder: torch.nn.Module):
    """Inside the block, the last hidden states of each forward of ``decoder`` go into the list yielded."""
    states: list[torch.Tensor] = []
    handle = decoder.register_forward_hook(lambda module, args, out: states.append(out[0]))
    try:
        yield states
    finally:
        handle.remove()


def pick(scores: torch.Tensor, tokens: list[int], top: int) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """From log-probabilities ``scores`` [positions, vocabulary]: each position's token's, and its ``top`` most
    likely (token, log-probability) pairs (both read from the same values, so a greedy token's equals the top one)."""
    chosen = scores.gather(-1, torch.tensor(tokens, device=scores.device)[:, None])[:, 0].tolist()
    if top <= 0:
        return chosen, [[] for _ in tokens]
    values, ids = scores.topk(min(top, scores.shape[-1]), dim=-1)
    return chosen, [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]


# The most logits a prompt's log-probabilities (echo) compute at once: a 4,000-token prompt of a 128k vocabulary
# has 2 GB of them in fp32 (and as much again for their log-softmax), which a server answering evaluation clients
# (lm-eval's local-completions scores every prompt so) must not hold per request. 16M: 64 MB, 128 positions of a
# 128k vocabulary, 512 of a 32k one; a product of as many rows still reads the head's weight efficiently.
SCORE_ELEMENTS = 1 << 24


def score_rows(
    rows: torch.Tensor, head: Callable[[torch.Tensor], torch.Tensor] | None, tokens: list[int], top: int, vocab: int
) -> tuple[list[float], list[list[tuple[int, float]]]]:
    """``pick`` of the log-probabilities at ``rows``: hidden states that ``head`` projects to logits, or logits
    (``head`` None), ``SCORE_ELEMENTS // vocab`` positions at a time, so that their logits never all exist."""
    chosen: list[float] = []
    tops: list[list[tuple[int, float]]] = []
    size = max(1, SCORE_ELEMENTS // vocab)
    for lo in range(0, rows.shape[0], size):
        logits = rows[lo : lo + size] if head is None else head(rows[lo : lo + size])
        c, t = pick(torch.log_softmax(logits.float(), -1), tokens[lo : lo + size], top)
        chosen += c
        tops += t
    return chosen, tops


# The greedy head's screen (``GreedyHead``): a bound on |bf16 product - fp32 product| as a share of |x|·|w|:
# rounding x and w to bf16 (unit roundoff 2^-8 each), the bf16 output's rounding (2^-8), fp32 accumulation
# over the hidden size (under 2^-15 for 512) and the fp32 product's own accumulation; 2^-6 (4 x 2^-8) covers them
# with room for the threshold's own fp32 arithmetic.
SCREEN_BOUND = 2.0**-6
SCREEN_MAX = 64  # candidates per row, on average, beyond which the full head is cheaper


def bf16_matmul() -> bool:
    """Whether this CPU has bf16 matrix instructions (AVX512-BF16 or AMX), where oneDNN's bf16 product is fast.
    (``torch.ops.mkldnn._is_mkldnn_bf16_supported`` also answers yes on AVX-512 cores without them, where it
    converts; the greedy head is unmeasured there.)"""
    try:
        return bool(torch.cpu._is_avx512_bf16_supported() or torch.cpu._is_amx_tile_supported())
    except (AttributeError, RuntimeError):
        return False


class GreedyHead:
    """Greedy tokens from a linear head without its full fp32 product on the CPU: the head's largest matrix (a
    32k vocabulary by 512 is 58 % of the 28M Llama's weights) is what a decode step mostly waits for, read from
    memory at every step. A bf16 copy (half the bytes) screens the vocabulary: with ``a`` its product and ``B`` the
    bound on ``|a - z|`` (``SCREEN_BOUND`` x |x| x the largest row norm of the head), every token whose ``a`` is
    below ``max(a) - 2B`` is beaten by the top one, whatever the exact values; the others' fp32 products are
    computed (their weight rows gathered) and the largest wins, the first of equal ones, as ``argmax``. So the
    token is the argmax of fp32 logits: each is its row's dot product in fp32, as the full head's, though not
    bitwise the same sum (a near-tie may break the other way, as between the CPU's two GEMM forms). Why not
    transformers' or torch's: neither has an exact greedy head from a low-precision screen.

    ``tokens`` answers None (the caller runs the full head) where it does not apply: not a CPU fp32 bias-free
    head, a CPU without bf16 matrix hardware, a head below ``GEMM_MIN_WEIGHT`` elements, values not finite, or
    a flat distribution leaving more than ``SCREEN_MAX`` candidates a row on average. The bf16 copy (half the
    head's fp32 size, kept while the engine lives) is remade when the head's weight changes: its storage, its
    version (an in-place update, a training step between two generations) or a sample of its values (a write
    through ``.data``, which leaves the version as it was)."""

    def __init__(self, enabled: bool | None = None):
        self.enabled = bf16_matmul() if enabled is None else enabled
        self._key: tuple | None = None
        self._sample: torch.Tensor | None = None
        self._low: torch.Tensor | None = None
        self._norm = 0.0

    def fits(self, head) -> bool:
        """Whether ``tokens`` may screen ``head``: enabled, and a bias-free CPU fp32 linear layer of
        ``GEMM_MIN_WEIGHT`` elements and more."""
        w = getattr(head, "weight", None)
        return (
            self.enabled
            and type(head) is torch.nn.Linear
            and head.bias is None
            and type(w) is torch.nn.Parameter
            and w.device.type == "cpu"
            and w.dtype == torch.float32
            and w.numel() >= GEMM_MIN_WEIGHT
        )

    def tokens(self, head: torch.nn.Linear, hidden: torch.Tensor) -> list[int] | None:
        """The argmax token of each row of ``head(hidden)`` (``hidden``: [..., hidden size]), or None where the
        screen does not apply (see the class)."""
        if not self.fits(head):
            return None
        w = head.weight.detach()
        h = hidden.reshape(-1, hidden.shape[-1])
        found = self.candidates(w, h)
        if found is None:
            return None
        v, r = found
        z = (w[v] * h[r]).sum(-1)  # the candidates' fp32 logits
        best = torch.full((h.shape[0],), float("-inf")).scatter_reduce(0, r, z, "amax")
        at = z == best[r]
        tokens = torch.full((h.shape[0],), w.shape[0]).scatter_reduce(0, r[at], v[at], "amin").tolist()
        return None if w.shape[0] in tokens else tokens  # a row whose candidates' logits all overflowed to NaN

    def candidates(self, w: torch.Tensor, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The (token, row) pairs whose bf16 logit (of ``w`` [vocabulary, hidden] and ``h`` [rows, hidden]) is at
        least its row's largest less twice the bound: the tokens that may be the row's fp32 argmax. None: too
        many, or values not finite."""
        self._refresh(w)
        rows, vocabulary = h.shape[0], w.shape[0]
        # the bf16 product, [vocabulary, rows], seen as [groups, classes]: class c holds the tokens v = g x width + c
        # // rows of row c % rows. Why: torch's CPU reductions over a matrix's first dimension are fast only for wide
        # rows (the max of [32000, 16] took 0.3-0.5 ms; of the same values as [250, 2048], then [128, 16], 0.09; a
        # 32k vocabulary runs as [256, 2000], then [125, 16]) and the candidates are found from each class's
        # largest value (0.15 ms against 0.6 for a compare and ``nonzero`` of all)
        groups = self._groups(vocabulary)
        a = torch.mm(self._low, h.to(torch.bfloat16).t()).view(groups, -1)
        best_of_class = a.amax(0)
        top = best_of_class.view(-1, rows).amax(0).float()
        floor = top - 2 * SCREEN_BOUND * self._norm * torch.linalg.vector_norm(h, dim=1)
        if not bool(torch.isfinite(floor).all()):
            return None
        floors = floor.repeat(vocabulary // groups)  # each class's row's floor
        classes = (best_of_class >= floors).nonzero()[:, 0]
        g, k = (a[:, classes] >= floors[classes]).nonzero(as_tuple=True)
        if g.numel() > SCREEN_MAX * rows:
            return None
        flat = g * a.shape[1] + classes[k]
        return flat // rows, flat % rows

    def _refresh(self, w: torch.Tensor) -> None:
        """The bf16 copy and the largest row norm of ``w``, remade if ``w`` is not the weight they were made from."""
        try:
            version = w._version
        except RuntimeError:  # a tensor made under ``torch.inference_mode`` has no version counter
            version = None
        key = (w.data_ptr(), version, tuple(w.shape))
        flat = w.reshape(-1)
        sample = flat[:: max(1, flat.numel() // 4096)]  # about 4,096 values: a few microseconds to compare
        if key != self._key or not torch.equal(sample, self._sample):
            self._low, self._norm = w.to(torch.bfloat16), float(torch.linalg.vector_norm(w, dim=1).max())
            self._key, self._sample = key, sample.clone()

    @staticmethod
    @functools.cache
    def _groups(vocabulary: int) -> int:
        """The largest divisor of ``vocabulary`` up to 256 (256 for 32,000 and for 128,256; 128 for 151,936)."""
        return max(d for d in range(1, 257) if vocabulary % d == 0)
