"""Generation with a causal LM export: ``generate`` (what `kubetune predict` runs for a task whose export
is a causal LM, one prompt at a time) and ``Generator``, the engine `kubetune serve` batches requests into
(the OpenAI protocol's routes, ``server.openai_routes``), loaded and checked as ``generate`` loads them so
that a request answers what ``predict`` answers; ``is_causal_lm`` tells such a model by its config."""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kubetune.errors import KubetuneError
from kubetune.inference import model as M
from kubetune.inference.model import check_vocab, context_length, describe, load_model, load_tokenizer, short


def is_causal_lm(config: dict) -> bool:
    """Does the model of ``config`` (a checked config.json) generate: an architecture ``*ForCausalLM``
    or one transformers maps as a causal LM (GPT2LMHeadModel generates too)?"""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    archs = config.get("architectures") or []
    return any(a.endswith("ForCausalLM") or a in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.values() for a in archs)


def generate(
    uri: str,
    prompts: list[str],
    max_new_tokens: int = 64,
    temperature: float = 0.0,
    chat: bool | None = None,
    seed: int = 0,
    warn: Callable[[str], None] | None = None,
) -> list[dict]:
    """Continue each prompt with a causal LM; returns ``[{prompt, completion}]`` in input order.

    A prompt longer than the model's context less ``max_new_tokens`` keeps its last tokens (the
    end of a prompt is what the continuation follows); ``warn`` gets one line saying so.

    Args:
        chat: render each prompt as a user turn with the tokenizer's chat template (the template the
            model was trained with, saved beside it); default: when the tokenizer has one.
        temperature: 0 = greedy decoding; above 0 samples (seeded by ``seed``).
        warn: called with one line when prompts were cut; default: the ``kubetune.inference.causal`` logger.

    Raises:
        KubetuneError: the model is not a causal LM or cannot be loaded, ``--chat`` without a chat
            template, a non-finite temperature, or ``max_new_tokens`` that leaves no room for a prompt.
    """
    import torch
    from transformers import AutoModelForCausalLM

    if not math.isfinite(temperature) or temperature < 0:
        raise KubetuneError(
            f"{temperature} is not a finite number >= 0", field="--temperature", fix="pass e.g. 0 (greedy) or 0.7"
        )
    path = M.model_path(uri)
    M.expect(path, is_causal_lm, "causal LM")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = load_tokenizer(path)
    model = load_model(AutoModelForCausalLM, path)
    check_vocab(model, tokenizer, path)
    model = model.to(device).eval()
    use_chat = bool(getattr(tokenizer, "chat_template", None)) if chat is None else chat
    if use_chat and not getattr(tokenizer, "chat_template", None):
        raise KubetuneError(
            f"the tokenizer in {short(str(path))} has no chat template",
            field="--chat",
            fix="drop --chat to complete the raw prompt",
        )
    context = context_length(model.config, tokenizer)
    if context is not None and max_new_tokens >= context:
        raise KubetuneError(
            f"{max_new_tokens:,} new tokens leave no room for a prompt in the model's {context}-token context",
            field="--max-new-tokens",
            fix=f"pass at most {context - 1}",
        )
    budget = None if context is None else context - max_new_tokens

    render = functools.partial(render_prompt, tokenizer, use_chat, path)
    results, cut = [], []
    for number, prompt in enumerate(prompts, 1):
        ids, kept, total = fit(tokenizer, render, prompt, budget)
        if kept is not None:
            cut.append((number, kept, total))
        enc = torch.tensor([ids], device=device)
        torch.manual_seed(seed)
        sampling = {"do_sample": True, "temperature": temperature} if temperature > 0 else {"do_sample": False}
        with torch.no_grad():
            out = model.generate(
                input_ids=enc,
                attention_mask=torch.ones_like(enc),
                max_new_tokens=max_new_tokens,
                pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
                **sampling,
            )
        completion = tokenizer.decode(out[0, enc.shape[1] :], skip_special_tokens=True)
        results.append({"prompt": prompt, "completion": completion})
    if cut:
        (warn or _log_warning)(cut_line(cut, context, max_new_tokens))
    return results


