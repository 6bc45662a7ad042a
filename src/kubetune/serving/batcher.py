"""Dynamic batching for ``kubetune serve``: requests wait in a bounded queue; one worker thread takes the
oldest, gathers the requests that may share its batch (``key``) that arrive within ``max_wait_s``, up to
``max_batch``, runs them in one call of the engine and hands each request its result.

Why our own (about 100 lines) rather than a library's: KServe's model server batches in its own
process model (ray/agents) and the ASGI frameworks have none; what a bounded queue answering 429,
a wait bound and grouping by sampling need is a queue and a thread."""

from __future__ import annotations

import asyncio
import collections
import threading
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Any


class QueueFull(Exception):
    """The queue holds ``max_queue`` requests: the server answers 429."""


@dataclass
class _Item:
    payload: Any
    key: Hashable
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    enqueued: float = field(default_factory=time.monotonic)


class Batcher:
    """``await submit(payload, key)`` -> what ``run([payloads])`` did for it (``run`` fills each payload in
    place, or returns one result per payload)."""

    def __init__(
        self,
        run: Callable[[list], list | None],
        max_batch: int,
        max_wait_s: float,
        max_queue: int,
        on_batch: Callable[[int], None] | None = None,
    ):
        self.run, self.max_batch, self.max_wait_s, self.max_queue = run, max_batch, max_wait_s, max_queue
        self.on_batch = on_batch
        self._queue: collections.deque[_Item] = collections.deque()
        self._cond = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._work, name="kubetune-batcher", daemon=True)
        self._thread.start()

    @property
    def depth(self) -> int:
        """Requests waiting (not yet in a batch)."""
        return len(self._queue)

    async def submit(self, payload, key: Hashable = None):
        """This payload's result once its batch has run.

        Raises:
            QueueFull: ``max_queue`` requests are waiting.
            Exception: what ``run`` raised for its batch.
        """
        loop = asyncio.get_running_loop()
        item = _Item(payload, key, loop.create_future(), loop)
        with self._cond:
            if len(self._queue) >= self.max_queue:
                raise QueueFull
            self._queue.append(item)
            self._cond.notify()
        return await item.future

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
            return [i for i in batch if not i.future.cancelled()]  # a timed-out request is not computed

    def _work(self) -> None:
        while (batch := self._take()) is not None:
            if not batch:
                continue
            if self.on_batch is not None:
                self.on_batch(len(batch))
            try:
                results = self.run([i.payload for i in batch])
            except Exception as e:  # the batch's requests all get the error; the worker goes on
                for i in batch:
                    i.loop.call_soon_threadsafe(_set, i.future, None, e)
                continue
            for k, i in enumerate(batch):
                i.loop.call_soon_threadsafe(_set, i.future, results[k] if results is not None else i.payload, None)


def _set(future: asyncio.Future, result, error: BaseException | None) -> None:
    if future.done():  # cancelled by its request's timeout
        return
    if error is not None:
        future.set_exception(error)
    else:
        future.set_result(result)
