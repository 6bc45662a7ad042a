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


def _lost(name: str) -> list[str]:
    """The source texts of ``kubetune NAME --help`` whose words do not appear, in order, on the page;
    and the page itself when it holds an empty code span or empty brackets (a placeholder eaten)."""
    page = _render(name)
    rendered = " " + " ".join(WORD.findall(page)) + " "
    lost = [t for t in _source_texts(_commands()[name]) if f" {' '.join(WORD.findall(t))} " not in rendered]
    return lost + ([page] if "``" in page or "[]" in page or "()" in page else [])


@pytest.mark.parametrize("name", sorted(_commands()))
def test_help_shows_every_word_of_the_source_text(name):
    assert _lost(name) == [], f"`kubetune {name} --help` lost words of these texts: {_lost(name)}"


def test_the_help_check_catches_a_dropped_placeholder(monkeypatch):
    """Rendered as Rich markup (typer's default, and what the CLI used before), `[node N]` and
    `[rank R]` are eaten: the check above fails on that page."""
    monkeypatch.setattr(app, "rich_markup_mode", "rich")
    lost = _lost("logs")
    assert any("[node N]" in text for text in lost) and any("``" in text for text in lost), lost
