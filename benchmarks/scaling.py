"""How kubetune's DDP scales across the cores of one CPU machine, against the ceiling this machine allows.

    python benchmarks/scaling.py [--train-rows 1200] [--rounds 2] [--name scaling]

Every run is kubetune on the packaged MiniLM (full fine-tune, one epoch, the same rows, 1 thread
per process, `precision: auto`). Per round, in turn:

- **solo**: 1 process, per-process batch 16, alone on the machine;
- **2 independent**: two such 1-process runs started together, sharing nothing; their summed
  samples/s is what two processes get from this machine when they never communicate: the ceiling
  for any data-parallel method;
- **DDP 2 × 1**: kubetune with 2 processes, per-process batch 16 (global 32), gloo all-reduce;
- **solo, batch 32**: 1 process with DDP's global batch (the same optimizer steps as DDP 2 × 1);
- **solo / DDP 2 × 1 with grad_accum 2**: the same two runs with 2 micro-batches of 16 per
  optimizer step, so DDP all-reduces once per 2 micro-batches (``no_sync`` on the first).

Reported: DDP samples/s ÷ (2 × solo) (weak scaling: same work per process, as DDP scaling is
usually quoted), ÷ the 2-independent ceiling, and ÷ (2 × solo at batch 32) (strong scaling: the
same job). Medians of the rounds. Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, write_split  # noqa: E402
from run import PY, _cpu_model, kubetune_spec  # noqa: E402  (the spec every kubetune benchmark run uses)


def start(
    work: Path, train: Path, evald: Path, name: str, procs: int, batch: int, accum: int = 1
) -> tuple[subprocess.Popen, Path]:
    out = work / f"{name}-{time.time_ns()}"
    path = work / f"{name}.yaml"
    overrides = {
        "name": name,
        "training.batch_size": batch,
        "training.grad_accum": accum,
        "training.log_every": 10,
        "distributed.threads_per_proc": 1,
    }
    path.write_text(yaml.safe_dump(kubetune_spec(train, evald, out, procs, overrides, eval_every=0)))
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(
        [PY, "-m", "kubetune", "run", str(path)],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    return proc, out


def finish(proc: subprocess.Popen, out: Path) -> dict:
    output, _ = proc.communicate()
    if proc.returncode != 0:
        raise SystemExit(f"kubetune run failed ({proc.returncode}):\n{output[-3000:]}")
    return json.loads((out / "metrics.json").read_text())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-rows", type=int, default=1200)
    ap.add_argument("--eval-rows", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="scaling")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kubetune-scaling-"))
    train, evald = write_split(work / "data", args.train_rows, args.eval_rows)
    finish(*start(work, train, evald, "warmup", 1, 16))  # tokenization cache and page cache, not timed

    # name -> (processes, per-process batch, grad_accum); "independent" is two solo runs at once.
    runs = {
        "solo": (1, 16, 1),
        "independent": (1, 16, 1),
        "ddp": (2, 16, 1),
        "solo32": (1, 32, 1),
        "solo_accum2": (1, 16, 2),
        "ddp_accum2": (2, 16, 2),
    }
    rates: dict[str, list[float]] = {name: [] for name in runs}
    for rnd in range(args.rounds):
        for name, (procs, batch, accum) in runs.items():
            started = [
                start(work, train, evald, f"{name.replace('_', '-')}{i}", procs, batch, accum)
                for i in range(2 if name == "independent" else 1)
            ]
            rates[name].append(sum(finish(*p)["train_samples_per_second"] for p in started))
        print(f"round {rnd + 1}: " + ", ".join(f"{k} {v[-1]:.1f}" for k, v in rates.items()), flush=True)

    med = {k: statistics.median(v) for k, v in rates.items()}
    cpu = _cpu_model()
    result = {
        "meta": {
            "cpu_model": cpu,
            "cores": os.cpu_count(),
            "torch": __import__("torch").__version__,
            "train_rows": args.train_rows,
            "rounds": args.rounds,
            "date": time.strftime("%Y-%m-%d %H:%M"),
        },
        "samples_per_s": rates,
        "median": med,
        "ddp_vs_2x_solo": med["ddp"] / (2 * med["solo"]),
        "independent_vs_2x_solo": med["independent"] / (2 * med["solo"]),
        "ddp_vs_independent": med["ddp"] / med["independent"],
        "ddp_vs_2x_solo32": med["ddp"] / (2 * med["solo32"]),
        "ddp_accum2_vs_2x_solo_accum2": med["ddp_accum2"] / (2 * med["solo_accum2"]),
    }
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    (results / f"{args.name}.json").write_text(json.dumps(result, indent=2))
    md = "\n".join(
        [
            (
                f"{cpu}, {os.cpu_count()} cores, torch {result['meta']['torch']}, {args.train_rows} rows, "
                f"{args.rounds} rounds (medians), {result['meta']['date']}"
            ),
            "",
            "| run | processes × threads | per-process batch | samples/s (median) | ÷ 2 × solo |",
            "| --- | --- | --- | --- | --- |",
            f"| solo | 1 × 1 | 16 | {med['solo']:.1f} | 50% |",
            (
                f"| 2 independent runs (no communication: the ceiling) | 2 × (1 × 1) | 16 | {med['independent']:.1f} "
                f"| {result['independent_vs_2x_solo']:.1%} |"
            ),
            f"| kubetune DDP | 2 × 1 | 16 | {med['ddp']:.1f} | **{result['ddp_vs_2x_solo']:.1%}** |",
            f"| solo, DDP's global batch | 1 × 1 | 32 | {med['solo32']:.1f} | — |",
            f"| solo, grad_accum 2 | 1 × 1 | 16 × 2 | {med['solo_accum2']:.1f} | 50% |",
            (
                f"| kubetune DDP, grad_accum 2 | 2 × 1 | 16 × 2 | {med['ddp_accum2']:.1f} | "
                f"**{result['ddp_accum2_vs_2x_solo_accum2']:.1%}** (÷ 2 × solo, grad_accum 2) |"
            ),
            "",
            (
                f"- Weak scaling (same per-process work): DDP 2 × 1 reaches {result['ddp_vs_2x_solo']:.1%} of twice "
                "the solo rate."
            ),
            f"- Against the ceiling (two processes that never communicate): {result['ddp_vs_independent']:.1%}.",
            (
                f"- Strong scaling (the same job, global batch 32): {result['ddp_vs_2x_solo32']:.1%} of twice the "
                "1-process rate at batch 32."
            ),
            (
                f"- With 2 micro-batches per all-reduce: {result['ddp_accum2_vs_2x_solo_accum2']:.1%} of twice the "
                "solo rate with the same accumulation."
            ),
            "",
        ]
    )
    (results / f"{args.name}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()
