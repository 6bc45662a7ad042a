"""Rank 0's trainerStatus (Kubeflow Trainer v2.3 TrainJobStatus): the request body against the v2.3.0
CRD, reading it back, and the sender against the FAKE status server of tests/fakes/trainer_status.py
(real TLS on 127.0.0.1; no Trainer controller can run here): throttled, token re-read, failures logged
once per kind and never in the caller's way."""

from __future__ import annotations

import logging
import time
from datetime import datetime, timezone

import pytest
from fakes.trainer_status import TrainerStatusServer, status_errors

from kubetune.training.events import Event
from kubetune.training.loggers import ProgressLogger
from kubetune.training.trainer_status import (
    MAX_CHARS,
    MAX_METRICS,
    Endpoint,
    StatusReporter,
    metric_value,
    progress_of,
    trainer_status,
)

NOW = datetime(2026, 1, 2, 3, 4, 5, tzinfo=timezone.utc)
RECORD = {
    "phase": "training",
    "step": 20,
    "total_steps": 30,
    "epoch": 1,
    "epochs": 2,
    "loss": 1.0412,
    "lr": 1e-05,
    "samples_per_s": 91.53333333333333,
    "tokens_per_s": 5400.25,
    "eta_s": 65.4,
    "last_eval": {"step": 15, "eval_loss": 1.05, "eval_accuracy": 0.4, "eval_f1_macro": 0.38},
}


def test_a_progress_record_becomes_a_trainer_status_the_crd_admits():
    status = trainer_status(RECORD, NOW)
    assert status_errors(status) == []
    assert status["progressPercentage"] == 66 and status["estimatedRemainingSeconds"] == 65
    assert status["lastUpdatedTime"] == "2026-01-02T03:04:05Z"
    sent = {m["name"]: m["value"] for m in status["metrics"]}
    assert sent == {
        "step": "20",
        "total_steps": "30",
        "epoch": "1",
        "epochs": "2",
        "loss": "1.0412",
        "learning_rate": "1e-05",
        "samples_per_second": "91.53333333333333",
        "tokens_per_second": "5400.25",
        "eval_step": "15",
        "eval_loss": "1.05",
        "eval_accuracy": "0.4",
        "eval_f1_macro": "0.38",
    }


@pytest.mark.parametrize(
    "record, percent",
    [
        ({"step": 0, "total_steps": 30}, 0),  # the start
        ({"step": 29, "total_steps": 30}, 96),
        ({"step": 30, "total_steps": 30, "phase": "finishing"}, 99),  # the export still runs
        ({"step": 30, "total_steps": 30, "phase": "stopped"}, 99),
        ({"step": 30, "total_steps": 30, "phase": "succeeded"}, 100),
        ({"step": 40, "total_steps": 0}, None),  # a stream of unknown length
    ],
)
def test_the_percentage_says_100_only_once_the_run_succeeded(record, percent):
    status = trainer_status(record, NOW)
    assert status.get("progressPercentage") == percent
    assert status_errors(status) == []


def test_every_value_fits_64_characters_and_at_most_256_metrics_are_sent():
    long_name = "eval_" + "n" * 100
    last_eval = {"step": 7, long_name: 0.5, **{f"eval_m{i:03d}": i / 7 for i in range(300)}, "eval_loss": 2.0}
    record = {**RECORD, "lr": -1.2345678901234567e-308, "last_eval": last_eval, "loss": float("nan")}
    status = trainer_status(record, NOW)
    assert status_errors(status) == []
    metrics = status["metrics"]
    assert len(metrics) == MAX_METRICS
    assert all(1 <= len(m["name"]) <= MAX_CHARS and 1 <= len(m["value"]) <= MAX_CHARS for m in metrics)
    names = [m["name"] for m in metrics]
    assert len(set(names)) == len(names) and "eval_loss" in names  # eval_loss first among the evaluation's
    assert metric_value(-1.2345678901234567e-308) == "-1.2345678901234567e-308"  # the longest float: 24
    assert metric_value("x" * 100) == "x" * 64 and metric_value("") is None and metric_value(True) is None
    # what the CRD refuses, the fake refuses as the apiserver would
    too_long = {"lastUpdatedTime": "2026-01-02T03:04:05Z", "metrics": [{"name": "a", "value": "v" * 65}]}
    assert status_errors(too_long) == ["status.trainerStatus.metrics[0].value: Too long: may not be more than 64 bytes"]
    assert status_errors({"progressPercentage": 5}) == [
        'status.trainerStatus: Invalid value: "object": lastUpdatedTime is required when trainerStatus is present'
    ]


