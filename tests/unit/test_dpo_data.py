"""DPO data and spec: TRL's formats (text pairs, conversational with an explicit or an implicit prompt, strings
rendered as chat), any column names, a system prompt, the batch layout (chosen rows then rejected
rows, labels on answer tokens only, keep_start truncation), what is dropped and counted, and one-line
errors for a missing column or malformed messages, the dpo section's checks, and the model card."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from kubetune.data.rows import RowSplit
from kubetune.errors import KubetuneError
from kubetune.tasks import pair_batches as dpo_data
from kubetune.tasks.common import IGNORE, ensure_chat_template
from kubetune.tasks.dpo import DPOSpec, PreferenceData
from kubetune.tasks.dpo import task as dpo
from kubetune.tasks.pairs import load_pair_frames, with_answers

TINY = Path(__file__).resolve().parents[2] / "src" / "kubetune" / "assets" / "tiny-llama"


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(TINY)
    ensure_chat_template(t)
    return t


def _write(tmp_path: Path, rows: list[dict], name: str = "pairs.jsonl") -> Path:
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _frames(tmp_path, rows, **data) -> RowSplit:
    spec = PreferenceData(train=str(_write(tmp_path, rows)), eval_fraction=0.25, **data)
    return load_pair_frames(spec, 0)


def _records(frames: RowSplit) -> list[dict]:
    return [json.loads(r) for r in pd.concat([frames.train, frames.eval])["record"]]


def _user(text: str) -> dict:
    return {"role": "user", "content": text}


def _bot(text: str) -> dict:
    return {"role": "assistant", "content": text}


def test_text_pairs_with_any_column_names(tmp_path):
    rows = [{"q": f"Is {i} even?", "good": "yes" if i % 2 == 0 else "no", "bad": "maybe"} for i in range(8)]
    frames = _frames(tmp_path, rows, prompt_column="q", chosen_column="good", rejected_column="bad")
    assert frames.format == "text" and len(frames.train) == 6 and len(frames.eval) == 2
    assert {"prompt": "Is 0 even?", "chosen": "yes", "rejected": "maybe"} in _records(frames)


def test_conversational_explicit_and_implicit_prompt_give_the_same_pairs(tmp_path):
    explicit = [
        {"prompt": [_user(f"Hi {i}")], "chosen": [_bot("Hello!")], "rejected": [_bot("Go away.")]} for i in range(4)
    ]
    implicit = [
        {"chosen": [_user(f"Hi {i}"), _bot("Hello!")], "rejected": [_user(f"Hi {i}"), _bot("Go away.")]}
        for i in range(4)
    ]
    a = _records(_frames(tmp_path, explicit))
    b = _records(_frames(tmp_path, implicit))
    assert a == b
    assert sorted(r["prompt"][0]["content"] for r in a) == [f"Hi {i}" for i in range(4)]
    assert all(r["chosen"] == [_bot("Hello!")] and r["rejected"] == [_bot("Go away.")] for r in a)


def test_strings_as_chat_and_a_system_prompt(tmp_path):
    rows = [{"prompt": "Say hi", "chosen": "Hi!", "rejected": "No."}] * 4
    rec = _records(_frames(tmp_path, rows, format="chat", system_prompt="Be kind."))[0]
    assert rec == {
        "prompt": [{"role": "system", "content": "Be kind."}, _user("Say hi")],
        "chosen": [_bot("Hi!")],
        "rejected": [_bot("No.")],
    }


def test_pairs_without_a_preference_or_an_answer_are_dropped_and_counted(tmp_path):
    rows = [{"prompt": f"p{i}", "chosen": "a", "rejected": "b"} for i in range(6)]
    rows += [{"prompt": "same", "chosen": "a", "rejected": "a"}, {"prompt": "empty", "chosen": " ", "rejected": "b"}]
    # an empty prompt, text or chat: dropped, as the warning says (issue 30: they were trained on)
    rows += [{"prompt": "", "chosen": "a", "rejected": "b"}, {"prompt": "  ", "chosen": "a", "rejected": "b"}]
    frames = _frames(tmp_path, rows)
    assert frames.dropped == {"train": 4} and len(frames.train) + len(frames.eval) == 6
    assert all(r["prompt"].strip() for r in _records(frames))
    chat = [{"prompt": [_user(f"Hi {i}")], "chosen": [_bot("Hello!")], "rejected": [_bot("Go.")]} for i in range(4)]
    chat += [{"prompt": [_user("")], "chosen": [_bot("Hello!")], "rejected": [_bot("Go.")]}]
    chat += [{"prompt": [], "chosen": [_bot("Hello!")], "rejected": [_bot("Go.")]}]
    frames = _frames(tmp_path, chat)
    assert frames.dropped == {"train": 2} and len(frames.train) + len(frames.eval) == 4


def test_a_missing_column_is_one_line_naming_the_field(tmp_path):
    with pytest.raises(KubetuneError) as e:
        _frames(tmp_path, [{"prompt": "p", "preferred": "a", "rejected": "b"}] * 4)
    msg = str(e.value)
    assert e.value.field == "data.chosen_column" and "'chosen' not found" in msg and "preferred" in msg
    assert "\n" not in msg


def test_malformed_messages_are_one_line(tmp_path):
    rows = [{"prompt": [_user("hi")], "chosen": [{"speaker": "bot", "text": "x"}], "rejected": [_bot("y")]}] * 4
    with pytest.raises(KubetuneError) as e:
        _frames(tmp_path, rows, format="chat")
    assert e.value.field == "data.chosen_column" and "role, content" in str(e.value)
    rows = [{"prompt": [_user("hi")], "chosen": [{"role": "robot", "content": "x"}], "rejected": [_bot("y")]}] * 4
    with pytest.raises(KubetuneError, match="unknown message role 'robot'"):
        _frames(tmp_path, rows)


def test_batch_layout_labels_and_truncation(tok):
    import datasets

    records = [
        {"prompt": [_user("Rate: great food")], "chosen": [_bot("positive")], "rejected": [_bot("I cannot tell.")]},
        {"prompt": [_user("Rate: " + "cold soup " * 20)], "chosen": [_bot("negative")], "rejected": [_bot("Maybe.")]},
    ]
    frame = pd.DataFrame({"record": [json.dumps(r) for r in records]})
    cols = dpo_data.encode_pairs(frame, tok, 512)
    # the prompt ends with the generation prompt; the answers hold the reply and its end of turn
    assert tok.decode(cols["prompt_ids"][0]).endswith("<|assistant|>\n")
    assert tok.decode(cols["chosen_ids"][0]) == "positive" + tok.eos_token
    ds = datasets.Dataset.from_dict(cols)
    short = len(cols["prompt_ids"][1]) + 2  # the long pair keeps 2 answer tokens at this length
    batch = dpo_data.PairCollate(ds, tok.pad_token_id, short, DPOSpec(), key="")([0, 1])
    ids, labels = batch.inputs["input_ids"], batch.labels
    assert ids.shape[0] == 4  # chosen 0, chosen 1, rejected 0, rejected 1
    for row, (pair, key) in enumerate([(0, "chosen_ids"), (1, "chosen_ids"), (0, "rejected_ids"), (1, "rejected_ids")]):
        answer = cols[key][pair][: max(short - len(cols["prompt_ids"][pair]), 0)]
        assert [t for t in labels[row].tolist() if t != IGNORE] == answer
        assert int(batch.inputs["attention_mask"][row].sum()) == min(
            len(cols["prompt_ids"][pair]) + len(cols[key][pair]), short
        )
    assert labels.shape[1] <= short and int((labels[1] != IGNORE).sum()) == 2


def test_prompts_that_fill_max_length_are_dropped(tok):
    import datasets

    records = [{"prompt": "x " * (60 if i == 0 else 2), "chosen": "a", "rejected": "b"} for i in range(4)]
    frame = pd.DataFrame({"record": [json.dumps(r) for r in records]})
    ds = datasets.Dataset.from_dict(dpo_data.encode_pairs(frame, tok, 16))
    dropped: dict = {}
    kept = with_answers(ds, dropped, "train_truncated", 16)
    assert dropped == {"train_truncated": 1} and len(kept) == 3
    assert all(len(p) < 16 for p in kept["prompt_ids"])
    with pytest.raises(KubetuneError) as e:
        with_answers(ds.select([0]), {}, "train_truncated", 16)
    assert e.value.field == "data.max_length"
    # the split is named: a 2-pair eval split all over max_length said "every prompt" of a train split that was fine
    with pytest.raises(KubetuneError) as e:
        with_answers(ds.select([0]), {}, "eval_truncated", 16)
    assert "every prompt of the 1 eval pairs takes 16 tokens or more" in str(e.value)
    assert "give data.eval pairs with shorter prompts" in str(e.value)


def test_the_dpo_section_belongs_to_task_dpo(tmp_path):
    from kubetune.config import parse_spec

    base = {"name": "x", "model": {"uri": "m"}, "output": {"uri": str(tmp_path / "o")}}
    spec = parse_spec({**base, "task": "dpo", "data": {"train": "pairs.jsonl", "chosen_column": "good"}})
    assert spec.dpo is None and spec.data.chosen_column == "good"  # absent: the defaults (beta 0.1, sigmoid)
    with pytest.raises(KubetuneError) as e:
        parse_spec({**base, "task": "causal-lm", "data": {"train": "t.jsonl"}, "dpo": {"beta": 0.5}})
    assert "dpo: applies to task dpo, and this job's task is causal-lm" in str(e.value)
    with pytest.raises(KubetuneError) as e:
        parse_spec(
            {**base, "task": "dpo", "data": {"train": "t.jsonl"}, "dpo": {"loss_type": "ipo", "label_smoothing": 0.1}}
        )
    assert "dpo.label_smoothing applies to dpo.loss_type sigmoid" in str(e.value)


def test_the_model_card_says_dpo_and_from_which_base(tmp_path):
    from kubetune.artifacts.hub import model_card
    from kubetune.config import parse_spec

    spec = parse_spec(
        {
            "name": "my-dpo",
            "task": "dpo",
            "model": {"uri": "hf://org/my-sft-model"},
            "data": {"train": "pairs.jsonl"},
            "lora": {"r": 8},
            "dpo": {"beta": 0.2},
            "output": {"uri": "hf://org/my-dpo"},
        }
    )
    metrics = {
        "eval_reward_accuracy": 0.95,
        "eval_reward_margin": 1.5,
        "eval_loss": 0.2,
        "eval_pairs": 40,
        "dpo_loss": "sigmoid",
        "dpo_beta": 0.2,
        "dpo_reference": "the base model (LoRA adapter disabled)",
        "data_format": "chat",
        "chat_template": "tokenizer",
    }
    card = model_card(spec, "org/my-dpo-model", metrics, dpo.TASK.present)
    assert "base_model: org/my-sft-model" in card and "pipeline_tag: text-generation" in card
    assert "Preference-tuned with DPO (sigmoid loss, beta 0.2)" in card and "reward accuracy is 0.9500" in card


def test_a_task_that_is_not_a_name_is_one_field_error():
    from kubetune.config import parse_spec

    with pytest.raises(KubetuneError) as e:  # was: TypeError (unhashable) from the cross-section checks
        parse_spec(
            {"name": "x", "task": ["dpo"], "model": {"uri": "m"}, "data": {"train": "t"}, "output": {"uri": "o"}}
        )
    assert "task" in str(e.value) and "unhashable" not in str(e.value)
