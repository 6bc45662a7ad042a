"""The documentation site's troubleshooting page (issue 52): each family of errors a user meets, with the very line
kubetune prints for a typical case, produced by running the real code on that bad input (offline, in a scratch
directory; its path is written `<dir>`), so the page shows what the code says today. ``scripts/docs_reference.py``
writes it with the reference pages and the docs test fails when it is stale.

Each error is one line naming the field (or option), the value and the fix; the CLI prints it after `error:` and
exits 2. A worker's crash (not the input's fault) is a traceback and exit 1; a stop signal is exit 143."""

from __future__ import annotations

import json
import tempfile
from collections.abc import Callable
from pathlib import Path

TINY = "pkg://kubetune/assets/tiny-llama"
PAIRS = "pkg://kubetune/assets/sentiment/sentiment-preferences.jsonl"


def _spec(d: Path, **over) -> dict:
    spec = {"name": "my-job", "model": {"uri": "hf://sentence-transformers/all-MiniLM-L6-v2"},
            "data": {"train": str(d / "train.csv")}, "output": {"uri": str(d / "out")}}  # fmt: skip
    for key, value in over.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) and key in spec else value
    return spec


def _parse(spec: dict) -> None:
    from kubetune.config import parse_spec

    parse_spec(spec)


def _frames(spec: dict) -> None:
    """The task's data checks, as `kubetune run`'s preflight runs them before any worker starts."""
    from kubetune import tasks
    from kubetune.config import parse_spec

    job = parse_spec(spec)
    tasks.get(job.task).load_frames(job.data, job.training.seed)


def _render(spec: dict) -> None:
    from kubetune.backends.kubeflow import manifests
    from kubetune.config import parse_spec

    manifests.render(parse_spec(spec), "default", "pytorchjob")


def _output(spec: dict) -> None:
    from kubetune.artifacts.output import Output
    from kubetune.config import parse_spec

    job = parse_spec(spec)
    Output.for_spec(job).check(job)


def parse_cli(argv: list[str]) -> None:
    """Parse ``argv`` (after `kubetune`) with the real CLI's click commands, without running anything: an unknown
    command or option, a missing argument or a bad value raises click's usage error (typer's own click's). The docs
    test parses every `kubetune …` line of the docs with it."""
    import typer.main

    from kubetune.cli import app

    cmd, parent, name = typer.main.get_command(app), None, "kubetune"
    while True:
        try:
            ctx = cmd.make_context(name, list(argv), parent=parent, resilient_parsing=False)
        except Exception as e:  # an eager option that ends the program (--version, --help) ends it with code 0
            if type(e).__name__ == "Exit" and getattr(e, "exit_code", 1) == 0:
                return
            raise
        if not hasattr(cmd, "list_commands"):
            return
        name, cmd, argv = cmd.resolve_command(ctx, ctx._protected_args + ctx.args)
        parent = ctx


def _cli(*argv: str) -> Callable[[Path], None]:
    return lambda d: parse_cli(list(argv))


def _no_s3_credentials(d: Path) -> None:
    """Reading a model from s3:// with no credentials anywhere: in a fresh interpreter whose environment has no AWS_*
    variable and whose home has no AWS files, so that nothing this process (or a test before it) configured or
    cached can answer."""
    import os
    import subprocess
    import sys

    from kubetune.errors import KubetuneError

    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")} | {"HOME": str(d)}
    code = (
        "from kubetune import providers\n"
        "from kubetune.providers import S3Settings\n"
        "try:\n"
        "    providers.resolve('s3://models/bert', kind='model', field='model.uri',\n"
        "                      s3=S3Settings(endpoint_url='http://127.0.0.1:9'))\n"
        "except Exception as e:\n"
        "    print(e)\n"
    )
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    raise KubetuneError(r.stdout.strip().splitlines()[-1])


def _write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


# (family, what triggers it, the case: a function of the scratch directory that raises the error)
CASES: list[tuple[str, str, Callable[[Path], None]]] = [
    ("The spec", "a key the spec does not have",
     lambda d: _parse(_spec(d, training={"epoch": 2}))),
    ("The spec", "a value out of range", lambda d: _parse(_spec(d, training={"learning_rate": -1}))),
    ("The spec", "sections that do not go together",
     lambda d: _parse(_spec(d, task="kto", model={"uri": TINY}, data={"train": PAIRS},
                            distributed={"procs_per_node": 2, "strategy": "fsdp"}))),
    ("The CLI", "an option the command does not have", _cli("run", "job.yaml", "--epochs", "2")),
    ("Data", "a column the table does not have",
     lambda d: (_write(d / "train.csv", "review,label\ngood,pos\nbad,neg\n"), _frames(_spec(d)))),
    ("Data", "a label column with one class",
     lambda d: (_write(d / "train.csv", "text,label\ngood,pos\nfine,pos\nnice,pos\n"), _frames(_spec(d)))),
    ("Data", "a desirable flag that is not boolean-like (KTO)",
     lambda d: (_write(d / "kto.jsonl", json.dumps({"prompt": "p", "completion": "c", "label": "maybe"}) + "\n"),
                _frames(_spec(d, task="kto", model={"uri": TINY}, data={"train": str(d / "kto.jsonl")})))),
    ("Data", "a data file that is not there", lambda d: _frames(_spec(d, data={"train": str(d / "nowhere.csv")}))),
    ("Storage and credentials", "a model on s3:// with no credentials", _no_s3_credentials),
    ("Output", "an output directory holding files kubetune did not write",
     lambda d: (_write(d / "out" / "notes.txt", "mine"), _write(d / "train.csv", "text,label\na,x\nb,y\n"),
                _output(_spec(d)))),
    ("Kubernetes", "a path on this machine in a spec for the cluster",
     lambda d: _render(_spec(d, data={"train": "data/train.csv"}))),
]  # fmt: skip


def error_line(case: Callable[[Path], None]) -> str:
    """The line the CLI prints for ``case``'s error (the first, for a spec with several)."""
    from kubetune.errors import KubetuneError, SpecError

    with tempfile.TemporaryDirectory() as tmp:
        d = Path(tmp)
        try:
            case(d)
        except SpecError as e:
            line = e.lines()[0]
        except KubetuneError as e:
            line = str(e)
        except Exception as e:  # the CLI's own usage errors (typer's click)
            if type(e).__name__ not in ("NoSuchOption", "UsageError", "BadParameter"):
                raise
            line = e.format_message()
        else:
            raise AssertionError("the case raised no error")
        return line.replace(tmp, "<dir>")


def page(header: str) -> str:
    out = [header, "# Troubleshooting", "", __doc__.split("\n\n", 1)[1].strip(), "",
           "Each line below is what kubetune printed for the case, produced by running the code on that input "
           "when this page was generated.", ""]  # fmt: skip
    family = None
    for fam, what, case in CASES:
        if fam != family:
            family = fam
            out += ["", f"## {fam}", ""]
        out += [f"**{what[0].upper()}{what[1:]}:**", "", "```text", f"error: {error_line(case)}", "```", ""]
    out += ["", "## Exit codes", "", "| exit | meaning |", "| --- | --- |",
            "| 0 | done |", "| 1 | a worker crashed (its traceback is above the line) |",
            "| 2 | bad input: the line names the field, the value and the fix |",
            "| 143 | stopped by SIGTERM or SIGINT after a checkpoint: run the same command again to resume |",
            ]  # fmt: skip
    return "\n".join(out).replace("\n\n\n", "\n\n").rstrip() + "\n"
