"""A careless user through the real CLI: a diverging run, a rerun into a finished output, a full
disk, Ctrl-C during start-up. Runs the tiny random-init Llama (0.4M parameters): seconds per run."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ROOT, kubetune, kubetune_together

pytestmark = pytest.mark.integration
EXAMPLE = ROOT / "examples" / "causal-tiny-chat.yaml"


def _args(out: Path, *extra: str, steps: int = 2, procs: int = 1) -> tuple[str, ...]:
    return (
        "run",
        str(EXAMPLE),
        "--set",
        f"output.uri={out}",
        "--set",
        f"training.max_steps={steps}",
        "--set",
        f"distributed.procs_per_node={procs}",
        "--set",
        "data.max_train_samples=200",
        *extra,
    )


def _run(
    out: Path, *extra: str, env: dict | None = None, steps: int = 2, procs: int = 1
) -> subprocess.CompletedProcess:
    return kubetune(*_args(out, *extra, steps=steps, procs=procs), env=env)


def _errors(proc: subprocess.CompletedProcess) -> list[str]:
    return [line for line in proc.stderr.splitlines() if "error:" in line]


def test_a_diverging_run_stops_on_every_rank_keeps_its_checkpoint_and_exports_nothing(tmp_path):
    """weight_decay 1e30 is finite, so it validates; the weights blow up after the first steps."""
    out = tmp_path / "out"
    proc = _run(
        out,
        "--set",
        "training.weight_decay=1.0e+30",
        "--set",
        "training.learning_rate=0.001",
        "--set",
        "training.checkpoint_every=2",
        "--set",
        "training.log_every=5",
        steps=12,
        procs=2,
    )
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    worker_lines = [line for line in _errors(proc) if line.startswith("[rank")]
    assert len(worker_lines) == 1 and worker_lines[0].startswith(
        "[rank 0] error: training: the loss or the gradient norm became non-finite (nan/inf) at step "
    )
    assert "the checkpoint of step 2 is kept" in worker_lines[0] and "nothing was exported" in worker_lines[0]
    assert (out / "checkpoints" / "step-00000002" / "COMPLETE").exists()
    assert not (out / "model").exists() and not (out / "metrics.json").exists()
    assert not list(out.glob(".kubetune-staging-*"))


def _artifacts(out: Path) -> dict:
    """The run's files but the live ones (history, progress, events, who holds the output), which are the latest
    attempt's."""
    live = ("history.jsonl", "progress.json", "events.jsonl", "tensorboard", ".kubetune-lock")
    return {
        p.relative_to(out): p.read_bytes()
        for p in out.rglob("*")
        if p.is_file() and p.parts[len(out.parts)] not in live
    }


