"""Short runs, whole processes: an 8-step GRPO, SFT and DPO run of kubetune against TRL's trainers, each timed as a
whole process from its start to its model saved, kubetune's split into its phases (metrics.json's ``phases``:
start-up, data, training, export; the launcher's share of start-up beside them).

    python benchmarks/whole_run.py [--tasks grpo,sft,dpo] [--steps 8] [--rounds 1] [--before SRC] [--name whole-run]

The runs are the CPU comparisons' own, cut to ``--steps`` optimizer steps: GRPO is ``grpo_trl.py``'s chat-dapo
setting (4 prompts × 8 completions of 64 tokens a step; kubetune evaluates 8 held-out prompts at the end), SFT is
``sft_trl.py``'s (packed chat rows, about 2,048 tokens a step; TRL's SFTTrainer with packing), DPO is a full
fine-tune of the same 28M Llama on the packaged sentiment preferences (8 pairs a step, β 0.1, sigmoid loss, max
length 256, AdamW lr 5e-6; TRL's DPOTrainer with its reference model, kubetune with its own), one process with
both cores. TRL's process saves its model at the end (``trainer.save_model``), as kubetune's exports it.

Systems alternate within each round, each in a fresh process: ``kubetune``, ``kubetune-before`` (with ``--before
SRC``: the kubetune whose package is in SRC, e.g. ``git worktree add /tmp/old main``, then ``--before
/tmp/old/src``; its phases only where that version writes them) and ``trl``. Reported: each system's whole
process (wall seconds from its start to its exit), its own training clock, and kubetune's phases; medians over
the rounds. Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT  # noqa: E402

TASKS = ("grpo", "sft", "dpo")
PHASES = ("launcher_s", "startup_s", "data_s", "training_s", "export_s", "total_s")
DPO_BATCH, DPO_LR, DPO_BETA, DPO_MAX_LENGTH, SEED = 8, 5e-6, 0.1, 256, 42


def _grpo_args(steps: int) -> argparse.Namespace:
    from grpo_trl import SETTINGS

    return argparse.Namespace(steps=steps, setting="chat-dapo", completion=SETTINGS["chat-dapo"]["completion"])


def prepare(task: str, work: Path) -> None:
    """The model and the data of ``task``'s comparison, made once in ``work``."""
    from sft_trl import make_data, make_model

    if not (work / "model" / "config.json").exists():
        make_model(work / "model")
    if task == "grpo":
        import grpo_trl

        grpo_trl.make_data(work, 256, "chat-dapo")
    elif task == "sft":
        make_data(work, 600)
    else:
        import pairs_bench

        pairs_bench.make_data(work, 1080)


def _phases(out: Path) -> dict:
    return json.loads((out / "metrics.json").read_text()).get("phases") or {}


def run_kubetune(task: str, work: Path, out: Path, steps: int) -> dict:
    """``task``'s kubetune run (``kubetune run`` in a subprocess, with this process's environment)."""
    if task == "grpo":
        import grpo_trl

        result = grpo_trl.run_kubetune(work, out, _grpo_args(steps))
    elif task == "sft":
        import sft_trl

        result = sft_trl.run_kubetune(work, out, {"training.max_steps": steps})
    else:
        result = _dpo_kubetune(work, out, steps)
    return {"train_s": result["train_s"], "steps": result["steps"], "phases": _phases(out)}


def _dpo_kubetune(work: Path, out: Path, steps: int) -> dict:
    import yaml

    spec = {
        "name": "dpo-bench",
        "task": "dpo",
        "model": {"uri": str(work / "model")},
        "data": {"train": str(work / "pairs.jsonl"), "eval_fraction": 0.1, "max_length": DPO_MAX_LENGTH},
        "dpo": {"beta": DPO_BETA, "loss_type": "sigmoid"},
        "training": {
            "max_steps": steps,
            "batch_size": DPO_BATCH,
            "learning_rate": DPO_LR,
            "warmup_ratio": 0.0,
            "weight_decay": 0.0,
            "precision": "fp32",
            "seed": SEED,
            "log_every": 1,
        },
        "distributed": {"procs_per_node": 1},
        "output": {"uri": str(out), "report_baseline": False},
    }
    path = work / f"{out.name}.yaml"
    path.write_text(yaml.safe_dump(spec))
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    subprocess.run([sys.executable, "-m", "kubetune", "run", str(path), "--no-resume"], check=True, env=env)
    m = json.loads((out / "metrics.json").read_text())
    return {"train_s": m["train_runtime_s"], "steps": m["global_step"]}


def run_trl(task: str, work: Path, out: Path, steps: int) -> dict:
    """``task``'s TRL run in this process, its model saved at the end."""
    if task == "grpo":
        import grpo_trl

        result = grpo_trl.run_trl(work, out, _grpo_args(steps))
    elif task == "sft":
        import sft_trl

        result = sft_trl.run_trl(work, out, {"max_steps": steps})
    else:
        result = _dpo_trl(work, out, steps)
    return {"train_s": result["train_s"], "steps": result["steps"]}


