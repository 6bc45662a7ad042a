"""What a request's handler shares with the others: the server's bounds (``Limits``), the error a handler
raises (``HTTPError``), the Prometheus metrics, and ``Runner.compute``, which puts a request's items
through the batcher within the bounds: all queued or none (413 past the queue's size, 429 while it is
full), answered within the timeout (504), and given up as soon as its client has gone; a request given
up is stopped in the engine at its next token (``Batcher.on_cancel``) and counted by its reason."""

from __future__ import annotations

import asyncio
from collections.abc import Hashable, Mapping
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from starlette.exceptions import HTTPException as StarletteHTTPException

from kubetune.inference.server.batcher import Batcher, Feeder, QueueFull

CLIENT_GONE = 499  # nginx's "client closed request": counted, never seen by the client


@dataclass(frozen=True)
class Limits:
    """The server's bounds (``kubetune serve``'s options)."""

    max_batch: int = 8
    max_wait_ms: float = 10.0
    max_queue: int = 64
    timeout_s: float = 60.0
    max_request_bytes: int = 1 << 20
    max_tokens: int = 2048  # the most new tokens one request may ask for (also bounded by the context)
    header_timeout_s: float = 10.0  # the longest a client may take to send a request's headers


class HTTPError(StarletteHTTPException):
    """A request's own error: its status and one line (``kind``: OpenAI's error type; ``param``: the field).
    A Starlette HTTPException, so that one raised while FastAPI reads the body keeps its status."""

    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        headers: Mapping[str, str] | None = None,
    ):
        super().__init__(status, message, headers)
        self.status, self.message, self.kind, self.param = status, message, kind, param


def check_model(asked: str | None, name: str) -> None:
    """A request for a model this server does not serve: 404."""
    if asked is not None and asked != name:
        raise HTTPError(
            404, f"model {asked!r} is not served here; this server serves {name!r}", "model_not_found", "model"
        )


class Metrics:
    def __init__(self, batcher: Batcher | Feeder):
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("kubetune_requests", "Requests answered", ["endpoint", "status"], registry=r)
        self.latency = Histogram("kubetune_request_seconds", "Request latency", ["endpoint"], registry=r)
        self.tokens = Counter("kubetune_completion_tokens", "Completion tokens answered", registry=r)
        self.generated = Counter(
            "kubetune_generated_tokens", "Tokens the engine generated, for requests answered or given up", registry=r
        )
        self.cancelled = Counter(
            "kubetune_cancelled_requests", "Requests given up before their answer", ["reason"], registry=r
        )
        for reason in ("timeout", "disconnect"):
            self.cancelled.labels(reason)
        self.batch = Histogram(
            "kubetune_batch_size", "Requests per engine call", buckets=(1, 2, 4, 8, 16, 32, 64), registry=r
        )
        queue = Gauge("kubetune_queue_depth", "Requests waiting for a batch", registry=r)
        queue.set_function(lambda: batcher.depth)
        engine = Gauge("kubetune_engine_requests", "Requests the engine is computing now", registry=r)
        engine.set_function(lambda: batcher.running)


class Runner:
    """Puts requests through ``batcher`` within ``limits``, counting in ``metrics``."""

    def __init__(self, batcher: Batcher | Feeder, limits: Limits, metrics: Metrics):
        self.batcher, self.limits, self.metrics = batcher, limits, metrics

    async def compute(self, items: list[tuple[Any, Hashable]], noun: str, receive=None) -> list:
        """The results of a request's ``(payload, key)`` items, in order: ``enqueue`` then ``wait``."""
        return await self.wait(self.enqueue(items, noun), receive)

    def check_count(self, count: int, noun: str) -> None:
        """A request of ``count`` items (``noun``: what they are, for the message), checked before any work on them
        (200,000 one-character prompts fit a 1 MiB body, and took 6.8 s to tokenize before their 413).

        Raises:
            HTTPError: 413 more items than the queue holds.
        """
        if count > self.limits.max_queue:
            raise HTTPError(
                413,
                f"the request holds {count} {noun}; this server queues at most {self.limits.max_queue} "
                "(kubetune serve --max-queue); send fewer at a time",
            )

    def enqueue(self, items: list[tuple[Any, Hashable]], noun: str) -> list[asyncio.Future]:
        """Queue a request's items, all or none (``noun``: what they are, for the message).

        Raises:
            HTTPError: 413 more items than the queue holds, 429 the queue has no room for them now.
        """
        self.check_count(len(items), noun)
        try:
            return self.batcher.enqueue(items)
        except QueueFull:
            raise HTTPError(
                429, f"the queue is full ({self.limits.max_queue} waiting); retry later", "rate_limit_exceeded"
            ) from None

    async def wait(self, futures: list[asyncio.Future], receive=None) -> list:
        """The results of queued items, in order; ``receive``: the request's ASGI receive once its body is
        read, to notice its client going (a streaming response notices by itself).

        Raises:
            HTTPError: 504 no answer within the timeout, 499 the client has gone.
            Exception: an item's own error.
        """
        work = asyncio.gather(*futures)
        gone = asyncio.ensure_future(_disconnected(receive)) if receive is not None else None
        try:
            done, _ = await asyncio.wait(
                [work] + ([gone] if gone else []), timeout=self.limits.timeout_s, return_when=asyncio.FIRST_COMPLETED
            )
        except asyncio.CancelledError:  # the handler itself was cancelled (a streaming client gone)
            work.cancel()
            raise
        finally:
            if gone is not None:
                gone.cancel()
        if work in done:
            try:
                return work.result()
            except BaseException:
                for f in futures:  # the other items of a request that failed are not computed
                    f.cancel()
                raise
        work.cancel()  # cancels every item's future: dropped from the queue, stopped in the engine
        if gone is not None and gone in done:
            self.metrics.cancelled.labels("disconnect").inc()
            raise HTTPError(CLIENT_GONE, "the client closed the connection before the answer")
        self.metrics.cancelled.labels("timeout").inc()
        raise HTTPError(504, f"no answer within {self.limits.timeout_s:g} s (kubetune serve --timeout)", "timeout")


async def _disconnected(receive) -> None:
    """Returns once the client has gone: the body has been read, so ``receive`` waits for the disconnect."""
    while (await receive())["type"] != "http.disconnect":
        pass