@pytest.mark.e2e  # make test: the Output's claim, refusal and overwrite in process (test_output.py, test_output_seam.py)
def test_rerun_into_a_finished_output_is_refused_a_full_disk_keeps_it_and_overwrite_keeps_the_users_files(
    tmp_path, tmpfs
):
    """One finished run (a full fine-tune: no adapter, only model/, 1.6 MB) on a real 3 MiB tmpfs where
    one can be mounted: run again it is left alone; another job is refused; --overwrite, which cannot
    also fit beside it while it is being staged, fails in one line and leaves the first run whole; and
    where the disk has room (a copy of it), --overwrite replaces it and keeps the user's files."""
    try:
        disk = tmpfs("3m")
    except pytest.skip.Exception:  # no size-limited tmpfs here: all but the full disk
        disk = None
    out, tmp = (disk or tmp_path) / "out", tmp_path / "tmp"
    tmp.mkdir()
    first = _run(out, "--set", "lora=null", env={"TMPDIR": str(tmp)})
    assert first.returncode == 0, first.stderr[-3000:]
    assert "output " + str(out) + ": new output directory" in first.stderr
    # No /tmp/kubetune-<name>-* or torchelastic_* directory left behind (torchinductor_<user> is torch's shared compile cache).
    assert [p.name for p in tmp.iterdir() if not p.name.startswith("torchinductor_")] == []
    (out / "notes.txt").write_text("the user's")
    weights = (out / "model" / "model.safetensors").stat().st_mtime_ns
    # The same job again (a pod restarted after its run had finished, or a second `make`): nothing to do.
    # Another job into the finished output: refused before the workers start, and by the worker itself.
    # The four at once: none of them may write into the finished output (its weights' mtime is checked below).
    same_job = ("--set", "lora=null")
    other_job = ("--set", "lora=null", "--set", "training.learning_rate=0.01")
    *sames, again_pre, again_worker = kubetune_together(
        *[(_args(out, *job, *extra), None) for job in (same_job, other_job) for extra in ((), ("--no-preflight",))]
    )
    for same in sames:
        assert same.returncode == 0, same.stderr[-2000:]
        assert (
            f"{out} already holds this job's finished run: nothing to train (pass --overwrite to train it again)"
            in same.stderr
        )
    for again in (again_pre, again_worker):
        assert again.returncode == 2, again.stderr[-2000:]
        assert (
            f"output.uri: {out} holds a finished run (metrics.json, model/) — pick a new output.uri, or pass --overwrite"
            in _errors(again)[0]
        )
    assert (out / "model" / "model.safetensors").stat().st_mtime_ns == weights
    if disk is not None:
        before = _artifacts(out)
        second = _run(out, "--set", "lora=null", "--overwrite")
        assert second.returncode == 2, second.stderr[-3000:]
        assert "Traceback" not in second.stderr
        assert any(
            f"output.uri: cannot write the artifacts to {out}: No space left on device" in line
            for line in _errors(second)
        )
        after = _artifacts(out)
        assert {k: v for k, v in after.items() if k.parts[0] != "checkpoints"} == before  # the first run, byte for byte
        assert not list(out.glob(".kubetune-staging-*"))
        shutil.copytree(out, tmp_path / "out", ignore=shutil.ignore_patterns("checkpoints"))
        out = tmp_path / "out"
    replaced = _run(out, "--set", "lora=null", "--overwrite")
    assert replaced.returncode == 0, replaced.stderr[-3000:]
    assert (
        f"output {out}: starting over (--overwrite): the finished run in {out} is replaced when this run finishes"
        in replaced.stderr
    )
    assert (out / "notes.txt").read_text() == "the user's"
    assert (out / "model" / "model.safetensors").stat().st_mtime_ns != weights


def test_ctrl_c_during_start_up_says_so(tmp_path):
    """SIGINT while `kubetune run` checks the data, held deterministically on an S3 endpoint that
    accepts the connection and never answers (today's main exits 130 printing nothing)."""
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    held: list[socket.socket] = []
    threading.Thread(target=lambda: [held.append(server.accept()[0]) for _ in range(8)], daemon=True).start()
    port = server.getsockname()[1]
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "x",
        "AWS_SECRET_ACCESS_KEY": "y",
        "S3_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "kubetune",
            "run",
            str(EXAMPLE),
            "--set",
            "data.train=s3://bucket/chat.jsonl",
            "--set",
            f"output.uri={tmp_path / 'out'}",
        ],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.time() + 60
        while not held:  # preflight reached the data
            assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-2000:]
            time.sleep(0.05)
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
        server.close()
    assert proc.returncode == 130
    assert (
        err.strip().splitlines()[-1]
        == f"interrupted before training started; nothing was written to {tmp_path / 'out'} — run the same command again to start"
    )
    assert "Traceback" not in err and not (tmp_path / "out").exists()


@pytest.mark.parametrize("state", ["finished", "checkpoint", "nothing"])
def test_the_stop_message_follows_the_output_state(tmp_path, state):
    """What `kubetune run` says after SIGINT/SIGTERM reached it (its exit 143 path): a run that had
    just finished is not told to "run again to resume"."""
    from kubetune.artifacts.output import Output
    from kubetune.cli.run import _after_stop
    from kubetune.config import load_spec

    out = tmp_path / "out"
    job = load_spec(EXAMPLE, [f"output.uri={out}"])
    started = time.time() - 1
    out.mkdir()
    if state == "finished":
        (out / "metrics.json").write_text(json.dumps({}))
    elif state == "checkpoint":
        (out / "checkpoints" / "step-00000004").mkdir(parents=True)
        (out / "checkpoints" / "step-00000004" / "COMPLETE").write_text("{}")
    assert Output.for_spec(job).state_after_stop(started) == state
    expected = {
        "finished": f"the run had already finished: its artifacts in {out} are complete",
        "checkpoint": "run the same command again to resume from the last checkpoint",
        "nothing": "no checkpoint was written yet, so running the same command again starts over",
    }[state]
    assert _after_stop(job, started) == expected
