"""The OpenAI protocol for a causal LM: ``/v1/completions`` and ``/v1/chat/completions`` (server-sent events
with ``stream: true``) and ``/v1/models``. A streaming request whose client goes is given up at once:
its generation stops at the next token."""

from __future__ import annotations

import asyncio
import json
import time
import uuid
from collections.abc import Callable

from fastapi import FastAPI, Request
from fastapi.responses import StreamingResponse

from kubetune.errors import KubetuneError
from kubetune.inference.causal import Generation, Generator
from kubetune.inference.server import protocol as api
from kubetune.inference.server.compute import HTTPError, Limits, Runner, check_model


def add_routes(app: FastAPI, engine: Generator, name: str, limits: Limits, runner: Runner) -> None:
    created = int(time.time())
    metrics = runner.metrics

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "kubetune"}]}

    def generations(prompts: list[list[int]], req) -> list[Generation]:
        context = engine.context or 1 << 30
        max_tokens = req.max_tokens if req.max_tokens is not None else req.default_max_tokens
        if max_tokens > limits.max_tokens:
            raise HTTPError(
                400, f"max_tokens {max_tokens} is over this server's limit of {limits.max_tokens}", param="max_tokens"
            )
        out = []
        for ids in prompts:
            if not ids:
                raise HTTPError(
                    400, "a prompt has no tokens (this model's tokenizer adds none of its own)", param="prompt"
                )
            if len(ids) + max_tokens > context:
                raise HTTPError(
                    400,
                    f"the prompt's {len(ids)} tokens and max_tokens {max_tokens} are over the model's "
                    f"{context}-token context; shorten the prompt or lower max_tokens",
                    "context_length_exceeded",
                )
            scored = req.echo and req.logprobs is not None
            g = Generation(
                ids, max_tokens, req.temperature, req.top_p, req.seed, logprobs=req.logprobs, prompt_logprobs=scored
            )
            if any(req.stop or ()) and not req.stream:  # a stream stops at its stop sequence itself (``_stream``)
                g.on_token = _stopped_at(g, req.stop, engine.decode)
            out.append(g)
        return out

    async def answer(kind: str, prompts: list[list[int]], req, request: Request):
        check_model(req.model, name)
        gens = generations(prompts, req)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        if req.stream:
            if len(gens) != 1:
                raise HTTPError(400, "stream: true takes one prompt", param="stream")
            if req.logprobs is not None or req.echo:
                raise HTTPError(400, "logprobs and echo are answered without stream: true", param="stream")
            g, loop = gens[0], asyncio.get_running_loop()
            queue: asyncio.Queue[int | None] = asyncio.Queue()

            def on_token(token: int) -> None:  # from the engine's thread
                loop.call_soon_threadsafe(queue.put_nowait, token)

            g.on_token = on_token
            task = asyncio.ensure_future(runner.wait(runner.enqueue([(g, None)], "prompts")))  # 429 before 200
            task.add_done_callback(lambda _: queue.put_nowait(None))
            return _Stream(_stream(g, queue, task, kind, rid, name, req.stop, engine, metrics), task, metrics)
        done = await runner.compute([(g, None) for g in gens], "prompts", request.receive)
        choices = []
        echo = req.echo
        for k, g in enumerate(done):
            text, finish = _stop_at(engine.decode(g.tokens), req.stop, g.finish_reason)
            metrics.tokens.inc(len(g.tokens))
            made = g.tokens + ([g.end_token] if g.end_token is not None else [])
            prompt = engine.decode(g.ids) if echo else ""
            scored = None
            if g.logprobs is not None:  # the end token too: a scorer reads the last one as the one made
                ids = (g.ids if echo else []) + made
                values = ([None, *g.prompt_token_logprobs] if echo else []) + g.token_logprobs
                top = ([None, *g.prompt_top_logprobs] if echo else []) + g.top_logprobs
                offsets = api.text_offsets(([(g.ids, prompt)] if echo else []) + [(made, text)], engine.decode)
                scored = api.logprobs([engine.token_text(i) for i in ids], values, top, engine.token_text, offsets)
            choices.append(api.choice(kind, k, prompt + text, finish, scored))
        usage = api.usage(sum(len(p) for p in prompts), sum(len(g.tokens) for g in done))
        return api.response(kind, rid, name, choices, usage)

    @app.post("/v1/completions")
    async def completions(req: api.CompletionRequest, request: Request):
        return await answer("text", _prompt_ids(req.prompt, engine, runner), req, request)

    @app.post("/v1/chat/completions")
    async def chat(req: api.ChatRequest, request: Request):
        try:
            ids = engine.encode_chat([m.model_dump() for m in req.messages])
        except KubetuneError as e:
            raise HTTPError(400, str(e), param="messages") from None
        return await answer("chat", [ids], req, request)


