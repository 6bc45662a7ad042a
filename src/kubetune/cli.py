"""The ``kubetune`` command line."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Annotated

import typer

from kubetune.errors import USER_ERROR_EXIT, KubetuneError, SpecError

app = typer.Typer(
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode="markdown",
    help="Distributed fine-tuning of transformer models from one YAML job spec.",
)

# What pods, the launcher and the tests run: listed apart from the user's commands in --help.
INTERNAL = "Internal (what pods and the launcher run)"


def _version(value: bool) -> None:
    if value:
        from kubetune.version import __version__

        typer.echo(f"kubetune {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """Distributed fine-tuning of transformer models from one YAML job spec."""


SetOpt = Annotated[
    list[str] | None,
    typer.Option("--set", help="Override a spec value: KEY=VALUE with a dotted key (repeatable).", metavar="KEY=VALUE"),
]
SpecArg = Annotated[Path, typer.Argument(help="Job spec (YAML).", metavar="SPEC")]


def _fail(err: KubetuneError) -> None:
    lines = err.lines() if isinstance(err, SpecError) else [str(err)]
    for line in lines:
        typer.echo(f"error: {line}", err=True)
    raise typer.Exit(USER_ERROR_EXIT)


@app.command()
def validate(spec: SpecArg, set_: SetOpt = None) -> None:
    """Check a job spec: prints `ok`, or every problem (one per line) and exits 2."""
    from kubetune.config import load_spec

    try:
        job = load_spec(spec, set_)
        if not job.resources.gpu:  # no GPU pods either: the job can only run on a machine like this one
            _check_this_machine(job)
    except KubetuneError as e:
        _fail(e)
    typer.echo("ok")


def _check_this_machine(job) -> None:
    """Refuse what needs a CUDA GPU (QLoRA, FSDP CPU offload) on a machine without one, before any
    worker starts (they failed 20 s into start-up)."""
    needs = []
    if job.lora and job.lora.quantization:
        needs.append(("lora.quantization", f"{job.lora.quantization} quantization (QLoRA)"))
    if job.distributed.fsdp.cpu_offload:
        needs.append(("distributed.fsdp.cpu_offload", "FSDP CPU offload (it moves GPU state to the host)"))
    if not needs:
        return
    import torch

    if not torch.cuda.is_available():
        field, what = needs[0]
        raise KubetuneError(
            f"{what} needs a CUDA GPU and this machine has none",
            field=field,
            fix=f"remove {field}, or run on a GPU machine / GPU nodes (resources.gpu)",
        )


@app.command()
def explain(
    section: Annotated[
        str | None, typer.Argument(help="A section or key, e.g. training, data or lora.r; default: every field.")
    ] = None,
) -> None:
    """Print the spec's fields (every one, or a section's) with type, default and help text."""
    from kubetune.config.load import field_reference

    rows = [r for r in field_reference() if section is None or r[0] == section or r[0].startswith(f"{section}.")]
    if not rows:
        sections = sorted({r[0].split(".")[0] for r in field_reference()})
        _fail(
            KubetuneError(f"no spec key or section {section!r}", field="section", fix=f"one of: {', '.join(sections)}")
        )
    for key, type_, default, help_ in rows:
        typer.echo(f"{key:<28} {type_:<22} {default:<14} {help_}")


@app.command()
def init(
    task: Annotated[str, typer.Argument(help="The task: `kubetune explain task` lists them.")],
    out: Annotated[Path, typer.Option("--output", "-o", help="Where to write the spec.")] = Path("job.yaml"),
) -> None:
    """Write a commented starter job spec for TASK (job.yaml), never over an existing file."""
    from importlib.resources import files

    from kubetune.config.schema import DATA_SPECS

    if task not in DATA_SPECS:
        _fail(KubetuneError(f"no task {task!r}", field="task", fix=f"one of: {', '.join(DATA_SPECS)}"))
    if out.exists() or out.is_symlink():
        _fail(KubetuneError(f"{out} already exists", field="--output", fix="pass another path with --output"))
    text = (files("kubetune") / "assets" / "starters" / f"{task}.yaml").read_text(encoding="utf-8")
    try:
        with out.open("x", encoding="utf-8") as f:  # "x": never replaces a file that appeared meanwhile
            f.write(text)
    except OSError as e:
        _fail(KubetuneError(f"cannot write {out}: {e.strerror}", field="--output", fix="pass a writable path"))
    typer.echo(f"wrote {out}: check it with `kubetune validate {out}`, run it with `kubetune run {out}`")


@app.command()
def schema(
    out: Annotated[Path | None, typer.Option("--output", "-o", help="Write to this file instead of stdout.")] = None,
) -> None:
    """Write the job spec's JSON Schema, for editors: put `# yaml-language-server: $schema=PATH`
    at the top of job.yaml."""
    from kubetune.config.load import json_schema
    from kubetune.paths import write_atomic

    text = json.dumps(json_schema(), indent=1) + "\n"
    if out is None:
        typer.echo(text, nl=False)
    else:
        try:
            write_atomic(out, text)
        except OSError as e:  # a directory, a path under a file, /proc, a read-only place
            under = next((p for p in out.parents if p.exists() and not p.is_dir()), None)
            why = f"{under} is not a directory" if under else e.strerror or str(e)
            _fail(
                KubetuneError(
                    f"cannot write {out}: {why}", field="--output", fix="give a file path in a writable directory"
                )
            )
        typer.echo(f"wrote {out}")


@app.command()
def run(
    spec: SpecArg,
    set_: SetOpt = None,
    preflight: Annotated[bool, typer.Option(help="Check model and data before starting workers.")] = True,
    resume: Annotated[bool, typer.Option(help="Continue from the newest complete checkpoint under output.uri.")] = True,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help=(
                "Write into a non-empty output that kubetune did not create, or replace a finished run there once "
                "this one finishes (only kubetune's own files are replaced)."
            ),
        ),
    ] = False,
    local_addr: Annotated[
        str | None, typer.Option("--local-addr", help="Multi-node: this node's address as the other nodes reach it.")
    ] = None,
) -> None:
    """Run the job on this machine: nodes × procs_per_node workers under torch elastic.

    Exit codes: 0 done; 1 a worker crashed; 2 bad input; 143 stopped by SIGTERM/SIGINT after a
    checkpoint (run the same command again to resume)."""
    import time

    from kubetune.backends import base
    from kubetune.config import load_spec
    from kubetune.config.load import resolve_data_paths
    from kubetune.launch import Stopped, WorkerFailed

    started = time.time()
    job = record = None
    backend = base.get("local")  # `kubetune run` is the local backend's run, in the foreground
    try:
        job = load_spec(
            spec,
            [
                *(set_ or []),
                *([] if resume else ["training.resume=never"]),
                *(["output.overwrite=true"] if overwrite else []),
            ],
        )
        job = resolve_data_paths(job, spec.parent)  # relative data paths: next to the spec file
        record = backend.record_run(job)  # what `kubetune status NAME` reads from another shell
        if preflight and _preflight(job) == "done":
            return
        backend.run(job, local_addr=local_addr)
    except KubetuneError as e:
        _fail(e)
    except Interrupted:
        # Ctrl-C before the workers started (reading the spec, checking model and data); once they
        # run, the elastic launcher takes the signal and the workers stop at a step boundary.
        typer.echo(
            (
                f"interrupted before training started; nothing was written{_where(job)} — run the same command again "
                "to start"
            ),
            err=True,
        )
        raise typer.Exit(130) from None
    except WorkerFailed as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(1) from None
    except Stopped as e:
        typer.echo(f"stopped: {e} — {_after_stop(job, started)}", err=True)
        raise typer.Exit(143) from None
    finally:
        if record is not None:
            ended = sys.exc_info()[1]
            code = 0 if ended is None else ended.exit_code if isinstance(ended, typer.Exit) else 1
            backend.end_run(record, code)


def _where(job) -> str:
    return f" to {job.output.uri}" if job is not None else ""


def _after_stop(job, started: float) -> str:
    """What a user can do after a stop signal, from the state the output is in now."""
    from kubetune.artifacts.output import Output

    try:
        state = Output.for_spec(job).state_after_stop(started)
    except Exception:  # the stop message must not fail on a broken output
        return "run the same command again to resume"
    return {
        "finished": f"the run had already finished: its artifacts in {job.output.uri} are complete",
        "checkpoint": "run the same command again to resume from the last checkpoint",
        "nothing": "no checkpoint was written yet, so running the same command again starts over",
    }[state]


def _preflight(job) -> str:
    """Fail fast, before any worker starts, on a bad model path, data or output; returns what the
    run will do with its output (``done``: this job already finished there)."""
    from kubetune import artifacts, providers, tasks

    _check_this_machine(job)
    if job.tracking.mlflow:  # the tracking server is up and takes the credentials (one line if not)
        from kubetune.training import tracking

        tracking.connect(job)
    artifacts.resolve_model(job)
    tasks.get(job.task).load_frames(job.data, job.training.seed, providers.S3Settings.from_spec(job))
    from kubetune.artifacts.output import Output

    plan = Output.for_spec(job).check(job)
    if plan.action == "done":
        typer.echo(f"output {job.output.uri}: {plan.detail}", err=True)
    return plan.action


@app.command(rich_help_panel=INTERNAL)
def launch(spec: SpecArg) -> None:
    """Run this pod's workers as torchrun would, from the operator's PET_* environment.

    What a Kubernetes pod's main container runs. Exit codes, for restartPolicy
    ExitCode: 0 done; 143 stopped by SIGTERM after a checkpoint; 128+N a worker
    killed by signal N (137: the OOM killer); 200 an infrastructure failure (a
    lost peer, a timeout): the operator restarts the pod, which resumes from
    the last checkpoint. 1: a user error or a crash, and the job fails."""
    from kubetune.launch import main as launch_main

    raise typer.Exit(launch_main([str(spec)]))


@app.command(rich_help_panel=INTERNAL)
def worker(spec: SpecArg) -> None:
    """Run one worker process (what torchrun starts in each pod; reads RANK, WORLD_SIZE, ...)."""
    from kubetune.worker import main as worker_main

    worker_main([str(spec)])


@app.command()
def predict(
    model: Annotated[
        str, typer.Argument(help="Exported model: a job's output (directory, s3://, hf://) or its model/ directory.")
    ],
    texts: Annotated[list[str] | None, typer.Argument(help="Texts to classify, or prompts for a causal LM.")] = None,
    file: Annotated[Path | None, typer.Option("--file", "-f", help="Read texts from a file, one per line.")] = None,
    as_json: Annotated[
        bool,
        typer.Option(
            "--json",
            help="Print a JSON list of {text, label, score} (classifiers) or {prompt, completion} (causal LMs).",
        ),
    ] = False,
    endpoint_url: Annotated[
        str | None, typer.Option("--endpoint-url", help="S3 endpoint for s3:// models (MinIO).")
    ] = None,
    # None = not given: a classifier refuses these options rather than ignoring them
    max_new_tokens: Annotated[
        int | None,
        typer.Option("--max-new-tokens", min=1, help="Causal LMs: tokens to generate per prompt (default 64)."),
    ] = None,
    temperature: Annotated[
        float | None,
        typer.Option("--temperature", min=0.0, help="Causal LMs: sampling temperature; 0 = greedy (the default)."),
    ] = None,
    chat: Annotated[
        bool | None,
        typer.Option(
            "--chat/--no-chat",
            help="Causal LMs: wrap each prompt as a user turn in the model's chat template (default: when it has one).",
        ),
    ] = None,
    seed: Annotated[int | None, typer.Option("--seed", help="Causal LMs: seed for sampling (default 0).")] = None,
) -> None:
    """Classify texts or generate text with an exported model (a directory, s3:// artifact or hf:// repo)."""
    from kubetune.predict import model_path, read_texts
    from kubetune.providers import S3Settings

    s3 = S3Settings(endpoint_url=endpoint_url)
    items = list(texts or [])
    given = {"max_new_tokens": max_new_tokens, "temperature": temperature, "chat": chat, "seed": seed}
    given = {name: value for name, value in given.items() if value is not None}
    try:
        _check_texts(items)
        if file is not None:
            items += read_texts(file)
        if not items:
            raise KubetuneError("no texts given", field="TEXTS", fix="pass texts as arguments or --file texts.txt")
        local = model_path(model, s3)  # s3:// and hf:// artifacts are downloaded and checked once
        task = _predicting_task(local)
        _check_predict_options(task, given, model)
        results = task.predict(str(local), items, given, lambda line: typer.echo(f"warning: {line}", err=True))
    except KubetuneError as e:
        _fail(e)
    if as_json:
        typer.echo(json.dumps(results, ensure_ascii=False, indent=2))
    else:
        for r in results:
            typer.echo(task.show(r))


def _check_texts(items: list[str]) -> None:
    for number, text in enumerate(items, 1):
        which = "the text argument" if len(items) == 1 else f"text argument {number} of {len(items)}"
        if not text.strip():
            raise KubetuneError(
                f"{which} is empty", field="TEXTS", fix="pass the text itself, or drop the empty argument"
            )
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:  # bytes the shell passed that are not UTF-8 arrive as lone surrogates
            raise KubetuneError(
                f"{which} is not UTF-8 (byte 0x{ord(text[e.start]) & 0xFF:02x} at character {e.start})",
                field="TEXTS",
                fix="pass UTF-8 text (check the terminal's encoding)",
            ) from None


def _predicting_task(local: Path):
    """The task that predicts with the model in ``local``: the task of the job that exported it, else
    the first registered task whose models are of its kind (the pipeline that serves it)."""
    from kubetune import tasks
    from kubetune.predict import model_kind, run_task

    name = run_task(local)
    if name in tasks.names() and tasks.get(name).predict is not None:
        return tasks.get(name)
    kind = model_kind(local)
    return next(t for t in map(tasks.get, tasks.names()) if t.predict is not None and t.present.pipeline_tag == kind)


def _check_predict_options(task, given: dict, model: str) -> None:
    """Refuse the options the model's task does not take, naming the kind of model that does."""
    from kubetune import tasks
    from kubetune.predict import NOUNS

    refused = [name for name in given if name not in task.predict_options]
    if not refused:
        return
    flags = [f"--{n.replace('_', '-')}" if n != "chat" or given[n] else "--no-chat" for n in refused]
    takers = {t.present.pipeline_tag for t in map(tasks.get, tasks.names()) if refused[0] in t.predict_options}
    raise KubetuneError(
        f"{'applies' if len(flags) == 1 else 'apply'} to {' and '.join(NOUNS[k] + 's' for k in sorted(takers))} "
        f"only, and {model} is a {NOUNS[task.present.pipeline_tag]}",
        field=", ".join(flags),
        fix=f"drop {' and '.join(flags)}",
    )


@app.command(rich_help_panel=INTERNAL)
def fetch(
    spec: SpecArg,
    dest: Annotated[Path, typer.Option("--dest", help="Directory to stage into (a pod's workspace).")],
    set_: SetOpt = None,
) -> None:
    """Stage a job's model and data into DEST (the init container's command); idempotent."""
    import logging

    from kubetune.config import load_spec
    from kubetune.stage import stage

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s", datefmt="%H:%M:%S")
    try:
        staged = stage(load_spec(spec, set_), dest)
    except KubetuneError as e:
        _fail(e)
    typer.echo(str(staged))


@app.command()
def render(
    spec: SpecArg,
    set_: SetOpt = None,
    target: Annotated[
        str, typer.Option(help="pytorchjob (Kubeflow Training Operator v1) or trainjob (Kubeflow Trainer v2).")
    ] = "pytorchjob",
    namespace: Annotated[
        str | None, typer.Option("--namespace", "-n", help="Namespace; default: kubernetes.namespace, else 'default'.")
    ] = None,
    output: Annotated[
        Path | None, typer.Option("--output", "-o", help="Write the YAML here instead of stdout.")
    ] = None,
) -> None:
    """Print the Kubernetes objects for a job spec (multi-document YAML); touches no cluster."""
    from kubetune.backends import base, manifests
    from kubetune.config import load_spec

    try:
        if target not in base.CLUSTER:
            raise KubetuneError(f"unknown target {target!r}", field="--target", fix=f"use {' or '.join(base.CLUSTER)}")
        _check_namespace(namespace)
        job = load_spec(spec, set_)
        rendered = manifests.render(job, namespace or job.kubernetes.namespace or "default", target)
    except KubetuneError as e:
        _fail(e)
    for warning in manifests.warnings_for(job):
        typer.echo(f"warning: {warning}", err=True)
    text = rendered.to_yaml()
    if output:
        from kubetune.artifacts import write_atomic

        write_atomic(output, text)
    else:
        typer.echo(text, nl=False)


NameArg = Annotated[str, typer.Argument(help="Job name.")]
NsOpt = Annotated[
    str | None,
    typer.Option("--namespace", "-n", help="Namespace; default: the kubeconfig context's (in a pod: its own)."),
]
CtxOpt = Annotated[str | None, typer.Option("--context", help="kubeconfig context.")]
KcOpt = Annotated[
    str | None, typer.Option("--kubeconfig", help="kubeconfig file; default $KUBECONFIG or ~/.kube/config.")
]
TargetOpt = Annotated[str, typer.Option("--target", help="pytorchjob (Training Operator v1) or trainjob (Trainer v2).")]
# After submit the kind is found on the cluster: --target only disambiguates.
JobTargetOpt = Annotated[
    str | None,
    typer.Option("--target", help="pytorchjob or trainjob; default: the kind of the job of that name on the cluster."),
]


def _check_namespace(namespace: str | None) -> None:
    from kubetune.config.cluster import namespace_problem

    problem = namespace_problem(namespace) if namespace is not None else None
    if problem:
        raise KubetuneError(problem, field="--namespace", fix="pass a valid namespace, e.g. -n kubeflow")


def _backend(namespace, context, kubeconfig, target, here=False):
    """The backend registered as ``target`` as this command line reaches it: a cluster backend with
    these connection options; ``here``: also a backend on this machine, over the runs recorded there
    (a `kubetune run` is driven from its own terminal, so submit, logs, wait and delete refuse it)."""
    from kubetune.backends import base

    if here and target in base.REGISTRY and target not in base.CLUSTER:
        return base.reach(target)
    _check_namespace(namespace)
    if target not in base.CLUSTER:
        raise KubetuneError(f"unknown target {target!r}", field="--target", fix=f"use {' or '.join(base.CLUSTER)}")
    return base.reach(target, namespace=namespace, kubeconfig=kubeconfig, context=context)


def _job_backend(name, namespace, context, kubeconfig, target, here=False):
    """The backend of the job called ``name``: ``target``'s; without one, (``here``) a `kubetune run`
    of that name recorded on this machine unless a cluster option is given, else the cluster backend
    of the job's kind as found on the cluster."""
    from kubetune.backends import base

    if target is not None:
        return _backend(namespace, context, kubeconfig, target, here)
    found = base.recorded(name) if here and not (namespace or context or kubeconfig) else None
    if found is not None:
        return found
    _check_namespace(namespace)
    return base.of_job(name, namespace=namespace, kubeconfig=kubeconfig, context=context)


@app.command()
def submit(
    spec: SpecArg,
    set_: SetOpt = None,
    replace: Annotated[bool, typer.Option(help="Delete an existing job of the same name first.")] = False,
    namespace: NsOpt = None,
    context: CtxOpt = None,
    kubeconfig: KcOpt = None,
    target: TargetOpt = "pytorchjob",
) -> None:
    """Create the job on Kubernetes (a PyTorchJob, or a TrainJob) and print its name."""
    from kubetune.backends import manifests
    from kubetune.config import load_spec

    try:
        job = load_spec(spec, set_)
        backend = _backend(namespace or job.kubernetes.namespace, context, kubeconfig, target)
        for warning in manifests.warnings_for(job):
            typer.echo(f"warning: {warning}", err=True)
        name = backend.submit(job, replace=replace)
    except KubetuneError as e:
        _fail(e)
    typer.echo(name)


@app.command()
def status(
    name: NameArg,
    namespace: NsOpt = None,
    context: CtxOpt = None,
    kubeconfig: KcOpt = None,
    target: Annotated[
        str | None,
        typer.Option("--target", help="local, pytorchjob or trainjob; default: see above."),
    ] = None,
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """Phase, progress (step, loss, ETA, the last evaluation), and why the job failed (with its last log lines).

    NAME is a `kubetune run` on this machine if one of that name ran here (unless --namespace,
    --context, --kubeconfig or a cluster --target is given), else the job on the cluster."""
    import dataclasses

    try:
        st = _job_backend(name, namespace, context, kubeconfig, target, here=True).status(name)
    except KubetuneError as e:
        _fail(e)
    if as_json:
        typer.echo(json.dumps(dataclasses.asdict(st), indent=2))
        return
    if st.kind == "LocalRun":
        _print_local_status(st)
        return
    typer.echo(f"{st.kind} {st.name} in {st.namespace}: {st.phase}")
    for rtype, counts in st.replicas.items():
        typer.echo(f"  {rtype}: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    typer.echo(f"  pods: {len(st.pods)}, restarts: {st.restarts}")
    if st.reason:
        typer.echo(
            f"  reason: {st.reason}"
            + (f" on {st.failed_pod}" if st.failed_pod else "")
            + (f": {st.message}" if st.message else "")
        )
    if st.log_tail:
        typer.echo("  last log lines:")
        for line in st.log_tail:
            typer.echo(f"    {line}")
    _print_progress(st)
    if st.output:
        typer.echo(f"  output: {st.output}")


def _print_local_status(st) -> None:
    typer.echo(f"local run {st.name}: {st.phase}")
    if st.reason:
        typer.echo(f"  reason: {st.reason}" + (f": {st.message}" if st.message else ""))
    _print_progress(st)
    if st.output:
        typer.echo(f"  output: {st.output}")


def _print_progress(st) -> None:
    """The progress lines of `status`: step/total, loss, ETA, the last evaluation; after success, the
    headline metrics."""
    import time

    from kubetune.training.loggers import duration, format_line

    p = st.progress or {}
    if p.get("step") is not None and st.phase == "Running":
        line = format_line(p).replace("eta=", "ETA ")
        typer.echo(
            f"  progress: {line}" + (f" ({duration(time.time() - p['updated'])} ago)" if p.get("updated") else "")
        )
    ev = p.get("last_eval")
    if ev:
        shown = " ".join(f"{k} {v:.4f}" for k, v in ev.items() if k != "step" and isinstance(v, float))
        typer.echo(f"  last evaluation (step {ev['step']}): {shown}")
    if st.phase == "Succeeded":
        # the task's headline: what the finished run recorded as such (progress.json, the `done:` line)
        # beside the eval and train loss; without that record, every eval metric
        headline = p.get("metrics") or {}
        metrics = {**headline, **(st.metrics or {})}
        names = tuple(headline) or tuple(k for k in metrics if k.startswith("eval_"))
        shown = " ".join(
            f"{k} {metrics[k]:.4f}"
            for k in dict.fromkeys(("eval_loss", *names, "train_loss"))
            if isinstance(metrics.get(k), float)
        )
        if shown:
            typer.echo(f"  metrics: {shown}")


@app.command()
def logs(
    name: NameArg,
    follow: Annotated[bool, typer.Option("--follow", "-f", help="Stream new lines until the pods finish.")] = False,
    node: Annotated[int | None, typer.Option("--node", help="Node rank of the pod to read (0 = master).")] = None,
    rank: Annotated[
        int | None, typer.Option("--rank", help="The pod of process rank N (as in the `[rank N]` of its lines).")
    ] = None,
    all_: Annotated[bool, typer.Option("--all", help="All pods, merged, each line prefixed with its node.")] = False,
    tail: Annotated[int | None, typer.Option("--tail", help="Only the last N lines of each pod.")] = None,
    namespace: NsOpt = None,
    context: CtxOpt = None,
    kubeconfig: KcOpt = None,
    target: JobTargetOpt = None,
) -> None:
    """Print the job's logs (the master's by default), prefixed `[node N]` with --all.

    Each line from a worker process carries its process rank, `[rank R]`: --rank R picks the pod
    that runs it (node R // procs_per_node), --node N the pod of node rank N."""
    try:
        backend = _job_backend(name, namespace, context, kubeconfig, target)
        if rank is not None:
            if node is not None:
                raise KubetuneError("pass --rank or --node, not both", field="--rank", fix="drop one of them")
            spec = backend.spec_of(name)
            node = rank // (spec.distributed.procs_per_node if spec is not None else 1)
        for line in backend.logs(name, follow=follow, rank=node, all_ranks=all_, tail=tail):
            typer.echo(line)
    except KubetuneError as e:
        _fail(e)


@app.command()
def wait(
    name: NameArg,
    timeout: Annotated[float | None, typer.Option(help="Give up after this many seconds (exit 3).")] = None,
    namespace: NsOpt = None,
    context: CtxOpt = None,
    kubeconfig: KcOpt = None,
    target: JobTargetOpt = None,
) -> None:
    """Wait for the job to finish: exit 0 on Succeeded, 1 on Failed (with the reason), 3 on timeout."""
    from kubetune.backends.status import WaitTimeout

    try:
        st = _job_backend(name, namespace, context, kubeconfig, target).wait(name, timeout)
    except WaitTimeout as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(3) from None
    except KubetuneError as e:
        _fail(e)
    if st.phase == "Succeeded":
        typer.echo(f"{st.name}: Succeeded" + (f"; output: {st.output}" if st.output else ""))
        return
    reason = st.reason or "unknown reason"
    typer.echo(
        f"error: {st.kind} {st.name} failed: {reason}"
        + (f" on {st.failed_pod}" if st.failed_pod else "")
        + (f": {st.message}" if st.message else ""),
        err=True,
    )
    for line in st.log_tail:
        typer.echo(f"  {line}", err=True)
    raise typer.Exit(1)


@app.command()
def delete(
    name: NameArg,
    namespace: NsOpt = None,
    context: CtxOpt = None,
    kubeconfig: KcOpt = None,
    target: JobTargetOpt = None,
    delete_storage: Annotated[
        bool,
        typer.Option(
            "--delete-storage",
            help="Also delete the workspace claim kubetune created for the job (its output and checkpoints).",
        ),
    ] = False,
) -> None:
    """Delete the job, its ConfigMap and TensorBoard; its workspace claim (the output) only with --delete-storage."""
    try:
        notes = _job_backend(name, namespace, context, kubeconfig, target).delete(name, storage=delete_storage)
    except KubetuneError as e:
        _fail(e)
    typer.echo(f"deleted {name}")
    for note in notes:
        typer.echo(note)


@app.command()
def runtimes(namespace: NsOpt = None, context: CtxOpt = None, kubeconfig: KcOpt = None) -> None:
    """List the cluster's Trainer v2 ClusterTrainingRuntimes (for kubernetes.runtime, --target trainjob)."""
    try:
        items = _backend(namespace, context, kubeconfig, "trainjob").runtimes()
    except KubetuneError as e:
        _fail(e)
    for r in items:
        typer.echo(f"{r['name']:<40} {r['framework']}")


@app.command("list")
def list_jobs(
    namespace: NsOpt = None,
    context: CtxOpt = None,
    kubeconfig: KcOpt = None,
    target: Annotated[
        str,
        typer.Option(
            "--target", help="pytorchjob, trainjob, or local (every `kubetune run` recorded on this machine)."
        ),
    ] = "pytorchjob",
    as_json: Annotated[bool, typer.Option("--json", help="Print JSON.")] = False,
) -> None:
    """List kubetune jobs in the namespace; `--target local`: every `kubetune run` recorded on this machine."""
    try:
        jobs = _backend(namespace, context, kubeconfig, target, here=True).list()
    except KubetuneError as e:
        _fail(e)
    if as_json:
        typer.echo(json.dumps(jobs, indent=2, default=str))
        return
    for j in jobs:
        typer.echo(f"{j['name']:<40} {j['phase']:<12} {j.get('problem') or j['created'] or ''}")


@app.command()
def pull(
    uri: Annotated[str, typer.Argument(help="Artifact: s3://BUCKET/PREFIX (a job's output.uri) or hf://ORG/REPO.")],
    dest: Annotated[Path, typer.Argument(help="Local directory: new, empty, or an earlier pull's.")],
    endpoint_url: Annotated[
        str | None,
        typer.Option("--endpoint-url", help="S3 endpoint (MinIO); default $S3_ENDPOINT_URL / $AWS_ENDPOINT_URL."),
    ] = None,
    overwrite: Annotated[
        bool,
        typer.Option(
            "--overwrite",
            help=(
                "Pull into a non-empty directory that kubetune did not write (files of the artifact replace "
                "same-named ones)."
            ),
        ),
    ] = False,
) -> None:
    """Download an exported artifact and verify it against its manifest (sizes and sha256)."""
    from kubetune.artifacts import output
    from kubetune.predict import pull as do_pull
    from kubetune.providers import S3Settings

    s3 = S3Settings(endpoint_url=endpoint_url)
    try:
        output.check_pull_dest(dest, overwrite)
        path = do_pull(uri, dest, s3)
        output.mark_pulled(dest, uri)
    except KubetuneError as e:
        _fail(e)
    except OSError as e:
        _fail(
            KubetuneError(f"cannot write to {dest}: {e.strerror or e}", field="DEST", fix="choose a writable directory")
        )
    typer.echo(str(path))


@app.command("seed-hf-cache", rich_help_panel=INTERNAL)
def seed_hf_cache() -> None:
    """Put the packaged all-MiniLM-L6-v2 into the Hugging Face cache (for offline hf:// use)."""
    from kubetune.providers.hf import SEED_REPO_ID, seed_cache

    try:
        path = seed_cache()
    except KubetuneError as e:
        _fail(e)
    typer.echo(f"hf://{SEED_REPO_ID} -> {path}")


class Interrupted(BaseException):
    """Ctrl-C (SIGINT) in the command line process. Not a KeyboardInterrupt: click swallows those
    and exits 130 without a word."""


def _interrupt(signum, frame):
    raise Interrupted()


def main() -> None:
    import signal

    ex = _click_exceptions()
    signal.signal(signal.SIGINT, _interrupt)
    try:
        # Not standalone: click would print a usage error as a multi-line box; here it is one line.
        code = app(standalone_mode=False, prog_name="kubetune")
    except SystemExit as e:
        code = e.code
        if not isinstance(code, int) and code is not None:  # sys.exit("message"): Python prints it, exit 1
            print(code, file=sys.stderr)
    except (Interrupted, KeyboardInterrupt):
        typer.echo("error: interrupted (Ctrl-C)", err=True)
        code = 130
    except ex.NoArgsIsHelpError as e:
        typer.echo(e.ctx.get_help())
        code = USER_ERROR_EXIT
    except ex.UsageError as e:
        where = e.ctx.command_path if e.ctx is not None else "kubetune"
        typer.echo(f"error: {' '.join(e.format_message().split())} — see `{where} --help`", err=True)
        code = USER_ERROR_EXIT
    except ex.ClickException as e:  # e.g. a file argument that cannot be opened
        typer.echo(f"error: {' '.join(e.format_message().split())}", err=True)
        code = e.exit_code
    except typer.Abort:
        typer.echo("error: aborted", err=True)
        code = 1
    _leave(code if isinstance(code, int) else 0 if code is None else 1)


def _leave(code: int) -> None:
    """Exit with ``code``; once torch is imported (run, predict, launch), without the interpreter's
    finalization. Why: tearing down torch's and the other libraries' modules took 0.43 s at the end
    of every such command here, and frees nothing the system does not. Everything a command writes
    is closed when it returns; the atexit handlers (logging's flush, temporary directories'
    finalizers) still run, and the standard streams are flushed."""
    if "torch" not in sys.modules:
        sys.exit(code)
    import atexit

    from kubetune.errors import exit_now

    atexit._run_exitfuncs()
    exit_now(code)


def _click_exceptions():
    """Where the running typer keeps click's exception classes: recent releases vendor click as
    ``typer._click``; older ones use click itself."""
    try:
        from typer._click import exceptions
    except ImportError:
        from click import exceptions
    return exceptions


if __name__ == "__main__":
    main()
