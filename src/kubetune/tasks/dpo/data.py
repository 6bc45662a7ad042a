"""DPO's data: preference pairs (read by ``tasks.pairs`` in TRL's conventions: text, or chat message lists
with an implicit prompt) tokenized as TRL's DPOTrainer does, and the micro-batches of pairs (chosen
sequences, then rejected ones, answer tokens labeled)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from kubetune.data import Batch
from kubetune.tasks.common import IGNORE
from kubetune.tasks.dpo import DPOSpec
from kubetune.tasks.pairs import shared_prefix

log = logging.getLogger(__name__)


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


# ---------------------------------------------------------------- batches


@dataclass
class PairBatch(Batch):
    """A micro-batch of pairs: rows 0..n-1 the chosen sequences, rows n..2n-1 the rejected ones;
    labels are the answer tokens (IGNORE elsewhere)."""

    reference: torch.Tensor | None = None  # [pairs, 2] the reference log-probabilities, when precomputed
    dpo: DPOSpec = field(default_factory=DPOSpec)  # the loss's settings (the trainer passes no spec to the loss)


class Collate:
    """Dataset row ids -> a ``PairBatch``: prompt + answer cut to ``max_length`` (TRL's keep_start),
    right-padded. ``reference``: the precomputed reference log-probabilities of every row (set by
    ``setup`` before training; None: the reference is computed on the fly)."""

    def __init__(self, ds, pad_id: int, max_length: int, dpo: DPOSpec, key: str):
        self.ds, self.pad_id, self.max_length, self.dpo = ds, pad_id, max_length, dpo
        self.key = key  # what the reference log-probabilities of these rows depend on (their cache's key)
        self.reference: np.ndarray | None = None

    def __call__(self, indices: np.ndarray) -> PairBatch:
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
            self.dpo,
        )
