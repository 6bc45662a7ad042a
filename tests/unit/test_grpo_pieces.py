"""GRPO's spec, data and rewards: the grpo section's checks (one line each), prompts in text and chat
with every other column kept for the rewards, the built-in rewards (exact_match, regex and its share,
DAPO's length penalty), a user's module:function and each way it can fail (one line naming it and the
step), the weighted total with None; the repeated plan of num_iterations; and the log-probabilities of
the chunked head (full and LoRA, temperature) against the model's own logits."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from kubetune.config.load import parse_spec
from kubetune.errors import KubetuneError, SpecError
from kubetune.tasks.common import IGNORE, ensure_chat_template
from kubetune.tasks.grpo import PromptData, Reward
from kubetune.tasks.grpo import data as grpo_data
from kubetune.tasks.grpo import loss as grpo_loss
from kubetune.tasks.grpo import rewards as R
from kubetune.tasks.grpo.rollout import completion_logps
from kubetune.training.layout import Repeated

TINY = Path(__file__).resolve().parents[2] / "src" / "kubetune" / "assets" / "tiny-llama"


def _spec(grpo: dict | None, **data) -> dict:
    spec = {
        "name": "g",
        "task": "grpo",
        "model": {"uri": "pkg://kubetune/assets/tiny-llama"},
        "data": {"train": "x.jsonl", **data},
        "output": {"uri": "runs/g"},
    }
    if grpo is not None:
        spec["grpo"] = grpo
    return spec


@pytest.mark.parametrize(
    ("grpo", "expected"),
    [
        (None, "task grpo needs a grpo section"),
        ({"rewards": []}, "rewards"),
        ({"rewards": [{"function": "exact_match"}]}, "exact_match needs `column`"),
        ({"rewards": [{"function": "regex"}]}, "regex needs `pattern`"),
        ({"rewards": [{"function": "regex", "pattern": "("}]}, "is not a regular expression"),
        ({"rewards": [{"function": "length", "max_tokens": 10}]}, "length needs max_tokens and cache_tokens"),
        ({"rewards": [{"function": "length", "max_tokens": 10, "cache_tokens": 10}]}, "must be below max_tokens"),
        ({"rewards": [{"function": "regex", "pattern": "a", "column": "x"}]}, "column does not apply"),
        (
            {"rewards": [{"function": "length", "max_tokens": 9, "cache_tokens": 2, "share": True}]},
            "apply to function regex",
        ),
        ({"rewards": [{"function": "regex", "pattern": "a", "full": True, "share": True}]}, "exclude each other"),
        ({"rewards": [{"function": "my.mod"}]}, "neither a built-in"),
        (
            {"rewards": [{"function": "m:f"}, {"function": "other:f"}]},
            "the names ['f'] repeat",
        ),
        ({"rewards": [{"function": "m:f"}], "num_generations": 1}, "num_generations"),
        ({"rewards": [{"function": "m:f"}], "loss_type": "ppo"}, "loss_type"),
    ],
)
def test_grpo_section_problems_are_one_line_each(grpo, expected):
    with pytest.raises(SpecError) as e:
        parse_spec(_spec(grpo))
    assert any(expected in p for p in e.value.problems), e.value.problems


def test_a_valid_grpo_spec_keeps_trl_names_and_defaults():
    spec = parse_spec(_spec({"rewards": [{"function": "exact_match", "column": "answer"}]}))
    g = spec.grpo
    assert (g.num_generations, g.loss_type, g.scale_rewards, g.beta, g.num_iterations) == (8, "dapo", "group", 0.0, 1)
    assert g.rewards[0].label == "exact_match" and spec.data.max_length == 512


# ---------------------------------------------------------------- data


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(TINY)
    ensure_chat_template(t)
    return t


def _frames(tmp_path, rows, **data):
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return grpo_data.load_prompt_frames(PromptData(train=str(path), eval_fraction=0.25, **data), 0)


def test_text_prompts_keep_every_other_column_for_the_rewards(tmp_path, tok):
    rows = [{"q": f"{i} + {i} =", "answer": 2 * i, "meta": {"k": [i]}} for i in range(8)] + [{"q": " ", "answer": 0}]
    frames = _frames(tmp_path, rows, prompt_column="q")
    assert frames.format == "text" and frames.dropped == {"train": 1}
    records = [json.loads(r) for r in pd.concat([frames.train, frames.eval])["record"]]
    assert {"prompt": "3 + 3 =", "columns": {"answer": 6, "meta": {"k": [3]}}} in records
    frame = pd.DataFrame({"record": [json.dumps({"prompt": "3 + 3 = what, exactly?", "columns": {}})]})
    full = tok("3 + 3 = what, exactly?")["input_ids"]
    cols = grpo_data.encode_prompts(frame, tok, max_length=4)
    assert len(full) > 4 and cols["prompt_ids"] == [full[-4:]] and cols["length"] == [4]  # the end kept


def test_chat_prompts_get_the_system_prompt_and_the_generation_prompt(tmp_path, tok):
    rows = [{"prompt": [{"role": "user", "content": f"say {i}"}], "want": str(i)} for i in range(8)]
    frames = _frames(tmp_path, rows, system_prompt="Be brief.")
    assert frames.format == "chat"
    rec = json.loads(frames.train["record"].iloc[0])
    assert rec["prompt"][0] == {"role": "system", "content": "Be brief."} and "want" in rec["columns"]
    cols = grpo_data.encode_prompts(frames.train, tok, max_length=512)
    text = tok.decode(cols["prompt_ids"][0])
    assert text.endswith("<|assistant|>\n") and "Be brief." in text
    # a micro-batch of prompts is left-padded, for generation
    collate = grpo_data.PromptCollate(_Rows(cols), pad_id=tok.pad_token_id or 0)
    batch = collate(np.arange(3))
    assert (batch.inputs["attention_mask"][:, -1] == 1).all() and len(batch.records) == 3


class _Rows:
    """A tokenized table as the collate reads it (a datasets.Dataset's row selection)."""

    def __init__(self, cols):
        self.cols = cols

    def __getitem__(self, ids):
        return {k: [v[i] for i in ids] for k, v in self.cols.items()}


def test_a_missing_prompt_column_names_the_columns(tmp_path):
    with pytest.raises(KubetuneError, match=r"data.prompt_column: column 'prompt' not found .* columns are \['q'\]"):
        _frames(tmp_path, [{"q": "x"}] * 4)


# ---------------------------------------------------------------- rewards


def _score(rewards: list[dict], completions, step: int = 5, **columns):
    scorers = R.scorers([Reward(**r) for r in rewards])
    ids = [[0] * len(str(c)) for c in completions]
    per_fn = R.score(scorers, ["p"] * len(completions), completions, ids, columns, step)
    return per_fn, R.total(per_fn, scorers)


def test_builtin_rewards():
    per_fn, _ = _score(
        [{"function": "exact_match", "column": "answer", "pattern": r"<a>(.*?)</a>"}],
        ["x <a> 42 </a>", "<a>41</a>", "42"],
        answer=[42, 42, 42],
    )
    assert per_fn[:, 0].tolist() == [1.0, 0.0, 0.0]
    per_fn, _ = _score([{"function": "exact_match", "column": "answer"}], [" yes\n", "no"], answer=["yes", "yes"])
    assert per_fn[:, 0].tolist() == [1.0, 0.0]
    per_fn, _ = _score([{"function": "regex", "pattern": r"^\d+$", "full": True}], ["123", "12a"])
    assert per_fn[:, 0].tolist() == [1.0, 0.0]
    per_fn, _ = _score([{"function": "regex", "pattern": r"\d", "share": True}], ["12 ab", "", "99"])
    assert per_fn[:, 0].tolist() == [0.5, 0.0, 1.0]
    # chat completions: the assistant message's content
    per_fn, _ = _score([{"function": "regex", "pattern": "ok"}], [[{"role": "assistant", "content": "ok"}]])
    assert per_fn[0, 0] == 1.0
    # DAPO's soft overlong penalty over completion tokens: 0 up to 6, then down to -1 at 10, -1 beyond
    per_fn, _ = _score([{"function": "length", "max_tokens": 10, "cache_tokens": 4}], ["x" * n for n in (6, 8, 10, 11)])
    assert per_fn[:, 0].tolist() == [0.0, -0.5, -1.0, -1.0]


def good(prompts, completions, completion_ids, **columns):
    return [float(len(c)) if c != "skip" else None for c in completions]


def raises(prompts, completions, completion_ids, **columns):
    raise ValueError("no parser for this")


def short(prompts, completions, completion_ids, **columns):
    return [1.0]


def nan(prompts, completions, completion_ids, **columns):
    return [math.nan for _ in completions]


def text(prompts, completions, completion_ids, **columns):
    return ["high" for _ in completions]


def test_user_functions_weights_and_none():
    sys.modules.setdefault("test_grpo_rewards", sys.modules[__name__])
    per_fn, total = _score(
        [{"function": "test_grpo_rewards:good", "weight": 0.5}, {"function": "regex", "pattern": "a", "weight": 2}],
        ["aa", "skip", "b"],
    )
    assert per_fn[0, 0] == 2.0 and np.isnan(per_fn[1, 0]) and per_fn[2, 0] == 1.0
    assert per_fn[:, 1].tolist() == [1.0, 0.0, 0.0]
    assert total.tolist() == [0.5 * 2 + 2 * 1.0, 0.0, 0.5 * 1 + 0.0]  # None counts as nothing (nansum)


@pytest.mark.parametrize(
    ("name", "expected"),
    [
        ("raises", "reward function raises raised ValueError: no parser for this at step 5"),
        ("short", "reward function short returned 1 values for 2 completions at step 5"),
        ("nan", "reward function nan returned 'nan' for completion 0 at step 5"),
        ("text", "reward function text returned 'high' for completion 0 at step 5"),
    ],
)
def test_a_failing_reward_function_is_one_line_naming_it_and_the_step(name, expected):
    sys.modules.setdefault("test_grpo_rewards", sys.modules[__name__])
    with pytest.raises(KubetuneError) as e:
        _score([{"function": f"test_grpo_rewards:{name}"}], ["a", "b"])
    assert str(e.value).startswith(f"grpo.rewards[0].function: {expected}"), str(e.value)
    assert "\n" not in str(e.value)


def test_an_unimportable_reward_function_says_where_it_must_be():
    with pytest.raises(
        KubetuneError, match=r"grpo.rewards\[0\].function: reward function nowhere_mod:f: cannot import"
    ):
        R.scorers([Reward(function="nowhere_mod:f")])
    with pytest.raises(KubetuneError, match="module 'json' has no 'nothing'"):
        R.scorers([Reward(function="json:nothing")])


# ---------------------------------------------------------------- the plan and the log-probabilities


def test_num_iterations_repeats_each_plan_step():
    plan = Repeated(["a", "b", "c"], 2)
    assert len(plan) == 6 and [plan[k] for k in range(6)] == ["a", "a", "b", "b", "c", "c"]
    with pytest.raises(IndexError):
        plan[6]


@pytest.mark.parametrize("mask_truncated", [False, True])
def test_rollout_micro_batches_label_completions_and_mask_truncated_ones(mask_truncated):
    from kubetune.tasks.grpo import GRPOSpec
    from kubetune.tasks.grpo.data import PromptBatch
    from kubetune.tasks.grpo.rollout import Rollouts, Sampled

    g = GRPOSpec(
        rewards=[Reward(function="regex", pattern="a")],
        num_generations=2,
        mask_truncated_completions=mask_truncated,
        loss_type="dapo",
    )
    tok = type("T", (), {"pad_token_id": 0})()
    r = Rollouts(g, tok, [], seed=0, rank=0, chat=False, eos_ids=[1])
    prompt = PromptBatch({}, torch.zeros(0), 1.0, torch.tensor([7]), [{"prompt": "p", "columns": {}}])
    sampled = Sampled(
        prompt_ids=[[5, 6], [5, 6]],
        completion_ids=[[9, 1], [9, 9, 9]],  # ended; truncated
        truncated=np.array([False, True]),
        texts=["", ""],
        prompts=["p", "p"],
        columns={},
    )
    (m,) = r._micro_batches([prompt], sampled, torch.tensor([1.0, -1.0]), torch.zeros(2))
    assert m.inputs["input_ids"].tolist() == [[5, 6, 9, 1, 0], [5, 6, 9, 9, 9]]
    assert m.inputs["attention_mask"].tolist() == [[1, 1, 1, 1, 0], [1, 1, 1, 1, 1]]
    assert m.labels[0].tolist() == [IGNORE, IGNORE, 9, 1, IGNORE]
    second = [IGNORE] * 5 if mask_truncated else [IGNORE, IGNORE, 9, 9, 9]
    assert m.labels[1].tolist() == second
    assert m.units == (2.0 if mask_truncated else 5.0)  # dapo: the completion tokens that carry a loss
    assert m.index.tolist() == [7, 7]


@pytest.mark.parametrize("lora", [False, True])
@pytest.mark.parametrize("temperature", [1.0, 0.7])
def test_chunked_head_log_probabilities_equal_the_models_logits(lora, temperature):
    from transformers import AutoModelForCausalLM

    from kubetune.data import Batch

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TINY)
    if lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", lora_dropout=0.0))
        for n, p in model.named_parameters():
            if "lora_B" in n:
                torch.nn.init.normal_(p, std=0.1)  # an adapter that changes the output
    ids = torch.randint(3, 2000, (3, 12))
    mask = torch.ones_like(ids)
    mask[2, 9:] = 0
    labels = torch.full_like(ids, IGNORE)
    labels[:, 6:] = ids[:, 6:]
    labels[2, 9:] = IGNORE
    batch = Batch({"input_ids": ids, "attention_mask": mask}, labels)
    logps, entropy = completion_logps(model, batch, temperature, torch.autocast("cpu", enabled=False))
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1]
    keep = labels[:, 1:] != IGNORE
    want = grpo_loss.token_logps(logits[keep], labels[:, 1:][keep], temperature)
    assert torch.allclose(logps, want, atol=1e-5), (logps - want).abs().max()
    assert torch.allclose(entropy, grpo_loss.token_entropy(logits[keep], temperature), atol=1e-4)
    logps.sum().backward()  # the gradient flows through the chunked head
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.parameters() if p.requires_grad)


