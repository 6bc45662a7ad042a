"""Each task's loss and evaluation, in-process at world size 1, against a direct computation:
the recipe maths is not tested only through subprocess runs.

- classification: evaluate()'s accuracy and macro-F1 equal scikit-learn's on the same predictions,
  and its loss equals the mean cross-entropy of each example run alone (no padding);
- causal LM: loss() over a padded micro-batch with prompt tokens masked equals the next-token
  cross-entropy summed over each sequence's target tokens, run alone.
"""

from __future__ import annotations

import importlib
import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from conftest import tiny_spec

from kubetune import providers
from kubetune.config import parse_spec
from kubetune.data import Batch
from kubetune.distributed import DistEnv
from kubetune.tasks import logprobs
from kubetune.tasks.base import evaluate
from kubetune.tasks.causal_lm import task as causal_lm
from kubetune.tasks.causal_lm.data import IGNORE
from kubetune.tasks.classify import task as classify
from kubetune.tasks.common import load_tokenizer

CPU = torch.device("cpu")
NO_AUTOCAST = torch.autocast("cpu", enabled=False)


@pytest.fixture(scope="module")
def classifier(small_csv, tmp_path_factory):
    spec = parse_spec(tiny_spec(small_csv, tmp_path_factory.mktemp("out")))
    model_dir = providers.resolve(spec.model.uri, kind="model", field="model.uri")
    tokenizer = load_tokenizer(model_dir)
    data = classify.prepare(spec, DistEnv(), model_dir, tokenizer)
    torch.manual_seed(0)
    model = classify.build_model(spec, model_dir, data, CPU, torch.float32)
    return model, data, tokenizer


def test_classification_metrics_equal_scikit_learns(classifier):
    from sklearn.metrics import accuracy_score, f1_score

    model, data, tokenizer = classifier
    metrics = evaluate(
        classify.TASK, model, data, DistEnv(), CPU, NO_AUTOCAST, batch_size=7
    )  # odd: batches of mixed lengths
    model.eval()
    labels, preds, losses = [], [], []
    with torch.no_grad():
        for row in data.eval_ds:
            ids = torch.tensor([row["input_ids"]])
            logits = model(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
            label = torch.tensor([row["label"]])
            labels.append(int(label))
            preds.append(int(logits.argmax(-1)))
            losses.append(float(F.cross_entropy(logits, label)))
    model.train()
    assert metrics["eval_samples"] == len(labels) == data.eval_rows
    assert metrics["eval_accuracy"] == pytest.approx(accuracy_score(labels, preds), abs=1e-12)
    assert metrics["eval_f1_macro"] == pytest.approx(f1_score(labels, preds, average="macro"), abs=1e-12)
    assert metrics["eval_loss"] == pytest.approx(float(np.mean(losses)), rel=1e-5)
    assert np.array(metrics["eval_confusion"]).sum() == len(labels)


def test_macro_f1_counts_classes_only_predicted_like_scikit_learn(classifier):
    """sklearn's macro average takes every class that is true or predicted; a class never seen in
    either is left out (evaluate() gets it from per-class counts, not from sklearn)."""
    from sklearn.metrics import f1_score

    model, data, _ = classifier
    with torch.no_grad():
        model.classifier.bias.copy_(torch.tensor([100.0, 0.0, 0.0]))  # predict class 0 for everything
    try:
        metrics = evaluate(classify.TASK, model, data, DistEnv(), CPU, NO_AUTOCAST, batch_size=16)
    finally:
        torch.manual_seed(0)
        with torch.no_grad():
            model.classifier.bias.zero_()
    labels = list(data.eval_ds["label"])
    assert metrics["eval_f1_macro"] == pytest.approx(f1_score(labels, [0] * len(labels), average="macro"), abs=1e-12)


def test_causal_loss_equals_a_direct_next_token_cross_entropy():
    from transformers import AutoModelForCausalLM

    model_dir = providers.resolve("pkg://kubetune/assets/tiny-llama", kind="model", field="model.uri")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    vocab = model.config.vocab_size
    # Two sequences of different lengths, right-padded; prompt tokens carry no loss.
    seqs = [torch.randint(3, vocab, (9,)), torch.randint(3, vocab, (5,))]
    prompt = [4, 2]
    width = max(len(s) for s in seqs)
    input_ids = torch.zeros(2, width, dtype=torch.long)
    attention = torch.zeros(2, width, dtype=torch.long)
    labels = torch.full((2, width), IGNORE)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)], attention[i, : len(s)] = s, 1
        labels[i, prompt[i] : len(s)] = s[prompt[i] :]
    with torch.no_grad():
        loss_sum, units, _ = causal_lm.loss(
            model, Batch({"input_ids": input_ids, "attention_mask": attention}, labels), NO_AUTOCAST
        )
        direct, count = 0.0, 0
        for s, p in zip(seqs, prompt):
            logits = model(input_ids=s[None]).logits[0]
            # token t is predicted from the positions before it; targets are the non-prompt tokens
            direct += float(F.cross_entropy(logits[p - 1 : len(s) - 1], s[p:], reduction="sum"))
            count += len(s) - p
    assert int(units) == count == (9 - 4) + (5 - 2)
    assert float(loss_sum) == pytest.approx(direct, rel=1e-5)
    assert math.isfinite(direct) and direct > 0


