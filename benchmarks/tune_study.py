"""`kubetune tune` on the MiniLM sentiment example (examples/sentiment-minilm.yaml, shortened), in one run:

    python benchmarks/tune_study.py [--rows 800] [--trials 8] [--name tune-cpu]

1. The example's own settings as one `kubetune run`: the accuracy to beat.
2. The study of issue 50: 8 TPE trials over training.learning_rate (log 1e-5..1e-3) and lora.r (4, 8, 16),
   median early stopping (2 trials first, evaluations every 10 steps), 2 at once: trials stopped early, the
   best trial's accuracy against the default's, and `kubetune run best.yaml` against the best trial's metric.
3. The same 8 trials (a grid: 4 learning rates x lora.r 4 and 16, so both studies run exactly the same
   trials) with parallel 1 and parallel 2, and with parallel 1 and early stopping: wall time of each, so the
   ratios say what parallel trials and early stopping save.

Each trial is one process (procs_per_node 1), so 2 trials at once use the 2 cores. Writes
benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import ROOT  # noqa: E402

SPACE_TPE = {
    "training.learning_rate": {"type": "float", "low": 1e-5, "high": 1e-3, "log": True},
    "lora.r": {"type": "choice", "values": [4, 8, 16]},
}
SPACE_GRID = {
    "training.learning_rate": {"type": "choice", "values": [1e-5, 5e-5, 2e-4, 8e-4]},
    "lora.r": {"type": "choice", "values": [4, 16]},
}


def base(work: Path, rows: int) -> dict:
    spec = yaml.safe_load((ROOT / "examples" / "sentiment-minilm.yaml").read_text())
    spec["data"]["max_train_samples"] = rows
    spec["data"]["max_eval_samples"] = 200  # 5 evaluations per trial: the early stopping's evidence
    spec["training"]["eval_every"] = 10
    spec["distributed"]["procs_per_node"] = 1
    spec["output"] = {"uri": str(work / "default"), "report_baseline": False}
    spec["lora"] = {"r": 8}  # the default LoRA the study searches around
    return spec


def timed(cmd: list[str]) -> tuple[float, subprocess.CompletedProcess]:
    t0 = time.perf_counter()
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    if r.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{r.stderr[-3000:]}")
    return time.perf_counter() - t0, r


def study(work: Path, spec: dict, name: str, **tune) -> dict:
    spec = {**spec, "output": {"uri": str(work / name), "report_baseline": False}, "tune": tune}
    path = work / f"{name}.yaml"
    path.write_text(yaml.safe_dump(spec, sort_keys=False))
    wall, _ = timed([sys.executable, "-m", "kubetune", "tune", str(path)])
    data = json.loads((work / name / "tune.json").read_text())
    states = [t["state"] for t in data["trials"]]
    return {"wall_s": wall, "best": data["best"], "states": states, "pruned": states.count("pruned"), "data": data}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", type=int, default=800)
    ap.add_argument("--trials", type=int, default=8)
    ap.add_argument("--name", default="tune-cpu")
    ap.add_argument("--work", default="/tmp/kubetune-bench-tune")
    a = ap.parse_args()
    work = Path(a.work)
    subprocess.run(["rm", "-rf", str(work)], check=True)
    work.mkdir(parents=True)
    spec = base(work, a.rows)
    default_path = work / "default.yaml"
    default_path.write_text(yaml.safe_dump(spec, sort_keys=False))
    default_s, _ = timed([sys.executable, "-m", "kubetune", "run", str(default_path)])
    default_acc = json.loads((work / "default" / "metrics.json").read_text())["eval_accuracy"]
    print(f"default: eval_accuracy {default_acc:.4f} in {default_s:.0f} s", flush=True)

    common = {"objective": "eval_accuracy", "trials": a.trials, "seed": 0}
    stop = {"min_trials": 2}
    tpe = study(work, spec, "tpe", space=SPACE_TPE, algorithm="tpe", parallel=2, early_stopping=stop, **common)
    print(f"tpe: {tpe['states']}, best {tpe['best']} in {tpe['wall_s']:.0f} s", flush=True)
    again_s, _ = timed([sys.executable, "-m", "kubetune", "run", str(work / "tpe" / "best.yaml")])
    again = json.loads((work / "tpe" / "best" / "metrics.json").read_text())["eval_accuracy"]

    grid = {"space": SPACE_GRID, "algorithm": "grid", **common}
    serial = study(work, spec, "grid-p1", parallel=1, **grid)
    parallel = study(work, spec, "grid-p2", parallel=2, **grid)
    stopped = study(work, spec, "grid-p1-stop", parallel=1, early_stopping=stop, **grid)
    for name, s in (("grid-p1", serial), ("grid-p2", parallel), ("grid-p1-stop", stopped)):
        print(f"{name}: {s['wall_s']:.0f} s, {s['states']}", flush=True)

    rows = [
        ("default spec (one run)", default_s, "—", f"{default_acc:.4f}", ""),
        ("TPE, 8 trials, median stopping, parallel 2", tpe["wall_s"], tpe["pruned"], f"{tpe['best']['value']:.4f}",
         f"trial {tpe['best']['number']}: {tpe['best']['params']}"),
        ("kubetune run best.yaml", again_s, "—", f"{again:.4f}", "equal to the best trial's" if again ==
         tpe["best"]["value"] else f"DIFFERS from {tpe['best']['value']}"),
        ("grid of 8, parallel 1", serial["wall_s"], serial["pruned"], f"{serial['best']['value']:.4f}", ""),
        ("grid of 8, parallel 2", parallel["wall_s"], parallel["pruned"], f"{parallel['best']['value']:.4f}",
         f"{serial['wall_s'] / parallel['wall_s']:.2f}x faster than parallel 1"),
        ("grid of 8, parallel 1, median stopping", stopped["wall_s"], stopped["pruned"],
         f"{stopped['best']['value']:.4f}", f"{1 - stopped['wall_s'] / serial['wall_s']:.0%} of the wall time saved"),
    ]  # fmt: skip
    cpu = platform.processor() or platform.machine()
    lines = [
        f"# kubetune tune on the CPU ({time.strftime('%Y-%m-%d %H:%M')})",
        "",
        f"{cpu}, {os.cpu_count()} cores. `python benchmarks/tune_study.py --rows {a.rows} --trials {a.trials}`: "
        f"examples/sentiment-minilm.yaml with max_train_samples {a.rows}, max_eval_samples 200, eval_every 10, "
        "LoRA, one process "
        "per trial.",
        "",
        "| study | wall (s) | stopped early | best eval_accuracy | note |",
        "| --- | --- | --- | --- | --- |",
        *(f"| {r[0]} | {r[1]:.0f} | {r[2]} | {r[3]} | {r[4]} |" for r in rows),
        "",
        f"TPE's best against the default spec: {tpe['best']['value']:.4f} vs {default_acc:.4f}"
        f" ({'at least' if tpe['best']['value'] >= default_acc else 'BELOW'} the default's).",
    ]
    out = ROOT / "benchmarks" / "results"
    (out / f"{a.name}.md").write_text("\n".join(lines) + "\n")
    record = {"default": default_acc, "default_s": default_s, "again": again,
              "studies": {k: {kk: vv for kk, vv in v.items() if kk != "data"} | {"trials": v["data"]["trials"]}
                          for k, v in (("tpe", tpe), ("grid-p1", serial), ("grid-p2", parallel),
                                       ("grid-p1-stop", stopped))}}  # fmt: skip
    (out / f"{a.name}.json").write_text(json.dumps(record, indent=1, default=str))
    print("\n".join(lines))


if __name__ == "__main__":
    main()