def test_render_says_when_a_reward_module_is_not_in_the_trainer_image():
    from kubetune.backends.kubeflow import checks

    rewards = [{"function": "my_rewards:score"}, {"function": "json:loads"}, {"function": "numpy.linalg:norm"}]
    spec = parse_spec({**_spec({"rewards": rewards}), "output": {"uri": "s3://b/out"}})
    warnings = [w for w in checks.warnings_for(spec) if w.startswith("grpo.")]
    assert warnings == [
        "grpo.rewards[0].function: module 'my_rewards' must be importable in the pods, and the trainer image holds "
        "kubetune and its dependencies only — build kubernetes.image FROM the trainer image with your module installed"
    ]
    spec.kubernetes.image = "registry.example/me/trainer:1"  # an image of the user's own may hold it
    assert not [w for w in checks.warnings_for(spec) if w.startswith("grpo.")]


def test_kept_rollouts_resume_on_the_same_world_size_only_inside_a_generation():
    from kubetune.tasks.grpo import GRPOSpec
    from kubetune.tasks.grpo.rollout import RolloutBatch, Rollouts

    g = GRPOSpec(rewards=[Reward(function="regex", pattern="a")], num_iterations=2)
    tok = type("T", (), {"pad_token_id": 0})()
    kept = RolloutBatch(
        {"input_ids": torch.ones(1, 3, dtype=torch.long), "attention_mask": torch.ones(1, 3, dtype=torch.long)},
        torch.ones(1, 3, dtype=torch.long),
        1.0,
        torch.tensor([0]),
        torch.tensor([0.5]),
        stats=torch.zeros(1),
        grpo=g,
    )
    states = [Rollouts(g, tok, [], 0, rank, False, [1], cache=[kept], cache_units=2.0).state_dict() for rank in (0, 1)]
    same = Rollouts(g, tok, [], 0, 1, False, [1])
    same.load_state_dict(states, world_size=2, global_step=3)
    assert len(same.cache) == 1 and same.cache_units == 2.0 and same.cache[0].advantages.tolist() == [0.5]
    with pytest.raises(
        KubetuneError, match=r"distributed: the checkpoint of step 3 is inside a generation .* 2 processes"
    ):
        Rollouts(g, tok, [], 0, 0, False, [1]).load_state_dict(states, world_size=1, global_step=3)
    other = Rollouts(g, tok, [], 0, 0, False, [1])
    other.load_state_dict(states, world_size=1, global_step=4)  # a generation boundary: nothing kept is needed
    assert other.cache == []
