"""Baseline (b): Hugging Face Trainer with dynamic padding (DataCollatorWithPadding), fp32,
one process using every core (how `python train.py` runs it):

    python benchmarks/hf_trainer.py --train T --eval E --out R.json
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import pandas as pd
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import Result, model_path  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--train", required=True)
    ap.add_argument("--eval", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=1e-4)
    ap.add_argument("--eval-every", type=int, default=15, help="0: evaluate at the end only")
    ap.add_argument("--model", help="model directory (default: the packaged all-MiniLM-L6-v2)")
    ap.add_argument("--bf16", action="store_true", help="bf16 autocast (on a GPU)")
    ap.add_argument("--max-length", type=int, default=128)
    args = ap.parse_args()

    import datasets
    import numpy as np
    from transformers import (
        AutoModelForSequenceClassification,
        AutoTokenizer,
        DataCollatorWithPadding,
        Trainer,
        TrainerCallback,
        TrainingArguments,
    )

    datasets.disable_progress_bars()
    path = args.model or model_path()
    tok = AutoTokenizer.from_pretrained(path)

    def load(p):
        ds = datasets.Dataset.from_pandas(pd.read_csv(p))
        return ds.map(
            lambda b: tok(b["text"], truncation=True, max_length=args.max_length), batched=True, remove_columns=["text"]
        )

    train_ds, eval_ds = load(args.train), load(args.eval)
    gpu = torch.cuda.is_available()
    res = Result(
        system=f"HF Trainer (dynamic padding, {'bf16' if args.bf16 else 'fp32'})",
        world_size=1,
        threads=torch.get_num_threads(),
    )
    collate = DataCollatorWithPadding(tok)

    class CountingTrainer(Trainer):
        """Counts the tokens of training batches only (the collator also serves evaluation)."""

        def compute_loss(self, model, inputs, *a, **kw):
            if model.training:
                mask = inputs["attention_mask"]
                res.real_tokens += int(mask.sum())
                res.padded_tokens += mask.numel()
                res.token_lengths += mask.sum(1).tolist()
            return super().compute_loss(model, inputs, *a, **kw)

    clock = {"eval": 0.0, "start": None}

    class Clock(TrainerCallback):
        def on_train_begin(self, args_, state, control, **kw):
            clock["start"] = time.perf_counter()

        def on_evaluate(self, args_, state, control, metrics=None, **kw):
            res.evals.append(
                {
                    "train_s": time.perf_counter() - clock["start"] - clock["eval"],
                    "samples": state.global_step * args.batch,
                    "accuracy": metrics["eval_accuracy"],
                    "eval_runtime": metrics["eval_runtime"],
                }
            )
            clock["eval"] += metrics["eval_runtime"]

    def accuracy(pred):
        return {"accuracy": float((np.argmax(pred.predictions, -1) == pred.label_ids).mean())}

    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=3)
    targs = TrainingArguments(
        output_dir=tempfile.mkdtemp(prefix="hf-bench-"),
        per_device_train_batch_size=args.batch,
        per_device_eval_batch_size=64,
        learning_rate=args.lr,
        weight_decay=0.01,
        warmup_steps=0.06,
        num_train_epochs=1,
        eval_strategy="steps" if args.eval_every else "no",
        eval_steps=args.eval_every or None,
        bf16=args.bf16,
        save_strategy="no",
        logging_strategy="no",
        report_to=[],
        seed=42,
        dataloader_num_workers=0,
        use_cpu=not gpu,
        disable_tqdm=True,
    )
    trainer = CountingTrainer(
        model=model,
        args=targs,
        train_dataset=train_ds,
        eval_dataset=eval_ds,
        data_collator=collate,
        compute_metrics=accuracy,
    )
    out = trainer.train()
    # Eval runtime includes a little Trainer overhead outside the forward passes; the rest is training.
    end_train = out.metrics["train_runtime"] - clock["eval"]
    if not res.evals or res.evals[-1]["samples"] < len(train_ds):
        m = trainer.evaluate()
        res.evals.append({"train_s": end_train, "samples": len(train_ds), "accuracy": m["eval_accuracy"]})
    res.samples, res.train_s = len(train_ds), end_train
    res.final_accuracy = res.evals[-1]["accuracy"]
    if gpu:
        res.peak_gpu_mib = torch.cuda.max_memory_allocated() / 2**20
    res.save(Path(args.out))


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    main()