def _prompt_ids(prompt, engine: Generator, runner: Runner) -> list[list[int]]:
    """A completion request's prompts as token ids: texts encoded, token ids checked against the vocabulary; more
    prompts than the server queues are refused (413) before any is encoded."""
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt or any(len(p) == 0 for p in prompt):
        raise HTTPError(
            400, "prompt: give a string, a list of strings, or token ids (a list, or lists)", param="prompt"
        )
    runner.check_count(len(prompt), "prompts")
    out = []
    for p in prompt:
        if isinstance(p, str):
            out.append(engine.encode(p))
            continue
        bad = next((i for i in p if not 0 <= i < engine.vocab_size), None)
        if bad is not None:
            raise HTTPError(
                400,
                f"prompt: token id {bad} is outside this model's vocabulary (0 to {engine.vocab_size - 1})",
                param="prompt",
            )
        out.append(list(p))
    return out


class _Stream(StreamingResponse):
    """Server-sent events that give their generation up when the response ends before it (the client gone:
    Starlette stops the response on the disconnect, and this is the one place that always runs then)."""

    def __init__(self, events, task: asyncio.Future, metrics):
        super().__init__(events, media_type="text/event-stream")
        self.task, self.metrics = task, metrics

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            if not self.task.done():
                self.task.cancel()
                self.metrics.cancelled.labels("disconnect").inc()


def _stopped_at(g: Generation, stop: list[str], decode) -> Callable[[int], None]:
    """``on_token`` (called in the engine's thread) for a generation with stop sequences: once the text of its last
    tokens holds one, it is given up, so the engine stops it at its next token, as a stream's is; its answer is
    cut where its whole text holds the first (``_stop_at``)."""
    stops = [s for s in stop if s]
    # the tokens a stop sequence's text can span: at most 4 a character (one per UTF-8 byte), and one more that
    # ends inside its first; twice as many, so that the window's first tokens (decoded without what precedes
    # them: a leading space lost, half a character) are never part of it
    window = 8 * max(len(s) for s in stops) + 8

    def on_token(token: int) -> None:
        tail = decode(g.tokens[-window:])
        if any(s in tail for s in stops):
            g.cancelled.set()

    return on_token


def _stop_at(text: str, stop: list[str] | None, finish: str) -> tuple[str, str]:
    cuts = [text.find(s) for s in stop or () if s and s in text]
    return (text[: min(cuts)], "stop") if cuts else (text, finish)


async def _stream(g: Generation, queue: asyncio.Queue, task, kind: str, rid: str, name: str, stop, engine, metrics):
    """Server-sent events: one chunk per new piece of text as ``queue`` brings the tokens, then the finish
    reason and ``[DONE]``; the concatenated chunks are the non-streaming answer's text."""
    sent, tokens = "", []
    if kind == "chat":
        yield _sse(api.chunk(kind, rid, name, "", None, role=True))
    while (token := await queue.get()) is not None:
        tokens.append(token)
        text, finish = _stop_at(engine.decode(tokens), stop, "")
        if finish == "stop":
            g.cancelled.set()  # a stop sequence: the engine stops this generation at its next token
            break
        if len(text) > len(sent) and not text.endswith("\ufffd"):  # a whole character, not half a UTF-8 sequence
            yield _sse(api.chunk(kind, rid, name, text[len(sent) :], None))
            sent = text
    try:
        [done] = await task
    except Exception as e:  # noqa: BLE001 - reported in the stream: the status line has gone out already
        message = e.message if isinstance(e, HTTPError) else "generation failed"
        yield _sse(api.openai_error(getattr(e, "status", 500), message, getattr(e, "kind", "server_error")))
        return
    metrics.tokens.inc(len(done.tokens))
    text, finish = _stop_at(engine.decode(done.tokens), stop, done.finish_reason)
    if len(text) > len(sent):
        yield _sse(api.chunk(kind, rid, name, text[len(sent) :], None))
    yield _sse(api.chunk(kind, rid, name, "", finish))
    yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"
