"""Size is a smell: no function or method in src/kubetune over 100 lines (``def`` to its last line), no
module over 600. Read from the source (ast), so nested functions and code no test runs count too; where the
code is long because it is a table, write it as a table (data), not as branches."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "kubetune"
MAX_FUNCTION_LINES = 100
MAX_MODULE_LINES = 600


def _modules() -> list[tuple[str, str]]:
    return [(str(path.relative_to(SRC)), path.read_text()) for path in sorted(SRC.rglob("*.py"))]


def test_no_function_over_100_lines():
    long = [
        f"{name}:{node.name} ({node.end_lineno - node.lineno + 1} lines, line {node.lineno})"
        for name, text in _modules()
        for node in ast.walk(ast.parse(text))
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
        and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES
    ]
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split them into named steps): {'; '.join(long)}"


def test_no_module_over_600_lines():
    large = [
        f"{name} ({len(text.splitlines())} lines)"
        for name, text in _modules()
        if len(text.splitlines()) > MAX_MODULE_LINES
    ]
    assert not large, f"modules over {MAX_MODULE_LINES} lines (split them by what they hold): {'; '.join(large)}"
