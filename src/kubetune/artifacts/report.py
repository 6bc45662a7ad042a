"""report.html: training loss and eval metrics plots (PNG, also embedded), metrics and the spec."""

from __future__ import annotations

import base64
import html
import json
from pathlib import Path

from kubetune.artifacts.presentation import Presentation
from kubetune.config import JobSpec, dump_spec
from kubetune.paths import write_atomic

# The bookkeeping fields of a history record (``training.loggers``): not metrics.
HISTORY_CONTEXT = ("type", "step", "epoch", "samples", "tokens", "train_s", "eval_s")


def _read_history(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot(history: list[dict], out: Path, present: Presentation, metrics: dict | None = None) -> list[Path]:
    """Write plots/train_loss.png, plots/eval_metrics.png (the task's eval curves, if any) and one
    PNG per step plot; return their paths. Every plot spans the run from step 0 to its last step, so
    a run that evaluated once shows one labelled point where it stands, not a lone dot on a zoomed axis."""
    # a Figure drawn by Agg directly: pyplot (its backends and figure manager, half a second more of a short run's
    # export) is never needed to write a PNG
    from matplotlib.figure import Figure

    (out / "plots").mkdir(exist_ok=True)
    last = max((h["step"] for h in history), default=1)
    train = [h for h in history if h["type"] == "train"]
    evals = [h for h in history if h["type"] == "eval"]

    def figure(name: str, title: str, curves: list[tuple[str, list, list, str]], ylabel: str = "", style=None) -> Path:
        fig = Figure(figsize=(6.4, 3.6), dpi=100)
        ax = fig.subplots()
        for label, xs, ys, fmt in curves:
            if len(xs) == 1:  # one point: its value and step in the legend
                label = f"{label}: {ys[0]:.4g} at step {xs[0]}"
            if xs:
                ax.plot(xs, ys, fmt, label=label)
        if style:
            style(ax)
        ax.set_xlim(0, last * 1.03)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel(ylabel)
        ax.set_title(title)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:
            ax.legend()
        fig.tight_layout()
        path = out / "plots" / f"{name}.png"
        fig.savefig(path)
        return path

    def steps(records: list[dict], key: str) -> tuple[list, list]:
        points = [(h["step"], h[key]) for h in records if isinstance(h.get(key), (int, float))]
        return [p[0] for p in points], [p[1] for p in points]

    paths = [
        figure(
            "train_loss",
            "Loss",
            [("train loss", *steps(train, "loss"), "-"), ("eval loss", *steps(evals, "eval_loss"), "o-")],
            present.loss_label,
        )
    ]
    if present.eval_curves:
        reference = present.reference_line(metrics or {})

        def style(ax) -> None:
            if present.eval_log_scale:
                ax.set_yscale("log")
            else:
                ax.set_ylim(0, 1)
            if reference is not None:
                ax.axhline(reference[0], color="grey", linestyle="--", label=reference[1])

        # at their step: evaluations within an epoch (eval_every) too
        curves = [(key.removeprefix("eval_"), *steps(evals, key), "o-") for key in present.eval_curves]
        paths.append(figure("eval_metrics", "Evaluation", curves, style=style))
    harness = [h for h in history if h["type"] == "lm_eval"]
    if harness:  # lm-evaluation-harness: a curve per task and metric, from the base model's score at step 0
        names = list(dict.fromkeys(k for h in harness for k in h if k not in HISTORY_CONTEXT))
        values = [h[k] for h in harness for k in names if isinstance(h.get(k), (int, float))]

        def unit(ax) -> None:
            if values and all(0 <= v <= 1 for v in values):
                ax.set_ylim(0, 1)

        curves = [(name, *steps(harness, name), "o-") for name in names]
        paths.append(figure("lm_eval", "lm-evaluation-harness", curves, style=unit))
    for title, keys in present.step_plots:
        curves = [
            (
                key.replace("eval_", "eval ").replace("_", " "),
                *steps(history, key),
                "o-" if key.startswith("eval_") else "-",
            )
            for key in keys
        ]
        paths.append(figure(title.lower().replace(" ", "_"), title, curves))
    return paths


def write_report(spec: JobSpec, metrics: dict, out: Path, present: Presentation, history: Path | None = None) -> Path:
    """Write ``report.html`` (self-contained: the PNGs are embedded as data URIs)."""
    records = _read_history(history or out / "history.jsonl")
    images = plot(records, out, present, metrics)
    head = present.report_rows(metrics)
    rows = [
        *head,
        ("eval loss", metrics.get("eval_loss")),
        ("train loss (last 10% of logs)", metrics.get("train_loss")),
        ("train samples/s", metrics.get("train_samples_per_second")),
        ("train runtime (s)", metrics.get("train_runtime_s")),
        *_phase_rows(metrics.get("phases") or {}),
        ("world size", metrics.get("world_size")),
        ("optimizer steps", metrics.get("global_step")),
        ("train / eval rows", f"{_train_rows(metrics)} / {metrics.get('eval_rows')}"),
        ("dropped rows", metrics.get("dropped_rows") or "none"),
    ]
    table = "".join(f"<tr><th>{html.escape(k)}</th><td>{fmt(v)}</td></tr>" for k, v in rows)
    compare = present.reference_html(metrics, spec.model.uri)
    confusion = _confusion_html(metrics.get("labels") or [], metrics.get("eval_confusion") or [])
    imgs = "".join(
        f'<img alt="{p.stem}" src="data:image/png;base64,{base64.b64encode(p.read_bytes()).decode()}">' for p in images
    )
    page = f"""<!doctype html><html><head><meta charset="utf-8"><title>kubetune report: {html.escape(spec.name)}</title>
<style>body{{font-family:system-ui,sans-serif;max-width:60rem;margin:2rem auto;padding:0 1rem}}\
table{{border-collapse:collapse;margin:1rem 0}}
th,td{{border:1px solid #ccc;padding:.3rem .6rem;text-align:left}}img{{max-width:100%;margin:.5rem 0}}\
pre{{background:#f5f5f5;padding:1rem;overflow:auto}}</style></head>
<body><h1>kubetune report: {html.escape(spec.name)}</h1>
<p>Task {html.escape(spec.task)}, model {html.escape(spec.model.uri)}, \
{"LoRA r=" + str(spec.lora.r) if spec.lora else "full fine-tune"}.</p>
<table>{table}</table>{compare}{_harness_html(metrics, records)}{confusion}<h2>Curves</h2>{imgs}
<h2>Job spec</h2><pre>{html.escape(dump_spec(spec))}</pre></body></html>"""
    path = out / "report.html"
    write_atomic(path, page)
    return path


def harness_scalars(per_task: dict[str, dict[str, float]]) -> dict[str, float]:
    """lm-evaluation-harness's scores (per task, its own metric names: ``acc,none``) as one scalar per task and
    metric for the curves (history.jsonl, TensorBoard, MLflow, status): ``task/acc`` for the unfiltered
    ``acc,none``, ``task/exact_match/strict-match`` for a filter's; no stderr. Slashes, not the harness's
    comma: MLflow refuses a comma in a metric name. ``sample_len`` (the documents scored) is left out."""
    out = {}
    for task, values in per_task.items():
        for key, value in values.items():
            metric, _, filt = key.partition(",")
            if metric.endswith("_stderr") or metric == "sample_len":  # a count, not a score
                continue
            out[f"{task}/{metric}" + (f"/{filt}" if filt and filt != "none" else "")] = value
    return out


def _harness_html(metrics: dict, history: list[dict]) -> str:
    """lm-evaluation-harness's scores after training (metrics.json's ``lm_eval``) against the base model's
    (the step-0 evaluation of ``evaluation.on_start``, from the history), one row per task and metric."""
    scores = metrics.get("lm_eval")
    if not isinstance(scores, dict) or not scores:
        return ""
    final = harness_scalars(scores)
    base = next((h for h in history if h.get("type") == "lm_eval" and h.get("step") == 0), {})
    rows = []
    for name, value in final.items():
        before = base.get(name)
        change = f"{value - before:+.4f}" if isinstance(before, (int, float)) else ""
        rows.append(
            f"<tr><th>{html.escape(name)}</th><td>{fmt(before) if before is not None else ''}</td>"
            f"<td>{fmt(value)}</td><td>{change}</td></tr>"
        )
    version = html.escape(str(metrics.get("lm_eval_harness", "")))
    return (
        f"<h2>lm-evaluation-harness {version}</h2><table><tr><th>task / metric</th><th>base model (step 0)</th>"
        f"<th>after training</th><th>change</th></tr>{''.join(rows)}</table>"
    )


# More classes than this make a table nobody reads (metrics.json keeps the matrix up to 100 classes).
MAX_CONFUSION_TABLE = 30


def _confusion_html(labels: list, cm: list[list[int]]) -> str:
    """The confusion matrix as a table; a one-line note instead when it is absent or too big to read."""
    if not cm:
        return (
            f"<p>{len(labels)} classes: no confusion matrix (kept up to 100 classes).</p>" if len(labels) > 100 else ""
        )
    if len(cm) > MAX_CONFUSION_TABLE:
        return (
            f"<p>{len(cm)} classes: the confusion matrix is in metrics.json (eval_confusion), "
            "too big for a table here.</p>"
        )
    if len(labels) != len(cm):
        labels = list(range(len(cm)))
    head = "".join(f"<th>{html.escape(str(lab))}</th>" for lab in labels)
    body = "".join(
        f"<tr><th>{html.escape(str(labels[i]))}</th>" + "".join(f"<td>{v}</td>" for v in row) + "</tr>"
        for i, row in enumerate(cm)
    )
    return f"<h2>Confusion matrix (rows: true, columns: predicted)</h2><table><tr><th></th>{head}</tr>{body}</table>"


# metrics.json's ``phases`` (``training.events.phases``), as the report names them
PHASE_ROWS = {
    "startup_s": "start-up: process start to model built (s)",
    "data_s": "data: reading, tokenizing, first batch (s)",
    "training_s": "training: first step to last (s)",
    "export_s": "export: last step to artifacts written (s)",
    "total_s": "whole run (s)",
}


def _phase_rows(phases: dict) -> list[tuple[str, object]]:
    return [(label, phases[key]) for key, label in PHASE_ROWS.items() if key in phases]


def fmt(v) -> str:
    if isinstance(v, float):
        return f"{v:.4f}" if abs(v) < 100 else f"{v:.1f}"
    return html.escape(str(v))


def _train_rows(metrics: dict) -> str:
    """A stream's row count is not known (``data.streaming``): its shards and the samples trained say what it was."""
    if metrics.get("train_rows") is None and metrics.get("streamed_shards"):
        return f"streamed from {metrics['streamed_shards']} shards ({metrics.get('train_samples')} samples trained)"
    return str(metrics.get("train_rows"))
