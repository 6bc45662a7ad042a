"""Issue 64, items 3 and 4: the trainer's periodic duties go through one typed hook interface, and what happens in
a run is emitted as structured events that the human lines, history.jsonl, progress.json and `status` render.

One real run in this process (world size 1, the tiny MiniLM, 4 steps: evaluation every 2, a checkpoint every 2),
shared by the tests of this module."""

from __future__ import annotations

import json
import logging
import re

import pytest
import torch
from conftest import tiny_spec

from kubetune import tasks
from kubetune.artifacts.output import Output
from kubetune.config import parse_spec
from kubetune.distributed import DistEnv
from kubetune.training.build import build_trainer
from kubetune.training.events import (
    EVENTS_FILE,
    KINDS,
    LOG_EVENTS_ENV,
    LOG_PREFIX,
    RECORDS,
    Event,
    events_in_log,
    log_line,
)
from kubetune.training.hooks import Hook, Metrics, Run
from kubetune.training.loggers import progress_from_events, read_progress


class Recorder(Hook):
    """A custom duty: what it saw, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, int]] = []

    def on_train_start(self, run: Run) -> None:
        self.seen.append(("start", run.state.global_step))

    def on_evaluate(self, run: Run, metrics: Metrics) -> None:
        assert "eval_loss" in metrics
        self.seen.append(("evaluate", run.state.global_step))

    def on_save(self, run: Run, step: int) -> None:
        self.seen.append(("save", step))

    def on_train_end(self, run: Run, metrics: Metrics) -> None:
        assert metrics["global_step"] == run.state.global_step
        self.seen.append(("end", run.state.global_step))

    def on_exported(self, run: Run, metrics: Metrics, model: torch.nn.Module | None) -> None:
        assert model is not None  # world size 1: this rank writes
        self.seen.append(("exported", run.state.global_step))

    def on_artifacts(self, run: Run, staged) -> None:
        (staged / "seen.txt").write_text("the hook's own file")  # not one of the artifact's: left out of it
        self.seen.append(("artifacts", run.state.global_step))


# session-scoped: the parallel runner may run other modules between this module's tests, which tears a module
# fixture down and makes it again (25 s each time on 2 cores)
@pytest.fixture(scope="session")
def finished(small_csv, tmp_path_factory):
    out = tmp_path_factory.mktemp("arch64") / "out"
    spec = parse_spec(
        tiny_spec(
            small_csv,
            out,
            distributed={"nodes": 1, "procs_per_node": 1},
            training__max_steps=4,
            training__eval_every=2,
            training__checkpoint_every=2,
            training__log_every=1,
        )
    )
    dest = Output.for_spec(spec)
    assert dest.claim(spec).action == "new"
    recorder = Recorder()
    handler = _Collect()
    root = logging.getLogger()
    level = root.level
    root.addHandler(handler)
    root.setLevel(logging.INFO)
    patch = pytest.MonkeyPatch()
    patch.setenv(LOG_EVENTS_ENV, "1")  # as a cluster pod's launcher sets it: the event lines go into the log
    try:
        trainer = build_trainer(
            spec, DistEnv(), tasks.get(spec.task), dest, torch.device("cpu"), extra_hooks=[recorder]
        )
        metrics = trainer.train()
        trainer.events.close()
    finally:
        root.removeHandler(handler)
        root.setLevel(level)
        patch.undo()
    return out, recorder.seen, handler.lines, metrics, trainer.layout.epoch_steps[0]


class _Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


def test_a_custom_hook_sees_evaluate_save_and_the_end_in_order(finished):
    _, seen, _, _, epoch_steps = finished
    # a step's end: evaluation (inside an epoch, not at the last step) before the checkpoint; then the epoch's end
    middle = [("evaluate", 2), ("save", 2)] if epoch_steps > 2 else [("save", 2), ("evaluate", 2)]
    assert seen[0] == ("start", 0) and seen[1:3] == middle
    assert ("save", 4) in seen and seen.index(("save", 4)) < seen.index(("evaluate", 4))
    assert seen[-3:] == [("end", 4), ("exported", 4), ("artifacts", 4)]


def test_the_events_file_is_one_json_object_per_line_and_history_renders_it(finished):
    out, _, _, metrics, _ = finished
    lines = (out / EVENTS_FILE).read_text().splitlines()
    events = [Event.from_json(line) for line in lines]
    assert all(e is not None for e in events) and all(json.loads(line)["kind"] in KINDS for line in lines)
    kinds = [e.kind for e in events]
    assert kinds[0] == "start" and kinds[-1] == "done" and kinds.count("checkpoint") == 2
    assert kinds.count("train") == 4 and "eval" in kinds
    # history.jsonl (format unchanged) is the records' rendering, record for record
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    rendered = [{"type": e.kind, "step": e.step, **e.context, **e.metrics} for e in events if e.kind in RECORDS]
    assert history == rendered
    done = events[-1]
    assert done.context["output"] == str(out) and done.metrics["train_loss"] == metrics["train_loss"]


def test_the_human_lines_and_the_progress_are_rendered_from_the_events(finished):
    out, _, logged, metrics, _ = finished
    events = [Event.from_json(line) for line in (out / EVENTS_FILE).read_text().splitlines()]
    evals = [e for e in events if e is not None and e.kind == "eval"]
    for e in evals:  # the line tests, docs and Katib's collector read, text unchanged
        line = f"epoch {e.context['epoch']}, step {e.step}: eval_loss {e.metrics['eval_loss']:.4f}"
        assert any(m.startswith(line) for m in logged), line
    assert sum(m.startswith("progress: step=") for m in logged) == 4
    assert any(m.startswith("done: ") and f"train_loss {metrics['train_loss']:.4f}" in m for m in logged)
    # what `status` reads from a pod's log: the event lines alone, json.loads each, equal to progress.json
    from_log = progress_from_events([f"12:00:00 [rank 0] INFO {m}" for m in logged])
    saved = read_progress(out)
    assert from_log is not None and saved is not None
    assert from_log["phase"] == saved["phase"] == "succeeded" and from_log["output"] == saved["output"]
    assert from_log["metrics"] == saved["metrics"] and from_log["last_eval"] == saved["last_eval"]
    assert {k: from_log[k] for k in ("step", "total_steps", "loss")} == {
        k: saved[k] for k in ("step", "total_steps", "loss")
    }


def test_status_reads_a_cluster_logs_events_with_no_regex():
    from kubetune.backends.kubeflow import read
    from kubetune.backends.kubeflow.katib import METRICS_FORMAT
    from kubetune.training import events, loggers

    for module in (loggers, events, read):  # nothing parses the trainer's text back
        assert "import re\n" not in open(module.__file__).read() and "re.compile" not in open(module.__file__).read()
    lines = [
        "noise " + LOG_PREFIX + "{not json",
        "12:00:00 [rank 0] INFO " + log_line(Event("eval", 5, {"eval_loss": 0.5, "arc/acc": 0.25})),
        "12:00:01 [rank 0] INFO " + log_line(Event("progress", 6, context={"step": 6, "total_steps": 9})),
        "12:00:02 [rank 0] INFO " + log_line(Event("done", 9, {"eval_loss": 0.4}, {"output": "s3://b/run x 5"})),
    ]
    assert [e.kind for e in events_in_log(lines)] == ["eval", "progress", "done"]
    rec = progress_from_events(lines)
    assert rec == {
        "phase": "succeeded",
        "step": 6,
        "total_steps": 9,
        "last_eval": {"step": 5, "eval_loss": 0.5, "arc/acc": 0.25},
        "metrics": {"eval_loss": 0.4},
        "output": "s3://b/run x 5",
    }
    # Katib's StdOut collector reads `name value` / `name=value`: an event line gives it no metric
    assert not any(re.search(METRICS_FORMAT, line) for line in lines[1:])
