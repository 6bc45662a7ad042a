"""A prompt's log-probabilities (``score_rows``, OpenAI's ``echo``): the log-softmax of a chunk of positions at a
time, projected from the decoder's last hidden states (``hidden_states``) where the logits are the head's
projection alone (``plain_head``: ``PLAIN_HEAD`` model types), else read from the logits: a long prompt's logits
never all exist (or, read from the model's logits, never with their log-softmax beside them). ``pick`` reads a token's
log-probability and the most likely ones from the same values; ``record``, each new token's."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Sequence
from typing import Any, Protocol

import torch

# Model types whose logits are their output projection of the decoder's last hidden states and nothing after it
# (Gemma 2, Cohere and Granite scale or soft-cap them), so that a prompt's log-probabilities may project those
# states a few positions at a time (``plain_head``); the families of the tasks' chunked head too
# (``tasks.common``: a public name, imported from here).
PLAIN_HEAD = frozenset({"llama", "mistral", "mixtral", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe", "phi3"})


def plain_head(model: Any) -> tuple[torch.nn.Module, torch.nn.Module] | None:
    """For a ``PLAIN_HEAD`` causal LM (under a PEFT wrapper too): its decoder, whose output's first element is
    the last hidden states, and its output projection, whose output alone is the logits; else None."""
    inner = model.get_base_model() if hasattr(model, "get_base_model") else model
    if getattr(getattr(inner, "config", None), "model_type", None) not in PLAIN_HEAD:
        return None
    decoder, head = inner.get_decoder(), inner.get_output_embeddings()
    return None if decoder is None or head is None else (decoder, head)


@contextlib.contextmanager
def hidden_states(decoder: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
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


class Recorded(Protocol):
    """A request whose new tokens' log-probabilities may be recorded (``generation.Generation``)."""

    logprobs: int | None
    max_tokens: int
    token_logprobs: list[float]
    top_logprobs: list[list[tuple[int, float]]]


def record(logits: torch.Tensor, rows: Sequence[Recorded], tokens: list[int]) -> None:
    """Each new token's log-probability (and the most likely there) for the rows that ask for them (not those
    of ``max_tokens`` 0, which make nothing): row ``k``'s logits ``logits[k]``, its new token ``tokens[k]``."""
    asking = [k for k, g in enumerate(rows) if g.logprobs is not None and g.max_tokens > 0]
    if not asking:
        return
    gens = [rows[k] for k in asking]
    chosen, tops = pick(
        torch.log_softmax(logits[asking], -1), [tokens[k] for k in asking], max(g.logprobs or 0 for g in gens)
    )
    for g, lp, top in zip(gens, chosen, tops):
        g.token_logprobs.append(lp)
        g.top_logprobs.append(top[: g.logprobs])
