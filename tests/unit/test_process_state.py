"""No process-global mutable state in library code (a setting is built into an object and passed): no module
of src/kubetune rebinds a module-level name at run time (``global``), changes a module-level dict,
list, set or Event from inside a function, or writes the process environment, except where an
allow-list below says why. Read from the source (ast), so a code path no test runs counts too."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

SRC = Path(__file__).resolve().parents[2] / "src"

# (module, function) -> why that function may write os.environ.
ENVIRON_WRITERS = {
    ("kubetune/backends/local/launcher.py", "_launcher_environment"): (
        "torch's elastic launcher takes no environment: each worker's is a copy of the launching "
        "process's, and its rendezvous handler reads TORCH_DISABLE_SHARE_RDZV_TCP_STORE from it; set for the "
        "launch only, and restored"
    ),
    ("kubetune/pod/launch.py", "run"): (
        "torchrun's runner takes no environment for the workers either: the pid they die with (kubetune.lifetime) "
        "and the switch that puts their events into the log (training.events.LOG_EVENTS_ENV) go through this "
        "process's, the pod's main process, which runs nothing else"
    ),
    ("kubetune/training/tracking.py", "_quiet_client"): (
        "MLflow reads its HTTP retries and timeout, and whether to print a run's URL, only from the environment"
    ),
}

# (module, name) -> why that module-level container may change after import.
MUTABLE_GLOBALS = {
    ("kubetune/providers/base.py", "_RESOLVERS"): "the scheme registry, filled by @register as the providers import",
    ("kubetune/backends/local/runs.py", "_LOCAL_JOBS"): (
        "the jobs this process started (Popen handles): child processes belong to the process itself"
    ),
    ("kubetune/inference/attention.py", "WRAPPED"): (
        "the attention implementations registered as a wrapper over another, filled as each registers (as "
        "transformers' own ALL_ATTENTION_FUNCTIONS, which the same registration writes)"
    ),
    ("kubetune/checkpoint/writer.py", "_WRITERS"): (
        "the background checkpoint writer of each checkpoint directory: its thread belongs to the process, and every "
        "CheckpointStore made for that directory must wait for the write in flight"
    ),
    ("kubetune/artifacts/lock.py", "_HELD"): (
        "the outputs this process holds locked: a lock belongs to the process, and the kernel releases it when the "
        "process ends, however it ends"
    ),
}

MUTATORS = {
    "append",
    "appendleft",
    "add",
    "clear",
    "discard",
    "extend",
    "insert",
    "pop",
    "popitem",
    "remove",
    "reverse",
    "set",
    "setdefault",
    "sort",
    "update",
    "__setitem__",
    "__delitem__",
}
MUTABLE_MAKERS = {
    "dict",
    "list",
    "set",
    "defaultdict",
    "OrderedDict",
    "Counter",
    "deque",
    "Event",
    "WeakValueDictionary",
    "WeakKeyDictionary",
    "WeakSet",
}


def _mutable(value: ast.expr) -> bool:
    if isinstance(value, (ast.Dict, ast.List, ast.Set, ast.DictComp, ast.ListComp, ast.SetComp)):
        return True
    if isinstance(value, ast.Call):
        func = value.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        return name in MUTABLE_MAKERS
    return False


def _module_mutables(tree: ast.Module) -> set[str]:
    names = set()
    for node in tree.body:
        if isinstance(node, ast.Assign) and _mutable(node.value):
            names |= {t.id for t in node.targets if isinstance(t, ast.Name)}
        elif isinstance(node, ast.AnnAssign) and node.value is not None and _mutable(node.value):
            if isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return names


def _is_environ(node: ast.expr) -> bool:
    return ast.unparse(node) in ("os.environ", "environ")


def _base_name(node: ast.expr) -> str | None:
    """``x`` of ``x[...]`` and ``x.attr`` (None for anything else)."""
    return (
        node.value.id if isinstance(node, (ast.Subscript, ast.Attribute)) and isinstance(node.value, ast.Name) else None
    )


class _Finder(ast.NodeVisitor):
    """Every write to process state: (kind, name, enclosing function, line)."""

    def __init__(self, mutables: set[str]):
        self.mutables, self.found, self.stack = mutables, [], []

    def visit_FunctionDef(self, node):
        local = {a.arg for a in [*node.args.posonlyargs, *node.args.args, *node.args.kwonlyargs]}
        local |= {n.id for n in ast.walk(node) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
        self.stack.append((node.name, local))
        self.generic_visit(node)
        self.stack.pop()

    visit_AsyncFunctionDef = visit_FunctionDef

    def _add(self, kind: str, name: str, node: ast.AST) -> None:
        self.found.append((kind, name, self.stack[-1][0] if self.stack else "<module>", node.lineno))

    def _global_container(self, name: str | None) -> bool:
        # Only inside a function: what a module does to its own tables while it imports is set-up.
        return bool(self.stack) and name in self.mutables and name not in self.stack[-1][1]

    def visit_Global(self, node):
        for name in node.names:
            self._add("global", name, node)

    def visit_Call(self, node):
        func = node.func
        if isinstance(func, ast.Attribute) and func.attr in MUTATORS:
            owner = func.value  # ``x`` of ``x.update(...)``, or of ``x[k].append(...)``
            name = owner.id if isinstance(owner, ast.Name) else _base_name(owner)
            if _is_environ(owner):
                self._add("environ", func.attr, node)
            elif self._global_container(name):
                self._add("mutable", name, node)
        if ast.unparse(func) in ("os.putenv", "os.unsetenv"):
            self._add("environ", ast.unparse(func), node)
        self.generic_visit(node)

    def _targets(self, targets, node):
        for target in targets:
            if isinstance(target, ast.Subscript) and _is_environ(target.value):
                self._add("environ", "[]", node)
            elif self._global_container(_base_name(target)):
                self._add("mutable", _base_name(target), node)

    def visit_Assign(self, node):
        self._targets(node.targets, node)
        self.generic_visit(node)

    def visit_AugAssign(self, node):
        self._targets([node.target], node)
        self.generic_visit(node)

    def visit_Delete(self, node):
        self._targets(node.targets, node)
        self.generic_visit(node)


def writes(source: str) -> list[tuple[str, str, str, int]]:
    """The process-state writes in ``source``: (``global`` | ``mutable`` | ``environ``, the name or
    method, the enclosing function, the line)."""
    tree = ast.parse(source)
    finder = _Finder(_module_mutables(tree))
    finder.visit(tree)
    return finder.found


@pytest.mark.parametrize(
    "source, expected",
    [  # the shapes this test exists for (the S3 settings, the stop flag, the control group, the environment)
        (
            "_s = {'a': None}\ndef configure(a):\n    _s.update(a=a)\n",
            [("mutable", "_s", "configure", 3)],
        ),
        ("import threading\nSTOP = threading.Event()\ndef h():\n    STOP.set()\n", [("mutable", "STOP", "h", 4)]),
        ("_C = None\ndef init():\n    global _C\n    _C = 1\n", [("global", "_C", "init", 3)]),
        ("_jobs = {}\ndef start(n, j):\n    _jobs[n] = j\n", [("mutable", "_jobs", "start", 3)]),
        ("_n = [0]\ndef bump():\n    _n[0] += 1\n", [("mutable", "_n", "bump", 3)]),
        # a cache of handles by key (client.py had one, to hand back the same object)
        (
            "import weakref\n_H = weakref.WeakValueDictionary()\ndef h(k, v):\n    _H[k] = v\n",
            [("mutable", "_H", "h", 4)],
        ),
        ("import os\ndef run(e):\n    os.environ.update(e)\n", [("environ", "update", "run", 3)]),
        ("import os\nos.environ['A'] = '1'\n", [("environ", "[]", "<module>", 2)]),
        ("import os\ndef f():\n    del os.environ['A']\n", [("environ", "[]", "f", 3)]),
        ("import os\ndef f():\n    os.environ.setdefault('A', '1')\n", [("environ", "setdefault", "f", 3)]),
        ("import os\ndef f():\n    os.putenv('A', '1')\n", [("environ", "os.putenv", "f", 3)]),
        # not process state: a module's tables built while it imports, a local that shadows, a read
        ("T = {}\nT['a'] = 1\ndef f():\n    return T['a']\n", []),
        ("T = {}\ndef f():\n    T = {}\n    T['a'] = 1\n", []),
        ("import os\ndef f():\n    return os.environ.get('A')\n", []),
    ],
)
def test_the_finder_sees_each_kind_of_write(source, expected):
    assert writes(source) == expected


def test_library_code_keeps_no_process_global_mutable_state():
    seen_environ, seen_mutable, problems = set(), set(), []
    for path in sorted((SRC / "kubetune").rglob("*.py")):
        module = path.relative_to(SRC).as_posix()
        for kind, name, function, line in writes(path.read_text()):
            where = f"{module}:{line} ({function})"
            if kind == "environ" and (module, function) in ENVIRON_WRITERS:
                seen_environ.add((module, function))
            elif kind == "mutable" and (module, name) in MUTABLE_GLOBALS:
                seen_mutable.add((module, name))
            elif kind == "global":
                problems.append(f"{where}: `global {name}` rebinds a module-level name; pass an object instead")
            elif kind == "environ":
                problems.append(f"{where}: writes os.environ ({name}); build an environment dict and pass it")
            else:
                problems.append(f"{where}: changes the module-level {name}; pass the state (or settings) instead")
    assert problems == []
    # An allow-list entry whose write is gone is removed too, so the list says what is left.
    assert seen_environ == set(ENVIRON_WRITERS)
    assert seen_mutable == set(MUTABLE_GLOBALS)
