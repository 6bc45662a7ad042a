"""Causal-LM end to end on the shipped tiny random-init Llama: 2-process LoRA run of the tiny
example (loss goes down, adapter loads, merged logits equal adapter logits, predict generates),
a full fine-tune on instruction data, and QLoRA refused on CPU with one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from conftest import kubetune

pytestmark = pytest.mark.integration
ROOT = Path(__file__).resolve().parents[2]
EXAMPLE = ROOT / "examples" / "causal-tiny-chat.yaml"


def _history(out: Path) -> list[dict]:
    return [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]


def test_tiny_chat_example_lora_two_processes(tmp_path):
    out = tmp_path / "run"
    canary = "hf_canaryTOKEN0123456789"  # a gated model's token: read from HF_TOKEN, never written anywhere
    r = kubetune(
        "run",
        str(EXAMPLE),
        "--set",
        f"output.uri={out}",
        "--set",
        "training.epochs=2",
        "--set",
        "data.max_train_samples=600",
        env={"HF_TOKEN": canary},
        timeout=600,
    )
    assert r.returncode == 0, r.stderr[-3000:]
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