def test_reading_a_trainer_status_back_gives_the_progress_record():
    back = progress_of(trainer_status(RECORD, NOW))
    assert back == {
        "source": "trainerStatus",
        "percent": 66,
        "phase": "training",
        "step": 20,
        "total_steps": 30,
        "epoch": 1,
        "epochs": 2,
        "loss": 1.0412,
        "lr": 1e-05,
        "samples_per_s": 91.53333333333333,
        "tokens_per_s": 5400.25,
        "eta_s": 65.0,
        "last_eval": {"step": 15, "eval_loss": 1.05, "eval_accuracy": 0.4, "eval_f1_macro": 0.38},
        "updated": NOW.timestamp(),
    }
    done = progress_of(trainer_status({**RECORD, "phase": "succeeded"}, NOW))
    assert done["phase"] == "succeeded" and done["percent"] == 100 and "eta_s" not in done
    assert done["metrics"] == {"eval_loss": 1.05, "eval_accuracy": 0.4, "eval_f1_macro": 0.38}
    # written by any trainer: what is not a number is left out, the rest is kept
    odd = {
        "progressPercentage": 140,
        "estimatedRemainingSeconds": -3,
        "metrics": [{"name": "step", "value": "12"}, {"name": "loss", "value": "nan"}, {"name": "lr"}, "junk"],
        "lastUpdatedTime": "yesterday",
    }
    assert progress_of(odd) == {"source": "trainerStatus", "phase": "training"}  # a step needs its total
    assert progress_of(None) is None and progress_of({}) is None


def test_no_variables_no_endpoint():
    env = {"KUBEFLOW_TRAINER_SERVER_URL": "https://x/s", "KUBEFLOW_TRAINER_SERVER_CA_CERT": "/ca"}
    assert Endpoint.from_env(env) is None
    assert Endpoint.from_env({**env, "KUBEFLOW_TRAINER_SERVER_TOKEN": "/t"}) == Endpoint("https://x/s", "/ca", "/t")


@pytest.fixture
def server(tmp_path):
    with TrainerStatusServer(tmp_path / "status") as s:
        yield s


def _endpoint(server: TrainerStatusServer, **over) -> Endpoint:
    return Endpoint(**{"url": server.url, "ca_file": str(server.ca_file), "token_file": str(server.token_file), **over})


