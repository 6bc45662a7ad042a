"""Preference pairs as micro-batches (DPO, ORPO): each pair tokenized as TRL's DPOTrainer does
(``encode_pairs``), and the micro-batches of pairs (``PairCollate``: the chosen sequences, then the rejected
ones, answer tokens labeled), each carrying the task's own loss settings (``PairBatch.settings``) and, where
the task precomputed them, the reference log-probabilities. The pairs themselves are read by ``tasks.pairs``."""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import numpy as np
import pandas as pd
import torch

from kubetune.data import Batch
from kubetune.tasks.common import IGNORE, label_targets
from kubetune.tasks.pairs import shared_prefix

S = TypeVar("S")  # a task's loss settings (its own section: DPOSpec, ORPOSpec)


def encode_pairs(frame: pd.DataFrame, tokenizer, max_length: int) -> dict[str, list]:
    """Token ids of each pair as TRL's DPOTrainer makes them: the prompt, and prompt + answer (text:
    joined as strings, the answer ending with EOS; chat: the template, the prompt with the generation
    prompt); each answer starts where its tokens leave the prompt's. Columns prompt_ids, chosen_ids,
    rejected_ids, length (the longer sequence, up to ``max_length``)."""
    cols: dict[str, list] = {"prompt_ids": [], "chosen_ids": [], "rejected_ids": [], "length": []}
    eos = tokenizer.eos_token or ""
    for rec in frame["record"]:
        r = json.loads(rec)
        if isinstance(r["prompt"], str):
            prompt_ids = tokenizer(r["prompt"])["input_ids"]
            full = [
                tokenizer(r["prompt"] + (a if a.endswith(eos) else a + eos))["input_ids"]
                for a in (r["chosen"], r["rejected"])
            ]
        else:
            prompt_ids = _chat_ids(tokenizer, r["prompt"], add_generation_prompt=True)
            full = [_chat_ids(tokenizer, r["prompt"] + r[k]) for k in ("chosen", "rejected")]
        n = min(shared_prefix(prompt_ids, ids) for ids in full)
        cols["prompt_ids"].append(prompt_ids[:n])
        cols["chosen_ids"].append(full[0][n:])
        cols["rejected_ids"].append(full[1][n:])
        cols["length"].append(min(max_length, max(len(full[0]), len(full[1]))))
    return cols


def _chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True
    )
    return list(out["input_ids"])


@dataclass
class PairBatch(Batch, Generic[S]):
    """A micro-batch of pairs: rows 0..n-1 the chosen sequences, rows n..2n-1 the rejected ones;
    labels are the answer tokens (IGNORE elsewhere)."""

    reference: torch.Tensor | None = None  # [pairs, 2] the reference log-probabilities, when precomputed
    settings: S | None = None  # the task's loss settings (the trainer passes no spec to the loss)


class PairCollate(Generic[S]):
    """Dataset row ids (of ``encode_pairs``' columns) -> a ``PairBatch``: prompt + answer cut to ``max_length``
    (TRL's keep_start), right-padded; ``settings``: the task's loss settings, which every batch carries.
    ``reference``: the precomputed reference log-probabilities of every row (``tasks.reference.precompute``,
    before training; None: the task computes its reference on the fly, or has none)."""

    def __init__(self, ds: Any, pad_id: int, max_length: int, settings: S, key: str = ""):
        self.ds, self.pad_id, self.max_length, self.settings = ds, pad_id, max_length, settings
        self.key = key  # what the reference log-probabilities of these rows depend on (their cache's key)
        self.reference: np.ndarray | None = None

    def __call__(self, indices: np.ndarray | list[int]) -> PairBatch[S]:
        weight = 1.0
        if len(indices) == 0:  # a rank's empty share of the last step: computed, weighs nothing
            indices, weight = np.zeros(1, dtype=np.int64), 0.0
        rows = self.ds[[int(i) for i in indices]]
        seqs, answers = [], []
        for key in ("chosen_ids", "rejected_ids"):
            for prompt, answer in zip(rows["prompt_ids"], rows[key]):
                seqs.append((prompt + answer)[: self.max_length])
                answers.append(min(len(answer), max(self.max_length - len(prompt), 0)))
        width = max(len(s) for s in seqs)
        ids = torch.full((len(seqs), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(seqs), width), dtype=torch.long)
        labels = torch.full((len(seqs), width), IGNORE, dtype=torch.long)
        for k, (seq, n) in enumerate(zip(seqs, answers)):
            ids[k, : len(seq)] = torch.tensor(seq)
            mask[k, : len(seq)] = 1
            labels[k, len(seq) - n : len(seq)] = ids[k, len(seq) - n : len(seq)]
        ref = torch.as_tensor(self.reference[indices], dtype=torch.float32) if self.reference is not None else None
        return PairBatch(
            {"input_ids": ids, "attention_mask": mask},
            labels,
            weight,
            torch.as_tensor(indices, dtype=torch.long),
            ref,
            self.settings,
            targets=label_targets(labels),  # on the host: the loss then selects without a sync
        )
