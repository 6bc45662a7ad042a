"""The README's module map is generated from the module docstrings (scripts/module_map.py), so it
cannot drift: the README's block equals the generated text, every module and package says in its
docstring what it holds, and the check itself sees a module the README does not list."""

from __future__ import annotations

import importlib.util
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("module_map", ROOT / "scripts" / "module_map.py")
module_map = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(module_map)


def test_readme_map_is_the_generated_one():
    block = module_map.readme_block(module_map.README.read_text())  # docs/development.md
    assert block == module_map.module_map(), (
        "README.md's module map differs from the module docstrings: run `python scripts/module_map.py --write`"
    )


def test_every_module_and_package_has_a_docstring():
    missing = module_map.missing_docstrings()
    assert not missing, f"give each a module docstring saying what it holds: {', '.join(missing)}"


def test_the_check_sees_a_module_the_readme_does_not_list(tmp_path):
    src = tmp_path / "kubetune"
    shutil.copytree(module_map.SRC, src, ignore=shutil.ignore_patterns("__pycache__"))
    readme = module_map.with_block(f"# x\n\n{module_map.START}\n{module_map.END}\n", module_map.module_map(src))
    assert module_map.readme_block(readme) == module_map.module_map(src)
    missing = set(module_map.missing_docstrings(src))

    (src / "data" / "extra.py").write_text('"""Extra rows for the test. More words."""\n')
    (src / "data" / "undocumented.py").write_text("X = 1\n")
    generated = module_map.module_map(src)
    assert module_map.readme_block(readme) != generated
    assert "    - `extra.py` — Extra rows for the test.\n" in generated
    assert set(module_map.missing_docstrings(src)) - missing == {"src/kubetune/data/undocumented.py"}
    assert module_map.readme_block(module_map.with_block(readme, generated)) == generated


@pytest.mark.parametrize(
    "doc, summary",
    [
        ("One line.\n\nMore.", "One line."),
        ("A sentence that\nwraps. Then another.", "A sentence that wraps."),
        ("Uses ``x`` and :func:`~a.b.fn`::\n\n    code", "Uses `x` and `fn`"),
        ("Word " * 30, "Word " * 19 + "Word …"),
        (
            "Ends in a code span " + "w" * 70 + " ``kubetune.some.module`` tail.",
            "Ends in a code span " + "w" * 70 + " …",
        ),
        ("An aside (" + "w " * 60 + ") closes.", "An aside …"),
    ],
)
def test_summary(doc, summary):
    assert module_map.summary(doc) == summary
