"""The ``kubetune`` command line: ``main``. The app and the options its commands share are in
``common``; the commands in one module per group (``spec``, ``run``, ``predict``, ``jobs``, ``pull``),
registered in the order ``--help`` lists them."""

from __future__ import annotations

import sys

import typer

from kubetune.cli.common import Interrupted, app
from kubetune.errors import USER_ERROR_EXIT


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


# The commands (registered on import, in --help's order).
from kubetune.cli import evaluate, jobs, predict, pull, run, serve, spec, tune  # noqa: E402, F401, I001
