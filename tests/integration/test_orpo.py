"""ORPO end to end (task: orpo) on the shipped tiny Llama and the packaged sentiment preferences, 2 gloo processes,
no SFT stage and no reference model: the held-out margin between the chosen and the rejected answers rises, TRL's
metric names are logged, the export predicts; a full fine-tune killed with SIGKILL resumes to the same weights bit
for bit (e2e)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from conftest import kubetune, start_run, wait_for_checkpoint, worker_pid, write_spec

pytestmark = pytest.mark.integration
PAIRS = "pkg://kubetune/assets/sentiment/sentiment-preferences.jsonl"


def _spec(out: Path, **training) -> dict:
    return {
        "name": "orpo-tiny",
        "task": "orpo",
        "model": {"uri": "pkg://kubetune/assets/tiny-llama"},
        "data": {
            "train": PAIRS,
            "eval_fraction": 0.1,
            "max_length": 128,
            "max_train_samples": 256,
            "max_eval_samples": 48,
        },  # fmt: skip
        "orpo": {"beta": 0.2},
        "training": {
            "max_steps": 16,
            "batch_size": 4,
            "learning_rate": 1e-3,
            "precision": "fp32",
            "log_every": 1,
            "eval_every": 8,
            "eval_on_start": True,
            "seed": 3,
            **training,
        },
        "distributed": {"procs_per_node": 2},
        "output": {"uri": str(out)},
    }


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("orpo")
    r = kubetune("run", str(write_spec(tmp / "job.yaml", _spec(tmp / "out"))), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "out"


def test_it_raises_the_held_out_margin_logs_trls_names_and_predicts(trained):
    out = trained
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["task"] == "orpo" and metrics["orpo_beta"] == 0.2 and metrics["world_size"] == 2
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    evals = [h for h in history if h["type"] == "eval"]
    assert evals[0]["step"] == 0 and len(evals) >= 3
    print(f"orpo held-out reward margin: {evals[0]['eval_reward_margin']:.4f} -> {evals[-1]['eval_reward_margin']:.4f}")
    assert evals[-1]["eval_reward_margin"] > evals[0]["eval_reward_margin"] + 0.05
    assert evals[-1]["eval_nll_loss"] < evals[0]["eval_nll_loss"]
    train = [h for h in history if h["type"] == "train"]
    assert {"reward_accuracy", "reward_margin", "nll_loss", "log_odds_ratio", "log_odds_chosen"} <= train[0].keys()
    r = kubetune("predict", str(out), "What is the sentiment of this review? great crew", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr[-2000:]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "model" / "model.safetensors")


@pytest.mark.e2e
def test_a_run_killed_with_sigkill_resumes_to_the_same_weights(trained, tmp_path):
    out = tmp_path / "out"
    proc = start_run(write_spec(tmp_path / "job.yaml", _spec(out, checkpoint_every=4)))
    wait_for_checkpoint(out, 4, proc)
    os.kill(worker_pid(proc.pid, 1), signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    r = kubetune("run", str(tmp_path / "job.yaml"), timeout=600)
    assert r.returncode == 0 and "resumed from checkpoint step" in r.stderr, r.stderr[-3000:]
    a, b = _weights(out), _weights(trained)
    diff = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    print(f"orpo, SIGKILL after a checkpoint, resumed: max |diff| {diff}")
    assert diff == 0.0


@pytest.mark.e2e
@pytest.mark.parametrize("lora", [False, True])
def test_it_learns_under_fsdp(tmp_path, lora):
    """ORPO has no reference model, so a full fine-tune shards as the causal-LM task's does; LoRA too."""
    spec = _spec(tmp_path / "out")
    spec["distributed"]["strategy"] = "fsdp"
    if lora:
        spec["lora"] = {"r": 8, "alpha": 16, "target_modules": "all-linear"}
        spec["training"]["learning_rate"] = 5e-3
    r = kubetune("run", str(write_spec(tmp_path / "job.yaml", spec)), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["strategy"] == "fsdp" and metrics["world_size"] == 2
    history = [json.loads(line) for line in (tmp_path / "out" / "history.jsonl").read_text().splitlines()]
    evals = [h for h in history if h["type"] == "eval"]
    first, last = evals[0]["eval_reward_margin"], evals[-1]["eval_reward_margin"]
    print(f"orpo under fsdp ({'LoRA' if lora else 'full'}): held-out reward margin {first:.4f} -> {last:.4f}")
    assert last > first + 0.05
    r = kubetune(
        "predict", str(tmp_path / "out"), "What is the sentiment of this review? rude staff", "--max-new-tokens", "4"
    )
    assert r.returncode == 0, r.stderr[-2000:]
