"""``kubetune eval``: lm-evaluation-harness tasks on an exported causal LM, in this process or over N."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated

import typer

from kubetune.cli.common import _fail, app
from kubetune.errors import KubetuneError


@app.command(name="eval")
def evaluate_command(
    model: Annotated[
        str,
        typer.Argument(help="Exported causal LM: a job's output (directory, s3://, hf://) or its model/ directory."),
    ],
    tasks: Annotated[
        str,
        typer.Option("--tasks", "-t", help="lm-evaluation-harness task names, comma-separated (e.g. arc_easy,gsm8k)."),
    ],
    include_path: Annotated[
        str | None,
        typer.Option(
            "--include-path",
            help="A directory of the harness's task YAML (local or private suites), or an s3:// prefix.",
        ),
    ] = None,
    num_fewshot: Annotated[
        int | None, typer.Option("--num-fewshot", min=0, help="Few-shot examples per prompt.")
    ] = None,
    limit: Annotated[
        float | None, typer.Option("--limit", min=0, help="Examples per task (a count, or a fraction below 1).")
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Requests per forward pass.")] = 1,
    chat: Annotated[
        bool, typer.Option("--chat/--no-chat", help="Apply the model's chat template (default: not).")
    ] = False,
    procs: Annotated[int, typer.Option("--procs", min=1, help="Processes; each scores its share (one GPU each).")] = 1,
    seed: Annotated[int, typer.Option("--seed", help="The harness's seeds (sampling, few-shot choice).")] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the harness's results as JSON.")] = False,
    log_samples: Annotated[
        bool, typer.Option("--log-samples", help="With --output: each example's prompt, answers and scores too.")
    ] = False,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Also write the results (JSON) to this file.")
    ] = None,
    adapter: Annotated[
        bool,
        typer.Option("--adapter", help="A LoRA export: score its base model plus adapter/ (unmerged), not model/."),
    ] = False,
    endpoint_url: Annotated[
        str | None, typer.Option("--endpoint-url", help="S3 endpoint for s3:// models and task directories (MinIO).")
    ] = None,
) -> None:
    """Score an exported causal LM on lm-evaluation-harness tasks (the harness's own scoring)."""
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    params = {
        "model_uri": model,
        "tasks": names,
        "include_path": include_path,
        "num_fewshot": num_fewshot,
        "limit": int(limit) if limit is not None and limit >= 1 else limit,
        "batch_size": batch_size,
        "chat": chat,
        "seed": seed,
        "log_samples": log_samples,
        "adapter": adapter,
    }
    try:
        if not names:
            raise KubetuneError("no task given", field="--tasks", fix="give task names, e.g. --tasks arc_easy")
        if log_samples and output is None:
            raise KubetuneError("--log-samples needs --output", field="--log-samples", fix="add --output FILE.json")
        results = _run(params, procs, endpoint_url)
    except KubetuneError as e:
        _fail(e)
    summary = {"results": results["results"], "n-samples": results.get("n-samples"), "config": params}
    if output is not None:
        tmp = output.with_name(output.name + ".partial")
        written = {**summary, "samples": results["samples"]} if log_samples else summary
        tmp.write_text(json.dumps(written, indent=2, default=str))
        tmp.replace(output)
    if as_json:
        typer.echo(json.dumps(summary, indent=2, default=str))
        return
    for task, metrics in summary["results"].items():
        for key, value in metrics.items():
            name, _, filt = key.partition(",")
            if not filt or name.endswith("_stderr") or not isinstance(value, (int, float)):
                continue
            err = metrics.get(f"{name}_stderr,{filt}")
            shown = f"{task}  {name}" + (f" ({filt})" if filt != "none" else "")
            typer.echo(f"{shown}  {value:.4f}" + (f" ± {err:.4f}" if isinstance(err, (int, float)) else ""))


def _run(params: dict, procs: int, endpoint_url: str | None) -> dict:
    """The harness's results: in this process, or from rank 0 of ``procs`` started as torchrun starts them. What can
    be checked or fetched is, once, here: the tasks, their data, whether they fit the model, the model and an
    s3:// task directory (the ranks get local paths)."""
    from kubetune.evaluation.harness import check_data, check_fit, check_tasks, evaluate, task_manager
    from kubetune.evaluation.suites import stage
    from kubetune.inference import model as M
    from kubetune.providers import S3Settings

    s3 = S3Settings(endpoint_url=endpoint_url)
    params = {**params, "include_path": stage(params["include_path"], s3, field="--include-path")}
    manager = task_manager(params["include_path"], params["tasks"])
    check_tasks(params["tasks"], manager)
    loaded = check_data(params["tasks"], manager, field="--tasks")
    path = M.model_path(params["model_uri"], s3)
    base, adapter_dir = M.adapter_beside(path) if params["adapter"] else (path, None)
    check_fit(
        loaded,
        M.load_tokenizer(adapter_dir or base),
        base,
        num_fewshot=params["num_fewshot"],
        limit=params["limit"],
        chat=params["chat"],
        seed=params["seed"],
    )
    params = {**params, "model_uri": str(path)}  # fetched once, not per rank
    if procs == 1:
        return evaluate(**params, s3=s3)
    import sys
    import tempfile
    import uuid

    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    with tempfile.TemporaryDirectory(prefix="kubetune-eval-") as tmp:
        out = Path(tmp) / "results.json"
        spec = Path(tmp) / "params.json"
        spec.write_text(json.dumps({**params, "out": str(out)}))
        config = LaunchConfig(
            min_nodes=1,
            max_nodes=1,
            nproc_per_node=procs,
            run_id=uuid.uuid4().hex,
            rdzv_backend="c10d",
            rdzv_endpoint="127.0.0.1:0",
            max_restarts=0,
            monitor_interval=0.2,
        )
        try:
            elastic_launch(config, sys.executable)("-m", "kubetune.evaluation.worker", str(spec))
        except ChildFailedError as e:
            code = min(f.exitcode for f in e.failures.values())
            raise KubetuneError(
                f"evaluation failed on {len(e.failures)} of {procs} processes (exit code {code}; the error is above)",
                field="--procs",
            ) from None
        return json.loads(out.read_text())