def _dpo_trl(work: Path, out: Path, steps: int) -> dict:
    import datasets
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import DPOConfig, DPOTrainer

    rows = [json.loads(line) for line in (work / "pairs.jsonl").read_text().splitlines()]
    train = datasets.Dataset.from_list(rows[: int(len(rows) * 0.9)])
    tok = AutoTokenizer.from_pretrained(work / "model")
    torch.manual_seed(SEED)
    model = AutoModelForCausalLM.from_pretrained(work / "model", dtype=torch.float32)
    args = DPOConfig(
        output_dir=str(out), per_device_train_batch_size=DPO_BATCH, max_steps=steps, learning_rate=DPO_LR,
        warmup_steps=0, lr_scheduler_type="linear", weight_decay=0.0, max_length=DPO_MAX_LENGTH, beta=DPO_BETA,
        loss_type="sigmoid", report_to=[], use_cpu=True, bf16=False, fp16=False, save_strategy="no",
        logging_steps=1, seed=SEED, dataloader_num_workers=0,
    )  # fmt: skip
    trainer = DPOTrainer(model=model, args=args, train_dataset=train, processing_class=tok)
    result = trainer.train()
    trainer.save_model(str(out / "model"))
    return {"train_s": result.metrics["train_runtime"], "steps": result.global_step}


def child(system: str, task: str, work: Path, out: Path, steps: int) -> None:
    run = run_trl if system == "trl" else run_kubetune
    (out.parent / f"{out.name}.json").write_text(json.dumps(run(task, work, out, steps)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tasks", default=",".join(TASKS))
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--before", help="another checkout's src: its kubetune runs too, as kubetune-before")
    ap.add_argument("--name", default="whole-run")
    ap.add_argument("--work", default="/tmp/kubetune-bench-whole")
    ap.add_argument("--child", nargs=3, metavar=("SYSTEM", "TASK", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child:
        system, task, out = a.child
        child(system, task, Path(a.work) / task, Path(out), a.steps)
        return
    systems = ["kubetune", *(["kubetune-before"] if a.before else []), "trl"]
    results: dict[str, dict[str, list]] = {t: {s: [] for s in systems} for t in a.tasks.split(",")}
    for task in results:
        (Path(a.work) / task).mkdir(parents=True, exist_ok=True)
        prepare(task, Path(a.work) / task)
    for r in range(a.rounds):
        for task, by_system in results.items():
            order = systems if r % 2 == 0 else systems[::-1]  # alternate who goes first
            for system in order:
                out = Path(a.work) / task / f"r{r}-{system}"
                subprocess.run(["rm", "-rf", str(out)], check=True)
                env = dict(os.environ)
                if system == "kubetune-before":
                    env["PYTHONPATH"] = str(Path(a.before).resolve())  # the kubetune run inherits it
                t = time.perf_counter()
                cmd = [sys.executable, __file__, "--work", a.work, "--steps", str(a.steps)]
                subprocess.run([*cmd, "--child", system, task, str(out)], check=True, env=env)
                res = json.loads(out.with_suffix(".json").read_text())
                res["wall_s"] = time.perf_counter() - t
                by_system[system].append(res)
                print(f"round {r} {task} {system}: {res['wall_s']:.1f} s process, {res['train_s']:.1f} s training")
    write(a, results)


def write(a, results: dict) -> None:
    import torch
    import transformers
    import trl

    lines = [
        f"# Whole-process time of {a.steps}-step runs: kubetune and TRL ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"{os.cpu_count()} cores (shared with other work while measured); torch {torch.__version__}, transformers "
        f"{transformers.__version__}, trl {trl.__version__}. `python benchmarks/whole_run.py --steps {a.steps} "
        f"--rounds {a.rounds}{' --before SRC' if a.before else ''}` (medians of {a.rounds} round(s), systems "
        "alternating). Process: wall seconds from the process's start to its exit, the model saved; training: the "
        "system's own clock; the phases: kubetune's metrics.json.",
        "",
        "| task | system | process (s) | training (s) | launcher (s) | start-up (s) | data (s) | training phase (s) "
        "| export (s) | TRL ÷ system, whole process |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    medians: dict = {}
    for task, by_system in results.items():
        for system, runs in by_system.items():
            med = {k: statistics.median(r[k] for r in runs) for k in ("wall_s", "train_s")}
            for p in PHASES:
                vals = [r["phases"][p] for r in runs if p in r.get("phases", {})]
                med[p] = statistics.median(vals) if vals else None
            medians.setdefault(task, {})[system] = med
        trl_wall = medians[task]["trl"]["wall_s"] if "trl" in by_system else None
        for system, m in medians[task].items():
            cells = [f"{m[p]:.1f}" if m[p] is not None else "—" for p in PHASES[:-1]]
            ratio = f"{trl_wall / m['wall_s']:.2f}×" if trl_wall and system != "trl" else "—"
            lines.append(
                f"| {task} | {system} | {m['wall_s']:.1f} | {m['train_s']:.1f} | " + " | ".join(cells) + f" | {ratio} |"
            )
    text = "\n".join(lines) + "\n"
    print(text)
    dest = ROOT / "benchmarks" / "results"
    (dest / f"{a.name}.md").write_text(text)
    (dest / f"{a.name}.json").write_text(
        json.dumps({"results": results, "medians": medians, "args": vars(a)}, indent=1)
    )


if __name__ == "__main__":
    main()
