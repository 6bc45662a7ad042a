"""``kubetune eval``: lm-evaluation-harness tasks on an exported causal LM, in this process or over N."""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Annotated

import typer

from kubetune.cli.common import Interrupted, _fail, app
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
        int | None, typer.Option("--num-fewshot", help="Few-shot examples per prompt (0 to 1000).")
    ] = None,
    limit: Annotated[
        float | None, typer.Option("--limit", help="Examples per task (a count, or a fraction below 1).")
    ] = None,
    batch_size: Annotated[int, typer.Option("--batch-size", help="Requests per forward pass (1 to 4096).")] = 1,
    chat: Annotated[
        bool, typer.Option("--chat/--no-chat", help="Apply the model's chat template (default: not).")
    ] = False,
    procs: Annotated[
        int,
        typer.Option("--procs", min=1, help="Processes; each scores its share (one GPU each, else one core each)."),
    ] = 1,
    seed: Annotated[
        int, typer.Option("--seed", min=0, max=2**32 - 1, help="The harness's seeds (sampling, few-shot choice).")
    ] = 0,
    as_json: Annotated[bool, typer.Option("--json", help="Print the harness's results as JSON.")] = False,
    log_samples: Annotated[
        bool, typer.Option("--log-samples", help="With --output: each example's prompt, answers and scores too.")
    ] = False,
    output: Annotated[
        Path | None,
        typer.Option(
            "--output", "-o", help="Also write the results (JSON) to this file (replaced; its folder is checked first)."
        ),
    ] = None,
    adapter: Annotated[
        bool,
        typer.Option("--adapter", help="A LoRA export: score its base model plus adapter/ (unmerged), not model/."),
    ] = False,
    endpoint_url: Annotated[
        str | None, typer.Option("--endpoint-url", help="S3 endpoint for s3:// models and task directories (MinIO).")
    ] = None,
) -> None:
    """Score an exported causal LM on lm-evaluation-harness tasks (the harness's own scoring).

    Exit codes: 0 done; 2 bad input; 143 stopped by SIGTERM (nothing written)."""
    names = [t.strip() for t in tasks.split(",") if t.strip()]
    params = {
        "model_uri": model,
        "tasks": names,
        "include_path": include_path,
        "num_fewshot": num_fewshot,
        "limit": limit,
        "batch_size": batch_size,
        "chat": chat,
        "seed": seed,
        "log_samples": log_samples,
        "adapter": adapter,
    }
    saved = signal.signal(signal.SIGTERM, _stop)
    try:
        _evaluate(params, procs, endpoint_url, output, as_json)
    except _Stopped as e:
        typer.echo(
            f"stopped by {signal.Signals(e.signum).name} before the evaluation finished; nothing was written — "
            "run the same command again",
            err=True,
        )
        raise typer.Exit(128 + e.signum) from None
    finally:
        signal.signal(signal.SIGTERM, saved)


def _evaluate(params: dict, procs: int, endpoint_url: str | None, output: Path | None, as_json: bool) -> None:
    """Check, score, show, write; a folder made for the results is removed again if nothing is written there."""
    created = None
    try:
        params = _checked(params, procs, output)
        created = _make_folder(output) if output is not None else None
        results = _run(params, procs, endpoint_url)
        summary = {"results": results["results"], "n-samples": results.get("n-samples"), "config": params}
        _show(summary, as_json)  # first: a file that cannot be written then still leaves the scores on the screen
        if output is not None:
            _write(output, {**summary, "samples": results["samples"]} if params["log_samples"] else summary)
    except KubetuneError as e:
        _remove_empty(created)
        _fail(e)
    except BaseException:  # a stop, Ctrl-C, a crash
        _remove_empty(created)
        raise


def _write(output: Path, written: dict) -> None:
    """The results into ``output``, atomically (a temporary sibling renamed over it: never half a file, nothing
    left beside it if the write fails)."""
    from kubetune.paths import write_atomic

    try:
        write_atomic(output, json.dumps(written, indent=2, default=str))
    except OSError as e:
        raise KubetuneError(
            f"cannot write the results to {output} ({e.strerror or type(e).__name__}); the scores are above",
            field="--output",
            fix="free space there or give another path, and run again for the file",
        ) from None


class _Stopped(BaseException):
    """SIGTERM in ``kubetune eval``: the evaluation is given up at once (a pod's grace period is 30 s, an
    evaluation can take hours). A BaseException, so that the harness's ``except Exception`` lets it through."""

    def __init__(self, signum: int):
        super().__init__(signum)
        self.signum = signum


def _stop(signum, frame):
    raise _Stopped(signum)


def _show(summary: dict, as_json: bool) -> None:
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


