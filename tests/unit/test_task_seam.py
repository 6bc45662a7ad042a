"""The task seam: nothing outside ``kubetune/tasks/`` names a task or branches on a task's data
model; what a task is comes from the registry (entry points of ``kubetune.tasks``)."""

from __future__ import annotations

import ast
from pathlib import Path

from kubetune.config.tasks import entries

SRC = Path(__file__).resolve().parents[2] / "src" / "kubetune"


def _strings(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Constant) and isinstance(node.value, str):
            yield node.lineno, node.value


def test_no_module_outside_tasks_names_a_task():
    names = list(entries())
    data_models = {entry.data.__name__ for entry in entries().values()}
    data_models |= {entry.section.__name__ for entry in entries().values() if entry.section is not None}
    found = []
    for path in sorted(SRC.rglob("*.py")):
        if (SRC / "tasks") in path.parents:
            continue
        rel = path.relative_to(SRC.parent)
        for line, text in _strings(path):
            words = set(text.replace("`", " ").replace("'", " ").replace('"', " ").replace(",", " ").split())
            found += [f"{rel}:{line}: {name!r} in {text[:60]!r}" for name in names if name in words or text == name]
        tree = ast.parse(path.read_text(encoding="utf-8"))
        found += [
            f"{rel}:{node.lineno}: names {node.id if isinstance(node, ast.Name) else node.attr}"
            for node in ast.walk(tree)
            if (isinstance(node, ast.Name) and node.id in data_models)
            or (isinstance(node, ast.Attribute) and (node.attr in data_models or node.attr in names))
        ]
    assert found == [], "\n".join(found)
