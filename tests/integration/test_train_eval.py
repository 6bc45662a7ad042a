"""lm-evaluation-harness during and after training (the spec's ``evaluation`` section): the tiny chat example
as a full fine-tune on 2 processes, its harness tasks scored at step 0 (the base model), every 4 steps and after
training. The scores after training equal ``lm_eval.simple_evaluate(model="hf")`` on the exported model exactly
(each rank scored its share); the curve is in history.jsonl, progress.json and report.html; the per-sample log
is kept. Bad input fails in one line before any worker starts."""

from __future__ import annotations

import json
import signal
from pathlib import Path

import pytest
import yaml
from conftest import ROOT, kubetune, lm_eval_tasks, start_run, wait_for_checkpoint, write_spec

pytestmark = pytest.mark.integration
TASKS = ["kubetune_sentiment_mc", "kubetune_sentiment_gen"]


def _spec(tmp: Path, **evaluation) -> dict:
    spec = yaml.safe_load((ROOT / "examples" / "causal-tiny-chat.yaml").read_text())
    spec.pop("lora")
    spec["data"]["max_train_samples"] = 256
    spec["training"].update(max_steps=16, log_every=4, precision="fp32", learning_rate=1e-3)
    spec["output"] = {"uri": str(tmp / "run")}
    spec["evaluation"] = {
        "tasks": TASKS,
        "include_path": str(lm_eval_tasks(tmp / "tasks", 12)) if (tmp / "tasks").mkdir() is None else "",
        "chat": True,
        "batch_size": 4,
        **evaluation,
    }
    return spec


