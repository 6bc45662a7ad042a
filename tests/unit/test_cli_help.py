"""Every command's --help shows every word of its docstring and of each option's help, in order.

`kubetune logs --help` once printed "prefixed `` with --all": Rich markup took `[node N]` for a
style tag and dropped it. The check is generic: for each command (internal ones included), the
words of the source text must appear, contiguous and in order, in the rendered page."""

from __future__ import annotations

import re

import pytest
import typer.main
from typer.testing import CliRunner

from kubetune.cli import app

WORD = re.compile(r"[A-Za-z0-9_]+")


def _commands() -> dict:
    group = typer.main.get_command(app)
    ctx = group.make_context("kubetune", [], resilient_parsing=True)
    return {"": group} | {name: group.get_command(ctx, name) for name in group.list_commands(ctx)}


def _source_texts(cmd) -> list[str]:
    texts = [(cmd.help or "").partition("\f")[0]]
    texts += [p.help for p in cmd.params if getattr(p, "help", None)]
    return [t for t in texts if t.strip()]


def _render(name: str) -> str:
    args = [name, "--help"] if name else ["--help"]
    result = CliRunner().invoke(app, args, terminal_width=200, env={"COLUMNS": "200"})
    assert result.exit_code == 0, result.output
    return result.stdout


@pytest.mark.parametrize("name", sorted(_commands()))
def test_help_shows_every_word_of_the_source_text(name):
    page = _render(name)
    rendered = " " + " ".join(WORD.findall(page)) + " "
    for text in _source_texts(_commands()[name]):
        words = " ".join(WORD.findall(text))
        assert f" {words} " in rendered, f"`kubetune {name} --help` lost words of: {text!r}\n{page}"
    # an empty code span or empty brackets: a placeholder that the renderer ate
    assert "``" not in page and "[]" not in page and "()" not in page, page


def test_the_help_check_catches_a_dropped_placeholder():
    """The check above fails on the defect it was written for (Rich markup eating `[node N]`)."""
    from rich.text import Text

    source = "prefixed [node N] with --all"
    eaten = Text.from_markup(source).plain
    assert " ".join(WORD.findall(source)) not in " ".join(WORD.findall(eaten))
    assert "node N" in _render("logs")
