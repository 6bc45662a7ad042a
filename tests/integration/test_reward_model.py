"""Reward modelling end to end (task: reward-model) on the packaged MiniLM and the packaged sentiment preferences,
2 gloo processes: it learns the preference (held-out pairwise accuracy >= 0.9), reports TRL's metric names,
exports a scorer whose raw scores `kubetune predict` and `kubetune serve` (KServe v1 and v2) answer, chosen above
rejected; a run killed with SIGKILL resumes to the same weights bit for bit (e2e), and LoRA and FSDP train it."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path

import pytest
import torch
from conftest import MINILM, kubetune, start_run, wait_for_checkpoint, worker_pid, write_spec

pytestmark = pytest.mark.integration
PAIRS = "pkg://kubetune/assets/sentiment/sentiment-preferences.jsonl"
ROOT_TINY = Path(__file__).resolve().parents[2] / "src" / "kubetune" / "assets" / "tiny-llama"


def _spec(out: Path, **over) -> dict:
    spec = {
        "name": "reward-minilm",
        "task": "reward-model",
        "model": {"uri": MINILM},
        "data": {
            "train": PAIRS,
            "eval_fraction": 0.1,
            "max_length": 128,
            "max_train_samples": 320,
            "max_eval_samples": 64,
        },
        "reward-model": {"center_rewards_coefficient": 0.01},
        "training": {
            "epochs": 1,
            "batch_size": 16,
            "learning_rate": 1e-4,
            "log_every": 1,
            "eval_every": 5,
            "seed": 5,
        },
        "distributed": {"procs_per_node": 2},
        "output": {"uri": str(out)},
    }
    for key, value in over.items():
        spec[key] = {**spec.get(key, {}), **value} if isinstance(value, dict) else value
    return spec


def _render(review: str, answer: str) -> str:
    """A pair's text as the fallback chat template renders it for the MiniLM tokenizer (which has none)."""
    return f"<|user|>\nWhat is the sentiment of this review? {review}\n<|assistant|>\n{answer}"


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("reward")
    r = kubetune("run", str(write_spec(tmp / "job.yaml", _spec(tmp / "out"))), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    return tmp / "out", r.stderr


def test_an_exported_reward_model_predicts_and_serves_raw_scores(tmp_path):
    """`kubetune predict` and `kubetune serve` (KServe v1 and v2, output `score`) on a reward-model export (a small
    random one, as the task writes it: found by its config, one output named `reward`): the model's raw score of
    each text, the same from both."""
    from conftest import make_reward_model
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = make_reward_model(tmp_path / "rm", template=True)  # trained on chat pairs
    tok = AutoTokenizer.from_pretrained(path)
    conversations = [
        [{"role": "user", "content": f"What is the sentiment? {review}"}, {"role": "assistant", "content": answer}]
        for review, answer in (("rude crew", "negative"), ("rude crew", "Hard to say."), ("lovely staff", "positive"))
    ]
    texts = [tok.apply_chat_template(c, tokenize=False) for c in conversations]  # what a user passes: rendered
    r = kubetune("predict", str(path), "--json", *texts)
    assert r.returncode == 0, r.stderr[-2000:]
    scores = [x["score"] for x in json.loads(r.stdout)]
    model = AutoModelForSequenceClassification.from_pretrained(path).eval()
    with torch.no_grad():  # the ids its training scored: the chat template's own tokenization (no [BOS] added twice)
        want = [
            model(
                input_ids=torch.tensor([tok.apply_chat_template(c, tokenize=True, return_dict=True)["input_ids"]])
            ).logits.item()
            for c in conversations
        ]
    assert scores == pytest.approx(want, abs=1e-4) and any(s < 0 for s in scores)  # raw: a probability is not < 0

    from test_serve import Server

    server = Server(path, "--name", "rm").wait()
    try:
        status, v1 = server.call("/v1/models/rm:predict", {"instances": texts})
        assert status == 200, v1
        assert [p["score"] for p in v1["predictions"]] == pytest.approx(scores, abs=1e-4)
        tensor = {"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}
        status, v2 = server.call("/v2/models/rm/infer", {"inputs": [tensor]})
        assert status == 200 and [o["name"] for o in v2["outputs"]] == ["score"], v2
        assert v2["outputs"][0]["data"] == pytest.approx(scores, abs=1e-4)
    finally:
        server.stop()


@pytest.mark.e2e  # make test: the TRL equality (unit), the export's predict and serve above
def test_it_learns_the_preference_reports_predicts_and_serves_raw_scores(trained):
    out, log = trained
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["task"] == "reward-model" and metrics["world_size"] == 2
    assert metrics["eval_accuracy"] >= 0.9, metrics  # the bar, on 64 held-out pairs
    assert metrics["eval_margin"] > 0.2 and metrics["eval_pairs"] == 64
    assert metrics["center_rewards_coefficient"] == 0.01 and metrics["data_format"] == "chat"
    history = [json.loads(line) for line in (out / "history.jsonl").read_text().splitlines()]
    train = [h for h in history if h["type"] == "train"]
    assert {"accuracy", "margin", "mean_reward"} <= train[0].keys()  # TRL's names
    evals = [h for h in history if h["type"] == "eval"]
    assert evals[-1]["eval_margin"] > evals[0]["eval_margin"]
    assert "done: eval_accuracy" in log and "train_loss" in log
    assert "pairwise accuracy" in (out / "report.html").read_text()
    config = json.loads((out / "model" / "config.json").read_text())
    assert config["id2label"] == {"0": "reward"} and config["problem_type"] == "regression"

    texts = [
        _render("the crew were rude and my bag is lost", "negative"),
        _render("the crew were rude and my bag is lost", "Hard to say."),
        _render("smooth flight, lovely staff", "positive"),
        _render("smooth flight, lovely staff", "No comment."),
    ]
    r = kubetune("predict", str(out), "--json", *texts)
    assert r.returncode == 0, r.stderr[-2000:]
    scores = [x["score"] for x in json.loads(r.stdout)]
    assert scores[0] > scores[1] and scores[2] > scores[3], scores  # the answer above the evasion
    assert any(s < 0 for s in scores)  # raw scores: no probability is negative

    from test_serve import Server

    server = Server(out, "--name", "rm").wait()
    try:
        status, v1 = server.call("/v1/models/rm:predict", {"instances": texts})
        assert status == 200, v1
        assert [p["score"] for p in v1["predictions"]] == pytest.approx(scores, abs=1e-4)
        tensor = {"name": "text", "shape": [len(texts)], "datatype": "BYTES", "data": texts}
        status, v2 = server.call("/v2/models/rm/infer", {"inputs": [tensor]})
        assert status == 200 and [o["name"] for o in v2["outputs"]] == ["score"], v2
        assert v2["outputs"][0]["data"] == pytest.approx(scores, abs=1e-4)
    finally:
        server.stop()


def test_pairs_that_cannot_be_learned_are_one_line(tmp_path):
    bad = tmp_path / "pairs.jsonl"
    bad.write_text(
        "\n".join(json.dumps({"prompt": "q", "chosen": f"a{i}", "rejected": f"b{i}", "m": m}) for i, m in enumerate(
            [1, "lots", 2]
        ))
    )  # fmt: skip
    spec = _spec(tmp_path / "out", data={"train": str(bad), "margin_column": "m"})
    r = kubetune("run", str(write_spec(tmp_path / "job.yaml", spec)))
    assert r.returncode == 2
    (line,) = r.stderr.strip().splitlines()
    assert "data.margin_column" in line and "'lots', not a number" in line, line
    assert not (tmp_path / "out").exists()


def _weights(out: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(out / "model" / "model.safetensors")


@pytest.mark.e2e
def test_a_run_killed_with_sigkill_resumes_to_the_same_weights(trained, tmp_path):
    ref_out, _ = trained
    out = tmp_path / "out"
    # checkpoints every 5 steps, which the uninterrupted run did not write: they change nothing of the training
    proc = start_run(write_spec(tmp_path / "job.yaml", _spec(out, training={"checkpoint_every": 5})))
    wait_for_checkpoint(out, 5, proc)
    os.kill(worker_pid(proc.pid, 1), signal.SIGKILL)  # as the OOM killer would
    proc.communicate(timeout=120)
    assert proc.returncode != 0
    r = kubetune("run", str(tmp_path / "job.yaml"), timeout=600)
    assert r.returncode == 0 and "resumed from checkpoint step" in r.stderr, r.stderr[-3000:]
    a, b = _weights(out), _weights(ref_out)
    diff = max((a[k].double() - b[k].double()).abs().max().item() for k in a)
    print(f"reward model, SIGKILL after a checkpoint, resumed: max |diff| {diff}")
    assert diff == 0.0


@pytest.mark.e2e
def test_lora_and_fsdp_train_it(tmp_path):
    lora = _spec(
        tmp_path / "lora", lora={"r": 8, "target_modules": ["query", "value"]}, training={"learning_rate": 5e-4}
    )
    fsdp = _spec(tmp_path / "fsdp", distributed={"strategy": "fsdp"})
    for name, spec in (("lora", lora), ("fsdp", fsdp)):
        r = kubetune("run", str(write_spec(tmp_path / f"{name}.yaml", spec)), timeout=600)
        assert r.returncode == 0, r.stderr[-3000:]
        metrics = json.loads((tmp_path / name / "metrics.json").read_text())
        assert metrics["eval_accuracy"] >= 0.9, (name, metrics["eval_accuracy"])
    assert (tmp_path / "lora" / "adapter").is_dir()
    assert json.loads((tmp_path / "fsdp" / "metrics.json").read_text())["strategy"] == "fsdp"


SYSTEM = "Rate the review from 1 to 5 stars. Answer with digits only."


def _grpo_spec(out: Path, reward_model: Path, **training) -> dict:
    return {
        "name": "grpo-rm",
        "task": "grpo",
        "model": {"uri": "pkg://kubetune/assets/tiny-llama"},
        "data": {
            "train": "pkg://kubetune/assets/sentiment/sentiment-instructions.jsonl",
            "prompt_column": "input",
            "format": "chat",
            "system_prompt": SYSTEM,
            "max_length": 128,
            "max_train_samples": 64,
            "max_eval_samples": 8,
        },
        "grpo": {
            "num_generations": 4,
            "max_completion_length": 8,
            "rewards": [{"function": "model", "model": str(reward_model), "name": "rm"}],
            "log_completions": 8,
        },
        "training": {"max_steps": 2, "batch_size": 2, "learning_rate": 1e-2, "log_every": 1, **training},
        "distributed": {"procs_per_node": 2},
        "output": {"uri": str(out)},
    }


@pytest.mark.e2e  # make test: the reward model's run above, the scoring in tests/unit/test_grpo_reward_checks.py
def test_a_trained_reward_model_is_a_grpo_reward_scored_as_it_was_trained(trained, tmp_path):
    """grpo.rewards' `function: model`: each completion's reward is the reward model's score of the conversation
    rendered by its own chat template and tokenized as its training tokenized pairs (checked here by scoring the
    logged completions again with transformers directly); what is not a reward model is one line."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    rm_out, _ = trained
    out = tmp_path / "grpo"
    r = kubetune("run", str(write_spec(tmp_path / "grpo.yaml", _grpo_spec(out, rm_out))), timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    samples = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    assert len(samples) >= 4
    tok = AutoTokenizer.from_pretrained(rm_out / "model")
    model = AutoModelForSequenceClassification.from_pretrained(rm_out / "model").eval()
    for s in samples[:4]:
        messages = [
            {"role": "system", "content": SYSTEM},
            {"role": "user", "content": s["prompt"]},
            {"role": "assistant", "content": s["completion"]},
        ]
        ids = tok.apply_chat_template(messages, tokenize=True, return_dict=True)["input_ids"]
        with torch.no_grad():
            want = model(input_ids=torch.tensor([ids])).logits.item()
        assert s["rewards"]["rm"] == pytest.approx(want, abs=1e-4), s
    metrics = json.loads((out / "metrics.json").read_text())
    assert metrics["grpo_rewards"] == ["rm"]

    # the tiny Llama is a causal LM, not a reward model: one line before training
    spec = _grpo_spec(tmp_path / "bad", Path("pkg://kubetune/assets/tiny-llama"))
    spec["grpo"]["rewards"][0]["model"] = str(ROOT_TINY)
    r = kubetune("run", str(write_spec(tmp_path / "bad.yaml", spec)))
    assert r.returncode != 0
    assert "grpo.rewards[0].model" in r.stderr and "not a reward model" in r.stderr, r.stderr[-2000:]


@pytest.mark.e2e
def test_grpo_with_a_trained_reward_model_raises_its_held_out_reward(tmp_path):
    """The issue's bar: a reward model trained on preferences for a digit rating over a few of the review's words
    (600 pairs made from the packaged reviews the GRPO example does not sample), then the GRPO example (its 24
    steps, its settings) with that reward model as its only reward: the held-out reward rises by at least 0.3."""
    import random

    import yaml
    from conftest import ROOT

    rows = [json.loads(line) for line in (ROOT_TINY.parent / "sentiment" / "sentiment-instructions.jsonl").open()]
    rng = random.Random(0)
    pairs = []
    for r in rows[1024:1624]:
        words = r["input"].split()
        prompt = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": r["input"]}]
        rejected = " ".join(rng.sample(words, min(len(words), rng.randint(1, 4)))) or "fine"
        pairs.append({"prompt": prompt, "chosen": [{"role": "assistant", "content": str(rng.randint(1, 5))}],
                      "rejected": [{"role": "assistant", "content": rejected}]})  # fmt: skip
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    rm = _spec(tmp_path / "rm", data={"train": str(tmp_path / "pairs.jsonl"), "max_train_samples": None})
    # one epoch at 1e-4: with dropout off (TRL's default, since 7957b9b) two epochs at 3e-4 saturated the model, every
    # completion of the tiny policy scored about -4.5, the groups had no spread and GRPO nothing to learn from
    # (-4.518 -> -4.526 after 24 steps)
    # fp32 in both runs: `auto` is bf16 on a CPU with AMX or AVX512-BF16, whose rounding moved the rise to 0.274 on
    # one (the same numbers on the code before and after issue 63); this bar is about learning, not about a CPU
    rm["training"].update(epochs=1, learning_rate=1e-4, precision="fp32")
    rm.pop("reward-model")
    r = kubetune("run", str(write_spec(tmp_path / "rm.yaml", rm)), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    assert json.loads((tmp_path / "rm" / "metrics.json").read_text())["eval_accuracy"] >= 0.9

    grpo = yaml.safe_load((ROOT / "examples" / "grpo-tiny-digits.yaml").read_text())
    grpo.pop("kubernetes")
    grpo["output"] = {"uri": str(tmp_path / "grpo")}
    grpo["grpo"]["rewards"] = [{"function": "model", "model": str(tmp_path / "rm"), "name": "rm"}]
    grpo["training"]["precision"] = "fp32"
    r = kubetune("run", str(write_spec(tmp_path / "grpo.yaml", grpo)), timeout=900)
    assert r.returncode == 0, r.stderr[-3000:]
    evals = [h for h in map(json.loads, (tmp_path / "grpo" / "history.jsonl").open()) if h["type"] == "eval"]
    first, last = evals[0], evals[-1]
    print(f"grpo with a reward model: held-out reward {first['eval_reward']:.3f} -> {last['eval_reward']:.3f}")
    assert first["step"] == 0 and last["eval_reward"] - first["eval_reward"] >= 0.3
