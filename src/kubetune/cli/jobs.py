"""The job commands on a backend (``backends.base``): `render`, `submit`, `status`, `logs`, `wait`,
`delete`, `runtimes`, `list`; with ``--serve``, `render`, `submit`, `status` and `delete` are about the
KServe InferenceService that serves a finished job's export (``backends.kserve``: its ``manifests`` and ``backend``)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Annotated, Protocol

import typer

from kubetune.cli.common import (
    CtxOpt,
    JobTargetOpt,
    KcOpt,
    NameArg,
    NsOpt,
    SetOpt,
    SpecArg,
    TargetOpt,
    _fail,
    app,
)
from kubetune.errors import KubetuneError

ServeOpt = Annotated[
    bool,
    typer.Option(
        "--serve",
        help="The KServe InferenceService that serves a finished job's export (NAME: the InferenceService's), "
        "instead of the job.",
    ),
]
TuneOpt = Annotated[
    bool,
    typer.Option(
        "--tune",
        help="The Katib Experiment that runs the spec's tune section (NAME: the Experiment's, the job's name), "
        "instead of the job.",
    ),
]


class _Rendered(Protocol):
    """What `kubetune render` prints: a job's, a study's or a serving's objects."""

    def to_yaml(self) -> str:
        """The objects as multi-document YAML."""


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
    serve: Annotated[
        bool,
        typer.Option(
            "--serve",
            help="Instead of the job, the KServe InferenceService that serves its export once it has finished "
            "(and the ServiceAccount that lends KServe the job's storage Secrets); see the spec's serving section.",
        ),
    ] = False,
    tune: Annotated[
        bool,
        typer.Option(
            "--tune",
            help="Instead of the job, the Katib Experiment that runs the spec's tune section on the cluster (its "
            "trials: the job's PyTorchJob, or TrainJob with --target trainjob, with each trial's values).",
        ),
    ] = False,
) -> None:
    """Print the Kubernetes objects for a job spec (multi-document YAML); touches no cluster."""
    from kubetune.backends import base
    from kubetune.backends.kserve import manifests as serving
    from kubetune.backends.kubeflow import checks, manifests
    from kubetune.config import load_spec

    try:
        if target not in base.CLUSTER:
            raise KubetuneError(f"unknown target {target!r}", field="--target", fix=f"use {' or '.join(base.CLUSTER)}")
        _check_namespace(namespace)
        job = load_spec(spec, set_)
        ns = namespace or job.kubernetes.namespace or "default"
        if tune and serve:
            raise KubetuneError("--tune and --serve render different things", field="--tune", fix="give one of them")
        rendered: _Rendered
        if tune:
            rendered = manifests.render_tune(job, ns, target)
        else:
            rendered = serving.render_serve(job, ns) if serve else manifests.render(job, ns, target)
    except KubetuneError as e:
        _fail(e)
    if tune:
        warnings = manifests.tune_warnings(job, ns) + checks.warnings_for(job)
    else:
        warnings = serving.serve_warnings(job, ns) if serve else checks.warnings_for(job)
    for warning in warnings:
        typer.echo(f"warning: {warning}", err=True)
    text = rendered.to_yaml()
    if output:
        from kubetune.artifacts import write_atomic

        write_atomic(output, text)
    else:
        typer.echo(text, nl=False)


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


def _serve_backend(namespace, context, kubeconfig, target=None):
    """The serving backend (KServe InferenceServices) with these connection options; a --target
    with --serve is refused: it picks a job's kind."""
    from kubetune.backends import base

    if target is not None:
        raise KubetuneError(
            "--target picks a job's kind and means nothing with --serve", field="--target", fix="drop it"
        )
    _check_namespace(namespace)
    return base.serving(namespace=namespace, kubeconfig=kubeconfig, context=context)


def _tune_backend(namespace, context, kubeconfig, target=None, serve=False):
    """The tuning backend (Katib Experiments) with these connection options; --serve with it is refused, and a
    --target (which picks the trials' kind at submit) too where ``target`` is given here."""
    from kubetune.backends import base

    if serve:
        raise KubetuneError("--tune and --serve are about different objects", field="--tune", fix="give one of them")
    if target is not None:
        raise KubetuneError(
            "--target picks the trials' kind at submit and means nothing here with --tune",
            field="--target",
            fix="drop it",
        )
    _check_namespace(namespace)
    return base.tuning(namespace=namespace, kubeconfig=kubeconfig, context=context)


