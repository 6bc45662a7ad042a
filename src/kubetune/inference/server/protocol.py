"""The wire formats ``kubetune serve`` speaks: OpenAI's completions and chat completions (the request
fields by OpenAI's names; ones kubetune does not implement are refused by name, not ignored), KServe's
v1 ``instances`` (the open inference protocol v2 is in ``v2``), the responses, the two error
shapes, and one line for a request's first validation error. A request's strings must be text: a lone
UTF-16 surrogate (a JSON ``\\ud800`` escape without its pair) is refused by where it is."""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

MIN_TEMPERATURE = 0.01  # below it the scaled logits overflow to inf (NaN probabilities); vLLM clamps to it too
SEED_RANGE = (-(2**63), 2**64 - 1)  # what torch.manual_seed takes
_SURROGATE = re.compile("[\ud800-\udfff]")
# the tags pydantic puts in an error's location for a union's member ("str", "list[str]"): not field names
_UNION_TAG = re.compile(r"^(str|int|float|bool|dict|list|none|function-.*|.*\[.*\])$")


def lone_surrogate(value: Any, where: str = "") -> str | None:
    """Where the first string of a parsed JSON ``value`` (its values, not its keys) holds a lone surrogate,
    as one message; None where every string is text."""
    todo = [(value, where)]
    while todo:  # by hand, not recursion: a deeply nested body must not hit the recursion limit
        v, at = todo.pop()
        if isinstance(v, str):
            if (found := _SURROGATE.search(v)) is not None:
                return (
                    f"{at or 'body'}: a lone surrogate {found.group()!r} at character {found.start()} is not text; "
                    "send Unicode text (a \\ud800-\\udfff escape only as half of a pair)"
                )
        elif isinstance(v, dict):
            todo.extend((x, f"{at}.{k}" if at else str(k)) for k, x in reversed(v.items()))
        elif isinstance(v, list):
            todo.extend((x, f"{at}[{k}]") for k, x in reversed(list(enumerate(v))))
    return None


def describe(errors: Sequence[Mapping[str, Any]]) -> str:
    """One line for the first of pydantic's (or FastAPI's) validation errors: where, then what."""
    if not errors:
        return "body: not a valid request"
    first = errors[0]
    loc = list(first.get("loc", ()))
    if loc[:1] == ["body"]:  # FastAPI's prefix
        loc = loc[1:]
    kind, ctx = first.get("type", ""), first.get("ctx") or {}
    if kind == "json_invalid":
        at = f" at character {loc[0]}" if loc and isinstance(loc[0], int) else ""
        return f"body: not valid JSON ({ctx.get('error', 'decode error')}{at})"
    where = ""
    for part in loc:
        if isinstance(part, int):
            where += f"[{part}]"
        elif not _UNION_TAG.match(str(part)):
            where += f".{part}" if where else str(part)
    if kind == "value_error":  # our own validators' messages, which may name their place themselves
        message = str(ctx.get("error", first.get("msg", "")))
        return message if not where and ":" in message else f"{where or 'body'}: {message}"
    if kind in ("model_type", "model_attributes_type", "dict_type") and not where:
        return "body: must be a JSON object"
    if kind == "extra_forbidden":
        return f"{where}: not a field this server implements; remove it"
    return f"{where or 'body'}: {first.get('msg', 'invalid')}"


def openai_error(status: int, message: str, kind: str, param: str | None = None) -> dict:
    """OpenAI's error body."""
    return {"error": {"message": message, "type": kind, "param": param, "code": status}}


def kserve_error(message: str) -> dict:
    """KServe's v1 and the open inference protocol v2's error body."""
    return {"error": message}


class Strict(BaseModel):
    """A request object whose unknown fields are refused by name (a client that sets logprobs must not get
    an answer without them)."""

    model_config = ConfigDict(extra="forbid")


class Body(Strict):
    """A whole request body: its strings are checked for lone surrogates, which tokenizers cannot take."""

    @model_validator(mode="before")
    @classmethod
    def _text_only(cls, data):
        if (problem := lone_surrogate(data)) is not None:
            raise ValueError(problem)
        return data


MAX_LOGPROBS = 20  # OpenAI's legacy completions allow 5; vLLM 20