def _checked(params: dict, procs: int, output: Path | None) -> dict:
    """``params`` checked before anything is loaded: the settings against the spec's ``evaluation`` bounds (one
    model for both), the processes against this machine, the output's path; the limit as the harness takes it.

    Raises:
        KubetuneError: the first problem, naming its option.
    """
    from pydantic import ValidationError

    from kubetune.config.schema import EvaluationSpec

    if not params["tasks"]:
        raise KubetuneError("no task given", field="--tasks", fix="give task names, e.g. --tasks arc_easy")
    if params["log_samples"] and output is None:
        raise KubetuneError("--log-samples needs --output", field="--log-samples", fix="add --output FILE.json")
    settings = {k: params[k] for k in ("tasks", "num_fewshot", "limit", "batch_size")}
    try:
        EvaluationSpec.model_validate(settings)
    except ValidationError as e:
        error = e.errors()[0]
        key = str(error["loc"][0])
        option = "--tasks" if key == "tasks" else f"--{key.replace('_', '-')}"
        value = params[key] if key != "tasks" else error.get("input")
        msg = error["msg"]
        raise KubetuneError(
            f"got {value!r}; {msg[:1].lower()}{msg[1:]}", field=option, fix=_SETTING_FIXES.get(key, "")
        ) from None
    _check_procs(procs)
    if output is not None:
        _check_output(output)
    limit = params["limit"]
    return {**params, "limit": int(limit) if limit is not None and limit >= 1 else limit}


# What to give instead, per setting (the bounds are EvaluationSpec's; pydantic's message says which was crossed).
_SETTING_FIXES = {
    "tasks": "give the harness's task names, each at most 200 characters",
    "limit": "give a count of documents (1 to 1e9) or a fraction (between 0 and 1)",
    "num_fewshot": "give 0 to 1000 few-shot examples",
    "batch_size": "give 1 to 4096 requests per forward",
}


def _check_procs(procs: int) -> None:
    """As ``kubetune tune`` bounds its trials at once (``tune.parallel``): a process per GPU where there are
    GPUs (each rank takes its own), else at most one per core (each rank holds the model: ~0.5 GB for the
    tiny one)."""
    from kubetune.tune.devices import check_processes

    if procs > 1:
        check_processes(procs, f"{procs} processes", "--procs", lambda have: f"set --procs to at most {have}")


def _check_output(output: Path) -> None:
    """Where the results go, checked before anything is scored (so that hours of scoring are not lost to a
    typo): a new file or a regular file to replace, in a folder that exists and takes a file, or in a missing
    folder whose parent exists (``_make_folder`` makes it).

    Raises:
        KubetuneError: a directory, a FIFO or device, a folder that is a file or is missing with its parent, or a
            folder this process cannot write in.
    """
    import tempfile

    from kubetune.paths import check_regular

    field = "--output"
    if output.is_dir():
        raise KubetuneError(
            f"{output} is a directory, and --output names the results file",
            field=field,
            fix=f"give a file path, e.g. --output {output / 'results.json'}",
        )
    if output.exists():  # the results replace a regular file; a FIFO or a device (/dev/null) is refused
        check_regular(output, field=field, fix="give the path of a new file, or of a results file to replace")
    folder = output.parent
    if not folder.is_dir():
        if folder.exists() or folder.is_symlink():
            raise KubetuneError(f"{folder} is not a directory", field=field, fix="give a path in a directory")
        if not folder.parent.is_dir():
            raise KubetuneError(
                f"the folder {folder} does not exist, nor its parent {folder.parent}",
                field=field,
                fix=f"create it first (mkdir -p {folder}), or fix the path",
            )
        folder = folder.parent  # made before scoring (_make_folder): whether it can be is asked of its parent
    try:
        with tempfile.NamedTemporaryFile(dir=folder, prefix=f".{output.name}-", suffix=".probe"):
            pass
    except OSError as e:
        raise KubetuneError(
            f"cannot write in {folder} ({e.strerror or type(e).__name__})",
            field=field,
            fix="give a path in a folder you can write",
        ) from None


def _make_folder(output: Path) -> Path | None:
    """The output's missing folder made (``_check_output`` allowed one level); returns it, None if it was there."""
    if output.parent.is_dir():
        return None
    try:
        output.parent.mkdir()
    except OSError as e:
        raise KubetuneError(
            f"cannot create the folder {output.parent} ({e.strerror or type(e).__name__})",
            field="--output",
            fix="create it first, or give a path in a folder you can write",
        ) from None
    return output.parent


def _remove_empty(folder: Path | None) -> None:
    if folder is not None:
        try:
            folder.rmdir()  # only if still empty: never what someone else put there meanwhile
        except OSError:
            pass


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
        results = evaluate(**params, s3=s3)
        assert results is not None  # rank 0 of 1 answers the results
        return results
    import tempfile
    import uuid

    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    from kubetune.backends.local.launcher import launch, single_node_config

    with tempfile.TemporaryDirectory(prefix="kubetune-eval-") as tmp:
        out = Path(tmp) / "results.json"
        spec = Path(tmp) / "params.json"
        spec.write_text(json.dumps({**params, "out": str(out)}))
        config = single_node_config(procs, run_id=uuid.uuid4().hex, monitor_interval=0.2)
        try:  # the ranks die with this process, however it ends (``launch``)
            launch(config, ("-m", "kubetune.evaluation.worker", str(spec)))
        except SignalException as e:  # the launcher's handler took the signal, and stopped the ranks
            if e.sigval == signal.SIGINT:
                raise Interrupted() from None
            raise _Stopped(int(e.sigval)) from None
        except ChildFailedError as e:
            code = min(f.exitcode for f in e.failures.values())
            raise KubetuneError(
                f"evaluation failed on {len(e.failures)} of {procs} processes (exit code {code}; the error is above)",
                field="--procs",
            ) from None
        return json.loads(out.read_text())
