"""DPO end to end on the shipped tiny Llama, 2 gloo processes: a full fine-tune resumes bit-identically
after a SIGKILL, its reference log-probabilities computed again from the base weights when their
cache is gone; FSDP trains like DDP (its reference pass sharded); and the SFT -> DPO example learns
its preference (held-out reward accuracy >= 0.9) with LoRA, then exports, reports and predicts."""

from __future__ import annotations

import json
import os
import shutil
import signal
from pathlib import Path

import pytest
import torch
from conftest import kubetune, kubetune_together, start_run, wait_for_checkpoint, worker_pid, write_spec

pytestmark = pytest.mark.integration
PAIRS = "pkg://kubetune/assets/sentiment/sentiment-preferences.jsonl"


def _spec(out: Path, strategy: str = "ddp", **training) -> dict:
    return {
        "name": "dpo-tiny",
        "task": "dpo",
        "model": {"uri": "pkg://kubetune/assets/tiny-llama"},
        "data": {"train": PAIRS, "eval_fraction": 0.1, "max_length": 128, "max_train_samples": 320},
        "dpo": {"beta": 0.2},
        "training": {
            "epochs": 1,
            "max_steps": 20,
            "batch_size": 4,
            "grad_accum": 2,
            "learning_rate": 1e-3,
            "precision": "fp32",
            "log_every": 1,
            "checkpoint_every": 2,
            "eval_batch_size": 4,
            "seed": 3,
            **training,
        },
        "distributed": {"procs_per_node": 2, "strategy": strategy},
        "output": {"uri": str(out)},
    }


def _run(tmp: Path, spec: dict, env: dict | None = None):
    r = kubetune("run", str(write_spec(tmp / f"{spec['name']}.yaml", spec)), env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    return r


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "model" / "model.safetensors")


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k].double() - b[k].double()).abs().max().item() for k in a)


