"""Causal-LM end to end on the shipped tiny random-init Llama: 2-process LoRA run of the tiny
example (loss goes down, adapter loads, merged logits equal adapter logits, predict generates),
a full fine-tune on instruction data, and QLoRA refused on CPU with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import TOKEN_CANARY, kubetune

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "causal-tiny-chat.yaml"


def _history(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]


def _trace(trace: Path) -> list[dict]:
    return [json.loads(line) for f in sorted(trace.glob("rank*.jsonl")) for line in f.read_text().splitlines()]


def test_tiny_chat_example_lora_two_processes(tiny_chat_sft):
    out, trace, r = tiny_chat_sft
    canary = TOKEN_CANARY
    # Token-budget micro-batches: none above the budget, every row once per epoch over both ranks.
    micro = _trace(trace)
    assert all(0 < m["tokens"] <= 1024 for m in micro if m["rows"])
    for epoch in (0, 1):
        assert sorted(r for m in micro if m["epoch"] == epoch for r in m["rows"]) == list(range(600))
    assert canary not in r.stdout + r.stderr
    assert not [p for p in out.rglob("*") if p.is_file() and canary.encode() in p.read_bytes()]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["task"] == "causal-lm" and metrics["world_size"] == 2
    assert metrics["data_format"] == "chat" and metrics["chat_template"] == "fallback" and metrics["packing"] is True
    assert metrics["train_rows"] == 600 and metrics["epochs_completed"] == 2
    # The data's own token count is per epoch; train_tokens counts every epoch trained (packed: no padding).
    assert metrics["train_tokens"] == metrics["train_padded_tokens"] == 2 * metrics["train_data_tokens"]
    assert metrics["padding_fraction"] == 0.0 and 0 < metrics["train_data_target_tokens"] < metrics["train_data_tokens"]
    losses = [h["loss"] for h in _history(out) if h["type"] == "train"]
    # Random init: about ln(2048) = 7.6 at first; answering with one of three words is learnable.
    assert losses[0] > 5.0 and losses[-1] < 0.5 * losses[0], losses
    evals = [h for h in _history(out) if h["type"] == "eval"]
    assert len(evals) == 2 and evals[1]["eval_perplexity"] < evals[0]["eval_perplexity"] < 2048
    assert (
        abs(metrics["eval_perplexity"] - torch.tensor(metrics["eval_loss"]).exp().item())
        < 1e-3 * metrics["eval_perplexity"]
    )

    # The adapter loads onto the base, and the merged export computes the same logits (1e-4).
    from peft import PeftModel
    from transformers import AutoModelForCausalLM, AutoTokenizer

    base = AutoModelForCausalLM.from_pretrained(ROOT / "src/kubetune/assets/tiny-llama", dtype=torch.float32)
    adapted = PeftModel.from_pretrained(base, out / "adapter").eval()
    merged = AutoModelForCausalLM.from_pretrained(out / "model").eval()
    tok = AutoTokenizer.from_pretrained(out / "model")
    assert tok.chat_template and "<|assistant|>" in tok.chat_template  # saved with the template it was trained with
    text = tok.apply_chat_template(
        [{"role": "user", "content": "What is the sentiment of this review? great seats"}],
        tokenize=False,
        add_generation_prompt=True,
    )
    ids = tok(text, add_special_tokens=False, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        a, m = adapted(input_ids=ids).logits, merged(input_ids=ids).logits
        plain = AutoModelForCausalLM.from_pretrained(ROOT / "src/kubetune/assets/tiny-llama")(input_ids=ids).logits
    assert torch.allclose(a, m, atol=1e-4), (a - m).abs().max()
    assert not torch.allclose(a, plain, atol=1e-2)  # the adapter changed something

    r = kubetune(
        "predict",
        str(out),
        "What is the sentiment of this review? The brakes failed twice.",
        "--json",
        "--max-new-tokens",
        "8",
    )
    assert r.returncode == 0, r.stderr[-2000:]
    [result] = json.loads(r.stdout)
    # Greedy decoding from a model trained only to answer with a sentiment word.
    assert result["completion"].strip() in {"negative", "neutral", "positive"}, result


@pytest.mark.e2e  # make test: the tiny chat LoRA run above; a full fine-tune in test_fsdp.py and the GRPO example
def test_full_finetune_on_instruction_data_without_packing(tmp_path):
    data = tmp_path / "alpaca.jsonl"
    rows = [
        {"instruction": f"Repeat the number {i % 7}.", "input": "", "output": f"{i % 7} {i % 7} {i % 7}"}
        for i in range(96)
    ]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "full"
    r = kubetune(
        "run",
        str(EXAMPLE),
        "--set",
        f"output.uri={out}",
        "--set",
        f"data.train={data}",
        "--set",
        "data.format=auto",
        "--set",
        "data.packing=false",
        "--set",
        "lora=null",
        "--set",
        "training.max_steps=12",
        "--set",
        "training.epochs=1",
        "--set",
        "training.batch_size=4",
        "--set",
        "training.learning_rate=1e-3",
        "--set",
        "training.gradient_checkpointing=true",
        "--set",
        "distributed.procs_per_node=1",
        "--set",
        "name=full-ft",
        timeout=300,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["data_format"] == "instruction" and metrics["global_step"] == 12 and metrics["packing"] is False
    # max_steps cut the one epoch short: no epoch completed (12 steps of 4 rows each cover 48 rows)
    assert metrics["train_rows"] > 48 and metrics["epochs_completed"] == 0
    assert not (out / "adapter").exists() and (out / "model" / "model.safetensors").exists()
    losses = [h["loss"] for h in _history(out) if h["type"] == "train"]
    assert losses[-1] < losses[0]
    assert "eval perplexity" in (out / "report.html").read_text()


def test_qlora_on_cpu_is_one_clear_line(tmp_path):
    r = kubetune(
        "run", str(EXAMPLE), "--set", f"output.uri={tmp_path / 'q'}", "--set", "lora.quantization=4bit", timeout=120
    )
    assert r.returncode == 2
    lines = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert len(lines) == 1 and "lora.quantization" in lines[0] and "CUDA" in lines[0], r.stderr
    assert not (tmp_path / "q" / "model").exists()


def _budget_spec(out: Path, procs: int) -> dict:
    return {
        "name": "budget-tiny",
        "task": "causal-lm",
        "model": {"uri": "pkg://kubetune/assets/tiny-llama"},
        "data": {
            "train": "pkg://kubetune/assets/sentiment/sentiment-chat.jsonl",
            "format": "chat",
            "eval_fraction": 0.05,
            "max_length": 96,
            "max_train_samples": 160,
            "packing": True,
            "max_tokens_per_batch": 256,
        },
        "training": {
            "epochs": 1,
            "grad_accum": 1,
            "learning_rate": 2e-3,
            "precision": "fp32",
            "log_every": 1,
            "checkpoint_every": 2,
            "seed": 3,
        },
        "distributed": {"procs_per_node": procs},
        "output": {"uri": str(out)},
    }


@pytest.mark.slow  # the budget's plan for another world size is unit-tested (test_sharding), the layout's
# resume on another number of processes is test_fsdp's, and a budget run is the tiny-chat test above
def test_token_budget_micro_batches_resume_on_another_number_of_processes(tmp_path):
    """data.max_tokens_per_batch: no micro-batch holds more than the budget, every row is trained
    once; a 2-process run stopped by SIGTERM after a checkpoint resumes on 1 process (grad_accum
    1 -> 2), trains every later step on exactly the rows the uninterrupted run trained in it, and ends
    on its weights up to the order of the reductions."""
    import os
    import signal
    import subprocess
    import sys

    from conftest import wait_for_checkpoint, write_spec
    from safetensors.torch import load_file

    ref_trace = tmp_path / "trace-ref"
    ref = kubetune(
        "run",
        str(write_spec(tmp_path / "ref.yaml", _budget_spec(tmp_path / "ref", 2))),
        env={"KUBETUNE_TRACE_DIR": str(ref_trace)},
    )
    assert ref.returncode == 0, ref.stderr[-3000:]
    assert "micro-batches of up to 256 tokens" in ref.stderr
    micro = _trace(ref_trace)
    metrics = json.loads((tmp_path / "ref" / "metrics.json").read_text())
    assert all(0 < m["tokens"] <= 256 for m in micro if m["rows"])
    rows = [r for m in micro for r in m["rows"]]
    assert sorted(rows) == list(range(metrics["train_rows"]))  # every row once
    n_steps = metrics["global_step"]
    assert n_steps == max(m["step"] for m in micro) and n_steps >= 8

    out, trace = tmp_path / "out", tmp_path / "trace-1"
    spec = write_spec(tmp_path / "job.yaml", _budget_spec(out, 2))
    proc = subprocess.Popen(
        [sys.executable, "-m", "kubetune", "run", str(spec)],
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, "KUBETUNE_TRACE_DIR": str(tmp_path / "trace-0")},
    )
    wait_for_checkpoint(out, 4, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    saved = max(int(p.name[5:]) for p in (out / "checkpoints").glob("step-*") if (p / "COMPLETE").exists())
    again = kubetune(
        "run", str(write_spec(tmp_path / "job.yaml", _budget_spec(out, 1))), env={"KUBETUNE_TRACE_DIR": str(trace)}
    )
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resumed from checkpoint step {saved} " in again.stderr and "grad_accum 2 keeps" in again.stderr
    by_step: dict[int, list] = {}
    for m in micro:
        by_step.setdefault(m["step"], []).extend(m["rows"])
    resumed: dict[int, list] = {}
    for m in _trace(trace):
        resumed.setdefault(m["step"], []).extend(m["rows"])
    assert sorted(resumed) == list(range(saved + 1, n_steps + 1))
    assert all(sorted(resumed[s]) == sorted(by_step[s]) for s in resumed)
    a, b = load_file(out / "model" / "model.safetensors"), load_file(tmp_path / "ref" / "model" / "model.safetensors")
    diff = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    print(f"token budget, 2 -> 1 processes: max |diff| {diff:.3g}")
    assert diff < 5e-5, diff
