"""Real 2-process gloo jobs with the real MiniLM, launched by `kubetune run` as a user would."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import yaml
from conftest import descendants, environ_of, kubetune, kubetune_together, tiny_spec, write_spec

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def full_run(minilm_run):
    """The session's 2-epoch, 2-process full fine-tune (conftest.minilm_run: batch 4 × grad_accum 2,
    evaluated every 6 steps, data through a relative path, traced); several tests read its artifacts."""
    return minilm_run


def test_every_example_trained_exactly_once_per_epoch_across_ranks(full_run):
    out, trace, _ = full_run
    metrics = json.loads((out / "metrics.json").read_text())
    n = metrics["train_rows"]
    assert n == 120  # 160 rows, 25% held out; 120 = 7.5 global batches of 16: the last step is partial
    per_rank = {}
    for path in sorted(trace.glob("rank*.jsonl")):
        records = [json.loads(line) for line in path.read_text().splitlines()]
        per_rank[path.stem] = records
    assert set(per_rank) == {"rank0", "rank1"}
    for epoch in (0, 1):
        rows = [r for recs in per_rank.values() for rec in recs if rec["epoch"] == epoch for r in rec["rows"]]
        assert len(rows) == n and sorted(rows) == list(range(n))
        # Each rank trained on about half, not on everything.
        for recs in per_rank.values():
            mine = [r for rec in recs if rec["epoch"] == epoch for r in rec["rows"]]
            assert abs(len(mine) - n / 2) <= 8


def test_artifacts(full_run):
    out, _, proc = full_run
    metrics = json.loads((out / "metrics.json").read_text())
    for key in (
        "eval_accuracy",
        "eval_f1_macro",
        "eval_loss",
        "train_loss",
        "train_samples_per_second",
        "train_runtime_s",
        "world_size",
        "global_step",
    ):
        assert metrics[key] is not None, key
    assert metrics["world_size"] == 2
    assert metrics["global_step"] == 2 * 8  # 2 epochs × ceil(120 / (batch 4 × accum 2 × world 2))
    assert metrics["eval_samples"] == metrics["eval_rows"] == 40  # every eval row counted once across ranks
    assert 0 <= metrics["eval_accuracy"] <= 1 and metrics["baseline"]["accuracy"] > 0
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    # eval_every 6: mid-epoch at steps 6 and 12, and at the end of each epoch (steps 8 and 16), each with the
    # training time (evaluations excluded) and the samples seen so far.
    evals = [h for h in history if h["type"] == "eval"]
    assert [(h["step"], h["epoch"]) for h in evals] == [(6, 1), (8, 1), (12, 2), (16, 2)]
    assert [h["samples"] for h in evals] == [96, 120, 184, 240]
    assert all(0 < a["train_s"] < b["train_s"] for a, b in zip(evals, evals[1:]))
    assert evals[-1]["train_s"] == pytest.approx(metrics["train_runtime_s"], abs=0.01)
    assert evals[-1]["eval_accuracy"] == metrics["eval_accuracy"]
    assert any(h["type"] == "train" and h["loss"] > 0 for h in history)
    from kubetune.config import parse_spec

    assert parse_spec(yaml.safe_load((out / "job.yaml").read_text())).name == "tiny"
    report = (out / "report.html").read_text()
    assert report.count("data:image/png;base64,") == 2 and "TF-IDF" in report
    assert (out / "plots" / "train_loss.png").stat().st_size > 1000
    assert list((out / "tensorboard").glob("events.out.tfevents.*"))
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["id2label"] == {"0": "negative", "1": "neutral", "2": "positive"}
    assert config["label2id"] == {"negative": 0, "neutral": 1, "positive": 2}
    # Every worker log line says its rank; only rank 0 logs progress.
    worker_lines = [line for line in proc.stderr.splitlines() if re.match(r"\d\d:\d\d:\d\d \[", line)]
    assert worker_lines and all(re.match(r"\d\d:\d\d:\d\d \[rank \d\] ", line) for line in worker_lines)
    assert any("[rank 0] INFO epoch 2" in line for line in worker_lines)
    assert not any("[rank 1] INFO" in line for line in worker_lines)


def test_token_counts(full_run, small_csv):
    """Real (non-pad) tokens of the trained rows, counted once per epoch; padding is what the batches added."""
    out, _, _ = full_run
    metrics = json.loads((out / "metrics.json").read_text())
    import pandas as pd
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "model")
    lengths = sorted(
        len(ids) for ids in tok(pd.read_csv(small_csv)["text"].tolist(), truncation=True, max_length=32)["input_ids"]
    )
    n = metrics["train_rows"]
    real = metrics["train_tokens"]
    assert real % 2 == 0 and 2 * sum(lengths[:n]) <= real <= 2 * sum(lengths[-n:])  # 2 epochs of the same 120 rows
    assert metrics["train_padded_tokens"] >= real
    assert metrics["padding_fraction"] == pytest.approx(1 - real / metrics["train_padded_tokens"])
    assert metrics["padding_fraction"] < 0.25  # length-grouped batches pad little
    assert metrics["train_tokens_per_second"] == pytest.approx(real / metrics["train_runtime_s"])


def test_exported_model_works_with_pipeline_and_predict(full_run):
    out, _, _ = full_run
    from transformers import pipeline

    clf = pipeline("text-classification", model=str(out / "model"))
    assert clf("I hate this")[0]["label"] in {"negative", "neutral", "positive"}
    # the run's output and its model/ directory, predicted from at the same time (both only read)
    proc, plain = kubetune_together(
        (("predict", str(out), "I love it", "terrible idea", "--json"), None),
        (("predict", str(out / "model"), "I love it"), None),
    )
    assert proc.returncode == 0, proc.stderr
    results = json.loads(proc.stdout)
    assert [r["text"] for r in results] == ["I love it", "terrible idea"]
    assert all(r["label"] in {"negative", "neutral", "positive"} and 0 < r["score"] <= 1 for r in results)
    assert plain.returncode == 0 and plain.stdout.split("\t")[0] == results[0]["label"]


@pytest.fixture(scope="module")
def lora_run(full_run, tmp_path_factory, small_csv):
    """A short 2-process LoRA run after full_run, and the same job launched again at the same time
    (another output), which test_same_seed_same_weights compares with it:
    (output, spec, its CompletedProcess, the other launch's output)."""
    tmp = tmp_path_factory.mktemp("lora")
    out, again = tmp / "lora", tmp / "again"
    spec = write_spec(
        tmp / "job.yaml",
        tiny_spec(
            small_csv,
            out,
            lora={"r": 4, "alpha": 8, "target_modules": ["query", "value"]},
            training={"max_steps": 3, "batch_size": 8, "learning_rate": 1e-3, "log_every": 1, "seed": 7},
        ),
    )
    runs = kubetune_together(
        (("run", str(spec), "--set", "output.report_baseline=false"), None),
        (("run", str(spec), "--set", "output.report_baseline=false", "--set", f"output.uri={again}"), None),
    )
    for proc in runs:
        assert proc.returncode == 0, proc.stderr[-3000:]
    return out, spec, runs[0], again


# e2e, this and the same-seed test (one LoRA run of MiniLM plus a rerun): make test trains MiniLM above; the
# tokenization cache is unit-tested (test_rows.py), LoRA's export in test_causal_lm.py and the DPO example
@pytest.mark.e2e
def test_second_run_hits_tokenization_cache_and_lora_exports_adapter(lora_run):
    out, _, proc, _ = lora_run
    assert "tokenization cache hit" in proc.stderr  # same data, tokenizer and max_length as full_run
    m = re.search(r"(\d+) trainable / (\d+) parameters", proc.stderr)
    assert m and int(m.group(1)) < 0.05 * int(m.group(2))
    assert json.loads((out / "metrics.json").read_text())["global_step"] == 3
    assert (out / "adapter" / "adapter_config.json").exists()

    # The merged export gives the same logits as base model + adapter.
    import torch
    from peft import PeftModel
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out / "model")
    batch = tok(["what a lovely day", "never again"], return_tensors="pt", padding=True)
    merged = AutoModelForSequenceClassification.from_pretrained(out / "model").eval()
    base_dir = Path(json.loads((out / "adapter" / "adapter_config.json").read_text())["base_model_name_or_path"])
    base = AutoModelForSequenceClassification.from_pretrained(base_dir, num_labels=3)
    adapted = PeftModel.from_pretrained(base, out / "adapter").eval()
    with torch.no_grad():
        diff = (merged(**batch).logits - adapted(**batch).logits).abs().max().item()
    assert diff < 1e-4


