"""Metric loggers behind one ``log(kind, step, metrics, context)`` fan-out (rank 0 only).

``kind`` is "train" or "eval"; ``metrics`` are the values to plot; ``context`` is bookkeeping
(epoch, samples, training seconds) that the JSONL history keeps and plotting loggers skip.
"""

from __future__ import annotations

from pathlib import Path
from typing import Protocol

from kubetune import artifacts


class MetricLogger(Protocol):
    def log(self, kind: str, step: int, metrics: dict, context: dict) -> None: ...

    def close(self) -> None: ...


class JSONLLogger:
    """``history.jsonl``: one record per log step and per evaluation (artifacts.History)."""

    def __init__(self, out: Path, resume_step: int | None, saved: Path | None):
        self.history = artifacts.History(out, resume_step=resume_step, saved=saved)

    def log(self, kind: str, step: int, metrics: dict, context: dict) -> None:
        self.history.write({"type": kind, "step": step, **context, **metrics})

    def close(self) -> None:
        self.history.close()


class TensorBoardLogger:
    """``tensorboard/``: one scalar per float metric, as ``<kind>/<name>``."""

    def __init__(self, out: Path, resume_step: int | None):
        self.writer = artifacts.tensorboard_writer(out, purge_step=resume_step)

    def log(self, kind: str, step: int, metrics: dict, context: dict) -> None:
        for k, v in metrics.items():
            if isinstance(v, float):
                self.writer.add_scalar(f"{kind}/{k.removeprefix('eval_')}", v, step)

    def close(self) -> None:
        self.writer.close()


class Loggers:
    """Fan-out to every logger; empty (a no-op) on ranks other than 0."""

    def __init__(self, loggers: list[MetricLogger]):
        self.loggers = loggers

    def log(self, kind: str, step: int, metrics: dict, context: dict | None = None) -> None:
        for logger in self.loggers:
            logger.log(kind, step, metrics, context or {})

    def close(self) -> None:
        for logger in self.loggers:
            logger.close()