def render_prompt(tokenizer, use_chat: bool, path: Path, text: str) -> list[int]:
    """A prompt's token ids: as a user turn in the chat template (which holds BOS), or as it is."""
    if use_chat:
        from jinja2 import TemplateError

        try:
            text = tokenizer.apply_chat_template(
                [{"role": "user", "content": text}], tokenize=False, add_generation_prompt=True
            )
        except TemplateError as e:
            raise KubetuneError(
                f"the chat template in {short(str(path))} fails: {describe(e)}",
                field="--chat",
                fix="fix chat_template in tokenizer_config.json, or pass --no-chat",
            ) from None
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]


def cut_line(cut: list[tuple[int, int, int]], context: int | None, max_new_tokens: int) -> str:
    """One line about the prompts cut to fit the context: (prompt number, tokens kept, tokens it had)."""
    if len(cut) == 1:
        which = f"prompt {cut[0][0]} has {cut[0][2]:,} tokens"
    else:
        which = (
            f"{len(cut)} prompts ({', '.join(str(c[0]) for c in cut[:5])}{', ...' if len(cut) > 5 else ''}) "
            f"have up to {max(c[2] for c in cut):,} tokens"
        )
    return (
        f"{which}, more than the model's {context}-token context leaves beside --max-new-tokens {max_new_tokens}; "
        f"kept the last {min(c[1] for c in cut):,} tokens of the text"
    )


def fit(
    tokenizer, render: Callable[[str], list[int]], prompt: str, budget: int | None
) -> tuple[list[int], int | None, int]:
    """Token ids of ``prompt`` as rendered, at most ``budget`` long: a longer prompt keeps its end.

    Returns:
        The ids; the number of the prompt's own tokens kept when it was cut, else None; its length in tokens.
    """
    if budget is None:
        ids = render(prompt)
        return ids, None, len(ids)
    content = tokenizer(prompt, add_special_tokens=False)["input_ids"]  # tokenized once, however long
    overhead = len(render(""))
    if len(content) + overhead <= budget:
        ids = render(prompt)
        if len(ids) <= budget:
            return ids, None, len(content)
    keep = budget - overhead
    if keep <= 0:
        raise KubetuneError(
            f"the prompt template alone takes {overhead} of the {budget} tokens left by --max-new-tokens",
            field="--max-new-tokens",
            fix="pass a smaller --max-new-tokens",
        )
    for _ in range(4):  # decoding and encoding again may merge tokens differently at the cut
        ids = render(tokenizer.decode(content[-keep:]))
        if len(ids) <= budget:
            return ids, keep, len(content)
        keep -= len(ids) - budget
        if keep <= 0:
            break
    return ids[-budget:], max(keep, 0), len(content)


def _log_warning(line: str) -> None:
    import logging

    logging.getLogger(__name__).warning(line)


@dataclass
class Generation:
    """One completion to make: its prompt's token ids and sampling, and (streaming) where each new
    token goes as it is made."""

    ids: list[int]
    max_tokens: int
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None
    on_token: Callable[[int], None] | None = None
    # set from the event loop when its request is given up (timed out, client gone): stopped at the next token
    cancelled: threading.Event = field(default_factory=threading.Event)
    # filled by the engine
    tokens: list[int] = field(default_factory=list)
    finish_reason: str = "length"

    def key(self) -> tuple:
        """Requests that may share a batch: the same sampling (a seeded one runs alone)."""
        if self.seed is not None and self.temperature > 0:
            return ("seeded", id(self))
        return ("greedy",) if self.temperature == 0 else ("sample", self.temperature, self.top_p)


