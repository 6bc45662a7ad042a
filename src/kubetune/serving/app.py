"""The HTTP side of ``kubetune serve``, a FastAPI app: the OpenAI protocol for a causal LM
(``/v1/completions``, ``/v1/chat/completions`` with server-sent events, ``/v1/models``), KServe's v1
(``/v1/models/NAME:predict``) and open inference v2 (``/v2/models/NAME/infer``) protocols for a
classifier, health and readiness, Prometheus metrics; every request through the dynamic batcher,
with a queue bound (429), a size bound (413), a timeout (504) and an optional bearer token (401).
A bad request is a 4xx with one message; the server keeps serving."""

from __future__ import annotations

import asyncio
import hmac
import json
import time
import uuid
from dataclasses import dataclass
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from kubetune.errors import KubetuneError
from kubetune.serving import protocol as api
from kubetune.serving.batcher import Batcher, QueueFull
from kubetune.serving.engine import Classifier, Generation, Generator


@dataclass(frozen=True)
class Limits:
    """The server's bounds (``kubetune serve``'s options)."""

    max_batch: int = 8
    max_wait_ms: float = 10.0
    max_queue: int = 64
    timeout_s: float = 60.0
    max_request_bytes: int = 1 << 20
    max_tokens: int = 2048  # the most new tokens one request may ask for (also bounded by the context)


class HTTPError(Exception):
    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


class _Metrics:
    def __init__(self, batcher_depth):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kubetune_requests", "Requests answered", ["endpoint", "status"], registry=r)
        self.latency = Histogram("kubetune_request_seconds", "Request latency", ["endpoint"], registry=r)
        self.tokens = Counter("kubetune_completion_tokens", "Completion tokens generated", registry=r)
        self.batch = Histogram(
            "kubetune_batch_size", "Requests per engine call", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
        )
        self.queue = Gauge("kubetune_queue_depth", "Requests waiting for a batch", registry=r)
        self.queue.set_function(batcher_depth)


def build_app(engine, name: str, limits: Limits = Limits(), token: str | None = None) -> FastAPI:
    """The app serving ``engine`` (a ``Generator`` or a ``Classifier``) as model ``name``."""
    generator = isinstance(engine, Generator)
    batcher = Batcher(
        (lambda batch: engine.run(batch)) if generator else engine.run,
        limits.max_batch,
        limits.max_wait_ms / 1000,
        limits.max_queue,
    )
    metrics = _Metrics(lambda: batcher.depth)
    batcher.on_batch = metrics.batch.observe
    app = FastAPI(title="kubetune serve", docs_url=None, redoc_url=None, openapi_url=None)
    app.state.batcher, app.state.engine, app.state.name = batcher, engine, name

    @app.middleware("http")
    async def guard(request: Request, call_next):
        start, endpoint = time.perf_counter(), _endpoint(request.url.path)
        try:
            _authorize(request, token)
            size = request.headers.get("content-length")
            if size is not None and (not size.isdigit() or int(size) > limits.max_request_bytes):
                raise HTTPError(413, f"the request body is over {limits.max_request_bytes:,} bytes")
            response = await call_next(request)
        except HTTPError as e:
            response = _error(e)
        metrics.requests.labels(endpoint, str(response.status_code)).inc()
        metrics.latency.labels(endpoint).observe(time.perf_counter() - start)
        return response

    @app.exception_handler(HTTPError)
    async def http_error(request: Request, e: HTTPError):
        return _error(e)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        first = e.errors()[0] if e.errors() else {}
        where = ".".join(str(x) for x in first.get("loc", ())[1:]) or "body"
        return _error(HTTPError(400, f"{where}: {first.get('msg', 'invalid request')}"))

    @app.on_event("shutdown")
    def _close() -> None:
        batcher.close()

    @app.get("/health")
    @app.get("/v2/health/live")
    async def live():
        return {"status": "ok"}

    @app.get("/ready")
    @app.get("/v2/health/ready")
    async def ready():
        return {"status": "ready", "model": name}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    async def run(payload, key=None):
        try:
            return await asyncio.wait_for(batcher.submit(payload, key), limits.timeout_s)
        except QueueFull:
            raise HTTPError(
                429, f"the queue is full ({limits.max_queue} requests waiting); retry later", "rate_limit_exceeded"
            ) from None
        except TimeoutError:
            raise HTTPError(504, f"no answer within {limits.timeout_s:g} s", "timeout") from None

    if generator:
        _openai_routes(app, engine, name, limits, run, metrics)
    else:
        _kserve_routes(app, engine, name, run)
    return app