def _until(predicate, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "not in time"
        time.sleep(0.02)


def test_progress_reaches_the_server_throttled_with_the_token_read_at_every_send(server, tmp_path):
    reporter = StatusReporter(_endpoint(server), interval_s=0.5).start()
    progress = ProgressLogger(tmp_path, total_steps=100, epochs=1, start_step=0, status=reporter)
    _until(lambda: len(server.bodies()) == 1)  # the start, at once
    t0 = time.monotonic()
    for step in range(1, 61):  # 60 log steps over ~1.2 s: at most ~3 more requests, not 60
        progress.on_event(Event("train", step, {"loss": 1.0 / step, "lr": 1e-4}, {"epoch": 1, "samples": 8 * step}))
        if step == 30:
            server.rotate("token-1-" + "y" * 40)  # the kubelet rotated it: the next send reads the new one
        time.sleep(0.02)
    progress.on_event(Event("eval", 60, {"eval_loss": 0.25, "eval_accuracy": 0.75}, {"eval_s": 0.0}))
    progress.finish("succeeded", metrics={"eval_accuracy": 0.75})
    reporter.close()
    elapsed = time.monotonic() - t0
    assert [r.code for r in server.received] == [200] * len(server.received)  # no 403 after the rotation
    bodies = server.bodies()
    assert 3 <= len(bodies) <= 2 + elapsed / 0.5 + 1
    gaps = [b.at - a.at for a, b in zip(server.received, server.received[1:-1])]
    assert all(gap >= 0.45 for gap in gaps), gaps  # the final one alone goes without waiting
    percents = [b.get("progressPercentage") for b in bodies]
    assert percents[0] == 0 and percents[-1] == 100 and percents == sorted(percents)
    last = {m["name"]: m["value"] for m in bodies[-1]["metrics"]}
    assert last["eval_accuracy"] == "0.75" and last["eval_step"] == "60" and last["step"] == "60"
    assert reporter.sent == len(bodies)


def test_a_failing_server_is_said_once_per_kind_and_never_waits_the_caller(server, tmp_path, caplog):
    server.fail_with = [500, 500, 500, 403, 403]
    reporter = StatusReporter(_endpoint(server), interval_s=0.2).start()
    with caplog.at_level(logging.INFO, logger="kubetune.trainer_status"):
        record = dict(RECORD)
        t0 = time.monotonic()
        for step in range(40):
            reporter.update({**record, "step": step})
            time.sleep(0.05)
        calls = time.monotonic() - t0
        _until(lambda: len(server.received) >= 7)  # the failures, then accepted again
        reporter.close()
    assert calls < 40 * 0.05 + 0.5  # update() never waited on the server
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 2, warnings
    assert "answered HTTP 500" in warnings[0] and "training goes on" in warnings[0]
    assert "refused the token (HTTP 403: Forbidden)" in warnings[1] and "KUBEFLOW_TRAINER_SERVER_TOKEN" in warnings[1]
    assert any("accepts the updates again" in r.getMessage() for r in caplog.records)
    assert server.token not in caplog.text


def test_a_hanging_server_times_out_once_and_close_waits_a_bounded_time(server, caplog):
    server.hang = True
    reporter = StatusReporter(_endpoint(server), interval_s=0.1, timeout_s=0.5).start()
    with caplog.at_level(logging.WARNING, logger="kubetune.trainer_status"):
        t0 = time.monotonic()
        for step in range(20):
            reporter.update({**RECORD, "step": step})
        assert time.monotonic() - t0 < 0.1
        time.sleep(1.8)  # a few timed-out tries
        t1 = time.monotonic()
        reporter.close(wait_s=0.3)
        assert time.monotonic() - t1 < 1.0
    timeouts = [r.getMessage() for r in caplog.records if "did not answer within 0.5 s" in r.getMessage()]
    assert len(timeouts) == 1


@pytest.mark.parametrize(
    "over, said",
    [
        ({"ca_file": "OTHER_CA"}, "TLS with 127.0.0.1"),  # a CA that did not sign the server's certificate
        ({"ca_file": "/nonexistent/ca.crt"}, "cannot read the CA file /nonexistent/ca.crt"),
        ({"token_file": "/nonexistent/token"}, "cannot read the token file /nonexistent/token"),
        ({"url": "WRONG_JOB"}, "refused the token (HTTP 403"),  # the token's audience is another TrainJob
    ],
)
def test_each_misconfiguration_is_one_line_with_its_fix(server, tmp_path, caplog, over, said):
    if over.get("ca_file") == "OTHER_CA":
        with TrainerStatusServer(tmp_path / "other") as other:
            over = {"ca_file": str(other.ca_file)}
    if over.get("url") == "WRONG_JOB":
        over = {"url": server.url_for("team-a", "someone-elses")}
    reporter = StatusReporter(_endpoint(server, **over), interval_s=0.1).start()
    with caplog.at_level(logging.WARNING, logger="kubetune.trainer_status"):
        for step in range(5):
            reporter.update({**RECORD, "step": step})
            time.sleep(0.15)
        reporter.close()
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and said in warnings[0] and " — " in warnings[0], warnings
    assert server.bodies() == [] and server.token not in caplog.text


def test_a_resumed_run_starts_where_it_stopped_and_a_stop_is_sent_at_once(server, tmp_path):
    """After a SIGTERM the run checkpoints at the step it stopped at and resumes there: its first
    update says that step's percentage, never 0 again; the stop itself goes out without the interval."""
    reporter = StatusReporter(_endpoint(server), interval_s=60).start()
    progress = ProgressLogger(tmp_path, total_steps=100, epochs=1, start_step=40, status=reporter)
    _until(lambda: len(server.bodies()) == 1)
    progress.on_event(Event("train", 41, {"loss": 0.5, "lr": 1e-4}, {"epoch": 1, "samples": 8}))
    progress.finish("stopped")
    _until(lambda: len(server.bodies()) == 2, timeout=5)  # not 60 s later
    reporter.close()
    assert [b["progressPercentage"] for b in server.bodies()] == [40, 41]
