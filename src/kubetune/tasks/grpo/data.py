"""GRPO's data: prompts in TRL's conventions (a string, or a chat message list), every other column of
the row kept beside them for the reward functions, tokenized once (the chat template with its
generation prompt) and cached like the other tasks' tokens; a micro-batch is a set of prompts. A cell's
messages are read as DPO reads its own (``tasks.common``)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Any

import numpy as np
import pandas as pd
import torch

from kubetune.data import Batch
from kubetune.data.columns import NonText
from kubetune.data.rows import RowSplit, read_split
from kubetune.data.tables import short
from kubetune.errors import KubetuneError
from kubetune.providers import S3Settings
from kubetune.tasks.common import RecordNormalizer, as_messages, cell_messages
from kubetune.tasks.grpo import PromptData

log = logging.getLogger(__name__)


def load_prompt_frames(spec: PromptData, seed: int, s3: S3Settings = S3Settings()) -> RowSplit:
    """Read, check, normalize and split prompts in flat memory (``data.rows``; s3:// data reached with
    ``s3``): each row a ``record``, the JSON of its prompt and its other columns.

    Raises:
        KubetuneError: a missing prompt column, a column without text or messages, no usable prompt.
    """
    settings = json.dumps(["grpo", spec.format, spec.prompt_column, spec.system_prompt])
    return read_split(
        spec, seed, s3, normalizer=lambda field, train: _Normalizer(spec, field, train), settings=settings
    )


def _jsonable(value: Any) -> Any:
    """A cell as JSON can hold it (numpy scalars and arrays, NaN as None), for the reward functions."""
    if isinstance(value, np.ndarray):
        return [_jsonable(v) for v in value.tolist()]
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, np.generic):
        value = value.item()
    if isinstance(value, float) and value != value:
        return None
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    return str(value)


class _Normalizer(RecordNormalizer):
    """A prompt table, chunk by chunk (``data.rows.Normalizer``): the format detected on data.train's first
    chunk, the prompt column checked on it, each row made a record or dropped (an empty prompt)."""

    spec: PromptData

    def __init__(self, spec: PromptData, field_name: str, train_facts: dict | None):
        super().__init__(spec, field_name, train_facts)
        self.missing = 0

    def chunk(self, df: pd.DataFrame, start: int) -> dict[str, list]:
        spec, col = self.spec, self.spec.prompt_column
        if col not in df.columns:
            raise KubetuneError(
                f"column '{short(col, 40)}' not found in {short(self.source)}; "
                f"columns are {[short(c, 40) for c in df.columns[:20]]}",
                field="data.prompt_column",
                fix="set data.prompt_column to the column that holds the prompt",
            )
        if self.fmt is None:
            values = df[col].dropna()
            chat = len(values) and as_messages(values.iloc[0]) is not None
            self.fmt = spec.format if spec.format != "auto" else ("chat" if chat else "text")
        self.rows += len(df)
        if self.fmt == "text":
            self.non_text.setdefault("prompt_column", NonText()).update(df[col])
        records = []
        for i, row in enumerate(df.to_dict("records")):
            prompt = self._prompt(row[col], start + i)
            if prompt is None:
                self.missing += 1
                continue
            columns = {str(k): _jsonable(v) for k, v in row.items() if k != col}
            records.append(json.dumps({"prompt": prompt, "columns": columns}))
        return {"record": records}

    def _prompt(self, value, i: int):
        spec = self.spec
        if self.fmt == "text":
            return value if isinstance(value, str) and value.strip() else None
        messages = cell_messages(value, "user", "data.prompt_column", spec.prompt_column, self.source, i)
        if not messages or not any(isinstance(m["content"], str) and m["content"].strip() for m in messages):
            return None
        if spec.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": spec.system_prompt}, *messages]
        return messages

    def finish(self, kept: int) -> dict:
        self.check_read("set data.{key} to a text column, or data.format: chat for message lists")
        if self.missing:
            log.warning(
                "%s: dropped %d of %d rows with a missing or empty prompt", self.field_name, self.missing, self.rows
            )
        if not kept:
            raise KubetuneError(
                f"no usable prompts in {self.source} (format {self.fmt})",
                field=self.field_name,
                fix="check the data and data.prompt_column",
            )
        return {"format": self.fmt, "dropped": self.missing, "rows": self.rows}


def encode_prompts(frame: pd.DataFrame, tokenizer, max_length: int) -> dict[str, list]:
    """Each prompt's token ids as TRL's GRPOTrainer makes them: a string tokenized as it is, a message list
    rendered with the chat template and its generation prompt; a prompt over ``max_length`` keeps its
    end (TRL's max_prompt_length). Columns prompt_ids, length, record (the prompt and its columns)."""
    cols: dict[str, list] = {"prompt_ids": [], "length": [], "record": []}
    for rec in frame["record"]:
        prompt = json.loads(rec)["prompt"]
        if isinstance(prompt, str):
            ids = tokenizer(prompt)["input_ids"]
        else:
            out = tokenizer.apply_chat_template(prompt, tokenize=True, add_generation_prompt=True, return_dict=True)
            ids = list(out["input_ids"])
        ids = ids[-max_length:]
        cols["prompt_ids"].append(ids)
        cols["length"].append(len(ids))
        cols["record"].append(rec)
    return cols


@dataclass
class PromptBatch(Batch):
    """A micro-batch of prompts, left-padded for generation (``inputs``: input_ids, attention_mask;
    ``labels`` unused), with each prompt's record (its prompt and columns) for the rewards."""

    records: list | None = None  # dicts {prompt, columns}
    context: Any = None  # the run's ``rollout.Rollouts`` (evaluation generates through it)

    def pin_memory(self) -> PromptBatch:
        return self  # generation reads the prompts on the CPU first


class PromptCollate:
    """Dataset row ids -> a ``PromptBatch``."""

    def __init__(self, ds, pad_id: int):
        self.ds, self.pad_id = ds, pad_id
        self.context: Any = None  # set once the rollouts exist (``task.prepare``)

    def __call__(self, indices: np.ndarray) -> PromptBatch:
        weight = 1.0
        if len(indices) == 0:  # a rank's empty share of the last step: generated for, weighs nothing
            indices, weight = np.zeros(1, dtype=np.int64), 0.0
        rows = self.ds[[int(i) for i in indices]]
        prompts = rows["prompt_ids"]
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(prompts), width), dtype=torch.long)
        for k, p in enumerate(prompts):
            ids[k, width - len(p) :] = torch.tensor(p, dtype=torch.long)
            mask[k, width - len(p) :] = 1
        return PromptBatch(
            {"input_ids": ids, "attention_mask": mask},
            torch.zeros(0, dtype=torch.long),
            weight,
            torch.as_tensor(indices, dtype=torch.long),
            [json.loads(r) for r in rows["record"]],
            self.context,
        )
