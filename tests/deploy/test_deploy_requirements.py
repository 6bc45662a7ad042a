"""What goes into the trainer image: requirements.txt (runtime pins) and nothing test-only.
Test pins live in requirements-test.txt, which `make install` adds for development and CI."""

from __future__ import annotations

import re

import tomllib
from deploy_support import ROOT


def _name(requirement: str) -> str:
    # PEP 503 normalized project name, extras and version dropped: "moto[server]==5" -> "moto"
    return re.sub(r"[-_.]+", "-", re.match(r"[A-Za-z0-9_.-]+", requirement.strip()).group(0)).lower()


def _pins(path: str) -> dict[str, str]:
    lines = [line.strip() for line in (ROOT / path).read_text().splitlines()]
    return {_name(line): line for line in lines if line and not line.startswith(("#", "-r "))}


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]


def test_runtime_pins_hold_no_test_package_and_cover_every_dependency():
    runtime, test_only = _pins("requirements.txt"), _pins("requirements-test.txt")
    test_extra = {_name(r) for r in _pyproject()["optional-dependencies"]["test"]}
    assert not test_extra & set(runtime), (
        "test-only packages belong in requirements-test.txt, not in the image's requirements.txt"
    )
    assert set(test_only) == test_extra
    assert all("==" in line for line in [*runtime.values(), *test_only.values()]), "pins, not ranges"
    assert {_name(r) for r in _pyproject()["dependencies"]} <= set(runtime)


def test_make_install_takes_both_and_the_image_only_the_runtime_pins():
    assert "-r requirements.txt" in (ROOT / "requirements-test.txt").read_text().splitlines()
    makefile = (ROOT / "Makefile").read_text()
    assert "pip install -q -r requirements-test.txt" in makefile
    # the stamp depends on every requirements file the install reads (requirements-test.txt includes -docs)
    assert re.search(
        r"^\$\(BIN\)/\.installed: .*requirements\.txt requirements-test\.txt requirements-test-nodeps\.txt"
        r" requirements-docs\.txt$",
        makefile,
        re.M,
    )
    assert "-r requirements-docs.txt" in (ROOT / "requirements-test.txt").read_text().splitlines()
    # the pins whose own requirements conflict with kubetune's: installed without them, test-only, exact
    assert "pip install -q --no-deps -r requirements-test-nodeps.txt" in makefile
    assert all("==" in line for line in _pins("requirements-test-nodeps.txt").values())
    dockerfile = (ROOT / "docker" / "Dockerfile").read_text()
    instructions = [line for line in dockerfile.splitlines() if not line.lstrip().startswith("#")]
    assert not [line for line in instructions if "requirements-test" in line]
    assert "COPY requirements.txt pyproject.toml README.md ./" in instructions
    assert "grep -v '^torch==' requirements.txt > /tmp/requirements.txt" in dockerfile


def test_every_make_target_that_runs_the_venv_installs_it_first():
    """`make gpu-wheels` on a fresh clone failed with `.venv/bin/python: No such file or directory`: every
    target whose recipe runs $(BIN)/... must depend on install (directly or through a target that does)."""
    rules: dict[str, tuple[list[str], str]] = {}
    target = None
    for line in (ROOT / "Makefile").read_text().splitlines():
        head = re.match(r"^([\w.$()/-]+):(?!=)\s*(.*)$", line)
        if head and not line.startswith("\t"):
            target = head.group(1)
            rules[target] = (head.group(2).split(), "")
        elif line.startswith("\t") and target:
            rules[target] = (rules[target][0], rules[target][1] + line + "\n")
        elif not line.strip().startswith("#"):
            target = None

    def installs(name: str) -> bool:
        deps = rules.get(name, ([], ""))[0]
        return name in ("install", "$(BIN)/.installed") or any(installs(d) for d in deps)

    uses_venv = [t for t, (_, recipe) in rules.items() if "$(BIN)/" in recipe and t != "$(BIN)/.installed"]
    assert "gpu-wheels" in uses_venv and "test" in uses_venv
    assert [t for t in uses_venv if not installs(t)] == []
