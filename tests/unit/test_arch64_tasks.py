"""Issue 64, tasks: no task package imports another (what several share lives in the shared modules of
``tasks/``: ``causal``, ``logprobs``, ``reference``, ``pairs``, ``pair_batches``, ``reward_models``, ``common``),
nor does a shared module import a task package; and the one reference-model component (``tasks.reference``) is
held out of the optimizer, the state dict and the module tree, frozen, and found by the loss."""

from __future__ import annotations

import ast
import contextlib
from pathlib import Path

import pytest
import torch

from kubetune.data import Batch
from kubetune.tasks.reference import Reference

TASKS = Path(__file__).resolve().parents[2] / "src" / "kubetune" / "tasks"
PACKAGES = sorted(p.name for p in TASKS.iterdir() if (p / "__init__.py").is_file())


def imported_tasks(source: str, module: str) -> set[str]:
    """The task packages (``PACKAGES``) that the module ``module`` (dotted) imports anywhere in ``source``, lazy
    imports inside functions included; relative imports resolved."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(source)):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, up level - 1 more
                package = module.split(".")[: -node.level]
                base = ".".join(package + ([base] if base else []))
            names = [base] + [f"{base}.{a.name}" for a in node.names]
        for name in names:
            parts = name.split(".")
            if parts[:2] == ["kubetune", "tasks"] and len(parts) > 2 and parts[2] in PACKAGES:
                found.add(parts[2])
    return found


def _modules() -> list[tuple[str, Path]]:
    out = []
    for path in sorted(TASKS.rglob("*.py")):
        parts = path.relative_to(TASKS.parents[1]).with_suffix("").parts
        out.append((".".join(parts), path))
    return out


def test_no_task_package_imports_another():
    crossing = []
    for module, path in _modules():
        own = module.split(".")[2] if module.count(".") >= 3 else None  # kubetune.tasks.<pkg>.<module>
        others = imported_tasks(path.read_text(), module) - {own}
        crossing += [f"{module} imports kubetune.tasks.{o}" for o in sorted(others)]
    assert crossing == [], "a task package imports another; move what they share into a shared module of tasks/"


@pytest.mark.parametrize(
    ("module", "source", "expected"),
    [
        ("kubetune.tasks.orpo.task", "from kubetune.tasks.dpo import DPOSpec", {"dpo"}),
        ("kubetune.tasks.orpo.task", "from kubetune.tasks import dpo", {"dpo"}),
        ("kubetune.tasks.grpo.rewards", "def f():\n    import kubetune.tasks.reward_model.task", {"reward_model"}),
        ("kubetune.tasks.kto.task", "from ..causal_lm import task", {"causal_lm"}),
        ("kubetune.tasks.kto.task", "from . import data", {"kto"}),  # its own package: not a crossing
        ("kubetune.tasks.dpo.task", "from kubetune.tasks.reference import Reference", set()),
        ("kubetune.tasks.dpo.task", "from kubetune.tasks import causal, logprobs", set()),
    ],
)
def test_the_import_finder(module, source, expected):
    assert imported_tasks(source, module) == expected


class Tiny(torch.nn.Module):
    """A model whose 'log-probability' of a batch is its one weight times the inputs, summed per row."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))
        self.register_buffer("seen", torch.zeros(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (x * self.weight).sum(dim=1)


def test_a_frozen_copy_is_held_out_of_the_optimizer_the_state_dict_and_the_modules():
    model = Tiny()
    names, keys = [n for n, _ in model.named_parameters()], list(model.state_dict())
    Reference.frozen_copy(model).attach(model)
    # what the trainer builds from the model, and what a checkpoint and the export save: as without it
    assert [n for n, _ in model.named_parameters()] == names and list(model.state_dict()) == keys
    assert list(model.modules()) == [model] and list(model.buffers()) == [model.seen]
    optimizer = torch.optim.AdamW(model.parameters())
    assert [p for g in optimizer.param_groups for p in g["params"]] == [model.weight]
    # a checkpoint's weights load into the policy, not into the reference
    model.load_state_dict({"weight": torch.full((3,), 2.0), "seen": torch.zeros(())})
    reference = Reference.attached(model)
    assert reference.mode == "copy" and reference.model is not None
    assert not reference.model.training and not any(p.requires_grad for p in reference.model.parameters())
    x = torch.tensor([[1.0, 2.0, 3.0]])
    grads = []
    assert float(reference.run(model, lambda m: (grads.append(torch.is_grad_enabled()), m(x))[1])) == 6.0
    assert float(model(x).detach()) == 12.0 and grads == [False]


def test_without_an_attached_copy_the_reference_is_the_adapter_disabled():
    class Adapted(Tiny):
        def __init__(self) -> None:
            super().__init__()
            self.adapter_on = True

        @contextlib.contextmanager
        def disable_adapter(self):
            self.adapter_on = False
            try:
                yield
            finally:
                self.adapter_on = True

    model = Adapted()
    reference = Reference.attached(model)
    assert reference.mode == "adapter"
    assert reference.run(model, lambda m: m.adapter_on) is False and model.adapter_on
    with pytest.raises(RuntimeError, match="no reference model"):
        Reference.attached(Tiny()).run(Tiny(), lambda m: m)


def test_the_reference_log_probabilities_are_the_copys():
    """``Reference.logps``: each row's summed target-token log-probability under the reference, the policy's
    weights moved since (a tiny causal LM from a config: no download)."""
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2
    )
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    ids = torch.tensor([[1, 5, 7, 9], [1, 4, 6, 0]])
    labels = torch.tensor([[-100, -100, 7, 9], [-100, 4, 6, -100]])
    batch = Batch({"input_ids": ids, "attention_mask": (ids != 0).long()}, labels)
    off = torch.autocast("cpu", enabled=False)
    reference = Reference.frozen_copy(model)
    before = reference.logps(model, batch, off)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    assert torch.equal(reference.logps(model, batch, off), before)
    assert before.shape == (2,) and not before.requires_grad
