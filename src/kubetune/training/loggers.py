"""Metric loggers behind one ``log(kind, step, metrics, context)`` fan-out (rank 0 only).

``kind`` is "train", "eval" or "lm_eval" (lm-evaluation-harness's scores); ``metrics`` are the values to
plot; ``context`` is bookkeeping (epoch, samples, training seconds) that the JSONL history keeps and
plotting loggers skip.
"""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Protocol

from kubetune import artifacts

log = logging.getLogger("kubetune.progress")

PROGRESS = "progress.json"


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
        # Events after the checkpoint's step are hidden; those at it stay (its training log and an evaluation made
        # before the checkpoint are not made again; an epoch's last evaluation, made after it, comes again as the
        # same point).
        self.writer = artifacts.tensorboard_writer(out, purge_step=None if resume_step is None else resume_step + 1)

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
        """Close every logger once (the export closes them; so does any other way training ends)."""
        loggers, self.loggers = self.loggers, []
        for logger in loggers:
            logger.close()


class ProgressLogger:
    """Readable progress: a plain log line per logged step, whether or not stderr is a terminal (no
    ``\\r``; the tqdm bar is drawn on a terminal only), and ``progress.json``, atomically replaced,
    with the same fields and the last evaluation: what ``kubetune status`` shows.

    The line is ``progress: step=40/200 epoch=1/3 loss=0.6931 lr=2.00e-05 samples/s=91.2
    tokens/s=5400 eta=1m32s``: key=value pairs, so ``parse_line`` reads it back from a pod's log
    (how a cluster job's progress reaches ``kubetune status``, with no extra RBAC)."""

    def __init__(self, out: Path, total_steps: int, epochs: int, start_step: int, status=None):
        """``status``: a ``trainer_status.StatusReporter`` that gets every record written here (the
        TrainJob's ``status.trainerStatus``), from this one at the start to the final one; or None."""
        self.path = out / PROGRESS
        self.status = status
        self.total, self.epochs = total_steps, epochs
        # rates over the last interval; the ETA from this session's steps (a resumed run's first
        # steps are not slowed by the earlier session's)
        self.t0, self.step0 = time.monotonic(), start_step
        self.last = (self.t0, None, None)
        self.record: dict = {"phase": "training", "step": start_step, "total_steps": total_steps}
        previous = _read(self.path)
        for key in ("last_eval", "lm_eval"):  # a resumed run's
            if previous.get(key):
                self.record[key] = previous[key]
        if self.status is not None:  # the start (a resumed run: where it resumes)
            self.status.update(self.record)

    def log(self, kind: str, step: int, metrics: dict, context: dict) -> None:
        now = time.monotonic()
        if kind == "lm_eval":  # the harness's scores: beside the run's own evaluation, as ``lm_eval``
            t, samples, tokens = self.last
            self.last = (t + context.get("eval_s", 0.0), samples, tokens)
            self.record["lm_eval"] = {"step": step, **{k: v for k, v in metrics.items() if isinstance(v, float)}}
            self._write()
            return
        if kind == "eval":
            # the next line's samples/s and tokens/s are training rates: the evaluation's time is not in them
            t, samples, tokens = self.last
            self.last = (t + context.get("eval_s", 0.0), samples, tokens)
            self.record["last_eval"] = {"step": step, **{k: v for k, v in metrics.items() if isinstance(v, float)}}
            self.record["phase"] = "training" if step < self.total else "finishing"
            self._write()
            return
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

    def finish(self, phase: str, **extra) -> None:
        self.record.update(phase=phase, updated=time.time(), **extra)
        self._write(final=True)

    def _write(self, final: bool = False) -> None:
        artifacts.write_atomic(self.path, json.dumps(self.record, indent=1) + "\n")
        if self.status is not None:
            self.status.update(self.record, final=final)

    def close(self) -> None:
        pass


# The progress line's fields after step (and epoch): record key, label, format; parse_line reads them back.
_LINE_FIELDS = (
    ("loss", "loss", "{:.4f}"),
    ("lr", "lr", "{:.2e}"),
    ("samples_per_s", "samples/s", "{:.1f}"),
    ("tokens_per_s", "tokens/s", "{:.0f}"),
)


_LABELS = {label: key for key, label, _ in _LINE_FIELDS}


