"""The fast causal-LM tokenization (issue 66) gives today's tokens: the fallback chat template written
without jinja and the labels found by bisection match the jinja render and the per-token mask, on the
packaged sentiment-chat data and the tiny tokenizer, with documents and train_on_prompt."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest

from kubetune.tasks.causal_lm import data as lm
from kubetune.tasks.common import FALLBACK_CHAT_TEMPLATE, IGNORE, ensure_chat_template

ASSETS = Path(__file__).resolve().parents[2] / "src" / "kubetune" / "assets"
TINY = ASSETS / "tiny-llama"
CHAT = ASSETS / "sentiment" / "sentiment-chat.jsonl"
# Conversations the packaged data lacks: a system turn, several assistant turns, an assistant turn first,
# text that looks like markup or a template, newlines, non-ASCII, an empty user turn.
ODD = [
    [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi {{ bos_token }} {% if x %}"},
        {"role": "assistant", "content": "Hello\n\nthere <|user|>"},
        {"role": "user", "content": ""},
        {"role": "assistant", "content": "  neutral  "},
    ],
    [{"role": "assistant", "content": "I speak first"}, {"role": "user", "content": "ok"}],
    [{"role": "user", "content": "Ünïcødé — 東京 🚀"}, {"role": "assistant", "content": "positive"}],
    [{"role": "tool", "content": '{"x": 1}'}, {"role": "assistant", "content": "done"}],
]


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(TINY)
    ensure_chat_template(t)
    assert t.chat_template == FALLBACK_CHAT_TEMPLATE
    return t


def _records() -> list[dict]:
    rows = [json.loads(line) for line in CHAT.read_text(encoding="utf-8").splitlines() if line.strip()]
    docs = [{"text": "just a document"}, {"text": "word " * 300}]
    return [{"messages": r["messages"]} for r in rows] + [{"messages": m} for m in ODD] + docs


def _reference(records: list[dict], tok, max_length: int, train_on_prompt: bool) -> dict[str, list]:
    """Today's tokenization, row by row: jinja's render, transformers' call, the per-token mask."""
    out: dict[str, list] = {"input_ids": [], "labels": [], "length": [], "n_targets": []}
    for rec in records:
        if "text" in rec:
            ids = (tok(rec["text"], add_special_tokens=True)["input_ids"] + [tok.eos_token_id])[:max_length]
            labels, n = list(ids), max(len(ids) - 1, 0)
        else:
            text, spans = lm._rendered_spans(tok, [rec["messages"]])[0]
            enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = enc["input_ids"][:max_length]
            if train_on_prompt:
                labels, n = list(ids), max(len(ids) - 1, 0)
            else:
                starts = np.array([s for s, _ in enc["offset_mapping"][:max_length]], dtype=np.int64)
                inside = np.zeros(len(ids), dtype=bool)
                for a, b in spans:
                    inside |= (starts >= a) & (starts < b)
                labels = [t if keep else IGNORE for t, keep in zip(ids, inside)]
                n = int(inside[1:].sum())
        for key, value in zip(out, (ids, labels, len(ids), n)):
            out[key].append(value)
    return out


# One case in make test (2-3 s each on 2 cores); the other three in make test-e2e.
@pytest.mark.parametrize(
    "max_length, train_on_prompt",
    [
        (256, False),
        pytest.param(256, True, marks=pytest.mark.e2e),
        pytest.param(24, False, marks=pytest.mark.e2e),
        pytest.param(24, True, marks=pytest.mark.e2e),
    ],
)
def test_tokenize_frame_gives_todays_tokens(tok, max_length, train_on_prompt):
    records = _records()
    frame = pd.DataFrame({"record": [json.dumps(r) for r in records]})
    got = lm.tokenize_frame(frame, tok, max_length, train_on_prompt)
    want = _reference(records, tok, max_length, train_on_prompt)
    assert got == want
    assert train_on_prompt or sum(got["n_targets"]) > 0  # labels were set: the comparison is not of empties


def test_fallback_template_is_written_without_jinja(tok, monkeypatch):
    conversations = [json.loads(line)["messages"] for line in CHAT.read_text().splitlines()[:50]] + ODD
    rendered = lm._rendered_spans(tok, conversations)

    def no_jinja(*args, **kwargs):
        raise AssertionError("jinja rendered a conversation the fallback template writes directly")

    monkeypatch.setattr(lm, "_rendered_spans", no_jinja)
    assert lm.assistant_spans_batch(tok, conversations) == rendered


def test_other_templates_and_missing_tokens_are_rendered(tok, monkeypatch):
    from transformers import AutoTokenizer

    other = AutoTokenizer.from_pretrained(TINY)
    other.chat_template = FALLBACK_CHAT_TEMPLATE.replace("<|", "<<")
    assert lm._fallback_tokens(other) is None
    calls = []
    monkeypatch.setattr(lm, "_rendered_spans", lambda t, c: calls.append(c) or [])
    lm.assistant_spans_batch(other, ODD)
    lm.assistant_spans_batch(tok, [[{"role": "user", "content": 3}]])  # not text: jinja's str() of it
    assert len(calls) == 2


@pytest.mark.parametrize(
    ("offsets", "spans"),
    [
        ([(0, 1), (1, 3), (3, 4), (4, 6), (6, 7)], [(1, 4)]),
        ([(0, 1), (1, 3), (3, 4), (4, 6), (6, 7)], [(0, 2), (3, 7)]),
        ([(0, 1), (1, 3), (3, 4), (4, 6), (6, 7)], [(1, 4), (2, 5)]),  # overlapping: shared tokens once
        ([(0, 1), (2, 3), (1, 2), (3, 4), (4, 5)], [(1, 3)]),  # starts that go back: the mask decides
        ([(0, 1), (1, 2), (1, 2), (2, 3)], [(1, 2)]),  # tokens that share a start
        ([(0, 1), (1, 2)], []),
    ],
)
def test_labels_by_bisection_equal_the_mask(offsets, spans):
    ids = [10, 11, 12, 13, 14][: len(offsets)]
    for max_length in (len(ids), 2):
        want = lm._labelled_mask(ids[:max_length], [s for s, _ in offsets[:max_length]], spans)
        assert lm._labelled(ids, offsets, spans, max_length, False) == want
