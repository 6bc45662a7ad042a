"""The generation engine knows no model family (issue 64, item 5): a family's fast path is chosen by
architecture (``inference.families``), and a model of another architecture takes the generic path and makes
what transformers' greedy ``generate`` makes; training's packed attention reaches inference only through the
public attention plumbing (``inference.attention``)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch

from kubetune.inference.families import FAMILIES, family_of
from kubetune.inference.generation import Engine, Generation

SRC = Path(__file__).resolve().parents[2] / "src" / "kubetune"
LLAMA = SRC / "assets" / "tiny-llama"


def _tiny(kind: str) -> torch.nn.Module:
    """A tiny random causal LM of another architecture, built here (no download)."""
    from transformers import AutoModelForCausalLM, GPT2Config, Qwen2Config

    torch.manual_seed(0)
    if kind == "gpt2":
        config = GPT2Config(vocab_size=97, n_positions=64, n_embd=32, n_layer=2, n_head=4)
    else:
        config = Qwen2Config(
            vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, max_position_embeddings=64,
        )  # fmt: skip
    return AutoModelForCausalLM.from_config(config).eval()


def _greedy(model: torch.nn.Module, ids: list[int], n: int) -> list[int]:
    with torch.no_grad():
        out = model.generate(
            input_ids=torch.tensor([ids]), attention_mask=torch.ones(1, len(ids), dtype=torch.long),
            max_new_tokens=n, min_new_tokens=n, do_sample=False, pad_token_id=0,
        )  # fmt: skip
    return out[0, len(ids) :].tolist()


@pytest.mark.parametrize("kind,packed", [("gpt2", False), ("qwen2", True)])
def test_another_architecture_takes_the_generic_path_and_makes_what_generate_makes(kind, packed):
    """GPT-2 (plain steps) and Qwen2 (packed steps through the model's own forward): no family fast path, and
    each request's tokens are greedy ``generate``'s, in a continuous batch of more requests than slots."""
    model = _tiny(kind)
    assert family_of(model) is None
    engine = Engine(model, set(), slots=3)
    assert engine._flat is None and engine._packs is packed
    prompts = [[5, 17, 3], [8, 1, 44, 2, 9, 30, 12], [60], [7, 7, 7, 7]]
    gens = [Generation(ids, 6) for ids in prompts + prompts[:2]]
    engine.generate(gens)
    for g in gens:
        assert g.tokens == _greedy(model, g.ids, 6)


def test_the_llama_family_is_chosen_by_architecture_for_the_model_as_loaded():
    """The tiny Llama runs its family's fast path; the same model with a hook, or in training, does not."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(LLAMA).eval()
    assert family_of(model) is FAMILIES["llama"] and Engine(model, set())._flat is FAMILIES["llama"]
    handle = model.register_forward_hook(lambda *a: None)
    try:
        assert family_of(model) is None
    finally:
        handle.remove()
    model.train()
    assert family_of(model) is None


def _imports(path: Path) -> set[str]:
    return {
        node.module
        for node in ast.walk(ast.parse(path.read_text()))
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("kubetune.inference")
    }


def test_the_generic_engine_imports_no_family_module_and_training_no_engine_internals():
    """``generation`` and ``step`` name no family module (a family is reached through ``families``); the
    training side's packed attention imports the public attention plumbing only."""
    for engine in ("generation.py", "step.py", "kernels.py", "scoring.py", "sampling.py"):
        assert not any(m.startswith("kubetune.inference.families.llama") for m in _imports(SRC / "inference" / engine))
    assert _imports(SRC / "tasks" / "attention.py") == {"kubetune.inference.attention"}
