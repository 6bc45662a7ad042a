"""Generation with a causal LM export: ``generate`` (what `kubetune predict` runs for a task whose export
is a causal LM) and ``Generator``, what `kubetune serve` serves (the OpenAI protocol's routes,
``server.openai_routes``), both on the one generation engine (``generation.Engine``: continuous batching),
loaded and checked alike so that a request answers what ``predict`` answers; ``is_causal_lm`` tells such a
model by its config."""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from pathlib import Path
from typing import Any

from kubetune.errors import KubetuneError
from kubetune.inference import model as M
from kubetune.inference.generation import Engine, Generation
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
    checked: bool = False,
) -> list[dict]:
    """Continue each prompt with a causal LM; returns ``[{prompt, completion}]`` in input order.

    A prompt longer than the model's context less ``max_new_tokens`` keeps its last tokens (the
    end of a prompt is what the continuation follows); ``warn`` gets one line saying so.

    Args:
        chat: render each prompt as a user turn with the tokenizer's chat template (the template the
            model was trained with, saved beside it); default: when the tokenizer has one.
        temperature: 0 = greedy decoding; above 0 samples (seeded by ``seed``).
        warn: called with one line when prompts were cut; default: the ``kubetune.inference.causal`` logger.
        checked: ``uri`` is a local model directory its caller checked and found a causal LM (`kubetune predict`,
            through ``tasks.for_model``): not checked again, a command checks its model once.

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
    path = Path(uri) if checked else M.locate(uri)
    if not checked:
        M.expect(path, is_causal_lm, "causal LM")  # the check (``model_path``'s), once
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
    gens, cut = [], []
    for number, prompt in enumerate(prompts, 1):
        ids, kept, total = fit(tokenizer, render, prompt, budget)
        if not ids:
            raise KubetuneError(
                f"prompt {number} is {prompt!r}, which has no tokens (this tokenizer adds none of its own)",
                field="prompt",
                fix="give it some text",
            )
        if kept is not None:
            cut.append((number, kept, total))
        # each prompt seeded alike, as one `predict` call per prompt would be
        gens.append(Generation(ids, max_new_tokens, temperature, seed=seed))
    Engine(model, eos_ids(model, tokenizer), context=context).generate(gens)
    results = [
        {"prompt": prompt, "completion": tokenizer.decode(g.tokens, skip_special_tokens=True)}
        for prompt, g in zip(prompts, gens)
    ]
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


def load_causal_lm(path: Path, adapter: Path | None = None) -> tuple[Any, Any]:
    """The one loader of a causal LM export with its adapter: the tokenizer (the adapter's, beside a LoRA
    adapter, else the model's) and the model in ``path`` (safetensors only: ``model.load_model``), with the
    LoRA adapter in ``adapter`` on it, unmerged (``with_adapter``). ``path`` is checked by the caller
    (``model.check_model``, ``model.expect``): a command checks a model once.

    Returns:
        ``(model, tokenizer)``, the model on the CPU in training mode, as transformers loads it.

    Raises:
        KubetuneError: the tokenizer or the weights cannot be loaded.
    """
    from transformers import AutoModelForCausalLM

    tokenizer = load_tokenizer(adapter or path)
    model = load_model(AutoModelForCausalLM, path)
    return (model if adapter is None else with_adapter(model, adapter)), tokenizer


def with_adapter(model: Any, adapter: Path, merge: bool = False) -> Any:
    """``model`` (a loaded causal LM) with the LoRA adapter saved in ``adapter``: a ``PeftModel``, unmerged (as
    `kubetune serve --adapter` and `kubetune eval --adapter` score it), or with ``merge`` its weights merged
    in and the adapter's modules removed (a causal-LM export's ``model/``), in ``model``'s dtype."""
    from peft import PeftModel

    peft = PeftModel.from_pretrained(model, adapter)
    return peft.merge_and_unload() if merge else peft


class Generator:
    """A causal LM export (its ``model/``, or a model directory), on the GPU when there is one.

    ``path`` is checked by the caller and holds a causal LM: `kubetune serve` checks it once (``tasks.for_model``;
    a LoRA export's base: ``model.adapter_beside``) and builds this through the task's inference (``seam``)."""

    def __init__(self, path: Path, adapter: Path | None = None, slots: int = 16):
        import torch

        self.path = path
        model, self.tokenizer = load_causal_lm(path, adapter)  # with ``adapter``: the base plus it, unmerged
        M.check_vocab(model, self.tokenizer, path)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = model.to(self.device).eval()
        self.context = context_length(
            model.config if adapter is None else model.get_base_model().config, self.tokenizer
        )
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))
        self.eos = eos_ids(self.model, self.tokenizer)
        self.engine = Engine(self.model, self.eos, slots, self.context)

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

    def token_text(self, token: int) -> str:
        """One token's text on its own (special tokens too: a log-probability's token is named)."""
        return self.tokenizer.decode([token])

    @property
    def vocab_size(self) -> int:
        """The token ids the model takes: its input embedding's rows."""
        return self.model.get_input_embeddings().num_embeddings

    @staticmethod
    def cancel(g: Generation) -> None:
        """A request given up (timed out, client gone): its generation stops at the next token."""
        g.cancelled.set()

    @staticmethod
    def generated(batch: list[Generation]) -> int:
        """Tokens a finished batch made (for /metrics)."""
        return sum(len(g.tokens) for g in batch)

    def run(self, batch: list[Generation]) -> None:
        """Make every generation of ``batch`` to its end, in the calling thread (the engine's continuous
        batching within the list)."""
        self.engine.generate(batch)

    # a continuous engine for the server's Feeder (``server.batcher``): requests join the batch in flight
    def start(self, slots: int, on_step=None) -> None:
        """Run the engine's loop in its own thread with ``slots`` requests in flight at most; ``on_step(n)``
        after each step of ``n`` requests."""
        self.engine.slots, self.engine.on_step = slots, on_step
        self.engine.start()

    def submit(self, g: Generation, done) -> None:
        self.engine.submit(g, done)

    def close(self) -> None:
        self.engine.close()

    @property
    def waiting(self) -> int:
        return self.engine.waiting

    @property
    def running(self) -> int:
        return self.engine.running


def eos_ids(model, tokenizer) -> set[int]:
    """The tokens that end a generation: the tokenizer's end of sequence and the model's generation config's."""
    eos = model.generation_config.eos_token_id
    return {tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