def _cluster_target(target: str) -> str:
    from kubetune.backends import base

    if target not in base.CLUSTER:
        raise KubetuneError(f"unknown target {target!r}", field="--target", fix=f"use {' or '.join(base.CLUSTER)}")
    return target


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
    replace: Annotated[
        bool, typer.Option(help="Delete an existing job (with --serve: InferenceService) of the same name first.")
    ] = False,
    namespace: NsOpt = None,
    context: CtxOpt = None,
    kubeconfig: KcOpt = None,
    target: TargetOpt = "pytorchjob",
    serve: ServeOpt = False,
    tune: TuneOpt = False,
) -> None:
    """Create the job on Kubernetes (a PyTorchJob, or a TrainJob) and print its name; with --serve, the
    KServe InferenceService that serves its export (and the ServiceAccount naming the job's storage Secrets);
    with --tune, the Katib Experiment of the spec's tune section (its trials: the job with each trial's values)."""
    import functools

    from kubetune.backends.kserve import manifests as serving
    from kubetune.backends.kubeflow import checks, manifests
    from kubetune.config import load_spec

    try:
        job = load_spec(spec, set_)
        ns = namespace or job.kubernetes.namespace
        if serve and tune:
            raise KubetuneError("--tune and --serve submit different things", field="--tune", fix="give one of them")
        if tune:
            backend = _tune_backend(ns, context, kubeconfig)
            warnings = manifests.tune_warnings(job, backend.namespace) + checks.warnings_for(job)
            create = functools.partial(backend.submit, target=_cluster_target(target))
        elif serve:
            backend = _serve_backend(ns, context, kubeconfig)
            warnings = serving.serve_warnings(job, backend.namespace)
            create = backend.submit
        else:
            backend = _backend(ns, context, kubeconfig, target)
            warnings = checks.warnings_for(job)
            create = backend.submit
        for warning in warnings:
            typer.echo(f"warning: {warning}", err=True)
        name = create(job, replace=replace)
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
    serve: ServeOpt = False,
    tune: TuneOpt = False,
) -> None:
    """Phase, progress (step, loss, ETA, the last evaluation), and why the job failed (with its last log lines).

    NAME is a `kubetune run` on this machine if one of that name ran here (unless --namespace,
    --context, --kubeconfig or a cluster --target is given), else the job on the cluster. With --serve,
    NAME is an InferenceService: whether it is Ready, its URLs and its predictor's replicas. With --tune,
    NAME is a Katib Experiment: its trials by state and the best trial so far (a local study: `kubetune tune
    SPEC --status`)."""
    import dataclasses

    try:
        if tune:
            st = _tune_backend(namespace, context, kubeconfig, target, serve).status(name)
        elif serve:
            st = _serve_backend(namespace, context, kubeconfig, target).status(name)
        else:
            st = _job_backend(name, namespace, context, kubeconfig, target, here=True).status(name)
    except KubetuneError as e:
        _fail(e)
    if as_json:
        typer.echo(json.dumps(dataclasses.asdict(st), indent=2))
        return
    if serve:
        _print_serve_status(st)
        return
    if tune:
        _print_tune_status(st)
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


def _print_serve_status(st) -> None:
    typer.echo(f"{st.kind} {st.name} in {st.namespace}: {st.phase}")
    for label, value in (("url", st.url), ("address", st.address)):
        if value:
            typer.echo(f"  {label}: {value}")
    if st.replicas:
        typer.echo("  predictor: " + ", ".join(f"{k} {v}" for k, v in st.replicas.items()))
    if st.model:
        typer.echo(f"  model: {st.model}")
    if st.reason or st.message:
        typer.echo(f"  reason: {st.reason or 'unknown'}" + (f": {st.message}" if st.message else ""))
    if st.job:
        typer.echo(f"  serves: the export of job {st.job}")


def _print_tune_status(st) -> None:
    done = sum(v for k, v in st.trials.items() if k not in ("trials", "pending", "running"))
    typer.echo(f"{st.kind} {st.name} in {st.namespace}: {st.phase}, {done} of {st.max_trials or '?'} trials done")
    counts = {k: v for k, v in st.trials.items() if k != "trials"}
    if counts:
        typer.echo("  trials: " + ", ".join(f"{k} {v}" for k, v in counts.items()))
    if st.running:
        typer.echo("  running: " + ", ".join(st.running))
    if st.best_trial:
        metric = st.best_metrics.get(st.objective or "", {}).get("latest")
        typer.echo(f"  best: {st.best_trial}" + (f", {st.objective} {metric}" if metric is not None else ""))
        for path, value in st.best_values.items():
            typer.echo(f"    {path} = {value}")
        if st.best_output:
            typer.echo(f"  its output: {st.best_output}")
    if st.reason or st.message:
        typer.echo(f"  reason: {st.reason or 'unknown'}" + (f": {st.message}" if st.message else ""))


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
    # not done: a running TrainJob's phase is Created (Trainer v2 has no Running condition)
    if p.get("step") is not None and not st.done:
        line = format_line(p).replace("eta=", "ETA ")
        if p.get("percent") is not None:  # a TrainJob's status.trainerStatus
            line += f" ({p['percent']}% done)"
        typer.echo(
            f"  progress: {line}" + (f" ({duration(time.time() - p['updated'])} ago)" if p.get("updated") else "")
        )
    ev = p.get("last_eval")
    if ev:
        shown = " ".join(f"{k} {v:.4f}" for k, v in ev.items() if k != "step" and isinstance(v, float))
        typer.echo(f"  last evaluation (step {ev['step']}): {shown}")
    harness = p.get("lm_eval")
    if harness:
        shown = ", ".join(f"{k} {v:.4f}" for k, v in harness.items() if k != "step" and isinstance(v, float))
        typer.echo(f"  lm-evaluation-harness (step {harness['step']}): {shown}")
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
    serve: ServeOpt = False,
    tune: TuneOpt = False,
) -> None:
    """Delete the job, its ConfigMap and TensorBoard; its workspace claim (the output) only with --delete-storage.

    With --serve: the InferenceService NAME and the ServiceAccount kubetune made for it (never a Secret,
    nor anything kubetune did not make). With --tune: the Katib Experiment NAME (Katib removes its trials'
    jobs) and its ConfigMap; the trials' workspace claim only with --delete-storage."""
    try:
        if serve and delete_storage:
            raise KubetuneError(
                "--delete-storage removes a job's workspace claim; an InferenceService has none",
                field="--delete-storage",
                fix="drop it, or delete the job without --serve",
            )
        if tune:
            notes = _tune_backend(namespace, context, kubeconfig, target, serve).delete(name, storage=delete_storage)
        elif serve:
            notes = _serve_backend(namespace, context, kubeconfig, target).delete(name)
        else:
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
        done = f" {j['progress']}%" if j.get("progress") is not None else ""  # a TrainJob's trainerStatus
        typer.echo(f"{j['name']:<40} {j['phase']:<12} {j.get('problem') or j['created'] or ''}{done}")
