"""Where a short run's time goes besides its training steps: a whole `kubetune run` process of a
60-step MiniLM job (global batch 32, one process, evaluation at the end only, the TF-IDF baseline
on), split into phases by the arrival time of its log lines, beside Hugging Face Trainer's whole
process on the same rows (benchmarks/hf_trainer.py, evaluation at the end only). Rounds alternate
the systems; medians are reported.

    python benchmarks/fixed_cost.py [--rounds 3] [--name NAME] [--before SRC] [--no-hf]

Results: results/fixed-cost[-NAME].json and .md. The first kubetune round tokenizes and fits the
baseline (cold caches); the table shows the cold round and the median of the warm ones. ``--before
SRC`` also runs the kubetune whose package is in SRC (e.g. ``git worktree add /tmp/old HEAD~3``,
then ``--before /tmp/old/src``) in the same rounds, each with its own caches, for a before/after.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import write_split  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
# (phase, the log line that ends it); a phase runs from the previous milestone to this one
MILESTONES = [
    ("start-up (launcher, preflight, worker start, imports)", re.compile(r"\] INFO output ")),
    ("data (model files, tokenizer, tables, tokens)", re.compile(r"\] INFO data: ")),
    ("model (load, wrap, optimizer)", re.compile(r"\] INFO training: \d+ steps")),
    ("training steps", re.compile(r"\] INFO progress: step=(\d+)/\1 ")),
    ("final evaluation", re.compile(r"\] INFO epoch \d+, step \d+: eval_loss")),
    ("export", re.compile(r"\] INFO exported the model")),
    ("baseline", re.compile(r"\] INFO (baseline \(|done: )")),
    ("report, metrics, cleanup", re.compile(r"\] INFO done: ")),
]


def spec(train: Path, evald: Path, out: Path) -> dict:
    return {
        "name": "fixed-cost",
        "model": {"uri": "hf://sentence-transformers/all-MiniLM-L6-v2"},
        "data": {"train": str(train), "eval": str(evald), "text_column": "text", "label_column": "label"},
        "training": {"epochs": 1, "batch_size": 32, "learning_rate": 1e-4, "warmup_ratio": 0.06, "seed": 42},
        "distributed": {"nodes": 1, "procs_per_node": 1},
        "output": {"uri": str(out)},
    }


def run_kubetune(spec_path: Path, out: Path, cache: Path, src: str | None = None) -> dict:
    env = {**os.environ, "KUBETUNE_CACHE": str(cache), "HF_HUB_OFFLINE": "1"}
    if src:  # another checkout's package first on the path (the workers inherit it)
        env["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])
    cmd = [sys.executable, "-m", "kubetune", "run", str(spec_path), "--overwrite"]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, env=env)
    seen: dict[str, float] = {}
    lines = []
    for line in proc.stderr:
        lines.append(line)
        for name, pattern in MILESTONES:
            if name not in seen and pattern.search(line):
                seen[name] = time.perf_counter() - t0
    code = proc.wait()
    total = time.perf_counter() - t0
    if code != 0 or len(seen) != len(MILESTONES):
        raise SystemExit(f"kubetune run failed ({code}), milestones {sorted(seen)}:\n{''.join(lines[-30:])}")
    phases, last = {}, 0.0
    for name, _ in MILESTONES:
        phases[name] = seen[name] - last
        last = seen[name]
    phases["process exit"] = total - last
    metrics = json.loads((out / "metrics.json").read_text())
    return {"total_s": total, "phases_s": phases, "train_runtime_s": metrics["train_runtime_s"]}


def run_hf(train: Path, evald: Path, work: Path) -> dict:
    out = work / "hf.json"
    cmd = [sys.executable, str(ROOT / "benchmarks" / "hf_trainer.py"), "--train", str(train), "--eval", str(evald)]
    t0 = time.perf_counter()
    subprocess.run([*cmd, "--out", str(out), "--eval-every", "0"], check=True, capture_output=True)
    total = time.perf_counter() - t0
    return {"total_s": total, "train_runtime_s": json.loads(out.read_text())["train_s"]}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--name", default="")
    ap.add_argument("--no-hf", action="store_true", help="kubetune only")
    ap.add_argument("--before", help="the src/ directory of another kubetune checkout, run in the same rounds")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kubetune-fixed-cost-"))
    train, evald = write_split(work / "data", 1920, 600)
    systems = {"kubetune": None, **({"before": args.before} if args.before else {})}
    specs = {}
    for name in systems:
        specs[name] = work / f"{name}.yaml"
        specs[name].write_text(yaml.safe_dump(spec(train, evald, work / f"out-{name}"), sort_keys=False))
    rounds: list[dict] = []
    for r in range(args.rounds):
        row = {
            name: run_kubetune(specs[name], work / f"out-{name}", work / f"cache-{name}", src)
            for name, src in systems.items()
        }
        row["hf_trainer"] = None if args.no_hf else run_hf(train, evald, work)
        rounds.append(row)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v['total_s']:.1f} s" for k, v in row.items() if v))
    results = ROOT / "benchmarks" / "results"
    stem = "fixed-cost" + (f"-{args.name}" if args.name else "")
    (results / f"{stem}.json").write_text(json.dumps(rounds, indent=2) + "\n")
    (results / f"{stem}.md").write_text(table(rounds))
    print(table(rounds))


def med(values) -> float:
    return statistics.median(values)


def table(rounds: list[dict]) -> str:
    names = [n for n in ("before", "kubetune") if rounds[0].get(n)]
    cols = {n: (rounds[0][n], [r[n] for r in rounds[1:]] or [rounds[0][n]]) for n in names}
    label = {"before": "before", "kubetune": "this tree" if len(names) > 1 else ""}
    head = " | ".join(
        f"{label[n]} cold (round 1), s | {label[n]} warm (median of the others), s".strip() for n in names
    )
    rows = [f"| phase | {head} |", "| --- |" + " --- | --- |" * len(names)]
    for phase in rounds[0]["kubetune"]["phases_s"]:
        cells = [
            f"{cold['phases_s'][phase]:.2f} | {med([w['phases_s'][phase] for w in warm]):.2f}"
            for cold, warm in cols.values()
        ]
        rows.append(f"| {phase} | {' | '.join(cells)} |")
    cells = [f"**{cold['total_s']:.2f}** | **{med([w['total_s'] for w in warm]):.2f}**" for cold, warm in cols.values()]
    rows.append(f"| **whole process** | {' | '.join(cells)} |")
    cells = [f"— | {med([w['total_s'] - w['train_runtime_s'] for w in warm]):.2f}" for _, warm in cols.values()]
    rows.append(f"| of which not training (total − train_runtime_s) | {' | '.join(cells)} |")
    warm = cols["kubetune"][1]
    hf = [r["hf_trainer"] for r in rounds if r["hf_trainer"]]
    if hf:
        rows.append(
            f"\nHF Trainer, whole process: {med([h['total_s'] for h in hf]):.1f} s (training "
            f"{med([h['train_runtime_s'] for h in hf]):.1f} s); kubetune's warm whole process is "
            f"{med([h['total_s'] for h in hf]) / med([w['total_s'] for w in warm]):.2f}x faster, its training "
            f"{med([h['train_runtime_s'] for h in hf]) / med([w['train_runtime_s'] for w in warm]):.2f}x."
        )
    return "\n".join(rows) + "\n"


if __name__ == "__main__":
    main()
