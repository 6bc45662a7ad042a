"""The step-time cost of a checkpoint every N steps, written synchronously and asynchronously
(``training.checkpoint_async``), against the same run without checkpoints, in one run with the systems alternating.

    python benchmarks/checkpoint_cost.py [--before SRC] [--steps 12] [--every 4] [--rounds 2] [--strategy ddp]
        [--procs 1] [--shape 1024,2816,16] [--name checkpoint-cost]

Every run is ``kubetune run`` of a full fine-tune (fp32, AdamW, batch 1 × 128 tokens) of a random-init Llama of
``--shape`` (hidden, intermediate, layers; benchmarks/fsdp_memory.py's model) for ``--steps`` steps. Systems:
``none`` (no checkpoint), ``sync`` and ``async`` (a checkpoint every ``--every`` steps, ``checkpoint_async`` false and
true), and with ``--before SRC`` (another checkout's src, e.g. main's) ``before`` (the same checkpoints by that code,
which has no ``checkpoint_async``). Reported per run: the training time (``metrics.json``'s ``train_runtime_s``: the
loop's time, checkpoints included, evaluation excluded) and the whole process's wall time (an asynchronous run waits
for its last checkpoint after training: counted there); the cost of one checkpoint is the training time over the
``none`` run's, divided by the checkpoints written. Choose ``--steps`` so that the last checkpoint is not at the last
step (it would only be waited for at the end). Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT  # noqa: E402
from fsdp_memory import ASSETS, make_model  # noqa: E402

PY = sys.executable


def spec_for(model: Path, out: Path, system: str, args: argparse.Namespace) -> dict:
    training: dict = {
        "max_steps": args.steps,
        "batch_size": 1,
        "learning_rate": 1e-5,
        "precision": "fp32",
        "log_every": 1,
        "eval_batch_size": 4,
        "seed": 3,
    }
    if system != "none":
        training["checkpoint_every"] = args.every
        training["keep_checkpoints"] = 1
    if system in ("sync", "async"):
        training["checkpoint_async"] = system == "async"
    return {
        "name": f"ckpt-{system}",
        "task": "causal-lm",
        "model": {"uri": str(model)},
        "data": {
            "train": str(ASSETS / "sentiment" / "sentiment-chat.jsonl"),
            "format": "chat",
            "eval_fraction": 0.01,
            "max_length": 128,
        },
        "training": training,
        "distributed": {
            "procs_per_node": args.procs,
            "strategy": args.strategy,
            "threads_per_proc": max(1, (os.cpu_count() or 2) // args.procs),
        },
        "output": {"uri": str(out), "report_baseline": False},
    }


def run(work: Path, model: Path, system: str, args: argparse.Namespace) -> dict:
    out = work / f"out-{system}"
    shutil.rmtree(out, ignore_errors=True)
    path = work / f"{system}.yaml"
    path.write_text(yaml.safe_dump(spec_for(model, out, system, args)))
    src = args.before if system == "before" else ROOT / "src"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "PYTHONPATH": str(src)}
    t0 = time.perf_counter()
    proc = subprocess.run([PY, "-m", "kubetune", "run", str(path)], cwd=work, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"{system} failed (exit {proc.returncode}): {proc.stderr[-3000:]}")
    m = json.loads((out / "metrics.json").read_text())
    shutil.rmtree(out, ignore_errors=True)
    return {
        "train_s": m["train_runtime_s"],
        "wall_s": wall,
        "steps": m["global_step"],
        "peak_gib": m["peak_host_memory_gib"],
    }


def markdown(results: dict) -> str:
    a = results["args"]
    lines = [
        f"# Checkpoint cost: {a['strategy']} on {a['procs']} process(es), {results['params'] / 1e6:.0f}M parameters",
        "",
        f"A full fine-tune (fp32, AdamW) of a random-init Llama {a['shape']}, {a['steps']} steps of batch 1 × 128 "
        f"tokens, a checkpoint every {a['every']} steps ({results['checkpoints']} per run; about "
        f"{results['checkpoint_gib']:.1f} GiB each: weights and AdamW moments), {a['rounds']} round(s), systems "
        "alternating. Median over the rounds. On a shared 2-core machine: compare within this table only.",
        "",
        "| system | training s | s/step | cost per checkpoint (s) | stall vs sync | whole run s | peak GiB |",
        "|---|---|---|---|---|---|---|",
    ]
    s = results["summary"]
    for system, r in s.items():
        cost = r.get("cost_per_checkpoint_s")
        share = r.get("cost_vs_sync")
        lines.append(
            f"| {system} | {r['train_s']:.1f} | {r['s_per_step']:.2f} | {'' if cost is None else f'{cost:.2f}'} | "
            f"{'' if share is None else f'{share:.2f}×'} | {r['wall_s']:.1f} | {r['peak_gib']} |"
        )
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, default=None, help="another checkout's src (e.g. main's)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--every", type=int, default=5)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--strategy", default="ddp")
    ap.add_argument("--procs", type=int, default=1)
    ap.add_argument("--shape", default="1024,2816,16")
    ap.add_argument("--name", default="checkpoint-cost")
    ap.add_argument("--work", type=Path, default=None)
    args = ap.parse_args()
    work = args.work or Path(tempfile.mkdtemp(prefix="kt-ckpt-bench-"))
    shape = tuple(int(x) for x in args.shape.split(","))
    model, params = make_model(work, *shape)
    systems = ["none", "sync", "async", *(["before"] if args.before else [])]
    runs: dict[str, list[dict]] = {s: [] for s in systems}
    for r in range(args.rounds):
        for system in systems if r % 2 == 0 else systems[::-1]:  # alternating order between rounds
            runs[system].append(run(work, model, system, args))
            print(system, json.dumps(runs[system][-1]), flush=True)
    checkpoints = args.steps // args.every
    summary: dict[str, dict] = {}
    for system, rs in runs.items():
        train = statistics.median(x["train_s"] for x in rs)
        summary[system] = {
            "train_s": train,
            "s_per_step": train / args.steps,
            "wall_s": statistics.median(x["wall_s"] for x in rs),
            "peak_gib": max(max(x["peak_gib"]) for x in rs),
        }
    base = summary["none"]["train_s"]
    for system in systems[1:]:
        summary[system]["cost_per_checkpoint_s"] = (summary[system]["train_s"] - base) / max(1, checkpoints)
    sync_cost = summary["sync"]["cost_per_checkpoint_s"]
    for system in systems[1:]:
        summary[system]["cost_vs_sync"] = summary[system]["cost_per_checkpoint_s"] / sync_cost if sync_cost else None
    results = {
        "args": {**vars(args), "before": str(args.before) if args.before else None, "work": str(work)},
        "params": params,
        "checkpoints": checkpoints,
        "checkpoint_gib": params * 12 / 2**30,
        "runs": runs,
        "summary": summary,
    }
    out = ROOT / "benchmarks" / "results"
    (out / f"{args.name}.json").write_text(json.dumps(results, indent=1))
    (out / f"{args.name}.md").write_text(markdown(results))
    print(markdown(results))
    if not args.work:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
