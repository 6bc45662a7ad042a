"""The spec's ``evaluation`` section (lm-evaluation-harness during training) and where its scores go, without
running the harness: the checks between sections, the relative task directory, the scalar names every tracker
gets, and the scores read back from a pod's log and from a TrainJob's trainerStatus."""

from __future__ import annotations

from pathlib import Path

import pytest

from kubetune.artifacts.report import harness_scalars
from kubetune.config.load import parse_spec, resolve_data_paths
from kubetune.errors import SpecError
from kubetune.training.events import Event, log_line
from kubetune.training.loggers import progress_from_events
from kubetune.training.trainer_status import progress_of, trainer_status

BASE = {
    "name": "scored",
    "task": "causal-lm",
    "model": {"uri": "/models/llama"},
    "data": {"train": "chat.jsonl", "format": "chat"},
    "output": {"uri": "/tmp/runs/scored"},
    "evaluation": {"tasks": ["arc_easy"], "include_path": "tasks", "every": 10, "on_start": True},
}


def test_the_section_validates_and_its_task_directory_is_relative_to_the_spec(tmp_path):
    spec = resolve_data_paths(parse_spec(BASE), tmp_path)
    assert spec.evaluation.include_path == str(tmp_path.resolve() / "tasks")
    assert spec.evaluation.after and spec.evaluation.batch_size == 8
    absolute = resolve_data_paths(parse_spec({**BASE, "evaluation": {"tasks": ["a"], "include_path": "/t"}}), tmp_path)
    assert absolute.evaluation.include_path == "/t"


@pytest.mark.parametrize(
    "change, says",
    [
        ({"task": "sequence-classification", "data": {"train": "a.csv"}}, "scores causal language models"),
        ({"distributed": {"strategy": "fsdp"}}, "evaluation.every under distributed.strategy fsdp"),
        ({"evaluation": {"tasks": []}}, "evaluation.tasks"),
        ({"evaluation": {"tasks": ["a"], "limit": 0}}, "evaluation.limit"),
    ],
)
def test_what_cannot_run_is_refused_by_name(change, says):
    with pytest.raises(SpecError) as e:
        parse_spec({**BASE, **change})
    assert says in str(e.value), str(e.value)


def test_one_scalar_per_task_and_metric_named_for_every_tracker():
    scores = {
        "arc_easy": {"acc,none": 0.5, "acc_stderr,none": 0.1, "acc_norm,none": 0.6, "sample_len": 12.0},
        "gsm8k": {"exact_match,strict-match": 0.25, "exact_match,flexible-extract": 0.3},
    }
    assert harness_scalars(scores) == {
        "arc_easy/acc": 0.5,
        "arc_easy/acc_norm": 0.6,
        "gsm8k/exact_match/strict-match": 0.25,
        "gsm8k/exact_match/flexible-extract": 0.3,
    }
    assert not any("," in name for name in harness_scalars(scores))  # MLflow refuses commas


def test_the_scores_reach_status_from_a_pods_log_and_from_a_trainjob():
    lines = [
        log_line(Event("lm_eval", 0, {"arc_easy/acc": 0.25, "gsm8k/exact_match/strict-match": 0.0})),
        log_line(Event("progress", 10, context={"step": 10, "total_steps": 20, "loss": 1.2, "eta_s": 5.0})),
        log_line(Event("lm_eval", 10, {"arc_easy/acc": 0.5, "gsm8k/exact_match/strict-match": 0.125})),
    ]
    record = progress_from_events([f"12:00:0{i} [rank 0] INFO {line}" for i, line in enumerate(lines)])
    assert record["lm_eval"] == {"step": 10, "arc_easy/acc": 0.5, "gsm8k/exact_match/strict-match": 0.125}
    assert record["step"] == 10
    status = trainer_status({**record, "total_steps": 20})
    names = {m["name"]: m["value"] for m in status["metrics"]}
    assert names["lm_eval/arc_easy/acc"] == "0.5" and names["lm_eval_step"] == "10"
    assert all(len(m["name"]) <= 64 for m in status["metrics"])
    assert progress_of(status)["lm_eval"] == {"step": 10, "arc_easy/acc": 0.5, "gsm8k/exact_match/strict-match": 0.125}


def test_a_progress_file_keeps_its_scores_through_a_resume(tmp_path: Path):
    from kubetune.training.loggers import ProgressLogger, read_progress

    first = ProgressLogger(tmp_path, total_steps=20, epochs=1, start_step=0)
    first.on_event(Event("lm_eval", 10, {"arc_easy/acc": 0.5}, {"eval_s": 1.0}))
    again = ProgressLogger(tmp_path, total_steps=20, epochs=1, start_step=10)
    again.on_event(Event("train", 12, {"loss": 1.0, "lr": 1e-4}, {"epoch": 1, "samples": 96, "tokens": 1000}))
    assert read_progress(tmp_path)["lm_eval"] == {"step": 10, "arc_easy/acc": 0.5}
