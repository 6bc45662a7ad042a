"""The trainer's structured events, and the one fan-out that delivers them (rank 0 only).

The trainer says what happened as an ``Event`` (a kind, the step, the values, the bookkeeping); everything a
person or another program reads about a run is a rendering of those events by a ``Subscriber``:

- ``events.jsonl`` in the run's output (``EventFile``): every event, one JSON object per line;
- the human log lines (``HumanLog``): an evaluation's ``epoch E, step S: eval_loss ...``, the harness's ``step S:
  lm_eval ...``, the checkpoint, the stop and the ``done: ...`` line (Katib's StdOut collector reads its metrics
  from the evaluation, harness and done lines: their text is kept as it was);
- ``history.jsonl`` and TensorBoard (``loggers``), MLflow (``tracking``), ``progress.json`` with the progress
  line, the TrainJob's ``status.trainerStatus`` and the compact JSON lines ``kubetune status`` reads back from a
  cluster pod's log (``loggers.ProgressLogger``).

Kinds (``KINDS``): ``start`` (training begins or resumes), ``train`` (a log step's loss, learning rate and training
metrics), ``eval`` (the run's own evaluation), ``lm_eval`` (lm-evaluation-harness's scores), ``checkpoint``,
``stopped`` (a stop signal ended the run) and ``done`` (the artifacts are in place). ``progress`` is the progress
renderer's own record (rates and ETA added), which travels in the log for ``kubetune status``.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal, Protocol

log = logging.getLogger("kubetune.training.trainer")  # the logger the trainer's own lines always came from

Kind = Literal["start", "train", "eval", "lm_eval", "checkpoint", "stopped", "done", "progress"]
KINDS: tuple[Kind, ...] = ("start", "train", "eval", "lm_eval", "checkpoint", "stopped", "done", "progress")
RECORDS: tuple[Kind, ...] = ("train", "eval", "lm_eval")  # the kinds history.jsonl, TensorBoard and MLflow keep
EVENTS_FILE = "events.jsonl"
# The prefix of an event's line in the log (how a cluster pod's events reach `kubetune status`: its log is the
# only channel, read with no extra RBAC). Its JSON has no space after a name (compact separators), so Katib's
# collector, which reads `name value` and `name=value`, finds no metric in it.
LOG_PREFIX = "kubetune-event "
# Set (to "1") by a cluster pod's launcher (``kubetune launch``) for its workers: only there do the event lines go
# into the log, where `kubetune status` reads them; a local run's terminal keeps the human lines alone (its status
# reads progress.json).
LOG_EVENTS_ENV = "KUBETUNE_LOG_EVENTS"


@dataclass(frozen=True)
class Event:
    """One thing that happened in a run.

    Attributes:
        kind: one of ``KINDS``.
        step: the optimizer step it happened at.
        metrics: the values (a loss, an evaluation's scalars, the harness's scores, the final headline).
        context: the bookkeeping (epoch, samples, training and evaluation seconds, the output's URI, a
            checkpoint's path).
    """

    kind: Kind
    step: int
    metrics: dict[str, Any] = field(default_factory=dict)
    context: dict[str, Any] = field(default_factory=dict)

    def to_json(self) -> str:
        """One line of JSON (no newline), compact; a non-finite number as JSON's extension (``NaN``)."""
        return json.dumps(
            {"kind": self.kind, "step": self.step, "metrics": self.metrics, "context": self.context},
            separators=(",", ":"),
            default=str,
        )

    @classmethod
    def from_json(cls, text: str) -> Event | None:
        """The event of one JSON line, checked field by field (anything may have written it); None otherwise."""
        try:
            raw = json.loads(text)
        except ValueError:
            return None
        if not isinstance(raw, dict) or raw.get("kind") not in KINDS or type(raw.get("step")) is not int:
            return None
        metrics, context = raw.get("metrics"), raw.get("context")
        return cls(
            kind=raw["kind"],
            step=raw["step"],
            metrics=metrics if isinstance(metrics, dict) else {},
            context=context if isinstance(context, dict) else {},
        )


def log_line(event: Event) -> str:
    """The event as a log line's message: ``LOG_PREFIX`` and its JSON."""
    return LOG_PREFIX + event.to_json()


def events_in_log(lines: list[str]) -> list[Event]:
    """The events in log lines (``log_line``'s, behind any timestamp and rank), in order; other lines are skipped."""
    found = []
    for line in lines:
        _, sep, rest = line.partition(LOG_PREFIX)
        event = Event.from_json(rest) if sep else None
        if event is not None:
            found.append(event)
    return found


class Subscriber(Protocol):
    """A rendering of the events: it gets every event, in order, and is closed once when training ends."""

    def on_event(self, event: Event) -> None: ...

    def close(self) -> None: ...


class EventBus:
    """The fan-out from the trainer to its subscribers; empty (a no-op) on ranks other than 0."""

    def __init__(self, subscribers: list[Subscriber]):
        self.subscribers = subscribers
        self._closed = False

    def emit(self, event: Event) -> None:
        """Deliver ``event`` to every subscriber, in order."""
        for subscriber in self.subscribers:
            subscriber.on_event(event)

    def close(self) -> None:
        """Close every subscriber once (the export closes them before it reads history.jsonl; so does any other
        way training ends). The end's events (``stopped``, ``done``) still reach them after."""
        if self._closed:
            return
        self._closed = True
        for subscriber in self.subscribers:
            subscriber.close()


class EventFile:
    """``events.jsonl`` beside history.jsonl: every event, one JSON object per line. A fresh run starts it
    anew; a resumed run appends (its ``start`` event says from which step). Each line is written and closed at
    once (a few per log step), so the end's events still reach it after the other files are closed."""

    def __init__(self, out: Path, resumed: bool):
        self.path = out / EVENTS_FILE
        if not resumed:
            self.path.write_text("", encoding="utf-8")

    def on_event(self, event: Event) -> None:
        with self.path.open("a", encoding="utf-8") as f:
            f.write(event.to_json() + "\n")

    def close(self) -> None:
        pass


class HumanLog:
    """The run's own readable lines, rendered from its events (the text tests, docs and Katib's collector read)."""

    def __init__(self, headline: tuple[str, ...]):
        self.headline = headline  # the task's headline metrics: the evaluation line shows them after eval_loss

    def on_event(self, event: Event) -> None:
        m, step = event.metrics, event.step
        if event.kind == "eval":
            shown = " ".join(f"{k} {m[k]:.4f}" for k in ("eval_loss", *self.headline) if k in m)
            log.info("epoch %d, step %d: %s", event.context["epoch"], step, shown)
        elif event.kind == "lm_eval":
            logging.getLogger("kubetune.training.scoring").info(
                "step %d: lm_eval %s", step, ", ".join(f"{k} {v:.4f}" for k, v in m.items())
            )
        elif event.kind == "checkpoint":
            log.info("checkpoint at step %d: %s", step, event.context["path"])
        elif event.kind == "stopped":
            done = "checkpoint written — run the same job again to resume" if step else "nothing trained"
            log.warning("stopped on signal after step %d; %s", step, done)
        elif event.kind == "done":
            # the headline, and train_loss (a search's objective can be either: Katib reads them from this line)
            headline = ", ".join(f"{k} {v:.4f}" for k, v in m.items())
            c = event.context
            log.info("done: %s, %.1f samples/s; artifacts in %s", headline, c["samples_per_s"], c["output"])

    def close(self) -> None:
        pass


# ---- the run's phases (metrics.json's ``phases``, the report's rows) ----

# Set by kubetune's launchers for their workers (``kubetune run``, ``kubetune launch``): the wall-clock time (Unix
# seconds) the launcher's process started, so that a worker's phases count the whole run, the launcher's own
# start-up and checks included. A worker started otherwise counts from its own process's start.
RUN_STARTED_ENV = "KUBETUNE_RUN_STARTED"
PHASES = ("startup_s", "data_s", "training_s", "export_s", "total_s")
# beside them: the part of start-up before this worker's process started (the launcher's imports and checks)
LAUNCHER_S = "launcher_s"


def process_started(pid: int | str = "self") -> float:
    """The wall-clock time (Unix seconds) process ``pid`` started, from Linux's ``/proc``; elsewhere (or when
    ``/proc`` cannot be read), now."""
    import os
    import time

    try:
        # field 22 (after the command's parentheses, which may hold spaces): clock ticks after boot; against the
        # uptime read beside the clock (/proc/stat's boot time is whole seconds: up to one second off)
        ticks = int(Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[19])
        now, uptime = time.time(), float(Path("/proc/uptime").read_text().split()[0])
        return now - uptime + ticks / os.sysconf("SC_CLK_TCK")
    except (OSError, ValueError, IndexError):
        return time.time()


def run_started(environ: dict[str, str] | None = None) -> float:
    """When the run started, for this process's phases: its launcher's start (``RUN_STARTED_ENV``), else this
    process's own."""
    import os

    value = (os.environ if environ is None else environ).get(RUN_STARTED_ENV, "")
    try:
        return float(value)
    except ValueError:
        return process_started()


def phases(marks: dict[str, float]) -> dict[str, float]:
    """Pure: a run's phases in seconds (``PHASES``) from the wall-clock times of its milestones.

    ``marks``: ``started`` (the run's process started: ``run_started``), ``built`` (the trainer was built: data
    prepared, model loaded and wrapped, optimizer made), ``first_step`` (the first step's batch is in hand),
    ``last_step`` (the last step ended), ``end`` (the artifacts are written); optionally ``data_start`` and
    ``data_end`` around reading and tokenizing the data inside the build, and ``worker`` (this worker's process
    started: ``LAUNCHER_S`` is the time before it, part of start-up). Start-up is everything before the first
    step that is not data: imports, the process group, the output, the model; data is reading and tokenizing
    (when marked) plus waiting for the first batch; training runs from the first step to the last (evaluations
    and checkpoints between included); export from the last step to the end (the final evaluation, the export,
    the report).
    """
    prep = marks.get("data_end", 0.0) - marks.get("data_start", 0.0) if "data_start" in marks else 0.0
    data = prep + marks["first_step"] - marks["built"]
    out = {
        "startup_s": marks["built"] - marks["started"] - prep,
        "data_s": data,
        "training_s": marks["last_step"] - marks["first_step"],
        "export_s": marks["end"] - marks["last_step"],
        "total_s": marks["end"] - marks["started"],
        **({LAUNCHER_S: marks["worker"] - marks["started"]} if "worker" in marks else {}),
    }
    return {k: round(max(v, 0.0), 3) for k, v in out.items()}
