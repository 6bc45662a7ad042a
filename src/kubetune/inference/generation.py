"""The generation engine every causal-LM path runs on (`kubetune predict`, `kubetune serve`): continuous
batching over a KV cache that is written in place.

- **Continuous (in-flight) batching.** Requests wait in a queue; at every step the engine admits as many as it
  has free slots and makes, in one forward, one token for every request in flight and the first token of each
  new one (its prompt packed into the same row: ``inference.step``), then retires the finished ones at once.
  A request joins the running batch at the next step and leaves it when it ends; nobody waits for the longest
  member of a batch. (A model that cannot run packed steps gets a prefill forward of the new prompts, then
  the decode forward.)
- **A KV cache written in place** (``SlotCache``): one preallocated slot per request in flight, each token's
  keys and values written at the request's own position; nothing is recomputed or copied per step. The
  requests in flight fill slots ``[0, n)``, so the attention reads a view; a finished request's slot takes
  the last one's (one copy when a request ends, none per step). Each row attends over its own positions only
  (a 4D mask), and its positions are its own (``position_ids``), so rows of any length share a step.
- **Shared prompts computed once.** Requests admitted together with the same prompt (a GRPO group, ``n``
  completions) are prefilled once; the others' slots get a copy of its cache.
- **Sampling per request**: greedy, or temperature and top-p, with a seed of its own (a seeded request draws
  from its own ``torch.Generator``, so its result does not depend on what else is in flight).
- **A prompt's log-probabilities** (OpenAI's ``echo``, what evaluation clients score) from its hidden states, a few
  positions' logits at a time (``scoring.score_rows``): a long prompt's logits never all exist.
- **Greedy steps without the head's full product** (``families.greedy``, a CPU with bf16 matrix hardware): where
  every request in a step is greedy and records no log-probabilities, a bf16 copy of the head screens the
  vocabulary and only the candidates' fp32 logits are computed; the token is still the fp32 argmax.

Why our own loop rather than transformers' ``ContinuousBatchingManager``: on the CPU the manager spent 32 s
setting up its paged cache for a 5-prompt batch of the tiny Llama (it sizes the cache from the device's
free memory), and its seeding is per manager, not per request. This loop is the model's own forward with
a cache object of ours (transformers' ``Cache`` protocol: ``update`` and ``get_seq_length``), so every
architecture whose attention goes through ``past_key_values.update`` and takes a 4D mask runs on it; the
Llama family runs packed steps through the attention interface, and a model with a family fast path (chosen by
architecture, ``families``: transformers' Llama as loaded for inference, its operations called directly) runs
them through it. The engine itself knows no family.
"""

from __future__ import annotations

import collections
import contextlib
import functools
import threading
from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from kubetune.inference.families import family_of
from kubetune.inference.families.greedy import GreedyHead
from kubetune.inference.kernels import large_linears, swapped_gemm
from kubetune.inference.sampling import draw, sample
from kubetune.inference.scoring import hidden_states, plain_head, record, score_rows
from kubetune.inference.step import SlotCache, layout, packed_forward, packs

__all__ = ["Engine", "Generation", "draw"]


@dataclass
class Generation:
    """One completion to make: its prompt's token ids and sampling, and (streaming) where each new token
    goes as it is made."""

    ids: list[int]
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    top_k: int = 0  # 0: no top-k cut
    # where its draws come from, shared with other requests when given (a GRPO step's generator: a function
    # of seed, step and rank); else its own seeded one, or the engine's
    generator: torch.Generator | None = None
    # log-probabilities (of the model's own distribution: its logits' log-softmax, before temperature and top-k/p):
    # ``logprobs``: each new token's and the ``logprobs`` most likely there (None: not recorded);
    # ``prompt_logprobs``: also each prompt token's after the first (OpenAI's ``echo`` with ``logprobs``)
    logprobs: int | None = None
    prompt_logprobs: bool = False
    on_token: Callable[[int], None] | None = None
    # set when its request is given up (timed out, client gone, its stop sequence made; from any thread), or by
    # ``Engine.generate``'s stop: stopped at the next token
    cancelled: threading.Event = field(default_factory=threading.Event)
    # filled by the engine
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"
    end_token: int | None = None  # the end-of-sequence token that ended it (not in ``tokens``)
    error: Exception | None = None  # what ended it in the engine's thread, where something failed
    # with ``logprobs``: per new token (ended by an end token: that one too, last), its log-probability and the
    # most likely (token, log-probability) pairs there; with ``prompt_logprobs``: the same for prompt tokens 2..n
    token_logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_token_logprobs: list[float] = field(default_factory=list)
    prompt_top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)


