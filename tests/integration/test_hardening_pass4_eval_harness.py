"""Issue 63, evaluation with the harness itself (the tiny Llama of the package, a few reviews): `kubetune eval
--output` into a missing folder writes there once scored; SIGTERM during the scoring gives it up at once (one
line, exit 143, nothing left); a FIFO among the task YAML, data that is not JSON and more few-shot examples than
a task has are one line before anything is scored, from the command line and from a spec's `evaluation` section;
a training run's seed past numpy's range seeds the harness as training seeds numpy, and the samples of a task named
`../../../x` stay in the run; a task folder runs its Python as the evaluation guide says. (The checks that need
no harness: tests/unit/test_hardening_pass4_eval.py.)"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, kubetune, lm_eval_tasks, write_spec
from typer.testing import CliRunner

pytestmark = pytest.mark.integration
LLAMA = ROOT / "src" / "kubetune" / "assets" / "tiny-llama"
MC = "kubetune_sentiment_mc"


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory) -> Path:
    """The harness task YAML of tests/data/lm_eval_tasks over the first 4 reviews."""
    return lm_eval_tasks(tmp_path_factory.mktemp("lm-eval-tasks"), 4)


def _one_line(code: int, err: str, *fragments: str) -> str:
    assert code == 2, (code, err[-3000:])
    (line,) = err.strip().splitlines()
    assert line.startswith("error: ") and all(f in line for f in fragments), line
    return line


def test_eval_into_a_missing_folder_writes_the_results_there_once_scored(task_dir, tmp_path):
    out = tmp_path / "evals" / "results.json"  # evals/ does not exist; its parent does
    code, err, stdout = _cli("eval", str(LLAMA), "--tasks", MC, "--include-path", str(task_dir), "--limit", "2",
                             "-o", str(out), "--log-samples")  # fmt: skip
    assert code == 0, err[-3000:]
    written = json.loads(out.read_text())
    assert stdout.startswith(f"{MC}  acc  {written['results'][MC]['acc,none']:.4f}"), stdout
    assert [s["doc_id"] for s in written["samples"][MC]] == [0, 1]
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["evals", "results.json"]  # no .partial, no probe


def _stop_during_scoring(task_dir: Path, tmp_path: Path, procs: int) -> tuple[subprocess.Popen, str, float]:
    """`kubetune eval` over 200 reviews, SIGTERM once the harness runs its requests: (the process, its stderr,
    the seconds from the signal to its exit)."""
    (tmp_path / "big").mkdir()
    big = lm_eval_tasks(tmp_path / "big", 200)
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:
        proc = subprocess.Popen(
            [sys.executable, "-m", "kubetune", "eval", str(LLAMA), "--tasks", MC, "--include-path", str(big),
             "--procs", str(procs), "-o", str(tmp_path / "new" / "results.json")],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, start_new_session=True,
        )  # fmt: skip
        deadline = time.monotonic() + 240
        while "Running loglikelihood requests" not in log.read_text():
            assert proc.poll() is None, log.read_text()[-3000:]
            assert time.monotonic() < deadline, "never scored"
            time.sleep(0.2)
        time.sleep(1.0)  # well inside the scoring (200 reviews x 3 choices: 20 s and more)
        signalled = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        proc.wait(timeout=60)
    return proc, log.read_text(), time.monotonic() - signalled


def _stopped_at_once(proc: subprocess.Popen, err: str, took: float, tmp_path: Path) -> None:
    print(f"exit {proc.returncode} {took:.1f} s after SIGTERM")
    assert proc.returncode == 143, err[-3000:]
    # the one line (after the harness's progress bar, which tqdm closes last)
    assert err.count("stopped by SIGTERM before the evaluation finished; nothing was written — run the same") == 1, err[
        -3000:
    ]
    assert "Traceback" not in err and took < 15, (took, err[-3000:])
    assert not (tmp_path / "new").exists()  # the folder made for the results is not left behind


def test_sigterm_during_scoring_gives_the_evaluation_up_at_once(task_dir, tmp_path):
    _stopped_at_once(*_stop_during_scoring(task_dir, tmp_path, 1), tmp_path)


@pytest.mark.e2e  # make test: the one-process stop above (the same handler; here the launcher's signal)
def test_sigterm_during_scoring_on_two_processes_stops_every_rank(task_dir, tmp_path):
    proc, err, took = _stop_during_scoring(task_dir, tmp_path, 2)
    _stopped_at_once(proc, err, took, tmp_path)
    left = subprocess.run(["pgrep", "-s", str(proc.pid)], capture_output=True, text=True).stdout.split()
    assert not left, left  # no rank outlives the command


def test_a_fifo_among_the_task_yaml_is_one_line_not_a_hang(task_dir, tmp_path):
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    for f in task_dir.iterdir():
        (tasks / f.name).write_bytes(f.read_bytes())
    os.mkfifo(tasks / "zz.yaml")
    r = kubetune("eval", str(LLAMA), "--tasks", MC, "--include-path", str(tasks), timeout=120)
    _one_line(r.returncode, r.stderr, "--include-path: the task YAML", "zz.yaml is a FIFO (named pipe)")


def _cli(*args: str) -> tuple[int, str, str]:
    """The command line in this process (the harness imported once for the module): exit code, stderr (and the
    exception of a crash), stdout."""
    from kubetune.cli import app

    r = CliRunner().invoke(app, list(args))
    return r.exit_code, r.stderr + (repr(r.exception) if r.exit_code not in (0, 2) else ""), r.stdout


def test_data_that_is_not_json_a_missing_split_and_too_many_shots_are_one_line_before_scoring(task_dir, tmp_path):
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "reviews.jsonl").write_text("this is not JSON {\n")
    (bad / f"{MC}.yaml").write_text((task_dir / f"{MC}.yaml").read_text().replace(str(task_dir), str(bad)))
    code, err, _ = _cli("eval", str(LLAMA), "--tasks", MC, "--include-path", str(bad))
    _one_line(code, err, f"--tasks: the data of {MC} cannot be read as the task YAML says", "JSON parse error")
    (bad / f"{MC}.yaml").write_text((task_dir / f"{MC}.yaml").read_text().replace("test_split: test", "test_split: x"))
    code, err, _ = _cli("eval", str(LLAMA), "--tasks", MC, "--include-path", str(bad))
    _one_line(code, err, f"--tasks: the harness cannot load {MC}: KeyError: 'x'", "test_split")
    # 4 reviews: 4 examples can be drawn for each (the task samples from its test split), 5 cannot
    code, err, _ = _cli("eval", str(LLAMA), "--tasks", MC, "--include-path", str(task_dir), "--num-fewshot", "5")
    _one_line(code, err, f"--num-fewshot: task {MC} cannot draw 5 few-shot examples", "it has 4 documents")


def test_a_spec_asking_more_shots_than_a_task_has_is_one_line_before_training(task_dir, tmp_path):
    spec = yaml.safe_load((ROOT / "examples" / "causal-tiny-chat.yaml").read_text())
    spec["output"] = {"uri": str(tmp_path / "run")}
    spec["evaluation"] = {"tasks": [MC], "include_path": str(task_dir), "num_fewshot": 1000}
    code, err, _ = _cli("run", str(write_spec(tmp_path / "job.yaml", spec)))
    _one_line(code, err, f"evaluation.num_fewshot: task {MC} cannot draw 1000 few-shot examples")
    assert not (tmp_path / "run").exists()


def test_a_seed_past_numpys_range_and_a_task_named_like_a_path_in_training(task_dir, tmp_path):
    """What a training run's evaluation does (scoring.evaluate, scoring.write_samples), on the tiny Llama: its
    training.seed (any int from 0) seeds numpy modulo 2**32, as training does; the samples of a task whose YAML
    names it `../../../x` are written inside the run's lm_eval_samples/."""
    from transformers import AutoModelForCausalLM

    from kubetune.evaluation import harness
    from kubetune.inference import model as M
    from kubetune.training.scoring import write_samples

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    (tasks / "evil.yaml").write_text((task_dir / f"{MC}.yaml").read_text().replace(f"task: {MC}", "task: ../../../x"))
    manager = harness.task_manager(str(tasks), ["../../../x"])
    model = M.load_model(AutoModelForCausalLM, LLAMA).eval()
    results = harness.run(
        model, M.load_tokenizer(LLAMA), ["../../../x"], manager, limit=2, log_samples=True, seed=2**32, quiet=True
    )
    assert 0 <= harness.scores(results)["../../../x"]["acc,none"] <= 1
    run = tmp_path / "a" / "b" / "c" / "run"
    run.mkdir(parents=True)
    write_samples(run / "lm_eval_samples", results["samples"])
    (only,) = [p for p in tmp_path.rglob("*.jsonl")]
    assert only.parent == run / "lm_eval_samples" and len(only.read_text().splitlines()) == 2, only


def test_a_task_folder_runs_its_python_as_the_guide_says(task_dir, tmp_path):
    """`!function utils.process_docs`: utils.py beside the YAML is imported and run when the task loads."""
    from kubetune.evaluation import harness

    tasks = tmp_path / "tasks"
    tasks.mkdir()
    marker = tmp_path / "ran"
    (tasks / "utils.py").write_text(
        f"from pathlib import Path\nPath({str(marker)!r}).write_text('imported')\n\n"
        "def process_docs(docs):\n    return docs\n"
    )
    (tasks / "coded.yaml").write_text(
        (task_dir / f"{MC}.yaml").read_text().replace(f"task: {MC}", "task: coded")
        + "process_docs: !function utils.process_docs\n"
    )
    manager = harness.task_manager(str(tasks), ["coded"])
    assert not marker.exists()  # indexing the folder runs nothing
    harness.check_data(["coded"], manager, field="--tasks")
    assert marker.read_text() == "imported"
