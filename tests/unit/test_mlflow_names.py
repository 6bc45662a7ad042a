"""Metric names MLflow takes, whatever an lm-eval task is named (issue 63: a task named ``../x`` made the metric
``lm_eval/../x/acc``, which MLflow refuses as path-like, and the whole batch of that step was lost)."""

from __future__ import annotations

import pytest
from mlflow.utils.validation import _validate_metric_name

from kubetune.training.tracking import metric_name


@pytest.mark.parametrize(
    "kind, key, expected",
    [
        ("eval", "eval_loss", "eval/loss"),
        ("train", "loss", "train/loss"),
        ("lm_eval", "kubetune_sentiment_mc/acc", "lm_eval/kubetune_sentiment_mc/acc"),
        ("lm_eval", "../x/acc", "lm_eval/_/x/acc"),
        ("lm_eval", "/etc/x/acc", "lm_eval/_/etc/x/acc"),
        ("lm_eval", "a,b/acc,none", "lm_eval/a_b/acc_none"),
        ("lm_eval", "x//./y/acc", "lm_eval/x/_/_/y/acc"),
        ("lm_eval", "tâche/acc", "lm_eval/tâche/acc"),
    ],
)
def test_every_metric_name_is_one_mlflow_takes(kind, key, expected):
    name = metric_name(kind, key)
    assert name == expected
    _validate_metric_name(name)  # MLflow's own check, as its server applies it
