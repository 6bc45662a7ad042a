"""A `kubetune run` killed outright (kill -9, the OOM killer) takes every process of its job with it, and no
second run writes an output while a live run holds it (issue 63, row 1: the workers of a killed launcher
trained on as orphans, and a second run resumed into the same directory beside them)."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import descendants, kubetune, start_run, tiny_spec, wait_for_checkpoint, write_spec

from kubetune.artifacts.output import Output
from kubetune.config import load_spec

pytestmark = pytest.mark.integration


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for its reaper has ended)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_launcher_killed_outright_takes_its_workers_and_a_second_run_waits_for_it(tmp_path, small_csv):
    out = tmp_path / "out"
    spec_path = write_spec(
        tmp_path / "job.yaml",
        tiny_spec(small_csv, out, training={"epochs": 50, "batch_size": 4, "log_every": 1, "checkpoint_every": 2}),
    )
    first = start_run(spec_path)
    try:
        wait_for_checkpoint(out, 2, first)  # training, with a checkpoint to resume from
        job = descendants(first.pid)
        assert len(job) >= 2, job  # the two workers (and whatever they started)

        # A second run on the same output while the first trains: refused before it starts a worker.
        second = kubetune("run", str(spec_path), timeout=300)
        assert second.returncode == 2, second.stderr[-2000:]
        (line,) = [x for x in second.stderr.splitlines() if x.strip()]
        assert line.startswith(f"error: output.uri: {out} is in use by another run that is still going (job 'tiny', ")
        holder = json.loads((out / ".kubetune-lock").read_text())
        assert holder["pid"] in job and f"pid {holder['pid']} on " in line

        first.send_signal(signal.SIGKILL)  # the launcher only: its workers are in sessions of their own
        first.wait()
        deadline = time.time() + 15
        while [pid for pid in job if _alive(pid)]:
            assert time.time() < deadline, f"outlived their launcher: {[pid for pid in job if _alive(pid)]}"
            time.sleep(0.1)
    finally:
        for pid in [first.pid, *descendants(first.pid)]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    written = (out / "history.jsonl").read_bytes()
    time.sleep(1.5)  # nothing of the job writes any more
    assert (out / "history.jsonl").read_bytes() == written
    # and the output is free: the next run resumes there from the last checkpoint
    spec = load_spec(spec_path)
    assert Output.for_spec(spec).check(spec).action == "resume"
