"""Every batch type keeps its own fields when moved to a device. On the CPU ``to`` returns the batch itself,
so the copy a GPU makes is tested on the ``meta`` device (a real device type, no memory): GPU run 3 found
GRPO's evaluation batch losing its rollouts in a hand-written copy."""

from __future__ import annotations

import torch

from kubetune.data import Batch
from kubetune.tasks.dpo import DPOSpec
from kubetune.tasks.grpo.data import PromptBatch
from kubetune.tasks.grpo.rollout import RolloutBatch
from kubetune.tasks.pair_batches import PairBatch

META = torch.device("meta")


def _base() -> dict:
    return {
        "inputs": {"input_ids": torch.ones(2, 3, dtype=torch.long), "attention_mask": torch.ones(2, 3)},
        "labels": torch.zeros(2, 3, dtype=torch.long),
        "weight": 0.5,
        "index": torch.tensor([4, 7]),
    }


def test_a_batch_on_the_cpu_is_itself_and_elsewhere_a_copy_with_its_tensors_moved():
    b = Batch(**_base())
    assert b.to(torch.device("cpu")) is b
    moved = b.to(META)
    assert type(moved) is Batch and moved is not b
    assert all(t.device.type == "meta" for t in (*moved.inputs.values(), moved.labels))
    assert moved.index.device.type == "cpu" and moved.weight == 0.5  # row ids stay for tracing


def test_grpo_and_dpo_batches_keep_their_own_fields_on_a_device():
    rollouts = object()
    prompt = PromptBatch(**_base(), records=[{"prompt": "p"}], context=rollouts).to(META)
    assert type(prompt) is PromptBatch and prompt.context is rollouts and prompt.records == [{"prompt": "p"}]
    assert prompt.inputs["input_ids"].device.type == "meta"

    roll = RolloutBatch(**_base(), advantages=torch.ones(2), ref_logps=torch.ones(4), units=3.0).to(META)
    assert type(roll) is RolloutBatch and roll.units == 3.0 and roll.old_logps is None
    assert roll.advantages.device.type == "meta" and roll.ref_logps.device.type == "meta"

    pair = PairBatch(**_base(), reference=torch.ones(1, 2), settings=DPOSpec()).to(META)
    assert type(pair) is PairBatch and pair.reference.device.type == "meta" and pair.settings is not None
