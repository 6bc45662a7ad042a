"""The Python client's handle on a local run answers like one on a cluster job (it is the same
class, Job): status()/wait() return a JobStatus, logs() takes follow/rank/all_ranks/tail, Client.list/get see the runs, and
train(replace=...) refuses or replaces a run of the same name. A small Python script stands in
for `kubetune run` (backends.local.runs.run_command), so these run in a second; the real run is covered by
tests/integration/test_pod_commands.py and the notebook test."""

from __future__ import annotations

import inspect
import os
import sys
import time
from pathlib import Path

import pytest

from kubetune.backends.local import runs as client_mod
from kubetune.backends.status import JobStatus, WaitTimeout
from kubetune.client import Client, Job
from kubetune.errors import KubetuneError

SPEC = {"name": "demo", "model": {"uri": "m"}, "data": {"train": "train.csv"}, "output": {"uri": "runs/demo"}}


@pytest.fixture(autouse=True)
def fake_run(monkeypatch, tmp_path):
    """`kubetune run` replaced by the script in FAKE_SCRIPT (a file, so each test sets its own)."""
    script = tmp_path / "fake_run.py"
    script.write_text("import sys; print('[rank 0] INFO done'); sys.exit(0)\n")
    monkeypatch.setattr(client_mod, "run_command", lambda spec_file: [sys.executable, str(script), str(spec_file)])
    monkeypatch.setattr(client_mod, "_LOCAL_JOBS", {})
    yield script
    for job in list(client_mod._LOCAL_JOBS.values()):
        job.delete(timeout=5)


def _train(script, body: str, name: str = "demo", **kwargs) -> Job:
    # Replaced, not rewritten in place: a run started just before may still be starting up, and
    # would read a truncated script (and exit 0) if the file were rewritten under it.
    staged = script.with_suffix(".new")
    staged.write_text("import os, signal, sys, time\n" + body)
    os.replace(staged, script)
    return Client("local").train({**SPEC, "name": name}, **kwargs)


@pytest.mark.parametrize(
    ("body", "phase", "reason", "message"),
    [
        ("print('[rank 0] INFO done')", "Succeeded", None, None),
        (
            "print('[rank 1] Traceback ...'); print('error: worker rank 1 failed with exit code 1 (its error is above)'); sys.exit(1)",
            "Failed",
            "WorkerFailed",
            "kubetune run exited with code 1: error: worker rank 1 failed with exit code 1 (its error is above)",
        ),
        (
            "print('error: data.label_column: column \\'label\\' not found'); sys.exit(2)",
            "Failed",
            "InvalidInput",
            "kubetune run exited with code 2: error: data.label_column: column 'label' not found",
        ),
        (
            "print('stopped: stopped by SIGTERM — run the same command again to resume'); sys.exit(143)",
            "Failed",
            "Stopped",
            "kubetune run exited with code 143: stopped: stopped by SIGTERM — run the same command again to resume",
        ),
        ("sys.exit(7)", "Failed", "Error", "kubetune run exited with code 7"),
    ],
)
def test_status_is_a_job_status_with_the_reason(fake_run, body, phase, reason, message):
    job = _train(fake_run, body + "\n")
    status = job.wait(timeout=30)
    assert isinstance(status, JobStatus) and (status.kind, status.name) == ("LocalRun", "demo")
    assert (status.phase, status.reason, status.message, status.done) == (phase, reason, message, True)
    assert status.log_tail == ([] if phase == "Succeeded" else list(job.logs())[-20:])


def test_running_status_and_wait_timeout(fake_run):
    job = _train(fake_run, "time.sleep(30)\n")
    assert job.status().phase == "Running" and not job.status().done
    with pytest.raises(
        WaitTimeout, match=r"^local run 'demo' is still Running after 0 s — wait longer, or delete\(\) it$"
    ):
        job.wait(timeout=0.2)


def test_logs_tail_follow_and_lines_end_only_at_newlines(fake_run):
    # A progress bar redraws with \r inside one line; the last line is written in two pieces.
    body = (
        "for i in range(5): print(f'[rank 0] INFO step {i}', flush=True)\n"
        "sys.stdout.write('bar 1/2\\rbar 2/2\\n'); sys.stdout.write('[rank 0] INFO '); sys.stdout.flush(); time.sleep(1)\n"
        "print('done', flush=True)\n"
    )
    job = _train(fake_run, body)
    followed = list(job.logs(follow=True))
    assert followed == [*(f"[rank 0] INFO step {i}" for i in range(5)), "bar 1/2\rbar 2/2", "[rank 0] INFO done"]
    assert list(job.logs(tail=2)) == ["bar 1/2\rbar 2/2", "[rank 0] INFO done"]
    assert list(job.logs(tail=0)) == [] and list(job.logs(rank=0, all_ranks=True)) == followed


