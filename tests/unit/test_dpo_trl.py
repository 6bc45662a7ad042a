"""DPO checked against a peer: on the same model, data, batch and beta, kubetune's tokens, per-batch
loss and rewards equal TRL's DPOTrainer (TRL 1.16, installed for the tests only), for a full
fine-tune (a separate reference model in TRL, kubetune's precomputed reference pass) and for LoRA
(the adapter disabled, in both), with the sigmoid and the IPO loss, in the conversational and the
standard (text) formats."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pandas as pd
import pytest
import torch

from kubetune.distributed import DistEnv
from kubetune.tasks import pair_batches
from kubetune.tasks.common import ensure_chat_template
from kubetune.tasks.dpo import DPOSpec, PreferenceData
from kubetune.tasks.dpo import task as dpo
from kubetune.tasks.pairs import pair_record
from kubetune.tasks.reference import reference_pass

trl = pytest.importorskip("trl")  # requirements-test.txt pins it: this skip only guards a partial install

TINY = Path(__file__).resolve().parents[2] / "src" / "kubetune" / "assets" / "tiny-llama"
PAIRS = (
    Path(__file__).resolve().parents[2] / "src" / "kubetune" / "assets" / "sentiment" / "sentiment-preferences.jsonl"
)
N = 6  # pairs in the batch
TOL = 1e-5
MAX_LENGTH = 256


def _rows(fmt: str) -> list[dict]:
    rows = [json.loads(line) for line in PAIRS.read_text().splitlines()[:N]]
    rows[1]["chosen"][0]["content"] += " It mentions the delay twice and ends angry."  # answers of other lengths
    rows[2]["rejected"][0]["content"] = "Not sure, the review mixes praise with a complaint about the food."
    if fmt == "text":
        return [{k: r[k][0]["content"] for k in ("prompt", "chosen", "rejected")} for r in rows]
    return rows


@pytest.fixture(scope="module")
def tokenizer():
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(TINY)
    ensure_chat_template(tok)  # the asset has none: both sides render with kubetune's fallback template
    tok.pad_token = tok.pad_token or tok.eos_token
    return tok


def _trainer(lora: bool, tokenizer, rows, loss_type: str, beta: float, tmp_path):
    """TRL's DPOTrainer on the tiny Llama, and (policy, reference) for kubetune: for a full fine-tune
    the policy is the model with every weight moved and the reference the model itself; for LoRA the
    policy is TRL's own PEFT model (a new adapter, so its reference is the adapter disabled) with
    random adapter matrices, the reference None."""
    import datasets
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM
    from trl import DPOConfig, DPOTrainer

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)
    base.config.use_cache = False
    policy, reference = copy.deepcopy(base), base
    if not lora:
        with torch.no_grad():
            for p in policy.parameters():
                p.add_(0.02 * torch.randn_like(p))
    args = DPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=N,
        beta=beta,
        loss_type=[loss_type],
        max_length=MAX_LENGTH,
        report_to=[],
        use_cpu=True,
        bf16=False,
        fp16=False,
        disable_dropout=True,
    )
    trainer = DPOTrainer(
        model=policy,
        ref_model=None if lora else reference,
        args=args,
        train_dataset=datasets.Dataset.from_list(rows),
        processing_class=tokenizer,
        peft_config=LoraConfig(task_type="CAUSAL_LM", r=4, lora_alpha=8, target_modules="all-linear") if lora else None,
    )
    if lora:
        assert "ref" not in trainer.model.peft_config  # TRL's reference: the adapter disabled
        with torch.no_grad():
            for name, p in trainer.model.named_parameters():
                if "lora_" in name:
                    p.copy_(0.3 * torch.randn_like(p))
        return trainer, trainer.model, None
    return trainer, policy, reference


def _trl(trainer):
    examples = [trainer.train_dataset[i] for i in range(N)]
    inputs = trainer.data_collator(examples)
    trainer.model.train()
    loss = trainer.compute_loss(trainer.model, inputs)
    return examples, float(loss.detach()), {k: v[-1] for k, v in trainer._metrics["train"].items()}


def _kubetune(policy, reference, tokenizer, rows, dpo_spec: DPOSpec, tmp_path):
    spec = PreferenceData(train=str(tmp_path / "pairs.jsonl"), max_length=MAX_LENGTH, eval_fraction=0.5)
    frame = pd.DataFrame({"record": [json.dumps(r) for r in (_record(r, spec) for r in rows)]})
    cols = pair_batches.encode_pairs(frame, tokenizer, spec.max_length)
    import datasets

    ds = datasets.Dataset.from_dict(cols)
    collate = pair_batches.PairCollate(ds, tokenizer.pad_token_id, spec.max_length, dpo_spec, key="")
    off = torch.autocast("cpu", enabled=False)
    batch = collate(list(range(N)))
    if reference is not None:  # full fine-tune: the reference pass, as setup() makes it
        # in batches of 4, unlike the training batch of 6
        collate.reference = reference_pass(reference, collate, DistEnv(), torch.device("cpu"), off, 4, False)
        batch = collate(list(range(N)))
    policy.train()
    loss_sum, pairs, stats = dpo.loss(policy, batch, off)
    means = (stats / pairs).tolist()
    return cols, float(loss_sum.detach() / pairs), dict(zip(dpo.METRICS, means))


def _record(row: dict, spec: PreferenceData) -> dict:
    fmt = "chat" if isinstance(row["chosen"], list) else "text"
    return pair_record(row, spec, fmt)


@pytest.mark.parametrize(
    "fmt,lora,loss_type,beta",
    [
        ("chat", False, "sigmoid", 0.1),
        ("chat", True, "sigmoid", 0.5),
        ("text", False, "sigmoid", 0.1),
        ("chat", False, "ipo", 0.1),
        ("text", True, "ipo", 0.3),
    ],
)
def test_loss_and_rewards_equal_trl(tokenizer, tmp_path, fmt, lora, loss_type, beta):
    rows = _rows(fmt)
    trainer, policy, reference = _trainer(lora, tokenizer, rows, loss_type, beta, tmp_path)
    examples, t_loss, t = _trl(trainer)
    cols, k_loss, k = _kubetune(policy, reference, tokenizer, rows, DPOSpec(beta=beta, loss_type=loss_type), tmp_path)
    # the same tokens: prompt and answers, split where TRL splits them
    for key in ("prompt_ids", "chosen_ids", "rejected_ids"):
        assert cols[key] == [e[key] for e in examples], key
    assert abs(k_loss - t_loss) < TOL, (k_loss, t_loss)
    pairs = {
        "reward_chosen": "rewards/chosen",
        "reward_rejected": "rewards/rejected",
        "reward_margin": "rewards/margins",
        "reward_accuracy": "rewards/accuracies",
        "logps_chosen": "logps/chosen",
        "logps_rejected": "logps/rejected",
    }
    for ours, theirs in pairs.items():
        assert abs(k[ours] - t[theirs]) < TOL * max(1.0, abs(t[theirs])), (ours, k[ours], t[theirs])
    # the policy really differs from its reference: the rewards are not the trivial zeros
    assert abs(t["rewards/margins"]) > 1e-3


def test_label_smoothing_is_conservative_dpo():
    """TRL 1.16's sigmoid has no label smoothing (only its robust and aot losses do); kubetune's is the
    conservative DPO of the DPO paper's appendix: −(1−ε) log σ(βΔ) − ε log σ(−βΔ), the sigmoid loss at ε=0."""
    chosen, rejected = torch.tensor([-10.0, -4.0]), torch.tensor([-12.0, -2.0])
    ref_c, ref_r = torch.tensor([-11.0, -4.5]), torch.tensor([-11.5, -3.2])
    spec = DPOSpec(beta=0.2, label_smoothing=0.1)
    losses, stats = dpo.pair_losses(chosen, rejected, ref_c, ref_r, spec)
    delta = (chosen - ref_c) - (rejected - ref_r)
    expected = -0.9 * torch.nn.functional.logsigmoid(0.2 * delta) - 0.1 * torch.nn.functional.logsigmoid(-0.2 * delta)
    assert torch.allclose(losses, expected)
    plain, _ = dpo.pair_losses(chosen, rejected, ref_c, ref_r, DPOSpec(beta=0.2))
    assert torch.allclose(plain, -torch.nn.functional.logsigmoid(0.2 * delta))
    assert not torch.allclose(plain, losses)
    assert stats[:, 0].tolist() == [
        1.0,
        0.0,
    ]  # reward accuracy: only the first pair moved its chosen answer up more than its rejected one