def _endpoint(path: str) -> str:
    """A bounded label for a path (model names inside paths do not make new series)."""
    for known in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v2/models", "/v2/health", "/metrics"):
        if path.startswith(known):
            return known + (":predict" if path.endswith(":predict") else "/infer" if path.endswith("/infer") else "")
    return path if path in ("/health", "/ready") else "other"


def _authorize(request: Request, token: str | None) -> None:
    if token is None or request.url.path in ("/health", "/ready", "/v2/health/live", "/v2/health/ready"):
        return
    given = request.headers.get("authorization", "")
    if not hmac.compare_digest(given.encode(), f"Bearer {token}".encode()):
        raise HTTPError(401, "missing or wrong bearer token (Authorization: Bearer TOKEN)", "authentication_error")


def _error(e: HTTPError) -> JSONResponse:
    return JSONResponse({"error": {"message": e.message, "type": e.kind, "code": e.status}}, status_code=e.status)


def _check_model(asked: str | None, name: str) -> None:
    if asked is not None and asked != name:
        raise HTTPError(404, f"model {asked!r} is not served here; this server serves {name!r}", "model_not_found")


# ---------------------------------------------------------------- OpenAI


def _openai_routes(app: FastAPI, engine: Generator, name: str, limits: Limits, run, metrics: _Metrics) -> None:
    created = int(time.time())

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [{"id": name, "object": "model", "created": created, "owned_by": "kubetune"}]}

    def generations(prompts: list[list[int]], req) -> list[Generation]:
        context = engine.context or 1 << 30
        max_tokens = req.max_tokens if req.max_tokens is not None else req.default_max_tokens
        if max_tokens > limits.max_tokens:
            raise HTTPError(400, f"max_tokens {max_tokens} is over this server's limit of {limits.max_tokens}")
        out = []
        for ids in prompts:
            if len(ids) + max_tokens > context:
                raise HTTPError(
                    400,
                    f"the prompt's {len(ids)} tokens and max_tokens {max_tokens} are over the model's "
                    f"{context}-token context; shorten the prompt or lower max_tokens",
                    "context_length_exceeded",
                )
            out.append(Generation(ids, max_tokens, req.temperature, req.top_p, req.seed))
        return out

    async def answer(kind: str, prompts: list[list[int]], req):
        _check_model(req.model, name)
        gens = generations(prompts, req)
        rid = f"{'chatcmpl' if kind == 'chat' else 'cmpl'}-{uuid.uuid4().hex}"
        if req.stream:
            if len(gens) != 1:
                raise HTTPError(400, "stream: true takes one prompt")
            return StreamingResponse(
                _stream(gens[0], kind, rid, name, req.stop, run, engine, metrics), media_type="text/event-stream"
            )
        done = await asyncio.gather(*(run(g, g.key()) for g in gens))
        choices = []
        for k, g in enumerate(done):
            text, finish = _stop_at(engine.decode(g.tokens), req.stop, g.finish_reason)
            metrics.tokens.inc(len(g.tokens))
            choices.append(api.choice(kind, k, text, finish))
        usage = api.usage(sum(len(p) for p in prompts), sum(len(g.tokens) for g in done))
        return api.response(kind, rid, name, choices, usage)

    @app.post("/v1/completions")
    async def completions(req: api.CompletionRequest):
        prompts = [req.prompt] if isinstance(req.prompt, str) else req.prompt
        if not prompts:
            raise HTTPError(400, "prompt: give a string or a list of strings")
        return await answer("text", [engine.encode(p) for p in prompts], req)

    @app.post("/v1/chat/completions")
    async def chat(req: api.ChatRequest):
        try:
            ids = engine.encode_chat([m.model_dump() for m in req.messages])
        except KubetuneError as e:
            raise HTTPError(400, str(e)) from None
        return await answer("chat", [ids], req)


