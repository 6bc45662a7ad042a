"""How a task's results read to a person. Each task fills one in (``kubetune.tasks``); the report,
the model card and the summary read it, so none of them branches on the task."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Presentation:
    pipeline_tag: str  # the model card's pipeline tag (the transformers pipeline that runs the export)
    report_rows: Callable[[dict], list[tuple[str, Any]]]  # metrics.json -> the report's first rows
    eval_curves: tuple[str, ...]  # history keys of the evaluations plotted over steps in the report (none: no plot)
    eval_log_scale: bool  # plot them on a log axis (perplexity) or on [0, 1] (scores)
    card_usage: Callable[[str], list[str]]  # repo id -> Python lines that use the exported model
    card_about: Callable[[dict], list[str]]  # metrics -> lines about the data
    headline: Callable[[dict], str]  # metrics -> the headline of a Hub commit message
    summary: Callable[[dict], str]  # metrics.json -> the first line of the summary
    # More plots over optimizer steps: (title, history keys), each key's values from the train and eval
    # records that hold it (e.g. DPO's rewards)
    step_plots: tuple[tuple[str, tuple[str, ...]], ...] = ()
    loss_label: str = "cross-entropy"  # the loss plot's y axis
    card_metrics: tuple[str, ...] = ("eval_loss", "train_loss")  # metrics.json keys in the model card's table
    # A reference result on the same split (e.g. a baseline model), where the task has one; each takes
    # metrics.json. The eval plot's reference line (value, label); the report's HTML section (given the
    # fine-tuned model's name); the summary's lines; the model card's table rows.
    reference_line: Callable[[dict], tuple[float, str] | None] = lambda m: None
    reference_html: Callable[[dict, str], str] = lambda m, model: ""
    reference_summary: Callable[[dict], list[str]] = lambda m: []
    reference_card: Callable[[dict], list[str]] = lambda m: []
