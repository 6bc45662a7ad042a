"""DPO's data: preference pairs read in TRL's conventions (text, or chat message lists with an
implicit prompt), tokenized as TRL's DPOTrainer does, and the micro-batches of pairs (chosen
sequences, then rejected ones, answer tokens labeled). A cell's messages are read by ``tasks.common``
(GRPO's prompts too)."""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from kubetune.data import Batch
from kubetune.data.columns import NonText, check_table
from kubetune.data.rows import RowSplit, read_split
from kubetune.data.tables import short
from kubetune.errors import KubetuneError
from kubetune.providers import S3Settings
from kubetune.tasks.common import IGNORE, RECORD_SCHEMA, as_messages, cell_messages
from kubetune.tasks.dpo import DPOSpec, PreferenceData

log = logging.getLogger(__name__)


def load_pair_frames(spec: PreferenceData, seed: int, s3: S3Settings = S3Settings()) -> RowSplit:
    """Read, check, normalize and split preference pairs in flat memory (``data.rows``; s3:// data
    reached with ``s3``): each pair a ``record``, JSON text of its prompt, chosen and rejected answers.

    Raises:
        KubetuneError: a missing column, a column without text or messages, malformed messages, no usable pair.
    """
    settings = json.dumps(
        ["dpo", spec.format, spec.prompt_column, spec.chosen_column, spec.rejected_column, spec.system_prompt]
    )
    if spec.streaming:  # data.train is listed (a missing or unreadable prefix fails here), not read
        from kubetune.data.stream import list_shards

        list_shards(spec.train, field="data.train", s3=s3)
    return read_split(
        spec, seed, s3, normalizer=lambda field, train: _Normalizer(spec, field, train), settings=settings
    )


def shard_normalizer(spec: PreferenceData):
    """The normalizer of one streamed shard of data.train (``data.stream.Stream``): its format detected
    on its own first chunk (or data.format), its pairs checked as a table's."""
    return lambda shard: _Normalizer(spec, "data.train", None)


def _detect_format(df: pd.DataFrame, spec: PreferenceData) -> str:
    if spec.format != "auto":
        return spec.format
    if spec.chosen_column not in df.columns:
        return "text"  # _normalize names the missing column
    values = df[spec.chosen_column].dropna()
    return "chat" if len(values) and as_messages(values.iloc[0]) is not None else "text"