def test_worker_side_user_error_is_one_line(tmp_path, small_csv):
    spec = write_spec(
        tmp_path / "job.yaml",
        tiny_spec(small_csv, tmp_path / "out", data={"train": str(small_csv), "label_column": "stars"}),
    )
    proc = kubetune("run", str(spec), "--no-preflight")
    assert proc.returncode == 2
    assert "[rank 0] error: data.label_column: column 'stars' not found" in proc.stderr
    assert "Traceback" not in proc.stderr


def _model_weights(out: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(out / "model" / "model.safetensors")


@pytest.mark.e2e
def test_same_seed_same_weights(lora_run):
    """Determinism from training.seed: the same 2-process job launched again (lora_run's second launch,
    other output) ends with bit-identical weights. (Full fine-tunes: test_reliability's resumed runs
    match their uninterrupted reference bit for bit.)"""
    first, _, _, out = lora_run
    a, b = _model_weights(first), _model_weights(out)
    assert a.keys() == b.keys()
    assert max((a[k] - b[k]).abs().max().item() for k in a) == 0.0
    base = _model_weights(first)["classifier.weight"]
    assert base.abs().sum() > 0
    from safetensors.torch import load_file

    adapters = [load_file(o / "adapter" / "adapter_model.safetensors") for o in (first, out)]
    assert adapters[0].keys() == adapters[1].keys() and any("lora_B" in k for k in adapters[0])
    assert max((adapters[0][k] - adapters[1][k]).abs().max().item() for k in adapters[0]) == 0.0


# Slow: test_reliability.py's SIGKILL test asserts the same exit and message ("worker rank 1 failed
# with exit code -9") before it resumes.
@pytest.mark.slow
def test_killed_worker_fails_the_run_naming_the_rank(tmp_path, small_csv):
    """SIGKILL one worker mid-run (as the OOM killer would): the run exits non-zero naming that rank."""
    import os
    import signal
    import subprocess
    import sys
    import time

    from conftest import ROOT

    trace = tmp_path / "trace"
    spec = write_spec(
        tmp_path / "job.yaml",
        tiny_spec(small_csv, tmp_path / "out", training={"epochs": 50, "batch_size": 4, "log_every": 1}),
    )
    proc = subprocess.Popen(
        [sys.executable, "-m", "kubetune", "run", str(spec)],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "KUBETUNE_TRACE_DIR": str(trace)},
    )
    try:
        deadline = time.time() + 120
        while not (trace / "rank1.jsonl").exists():  # training has started on rank 1
            assert time.time() < deadline and proc.poll() is None, "training never started"
            time.sleep(0.2)
        victim = next(pid for pid in descendants(proc.pid) if environ_of(pid).get("RANK") == "1")
        os.kill(victim, signal.SIGKILL)
        _, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 1, stderr[-2000:]
    assert "error: worker rank 1 failed with exit code -9" in stderr
