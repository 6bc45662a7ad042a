"""Rank 0's progress: the plain log line, progress.json, and reading both back (status)."""

from __future__ import annotations

import json
import logging

from kubetune.training import loggers
from kubetune.training.events import Event
from kubetune.training.loggers import ProgressLogger, format_line, progress_from_events, read_progress


def test_the_progress_line_reads_back_what_it_says(tmp_path, caplog):
    logger = ProgressLogger(tmp_path, total_steps=200, epochs=3, start_step=0, log_events=True)  # a cluster pod's
    with caplog.at_level(logging.INFO, logger="kubetune.progress"):
        logger.on_event(Event("train", 10, {"loss": 0.69314, "lr": 2e-5}, {"epoch": 1, "samples": 320, "tokens": 9000}))
        logger.on_event(Event("train", 20, {"loss": 0.61, "lr": 1.9e-5}, {"epoch": 1, "samples": 640, "tokens": 18000}))
        logger.on_event(Event("eval", 20, {"eval_loss": 0.58, "eval_accuracy": 0.71, "eval_confusion": [[1]]}, {}))
    logged = [r.getMessage() for r in caplog.records]
    lines = [line for line in logged if line.startswith("progress: ")]  # the human lines; the others: events
    assert lines[0].startswith("progress: step=10/200 epoch=1/3 loss=0.6931 lr=2.00e-05")
    assert "samples/s" not in lines[0]  # no interval yet to measure a rate over
    assert "samples/s=" in lines[1] and "tokens/s=" in lines[1] and "eta=" in lines[1]
    back = progress_from_events(["12:00:01 [rank 0] INFO " + line for line in logged])
    saved = read_progress(tmp_path)
    assert back["step"] == saved["step"] == 20 and back["total_steps"] == saved["total_steps"] == 200
    assert back["epoch"] == 1 and back["epochs"] == 3 and back["loss"] == 0.61
    assert abs(back["samples_per_s"] - saved["samples_per_s"]) <= 0.05 * saved["samples_per_s"] + 0.1
    assert abs(back["eta_s"] - saved["eta_s"]) <= 1
    assert saved["last_eval"] == {"step": 20, "eval_loss": 0.58, "eval_accuracy": 0.71}  # scalars only
    assert not list(tmp_path.glob(".progress.json-*"))  # replaced atomically, no temporary left
    logger.finish("succeeded", output="s3://b/run")
    assert read_progress(tmp_path)["phase"] == "succeeded"
    assert back["last_eval"] == saved["last_eval"]
    assert progress_from_events(["INFO loading the model", "progress: step=10/20", "kubetune-event {nope"]) is None


def test_a_local_run_logs_the_human_lines_alone(tmp_path, caplog):
    """Outside a cluster pod (no KUBETUNE_LOG_EVENTS from `kubetune launch`) the terminal gets no event lines:
    a local run's status reads progress.json."""
    logger = ProgressLogger(tmp_path, total_steps=20, epochs=1, start_step=0)
    with caplog.at_level(logging.INFO, logger="kubetune.progress"):
        logger.on_event(Event("train", 10, {"loss": 0.69, "lr": 2e-5}, {"epoch": 1, "samples": 320, "tokens": 9000}))
        logger.on_event(Event("eval", 10, {"eval_loss": 0.58}, {}))
    logged = [r.getMessage() for r in caplog.records]
    assert any(line.startswith("progress: step=10/20") for line in logged)
    assert not any("kubetune-event" in line for line in logged), logged
    assert read_progress(tmp_path)["last_eval"] == {"step": 10, "eval_loss": 0.58}


def test_a_resumed_run_keeps_the_last_evaluation_and_measures_its_eta_from_its_own_steps(tmp_path, monkeypatch):
    (tmp_path / "progress.json").write_text(json.dumps({"step": 40, "last_eval": {"step": 40, "eval_loss": 0.5}}))
    clock = [1000.0]
    monkeypatch.setattr(loggers.time, "monotonic", lambda: clock[0])
    logger = ProgressLogger(tmp_path, total_steps=100, epochs=1, start_step=40)
    clock[0] += 20.0  # this session's 10 steps took 20 s
    logger.on_event(Event("train", 50, {"loss": 0.4, "lr": 1e-5}, {"epoch": 1, "samples": 1600}))
    rec = read_progress(tmp_path)
    assert rec["last_eval"] == {"step": 40, "eval_loss": 0.5}
    # 50 steps left at 2 s a step; measured from step 0 it would be 50 × 20/50 = 20 s
    assert rec["eta_s"] == 100.0 and rec["step"] == 50


