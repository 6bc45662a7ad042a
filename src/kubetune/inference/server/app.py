"""The HTTP side of ``kubetune serve``, a FastAPI app: the routes of the protocol the model's task serves it
over (``seam.Routes``: the OpenAI protocol, ``openai_routes``; KServe's v1 and the open inference protocol
v2, ``kserve_routes``), health and readiness, Prometheus metrics; every request through the
dynamic batcher, with a queue bound (429), a body bound (413, counted as the body is read, whatever its
framing), a timeout (504, and 408 for a body that does not arrive) and an optional bearer token (401).
A bad request is a 4xx with one message in its protocol's error shape (OpenAI's
``{"error": {"message", "type", "param", "code"}}``; KServe's ``{"error": "<message>"}``), unknown
routes and methods included; the server keeps serving."""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import time

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from prometheus_client import generate_latest
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.body_limit import RequestBodyLimitMiddleware

from kubetune.inference.seam import Routes
from kubetune.inference.server import protocol as api
from kubetune.inference.server.batcher import Batcher, Feeder
from kubetune.inference.server.compute import HTTPError, Limits, Metrics, Runner

PROBES = ("/health", "/ready", "/v2/health/live", "/v2/health/ready")

__all__ = ["HTTPError", "Limits", "build_app"]


def build_app(engine, name: str, routes: Routes, limits: Limits = Limits(), token: str | None = None) -> FastAPI:
    """The app serving ``engine`` (a ``seam.Engine``) as model ``name`` over ``routes``."""
    generated = getattr(engine, "generated", None)
    batcher: Batcher | Feeder
    metrics: Metrics  # made with the batcher; its callbacks below read it when they run
    if getattr(engine, "submit", None) is not None:  # continuous batching: requests join the batch in flight
        batcher = Feeder(
            engine,
            limits.max_batch,
            limits.max_queue,
            on_done=lambda g: metrics.generated.inc(generated([g])) if generated is not None else None,
            on_cancel=getattr(engine, "cancel", None),
            on_step=lambda n: metrics.batch.observe(n),  # the requests in each engine step
        )
        metrics = Metrics(batcher)
    else:
        batched = Batcher(engine.run, limits.max_batch, limits.max_wait_ms / 1000, limits.max_queue)
        batcher, metrics = batched, Metrics(batched)
        if getattr(engine, "cancel", None) is not None:
            batched.on_cancel = engine.cancel

        def on_batch(items: list) -> None:
            metrics.batch.observe(len(items))
            if generated is not None:
                metrics.generated.inc(generated(items))

        batched.on_batch = on_batch
    runner = Runner(batcher, limits, metrics)

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI):
        yield
        batcher.close()

    app = FastAPI(title="kubetune serve", docs_url=None, redoc_url=None, openapi_url=None, lifespan=lifespan)
    app.state.batcher, app.state.engine, app.state.name = batcher, engine, name

    def render(path: str, e: HTTPError) -> JSONResponse:
        """``e`` in the error shape of the protocol ``path`` belongs to."""
        if routes.openai_errors and not path.startswith("/v2"):
            body = api.openai_error(e.status, e.message, e.kind, e.param)
        else:
            body = api.kserve_error(e.message)
        return JSONResponse(body, status_code=e.status, headers=e.headers)

    listing = routes.listing(name)
    # Starlette's RequestBodyLimitMiddleware counts the body as it is read, chunked or not, and raises a 413
    # that the handler below answers; inside _Guard (added last, so outermost), which answers a declared
    # Content-Length over the limit itself (FastAPI's max_body_size would answer that one in plain text).
    app.add_middleware(RequestBodyLimitMiddleware, max_body_size=limits.max_request_bytes)
    app.add_middleware(_Guard, token=token, limits=limits, metrics=metrics, render=render)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, e: StarletteHTTPException):
        return render(request.url.path, _as_error(request, e, limits, listing))

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, e: RequestValidationError):
        message = api.describe(list(e.errors()))
        return render(request.url.path, HTTPError(400, message, param=message.split(":")[0]))

    @app.exception_handler(Exception)
    async def failed(request: Request, e: Exception):
        # Starlette logs the traceback after this answer: a 500 is a server fault, never a request's own
        message = f"internal error ({type(e).__name__}); the server's log has the details"
        return render(request.url.path, HTTPError(500, message, "server_error"))

    @app.get("/health")
    @app.get("/v2/health/live")
    async def live():
        return {"status": "ok", "live": True}

    @app.get("/ready")
    @app.get("/v2/health/ready")
    async def ready():
        return {"status": "ready", "model": name, "ready": True}

    @app.get("/metrics")
    async def prometheus():
        return PlainTextResponse(generate_latest(metrics.registry).decode(), media_type="text/plain; version=0.0.4")

    routes.add(app, engine, name, limits, runner)
    return app


