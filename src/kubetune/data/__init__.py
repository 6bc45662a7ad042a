"""Data: table loading and column mapping, tokenization cache, exactly-once sharding, batching."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from kubetune.data.sharding import Step
from kubetune.data.tables import Frames, load_frames, read_table
from kubetune.data.tokenize import tokenized

__all__ = ["Frames", "StepBatch", "batches", "collate", "load_frames", "read_table", "tokenized"]

MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


def collate(ds, indices: np.ndarray, tokenizer) -> dict[str, torch.Tensor]:
    """Pad the examples at ``indices`` to the longest one (dynamic padding).

    An empty ``indices`` (a rank's share of the last, partial step) yields example 0 with
    ``weight`` 0, so the rank still runs forward/backward but contributes nothing.
    """
    weight = 1.0
    if len(indices) == 0:
        indices, weight = np.zeros(1, dtype=np.int64), 0.0
    rows = ds[[int(i) for i in indices]]
    features = {k: rows[k] for k in MODEL_INPUTS if k in rows}
    batch = tokenizer.pad(features, return_tensors="pt")
    batch = {k: v for k, v in batch.items()}
    batch["labels"] = torch.as_tensor(rows["label"], dtype=torch.long)
    batch["weight"] = torch.full((len(indices),), weight)
    batch["index"] = torch.as_tensor(indices, dtype=torch.long)  # dataset row ids, for tracing
    return batch


@dataclass
class StepBatch:
    micro: list[dict[str, torch.Tensor]]
    global_count: int


class _StepDataset(torch.utils.data.Dataset):
    def __init__(self, plan: list[Step], ds, tokenizer):
        self.plan, self.ds, self.tokenizer = plan, ds, tokenizer

    def __len__(self) -> int:
        return len(self.plan)

    def __getitem__(self, k: int) -> StepBatch:
        step = self.plan[k]
        return StepBatch([collate(self.ds, m, self.tokenizer) for m in step.micro], step.global_count)


def _identity(x):
    return x


def batches(plan: list[Step], ds, tokenizer, workers: int = 0, start: int = 0):
    """Iterate this rank's collated steps from step ``start`` (workers > 0 prefetch in background)."""
    loader = torch.utils.data.DataLoader(
        _StepDataset(plan[start:], ds, tokenizer),
        batch_size=None,
        shuffle=False,
        num_workers=workers,
        collate_fn=_identity,
        persistent_workers=False,
        # Its own generator: each new iterator draws a seed from it, and drawing from the global
        # one would shift the dropout stream of a resumed run (exact resume needs it untouched).
        generator=torch.Generator().manual_seed(0),
    )
    return iter(loader)
