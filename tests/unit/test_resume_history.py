"""A resumed run's history is the uninterrupted run's: an evaluation made at the checkpoint's step, before the
checkpoint, is kept (issue 63, row 2: it was dropped and never made again, so the curve lost that point)."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import tiny_spec

from kubetune import tasks
from kubetune.artifacts import History
from kubetune.artifacts.output import Output
from kubetune.config import parse_spec
from kubetune.distributed import DistEnv
from kubetune.training.build import build_trainer
from kubetune.training.trainer import Preempted


def _records(out) -> list[tuple]:
    """(type, step, loss) of each record: the curve a user sees."""
    lines = (out / "history.jsonl").read_text().splitlines()
    return [(r["type"], r["step"], r.get("loss", r.get("eval_loss"))) for r in map(json.loads, lines)]


def _train(spec, stop_at_once: bool = False) -> None:
    dest = Output.for_spec(spec)
    dest.claim(spec)
    trainer = build_trainer(spec, DistEnv(), tasks.get(spec.task), dest, torch.device("cpu"))
    if stop_at_once:
        trainer.stop.set()  # a SIGTERM: the run checkpoints at its next step boundary and stops
    try:
        trainer.train()
    finally:
        trainer.bar.close()
        trainer.events.close()


# make test: test_records_written_after_the_checkpoint_are_left_out below (History itself); this one runs the
# trainer three times in this process (tens of seconds on 2 cores).
@pytest.mark.e2e
def test_an_evaluation_at_the_checkpoints_step_survives_the_resume(small_csv, tmp_path):
    def spec(out):
        raw = tiny_spec(small_csv, out, distributed={"nodes": 1, "procs_per_node": 1})
        raw["training"].update(max_steps=2, batch_size=4, eval_every=1, log_every=1, checkpoint_every=1)
        raw["data"].update(eval_fraction=0.1, max_length=16)  # 16 rows to evaluate: seconds in all
        raw["output"]["report_baseline"] = False
        return parse_spec(raw)

    _train(spec(tmp_path / "whole"))
    stopped = spec(tmp_path / "stopped")
    with pytest.raises(Preempted):
        _train(stopped, stop_at_once=True)  # step 1: trained, logged, evaluated, checkpointed; then stopped
    assert ("eval", 1) in [r[:2] for r in _records(tmp_path / "stopped")]
    _train(stopped)  # resumed from the checkpoint of step 1

    whole, resumed = _records(tmp_path / "whole"), _records(tmp_path / "stopped")
    assert [r[:2] for r in whole] == [("train", 1), ("eval", 1), ("train", 2), ("eval", 2)]
    assert resumed == whole  # every point once, with the uninterrupted run's values


def test_records_written_after_the_checkpoint_are_left_out(tmp_path):
    """The checkpoint's copy is the history as it was at the checkpoint: an evaluation at its step made after
    it (an epoch's last), made again by the resumed run, is not in it; records past the step never are."""
    out = tmp_path / "run"
    out.mkdir()
    saved = tmp_path / "copy.jsonl"
    before = [{"type": "train", "step": 4, "loss": 0.5}, {"type": "eval", "step": 4, "eval_loss": 0.6}]
    after = [{"type": "eval", "step": 6, "eval_loss": 0.4}, {"type": "train", "step": 7, "loss": 0.3}]
    saved.write_text("".join(json.dumps(r) + "\n" for r in before))
    (out / "history.jsonl").write_text("".join(json.dumps(r) + "\n" for r in before + after))
    History(out, resume_step=4, saved=saved).close()
    assert [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()] == before


def test_tensorboard_keeps_the_checkpoints_step_and_hides_what_came_after(tmp_path):
    """TensorBoard's curve after a resume from step 2: the points at step 2 (written before the checkpoint, not
    written again) stay, the interrupted run's points after it are hidden, and each step reads once."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from kubetune.training.events import Event
    from kubetune.training.loggers import TensorBoardLogger

    interrupted = TensorBoardLogger(tmp_path, None)
    for step in (1, 2, 3):
        interrupted.on_event(Event("train", step, {"loss": 1.0 / step}, {}))
    interrupted.on_event(Event("eval", 2, {"eval_loss": 0.75}, {}))
    interrupted.close()
    resumed = TensorBoardLogger(tmp_path, 2)
    for step in (3, 4):
        resumed.on_event(Event("train", step, {"loss": 0.5 / step}, {}))
    resumed.close()
    events = EventAccumulator(str(tmp_path / "tensorboard")).Reload()
    assert [(e.step, round(e.value, 4)) for e in events.Scalars("train/loss")] == [
        (1, 1.0),
        (2, 0.5),
        (3, round(0.5 / 3, 4)),
        (4, 0.125),
    ]
    assert [(e.step, e.value) for e in events.Scalars("eval/loss")] == [(2, 0.75)]