class _Sampling(Body):
    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: Literal[1] = 1
    stream: bool = False
    stop: str | list[str] | None = None
    seed: int | None = None
    user: str | None = None

    @field_validator("temperature")
    @classmethod
    def _temperature(cls, value):
        if 0 < value < MIN_TEMPERATURE:
            raise ValueError(f"{value:g} is too small to sample with; give 0 (greedy) or {MIN_TEMPERATURE:g} to 2")
        return value

    @field_validator("seed")
    @classmethod
    def _seed(cls, value):
        low, high = SEED_RANGE
        if value is not None and not low <= value <= high:
            raise ValueError(f"{value} is outside {low} to {high}; give a seed in that range")
        return value

    @field_validator("stop")
    @classmethod
    def _stops(cls, value):
        if isinstance(value, str):
            value = [value]
        if value is not None and len(value) > 4:
            raise ValueError("at most 4 stop sequences")
        return value

    def model_post_init(self, context) -> None:
        if self.max_tokens is None and self.max_completion_tokens is not None:
            self.max_tokens = self.max_completion_tokens


class CompletionRequest(_Sampling):
    # text, texts, one prompt's token ids, or several prompts' (what evaluation clients send: lm-eval's
    # local-completions tokenizes itself)
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(None, ge=0)  # 0: nothing made (with echo and logprobs: the prompt scored)
    echo: bool = False  # the prompt before the completion, in the text and (with logprobs) in the log-probabilities
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)  # each token's, and this many most likely there
    default_max_tokens: ClassVar[int] = 16  # OpenAI's default for completions


class Message(Strict):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    # not fields (a body that gives them is refused by name): what the routes read where a completion has them
    echo: ClassVar[bool] = False
    logprobs: ClassVar[None] = None
    default_max_tokens: ClassVar[int] = 256


def choice(kind: str, index: int, text: str, finish: str, logprobs: dict | None = None) -> dict:
    if kind == "chat":
        return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
    return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}


def logprobs(
    texts: list[str],
    token_logprobs: list[float | None],
    top: list[list[tuple[int, float]] | None],
    decode,
    offsets: list[int],
) -> dict:
    """OpenAI's legacy ``logprobs`` object: each token's text (decoded on its own, special tokens named),
    log-probability (None for a prompt's first) and most likely alternatives ({text: log-probability}), and
    ``offsets``, where each token's text starts in the answer's text (``text_offsets``)."""
    tops = [None if pairs is None else {decode(i): lp for i, lp in pairs} for pairs in top]
    return {"tokens": texts, "token_logprobs": token_logprobs, "top_logprobs": tops, "text_offset": offsets}


def text_offsets(parts: list[tuple[list[int], str]], decode: Callable[[list[int]], str]) -> list[int]:
    """Where each token starts in an answer's text, as OpenAI's and vLLM's ``text_offset`` index it: ``parts`` are
    token ids and the text the answer holds for them (their ``decode``, a completion's cut at its stop sequence),
    in order; the answer's text is their texts' concatenation. A token takes the text it adds to its part's as
    vLLM's detokenizer decodes incrementally: none for a token the text omits (BOS, with special tokens skipped)
    or one inside a character (the token that completes the character takes it); a token past its part's text
    (after a stop sequence) is at the part's end."""
    offsets, base = [], 0
    for ids, text in parts:
        at, prefix, read, before = 0, 0, 0, ""
        for i in range(len(ids)):
            offsets.append(base + min(at, len(text)))
            after = decode(ids[prefix : i + 1])
            if len(after) > len(before) and not after.endswith("\ufffd"):
                at += len(after) - len(before)
                # the next token's text in the context of this one (which may merge with it, or lose a leading space)
                prefix, read = read, i + 1
                before = decode(ids[prefix:read])
        base += len(text)
    return offsets


def usage(prompt: int, completion: int) -> dict:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def response(kind: str, rid: str, name: str, choices: list[dict], used: dict) -> dict:
    obj = "chat.completion" if kind == "chat" else "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": name, "choices": choices, "usage": used}


def chunk(kind: str, rid: str, name: str, text: str, finish: str | None, role: bool = False) -> dict:
    if kind == "chat":
        delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
        body = {"index": 0, "delta": delta, "finish_reason": finish}
        obj = "chat.completion.chunk"
    else:
        body, obj = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}, "text_completion"
    return {"id": rid, "object": obj, "created": int(time.time()), "model": name, "choices": [body]}


# ---------------------------------------------------------------- KServe v1


class V1Request(Body):
    """KServe v1: ``{"instances": ["text", ...]}`` (or ``{"text": ...}`` objects)."""

    instances: list[str | dict] = Field(min_length=1)

    def texts(self) -> list[str]:
        out = []
        for k, x in enumerate(self.instances):
            text = x if isinstance(x, str) else x.get("text")
            if not isinstance(text, str):
                raise ValueError(f"instances[{k}]: give a string, or an object with a string 'text'")
            out.append(text)
        return out
