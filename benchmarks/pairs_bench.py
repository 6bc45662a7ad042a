"""What the pair benchmarks (``reward_trl.py``, ``orpo_trl.py``) share: each system run in a fresh process in turn
(its result and peak RSS written by the child), the medians over the rounds, and the table against TRL with the
1.5× goal, into benchmarks/results/<name>.{json,md}."""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import time
from pathlib import Path

from common import ROOT


def child(systems: dict, system: str, work: Path, out: Path) -> None:
    t0 = time.perf_counter()
    result = systems[system](work, out)
    result["process_s"] = time.perf_counter() - t0
    result["peak_rss_mib"] = (
        max(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss)
        / 1024
    )
    (out.parent / f"{out.name}.json").write_text(json.dumps(result))


PAIRS = ROOT / "src/kubetune/assets/sentiment/sentiment-preferences.jsonl"


def make_data(work: Path, n: int) -> None:
    """The packaged preferences' first ``n`` pairs, which both systems split 90/10 by kubetune's own split."""
    rows = PAIRS.read_text().splitlines()[:n]
    (work / "pairs.jsonl").write_text("\n".join(rows) + "\n")


def prepare_llama(work: Path, pairs: int) -> None:
    """sft_trl.py's 28M Llama (made once) and the first ``pairs`` pairs: what the causal-LM pair benchmarks (ORPO,
    KTO) train on."""
    from sft_trl import make_model

    if not (work / "model" / "config.json").exists():
        make_model(work / "model")
    make_data(work, pairs)


def main(script: str, title: str, systems: dict, prepare, name: str, accuracy: str, unit: str = "pairs") -> None:
    """The command line of a pair benchmark: ``systems`` (name -> run(work, out) -> result), each run in a fresh
    process in turn; ``prepare(work, pairs)`` makes the model and data first; the table titled ``title``, its
    training rate in ``unit`` per second (a result's ``pairs``: KTO counts examples)."""
    ap = argparse.ArgumentParser()
    ap.add_argument("--pairs", type=int, default=1080)
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--name", default=name)
    ap.add_argument("--work", default=f"/tmp/kubetune-bench-{name}")
    ap.add_argument("--systems", default=",".join(systems))
    ap.add_argument("--child", nargs=2, metavar=("SYSTEM", "OUT"), help=argparse.SUPPRESS)
    a = ap.parse_args()
    work = Path(a.work)
    if a.child:
        child(systems, a.child[0], work, Path(a.child[1]))
        return
    work.mkdir(parents=True, exist_ok=True)
    prepare(work, a.pairs)
    results: dict[str, list] = {s: [] for s in a.systems.split(",")}
    for r in range(a.rounds):
        for system in results:
            out = work / f"r{r}-{system}"
            subprocess.run(["rm", "-rf", str(out)], check=True)
            t = time.perf_counter()
            subprocess.run([sys.executable, script, "--work", str(work), "--child", system, str(out)], check=True)
            res = json.loads((work / f"{out.name}.json").read_text())
            res["wall_s"] = time.perf_counter() - t
            results[system].append(res)
            print(
                f"round {r} {system}: {res['pairs'] / res['train_s']:.1f} {unit}/s, {res['train_s']:.1f} s", flush=True
            )
    write(a.name, results, a, script, title, accuracy, unit)


def write(name: str, results: dict, a, script: str, title: str, accuracy: str, unit: str = "pairs") -> None:
    import platform
    import statistics

    import torch
    import transformers
    import trl

    # no loss column: kubetune's train_loss is the mean of the last 10% of logged losses, TRL's the whole run's
    med = {s: {k: statistics.median(r[k] for r in runs) for k in ("train_s", "wall_s", "peak_rss_mib")}
           | {"pairs": runs[0]["pairs"], "steps": runs[0]["steps"]} for s, runs in results.items()}  # fmt: skip
    stamp = time.strftime("%Y-%m-%d %H:%M")
    lines = [
        f"# {title} on the CPU: kubetune and TRL ({stamp})",
        "",
        f"{platform.machine()}, {torch.get_num_threads()} threads; torch {torch.__version__}, transformers "
        f"{transformers.__version__}, trl {trl.__version__}. `python benchmarks/{Path(script).name} --pairs {a.pairs} "
        f"--rounds {a.rounds}` (medians of {a.rounds} round(s)).",
        "",
        f"| system | steps | {unit} | training (s) | {unit}/s | process wall (s) | peak RSS (MiB) |",
        "| --- | --- | --- | --- | --- | --- | --- |",
    ]
    for s, m in med.items():
        lines.append(
            f"| {s} | {m['steps']} | {m['pairs']} | {m['train_s']:.1f} | {m['pairs'] / m['train_s']:.2f} | "
            f"{m['wall_s']:.1f} | {m['peak_rss_mib']:.0f} |"
        )
    if {"kubetune", "trl"} <= med.keys():
        k, t = med["kubetune"], med["trl"]
        lines += [
            "",
            f"kubetune ÷ TRL: {unit}/s of training {(k['pairs'] / k['train_s']) / (t['pairs'] / t['train_s']):.2f}×, "
            f"whole run (wall) {t['wall_s'] / k['wall_s']:.2f}× (goal: at least 1.5×).",
        ]
        if results["kubetune"][0].get("eval_accuracy") is not None:
            lines.append(f"kubetune's held-out {accuracy}: {results['kubetune'][0]['eval_accuracy']:.4f}.")
    out = ROOT / "benchmarks" / "results"
    (out / f"{name}.md").write_text("\n".join(lines) + "\n")
    (out / f"{name}.json").write_text(json.dumps({"results": results, "medians": med}, indent=1))
    print("\n".join(lines))
