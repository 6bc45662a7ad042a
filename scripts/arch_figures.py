"""The architecture's figures (issue notes): files and lines, import cycles and imports that point up (the
layer table of tests/unit/test_layers.py), the longest functions, the largest modules, and the lines outside
tasks/ that name a task or a model kind.

    python scripts/arch_figures.py [SRC]     # default: src/kubetune of this checkout
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests" / "unit"))

import test_layers  # noqa: E402  (the layer table and the import graph the tests check)

# A task's name, its package, or the closed model-kind split of inference (issue 47).
TASK_WORDS = re.compile(
    r"(?i:causal[-_]lm|\bdpo\b|\bgrpo\b|sequence[-_]classification|tasks\.classify|text-generation"
    r"|text-classification|completions\.jsonl|ForCausalLM)"
    r"|\bGENERATOR\b|\bCLASSIFIER\b|(?<![.\w])Generator\b|(?<![.\w])Classifier\b"
)


def _docstring_lines(tree: ast.AST) -> set[int]:
    lines = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            lines |= set(range(node.lineno, node.end_lineno + 1))
    return lines


def functions(src: Path) -> list[tuple[int, str]]:
    found = []
    for path in src.rglob("*.py"):
        tree = ast.parse(path.read_text())
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                found.append((node.end_lineno - node.lineno + 1, f"{path.relative_to(src)}:{node.name}"))
    return sorted(found, reverse=True)


def task_mentions(src: Path) -> list[str]:
    hits = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        if rel.parts[0] == "tasks":
            continue
        text = path.read_text()
        skip = _docstring_lines(ast.parse(text))
        for number, line in enumerate(text.splitlines(), 1):
            code = line.split("  #")[0]
            if number not in skip and not code.lstrip().startswith("#") and TASK_WORDS.search(code):
                hits.append(f"{rel}:{number}: {line.strip()[:110]}")
    return hits


def main() -> None:
    src = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT / "src" / "kubetune"
    test_layers.SRC = src
    files = sorted(src.rglob("*.py"))
    sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(src))) for p in files), reverse=True)
    graph = test_layers.import_graph()
    up = [(m, d) for m, deps in graph.items() for d in deps if test_layers.layer(d) > test_layers.layer(m)]
    funcs = functions(src)
    mentions = task_mentions(src)
    print(f"files: {len(files)} ({sum(n for n, _ in sizes)} lines), folders: {len({p.parent for p in files})}")
    print(f"import cycles: {len(test_layers.cycles(graph))}; imports that point up: {len(up)}")
    print(
        f"functions over 100 lines: {sum(n > 100 for n, _ in funcs)}; modules over 600 lines: "
        f"{sum(n > 600 for n, _ in sizes)}"
    )
    print("10 longest functions:", ", ".join(f"{name} {n}" for n, name in funcs[:10]))
    print("10 largest modules:", ", ".join(f"{name} {n}" for n, name in sizes[:10]))
    print(
        f"lines outside tasks/ naming a task or a model kind: {len(mentions)} in "
        f"{len({m.split(':')[0] for m in mentions})} files"
    )
    for m in mentions:
        print("  ", m)


if __name__ == "__main__":
    main()
