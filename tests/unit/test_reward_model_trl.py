"""The reward model checked against a peer: on the same model, data and batch, kubetune's tokens, per-batch loss
and logged metrics equal TRL's RewardTrainer (TRL 1.16, installed for the tests only), in the conversational and
the standard (text) formats, with and without a margin column and the centring coefficient, on a decoder (the
tiny Llama: its last real token scored) and an encoder (MiniLM: its pooled first token)."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from kubetune.tasks.common import ensure_chat_template
from kubetune.tasks.pairs import pair_record
from kubetune.tasks.reward_model import RewardData
from kubetune.tasks.reward_model import task as rm

trl = pytest.importorskip("trl")  # requirements-test.txt pins it: this skip only guards a partial install

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "src" / "kubetune" / "assets" / "tiny-llama"
PAIRS = ROOT / "src" / "kubetune" / "assets" / "sentiment" / "sentiment-preferences.jsonl"
N = 6
TOL = 1e-5


def _rows(fmt: str, margin: bool) -> list[dict]:
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()[:N]]
    rows[1]["chosen"][0]["content"] += " It mentions the delay twice and ends angry."  # sequences of other lengths
    rows[2]["rejected"][0]["content"] = "Not sure, the review mixes praise with a complaint about the food."
    if fmt == "text":
        rows = [{k: r[k][0]["content"] for k in ("prompt", "chosen", "rejected")} for r in rows]
    if margin:
        for i, r in enumerate(rows):
            r["margin"] = 0.25 * i - 0.5
    return rows


def _model_and_tokenizer(kind: str):
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    from kubetune import providers

    path = (
        TINY
        if kind == "llama"
        else providers.resolve("hf://sentence-transformers/all-MiniLM-L6-v2", kind="model", field="model.uri")
    )
    tok = AutoTokenizer.from_pretrained(path)
    ensure_chat_template(tok)  # the assets have none: both sides render with kubetune's fallback template
    tok.pad_token = tok.pad_token or tok.eos_token
    torch.manual_seed(0)
    model = AutoModelForSequenceClassification.from_pretrained(
        path, num_labels=1, dtype=torch.float32, pad_token_id=tok.pad_token_id
    )
    with torch.no_grad():  # a head that scores: the fresh one is near zero everywhere
        model.score.weight.normal_(0, 0.5) if kind == "llama" else model.classifier.weight.normal_(0, 0.5)
    for module in model.modules():  # both sides: the same forward (dropout off)
        if isinstance(module, torch.nn.Dropout):
            module.p = 0.0
    return model, tok


def _trl(model, tokenizer, rows, center, tmp_path):
    import datasets
    from trl import RewardConfig, RewardTrainer

    args = RewardConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=N,
        max_length=512,
        center_rewards_coefficient=center,
        report_to=[],
        use_cpu=True,
        bf16=False,
        fp16=False,
    )
    trainer = RewardTrainer(
        model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), processing_class=tokenizer
    )
    examples = [trainer.train_dataset[i] for i in range(N)]
    inputs = trainer.data_collator(examples)
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, inputs)
    return examples, float(loss.detach()), {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _kubetune(model, tokenizer, rows, center, margin: bool, tmp_path):
    import datasets

    spec = RewardData(train=str(tmp_path / "p.jsonl"), margin_column="margin" if margin else None)
    records = []
    for r in rows:
        record = pair_record(r, spec, "chat" if isinstance(r["chosen"], list) else "text")
        if margin:
            record["margin"] = r["margin"]
        records.append(json.dumps(record))
    cols = rm.encode(pd.DataFrame({"record": records}), tokenizer)
    batch = rm.Collate(datasets.Dataset.from_dict(cols), tokenizer.pad_token_id, center)(list(range(N)))
    model.train()
    loss_sum, pairs, stats = rm.loss(model, batch, torch.autocast("cpu", enabled=False))
    return cols, float(loss_sum.detach() / pairs), dict(zip(rm.METRICS, (stats / pairs).tolist()))


@pytest.mark.parametrize(
    "kind,fmt,margin,center",
    [
        ("llama", "chat", False, None),
        ("llama", "text", True, 0.01),
        ("minilm", "chat", True, None),
        ("minilm", "text", False, 0.5),
    ],
)
def test_loss_and_metrics_equal_trl(tmp_path, kind, fmt, margin, center):
    rows = _rows(fmt, margin)
    model, tokenizer = _model_and_tokenizer(kind)
    if tokenizer.eos_token is None and fmt == "text":
        # TRL's text format appends the EOS token to every answer and fails on a tokenizer without one (BERT's):
        # both sides get [SEP] as EOS (kubetune, without one, appends nothing)
        tokenizer.eos_token = tokenizer.sep_token
    examples, t_loss, t = _trl(model, tokenizer, rows, center, tmp_path)
    cols, k_loss, k = _kubetune(model, tokenizer, rows, center, margin, tmp_path)
    for key in ("chosen_ids", "rejected_ids"):  # the same tokens
        assert cols[key] == [e[key] for e in examples], key
    assert abs(k_loss - t_loss) < TOL, (k_loss, t_loss)
    for ours, theirs in (("accuracy", "accuracy"), ("margin", "margin"), ("mean_reward", "mean_reward")):
        assert abs(k[ours] - t[theirs]) < TOL * max(1.0, abs(t[theirs])), (ours, k[ours], t[theirs])
    assert 0 < t["accuracy"] < 1 or abs(t["margin"]) > 1e-3  # the scores are not all the same


def test_pairs_over_max_length_are_dropped_and_counted_as_trl_filters_them(tmp_path):
    import datasets

    from kubetune.errors import KubetuneError

    model, tokenizer = _model_and_tokenizer("llama")
    rows = _rows("text", margin=False)
    spec = RewardData(train=str(tmp_path / "p.jsonl"))
    cols = rm.encode(pd.DataFrame({"record": [json.dumps(pair_record(r, spec, "text")) for r in rows]}), tokenizer)
    ds = datasets.Dataset.from_dict(cols)
    limit = sorted(cols["length"])[2]  # the longer sequence of each pair decides, as in TRL's filter
    dropped: dict = {}
    kept = rm._within(ds, dropped, "train_too_long", limit)
    want = [i for i, (c, r) in enumerate(zip(cols["chosen_ids"], cols["rejected_ids"])) if max(len(c), len(r)) <= limit]
    assert kept["chosen_ids"] == [cols["chosen_ids"][i] for i in want] and dropped == {"train_too_long": N - len(want)}
    with pytest.raises(KubetuneError) as e:
        rm._within(ds, {}, "eval_too_long", 4)
    assert e.value.field == "data.max_length"