def _plain_greedy(g: Generation) -> bool:
    """Whether ``g``'s tokens are argmaxes and nothing else is asked of its logits."""
    return g.temperature <= 0 and g.logprobs is None and not g.prompt_logprobs


def _distinct(new: list[_Row]) -> tuple[dict[tuple, int], list[tuple]]:
    """The distinct prompts of ``new``, in order: prompt -> its index, and the prompts."""
    unique: dict[tuple, int] = {}
    for row in new:
        unique.setdefault(tuple(row.gen.ids), len(unique))
    return unique, list(unique)


@dataclass
class _Row:
    gen: Generation
    done: Callable[[Generation], None] | None
    length: int  # positions cached (the prompt and the tokens made so far, less the one not yet fed)
    next_token: int = -1
    rng: torch.Generator | None = None


class Engine:
    """A causal LM generating with continuous batching (see the module's docstring).

    ``generate(gens)`` runs a list to its end in the calling thread (`kubetune predict`); ``start()`` runs the
    loop in a thread of its own, fed by ``submit`` (`kubetune serve`). One of the two at a time."""

    def __init__(self, model, eos: set[int], slots: int = 16, context: int | None = None):
        self.model, self.eos, self.slots = model, eos, slots
        self.context = context or 1 << 30
        self.device = next(model.parameters()).device
        self.dtype = next(model.parameters()).dtype if next(model.parameters()).is_floating_point() else torch.float32
        self.on_step: Callable[[int], None] | None = None  # active requests in each decode step (metrics)
        self._cache: SlotCache | None = None
        self._rows: list[_Row] = []
        self._waiting: collections.deque[_Row] = collections.deque()
        self._cond = threading.Condition()
        self._thread: threading.Thread | None = None
        self._stopped = False
        self._default_rng = torch.Generator(device=self.device)
        self._default_rng.manual_seed(0)
        self._linears = large_linears(model)
        self._packs = packs(model)
        # a family's flat forward of a packed step, where one runs this model (``families``); None: ``model(...)``
        self._flat = family_of(model) if self._packs else None
        self._greedy_head = GreedyHead()  # a greedy step's tokens without the head's full fp32 product (CPU)

    # ------------------------------------------------------------------ the two ways in

    def generate(
        self,
        gens: list[Generation],
        lockstep: Callable[[bool], bool] | None = None,
        stop: Callable[[], bool] | None = None,
    ) -> None:
        """Make every generation of ``gens`` to its end (their ``tokens`` and ``finish_reason``), at most
        ``slots`` at a time, in the calling thread.

        Args:
            lockstep: a sharded model, whose every forward is collective: ``lockstep(busy)`` answers whether any
                rank is still busy (an all-reduce); this rank then makes as many forwards as the busiest,
                with one idle row once its own have ended. Every generation is admitted at once (one prefill
                on every rank), so ``slots`` grows to ``len(gens)``.
            stop: asked before every forward (after ``lockstep``, whose answer it must agree with on every rank);
                True gives every generation not yet ended up (its ``cancelled`` set) and returns at once.
        """
        if lockstep is not None:
            self.slots = max(self.slots, len(gens))
        with self._cond:
            self._waiting.extend(_Row(g, None, len(g.ids)) for g in gens)
        with torch.no_grad():
            while True:
                busy = bool(self._waiting or self._rows)
                if lockstep is not None:
                    if not lockstep(busy):
                        break
                elif not busy:
                    break
                if stop is not None and stop():
                    self._give_up()
                    break
                if not busy:  # lockstep: another rank is still generating
                    self._idle()
                    continue
                self._step(lockstep is not None)

    def start(self) -> None:
        """Run the loop in a thread of its own, taking what ``submit`` hands it."""
        self._thread = threading.Thread(target=self._loop, name="kubetune-engine", daemon=True)
        self._thread.start()

    def submit(self, g: Generation, done: Callable[[Generation], None]) -> None:
        """Queue ``g``; ``done(g)`` is called from the engine's thread when it has ended (or with the error that
        ended its step, set as ``g.error``)."""
        with self._cond:
            self._waiting.append(_Row(g, done, len(g.ids)))
            self._cond.notify()

    @property
    def waiting(self) -> int:
        """Requests submitted and not yet admitted."""
        return len(self._waiting)

    @property
    def running(self) -> int:
        """Requests in flight."""
        return len(self._rows)

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        if self._thread is not None:
            self._thread.join(timeout=10)

    def _loop(self) -> None:
        while True:
            with self._cond:
                while not self._waiting and not self._rows and not self._stopped:
                    self._cond.wait()
                if self._stopped:
                    return
            try:
                with torch.no_grad():
                    self._step()
            except Exception as e:  # noqa: BLE001 - every request in flight gets the step's error; the loop goes on
                for row in self._rows:
                    row.gen.error = e
                    self._finish(row)
                self._rows = []

    # ------------------------------------------------------------------ one step

    def _step(self, lockstep: bool = False) -> None:
        self._drop_cancelled()
        new = self._take_waiting()
        if self._packs:  # one forward: the requests in flight and the new prompts (``inference.step``)
            if new or self._rows:
                self._packed_step(new)
            return
        if new:
            self._admit(new)
        if self._rows:
            self._decode()
        elif lockstep and new:  # every row ended at its first token: the other ranks' decode forward
            self._idle()

    def _idle(self) -> None:
        """One forward of one row that nobody reads (a sharded model's other ranks are still generating)."""
        cache = self._ensure_cache(1)
        cache.lo, cache.hi, cache.width, cache.pos = 0, 1, 1, torch.zeros(1, dtype=torch.long, device=self.device)
        self.model(
            input_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device),
            attention_mask=self._mask(torch.ones((1, 1, 1, 1), dtype=torch.bool)),
            position_ids=torch.zeros((1, 1), dtype=torch.long, device=self.device),
            past_key_values=cache,
            use_cache=True,
        )
        cache.pos = None

    def _drop_cancelled(self) -> None:
        with self._cond:  # ``submit`` appends from the server's event loop while this runs
            gone = [r for r in self._waiting if r.gen.cancelled.is_set()]
            for row in gone:
                self._waiting.remove(row)
        for row in gone:
            self._finish(row)
        self._retire([k for k, r in enumerate(self._rows) if r.gen.cancelled.is_set()])

    def _give_up(self) -> None:
        """Every generation not yet ended, waiting or in flight, given up (``cancelled``) and retired."""
        with self._cond:
            rows = [*self._waiting, *self._rows]
        for row in rows:
            row.gen.cancelled.set()
        self._drop_cancelled()

    def _take_waiting(self) -> list[_Row]:
        """The waiting requests that the free slots take now, oldest first."""
        room = self.slots - len(self._rows)
        if room <= 0 or not self._waiting:
            return []
        with self._cond:
            new = [self._waiting.popleft() for _ in range(min(room, len(self._waiting)))]
        for row in [r for r in new if not r.gen.ids]:  # nothing to continue: its own error, not its step's
            row.gen.error = ValueError("a prompt of no tokens: a completion needs at least one")
            new.remove(row)
            self._finish(row)
        return new

    def _packed_step(self, new: list[_Row]) -> None:
        """One forward of one packed row: each request in flight's next token, then each new distinct prompt
        (``inference.step``); then each one's token: the next, or a new request's first."""
        rows, n = self._rows, len(self._rows)
        unique, prompts = _distinct(new)
        need = max([len(r.gen.ids) + r.gen.max_tokens for r in new + rows] + [r.length + 1 for r in rows])
        cache = self._ensure_cache(min(need, self.context))
        step = layout([r.length for r in rows], [len(p) for p in prompts], self.dtype, self.device)
        scored = {unique[tuple(r.gen.ids)] for r in new if r.gen.prompt_logprobs}
        # a scored prompt's log-probabilities: its hidden states projected a few positions at a time (``score_rows``),
        # unless the model's logits may be more than its head's projection: then its every position's logits
        plain = plain_head(self.model) if scored and not self._flat else None
        whole = scored if not self._flat and plain is None else set()
        # logits kept: each request in flight's, and each prompt's last position (every position of a ``whole`` one)
        keep, first, starts, offset = list(range(n)), [], [], n
        for u, p in enumerate(prompts):
            first.append(len(keep))
            starts.append(offset)
            keep.extend(range(offset, offset + len(p)) if u in whole else [offset + len(p) - 1])
            offset += len(p)
        cache.pos, cache.width = None, 0
        ids = torch.tensor([[r.next_token for r in rows] + [t for p in prompts for t in p]], device=self.device)
        kept = torch.tensor(keep, device=self.device) if prompts else None  # None: every position
        # every row greedy, recording nothing: the forward stops before the head, for the greedy head
        greedy = all(_plain_greedy(r.gen) for r in rows + new)
        flat = self._flat
        screened = flat is not None and greedy and self._greedy_head.fits(flat.head(self.model))
        logits, hidden, head = self._forward(step, ids, cache, kept, screened, bool(scored) and not whole, plain)
        if scored:
            if whole:
                self._score_prompts(new, unique, lambda u, k: logits[first[u] : first[u] + k], None, logits.shape[-1])
            else:
                self._score_prompts(new, unique, lambda u, k: hidden[starts[u] : starts[u] + k], head, logits.shape[-1])
        last = [first[u] + (len(p) - 1 if u in whole else 0) for u, p in enumerate(prompts)]
        for row in rows:
            row.length += 1
        ordered = self._place(new, unique, len(prompts), n)
        picks = list(range(n)) + [last[unique[tuple(r.gen.ids)]] for r in ordered]
        order = None if picks == list(range(logits.shape[0])) else torch.tensor(picks, device=self.device)
        if self.on_step is not None:
            self.on_step(len(self._rows))
        tokens = None
        if screened and flat is not None:  # ``logits`` is the final norm's output at the kept positions
            rows_out = logits if order is None else logits.index_select(0, order)
            tokens = self._greedy_head.tokens(flat.head(self.model), rows_out)
            if tokens is None:  # the screen did not apply: the full head, on the rows ``model(...)`` computes it for
                logits = flat.project(self.model, logits)
        if tokens is None:
            if order is not None:  # scored prompts or shared ones (else the rows are in order)
                # only then: the CPU's swapped GEMM leaves the logits transposed in memory, where picking 16 rows of
                # a 32k vocabulary took 0.4 ms (index_select) to 0.8 ms (aten::index)
                logits = logits.index_select(0, order)
            logits = logits.float()
            tokens = self._sample(logits, self._rows)
            record(logits, [r.gen for r in self._rows], tokens)
        self._take(self._rows, tokens, 0)

    def _forward(self, step, ids: torch.Tensor, cache, kept, screened: bool, hidden: bool, plain) -> tuple:
        """A packed step's forward: (the logits at ``kept``, or with ``screened`` the final norm's output there;
        with ``hidden``, every position's last hidden states and the head that projects them, else None, None).
        ``plain``: the decoder and head of a model that does not run flat (``scoring.plain_head``)."""
        if self._flat is not None:  # the family's flat forward (transformers' Llama: its operations called directly)
            with packed_forward(self.model, step):
                at, project = (None, False) if hidden else (kept, not screened)
                out = self._flat.forward(self.model, ids, step.where[None], cache, at, head=project)
            if not hidden:
                return out[0], None, None
            head = functools.partial(self._flat.project, self.model)
            return head(out[:, kept])[0], out[0], head  # the kept positions' logits as the flat forward makes them
        unread = torch.zeros((1, 1, 1, 1), dtype=self.dtype, device=self.device)  # a 4D mask: see step_attention
        capture: contextlib.AbstractContextManager[list[torch.Tensor]]
        capture = hidden_states(plain[0]) if hidden else contextlib.nullcontext([])
        with packed_forward(self.model, step), swapped_gemm(self.device, self._linears), capture as states:
            out = self.model(
                input_ids=ids,
                attention_mask=unread,
                position_ids=step.where[None],
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=0 if kept is None else kept,
            )
        return (out.logits[0], states[0][0], plain[1]) if hidden else (out.logits[0], None, None)

    def _score_prompts(self, new: list[_Row], unique: dict[tuple, int], rows: Callable, head, vocab: int) -> None:
        """The prompt log-probabilities (echo) of the new requests that ask for them (``scoring.score_rows``):
        ``rows(u, k)``, the first ``k`` positions' hidden states (``head`` projects them) or logits (``head`` None)
        of distinct prompt ``u``."""
        for row in new:
            g = row.gen
            if g.prompt_logprobs:
                at = rows(unique[tuple(g.ids)], len(g.ids) - 1)
                g.prompt_token_logprobs, g.prompt_top_logprobs = score_rows(at, head, g.ids[1:], g.logprobs or 0, vocab)

    def _place(self, new: list[_Row], unique: dict[tuple, int], prompts: int, lo: int) -> list[_Row]:
        """The new requests into the rows from ``lo``: each distinct prompt's first request in the slot where its
        prompt was prefilled (``lo + u``), then the other requests of a shared prompt, each given a copy of its
        prompt's cache. Returns them in slot order."""
        firsts: dict[int, _Row] = {}
        copies: list[_Row] = []
        for row in new:
            u = unique[tuple(row.gen.ids)]
            if u in firsts:
                copies.append(row)
            else:
                firsts[u] = row
        ordered = [firsts[u] for u in range(prompts)] + copies
        for k, row in enumerate(copies):
            self._slots().move(lo + unique[tuple(row.gen.ids)], lo + prompts + k)
        for row in ordered:
            row.rng = self._rng(row.gen)
        self._rows.extend(ordered)
        return ordered

    def _admit(self, new: list[_Row]) -> None:
        """Prefill the new requests' prompts in one forward of right-padded rows (each distinct prompt once),
        then pick each one's first token (a model that cannot run packed steps)."""
        need = max(len(r.gen.ids) + r.gen.max_tokens for r in new + self._rows)
        cache = self._ensure_cache(min(need, self.context))
        unique, prompts = _distinct(new)
        lo = len(self._rows)
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), 0, dtype=torch.long)
        lengths = torch.tensor([len(p) for p in prompts])
        for k, p in enumerate(prompts):
            ids[k, : len(p)] = torch.tensor(p)
        col = torch.arange(width)
        allowed = (col[None, None, :] <= col[None, :, None]) & (col[None, None, :] < lengths[:, None, None])
        cache.lo, cache.hi, cache.width, cache.pos = lo, lo + len(prompts), width, None
        # the logits of each prompt's last position only (a vocabulary-wide row per prompt, not per position);
        # a scored prompt's log-probabilities are its hidden states projected a few positions at a time
        # (``score_rows``), unless the model's logits may be more than its head's projection: then every position's
        scored = any(r.gen.prompt_logprobs for r in new)
        plain = plain_head(self.model) if scored else None
        keep = torch.arange(width) if scored and plain is None else torch.unique(lengths - 1)
        capture: contextlib.AbstractContextManager[list[torch.Tensor]]
        capture = hidden_states(plain[0]) if plain else contextlib.nullcontext([])
        with capture as states:
            out = self.model(
                input_ids=ids.to(self.device),
                attention_mask=self._mask(allowed[:, None]),
                position_ids=col[None].expand(len(prompts), width).to(self.device),
                past_key_values=cache,
                use_cache=True,
                logits_to_keep=keep.to(self.device),
            )
        where = torch.searchsorted(keep, lengths - 1).to(self.device)
        last = out.logits[torch.arange(len(prompts), device=self.device), where].float()
        if scored:
            rows = states[0] if plain else out.logits
            self._score_prompts(
                new, unique, lambda u, k: rows[u, :k], plain[1] if plain else None, out.logits.shape[-1]
            )
        ordered = self._place(new, unique, len(prompts), lo)
        logit_rows = [unique[tuple(r.gen.ids)] for r in ordered]
        tokens = self._sample(last[logit_rows], ordered)
        record(last[logit_rows], [r.gen for r in ordered], tokens)
        self._take(ordered, tokens, lo)

    def _decode(self) -> None:
        """One token for every request in flight, in one forward."""
        cache = self._slots()
        n = len(self._rows)
        pos = torch.tensor([r.length for r in self._rows])
        width = int(pos.max()) + 1
        if width > cache.capacity:
            cache.grow(min(max(width, 2 * cache.capacity), self.context))
        cache.lo, cache.hi, cache.width, cache.pos = 0, n, width, pos.to(self.device)
        allowed = torch.arange(width)[None, :] <= pos[:, None]
        with swapped_gemm(self.device, self._linears):
            out = self.model(
                input_ids=torch.tensor([[r.next_token] for r in self._rows], device=self.device),
                attention_mask=self._mask(allowed[:, None, None, :]),
                position_ids=pos[:, None].to(self.device),
                past_key_values=cache,
                use_cache=True,
            )
        cache.pos = None
        for row in self._rows:
            row.length += 1
        if self.on_step is not None:
            self.on_step(n)
        logits = out.logits[:, -1].float()
        tokens = self._sample(logits, self._rows)
        record(logits, [r.gen for r in self._rows], tokens)
        self._take(self._rows, tokens, 0)

    def _take(self, rows: list[_Row], tokens: list[int], lo: int) -> None:
        """Each row's new token: kept (and streamed), or its end; the ended rows retired."""
        ended = []
        for k, (row, token) in enumerate(zip(rows, tokens)):
            g = row.gen
            if g.cancelled.is_set() or g.max_tokens == 0:  # 0: the prompt scored (echo), nothing made
                ended.append(lo + k)
                continue
            if token in self.eos:
                g.finish_reason, g.end_token = "stop", token
                ended.append(lo + k)
                continue
            g.tokens.append(token)
            row.next_token = token
            if g.on_token is not None:
                g.on_token(token)
            if len(g.tokens) >= g.max_tokens or row.length >= self.context:
                ended.append(lo + k)
        self._retire(ended)

    def _retire(self, indices: list[int]) -> None:
        """Finish the rows at ``indices``; the last rows move into their slots, so the rows stay ``[0, n)``."""
        for k in sorted(indices, reverse=True):
            row = self._rows[k]
            last = len(self._rows) - 1
            if k != last:
                self._slots().move(last, k)
                self._rows[k] = self._rows[last]
            self._rows.pop()
            self._finish(row)

    def _finish(self, row: _Row) -> None:
        if row.done is not None:
            row.done(row.gen)

    # ------------------------------------------------------------------ pieces

    def _slots(self) -> SlotCache:
        """The cache, made by the first step (``_ensure_cache``) before any row is in flight."""
        assert self._cache is not None, "no cache before the first step"
        return self._cache

    def _ensure_cache(self, capacity: int) -> SlotCache:
        if self._cache is None:
            self._cache = SlotCache(self.slots, max(capacity, 16))
        elif capacity > self._cache.capacity:
            self._cache.grow(min(max(capacity, 2 * self._cache.capacity), self.context))
        return self._cache

    def _mask(self, allowed: torch.Tensor) -> torch.Tensor:
        """A boolean ``allowed`` [rows, 1, queries, keys] as the additive mask the attention takes."""
        return torch.where(allowed, 0.0, torch.finfo(self.dtype).min).to(device=self.device, dtype=self.dtype)

    def _rng(self, g: Generation) -> torch.Generator | None:
        if g.temperature <= 0:
            return None
        if g.generator is not None:
            return g.generator
        if g.seed is None:
            return self._default_rng
        rng = torch.Generator(device=self.device)
        rng.manual_seed(g.seed)
        return rng

    def _sample(self, logits: torch.Tensor, rows: list[_Row]) -> list[int]:
        """Each row's next token from its logits (``sampling.sample``, with each row's generator)."""
        return sample(logits, [r.gen for r in rows], [r.rng for r in rows])
