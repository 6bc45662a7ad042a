"""The output seam: ``output.uri`` is parsed in one place, ``artifacts.output.Output`` (and
validated as a field in ``config``); everything else takes the Output object, resolved where a run
or a render starts, and may only show the URI (in a message, a log line, a tag)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "kubetune"
# config: the field's own check (sections.py) and the checks across sections (checks.py)
OWNERS = {SRC / "artifacts" / "output.py", SRC / "config" / "sections.py", SRC / "config" / "checks.py"}
# What taking the URI apart looks like: a method of the string, an index, a comparison, or a
# parser it is handed to.
PARSERS = {"parse_uri", "resolve", "parse", "Path", "urlparse", "urlsplit", "repo_id", "Location", "Output"}


def _parents(tree: ast.AST) -> dict[ast.AST, ast.AST]:
    return {child: node for node in ast.walk(tree) for child in ast.iter_child_nodes(node)}


def _name(func: ast.AST) -> str:
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")


def violations(path: Path, root: Path = SRC) -> list[str]:
    tree = ast.parse(path.read_text(encoding="utf-8"))
    parent = _parents(tree)
    found = []
    for node in ast.walk(tree):
        if (
            isinstance(node, ast.Call)
            and _name(node.func) == "resolve"
            and _name(getattr(node.func, "value", None)) == "Output"
        ):
            found.append(
                f"{path.relative_to(root)}:{node.lineno}: Output.resolve (use the run's Output, or Output.for_spec)"
            )
        if not (isinstance(node, ast.Attribute) and node.attr == "uri" and _name(node.value) == "output"):
            continue
        up = parent.get(node)
        parsed = (
            isinstance(up, (ast.Attribute, ast.Subscript, ast.Compare))
            or (isinstance(up, ast.Call) and _name(up.func) in PARSERS)
            or (isinstance(up, ast.BinOp))
        )
        if parsed:
            found.append(f"{path.relative_to(root)}:{node.lineno}: output.uri taken apart ({type(up).__name__})")
    return sorted(found, key=lambda v: int(v.split(":")[1]))


def test_only_the_output_object_parses_output_uri():
    found = [v for path in sorted(SRC.rglob("*.py")) if path not in OWNERS for v in violations(path)]
    assert found == [], "\n".join(found)


def test_the_check_sees_what_it_must_refuse(tmp_path):
    bad = tmp_path / "bad.py"
    bad.write_text(
        "def f(spec):\n"
        "    a = spec.output.uri.startswith('s3://')\n"
        "    b = parse_uri(spec.output.uri)\n"
        "    c = Output.resolve(spec.output.uri)\n"
        "    d = spec.output.uri.split('://')[1]\n"
        "    e = f'{spec.output.uri}'\n"
        "    log.info('to %s', spec.output.uri)\n"
    )
    assert [v.split(": ", 1)[0] for v in violations(bad, tmp_path)] == [
        "bad.py:2",
        "bad.py:3",
        "bad.py:4",
        "bad.py:4",
        "bad.py:5",
    ]
