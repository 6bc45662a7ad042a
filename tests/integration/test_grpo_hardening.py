"""GRPO reward functions that misbehave on one rank, through the real CLI with 2 gloo processes (issue 45,
rows 9-11), as a user sees it: the exit code and the last line on stderr.

Three runs start at once (one module fixture; each leaves a core idle while it starts): rank 1's reward
returns an int too large for a float (the one-line reward error, exit 2); rank 1's reward calls
os._exit(0) (the message names rank 1, which quit, not rank 0, which lost it in a collective); rank 1's
reward sleeps 60 s at step 2 and the launcher gets SIGTERM (the call is given up, the checkpoint of
step 1 is written and the run exits 143, well within Kubernetes' 30 s grace period). Marked slow: the
stopped run, run again, equals the same job run uninterrupted, bit for bit."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from conftest import ROOT, kubetune_together, write_spec

# e2e: three 2-process runs at once; make test covers each row in process (test_grpo_reward_checks.py) and a
# reward failing on one rank end to end (test_grpo.py)
pytestmark = [pytest.mark.integration, pytest.mark.e2e]
GRACE_S = 30  # Kubernetes' default terminationGracePeriodSeconds, and torchrun's default shutdown timeout

REWARDS = """
import os
import time
from pathlib import Path


def huge(prompts, completions, completion_ids, **columns):
    if os.environ["RANK"] == "1":
        return [10**400] * len(completions)
    return [1.0] * len(completions)


def quits(prompts, completions, completion_ids, **columns):
    if os.environ["RANK"] == "1":
        os._exit(0)
    return [1.0] * len(completions)


CALLS = 0


def slow(prompts, completions, completion_ids, **columns):
    global CALLS
    CALLS += 1
    flag = os.environ.get("SLOW_FLAG")
    if flag and CALLS == 2 and os.environ["RANK"] == "1":  # the call of step 2
        Path(flag).write_text("sleeping")
        time.sleep(60)
    return [len(c[-1]["content"]) % 3 - 1.0 for c in completions]
"""


def _spec(out: Path, name: str, function: str) -> dict:
    return {
        "name": f"grpo-hardening-{name}",
        "task": "grpo",
        "model": {"uri": "pkg://kubetune/assets/tiny-llama"},
        "data": {
            "train": "pkg://kubetune/assets/sentiment/sentiment-instructions.jsonl",
            "prompt_column": "input",
            "format": "chat",
            "max_length": 48,
            "max_train_samples": 16,
            "max_eval_samples": 4,
        },
        "grpo": {"num_generations": 2, "max_completion_length": 4, "rewards": [{"function": f"rewards:{function}"}]},
        "training": {
            "max_steps": 2,
            "batch_size": 1,
            "learning_rate": 1e-2,
            "precision": "fp32",
            "log_every": 1,
            "checkpoint_every": None,  # the stopped run's only checkpoint is the one its stop writes
            "seed": 5,
        },
        "distributed": {"procs_per_node": 2},
        "output": {"uri": str(out)},
    }


def _start(spec_path: Path, env: dict) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "kubetune", "run", str(spec_path)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        env={**os.environ, **env},
    )


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """name -> (CompletedProcess, output); also "stopped_s", the seconds from the stopped run's SIGTERM to its
    exit, "checkpoints", what it left, and "tmp", "env" for running its job again."""
    tmp = tmp_path_factory.mktemp("grpo-hardening")
    (tmp / "rewards.py").write_text(REWARDS)
    env = {"PYTHONPATH": str(tmp)}
    flag = tmp / "sleeping"
    jobs = {"huge": "huge", "quits": "quits", "stopped": "slow"}
    procs = {
        name: _start(
            write_spec(tmp / f"{name}.yaml", _spec(tmp / name, name, function)),
            {**env, **({"SLOW_FLAG": str(flag)} if name == "stopped" else {})},
        )
        for name, function in jobs.items()
    }
    results: dict = {"tmp": tmp, "env": env}
    try:
        stopped = procs["stopped"]
        deadline = time.time() + 300
        while not flag.exists():  # rank 1 is in the reward call of step 2
            assert stopped.poll() is None, stopped.communicate()[1][-3000:]
            assert time.time() < deadline, "the slow reward was never called"
            time.sleep(0.05)
        os.kill(stopped.pid, signal.SIGTERM)  # as the kubelet signals a pod's main process
        sent = time.monotonic()
        stopped.wait(timeout=120)
        results["stopped_s"] = time.monotonic() - sent
        results["checkpoints"] = sorted(
            p.name for p in (tmp / "stopped" / "checkpoints").glob("step-*") if (p / "COMPLETE").exists()
        )
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            results[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, out, err), tmp / name)
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.communicate()
    return results


def _last_line(r: subprocess.CompletedProcess) -> str:
    return r.stderr.strip().splitlines()[-1]


def test_a_reward_too_large_for_a_float_on_one_rank_is_the_one_line_reward_error(runs):
    r, _ = runs["huge"]
    assert r.returncode == 2, r.stderr[-3000:]
    assert "Traceback" not in r.stderr and "OverflowError" not in r.stderr
    errors = [line for line in r.stderr.splitlines() if "] error: " in line]
    assert errors == [
        "[rank 0] error: grpo.rewards[0].function: reward function huge returned "
        "'1000000000000000000000000000000000000000...' for completion 0 at step 1: too large for a float — return a "
        "finite number (or None where the function does not apply)"
    ]


def test_a_rank_that_exits_0_early_is_the_one_named(runs):
    r, _ = runs["quits"]
    assert r.returncode == 1, r.stderr[-3000:]
    last = _last_line(r)
    assert last.startswith("error: worker rank 1 exited with code 0 before the job finished"), last
    assert "rank 0 failed" not in r.stderr.splitlines()[-1]


def test_sigterm_during_a_slow_reward_checkpoints_the_last_step_within_the_grace_period(runs):
    r, _ = runs["stopped"]
    print(f"SIGTERM during a 60 s reward call: exited {r.returncode} after {runs['stopped_s']:.1f} s")
    assert r.returncode == 143, r.stderr[-3000:]
    assert runs["stopped_s"] < GRACE_S  # the contract itself; about 2 s when the machine is quiet
    assert runs["checkpoints"] == ["step-00000001"]  # the last completed step's, written on the stop
    assert "Traceback" not in r.stderr


@pytest.mark.slow  # test_grpo_reward_checks: the given-up step leaves the random state as before it
def test_the_stopped_run_resumes_to_the_uninterrupted_runs_weights_and_history(runs):
    """The checkpoint written after the given-up step is exact: the stopped job run again ends where the same
    job run uninterrupted does, bit for bit."""
    tmp, env = runs["tmp"], runs["env"]
    reference = write_spec(tmp / "reference.yaml", _spec(tmp / "reference", "reference", "slow"))
    again, ref = kubetune_together((("run", str(tmp / "stopped.yaml")), env), (("run", str(reference)), env))
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert again.returncode == 0, again.stderr[-3000:]
    assert "resumed from checkpoint step 1" in again.stderr
    from safetensors.torch import load_file

    a, b = (load_file(tmp / name / "model" / "model.safetensors") for name in ("stopped", "reference"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)

    def train(o: Path) -> list[dict]:
        return [h for h in map(json.loads, (o / "history.jsonl").read_text().splitlines()) if h["type"] == "train"]

    assert train(tmp / "stopped") == train(tmp / "reference")
