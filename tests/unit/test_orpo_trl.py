"""ORPO checked against a peer: on the same model and micro-batch (kubetune's tokens and padding, handed to TRL in
its batch layout), kubetune's loss and every logged metric equal TRL 1.16's ORPOTrainer (trl.experimental.orpo)
within 1e-5, for the conversational and the standard (text) formats, a full model and a LoRA one, two λ. TRL's own
tokenization is its legacy one (its ORPO was not moved to the DPO tokenizer TRL's DPOTrainer uses now); kubetune
tokenizes ORPO's pairs as its DPO does, which tests/unit/test_dpo_trl.py holds equal to TRL's DPOTrainer."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pandas as pd
import pytest
import torch

from kubetune.tasks.common import ensure_chat_template
from kubetune.tasks.dpo import DPOSpec
from kubetune.tasks.orpo import ORPOData
from kubetune.tasks.orpo import task as orpo
from kubetune.tasks.pair_batches import PairCollate as Collate
from kubetune.tasks.pair_batches import encode_pairs
from kubetune.tasks.pairs import pair_record

trl = pytest.importorskip("trl")  # requirements-test.txt pins it: this skip only guards a partial install
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "src" / "kubetune" / "assets" / "tiny-llama"
PAIRS = ROOT / "src" / "kubetune" / "assets" / "sentiment" / "sentiment-preferences.jsonl"
N = 6
TOL = 1e-5
# kubetune's name -> TRL's
NAMES = {
    "reward_accuracy": "rewards/accuracies",
    "reward_chosen": "rewards/chosen",
    "reward_rejected": "rewards/rejected",
    "reward_margin": "rewards/margins",
    "logps_chosen": "logps/chosen",
    "logps_rejected": "logps/rejected",
    "nll_loss": "nll_loss",
    "log_odds_ratio": "log_odds_ratio",
    "log_odds_chosen": "log_odds_chosen",
}


def _rows(fmt: str) -> list[dict]:
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()[:N]]
    rows[1]["chosen"][0]["content"] += " It mentions the delay twice and ends angry."
    rows[2]["rejected"][0]["content"] = "Not sure, the review mixes praise with a complaint about the food."
    if fmt == "text":
        return [{k: r[k][0]["content"] for k in ("prompt", "chosen", "rejected")} for r in rows]
    return rows


@pytest.mark.parametrize("fmt,lora,beta", [("chat", False, 0.1), ("text", False, 0.5), ("chat", True, 0.2)])
def test_loss_and_metrics_equal_trl(tmp_path, fmt, lora, beta):
    import datasets
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl.experimental.orpo import ORPOConfig, ORPOTrainer

    tok = AutoTokenizer.from_pretrained(TINY)
    ensure_chat_template(tok)
    tok.pad_token = tok.pad_token or tok.eos_token
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    with torch.no_grad():  # moved away from the base, so that the answers' probabilities differ
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    rows = _rows(fmt)
    args = ORPOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=N, beta=beta, max_length=256,
                      report_to=[], use_cpu=True, bf16=False, fp16=False)  # fmt: skip
    trainer = ORPOTrainer(
        model=copy.deepcopy(model),
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tok,
        peft_config=LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules="all-linear") if lora else None,
    )
    if lora:
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.3 * torch.randn_like(p))
    policy = trainer.model

    spec = ORPOData(train=str(tmp_path / "p.jsonl"), max_length=256)
    records = [json.dumps(pair_record(r, spec, fmt)) for r in rows]
    cols = encode_pairs(pd.DataFrame({"record": records}), tok, spec.max_length)
    collate = Collate(datasets.Dataset.from_dict(cols), tok.pad_token_id, 256, DPOSpec(beta=beta), "")
    batch = collate(list(range(N)))
    policy.train()
    total, pairs, stats = orpo.loss(policy, batch, torch.autocast("cpu", enabled=False))
    k_loss, k = float(total.detach() / pairs), dict(zip(orpo.METRICS, (stats / pairs).tolist()))

    ids, mask, labels = batch.inputs["input_ids"], batch.inputs["attention_mask"], batch.labels
    trl_batch = {
        "chosen_input_ids": ids[:N], "chosen_attention_mask": mask[:N], "chosen_labels": labels[:N],
        "rejected_input_ids": ids[N:], "rejected_attention_mask": mask[N:], "rejected_labels": labels[N:],
    }  # fmt: skip
    t_loss, t = trainer.get_batch_loss_metrics(policy, trl_batch, "train")
    assert abs(k_loss - float(t_loss.detach())) < TOL, (k_loss, float(t_loss))
    for ours, theirs in NAMES.items():
        assert abs(k[ours] - t[theirs]) < TOL * max(1.0, abs(t[theirs])), (ours, k[ours], t[theirs])
    assert 0 < t["rewards/accuracies"] < 1 or abs(t["rewards/margins"]) > 1e-4