def test_logs_tail_then_follow_while_running(fake_run, tmp_path):
    go = tmp_path / "go"
    body = (
        f"print('a'); print('b'); print('c', flush=True)\n"
        f"while not os.path.exists({str(go)!r}): time.sleep(0.05)\n"
        "print('d', flush=True)\n"
    )
    job = _train(fake_run, body)
    while len(list(job.logs())) < 3:
        time.sleep(0.05)
    lines = job.logs(follow=True, tail=1)
    assert next(lines) == "c"  # only the last line written so far, then new ones as they come
    go.touch()
    assert list(lines) == ["d"]


@pytest.mark.parametrize(
    ("kwargs", "error"),
    [
        (
            {"rank": 1},
            "rank: a local run has one node (node rank 0), not 1 — leave rank unset: the local log holds every process's lines, each prefixed [rank N]",
        ),
        ({"tail": -1}, "tail: expected a number of lines >= 0, got -1 — pass tail=N or leave it unset"),
    ],
)
def test_logs_bad_arguments_are_one_line(fake_run, kwargs, error):
    job = _train(fake_run, "pass\n")
    with pytest.raises(KubetuneError) as e:
        job.logs(**kwargs)
    assert str(e.value) == error


def test_replace_list_get_and_delete(fake_run):
    client = Client("local")
    first = _train(fake_run, "time.sleep(60)\n")
    with pytest.raises(KubetuneError, match=r"^local run 'demo' is already running \(pid \d+\) — pass replace=True"):
        client.train(SPEC)
    other = _train(fake_run, "time.sleep(60)\n", name="other")
    second = _train(fake_run, "time.sleep(60)\n", replace=True)
    # the first run got SIGTERM (the real CLI then checkpoints and exits 143)
    assert first.status().phase == "Failed" and first.status().reason == "Stopped"
    assert [(j["name"], j["phase"]) for j in client.list()] == [("other", "Running"), ("demo", "Running")]
    assert all(j["created"].endswith("Z") for j in client.list())
    assert client.get("demo") == second and Client("local").get("other") == other  # any Client of this process
    assert client.get("demo") != first  # the replaced run's handle is another job
    second.delete(timeout=5)
    assert [j["name"] for j in client.list()] == ["other"]
    with pytest.raises(
        KubetuneError, match=r"^no local run named 'demo' was started from this Python process \(started: other\) — "
    ):
        client.get("demo")
    # a finished run does not block its name
    other.delete(timeout=5)
    assert _train(fake_run, "pass\n", name="other").wait(timeout=30).phase == "Succeeded"


def test_delete_kills_the_whole_process_group_when_sigterm_is_ignored(fake_run, tmp_path):
    # A launcher whose worker outlives it would keep the GPU/CPU busy: after the timeout both go.
    pid_file = tmp_path / "child.pid"
    body = (
        "import subprocess\n"
        "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
        "child = subprocess.Popen([sys.executable, '-c', 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'])\n"
        f"open({str(pid_file)!r}, 'w').write(str(child.pid)); print('started', flush=True); time.sleep(60)\n"
    )
    job = _train(fake_run, body)
    while not pid_file.exists() or not pid_file.read_text():
        time.sleep(0.05)
    child = int(pid_file.read_text())
    started = time.monotonic()
    job.delete(timeout=1)
    assert 1 <= time.monotonic() - started < 10
    assert job.status().reason == "Killed"
    for _ in range(100):  # the child is reaped by init once killed
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            break
        time.sleep(0.05)
    else:
        pytest.fail(f"worker process {child} survived delete()")


def test_a_local_handle_says_where_its_output_is(fake_run, tmp_path):
    job = Client("local").train({**SPEC, "output": {"uri": str(tmp_path / "out")}})
    assert job.wait(timeout=30).phase == "Succeeded" and job.output == tmp_path / "out"
    relative = Client("local").train({**SPEC, "name": "rel"})  # runs/demo: as `kubetune run` resolves it
    assert relative.output == Path("runs/demo")


def test_local_client_takes_no_backend_options():
    with pytest.raises(KubetuneError, match=r"^backend: the local backend takes no options, got \['namespace'\] — "):
        Client("local", namespace="team-a")


def test_one_handle_class_has_every_backends_calls():
    # What LocalJob and KubeflowJob were is one class: its delete takes the cluster's storage (the
    # output outlives the job unless asked) and the local run's timeout (how long to wait before
    # killing it); train and get return it on every backend (tests/unit/test_backend_protocol.py).
    delete = inspect.signature(Job.delete)
    assert list(delete.parameters) == ["self", "storage", "timeout"]
    assert delete.parameters["storage"].default is False and delete.parameters["timeout"].default is None
    assert inspect.signature(Client.train).return_annotation == inspect.signature(Client.get).return_annotation == "Job"
