"""The renderings of the trainer's events that keep records (rank 0 only): ``history.jsonl`` (``JSONLLogger``),
TensorBoard (``TensorBoardLogger``) and the run's progress (``ProgressLogger``: the progress line, ``progress.json``,
the TrainJob's ``status.trainerStatus``, and the compact event lines ``progress_from_events`` reads back from a
cluster pod's log for ``kubetune status``).

A record's ``metrics`` are the values to plot; its ``context`` is bookkeeping (epoch, samples, training seconds)
that the JSONL history keeps and plotting loggers skip. The events themselves: ``training.events``.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kubetune import artifacts
from kubetune.training.events import RECORDS, Event, events_in_log, log_line

if TYPE_CHECKING:
    from kubetune.training.trainer_status import StatusReporter

log = logging.getLogger("kubetune.progress")

PROGRESS = "progress.json"
Record = dict[str, Any]


class JSONLLogger:
    """``history.jsonl``: one record per log step and per evaluation (artifacts.History)."""

    def __init__(self, out: Path, resume_step: int | None, saved: Path | None):
        self.history = artifacts.History(out, resume_step=resume_step, saved=saved)

    def on_event(self, event: Event) -> None:
        if event.kind in RECORDS:
            self.history.write({"type": event.kind, "step": event.step, **event.context, **event.metrics})

    def close(self) -> None:
        self.history.close()


class TensorBoardLogger:
    """``tensorboard/``: one scalar per float metric, as ``<kind>/<name>``."""

    def __init__(self, out: Path, resume_step: int | None):
        # Events after the checkpoint's step are hidden; those at it stay (its training log and an evaluation made
        # before the checkpoint are not made again; an epoch's last evaluation, made after it, comes again as the
        # same point).
        self.writer = artifacts.tensorboard_writer(out, purge_step=None if resume_step is None else resume_step + 1)

    def on_event(self, event: Event) -> None:
        if event.kind not in RECORDS:
            return
        for k, v in event.metrics.items():
            if isinstance(v, float):
                self.writer.add_scalar(f"{event.kind}/{k.removeprefix('eval_')}", v, event.step)

    def close(self) -> None:
        self.writer.close()


class ProgressLogger:
    """Readable progress: a plain log line per logged step, whether or not stderr is a terminal (no
    ``\\r``; the tqdm bar is drawn on a terminal only), and ``progress.json``, atomically replaced,
    with the same fields and the last evaluation: what ``kubetune status`` shows.

    The line is ``progress: step=40/200 epoch=1/3 loss=0.6931 lr=2.00e-05 samples/s=91.2
    tokens/s=5400 eta=1m32s``. Beside it, in a cluster pod, what status needs travels as compact event lines
    (``events.log_line``): the ``progress`` record of each log step (these fields), each evaluation's and
    harness's scalars, and the end (``done``: the headline and the output; ``stopped``). ``progress_from_events``
    folds them back into the record from a cluster pod's log (its only channel, with no extra RBAC) with
    ``json.loads``, never from the text."""

    def __init__(
        self,
        out: Path,
        total_steps: int,
        epochs: int,
        start_step: int,
        status: StatusReporter | None = None,
        log_events: bool = False,
    ):
        """``status``: a ``trainer_status.StatusReporter`` that gets every record written here (the
        TrainJob's ``status.trainerStatus``), from this one at the start to the final one; or None.
        ``log_events``: the event lines go into the log too (a cluster pod's: ``events.LOG_EVENTS_ENV``)."""
        self.log_events = log_events
        self.path = out / PROGRESS
        self.status = status
        self.total, self.epochs = total_steps, epochs
        # rates over the last interval; the ETA from this session's steps (a resumed run's first
        # steps are not slowed by the earlier session's)
        self.t0, self.step0 = time.monotonic(), start_step
        self.last: tuple[float, int | None, int | None] = (self.t0, None, None)
        self.record: Record = {"phase": "training", "step": start_step, "total_steps": total_steps}
        previous = _read(self.path)
        for key in ("last_eval", "lm_eval"):  # a resumed run's
            if previous.get(key):
                self.record[key] = previous[key]
        if self.status is not None:  # the start (a resumed run: where it resumes)
            self.status.update(self.record)

    def on_event(self, event: Event) -> None:
        kind, step, metrics, context = event.kind, event.step, event.metrics, event.context
        if kind == "done":
            headline = {k: metrics[k] for k in context["headline"]}
            self.finish("succeeded", metrics=headline, output=context["output"])
            self._log_event(Event("done", step, headline, {"output": context["output"]}))
            return
        if kind == "stopped":
            self.finish("stopped")
            self._log_event(event)
            return
        if kind not in RECORDS:
            return
        now = time.monotonic()
        if kind in ("eval", "lm_eval"):
            # the next line's samples/s and tokens/s are training rates: the evaluation's time is not in them
            t, samples, tokens = self.last
            self.last = (t + context.get("eval_s", 0.0), samples, tokens)
            scalars = {k: v for k, v in metrics.items() if isinstance(v, float)}
            if kind == "lm_eval":  # the harness's scores: beside the run's own evaluation, as ``lm_eval``
                self.record["lm_eval"] = {"step": step, **scalars}
            else:
                self.record["last_eval"] = {"step": step, **scalars}
                self.record["phase"] = "training" if step < self.total else "finishing"
            self._write()
            self._log_event(Event(kind, step, scalars))
            return
        self._train(step, metrics, context, now)

    def _train(self, step: int, metrics: Record, context: Record, now: float) -> None:
        t, samples, tokens = self.last
        dt = max(now - t, 1e-9)
        rec = self.record
        rec.update(step=step, epoch=context.get("epoch"), epochs=self.epochs, loss=metrics.get("loss"))
        rec["lr"] = metrics.get("lr")
        rec["samples_per_s"] = (context["samples"] - samples) / dt if samples is not None else None
        rec["tokens_per_s"] = (context["tokens"] - tokens) / dt if tokens is not None and "tokens" in context else None
        done = step - self.step0
        rec["eta_s"] = (self.total - step) * (now - self.t0) / done if done > 0 else None
        rec["phase"] = "training" if step < self.total else "finishing"
        rec["updated"] = time.time()
        self.last = (now, context.get("samples"), context.get("tokens"))
        log.info("progress: %s", format_line(rec))
        self._write()
        shown = {k: rec[k] for k in _PROGRESS_KEYS if rec.get(k) is not None}
        self._log_event(Event("progress", step, context=shown))

    def _log_event(self, event: Event) -> None:
        if self.log_events:
            log.info("%s", log_line(event))

    def finish(self, phase: str, **extra: Any) -> None:
        self.record.update(phase=phase, updated=time.time(), **extra)
        self._write(final=True)

    def _write(self, final: bool = False) -> None:
        artifacts.write_atomic(self.path, json.dumps(self.record, indent=1) + "\n")
        if self.status is not None:
            self.status.update(self.record, final=final)

    def close(self) -> None:
        pass


# The progress line's fields after step (and epoch): record key, label, format.
_LINE_FIELDS = (
    ("loss", "loss", "{:.4f}"),
    ("lr", "lr", "{:.2e}"),
    ("samples_per_s", "samples/s", "{:.1f}"),
    ("tokens_per_s", "tokens/s", "{:.0f}"),
)
# What a ``progress`` event line carries: the record's top-level fields the progress line shows
_PROGRESS_KEYS = ("phase", "step", "total_steps", "epoch", "epochs", *(k for k, _, _ in _LINE_FIELDS), "eta_s")


def format_line(rec: Record) -> str:
    """The progress line of a progress record (``step=40/200 epoch=1/3 loss=0.6931 ...``)."""
    parts = [f"step={rec['step']}/{rec['total_steps']}"]
    if rec.get("epoch") is not None:
        parts.append(f"epoch={rec['epoch']}/{rec['epochs']}")
    parts += [f"{label}={fmt.format(rec[key])}" for key, label, fmt in _LINE_FIELDS if rec.get(key) is not None]
    if rec.get("eta_s") is not None:
        parts.append(f"eta={duration(rec['eta_s'])}")
    return " ".join(parts)


def duration(seconds: float) -> str:
    """``seconds`` as ``1h02m``, ``3m05s`` or ``42s``."""
    s = int(round(seconds))
    h, m, s = s // 3600, s // 60 % 60, s % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _read(path: Path) -> Record:
    """The progress record in ``path``, checked field by field (what status prints and sends as JSON):
    {} when there is none, or it is not a bounded regular file holding a JSON object."""
    from kubetune.paths import BrokenRecord, read_bounded_json

    try:
        raw = read_bounded_json(path, constants=True)  # Infinity in one field leaves the others
    except (OSError, BrokenRecord):
        return {}
    return _checked_progress(raw) if isinstance(raw, dict) else {}


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _checked_progress(raw: Record) -> Record:
    """The fields of a progress record that have the types ProgressLogger writes; others are dropped."""
    counts = ("step", "total_steps", "epoch", "epochs")
    rec = {k: raw[k] for k in counts if type(raw.get(k)) is int and 0 <= raw[k] < 2**63}
    rec.update({k: raw[k] for k in ("loss", "lr", "samples_per_s", "tokens_per_s", "updated") if _number(raw.get(k))})
    if _number(raw.get("eta_s")) and 0 <= raw["eta_s"] < 1e9:  # 30 years
        rec["eta_s"] = raw["eta_s"]
    if isinstance(raw.get("phase"), str):
        rec["phase"] = raw["phase"][:40]
    if isinstance(raw.get("output"), str):
        rec["output"] = raw["output"][:4096]
    for key in ("last_eval", "lm_eval", "metrics"):
        value = raw.get(key)
        if isinstance(value, dict):
            metrics = {str(k)[:80]: v for k, v in list(value.items())[:64] if _number(v) and k != "step"}
            if key != "metrics":
                if type(value.get("step")) is not int:
                    continue
                metrics = {"step": value["step"], **{k: float(v) for k, v in metrics.items()}}
            rec[key] = metrics
    if "step" in rec and "total_steps" not in rec:  # the progress line needs both
        del rec["step"]
    if "epoch" in rec and "epochs" not in rec:
        del rec["epoch"]
    return rec


def read_progress(out: Path) -> Record | None:
    """``progress.json`` of an output directory, checked, or None."""
    return _read(out / PROGRESS) or None


def progress_from_events(lines: list[str]) -> Record | None:
    """Rank 0's progress read back from its log's event lines (``ProgressLogger``'s, ``json.loads`` each): the
    last ``progress`` record, the last ``eval`` as ``last_eval``, the last ``lm_eval`` as ``lm_eval`` and, once
    the run is done, its headline ``metrics`` and ``output`` (``stopped``: the phase); checked field by field as
    progress.json is. None without any."""
    record: Record = {}
    seen = False
    for event in events_in_log(lines):
        seen = True
        if event.kind == "progress":
            kept = {k: v for k, v in record.items() if k in ("last_eval", "lm_eval")}
            record = {"phase": "training", **event.context, **kept}
        elif event.kind == "eval":
            record["last_eval"] = {"step": event.step, **event.metrics}
        elif event.kind == "lm_eval":
            record["lm_eval"] = {"step": event.step, **event.metrics}
        elif event.kind == "done":
            record.update(phase="succeeded", metrics=event.metrics, output=event.context.get("output"))
        elif event.kind == "stopped":
            record["phase"] = "stopped"
    return _checked_progress(record) if seen else None