class _Normalizer:
    """A preference table, chunk by chunk (``data.rows.Normalizer``): the format detected on data.train's
    first chunk, the columns checked on it, each row made a pair or dropped (and why counted)."""

    schema = RECORD_SCHEMA

    def __init__(self, spec: PreferenceData, field_name: str, train_facts: dict | None):
        self.spec, self.field_name = spec, field_name
        self.source = getattr(spec, field_name.split(".")[1])
        self.fmt = train_facts["format"] if train_facts else None
        self.columns: list | None = None  # the first chunk's: a later chunk of JSON lines may lack some
        self.rows = 0
        self.reasons = {"missing": 0, "same": 0}
        self.non_text: dict[str, NonText] = {}

    def chunk(self, df: pd.DataFrame, start: int) -> dict[str, list]:
        spec = self.spec
        if self.columns is None:
            self.fmt = self.fmt or _detect_format(df, spec)
            self.columns = list(df.columns)
            for key, col in self._needed().items():
                if col not in df.columns:
                    hint = f" (data.format {'auto-detected as ' if spec.format == 'auto' else ''}{self.fmt})"
                    raise KubetuneError(
                        f"column '{short(col, 40)}' not found in {short(self.source)}{hint}; "
                        f"columns are {[short(c, 40) for c in df.columns[:20]]}",
                        field=f"data.{key}",
                        fix=f"set data.{key} to the column that holds the "
                        + {"prompt_column": "prompt", "chosen_column": "preferred answer"}.get(
                            key, "dispreferred answer"
                        ),
                    )
        df = df.reindex(columns=list(dict.fromkeys([*df.columns, *self.columns])))
        self.rows += len(df)
        if self.fmt == "text":
            for key, col in self._needed().items():
                self.non_text.setdefault(key, NonText()).update(df[col])
        records = []
        for i, row in enumerate(df.to_dict("records")):
            record = _text_record(row, spec) if self.fmt == "text" else _chat_record(row, spec, self.source, start + i)
            if record is not None and record["chosen"] == record["rejected"]:
                self.reasons["same"] += 1  # no preference to learn: its loss is constant
            elif record is None:
                self.reasons["missing"] += 1
            else:
                records.append(json.dumps(record))
        return {"record": records}

    def _needed(self) -> dict[str, str]:
        spec = self.spec
        needed = {"chosen_column": spec.chosen_column, "rejected_column": spec.rejected_column}
        if self.fmt == "text" or spec.prompt_column in self.columns:  # chat: the prompt may be implicit
            needed = {"prompt_column": spec.prompt_column, **needed}
        return needed

    def finish(self, kept: int) -> dict:
        check_table(
            self.rows,
            self.non_text,
            self.spec,
            self.source,
            self.field_name,
            rows_fix="point it at data with at least one row",
            text_fix="set data.{key} to a text column, or data.format: chat for message lists",
        )
        n_drop = sum(self.reasons.values())
        if n_drop:
            log.warning(
                "%s: dropped %d of %d pairs (%d with a missing or empty prompt or answer, %d whose chosen and "
                "rejected answers are the same)",
                self.field_name,
                n_drop,
                self.rows,
                self.reasons["missing"],
                self.reasons["same"],
            )
        if not kept:
            raise KubetuneError(
                f"no usable preference pairs in {self.source} (format {self.fmt})",
                field=self.field_name,
                fix="check the data and the data.*_column settings",
            )
        return {"format": self.fmt, "dropped": n_drop, "rows": self.rows}


def _text(value) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


def _text_record(row: dict, spec: PreferenceData) -> dict | None:
    prompt = row[spec.prompt_column]
    chosen, rejected = _text(row[spec.chosen_column]), _text(row[spec.rejected_column])
    if not _text(prompt) or not chosen or not rejected:  # an empty prompt is dropped, as the warning says
        return None
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _chat_record(row: dict, spec: PreferenceData, source: str, i: int) -> dict | None:
    """{prompt, chosen, rejected} message lists. Strings become a user turn (prompt) or an assistant
    turn (answers). Answers that start with a turn not the assistant's hold the whole conversation:
    the prompt is then the turns they share (TRL's implicit prompt), else the prompt column's."""
    chosen = cell_messages(row[spec.chosen_column], "assistant", "data.chosen_column", spec.chosen_column, source, i)
    rejected = cell_messages(
        row[spec.rejected_column], "assistant", "data.rejected_column", spec.rejected_column, source, i
    )
    if not chosen or not rejected:
        return None
    if chosen[0]["role"] != "assistant" or rejected[0]["role"] != "assistant":
        n = min(_shared_prefix(chosen, rejected), len(chosen) - 1, len(rejected) - 1)
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    elif spec.prompt_column in row:
        prompt = cell_messages(row[spec.prompt_column], "user", "data.prompt_column", spec.prompt_column, source, i)
        if prompt is None:
            return None
    else:
        raise KubetuneError(
            f"row {i} of {short(source)}: the answers hold no prompt and there is no column '{spec.prompt_column}'",
            field="data.prompt_column",
            fix="set data.prompt_column, or store whole conversations (prompt turns first) in the answer columns",
        )
    if not any(_text(m.get("content")) for m in prompt):  # an empty prompt is dropped, as the warning says
        return None
    if spec.system_prompt and (not prompt or prompt[0]["role"] != "system"):
        prompt = [{"role": "system", "content": spec.system_prompt}, *prompt]
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _shared_prefix(a: list, b: list) -> int:
    """How many leading items ``a`` and ``b`` share (os.path.commonprefix orders its items, which
    message dicts cannot be)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


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
        n = min(_shared_prefix(prompt_ids, ids) for ids in full)
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
