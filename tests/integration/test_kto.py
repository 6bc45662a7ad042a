"""KTO end to end (task: kto) on the shipped tiny Llama and the packaged sentiment preferences unpaired (each chosen
answer desirable, each rejected one not), 2 gloo processes: a full fine-tune (the reference a frozen copy of the
base) raises the held-out reward margin between the desirable and the undesirable answers, logs TRL's metric
names, the export predicts; killed with SIGKILL after a checkpoint it resumes to the same weights bit for bit (e2e:
the reference is still the base, not the checkpoint); LoRA under FSDP learns too (e2e)."""

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


def _spec(out: Path, **over) -> dict:
    spec = {
        "name": "kto-tiny",
        "task": "kto",
        "model": {"uri": "pkg://kubetune/assets/tiny-llama"},
        "data": {
            "train": PAIRS,
            "eval_fraction": 0.1,
            "max_length": 128,
            "max_train_samples": 256,
            "max_eval_samples": 48,
        },  # fmt: skip
        "kto": {"beta": 0.2},
        "training": {
            "max_steps": 16,
            "batch_size": 4,
            "learning_rate": 1e-3,
            "precision": "fp32",
            "log_every": 1,
            "eval_every": 8,
            "eval_on_start": True,
            "seed": 3,
        },
        "distributed": {"procs_per_node": 2},
        "output": {"uri": str(out)},
    }
    for key, value in over.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("kto")
    r = kubetune("run", str(write_spec(tmp / "job.yaml", _spec(tmp / "out"))), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "out"


def _evals(out: Path) -> list[dict]:
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    return [h for h in history if h["type"] == "eval"]


def test_it_raises_the_held_out_margin_logs_trls_names_and_predicts(trained):
    out = trained
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["task"] == "kto" and metrics["kto_beta"] == 0.2 and metrics["world_size"] == 2
    assert metrics["kto_reference"] == "a frozen copy of the base model"
    assert metrics["kto_train_desirable"] > 0 and metrics["kto_train_undesirable"] > 0
    evals = _evals(out)
    assert evals[0]["step"] == 0 and len(evals) >= 3
    print(f"kto held-out reward margin: {evals[0]['eval_reward_margin']:.4f} -> {evals[-1]['eval_reward_margin']:.4f}")
    assert abs(evals[0]["eval_reward_margin"]) < 1e-6  # step 0: the policy is the reference
    assert evals[-1]["eval_reward_margin"] > evals[0]["eval_reward_margin"] + 0.2
    train = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    train = [h for h in train if h["type"] == "train"]
    assert {"kl", "reward_chosen", "reward_rejected", "reward_margin", "logps_chosen", "logps_rejected"} <= train[
        0
    ].keys()
    assert "reward margin" in (out / "report.html").read_text()
    r = kubetune("predict", str(out), "What is the sentiment of this review? great crew", "--max-new-tokens", "4")
    assert r.returncode == 0, r.stderr[-2000:]


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "model" / "model.safetensors")


@pytest.mark.e2e
def test_a_run_killed_with_sigkill_resumes_to_the_same_weights(trained, tmp_path):
    out = tmp_path / "out"
    proc = start_run(write_spec(tmp_path / "job.yaml", _spec(out, training={"checkpoint_every": 4})))
    wait_for_checkpoint(out, 4, proc)
    os.kill(worker_pid(proc.pid, 1), signal.SIGKILL)
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    r = kubetune("run", str(tmp_path / "job.yaml"), timeout=600)
    assert r.returncode == 0 and "resumed from checkpoint step" in r.stderr, r.stderr[-3000:]
    a, b = _weights(out), _weights(trained)
    diff = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    print(f"kto, SIGKILL after a checkpoint, resumed: max |diff| {diff}")
    assert diff == 0.0


@pytest.mark.e2e
def test_lora_under_fsdp_learns(tmp_path):
    lora = {"r": 8, "alpha": 16, "target_modules": "all-linear"}
    spec = _spec(tmp_path / "out", lora=lora, distributed={"strategy": "fsdp"}, training={"learning_rate": 5e-3})
    r = kubetune("run", str(write_spec(tmp_path / "job.yaml", spec)), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads((tmp_path / "out" / "metrics.json").read_text())
    assert metrics["strategy"] == "fsdp" and metrics["kto_reference"].startswith("the base model (LoRA")
    evals = _evals(tmp_path / "out")
    print(
        f"kto LoRA FSDP: held-out margin {evals[0]['eval_reward_margin']:.4f} -> {evals[-1]['eval_reward_margin']:.4f}"
    )
    assert evals[-1]["eval_reward_margin"] > evals[0]["eval_reward_margin"] + 0.05