def format_line(rec: dict) -> str:
    parts = [f"step={rec['step']}/{rec['total_steps']}"]
    if rec.get("epoch") is not None:
        parts.append(f"epoch={rec['epoch']}/{rec['epochs']}")
    parts += [f"{label}={fmt.format(rec[key])}" for key, label, fmt in _LINE_FIELDS if rec.get(key) is not None]
    if rec.get("eta_s") is not None:
        parts.append(f"eta={duration(rec['eta_s'])}")
    return " ".join(parts)


def duration(seconds: float) -> str:
    s = int(round(seconds))
    h, m, s = s // 3600, s // 60 % 60, s % 60
    return f"{h}h{m:02d}m" if h else f"{m}m{s:02d}s" if m else f"{s}s"


def _seconds(text: str) -> float:
    total, num = 0.0, ""
    for ch in text:
        if ch.isdigit() or ch == ".":
            num += ch
        else:
            total += float(num or 0) * {"h": 3600, "m": 60, "s": 1}[ch]
            num = ""
    return total


def parse_line(line: str) -> dict | None:
    """The progress record of a ``progress:`` log line (as written by ``ProgressLogger``), else None."""
    _, sep, rest = line.partition("progress: ")
    if not sep:
        return None
    rec: dict = {"phase": "training"}
    try:
        for pair in rest.split():
            key, _, value = pair.partition("=")
            if key in ("step", "epoch"):
                done, _, total = value.partition("/")
                rec[key] = int(done)
                rec["total_steps" if key == "step" else "epochs"] = int(total)
            elif key == "eta":
                rec["eta_s"] = _seconds(value)
            elif key in _LABELS:
                rec[_LABELS[key]] = float(value)
    except (ValueError, KeyError):
        return None
    return rec if "step" in rec else None


def _read(path: Path) -> dict:
    """The progress record in ``path``, checked field by field (what status prints and sends as JSON):
    {} when there is none, or it is not a bounded regular file holding a JSON object."""
    from kubetune.paths import BrokenRecord, read_bounded_json

    try:
        raw = read_bounded_json(path, constants=True)  # Infinity in one field leaves the others
    except (OSError, BrokenRecord):
        return {}
    return _checked_progress(raw) if isinstance(raw, dict) else {}


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _checked_progress(raw: dict) -> dict:
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


def read_progress(out: Path) -> dict | None:
    """``progress.json`` of an output directory, checked, or None."""
    return _read(out / PROGRESS) or None


def progress_from_log(lines: list[str]) -> dict | None:
    """Rank 0's progress read back from its log: the last ``progress:`` line, with the last
    evaluation line (``epoch E, step S: eval_loss X ...``) as ``last_eval``, the last harness line
    (``step S: lm_eval task/acc X, ...``) as ``lm_eval`` and, once the run is
    done, the headline ``metrics`` and ``output`` of its ``done:`` line; None without any."""
    import re

    record, last_eval, done, harness = None, None, None, None
    evaluation = re.compile(r"epoch \d+, step (\d+): ((?:eval_\w+ \S+ ?)+)$")
    scored = re.compile(r"step (\d+): lm_eval ((?:\S+ [-+.\deE]+(?:, )?)+)$")  # Trainer.harness_evaluate's line
    finished = re.compile(r"done: ((?:\w+ [-+.\deE]+, )+)[\d.]+ samples/s; artifacts in (\S+)")
    for line in lines:
        m = finished.search(line)
        if m:
            pairs = [p.split() for p in m.group(1).rstrip(", ").split(", ")]
            done = {"metrics": {k: float(v) for k, v in pairs}, "output": m.group(2)}
            continue
        found = parse_line(line)
        if found:
            record = found
            continue
        m = scored.search(line.rstrip())
        if m:
            pairs = [p.split() for p in m.group(2).split(", ")]
            try:
                harness = {"step": int(m.group(1)), **{k: float(v) for k, v in pairs}}
            except ValueError:
                pass
            continue
        m = evaluation.search(line.rstrip())
        if m:
            pairs = m.group(2).split()
            try:
                last_eval = {"step": int(m.group(1)), **{k: float(v) for k, v in zip(pairs[::2], pairs[1::2])}}
            except ValueError:
                pass
    if record is None and last_eval is None and done is None and harness is None:
        return None
    record = record or {}
    if last_eval:
        record["last_eval"] = last_eval
    if harness:
        record["lm_eval"] = harness
    if done:
        record.update(phase="succeeded", **done)
    return record
