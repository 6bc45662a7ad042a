"""What ``kubetune serve`` computes: a causal LM generating for a batch of requests, or a classifier
labeling a batch of texts, loaded and checked as ``kubetune predict`` loads them (``kubetune.inference.model``),
so that a request answers what ``predict`` answers."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from kubetune.errors import KubetuneError
from kubetune.inference import model as P


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

    kind = P.GENERATOR

    def __init__(self, path: Path, adapter: Path | None = None):
        import torch
        from transformers import AutoModelForCausalLM

        P._expect(path, P.GENERATOR)
        self.path = path
        self.tokenizer = P._tokenizer(adapter or path)
        model = P._model(AutoModelForCausalLM, path)
        if adapter is not None:  # the base plus the LoRA adapter, unmerged
            from peft import PeftModel

            model = PeftModel.from_pretrained(model, adapter)
        P._check_vocab(model, self.tokenizer, path)
        self.device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
        self.model = model.to(self.device).eval()
        self.context = P._context(model.config if adapter is None else model.get_base_model().config, self.tokenizer)
        self.chat = bool(getattr(self.tokenizer, "chat_template", None))
        self.pad = self.tokenizer.pad_token_id or self.tokenizer.eos_token_id  # as predict's call
        eos = self.model.generation_config.eos_token_id
        self.eos = {self.tokenizer.eos_token_id, *(eos if isinstance(eos, list) else [eos])} - {None}
        self._lock = threading.Lock()

    def encode(self, prompt: str) -> list[int]:
        """A raw prompt's token ids, as ``predict --no-chat`` makes them."""
        return P._render(self.tokenizer, False, self.path, prompt)

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


class Classifier:
    """A sequence classifier export, labeling texts as ``predict`` does (the top label and its score)."""

    kind = P.CLASSIFIER

    def __init__(self, path: Path):
        import torch
        from transformers import AutoModelForSequenceClassification, pipeline

        P._expect(path, P.CLASSIFIER)
        self.path = path
        tokenizer = P._tokenizer(path)
        model = P._model(AutoModelForSequenceClassification, path)
        P._check_vocab(model, tokenizer, path)
        self.context = P._context(model.config, tokenizer) or 512
        self.pipe = pipeline(
            "text-classification", model=model, tokenizer=tokenizer, device=0 if torch.cuda.is_available() else -1
        )
        self.labels = [model.config.id2label[i] for i in sorted(model.config.id2label)]
        self._lock = threading.Lock()

    def run(self, texts: list[str]) -> list[dict | Exception]:
        """The top label and its score for each text, in one call of the pipeline; where that call fails,
        each text alone, so that a text the model cannot take fails its own request only (its entry is
        the exception)."""
        try:
            return self._label(texts)
        except Exception as e:  # noqa: BLE001 - whose text it was is found out below
            if len(texts) == 1:
                return [e]
        out: list[dict | Exception] = []
        for text in texts:
            try:
                out.extend(self._label([text]))
            except Exception as e:  # noqa: BLE001 - this text's own error, answered to its request
                out.append(e)
        return out

    def _label(self, texts: list[str]) -> list[dict]:
        with self._lock:
            out = self.pipe(texts, batch_size=len(texts), truncation=True, max_length=self.context)
        return [{"label": r["label"], "score": float(r["score"])} for r in out]


def load(uri: str, adapter: bool = False, s3=None):
    """The engine for an export (a job's output, a model directory, s3:// or hf://): a ``Generator`` or
    a ``Classifier``; ``adapter``: a LoRA export served as its base model plus ``adapter/``.

    Raises:
        KubetuneError: nothing servable there (as ``predict`` says it), or no adapter with ``adapter``.
    """
    from kubetune.providers import S3Settings

    path = P.model_path(uri, s3 or S3Settings())
    if P.check_model(path) == P.CLASSIFIER:
        if adapter:
            raise KubetuneError("--adapter serves a causal LM's LoRA adapter", field="--adapter", fix="drop --adapter")
        return Classifier(path)
    if not adapter:
        return Generator(path)
    adapter_dir = path.parent / "adapter"
    if not (adapter_dir / "adapter_config.json").is_file():
        raise KubetuneError(
            f"no LoRA adapter beside {P._short(str(path))} (no adapter/adapter_config.json)",
            field="--adapter",
            fix="serve the merged model (drop --adapter); only a LoRA run exports an adapter",
        )
    base = _adapter_base(adapter_dir)
    return Generator(base, adapter=adapter_dir)


def _adapter_base(adapter_dir: Path) -> Path:
    """The base model an adapter was trained on, as its adapter_config.json names it, resolved as a model URI."""
    import json

    name = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    if not name:
        raise KubetuneError(
            f"{P._short(str(adapter_dir))}/adapter_config.json names no base model",
            field="--adapter",
            fix="serve the merged model (drop --adapter)",
        )
    return P.model_path(name)
