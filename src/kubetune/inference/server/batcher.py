"""Batching for ``kubetune serve``. ``Batcher`` (an engine that computes a list at a time: the classifier):
requests wait in a bounded queue; one worker thread takes the oldest, gathers the requests that may share its
batch (``key``) that arrive within ``max_wait_s``, up to ``max_batch``, runs them in one call of the engine and
hands each request its result (or its own error). ``Feeder`` (an engine that batches continuously:
``generation.Engine``): each request goes to the engine at once, which admits it at its next step; the same
bounded queue (the requests not yet admitted), the same futures.

A request's items are queued all at once or not at all (a refused request leaves nothing behind), and
a request given up (timed out, its client gone) is not computed: it is dropped from the queue, and
``on_cancel`` tells the engine to stop it within a batch already running.

Why our own (about 150 lines) rather than a library's: KServe's model server batches in its own
process model (ray/agents) and the ASGI frameworks have none; what a bounded queue answering 429,
a wait bound and grouping by sampling need is a queue and a thread."""

from __future__ import annotations

import asyncio
import collections
import functools
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any


class QueueFull(Exception):
    """The queue has no room for all of a request's items: the server answers 429."""


@dataclass
class _Item:
    payload: Any
    key: Hashable
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.monotonic)


class Batcher:
    """``enqueue([(payload, key), ...])`` -> one future per payload, done with what ``run([payloads])`` did
    for it: ``run`` fills each payload in place (returns None), or returns one result per payload, where
    an exception is that payload's own error (the batch's others are answered)."""

    def __init__(
        self,
        run: Callable[[list], list | None],
        max_batch: int,
        max_wait_s: float,
        max_queue: int,
        on_batch: Callable[[list], None] | None = None,
        on_cancel: Callable[[Any], None] | None = None,
    ):
        self.run, self.max_batch, self.max_wait_s, self.max_queue = run, max_batch, max_wait_s, max_queue
        self.on_batch, self.on_cancel = on_batch, on_cancel
        self.running = 0  # requests in the engine call now going on
        self._queue: collections.deque[_Item] = collections.deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._work, name="kubetune-batcher", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting (not yet in a batch)."""
        return len(self._queue)

    def enqueue(self, items: list[tuple[Any, Hashable]]) -> list[asyncio.Future]:
        """Queue a request's ``(payload, key)`` items together, from the event loop's thread.

        Returns:
            One future per item; cancelling one drops its item (and calls ``on_cancel`` with its payload).

        Raises:
            QueueFull: the queue has no room for all of them; none was queued.
        """
        loop = asyncio.get_running_loop()
        queued = [_Item(payload, key, loop.create_future(), loop) for payload, key in items]
        with self._cond:
            if len(self._queue) + len(queued) > self.max_queue:
                raise QueueFull
            self._queue.extend(queued)
            self._cond.notify()
        if self.on_cancel is not None:
            for item in queued:
                item.future.add_done_callback(functools.partial(_cancelled, self, item.payload))
        return [item.future for item in queued]

    async def submit(self, payload, key: Hashable = None):
        """One payload's result once its batch has run.

        Raises:
            QueueFull: ``max_queue`` requests are waiting.
            Exception: the payload's own error, or what ``run`` raised for its batch.
        """
        [future] = self.enqueue([(payload, key)])
        return await future

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._cond.notify()
        self._thread.join(timeout=5)

    def _take(self) -> list[_Item] | None:
        """The next batch: the oldest request and, within ``max_wait_s`` of its arrival, others of its key."""
        with self._cond:
            while not self._queue and not self._stopped:
                self._cond.wait()
            if self._stopped:
                return None
            first = self._queue.popleft()
            batch = [first]
            deadline = first.enqueued + self.max_wait_s
            while len(batch) < self.max_batch:
                same = next((i for i in self._queue if i.key == first.key), None)
                if same is not None:
                    self._queue.remove(same)
                    batch.append(same)
                    continue
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)
            return [i for i in batch if not i.future.cancelled()]  # a request given up is not computed

    def _work(self) -> None:
        while (batch := self._take()) is not None:
            if not batch:
                continue
            self.running = len(batch)
            payloads = [i.payload for i in batch]
            try:
                results = self.run(payloads)
            except Exception as e:  # the batch's requests all get the error; the worker goes on
                results = [e] * len(batch)
            if self.on_batch is not None:
                self.on_batch(payloads)
            self.running = 0  # after on_batch: what the batch did is counted once the engine is idle
            for k, i in enumerate(batch):
                result = results[k] if results is not None else i.payload
                i.loop.call_soon_threadsafe(_set, i.future, result)


def _set(future: asyncio.Future, result) -> None:
    if future.done():  # cancelled: its request was given up
        return
    if isinstance(result, BaseException):
        future.set_exception(result)
    else:
        future.set_result(result)


class Feeder:
    """``Batcher``'s interface over a continuous engine (``start(slots, on_step)``, ``submit(payload, done)``,
    ``close``, and its ``waiting`` and ``running`` counts): ``enqueue`` hands the payloads to the engine at once,
    and each future is done when the engine calls back (the payload, or its ``error``). ``on_done(payload)``
    for each payload done; ``on_step(n)`` after each engine step of ``n`` requests."""

    def __init__(self, engine, max_batch: int, max_queue: int, on_done=None, on_cancel=None, on_step=None):
        self.engine, self.max_queue, self.on_done, self.on_cancel = engine, max_queue, on_done, on_cancel
        self._lock = threading.Lock()
        engine.start(max_batch, on_step)

    @property
    def depth(self) -> int:
        """Requests waiting for a slot in the engine."""
        return self.engine.waiting

    @property
    def running(self) -> int:
        """Requests in flight in the engine."""
        return self.engine.running

    def enqueue(self, items: list[tuple[Any, Hashable]]) -> list[asyncio.Future]:
        """As ``Batcher.enqueue``; the queue is the engine's requests not yet admitted."""
        loop = asyncio.get_running_loop()
        futures = [loop.create_future() for _ in items]
        with self._lock:
            if self.engine.waiting + len(items) > self.max_queue:
                raise QueueFull
            for (payload, _), future in zip(items, futures):
                self.engine.submit(payload, lambda g, f=future: loop.call_soon_threadsafe(self._done, f, g))
        if self.on_cancel is not None:
            for (payload, _), future in zip(items, futures):
                future.add_done_callback(functools.partial(_cancelled, self, payload))
        return futures

    async def submit(self, payload, key: Hashable = None):
        [future] = self.enqueue([(payload, key)])
        return await future

    def close(self) -> None:
        self.engine.close()

    def _done(self, future: asyncio.Future, payload) -> None:
        if self.on_done is not None:
            self.on_done(payload)
        error = getattr(payload, "error", None)
        _set(future, error if error is not None else payload)


def _cancelled(owner: Batcher | Feeder, payload: Any, future: asyncio.Future[Any]) -> None:
    """A future's done callback: a cancelled one's payload goes to its owner's ``on_cancel``."""
    if future.cancelled() and owner.on_cancel is not None:
        owner.on_cancel(payload)