def test_every_task_has_a_data_section_and_every_data_section_a_task():
    """The installed registry holds every task pyproject.toml declares, pointing where it says (an
    editable install made before an entry point was added lacks it: `pip install -e .` again); each
    entry's data model is tagged with its own name, and each registered runtime is a Task."""
    import typing
    from pathlib import Path

    import tomllib

    from kubetune import tasks
    from kubetune.config import DATA_SPECS
    from kubetune.config.tasks import GROUP
    from kubetune.tasks.base import Task

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    declared = pyproject["project"]["entry-points"][GROUP]
    for name, target in declared.items():
        module, _, attr = target.partition(":")
        assert DATA_SPECS[name] is getattr(importlib.import_module(module), attr).data, name
    for name, model in DATA_SPECS.items():
        assert typing.get_args(model.model_fields["task"].annotation) == (name,)
    assert all(isinstance(tasks.get(name), Task) for name in tasks.names())


def _full_logits_loss(model, batch):
    """The computation before the loss kept only the target positions: every position's logits,
    then the targets' rows upcast to fp32 in one cross-entropy."""
    logits = model(**batch.inputs).logits
    targets = batch.labels[:, 1:]
    mask = targets != IGNORE
    return F.cross_entropy(logits[:, :-1][mask].float(), targets[mask], reduction="sum"), mask.sum()


@pytest.mark.parametrize("in_head", [True, False])
@pytest.mark.parametrize("packed", [False, True])
def test_the_chunked_target_only_loss_equals_the_full_logits_loss_and_its_gradients(monkeypatch, packed, in_head):
    from transformers import AutoModelForCausalLM

    model_dir = providers.resolve("pkg://kubetune/assets/tiny-llama", kind="model", field="model.uri")
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    vocab = model.config.vocab_size
    gen = torch.Generator().manual_seed(1)
    seqs = [torch.randint(3, vocab, (n,), generator=gen) for n in (40, 23, 31)]
    prompt = [7, 3, 12]
    if packed:  # one row, position ids restarting per example, each example's first token no target
        ids = torch.cat(seqs)[None]
        inputs = {"input_ids": ids, "position_ids": torch.cat([torch.arange(len(s)) for s in seqs])[None]}
        labels = torch.cat([torch.cat([torch.full((p,), IGNORE), s[p:]]) for s, p in zip(seqs, prompt)])[None]
    else:
        width = max(len(s) for s in seqs)
        ids, attention = torch.zeros(3, width, dtype=torch.long), torch.zeros(3, width, dtype=torch.long)
        labels = torch.full((3, width), IGNORE)
        for i, (s, p) in enumerate(zip(seqs, prompt)):
            ids[i, : len(s)], attention[i, : len(s)], labels[i, p : len(s)] = s, 1, s[p:]
        inputs = {"input_ids": ids, "attention_mask": attention}
    batch = Batch(inputs, labels)
    # chunks smaller than the targets (71 of them): several checkpointed chunks, one partial
    monkeypatch.setattr(logprobs, "LOSS_CHUNK", 16)
    # the path under test: the loss in place of the output projection, or (a model whose head cannot
    # be replaced) the target rows of the full logits, chunked
    assert logprobs.replaceable_head(model) is model.lm_head
    if not in_head:
        monkeypatch.setattr(logprobs, "replaceable_head", lambda model: None)

    def run(fn):
        model.zero_grad()
        loss, count = fn(model, batch)
        loss.backward()
        return loss.detach(), int(count), {n: p.grad.clone() for n, p in model.named_parameters()}

    new = run(lambda m, b: causal_lm.loss(m, b, NO_AUTOCAST)[:2])
    old = run(_full_logits_loss)
    assert new[1] == old[1] == sum(len(s) - p for s, p in zip(seqs, prompt))
    assert float(new[0]) == pytest.approx(float(old[0]), rel=1e-5)
    worst = max(float((new[2][n] - old[2][n]).abs().max() / old[2][n].abs().max().clamp_min(1e-12)) for n in old[2])
    assert worst < 1e-5, worst


def test_the_reward_model_trains_with_every_dropout_off_as_trls_reward_trainer(tmp_path):
    """TRL's RewardTrainer turns dropout off by default (disable_dropout): the chosen and the rejected answer are
    scored by the same network. MiniLM has dropout 0.1 in every block; the task's model has none left, in training
    mode the same answer scores the same twice."""
    from types import SimpleNamespace

    from conftest import MINILM

    from kubetune.tasks.reward_model import task as reward_model

    spec = parse_spec(
        {
            "name": "rm",
            "task": "reward-model",
            "model": {"uri": MINILM},
            "data": {"train": "pkg://kubetune/assets/sentiment/sentiment-preferences.jsonl"},
            "output": {"uri": str(tmp_path / "out")},
        }
    )
    model_dir = providers.resolve(spec.model.uri, kind="model", field="model.uri")
    model = reward_model.build_model(
        spec, model_dir, SimpleNamespace(raw=SimpleNamespace(pad_token_id=0)), CPU, torch.float32
    )
    dropouts = [m for m in model.modules() if isinstance(m, torch.nn.Dropout)]
    assert dropouts and all(m.p == 0.0 for m in dropouts)
    model.train()
    ids = torch.tensor([[101, 2307, 3185, 102]])
    assert torch.equal(model(input_ids=ids).logits, model(input_ids=ids).logits)
