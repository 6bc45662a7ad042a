"""Asynchronous checkpoints under a real SIGKILL: a 2-process gloo run with the real MiniLM whose writer is held
(deterministically, by the writer's test-only hold) while a checkpoint is in flight and training goes on, then
killed; the rerun resumes from the previous checkpoint, whole, and ends with the uninterrupted run's weights."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from conftest import kubetune, minilm_spec, start_run, worker_pid, write_spec

from kubetune import checkpoint
from kubetune.checkpoint.writer import HOLD_ENV

pytestmark = pytest.mark.integration


def _weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "model" / "model.safetensors")


def _train_losses(out: Path) -> list[tuple[int, float]]:
    lines = (out / "history.jsonl").read_text().splitlines() if (out / "history.jsonl").exists() else []
    return [(h["step"], h["loss"]) for h in map(json.loads, lines) if h["type"] == "train"]


def _until(done, proc, what: str, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while not done():
        assert proc.poll() is None, proc.communicate()[1][-3000:]
        assert time.time() < deadline, what
        time.sleep(0.05)


# make test: tests/unit/test_async_checkpoint.py (a checkpoint absent until its writer completes it, pruning after
# it, errors at the wait) and every checkpointing run of make test (asynchronous by default).
@pytest.mark.e2e
def test_sigkill_during_an_async_save_resumes_from_the_previous_checkpoint_exactly(minilm_run, tmp_path, small_csv):
    out, hold = tmp_path / "out", tmp_path / "hold"
    hold.mkdir()
    raw = minilm_spec(small_csv, out, checkpoint_every=3)
    raw["output"]["report_baseline"] = False
    spec = write_spec(tmp_path / "job.yaml", raw)
    proc = start_run(spec, {HOLD_ENV: f"6:{hold}"})
    root = out / "checkpoints"
    _until((hold / "held").exists, proc, "the step-6 checkpoint was never held")
    # training goes on while step 6's checkpoint is in flight (step 9's save would wait for it)
    _until(lambda: any(step >= 8 for step, _ in _train_losses(out)), proc, "no step past the save")
    assert checkpoint.complete_steps(root) == [3] and not (root / "step-00000006").exists()
    (building,) = root.glob(".step-00000006-*")
    assert (building / "state.pt").exists() and not (building / checkpoint.MARKER).exists()
    os.kill(worker_pid(proc.pid, 0), signal.SIGKILL)  # the writer's process, its save in flight
    _, err = proc.communicate(timeout=120)
    assert proc.returncode != 0 and "worker rank 0 failed" in err, err[-3000:]
    assert checkpoint.complete_steps(root) == [3]  # the previous checkpoint whole, the held one absent

    again = kubetune("run", str(spec))
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from checkpoint step 3 " in again.stderr
    reference = minilm_run[0]
    mine, theirs = _weights(out), _weights(reference)
    assert mine.keys() == theirs.keys()
    assert max((mine[k].double() - theirs[k].double()).abs().max().item() for k in mine) == 0.0
    assert _train_losses(out) == _train_losses(reference)  # every step once, the same losses
