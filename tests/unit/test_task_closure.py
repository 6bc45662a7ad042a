"""Tasks are closed: no module under ``kubetune/tasks/`` uses another task package's private (``_``) names.
What several tasks share lives in one public module, ``kubetune.tasks.common``; a task may use another
task's public names (DPO's export is the causal-LM task's), never a ``_name`` of it, by import or as an
attribute of a module imported from it."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "kubetune"


def _private(name: str) -> bool:
    return name.startswith("_") and not name.startswith("__")


def _dotted(node: ast.AST) -> str | None:
    """``a.b.c`` of a chain of attributes on a name, else None."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    return ".".join([node.id, *reversed(parts)]) if isinstance(node, ast.Name) else None


def violations(root: Path, package: str = "kubetune.tasks") -> list[str]:
    """Every use, in a module under ``root`` (the package ``package``), of a task package's private name
    from outside that task package; a task package is a directory of ``root`` with an ``__init__.py``."""
    tasks = {p.name for p in root.iterdir() if (p / "__init__.py").is_file()}

    def task_of(module: str) -> str | None:
        rest = module.removeprefix(package + ".") if module.startswith(package + ".") else None
        return rest.split(".")[0] if rest and rest.split(".")[0] in tasks else None

    def is_module(module: str) -> bool:
        path = root.joinpath(*module.removeprefix(package + ".").split("."))
        return path.with_suffix(".py").is_file() or (path / "__init__.py").is_file()

    found = []
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root)
        own = rel.parts[0] if len(rel.parts) > 1 and rel.parts[0] in tasks else None
        here = ".".join([package, *rel.with_suffix("").parts[:-1]])  # the package this module is in
        if path.name == "__init__.py":
            here = ".".join([package, *rel.parts[:-1]])
        tree = ast.parse(path.read_text(encoding="utf-8"))
        modules: dict[str, str] = {}  # a local name bound to a module of another task -> that task

        def flag(line: int, what: str) -> None:
            found.append(f"{package.replace('.', '/')}/{rel.as_posix()}:{line}: {what}")

        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                base = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                module = node.module if not node.level else ".".join(filter(None, [base, node.module]))
                for alias in node.names:
                    full = f"{module}.{alias.name}"
                    other = task_of(full) if is_module(full) else task_of(module)
                    if other is None or other == own:
                        continue
                    if _private(alias.name):
                        flag(node.lineno, f"imports {alias.name} from {module} (task {other})")
                    elif is_module(full):
                        modules[alias.asname or alias.name] = other
            elif isinstance(node, ast.Import):
                for alias in node.names:
                    other = task_of(alias.name)
                    if other is not None and other != own and alias.asname:
                        modules[alias.asname] = other
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _private(node.attr)):
                continue
            dotted = _dotted(node.value)
            if dotted is None:
                continue
            root_name = dotted.split(".")[0]
            other = modules.get(root_name) or (task_of(dotted) if dotted.startswith(package + ".") else None)
            if other is not None and other != own:
                flag(node.lineno, f"uses {dotted}.{node.attr} (task {other})")
    return found


def test_no_task_uses_another_tasks_private_names():
    found = violations(SRC / "tasks")
    assert found == [], "\n".join(found)


def test_the_check_sees_each_way_of_reaching_a_private_name(tmp_path):
    root = tmp_path / "tasks"
    for name, text in {
        "a/__init__.py": "",
        "a/data.py": "def _p(): ...\ndef p(): ...\n",
        "a/task.py": "from kubetune.tasks.a.data import _p\nfrom . import data\ndata._p()\n",  # its own: fine
        "b/__init__.py": "",
        "b/ok.py": "from kubetune.tasks.a.data import p\nfrom kubetune.tasks.a import data\ndata.p()\ndata.__name__\n",
        "b/bad.py": (
            "from kubetune.tasks.a.data import _p\n"
            "from kubetune.tasks.a import data as d\n"
            "d._p()\n"
            "from kubetune.tasks import a\n"
            "a.data._p()\n"
            "import kubetune.tasks.a.data\n"
            "kubetune.tasks.a.data._p()\n"
            "from ..a.data import _p\n"
        ),
        "common.py": "from kubetune.tasks.a.data import _p\n",  # shared modules may not either
    }.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    assert [v.split(": ", 1)[0] for v in violations(root)] == [
        "kubetune/tasks/b/bad.py:1",
        "kubetune/tasks/b/bad.py:8",
        "kubetune/tasks/b/bad.py:3",
        "kubetune/tasks/b/bad.py:5",
        "kubetune/tasks/b/bad.py:7",
        "kubetune/tasks/common.py:1",
    ]
