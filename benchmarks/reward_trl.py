"""Reward modelling on the CPU: kubetune (task: reward-model) against TRL's RewardTrainer, the same model, pairs,
loss and settings, in one run.

    python benchmarks/reward_trl.py [--pairs 1080] [--rounds 1] [--name reward-cpu]

The model: the packaged all-MiniLM-L6-v2 (BERT, 22.7M parameters) with a fresh one-output head. The data: the
packaged sentiment preferences (chat pairs: a review's question, the label as the chosen answer, an evasion as
the rejected one), the first ``--pairs`` of them, rendered with kubetune's fallback chat template on both sides
(the tokenizer has none). Both: the Bradley-Terry loss with center_rewards_coefficient 0.01, 16 pairs per
optimizer step, one epoch, AdamW lr 5e-5 with a linear schedule and 10 % warmup, max_length 256, fp32, one
process with both cores, no evaluation during training (kubetune evaluates its 10 % held-out pairs once at the
end: counted in its process time, not its training time; TRL trains on the same 90 %).

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

MINILM = "hf://sentence-transformers/all-MiniLM-L6-v2"
BATCH, LR, WARMUP, MAX_LENGTH, CENTER, SEED = 16, 5e-5, 0.1, 256, 0.01, 42


def run_kubetune(work: Path, out: Path) -> dict:
    import yaml

    spec = {
        "name": "reward-bench",
        "task": "reward-model",
        "model": {"uri": MINILM},
        "data": {"train": str(work / "pairs.jsonl"), "eval_fraction": 0.1, "max_length": MAX_LENGTH},
        "reward-model": {"center_rewards_coefficient": CENTER},
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
            "train_loss": m["train_loss"], "eval_accuracy": m["eval_accuracy"]}  # fmt: skip


def run_trl(work: Path, out: Path) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForSequenceClassification, AutoTokenizer
    from trl import RewardConfig, RewardTrainer

    from kubetune import providers
    from kubetune.tasks.common import FALLBACK_CHAT_TEMPLATE
    from kubetune.tasks.pairs import load_pair_frames
    from kubetune.tasks.reward_model import RewardData

    path = providers.resolve(MINILM, kind="model", field="model.uri")
    frames = load_pair_frames(RewardData(train=str(work / "pairs.jsonl"), eval_fraction=0.1), SEED)
    records = frames.train["record"]  # kubetune's training pairs
    train = datasets.Dataset.from_list([json.loads(r) for r in records])
    tok = AutoTokenizer.from_pretrained(path)
    tok.chat_template = FALLBACK_CHAT_TEMPLATE
    torch.manual_seed(SEED)
    model = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, pad_token_id=tok.pad_token_id)
    args = RewardConfig(
        output_dir=str(out), per_device_train_batch_size=BATCH, num_train_epochs=1, learning_rate=LR,
        warmup_steps=WARMUP, lr_scheduler_type="linear", weight_decay=0.0, max_length=MAX_LENGTH,
        center_rewards_coefficient=CENTER, report_to=[], use_cpu=True, bf16=False, fp16=False, save_strategy="no",
        logging_steps=10, seed=SEED, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = RewardTrainer(model=model, args=args, train_dataset=train, processing_class=tok)
    result = trainer.train()
    return {"train_s": result.metrics["train_runtime"], "pairs": len(train), "steps": result.global_step,
            "train_loss": result.metrics["train_loss"]}  # fmt: skip


def main() -> None:
    pairs_bench.main(
        __file__,
        "Reward modelling",
        {"kubetune": run_kubetune, "trl": run_trl},
        pairs_bench.make_data,
        "reward-cpu",
        "pairwise accuracy",
    )


if __name__ == "__main__":
    main()