def test_the_rates_after_an_evaluation_leave_its_time_out(tmp_path, monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(loggers.time, "monotonic", lambda: clock[0])
    logger = ProgressLogger(tmp_path, total_steps=100, epochs=1, start_step=0)
    logger.on_event(Event("train", 10, {"loss": 0.5, "lr": 1e-5}, {"epoch": 1, "samples": 320, "tokens": 3200}))
    clock[0] += 10.0  # 10 steps of training in 10 s, then a 30 s evaluation
    clock[0] += 30.0
    logger.on_event(
        Event("eval", 20, {"eval_loss": 0.4}, {"epoch": 1, "samples": 640, "train_s": 20.0, "eval_s": 30.0})
    )
    logger.on_event(Event("train", 20, {"loss": 0.4, "lr": 1e-5}, {"epoch": 1, "samples": 640, "tokens": 6400}))
    rec = read_progress(tmp_path)
    assert rec["samples_per_s"] == 32.0 and rec["tokens_per_s"] == 320.0  # not 8 and 80 (40 s of wall time)
    assert rec["eta_s"] == 80 * 40.0 / 20  # the ETA stays wall time: evaluations recur


def test_progress_from_a_pod_log():
    """A cluster pod's progress reaches `status` as its event lines (json.loads), whatever the human lines say."""
    progress = '{"kind":"progress","step":%d,"metrics":{},"context":{"phase":"training","step":%d,"total_steps":30,'
    log = [
        "12:00:00 [rank 0] INFO job demo (classification): world size 2, device cpu, precision fp32",
        "12:00:05 [rank 0] INFO progress: step=10/30 epoch=1/1 loss=9.9999 lr=2.00e-05",  # never parsed
        "12:00:05 [rank 0] INFO kubetune-event " + progress % (10, 10) + '"epoch":1,"epochs":1,"loss":1.0986}}',
        "12:00:09 [rank 0] INFO epoch 1, step 15: eval_loss 1.0500 eval_accuracy 0.4000 eval_f1_macro 0.3800",
        '12:00:09 [rank 0] INFO kubetune-event {"kind":"eval","step":15,"metrics":{"eval_loss":1.05,'
        '"eval_accuracy":0.4,"eval_f1_macro":0.38},"context":{}}',
        "12:00:10 [rank 0] INFO kubetune-event " + progress % (20, 20) + '"epoch":1,"epochs":1,"loss":1.0412,'
        '"lr":1e-05,"samples_per_s":91.5,"eta_s":65.0}}',
        "12:00:11 [rank 1] some other line",
    ]
    rec = progress_from_events(log)
    assert rec["step"] == 20 and rec["total_steps"] == 30 and rec["eta_s"] == 65 and rec["samples_per_s"] == 91.5
    assert rec["last_eval"] == {"step": 15, "eval_loss": 1.05, "eval_accuracy": 0.4, "eval_f1_macro": 0.38}
    assert progress_from_events(log[:2]) is None
    assert format_line(rec).startswith("step=20/30 epoch=1/1 loss=1.0412")


def test_an_mlflow_run_that_finish_did_not_end_is_marked_failed():
    """However training ends (an error, a diverged loss), the loggers are closed: an MLflow run that
    finish() did not end is FAILED, not left RUNNING; after finish(), close() sends nothing more.
    (The client is a stand-in recording its calls; tests/integration/test_mlflow.py runs the real server.)"""
    from kubetune.training.tracking import MLflowLogger

    calls = []

    class Client:
        tracking_uri = "http://mlflow:5000"

        def set_terminated(self, run_id, status):
            calls.append((run_id, status))

    logger = MLflowLogger.__new__(MLflowLogger)
    logger.client, logger.run_id, logger.failed, logger.ended = Client(), "r1", [], False
    logger.close()
    logger.close()
    assert calls == [("r1", "FAILED")]
    calls.clear()
    logger.ended = False
    logger.finish(None, status="KILLED")  # preempted: ended as KILLED, which a resumed run reopens
    logger.close()
    assert calls == [("r1", "KILLED")]
