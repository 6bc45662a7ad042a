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

# A task's name or package, or a task's own artifact file.
TASK_WORDS = re.compile(
    r"(?i:\bcausal[-_]lm\b|\bdpo\b|\bgrpo\b|sequence[-_]classification|tasks\.classify|completions\.jsonl)"
)
# The closed model-kind split inference had (issue 47): kind constants, pipeline tags, the engines' classes,
# architectures tested by name. The inference modules of one model family (what a task picks) are not counted.
KIND_WORDS = re.compile(
    r"(?i:text-generation|text-classification|ForCausalLM|ForSequenceClassification|CAUSAL_LM_MAPPING"
    r"|SEQUENCE_CLASSIFICATION_MAPPING)|\bGENERATOR\b|\bCLASSIFIER\b|(?<![.\w])Generator\b(?!\[)|(?<![.\w])Classifier\b"
)
FAMILY_MODULES = ("inference/causal.py", "inference/classifier.py", "inference/kinds.py", "inference/families/")
# typing's Generator (a generator function's return type) is not the causal-LM engine
TYPING_IMPORT = re.compile(r"^\s*from (collections\.abc|typing) import ")


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


def task_mentions(src: Path, words: re.Pattern, skip: tuple[str, ...] = ()) -> list[str]:
    hits = []
    for path in sorted(src.rglob("*.py")):
        rel = path.relative_to(src)
        if rel.parts[0] == "tasks" or any(str(rel) == k or (k.endswith("/") and str(rel).startswith(k)) for k in skip):
            continue
        text = path.read_text()
        doc = _docstring_lines(ast.parse(text))
        for number, line in enumerate(text.splitlines(), 1):
            code = line.split("  #")[0]
            typing_line = TYPING_IMPORT.match(code) is not None
            if number not in doc and not code.lstrip().startswith("#") and not typing_line and words.search(code):
                hits.append(f"{rel}:{number}: {line.strip()[:110]}")
    return hits


def main() -> None:
    src = Path(sys.argv[1]).resolve() if len(sys.argv) > 1 else ROOT / "src" / "kubetune"
    # the layer table and the import graph of that checkout's own tests/unit/test_layers.py
    sys.path.insert(0, str(src.parents[1] / "tests" / "unit"))
    import test_layers

    test_layers.SRC = src
    files = sorted(src.rglob("*.py"))
    sizes = sorted(((len(p.read_text().splitlines()), str(p.relative_to(src))) for p in files), reverse=True)
    graph = test_layers.import_graph()
    up = [(m, d) for m, deps in graph.items() for d in deps if test_layers.layer(d) > test_layers.layer(m)]
    funcs = functions(src)
    mentions = task_mentions(src, TASK_WORDS, FAMILY_MODULES)
    kinds = task_mentions(src, KIND_WORDS, FAMILY_MODULES)
    print(f"files: {len(files)} ({sum(n for n, _ in sizes)} lines), folders: {len({p.parent for p in files})}")
    print(f"import cycles: {len(test_layers.cycles(graph))}; imports that point up: {len(up)}")
    packages = {p.parent.name for p in (src / "tasks").glob("*/__init__.py")}

    def task_package(module: str) -> str | None:
        parts = module.split(".")
        return parts[2] if len(parts) > 2 and parts[1] == "tasks" and parts[2] in packages else None

    across = [
        (m, d)
        for m, deps in graph.items()
        for d in deps
        if task_package(m) and task_package(d) not in (None, task_package(m))
    ]
    print(f"imports from one task package into another: {len(across)} in {len({m for m, _ in across})} modules")
    print(f"modules within 60 lines of the 600 cap (over 540): {sum(n > 540 for n, _ in sizes)}")
    print(
        f"functions over 100 lines: {sum(n > 100 for n, _ in funcs)}; modules over 600 lines: "
        f"{sum(n > 600 for n, _ in sizes)}"
    )
    print("10 longest functions:", ", ".join(f"{name} {n}" for n, name in funcs[:10]))
    print("10 largest modules:", ", ".join(f"{name} {n}" for n, name in sizes[:10]))
    for title, found in (("naming a task", mentions), ("naming a model kind (family modules aside)", kinds)):
        print(f"lines outside tasks/ {title}: {len(found)} in {len({m.split(':')[0] for m in found})} files")
        for m in found:
            print("  ", m)


if __name__ == "__main__":
    main()
