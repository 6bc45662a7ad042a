"""Checkpoints, graceful stop, automatic and exact resume, elastic restarts: real 2-process
gloo runs with the real MiniLM, interrupted by real signals."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
import yaml
from conftest import (
    descendants,
    environ_of,
    is_worker,
    kubetune,
    minilm_spec,
    start_run,
    wait_for_checkpoint,
    write_spec,
)

from kubetune.errors import KubetuneError

pytestmark = pytest.mark.integration


def _spec(small_csv, out: Path, **training) -> dict:
    """The job of conftest.minilm_run (16 steps), checkpointed: the reference run and these train
    the same (the TF-IDF baseline, left out here, is fitted at export and changes no weight)."""
    spec = minilm_spec(small_csv, out, **{"checkpoint_every": 3, **training})
    spec["output"]["report_baseline"] = False
    return spec


def _weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "model" / "model.safetensors")


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _eval(out: Path) -> dict:
    m = json.loads((out / "metrics.json").read_text())
    return {k: m[k] for k in ("eval_loss", "eval_accuracy", "eval_f1_macro", "eval_confusion", "global_step")}


@pytest.fixture(scope="module")
def reference(minilm_run):
    """The uninterrupted run every interrupted one must match exactly: the session's minilm_run (the
    same job; it writes no checkpoints, which change nothing a resumed run must match: the weights are
    compared bit for bit against runs that checkpoint every 3 and every 6 steps)."""
    return minilm_run[0]


def _worker_pids(launcher: int) -> dict[int, int]:
    """rank -> pid of the worker processes under a `kubetune run`."""
    ranks = {}
    for pid in descendants(launcher):
        env = environ_of(pid)
        if is_worker(pid) and "RANK" in env:
            ranks[int(env["RANK"])] = pid
    return ranks


@pytest.fixture(scope="module")
def killed(minilm_killed):
    """conftest.minilm_killed: a run of this job whose rank 1 was SIGKILLed after its step-6 checkpoint,
    `kubetune status` read while it ran and once it had failed, and a copy of its output."""
    return minilm_killed


@pytest.mark.e2e  # make test's resume: test_mlflow.py's SIGTERM + resume of the same job; checkpoint checks below
def test_sigkilled_worker_then_rerun_resumes_exactly_through_an_elastic_restart(reference, killed, tmp_path):
    """The killed run fails naming the rank; run again (with restarts allowed), it resumes, loses its
    rank 0 to a SIGKILL after a later checkpoint, restarts its workers, resumes again and completes in
    that one run: every step trained once, and the uninterrupted run's weights, evaluation and losses."""
    out, spec, err, progress = killed.out, killed.spec, killed.err, killed.running["progress"]
    assert killed.running["phase"] == "Running" and killed.running["kind"] == "LocalRun", killed.running
    assert 6 <= progress["step"] <= 16 and progress["total_steps"] == 16 and progress["epochs"] == 2
    assert progress["loss"] > 0 and progress["eta_s"] >= 0 and progress["samples_per_s"] > 0
    assert killed.code == 1 and "worker rank 1 failed with exit code -9" in err
    assert "local run tiny: Failed" in killed.failed and "reason: WorkerFailed" in killed.failed, killed.failed
    # the log of a run outside a terminal: plain progress lines, no bar redrawn with \r
    assert "\r" not in err and "progress: step=1/16 epoch=1/2 loss=" in err
    steps = sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step-*") if (p / "COMPLETE").exists())
    # The same job again, elastic (max_restarts and checkpoint_every are not in the checkpoint's
    # fingerprint): a checkpoint every 3 steps, and rank 0 SIGKILLed after the first one past the resume.
    raw = yaml.safe_load(spec.read_text())
    raw["distributed"]["max_restarts"] = 2
    raw["training"]["checkpoint_every"] = 3
    proc = start_run(write_spec(tmp_path / "elastic.yaml", raw))
    later = (steps[-1] // 3 + 1) * 3
    wait_for_checkpoint(out, later, proc)
    os.kill(_worker_pids(proc.pid)[0], signal.SIGKILL)
    _, again = proc.communicate(timeout=240)
    assert proc.returncode == 0, again[-3000:]
    assert f"resumed from checkpoint step {steps[-1]} " in again
    assert again.count("resumed from checkpoint step") == 2, again[-3000:]  # the rerun's start, then the restart's
    assert "progress: step=16/16 epoch=2/2" in again and "\r" not in again
    done = kubetune("status", "tiny")
    assert "local run tiny: Succeeded" in done.stdout and "metrics: eval_loss" in done.stdout, done.stdout
    assert _max_diff(_weights(out), _weights(reference)) == 0.0
    assert _eval(out) == _eval(reference)
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    train_steps = [h["step"] for h in history if h["type"] == "train"]
    assert train_steps == list(range(1, 17))  # nothing lost, nothing twice
    ref_history = [json.loads(line) for line in (reference / "history.jsonl").read_text().splitlines()]
    assert [h["loss"] for h in history if h["type"] == "train"] == [
        h["loss"] for h in ref_history if h["type"] == "train"
    ]
    # the evaluation at step 6, made before the checkpoint the rerun resumed from, is kept (issue 63, row 2)
    evals = [(h["step"], h["eval_loss"]) for h in history if h["type"] == "eval"]
    assert evals == [(h["step"], h["eval_loss"]) for h in ref_history if h["type"] == "eval"] and evals[0][0] == 6


# Slow: the SIGTERM path (checkpoint at the signal's step, exit 143, the next start resumes with nothing
# lost or twice) is test_pod_exit_codes.py's, and a bit-identical resume from a checkpoint (the same
# save_checkpoint) is the SIGKILL test's above.
@pytest.mark.slow
def test_sigterm_to_kubetune_run_checkpoints_exits_143_and_resumes_exactly(reference, tmp_path, small_csv):
    out = tmp_path / "out"
    spec = write_spec(tmp_path / "job.yaml", _spec(small_csv, out, checkpoint_every=100))
    proc = start_run(spec)
    deadline = time.time() + 180
    while (
        not list((out / "history.jsonl").parent.glob("history.jsonl"))
        or len((out / "history.jsonl").read_text().splitlines()) < 4
    ):
        assert proc.poll() is None and time.time() < deadline, proc.communicate()[1][-3000:]
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    assert "stopped:" in err and "run the same command again to resume" in err
    saved = [p for p in (out / "checkpoints").glob("step-*") if (p / "COMPLETE").exists()]
    assert len(saved) == 1 and 4 <= int(saved[0].name[5:]) < 16  # the signal's step, not a periodic one
    again = kubetune("run", str(spec))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from checkpoint step {int(saved[0].name[5:])} " in again.stderr
    assert _max_diff(_weights(out), _weights(reference)) == 0.0
    assert _eval(out) == _eval(reference)


def test_incompatible_checkpoints_are_one_line_errors(killed):
    """Against the checkpoints the killed run left (a copy of them: the resume test clears its own)."""
    out = killed.copy
    spec = write_spec(
        out.parent / "copy.yaml", {**yaml.safe_load(killed.spec.read_text()), "output": {"uri": str(out)}}
    )
    # `kubetune run`'s stop message under SIGTERM is asserted by test_mlflow.py's SIGTERM test
    # Through the real CLI, the checkpoint's one-line error is test_fsdp.py's global-batch case
    # (a CLI run per setting would cost a worker start-up each).
    # Every guarded setting, against the fingerprint the interrupted run saved (the same check the
    # worker makes; a CLI run per setting would cost a worker start-up each).
    from kubetune import checkpoint
    from kubetune.config import load_spec

    step = checkpoint.complete_steps(out / "checkpoints")[-1]  # the one a resume would load
    found = checkpoint.Found(step, out / "checkpoints" / f"step-{step:08d}")
    saved = checkpoint.load(found)["fingerprint"]
    same = load_spec(spec)
    checkpoint.check_compatible(
        saved,
        checkpoint.fingerprint(same, saved["labels"], same.distributed.world_size, saved["data"]["train_rows"]),
        str(found.path),
    )
    cases = [
        ("distributed.procs_per_node=1", "error: distributed: the checkpoint in"),
        ("training.batch_size=8", "error: training.batch_size: the checkpoint in"),
        ("training.learning_rate=0.001", "error: training.learning_rate: the checkpoint in"),
        ("data.max_length=16", "error: data.max_length: the checkpoint in"),
        ("lora.r=4", "error: lora: the checkpoint in"),
    ]
    for override, expected in cases:
        changed = load_spec(spec, [override])
        current = checkpoint.fingerprint(
            changed, saved["labels"], changed.distributed.world_size, saved["data"]["train_rows"]
        )
        with pytest.raises(KubetuneError) as e:
            checkpoint.check_compatible(saved, current, str(found.path))
        line = f"error: {e.value}"
        assert line.startswith(expected) and "--no-resume" in line and "\n" not in line, line
    # The training rows' content is fingerprinted (data/rows.py's key): other data, even with as many rows, is refused.
    assert saved["data"]["content"]
    other = checkpoint.fingerprint(
        same, saved["labels"], same.distributed.world_size, saved["data"]["train_rows"], content="0" * 32
    )
    with pytest.raises(KubetuneError) as e:
        checkpoint.check_compatible(saved, other, str(found.path))
    line = f"error: {e.value}"
    assert line.startswith("error: data.train: data.train changed since the checkpoint in") and "\n" not in line, line
    # That --no-resume starts over (no resume, the old checkpoints cleared) through the real CLI is
    # test_mlflow.py's SIGTERM test: its run starts with --no-resume over a copy of these checkpoints.
