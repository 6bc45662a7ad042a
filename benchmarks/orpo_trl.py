"""ORPO on the CPU: kubetune (task: orpo) against TRL's ORPOTrainer (trl.experimental.orpo), the same model,
pairs, loss and settings, in one run.

    python benchmarks/orpo_trl.py [--pairs 1080] [--rounds 1] [--name orpo-cpu]

The model: sft_trl.py's Llama-architecture decoder of 28M parameters with a 32,000-token vocabulary, random init,
fp32, its tokenizer with kubetune's fallback chat template. The data: the packaged sentiment preferences (chat
pairs: a review's question, the label as the chosen answer, an evasion as the rejected one), the first
``--pairs`` of them. Both: ORPO's loss with λ 0.1, 8 pairs per optimizer step, one epoch, AdamW lr 8e-6 with a
linear schedule and 10 % warmup, max_length 256, full fine-tune, fp32, one process with both cores, no evaluation
during training (kubetune evaluates its 10 % held-out pairs once at the end: counted in its process time, not its
training time; TRL trains on the same 90 %).

Systems run in turn, each in a fresh process. Reported: training time (each system's own clock: kubetune's
``train_runtime_s``, TRL's ``train_runtime``), pairs per second of training, the whole process's wall time, the
peak RSS, and the final training loss. Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import pairs_bench  # noqa: E402

BATCH, LR, WARMUP, MAX_LENGTH, BETA, SEED = 8, 8e-6, 0.1, 256, 0.1, 42


def run_kubetune(work: Path, out: Path) -> dict:
    import yaml

    spec = {
        "name": "orpo-bench",
        "task": "orpo",
        "model": {"uri": str(work / "model")},
        "data": {"train": str(work / "pairs.jsonl"), "eval_fraction": 0.1, "max_length": MAX_LENGTH},
        "orpo": {"beta": BETA},
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
            "train_loss": m["train_loss"], "eval_accuracy": m["eval_reward_accuracy"]}  # fmt: skip


def run_trl(work: Path, out: Path) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    from kubetune.tasks.orpo import ORPOData
    from kubetune.tasks.pairs import load_pair_frames

    frames = load_pair_frames(ORPOData(train=str(work / "pairs.jsonl"), eval_fraction=0.1), SEED)
    train = datasets.Dataset.from_list([json.loads(r) for r in frames.train["record"]])  # kubetune's training pairs
    tok = AutoTokenizer.from_pretrained(work / "model")
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32)
    args = ORPOConfig(
        output_dir=str(out), per_device_train_batch_size=BATCH, num_train_epochs=1, learning_rate=LR,
        warmup_steps=WARMUP, lr_scheduler_type="linear", weight_decay=0.0, max_length=MAX_LENGTH, beta=BETA,
        report_to=[], use_cpu=True, bf16=False, fp16=False, save_strategy="no", logging_steps=10, seed=SEED,
        dataloader_num_workers=0,
    )  # fmt: skip
    trainer = ORPOTrainer(model=model, args=args, train_dataset=train, processing_class=tok)
    result = trainer.train()
    return {"train_s": result.metrics["train_runtime"], "pairs": len(train), "steps": result.global_step,
            "train_loss": result.metrics["train_loss"]}  # fmt: skip


def main() -> None:
    pairs_bench.main(
        __file__,
        "ORPO",
        {"kubetune": run_kubetune, "trl": run_trl},
        pairs_bench.prepare_llama,
        "orpo-cpu",
        "reward accuracy",
    )


if __name__ == "__main__":
    main()