def _stop_at(text: str, stop: list[str] | None, finish: str) -> tuple[str, str]:
    cuts = [text.find(s) for s in stop or () if s and s in text]
    return (text[: min(cuts)], "stop") if cuts else (text, finish)


async def _stream(g: Generation, kind: str, rid: str, name: str, stop, run, engine: Generator, metrics):
    """Server-sent events: one chunk per new piece of text as tokens are made, then the finish reason and
    ``[DONE]``; the concatenated chunks are the non-streaming answer's text."""
    loop, queue = asyncio.get_running_loop(), asyncio.Queue()
    g.on_token = lambda token: loop.call_soon_threadsafe(queue.put_nowait, token)
    task = asyncio.ensure_future(run(g, g.key()))
    task.add_done_callback(lambda _: loop.call_soon_threadsafe(queue.put_nowait, None))
    sent, tokens = "", []
    if kind == "chat":
        yield _sse(api.chunk(kind, rid, name, "", None, role=True))
    while (token := await queue.get()) is not None:
        tokens.append(token)
        text, finish = _stop_at(engine.decode(tokens), stop, "")
        if finish == "stop":
            break
        if len(text) > len(sent) and not text.endswith("\ufffd"):  # a whole character, not half a UTF-8 sequence
            yield _sse(api.chunk(kind, rid, name, text[len(sent) :], None))
            sent = text
    try:
        done = await task
    except Exception as e:  # noqa: BLE001 - reported in the stream: the status line has gone out already
        message = e.message if isinstance(e, HTTPError) else "generation failed"
        yield _sse({"error": {"message": message, "type": "server_error"}})
        return
    metrics.tokens.inc(len(done.tokens))
    text, finish = _stop_at(engine.decode(done.tokens), stop, done.finish_reason)
    if len(text) > len(sent):
        yield _sse(api.chunk(kind, rid, name, text[len(sent) :], None))
    yield _sse(api.chunk(kind, rid, name, "", finish))
    yield "data: [DONE]\n\n"


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


# ---------------------------------------------------------------- KServe v1 and open inference v2


def _kserve_routes(app: FastAPI, engine: Classifier, name: str, run) -> None:
    @app.get("/v1/models/{model}")
    async def v1_ready(model: str):
        _check_model(model, name)
        return {"name": name, "ready": True}

    @app.post("/v1/models/{model}:predict")
    async def v1_predict(model: str, req: api.V1Request):
        _check_model(model, name)
        return {"predictions": await _classify(_texts(req), run)}

    @app.get("/v2/models/{model}")
    async def v2_metadata(model: str):
        _check_model(model, name)
        return api.v2_metadata(name)

    @app.get("/v2/models/{model}/ready")
    async def v2_ready(model: str):
        _check_model(model, name)
        return {"name": name, "ready": True}

    @app.post("/v2/models/{model}/infer")
    async def v2_infer(model: str, req: api.V2Request):
        _check_model(model, name)
        return api.v2_response(name, req.id, await _classify(_texts(req), run))


def _texts(req) -> list[str]:
    try:
        return req.texts()
    except ValueError as e:
        raise HTTPError(400, str(e)) from None


async def _classify(texts: list[str], run) -> list[dict[str, Any]]:
    if not texts:
        raise HTTPError(400, "no texts to classify: give instances (v1) or a BYTES input (v2)")
    return list(await asyncio.gather(*(run(t, "classify") for t in texts)))
