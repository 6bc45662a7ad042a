"""The module map of docs/development.md, generated from the module docstrings, so that it cannot drift from the code.

One line per package and module under src/kubetune, in tree order (a package, its modules, then its
subpackages), each with the first sentence of its docstring (cut at a word past ``LIMIT`` characters).
docs/development.md holds the generated text between ``START`` and ``END``; tests/unit/test_module_map.py fails
when the two differ or a module has no docstring.

    python scripts/module_map.py            # print the map
    python scripts/module_map.py --write    # rewrite docs/development.md's block in place
"""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "src" / "kubetune"
README = ROOT / "docs" / "development.md"  # the page that holds the map (it was README.md before the docs site)
START = "<!-- module-map:start -->"
END = "<!-- module-map:end -->"
LIMIT = 100  # characters of a summary; a longer first sentence is cut at a word and ends in "…"

_SENTENCE = re.compile(r"(.+?[.!?])(?=\s|$)")
_DANGLING = re.compile(r"(\s+(a|an|the|of|and|or|to|for|its|with|by|in|on|at|as|from|that|which))+$")
_ROLE = re.compile(r":[a-z]+:`~?(?:[\w.]+\.)?([^`]+)`")  # :func:`~a.b.c` -> `c`


def summary(doc: str) -> str:
    """The first sentence of a docstring, in Markdown, on one line of at most about ``LIMIT`` characters."""
    text = " ".join(doc.strip().split("\n\n")[0].split())
    match = _SENTENCE.match(text)
    text = (match.group(1) if match else text).rstrip(":")
    text = _ROLE.sub(r"`\1`", text).replace("``", "`")
    if len(text) <= LIMIT:
        return text
    cut = text[:LIMIT].rsplit(" ", 1)[0]
    while cut.count("`") % 2 or cut.count("(") > cut.count(")"):  # never end inside a code span or parentheses
        cut = cut[: max(cut.rindex("`") if cut.count("`") % 2 else 0, cut.rfind("("))].rstrip()
    return _DANGLING.sub("", cut.rstrip(",;:— ")).rstrip(",;:— ") + " …"


def _docstring(path: Path) -> str:
    if not path.exists():
        return ""
    return ast.get_docstring(ast.parse(path.read_text())) or ""


def entries(package: Path, depth: int = 0) -> list[tuple[int, str, str]]:
    """(depth, name, docstring) of a package and everything under it: its modules, then its subpackages.

    A folder counts as a package when a Python file lies anywhere below it, ``__init__.py`` or not.
    """
    name = f"{package.name}/" if depth else f"src/{package.name}/"
    found = [(depth, name, _docstring(package / "__init__.py"))]
    modules = sorted(p for p in package.glob("*.py") if p.name != "__init__.py")
    found += [(depth + 1, p.name, _docstring(p)) for p in modules]
    for sub in sorted(p for p in package.iterdir() if p.is_dir() and any(p.rglob("*.py"))):
        found += entries(sub, depth + 1)
    return found


def module_map(src: Path = SRC) -> str:
    """The map as a nested Markdown list, one line per package and module."""
    lines = [f"{'  ' * depth}- `{name}` — {summary(doc) or '(no docstring)'}" for depth, name, doc in entries(src)]
    return "\n".join(lines) + "\n"


def missing_docstrings(src: Path = SRC) -> list[str]:
    """The packages and modules under ``src`` without a module docstring, by their path in the map."""
    missing, path = [], []
    for depth, name, doc in entries(src):
        path[depth:] = [name]
        if not doc.strip():
            missing.append("".join(path))
    return missing


def readme_block(text: str) -> str:
    """What README text holds between the markers."""
    if START not in text or END not in text:
        raise SystemExit(f"README.md: the markers {START} and {END} are missing")
    return text.split(START, 1)[1].split(END, 1)[0].removeprefix("\n")


def with_block(text: str, block: str) -> str:
    """README text with ``block`` between the markers."""
    readme_block(text)
    head, rest = text.split(START, 1)
    return f"{head}{START}\n{block}{END}{rest.split(END, 1)[1]}"


def main(argv: list[str]) -> None:
    generated = module_map()
    if argv == ["--write"]:
        README.write_text(with_block(README.read_text(), generated))
        print(f"{README.relative_to(ROOT)}: module map written ({generated.count(chr(10))} lines)")
    elif not argv:
        print(generated, end="")
    else:
        raise SystemExit("usage: python scripts/module_map.py [--write]")


if __name__ == "__main__":
    main(sys.argv[1:])
