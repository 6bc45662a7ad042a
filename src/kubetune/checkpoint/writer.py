"""The background writer of asynchronous checkpoints (``training.checkpoint_async``): one checkpoint in flight at a
time per checkpoint directory, written by a thread while training goes on, its error raised where it is waited for.

A checkpoint's state reaches the writer as a snapshot (host-memory copies the step no longer changes: ``snapshot``),
so the step waits only for the copy. The writer builds the checkpoint under a temporary name and renames it into
place after its ``COMPLETE`` marker, as a synchronous save does: a process killed while a checkpoint is in flight
leaves the previous one whole and the new one absent.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

# Test-only: "STEP:DIR" holds the writer of checkpoint STEP before its marker while DIR/held exists (the writer
# creates it), so that a test can kill the process with that save in flight, deterministically.
HOLD_ENV = "KUBETUNE_TEST_CHECKPOINT_HOLD"


class Writer:
    """Runs one job at a time in a background thread; ``submit`` and ``wait`` come from one (the training) thread."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    @property
    def in_flight(self) -> bool:
        """Whether a job is still running."""
        return self._thread is not None and self._thread.is_alive()

    def submit(self, job: Callable[[], None], name: str) -> None:
        """Start ``job`` in the background once the one in flight is done (its error raised here first)."""
        self.wait()

        def run() -> None:
            try:
                job()
            except BaseException as e:  # kept for the training thread, which raises it at its next wait
                self._error = e

        # daemon: a run that fails ends its process without waiting for a checkpoint it no longer needs
        self._thread = threading.Thread(target=run, name=name, daemon=True)
        self._thread.start()

    def wait(self) -> None:
        """Until the job in flight is done.

        Raises:
            BaseException: the error the job ended with (raised once).
        """
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        error, self._error = self._error, None
        if error is not None:
            raise error


# One writer per checkpoint directory in this process: the run's ``Output`` makes a new ``CheckpointStore`` at every
# access, and every one of them must see the checkpoint in flight.
_WRITERS: dict[Path, Writer] = {}
_LOCK = threading.Lock()


def writer_for(root: Path) -> Writer:
    """The background writer of the checkpoints under ``root`` (made on first use)."""
    with _LOCK:
        return _WRITERS.setdefault(root.resolve(), Writer())


def snapshot(state: Any) -> Any:
    """A copy of ``state`` that nothing the training does afterwards changes: every tensor copied into host memory
    (a CPU tensor cloned), every dict, list and tuple rebuilt; other values (numbers, strings) are immutable or
    shared as they are."""
    import torch

    if isinstance(state, torch.Tensor):
        return state.detach().to("cpu", copy=True)
    if isinstance(state, dict):
        return {k: snapshot(v) for k, v in state.items()}
    if isinstance(state, list):
        return [snapshot(v) for v in state]
    if isinstance(state, tuple):
        return tuple(snapshot(v) for v in state)
    return state


def hold(step: int) -> None:
    """Test-only (``HOLD_ENV``): hold the writer of checkpoint ``step`` while the test's file exists."""
    value = os.environ.get(HOLD_ENV, "")
    held_step, _, where = value.partition(":")
    if not value or not held_step.isdigit() or int(held_step) != step:
        return
    flag = Path(where) / "held"
    flag.touch()
    log.warning("checkpoint step %d held by %s until %s is removed", step, HOLD_ENV, flag)
    while flag.exists():
        time.sleep(0.05)
