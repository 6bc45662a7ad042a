"""The wire formats ``kubetune serve`` speaks: OpenAI's completions and chat completions (the request
fields by OpenAI's names; ones kubetune does not implement are refused by name, not ignored), KServe's
v1 ``instances`` and the open inference protocol v2 (``inputs`` of BYTES), and the responses."""

from __future__ import annotations

import time
from typing import ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator


class _Request(BaseModel):
    # unknown fields are refused by name (a client that sets logprobs must not get an answer without them)
    model_config = ConfigDict(extra="forbid")


class _Sampling(_Request):
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
    prompt: str | list[str]
    default_max_tokens: ClassVar[int] = 16  # OpenAI's default for completions


class Message(_Request):
    role: Literal["system", "user", "assistant", "tool"]
    content: str


class ChatRequest(_Sampling):
    messages: list[Message] = Field(min_length=1)
    default_max_tokens: ClassVar[int] = 256


def choice(kind: str, index: int, text: str, finish: str) -> dict:
    if kind == "chat":
        return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
    return {"index": index, "text": text, "logprobs": None, "finish_reason": finish}


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


# ---------------------------------------------------------------- KServe


class V1Request(_Request):
    """KServe v1: ``{"instances": ["text", ...]}`` (or ``{"text": ...}`` objects)."""

    instances: list[str | dict] = Field(min_length=1)

    def texts(self) -> list[str]:
        out = []
        for k, x in enumerate(self.instances):
            text = x if isinstance(x, str) else x.get("text")
            if not isinstance(text, str):
                raise ValueError(f"instances[{k}]: a string, or an object with a string 'text'")
            out.append(text)
        return out


class V2Tensor(_Request):
    name: str
    shape: list[int]
    datatype: str
    data: list
    parameters: dict | None = None


class V2Request(_Request):
    """The open inference protocol v2: one BYTES input of texts."""

    id: str | None = None
    inputs: list[V2Tensor] = Field(min_length=1)
    outputs: list[dict] | None = None
    parameters: dict | None = None

    def texts(self) -> list[str]:
        tensor = self.inputs[0]
        if tensor.datatype != "BYTES" or not all(isinstance(x, str) for x in tensor.data):
            raise ValueError(f"inputs[0] ({tensor.name}): datatype BYTES with string data")
        return list(tensor.data)


def v2_metadata(name: str) -> dict:
    return {
        "name": name,
        "platform": "kubetune",
        "inputs": [{"name": "text", "datatype": "BYTES", "shape": [-1]}],
        "outputs": [
            {"name": "label", "datatype": "BYTES", "shape": [-1]},
            {"name": "score", "datatype": "FP32", "shape": [-1]},
        ],
    }


def v2_response(name: str, rid: str | None, results: list[dict]) -> dict:
    n = len(results)
    return {
        "model_name": name,
        "id": rid or "",
        "outputs": [
            {"name": "label", "datatype": "BYTES", "shape": [n], "data": [r["label"] for r in results]},
            {"name": "score", "datatype": "FP32", "shape": [n], "data": [r["score"] for r in results]},
        ],
    }