def _history(out: Path, kind: str) -> list[dict]:
    return [h for h in map(json.loads, (out / "history.jsonl").read_text().splitlines()) if h["type"] == kind]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Two uninterrupted runs at the same time: DDP (its reference log-probabilities cached in the
    session's cache, where the killed run finds them) and FSDP with a cache of its own (its reference
    pass runs under FSDP, every forward collective, not read from DDP's): name -> (output, stderr)."""
    tmp = tmp_path_factory.mktemp("dpo")
    specs = {"ddp": _spec(tmp / "ddp"), "fsdp": _spec(tmp / "fsdp", "fsdp", checkpoint_every=None)}
    envs = {"ddp": None, "fsdp": {"KUBETUNE_CACHE": str(tmp / "fsdp-cache")}}
    results = kubetune_together(
        *((("run", str(write_spec(tmp / f"{name}.yaml", spec))), envs[name]) for name, spec in specs.items())
    )
    for r in results:
        assert r.returncode == 0, r.stderr[-3000:]
    return {name: (tmp / name, r.stderr) for name, r in zip(specs, results)}


@pytest.fixture(scope="module")
def uninterrupted(runs):
    return runs["ddp"]


# e2e, this and the FSDP one (one module run of both): make test's DPO run is the example below (LoRA, DDP)
@pytest.mark.e2e
def test_full_finetune_resumes_bit_identically_after_sigkill_with_the_reference_recomputed(uninterrupted, tmp_path):
    ref_out, ref_log = uninterrupted
    assert "dpo reference log-probabilities of 320 + 120 pairs" in ref_log
    metrics = json.loads((ref_out / "metrics.json").read_text())
    assert metrics["task"] == "dpo" and metrics["global_step"] == 20 and metrics["dpo_reference"].startswith("precomp")
    train = _history(ref_out, "train")
    assert [h["step"] for h in train] == list(range(1, 21))
    assert {"reward_accuracy", "reward_margin", "reward_chosen", "reward_rejected"} <= train[0].keys()
    # rewards are beta x log-ratios: their margin is their difference, and the policy moved (full fine-tune)
    assert all(abs(h["reward_margin"] - (h["reward_chosen"] - h["reward_rejected"])) < 1e-6 for h in train)
    assert train[-1]["reward_margin"] > train[0]["reward_margin"]

    cache = Path(os.environ["KUBETUNE_CACHE"]) / "reference"
    out = tmp_path / "out"
    proc = start_run(write_spec(tmp_path / "job.yaml", _spec(out)))
    wait_for_checkpoint(out, 2, proc)
    os.kill(worker_pid(proc.pid, 1), signal.SIGKILL)  # as the OOM killer would; 18 steps were left
    _, killed_log = proc.communicate(timeout=120)
    assert proc.returncode != 0
    assert "read from the cache" in killed_log  # the uninterrupted run's reference, for the same model and data
    steps = sorted(int(p.name[5:]) for p in (out / "checkpoints").glob("step-*") if (p / "COMPLETE").exists())
    assert 2 <= steps[-1] < 20, steps
    # Without its cache the resumed run must compute the reference from the base weights, before
    # the checkpoint's weights replace them (else its rewards, and the weights, would differ).
    shutil.rmtree(cache)
    again = _run(tmp_path, _spec(out))
    assert "resumed from checkpoint step" in again.stderr and "computed and cached" in again.stderr
    diff = _max_diff(_weights(out), _weights(ref_out))
    print(f"dpo full fine-tune, SIGKILL after a checkpoint, resumed: max |diff| {diff}")
    assert diff == 0.0
    assert _history(out, "train") == train  # the same losses and rewards at every step


@pytest.mark.e2e
def test_fsdp_trains_like_ddp_with_a_sharded_reference_pass(runs):
    ref_out, _ = runs["ddp"]
    out, log = runs["fsdp"]
    # its own cache: the reference pass runs under FSDP (every forward collective), not read from DDP's
    assert "computed and cached" in log
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["strategy"] == "fsdp"
    diff = _max_diff(_weights(out), _weights(ref_out))
    print(f"dpo fsdp vs ddp, 2 processes: max |diff| {diff:.3g}")
    assert diff < 5e-5, diff  # reduction order only (test_fsdp.py: the tied embedding bound)
    ddp = json.loads((ref_out / "metrics.json").read_text())
    assert abs(metrics["eval_reward_margin"] - ddp["eval_reward_margin"]) < 1e-4


def test_sft_then_dpo_example_learns_the_preference_and_predicts(dpo_example):
    """The two stages of examples/dpo-tiny-chat.yaml, shortened: SFT on the chat data (the session's
    tiny-chat run, which test_causal_lm.py asserts on), then DPO with LoRA on its merged model
    (reference: the adapter disabled): the session's ``dpo_example``."""
    out, r = dpo_example
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    evals = _history(out, "eval")
    curve = [(h["step"], round(h["eval_reward_accuracy"], 3), round(h["eval_reward_margin"], 3)) for h in evals]
    print("held-out (step, reward accuracy, margin):", curve)
    assert metrics["eval_reward_accuracy"] >= 0.9 and metrics["eval_pairs"] == 120
    assert evals[-1]["eval_reward_margin"] > evals[0]["eval_reward_margin"] > 0
    assert metrics["dpo_reference"].startswith("the base model")
    assert (out / "adapter" / "adapter_config.json").exists() and (out / "model" / "config.json").exists()
    plots = {p.name for p in (out / "plots").iterdir()}
    assert {"reward_accuracy.png", "rewards.png"} <= plots and "eval_metrics.png" not in plots  # no empty plot
    assert "reward accuracy" in (out / "report.html").read_text()
    r = kubetune("predict", str(out), "What is the sentiment of this review? The crew was lovely", "--json")
    assert r.returncode == 0, r.stderr[-2000:]
    [result] = json.loads(r.stdout)
    assert result["completion"].strip() in {"negative", "neutral", "positive"}, result
