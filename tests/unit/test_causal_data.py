"""Causal-LM data: formats, response-only labels, truncation, packing (logits equal packed vs alone)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import torch

from kubetune.errors import KubetuneError
from kubetune.tasks.causal_lm import CausalLMData
from kubetune.tasks.causal_lm.data import collate as collate_lm
from kubetune.tasks.causal_lm.data import encode_record, load_lm_frames, tokenize_frame
from kubetune.tasks.common import FALLBACK_CHAT_TEMPLATE, IGNORE, ensure_chat_template

TINY = Path(__file__).resolve().parents[2] / "src" / "kubetune" / "assets" / "tiny-llama"
# A Llama-3-style template (header markers, end-of-turn token) to check spans with a template
# other than the fallback one.
HEADER_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ '[' + m['role'] + ']\n\n' + m['content'] + '<|eos|>' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '[assistant]\n\n' }}{% endif %}"
)


@pytest.fixture(scope="module")
def tok():
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(TINY)
    assert not t.chat_template  # the asset exercises the fallback template
    ensure_chat_template(t)
    return t


def _target_text(tok, ids, labels) -> str:
    return tok.decode([t for t, lab in zip(ids, labels) if lab != IGNORE])


def test_instruction_record_labels_only_the_response(tok):
    rec = {
        "messages": [{"role": "user", "content": "Classify: I love it"}, {"role": "assistant", "content": "positive"}]
    }
    ids, labels = encode_record(rec, tok, 512, train_on_prompt=False)
    assert tok.chat_template == FALLBACK_CHAT_TEMPLATE
    assert ids[0] == tok.bos_token_id
    assert _target_text(tok, ids, labels) == "positive<|eos|>"
    n_prompt = labels.index(next(lab for lab in labels if lab != IGNORE))
    assert all(lab == IGNORE for lab in labels[:n_prompt]) and n_prompt > 5
    assert "Classify: I love it" in tok.decode(ids[:n_prompt])
    ids2, labels2 = encode_record(rec, tok, 512, train_on_prompt=True)
    assert ids2 == ids and labels2 == ids


def test_multi_turn_chat_labels_every_assistant_turn(tok):
    rec = {
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "Hi"},
            {"role": "assistant", "content": "Hello there"},
            {"role": "user", "content": "Mood?"},
            {"role": "assistant", "content": "neutral"},
        ]
    }
    ids, labels = encode_record(rec, tok, 512, train_on_prompt=False)
    assert _target_text(tok, ids, labels) == "Hello there<|eos|>neutral<|eos|>"


def test_spans_with_a_template_of_the_tokenizers_own(tok):
    from transformers import AutoTokenizer

    t = AutoTokenizer.from_pretrained(TINY)
    t.chat_template = HEADER_TEMPLATE
    assert ensure_chat_template(t) is False  # its own template is kept
    rec = {"messages": [{"role": "user", "content": "2+2?"}, {"role": "assistant", "content": "four"}]}
    ids, labels = encode_record(rec, t, 512, train_on_prompt=False)
    assert _target_text(t, ids, labels) == "four<|eos|>"


def test_text_rows_are_all_target_and_end_with_eos(tok):
    ids, labels = encode_record({"text": "just a document"}, tok, 512, train_on_prompt=False)
    assert labels == ids and ids[-1] == tok.eos_token_id and ids[0] == tok.bos_token_id


def test_truncation_at_max_length_and_rows_without_targets(tok):
    long_prompt = "word " * 300
    rec = {"messages": [{"role": "user", "content": long_prompt}, {"role": "assistant", "content": "positive"}]}
    ids, labels = encode_record(rec, tok, 32, train_on_prompt=False)
    assert len(ids) == 32 and all(lab == IGNORE for lab in labels)  # the response fell off the end
    cols = tokenize_frame(pd.DataFrame({"record": [json.dumps(rec)]}), tok, 32, train_on_prompt=False)
    assert cols["n_targets"] == [0] and cols["length"] == [32]


@pytest.mark.parametrize(
    ("rows", "extra", "expected"),
    [
        ([{"text": "a b c"}, {"text": "d e"}], {}, "text"),
        (
            [
                {"instruction": "Say hi", "input": "", "output": "hi"},
                {"instruction": "Say yo", "input": "now", "output": "yo"},
            ],
            {},
            "instruction",
        ),
        ([{"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": "y"}]}] * 2, {}, "chat"),
        (
            [{"q": "Say hi", "a": "hi"}] * 2,
            {"format": "instruction", "instruction_column": "q", "output_column": "a", "input_column": None},
            "instruction",
        ),
    ],
)
def test_formats_are_detected_and_normalized(tmp_path, rows, extra, expected):
    path = tmp_path / "d.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows * 5))
    frames = load_lm_frames(CausalLMData(train=str(path), eval=str(path), **extra), seed=0)
    assert frames.format == expected
    rec = json.loads(frames.train["record"][0])
    if expected == "text":
        assert rec == {"text": "a b c"}
    else:
        assert [m["role"] for m in rec["messages"]] == ["user", "assistant"]
    if expected == "instruction" and not extra:
        assert json.loads(frames.train["record"][1])["messages"][0]["content"] == "Say yo\n\nnow"


def test_system_prompt_is_prepended(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"instruction": "Say hi", "output": "hi"}) + "\n")
    frames = load_lm_frames(CausalLMData(train=str(path), eval=str(path), system_prompt="You are terse."), seed=0)
    assert json.loads(frames.train["record"][0])["messages"][0] == {"role": "system", "content": "You are terse."}


@pytest.mark.parametrize(
    ("row", "extra", "field", "needle"),
    [
        ({"prompt": "x"}, {"format": "chat"}, "data.messages_column", "column 'messages' not found"),
        ({"messages": "not json"}, {}, "data.messages_column", "not a JSON list"),
        (
            {"messages": [{"role": "wizard", "content": "x"}]},
            {},
            "data.messages_column",
            "unknown message role 'wizard'",
        ),
        ({"messages": [{"text": "x"}]}, {}, "data.messages_column", "list of {role, content}"),
        ({"instruction": "x", "output": ""}, {}, "data.train", "no usable rows"),
    ],
)
def test_bad_causal_data_gives_one_line_errors(tmp_path, row, extra, field, needle):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(row) + "\n")
    with pytest.raises(KubetuneError) as e:
        load_lm_frames(CausalLMData(train=str(path), eval=str(path), **extra), seed=0)
    assert e.value.field == field and needle in str(e.value) and "\n" not in str(e.value)


PACKED_TEXTS = [
    "the first example, a little longer than the others",
    "second",
    "and a third one here",
    "a fourth: with more words than the second and the third, and the longest of the six",
    "fifth",
    "the sixth example",
]


@pytest.mark.parametrize("attn", ["sdpa", "kubetune", "kubetune-eager"])
def test_packed_examples_do_not_attend_to_each_other(tok, attn, monkeypatch, request):
    """An example's logits are the same packed with others as alone, within 1e-5: with transformers'
    dense block-diagonal mask (sdpa) and with kubetune's packed attention, which builds no mask; the
    padded batch goes to the fallback attention, sdpa or (bf16 on a CPU) the model's own eager one."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM

    from kubetune.tasks import attention

    fallback = "eager" if attn.endswith("eager") else "sdpa"
    impl = attention.register(fallback) if attn.startswith("kubetune") else attn
    request.addfinalizer(attention.register)  # the default fallback again for the tests after this one
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32, attn_implementation=impl).eval()
    # As in training: without a KV cache, transformers reads packed sequences from the position ids.
    model.config.use_cache = False
    rows = [encode_record({"text": t}, tok, 64, train_on_prompt=False) for t in PACKED_TEXTS]
    ds = Dataset.from_dict({"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows]})
    n = len(rows)
    packed = collate_lm(ds, np.arange(n), tok.pad_token_id, packing=True)
    assert packed.inputs["input_ids"].shape == (1, sum(len(r[0]) for r in rows))
    assert "attention_mask" not in packed.inputs
    starts = np.cumsum([0] + [len(r[0]) for r in rows])
    assert all(packed.labels[0, s].item() == IGNORE for s in starts[:-1])  # never predicted across examples
    if attn != "sdpa":  # no (length)² mask is built for a packed row
        import transformers.masking_utils as mu

        def no_mask(*a, **k):
            raise AssertionError("a dense mask was built for a packed row")

        monkeypatch.setitem(mu.ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, fallback, no_mask)
    with torch.no_grad(), attention.packed_call():
        together = model(**packed.inputs).logits[0]
    monkeypatch.undo()
    with torch.no_grad():
        padded = collate_lm(ds, np.arange(n), tok.pad_token_id, packing=False)
        batched = model(**padded.inputs).logits  # padded rows with a mask: the fallback attention
        for k, (ids, _) in enumerate(rows):
            alone = model(input_ids=torch.tensor([ids])).logits[0]
            assert torch.allclose(together[starts[k] : starts[k + 1]], alone, atol=1e-5), k
            assert torch.allclose(batched[k, : len(ids)], alone, atol=1e-5), k
    # Had the mask let examples see each other, the second example's logits would differ:
    with torch.no_grad():
        leaky = model(input_ids=packed.inputs["input_ids"]).logits[0]  # one long sequence, no position reset
    assert not torch.allclose(
        leaky[starts[1] : starts[2]], model(input_ids=torch.tensor([rows[1][0]])).logits[0], atol=1e-3
    )


def test_packed_attention_gradients_equal_the_dense_mask_ones(tok, monkeypatch):
    """Loss and every parameter's gradient of a packed row: kubetune's packed attention (documents
    grouped by length, padded, causal SDPA) against transformers' dense-mask SDPA, within 1e-5;
    grouped-query attention (2 kv heads for 4 query heads) included; the documents' layout is worked
    out once per forward pass."""
    from datasets import Dataset
    from transformers import AutoConfig, AutoModelForCausalLM

    from kubetune.tasks import attention

    cfg = AutoConfig.from_pretrained(TINY)
    cfg.num_key_value_heads = max(1, cfg.num_attention_heads // 2)
    rows = [encode_record({"text": t}, tok, 64, train_on_prompt=False) for t in PACKED_TEXTS]
    ds = Dataset.from_dict({"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows]})
    batch = collate_lm(ds, np.arange(len(rows)), tok.pad_token_id, packing=True)
    grads, calls = {}, []
    documents = attention.documents

    def counted(*args):
        calls.append(1)
        return documents(*args)

    monkeypatch.setattr(attention, "documents", counted)
    for impl in ("sdpa", attention.register()):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=impl, dtype=torch.float32)
        model.config.use_cache = False
        with attention.packed_call():
            out = model(**batch.inputs, labels=batch.labels)
        out.loss.backward()
        grads[impl] = (out.loss.detach(), {k: p.grad for k, p in model.named_parameters()})
    # kubetune's run read the documents once for its forward pass, not once per layer
    assert cfg.num_hidden_layers > 1 and len(calls) == 1
    (loss_a, ga), (loss_b, gb) = grads.values()
    assert abs(loss_a - loss_b) < 1e-5
    worst = max((ga[k] - gb[k]).abs().max().item() for k in ga)
    assert worst < 1e-5, worst
    assert all(ga[k].abs().max() > 0 for k in ga if "embed" not in k)  # every weight took part


def test_padding_collate_masks_padding(tok):
    from datasets import Dataset

    ds = Dataset.from_dict({"input_ids": [[5, 6, 7], [8]], "labels": [[5, 6, 7], [IGNORE]]})
    b = collate_lm(ds, np.array([0, 1]), pad_id=tok.pad_token_id)
    assert b.inputs["input_ids"].tolist() == [[5, 6, 7], [8, tok.pad_token_id, tok.pad_token_id]]
    assert b.inputs["attention_mask"].tolist() == [[1, 1, 1], [1, 0, 0]]
    assert b.labels.tolist() == [[5, 6, 7], [IGNORE] * 3]
    assert b.weight == 1.0 and b.index.tolist() == [0, 1]
    empty = collate_lm(ds, np.array([], dtype=np.int64), pad_id=0)
    assert empty.weight == 0.0 and empty.index.tolist() == [0]


def test_compiled_blocks_equal_eager_and_compile_once_for_all_packed_lengths(tok):
    """training.compile: every transformer block compiled in place. On packed rows of three lengths,
    the loss and every gradient equal the eager model's within 1e-5, and the third length compiles
    no new graph (dynamic shapes: no recompile per packed length). The backend is aot_eager: the
    graph capture, its breaks around the packed attention and the recompiles are what kubetune
    decides; inductor's code generation is torch's (timed in benchmarks/sft_trl.py --ablations)."""
    import contextlib

    from datasets import Dataset
    from torch._dynamo.utils import counters
    from transformers import AutoConfig, AutoModelForCausalLM

    from kubetune.tasks import attention
    from kubetune.tasks.causal_lm import task as causal_lm
    from kubetune.training.runtime import compile_blocks

    cfg = AutoConfig.from_pretrained(TINY)
    rows = [encode_record({"text": t}, tok, 64, train_on_prompt=False) for t in PACKED_TEXTS]
    ds = Dataset.from_dict({"input_ids": [r[0] for r in rows], "labels": [r[1] for r in rows]})
    batches = [collate_lm(ds, np.arange(k), tok.pad_token_id, packing=True) for k in (6, 4, 2)]
    assert len({b.inputs["input_ids"].shape[1] for b in batches}) == 3
    results, graphs = {}, []
    torch._dynamo.reset()
    for compiled in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg, attn_implementation=attention.register(), dtype=torch.float32)
        model.config.use_cache = False
        if compiled:
            assert compile_blocks(model, backend="aot_eager") == cfg.num_hidden_layers
        out = []
        for batch in batches:
            loss_sum, count, _ = causal_lm.loss(model, batch, contextlib.nullcontext())
            (loss_sum / count).backward()
            out.append(((loss_sum / count).detach(), {k: p.grad.clone() for k, p in model.named_parameters()}))
            model.zero_grad()
            graphs.append(counters["stats"]["unique_graphs"])
        results[compiled] = out
    for (loss_a, ga), (loss_b, gb) in zip(results[False], results[True]):
        assert abs(loss_a - loss_b) < 1e-5
        assert max((ga[k] - gb[k]).abs().max().item() for k in ga) < 1e-5
    eager_graphs, compiled_graphs = graphs[:3], graphs[3:]
    assert eager_graphs == [0, 0, 0] and compiled_graphs[0] > 0
    assert compiled_graphs[2] == compiled_graphs[1], compiled_graphs  # the third length: no new graph
    torch._dynamo.reset()
