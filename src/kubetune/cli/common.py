"""What the command modules share: the app, the options several commands take, the one-line
user error, the interruption."""

from __future__ import annotations

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


class Interrupted(BaseException):
    """Ctrl-C (SIGINT) in the command line process. Not a KeyboardInterrupt: click swallows those
    and exits 130 without a word."""