def _as_error(request: Request, e: StarletteHTTPException, limits: Limits, routes: str) -> HTTPError:
    """Starlette's own HTTP errors (no route, wrong method, body over the limit) as one clear line."""
    if isinstance(e, HTTPError):
        return e
    method, path = request.method, request.url.path
    if e.status_code == 404:
        return HTTPError(404, f"{method} {path[:200]} is not a route of this server; it serves {routes}", "not_found")
    if e.status_code == 405:
        allowed = (e.headers or {}).get("Allow", "")
        return HTTPError(405, f"{method} is not allowed on {path[:200]}; use {allowed}", headers=e.headers)
    if e.status_code == 413:
        return _too_large(limits)
    return HTTPError(e.status_code, str(e.detail), headers=e.headers)


def _too_large(limits: Limits) -> HTTPError:
    return HTTPError(
        413,
        f"the request body is over {limits.max_request_bytes:,} bytes (kubetune serve --max-request-kb); send less",
    )


def _endpoint(path: str) -> str:
    """A bounded label for a path (model names inside paths do not make new series)."""
    for known in ("/v1/chat/completions", "/v1/completions", "/v1/models", "/v2/models", "/v2/health", "/metrics"):
        if path.startswith(known):
            return known + (":predict" if path.endswith(":predict") else "/infer" if path.endswith("/infer") else "")
    return path if path in ("/health", "/ready", "/v2") else "other"


class _Guard:
    """What every request passes first: the bearer token (401) and a declared body over the limit (413),
    answered before anything is read; the body's arrival within the timeout (408); every answer counted
    by endpoint and status. Pure ASGI rather than ``@app.middleware("http")`` (Starlette's
    BaseHTTPMiddleware), which stands between a response and the client's disconnect."""

    def __init__(self, app, token: str | None, limits: Limits, metrics: Metrics, render):
        self.app, self.token, self.limits, self.metrics, self.render = app, token, limits, metrics, render

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        start, endpoint, status = time.perf_counter(), _endpoint(scope["path"]), [500]

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            refusal = self._refusal(scope)
            if refusal is not None:
                await self.render(scope["path"], refusal)(scope, receive, counted)
            else:
                await self.app(scope, _in_time(receive, self.limits.timeout_s), counted)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            self.metrics.latency.labels(endpoint).observe(time.perf_counter() - start)

    def _refusal(self, scope) -> HTTPError | None:
        headers = Headers(scope=scope)
        if self.token is not None and scope["path"] not in PROBES:
            given = headers.get("authorization", "")
            if not hmac.compare_digest(given.encode(), f"Bearer {self.token}".encode()):
                return HTTPError(
                    401, "missing or wrong bearer token (Authorization: Bearer TOKEN)", "authentication_error"
                )
        size = headers.get("content-length")
        if size is not None and (not size.isdigit() or int(size) > self.limits.max_request_bytes):
            return _too_large(self.limits)
        return None


def _in_time(receive, seconds: float):
    """``receive`` whose body messages must all arrive within ``seconds`` of the request's start (else 408);
    after the body it passes through untouched (a disconnect may come at any time)."""
    loop = asyncio.get_running_loop()
    deadline, read = loop.time() + seconds, False

    async def bounded():
        nonlocal read
        if read:
            return await receive()
        try:
            message = await asyncio.wait_for(receive(), max(deadline - loop.time(), 0))
        except TimeoutError:
            raise HTTPError(
                408, f"the request body did not arrive within {seconds:g} s (kubetune serve --timeout)"
            ) from None
        read = message["type"] != "http.request" or not message.get("more_body", False)
        return message

    return bounded
