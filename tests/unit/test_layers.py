"""The package's import structure: no import cycle between modules (lazy imports inside
functions count too: a cycle that works only by import order is still a cycle), and imports point
down the layers of ``LAYERS`` below only (docs/development.md, "Layout", points here)."""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "kubetune"

# Lower number = lower layer. A module may import only modules of its own layer or below.
LAYERS = {
    "kubetune.version": 0,
    "kubetune.errors": 0,
    "kubetune.paths": 0,
    "kubetune.lifetime": 0,
    "kubetune.config": 1,
    "kubetune.providers": 2,
    "kubetune.distributed": 2,
    "kubetune.data": 3,
    "kubetune.artifacts": 4,
    "kubetune.checkpoint": 4,
    # what a task's inference plugs into: model loading and checks, the engines, the server
    "kubetune.inference": 5,
    "kubetune.tasks": 6,
    # lm-evaluation-harness on a loaded model: above inference (model loading), below training (which evaluates)
    "kubetune.evaluation": 6,
    "kubetune.summary": 6,
    "kubetune.training": 7,
    "kubetune.pod": 8,
    "kubetune.backends": 9,
    # a study whose trials are `kubetune run` processes (beside the backends, which run jobs too)
    "kubetune.tune": 9,
    "kubetune.client": 10,
    "kubetune.compat": 10,
    "kubetune.cli": 11,
    "kubetune.__main__": 12,
    "kubetune": 12,
}


def _modules() -> dict[str, Path]:
    out = {}
    for path in SRC.rglob("*.py"):
        parts = path.relative_to(SRC.parent).with_suffix("").parts
        out[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return out


def import_graph() -> dict[str, set[str]]:
    """module -> the kubetune modules it imports, anywhere in its body."""
    modules = _modules()
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and node.module
                and node.level == 0
                and node.module.split(".")[0] == "kubetune"
            ):
                for alias in node.names:
                    sub = f"{node.module}.{alias.name}"
                    deps.add(sub if sub in modules else node.module)
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.split(".")[0] == "kubetune"}
        graph[name] = {d for d in deps if d in modules and d != name}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer(module: str) -> int:
    while module not in LAYERS:
        module = module.rpartition(".")[0]
    return LAYERS[module]


def test_no_import_cycles():
    assert cycles(import_graph()) == []


def test_imports_point_down_the_layers():
    upward = sorted(
        f"{m} (layer {layer(m)}) imports {d} (layer {layer(d)})"
        for m, deps in import_graph().items()
        for d in deps
        if layer(d) > layer(m)
    )
    assert upward == []


def test_every_module_has_a_layer():
    assert [m for m in _modules() if not any(m == k or m.startswith(k + ".") for k in LAYERS)] == []


def test_the_cycle_finder_finds_cycles():
    assert cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert cycles({"a": {"b"}, "b": set()}) == []


def test_a_local_run_never_imports_the_kubernetes_client():
    import subprocess
    import sys

    code = (
        "import sys, kubetune.client, kubetune.pod.worker, kubetune.cli; "
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('kubernetes', 'kubeflow')))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]"