@pytest.fixture(scope="module")
def scored_run(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("train-eval")
    spec = _spec(tmp, every=4, on_start=True, log_samples=True)
    r = kubetune("run", str(write_spec(tmp / "job.yaml", spec)), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "run", spec, r


def test_the_scores_after_training_equal_the_harness_on_the_export(scored_run):
    import lm_eval
    from lm_eval.tasks import TaskManager

    out, spec, _ = scored_run
    metrics = json.loads((out / "metrics.json").read_text())
    want = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={out / 'model'},dtype=float32,device=cpu",
        tasks=TASKS,
        task_manager=TaskManager(include_path=spec["evaluation"]["include_path"]),
        batch_size=4,
        apply_chat_template=True,
        random_seed=0,
    )
    print({t: metrics["lm_eval"][t] for t in TASKS})
    for task in TASKS:
        expected = {k: v for k, v in want["results"][task].items() if isinstance(v, (int, float))}
        assert metrics["lm_eval"][task] == pytest.approx(expected, abs=0), task
    assert metrics["lm_eval_harness"]
    samples = {t: (out / "lm_eval_samples" / f"{t}.jsonl").read_text().splitlines() for t in TASKS}
    assert all(len(rows) == 12 for rows in samples.values()), {t: len(r) for t, r in samples.items()}


def test_the_curve_starts_at_the_base_model_and_is_everywhere_a_user_looks(scored_run):
    out, _, r = scored_run
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    scored = [h for h in history if h["type"] == "lm_eval"]
    assert [h["step"] for h in scored] == [0, 4, 8, 12, 16], scored
    assert all(0 <= h["kubetune_sentiment_mc/acc"] <= 1 for h in scored)
    metrics = json.loads((out / "metrics.json").read_text())
    assert scored[-1]["kubetune_sentiment_mc/acc"] == metrics["lm_eval"]["kubetune_sentiment_mc"]["acc,none"]
    progress = json.loads((out / "progress.json").read_text())
    assert progress["lm_eval"]["step"] == 16 and "kubetune_sentiment_gen/exact_match" in progress["lm_eval"]
    report = (out / "report.html").read_text()
    assert "lm-evaluation-harness" in report and "base model (step 0)" in report and 'alt="lm_eval"' in report
    assert (out / "plots" / "lm_eval.png").stat().st_size > 0
    # one line per evaluation, nothing of the harness's own output (progress bars, its `git describe`)
    lines = [line for line in r.stderr.splitlines() if "lm_eval" in line]
    assert len(lines) == 5 and all(": lm_eval kubetune_sentiment_mc/acc " in line for line in lines), lines
    assert "fatal:" not in r.stderr and "Running loglikelihood" not in r.stderr, r.stderr[-3000:]


def test_bad_evaluation_input_is_one_line_before_training(tmp_path):
    spec = _spec(tmp_path)
    spec["evaluation"]["tasks"] = ["kubetune_sentimnt_mc"]
    r = kubetune("run", str(write_spec(tmp_path / "a.yaml", spec)))
    assert r.returncode == 2, r.stderr[-2000:]
    assert r.stderr.strip().count("\n") == 0 and "closest: kubetune_sentiment_mc" in r.stderr, r.stderr
    assert "evaluation.tasks" in r.stderr and not (tmp_path / "run").exists()
    minilm = yaml.safe_load((ROOT / "examples" / "sentiment-minilm.yaml").read_text())
    minilm["evaluation"] = {"tasks": TASKS}
    r = kubetune("run", str(write_spec(tmp_path / "b.yaml", minilm)))
    assert r.returncode == 2 and "lm-evaluation-harness scores causal language models" in r.stderr, r.stderr
    # a generation budget over the tiny Llama's 512-token context: the harness would cut every prompt's start off
    (tmp_path / "c").mkdir()
    spec = _spec(tmp_path / "c", gen_kwargs={"max_gen_toks": 600})
    r = kubetune("run", str(write_spec(tmp_path / "c.yaml", spec)))
    assert r.returncode == 2, r.stderr[-2000:]
    (line,) = r.stderr.strip().splitlines()
    assert "12 of 12 requests of task kubetune_sentiment_gen need more than the model's context of 512" in line
    assert "evaluation" in line and "max_gen_toks" in line and not (tmp_path / "c" / "run").exists()
    # the few-shot examples count too (in the chat template's turns)
    (tmp_path / "d").mkdir()
    spec = _spec(tmp_path / "d", num_fewshot=11)
    r = kubetune("run", str(write_spec(tmp_path / "d.yaml", spec)))
    assert r.returncode == 2 and "requests of task kubetune_sentiment_mc need more than" in r.stderr, r.stderr[-2000:]
    assert "few-shot examples" in r.stderr


@pytest.mark.e2e  # make test: the uninterrupted run above
def test_a_run_stopped_by_sigterm_and_resumed_keeps_one_curve_equal_to_the_uninterrupted_one(scored_run, tmp_path):
    """The same job with checkpoints every 4 steps, SIGTERM after the checkpoint of step 4, run again: the
    harness's curve has each evaluation once (the history is cut back to the checkpoint, the evaluations after
    it are made again), and every score equals the uninterrupted run's (an exact resume)."""
    _, reference, _ = scored_run
    spec = {**reference, "output": {"uri": str(tmp_path / "run")}}
    spec["training"] = {**reference["training"], "checkpoint_every": 4}
    path = write_spec(tmp_path / "job.yaml", spec)
    proc = start_run(path)
    wait_for_checkpoint(tmp_path / "run", 4, proc)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err[-3000:]
    again = kubetune("run", str(path), timeout=600)
    assert again.returncode == 0 and "resumed from checkpoint step" in again.stderr, again.stderr[-3000:]

    def curve(out: Path) -> list[dict]:
        records = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
        keep = ("step", "kubetune_sentiment_mc/acc", "kubetune_sentiment_gen/exact_match")
        return [{k: h[k] for k in keep} for h in records if h["type"] == "lm_eval"]

    resumed, uninterrupted = curve(tmp_path / "run"), curve(scored_run[0])
    print(resumed)
    assert resumed == uninterrupted and [h["step"] for h in resumed] == [0, 4, 8, 12, 16]
