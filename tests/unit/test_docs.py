"""The documentation site is checked like code (issue 52): its generated reference equals what the code makes now,
every job spec in it (and in the README) validates, every `kubetune …` command line parses with the real CLI, and
the site builds in MkDocs' strict mode (a broken link or a page left out of the navigation fails it)."""

from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
FENCE = re.compile(r"^```(\w*)\n(.*?)^```", re.S | re.M)


def _blocks(kind: tuple[str, ...]) -> list[tuple[str, str]]:
    """(page, text) of every fenced block of a language in ``kind`` across the docs."""
    out = []
    for page in [ROOT / "README.md", *sorted(DOCS.rglob("*.md"))]:  # the README is documentation too
        for lang, text in FENCE.findall(page.read_text()):
            if lang in kind:
                out.append((str(page.relative_to(ROOT)), text))
    return out


def _reference_module():
    spec = importlib.util.spec_from_file_location("docs_reference", ROOT / "scripts" / "docs_reference.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_generated_reference_is_what_the_code_makes_now():
    for path, text in _reference_module().pages().items():
        assert path.exists(), f"{path}: run python scripts/docs_reference.py --write"
        assert path.read_text() == text, (
            f"{path.relative_to(ROOT)} is stale: run python scripts/docs_reference.py --write"
        )


JOBS = [pytest.param(text, id=f"{page}#{k}") for k, (page, text) in enumerate(_blocks(("yaml",)))]


@pytest.mark.parametrize("text", JOBS)
def test_every_job_spec_in_the_docs_validates(text):
    from kubetune.config import parse_spec

    doc = yaml.safe_load(text)
    if isinstance(doc, dict) and "model" in doc and "output" in doc:  # a job spec (other YAML: manifests, config)
        parse_spec(doc)


def _command_lines() -> list[tuple[str, str]]:
    lines = []
    for page, text in _blocks(("bash", "sh", "console")):
        for line in text.splitlines():
            line = line.strip().removeprefix("$ ")
            if line.startswith("kubetune "):
                # the kubetune part of a shell line: before a comment, a pipe, a redirect or the next command
                lines.append((page, re.split(r" #| \| | > | && | ; ", line)[0].strip()))
    return lines


def _parse(argv: list[str]) -> None:
    sys.path.insert(0, str(ROOT / "scripts"))
    from docs_troubleshooting import parse_cli  # the troubleshooting page's CLI case parses the same way

    parse_cli(argv)


@pytest.mark.parametrize("page, line", [pytest.param(p, ln, id=ln[:60]) for p, ln in _command_lines()])
def test_every_command_line_in_the_docs_parses_with_the_real_cli(page, line):
    _parse(shlex.split(line)[1:])


def test_a_command_line_with_an_unknown_option_does_not_parse():
    """The check above can fail: an option the CLI does not have, and a command it does not have (typer's own click
    raises its usage errors: ``typer._click``, not ``click``)."""
    with pytest.raises(Exception, match="No such option: --epochs"):
        _parse(["run", "job.yaml", "--epochs", "2"])
    with pytest.raises(Exception, match="No such command 'train'"):
        _parse(["train", "job.yaml"])
    _parse(["run", "job.yaml", "--set", "training.epochs=2"])


def test_the_site_builds_in_strict_mode(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "mkdocs",
            "build",
            "--strict",  # not -q: quiet drops the warnings strict mode counts (a broken link then passed)
            "-f",
            str(ROOT / "mkdocs.yml"),
            "-d",
            str(tmp_path),
        ],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )
    assert r.returncode == 0, r.stderr[-3000:]
    assert (tmp_path / "reference" / "spec" / "index.html").exists()