class _Streamer:
    """transformers' streamer protocol for a whole batch: ``put`` gets each step's new token of every
    row (its first call, the prompts, is skipped); each row's tokens go to its request until its end
    (its max_tokens, an end-of-sequence token, or its request given up). Called as a stopping criterion,
    it tells ``generate`` which rows have ended, so that a batch whose rows have all ended stops there."""

    def __init__(self, batch: list[Generation], eos: set[int]):
        self.batch, self.eos, self.first, self.done = batch, eos, True, [False] * len(batch)

    def put(self, value) -> None:
        if self.first:
            self.first = False
            return
        for k, token in enumerate(value.reshape(-1).tolist()):
            g = self.batch[k]
            if self.done[k] or g.cancelled.is_set():
                self.done[k] = True
                continue
            if token in self.eos:
                self.done[k], g.finish_reason = True, "stop"
                continue
            g.tokens.append(token)
            if g.on_token is not None:
                g.on_token(token)
            if len(g.tokens) >= g.max_tokens:
                self.done[k] = True

    def end(self) -> None:
        pass

    def __call__(self, input_ids, scores, **kwargs):
        import torch

        done = [d or g.cancelled.is_set() for d, g in zip(self.done, self.batch)]
        return torch.tensor(done, dtype=torch.bool, device=input_ids.device)


class Generator:
    """A causal LM export (its ``model/``, or a model directory), on the GPU when there is one."""

    def __init__(self, path: Path, adapter: Path | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        M.expect(path, is_causal_lm, "causal LM")
        self.path = path
        self.tokenizer = load_tokenizer(adapter or path)
        model = load_model(AutoModelForCausalLM, path)
        if adapter is not None:  # the base plus the LoRA adapter, unmerged
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter)
        M.check_vocab(model, self.tokenizer, path)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = model.to(self.device).eval()
        self.context = context_length(
            model.config if adapter is None else model.get_base_model().config, self.tokenizer
        )
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))
        self.pad = self.tokenizer.pad_token_id or self.tokenizer.eos_token_id  # as predict's call
        eos = self.model.generation_config.eos_token_id
        self.eos = {self.tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
        self._lock = threading.Lock()

    def encode(self, prompt: str) -> list[int]:
        """A raw prompt's token ids, as ``predict --no-chat`` makes them."""
        return render_prompt(self.tokenizer, False, self.path, prompt)

    def encode_chat(self, messages: list[dict]) -> list[int]:
        """A conversation's token ids with the chat template and its generation prompt (``predict --chat``).

        Raises:
            KubetuneError: the model has no chat template, or it fails on these messages.
        """
        from jinja2 import TemplateError

        if not self.chat:
            raise KubetuneError(
                "this model's tokenizer has no chat template", field="messages", fix="use /v1/completions"
            )
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except TemplateError as e:
            raise KubetuneError(f"the chat template fails on these messages: {e}", field="messages") from None
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    @staticmethod
    def cancel(g: Generation) -> None:
        """A request given up (timed out, client gone): its generation stops at the next token."""
        g.cancelled.set()

    @staticmethod
    def generated(batch: list[Generation]) -> int:
        """Tokens a finished batch made (for /metrics)."""
        return sum(len(g.tokens) for g in batch)

    def run(self, batch: list[Generation]) -> None:
        """Generate every request of ``batch`` (one sampling, see ``Generation.key``) in one call, left-padded;
        a batch of one is exactly ``predict``'s call."""
        import torch
        from transformers import StoppingCriteriaList

        width = max(len(g.ids) for g in batch)
        ids = torch.full((len(batch), width), self.pad, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for k, g in enumerate(batch):
            ids[k, width - len(g.ids) :] = torch.tensor(g.ids)
            mask[k, width - len(g.ids) :] = 1
        first = batch[0]
        sampling = (
            {"do_sample": True, "temperature": first.temperature, "top_p": first.top_p}
            if first.temperature > 0
            else {"do_sample": False}
        )
        streamer = _Streamer(batch, self.eos)
        with self._lock, torch.no_grad():  # one generation at a time on the model
            if first.seed is not None and first.temperature > 0:  # a seeded sampling runs alone (Generation.key)
                torch.manual_seed(first.seed)
            self.model.generate(
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                max_new_tokens=max(g.max_tokens for g in batch),
                pad_token_id=self.pad,
                streamer=streamer,
                stopping_criteria=StoppingCriteriaList([streamer]),
                **sampling,
            )
