"""KTO checked against a peer: on the same model and examples, kubetune's KTO loss and every metric TRL logs for it
(kl, rewards and log-probabilities of the desirable and the undesirable examples, their margin) equal TRL 1.16's
KTOTrainer within 1e-5, each side tokenizing and batching the examples its own way (TRL's collator, its KL
completions rotated by one within the batch; kubetune's data.py and Collate): chat and text, a full model (the
reference a frozen copy) and a LoRA one (the reference its adapter disabled), two β and unequal weights. Also the
data checks: a flag column that is not boolean-like and data with one kind of label are one line each."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from types import SimpleNamespace

import pandas as pd
import pytest
import torch

from kubetune.errors import KubetuneError
from kubetune.tasks.common import ensure_chat_template
from kubetune.tasks.kto import KTOData, KTOSpec
from kubetune.tasks.kto import task as kto
from kubetune.tasks.kto.data import encode, load_frames

trl = pytest.importorskip("trl")  # requirements-test.txt pins it: this skip only guards a partial install
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

ROOT = Path(__file__).resolve().parents[2]
TINY = ROOT / "src" / "kubetune" / "assets" / "tiny-llama"
PAIRS = ROOT / "src" / "kubetune" / "assets" / "sentiment" / "sentiment-preferences.jsonl"
N = 6
TOL = 1e-5
NAMES = {
    "kl": "kl",
    "reward_chosen": "rewards/chosen",
    "reward_rejected": "rewards/rejected",
    "reward_margin": "rewards/margins",
    "logps_chosen": "logps/chosen",
    "logps_rejected": "logps/rejected",
}


def _rows(fmt: str) -> list[dict]:
    """Unpaired examples from the packaged pairs: alternately the chosen (desirable) and the rejected answer."""
    pairs = [json.loads(line) for line in PAIRS.read_text().splitlines()[:N]]
    rows = []
    for k, p in enumerate(pairs):
        good = k % 3 != 2  # 4 desirable, 2 undesirable
        rows.append({"prompt": p["prompt"], "completion": p["chosen" if good else "rejected"], "label": good})
    if fmt == "text":
        return [{**r, "prompt": r["prompt"][0]["content"], "completion": r["completion"][0]["content"]} for r in rows]
    return rows


@pytest.mark.parametrize("fmt,lora,beta", [("chat", False, 0.1), ("text", False, 0.5), ("chat", True, 0.2)])
def test_loss_and_metrics_equal_trl(tmp_path, fmt, lora, beta):
    import datasets
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import KTOConfig, KTOTrainer

    tok = AutoTokenizer.from_pretrained(TINY)
    ensure_chat_template(tok)
    tok.pad_token = tok.pad_token or tok.eos_token
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(TINY, dtype=torch.float32)  # the reference of a full fine-tune
    model = copy.deepcopy(base)
    with torch.no_grad():  # the policy: moved away from the base, so that the log-ratios are not 0
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    rows = _rows(fmt)
    weights = {"desirable_weight": 1.0, "undesirable_weight": 1.5}
    args = KTOConfig(output_dir=str(tmp_path / "trl"), per_device_train_batch_size=N, beta=beta, max_length=256,
                     train_sampling_strategy="sequential", report_to=[], use_cpu=True, bf16=False, fp16=False,
                     **weights)  # fmt: skip
    trainer = KTOTrainer(
        model=copy.deepcopy(model),
        ref_model=None if lora else copy.deepcopy(base),
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
    # LoRA: TRL's PEFT model itself, whose adapter weights were just set. A full model: kubetune's own, as a run
    # makes it: the base, its reference copied by setup, then the policy's weights loaded (as a checkpoint's are)
    policy = trainer.model
    ours = trainer.model if lora else copy.deepcopy(base).train()
    policy.train()
    trl_batch = next(iter(trainer.get_train_dataloader()))
    t_loss = float(trainer._compute_loss(policy, trl_batch, False).detach())
    t = {k: v[-1] for k, v in trainer._metrics["train"].items()}

    spec = KTOData(train=str(tmp_path / "x.jsonl"), max_length=256)
    records = [json.dumps(r) for r in rows]  # data.py's records: {prompt, completion, label}
    cols = encode(pd.DataFrame({"record": records}), tok, spec.max_length)
    collate = kto.Collate(datasets.Dataset.from_dict(cols), tok.pad_token_id, 256, KTOSpec(beta=beta, **weights))
    batch = collate(list(range(N)))
    kto.setup(SimpleNamespace(lora=object() if lora else None), ours, None, None, None, None, False)
    if not lora:
        ours.load_state_dict(model.state_dict())
    total, units, stats = kto.loss(ours, batch, torch.autocast("cpu", enabled=False))
    k_loss, k = float(total.detach() / units), dict(zip(kto.METRICS, (stats / units).tolist()))

    print(f"{fmt} lora={lora} beta={beta}: loss {k_loss:.6f} (TRL {t_loss:.6f}), kl {k['kl']:.6f} (TRL {t['kl']:.6f})")
    assert abs(k_loss - t_loss) < TOL, (k_loss, t_loss)
    for ours, theirs in NAMES.items():
        assert abs(k[ours] - t[theirs]) < TOL * max(1.0, abs(t[theirs])), (ours, k[ours], t[theirs])
    assert abs(t["rewards/margins"]) > 1e-4  # the policy is not the reference: the check had something to compare


def _table(tmp_path: Path, labels: list) -> Path:
    path = tmp_path / "kto.jsonl"
    path.write_text(
        "".join(
            json.dumps({"prompt": f"review {k}?", "completion": "positive", "label": v}) + "\n"
            for k, v in enumerate(labels)
        )
    )
    return path


def test_a_flag_that_is_not_boolean_like_is_one_line_naming_the_row(tmp_path):
    spec = KTOData(train=str(_table(tmp_path, [True, "no", 1, "maybe"])))
    with pytest.raises(KubetuneError) as e:
        load_frames(spec, 0)
    assert e.value.field == "data.label_column" and "row 3" in str(e.value) and "'maybe'" in str(e.value)


def test_data_of_one_kind_of_label_is_refused_and_paired_data_is_unpaired(tmp_path):
    spec = KTOData(train=str(_table(tmp_path, [True, "yes", 1, "TRUE"])))
    with pytest.raises(KubetuneError) as e:
        load_frames(spec, 0)
    assert e.value.field == "data.label_column" and "every one of the 4 examples" in str(e.value)
    frames = load_frames(KTOData(train=str(PAIRS)), 0)  # pairs: two examples each, one of each kind
    pairs = len(PAIRS.read_text().splitlines())
    assert len(frames.train_ids) + len(frames.eval_ids) == 2 * pairs
    labels = [json.loads(r)["label"] for r in frames.train["record"]]
    assert 0 < sum(labels) < len(labels)


def test_a_full_fine_tune_under_fsdp_is_refused_at_validation(tmp_path):
    """Its reference is a frozen copy of the model, which FSDP cannot make: one line at validation, not a crash in
    every worker (the copy failed with FSDP's own AssertionError before this check)."""
    from kubetune.config import parse_spec

    spec = {
        "name": "kto",
        "task": "kto",
        "model": {"uri": str(TINY)},
        "data": {"train": str(PAIRS)},
        "distributed": {"procs_per_node": 2, "strategy": "fsdp"},
        "output": {"uri": str(tmp_path / "out")},
    }
    with pytest.raises(Exception) as e:
        parse_spec(spec)
    assert "task kto under distributed.strategy fsdp needs lora" in str(e.value)
    parse_spec({**spec, "lora": {"r": 4}})  # with LoRA the reference is the adapter disabled


def test_a_micro_batch_of_one_is_refused_naming_the_field(tmp_path):
    """Each example's KL sequence pairs its prompt with another example's completion of the micro-batch: with one
    example per micro-batch it would be itself (TRL's KTOTrainer refuses batch size 1 too). Refused before the data
    is read."""
    from kubetune.config import parse_spec

    spec = parse_spec(
        {
            "name": "kto",
            "task": "kto",
            "model": {"uri": str(TINY)},
            "data": {"train": str(PAIRS)},
            "training": {"batch_size": 1, "grad_accum": 8},
            "output": {"uri": str(tmp_path / "out")},
        }
    )
    with pytest.raises(KubetuneError) as e:
        kto.prepare(spec, None, None, None)
    assert e.value.field == "training.batch_size" and "micro-batch of one" in str(e.value)
