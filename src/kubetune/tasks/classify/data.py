"""Sequence classification's data: labeled text tables (``data.text_column``, optional
``data.text_pair_column``, ``data.label_column``) read by ``data.tables``, checked, normalized to
``text`` (``text_pair``) and integer ``label`` columns, and split (stratified) into ``Frames``."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pandas as pd
import pyarrow as pa
import torch

from kubetune.data import Batch
from kubetune.data.columns import NonText, check_table, is_nested
from kubetune.data.rows import ArrowFile, Rows, RowSplit, read_split
from kubetune.data.splits import split_indices
from kubetune.data.tables import short
from kubetune.errors import KubetuneError
from kubetune.providers import S3Settings
from kubetune.tasks.classify import ClassificationData

log = logging.getLogger(__name__)

# The tokenizer outputs a micro-batch passes to the model.
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


LABEL_KEY = "label_key"  # the normalized rows' label, as text (``_label_key``); ids are given at tokenization


def load_frames(spec: ClassificationData, seed: int, s3: S3Settings = S3Settings()) -> RowSplit:
    """Load, validate and split the data described by ``spec`` in flat memory (``data.rows``; s3://
    data reached with ``s3``): rows of ``text`` (``text_pair``) and ``label_key``; the class names
    (sorted: numerically when every label is a number) in ``labels``.

    Raises:
        KubetuneError: missing, oversized or non-tabular files or columns, a text column that holds
            no text, empty data, a single class or more than ``data.max_classes``, eval labels
            unseen in training.
    """
    settings = json.dumps(["classify", spec.text_column, spec.text_pair_column, spec.label_column, spec.max_classes])

    def carve(train: Rows, n_eval: int):
        ids = label_ids(train, train.facts["labels"])
        counts = np.bincount(ids)
        counts = counts[counts > 0]
        # Stratify when every class can be split and each side can hold every class (a class with a single
        # row cannot be split; scikit-learn refuses a side smaller than the number of classes).
        can_stratify = len(ids) >= 2 and counts.min() >= 2 and min(n_eval, len(ids) - n_eval) >= len(counts)
        tr, ev = split_indices(ids, n_eval, seed, can_stratify)
        return np.sort(tr), np.sort(ev)

    split = read_split(
        spec,
        seed,
        s3,
        normalizer=lambda field, train_facts: _Normalizer(spec, field, train_facts),
        settings=settings,
        carve=carve,
    )
    split.labels = labels = list(split.rows.facts["labels"])
    label2id = {name: i for i, name in enumerate(labels)}

    def view(df: pd.DataFrame) -> pd.DataFrame:  # text (text_pair) and the class id, as the baseline reads them
        df["label"] = df.pop(LABEL_KEY).map(label2id).astype("int64")
        return df

    split.view = view
    return split


def label_ids(rows: Rows, labels: list[str]) -> np.ndarray:
    """The class id of every normalized row (int32), read a record batch at a time through ``ArrowFile``
    (through the dataset's own map, the label column's pages stayed resident: memory growing with the data)."""
    import pyarrow.compute as pc

    value_set = pa.array(labels, pa.string())
    with ArrowFile(rows.path) as arrow:
        out = np.empty(arrow.rows, dtype=np.int32)
        pos = 0
        for chunk in arrow.table.column(LABEL_KEY).chunks:
            out[pos : pos + len(chunk)] = pc.index_in(chunk, value_set=value_set).to_numpy(zero_copy_only=False)
            pos += len(chunk)
            arrow.release()
    return out


class _Normalizer:
    """A classification table, chunk by chunk (``data.rows.Normalizer``): the columns checked on the
    first chunk, rows without text or label dropped; over the whole table the text columns' contents,
    the classes (data.train) or the labels unseen in data.train (data.eval)."""

    def __init__(self, spec: ClassificationData, field: str, train_facts: dict | None):
        self.spec, self.field, self.train_facts = spec, field, train_facts
        self.source = short(getattr(spec, field.split(".")[1]))
        self.text_keys = ["text_column"] + (["text_pair_column"] if spec.text_pair_column else [])
        self.columns = [getattr(spec, key) for key in self.text_keys]
        fields = [("text", pa.string())] + ([("text_pair", pa.string())] if spec.text_pair_column else [])
        self.schema = pa.schema([*fields, (LABEL_KEY, pa.string())])
        self.rows = self.dropped = 0
        self.non_text = {key: NonText() for key in self.text_keys}  # by spec key, as check_table names them
        self.keys: set[str] = set()
        self.fractional: set[float] = set()

    def chunk(self, df: pd.DataFrame, start: int) -> dict[str, list]:
        spec = self.spec
        names = {
            "text_column": spec.text_column,
            "text_pair_column": spec.text_pair_column,
            "label_column": spec.label_column,
        }
        if start == 0:
            available = [short(c, 40) for c in df.columns[:20]]
            for key, col in names.items():
                if col is not None and col not in df.columns:
                    raise KubetuneError(
                        f"column '{short(col, 40)}' not found in {self.source}; "
                        f"columns are {available}{' ...' if len(df.columns) > 20 else ''}",
                        field=f"data.{key}",
                        fix=f"set data.{key}",
                    )
        df = df.reindex(columns=[*self.columns, spec.label_column])
        self.rows += len(df)
        for key, check in self.non_text.items():
            check.update(df[getattr(spec, key)])
        label = df[spec.label_column]
        if label.dtype == object and label.map(is_nested).any():
            raise KubetuneError(
                f"column '{short(spec.label_column, 40)}' of {self.source} "
                "holds nested values (lists/structs), not class labels",
                field="data.label_column",
                fix="set data.label_column to the column that holds one class per row",
            )
        keep = label.notna().to_numpy().copy()
        for col in self.columns:
            keep &= df[col].map(lambda v: isinstance(v, str) and v.strip() != "").to_numpy(dtype=bool)
        self.dropped += int((~keep).sum())
        df = df[keep]
        keys = df[spec.label_column].map(_label_key)
        self.keys.update(keys.unique().tolist())
        if len(self.fractional) < 3 * (spec.max_classes + 1):  # enough for the warning's count and examples
            self.fractional.update(
                float(v)
                for v in df[spec.label_column].unique()
                if isinstance(v, (float, np.floating)) and math.isfinite(v) and not float(v).is_integer()
            )
        out = {"text": df[spec.text_column].tolist()}
        if spec.text_pair_column:
            out["text_pair"] = df[spec.text_pair_column].tolist()
        out[LABEL_KEY] = keys.tolist()
        return out

    def finish(self, kept: int) -> dict:
        spec = self.spec
        check_table(
            self.rows,
            self.non_text,
            spec,
            self.source,
            self.field,
            rows_fix="point it at data with at least one labeled row",
            text_fix="set data.{key} to the text column",
        )
        if self.dropped:
            log.warning(
                "%s: dropped %d of %d rows with a missing/empty text or label", self.field, self.dropped, self.rows
            )
        if not kept:
            raise KubetuneError(
                f"no usable rows in {self.source}: every row lacks a text or label",
                field=self.field,
                fix="check data.text_column and data.label_column",
            )
        if self.train_facts is not None:  # data.eval: every label must be a class of data.train
            unseen = sorted(self.keys - set(self.train_facts["labels"]))
            if unseen:
                raise KubetuneError(
                    f"labels {[short(u, 40) for u in unseen[:5]]} occur in {short(spec.eval)} "
                    f"but never in {short(spec.train)}",
                    field="data.eval",
                    fix="train on data that covers every eval label, or filter those rows out",
                )
            return {"dropped": self.dropped, "rows": self.rows}
        _check_labels(len(self.keys), sorted(self.fractional), spec)
        labels = _label_names(self.keys)
        if len(labels) < 2:
            raise KubetuneError(
                f"only one class ({short(labels[0])!r}) in column '{short(spec.label_column)}' of {short(spec.train)}",
                field="data.label_column",
                fix="classification needs at least two classes; check the label column or the data",
            )
        return {"dropped": self.dropped, "rows": self.rows, "labels": labels}


def _check_labels(n: int, fractional: list[float], spec: ClassificationData) -> None:
    """Refuse more classes than data.max_classes; warn on fractional numbers (a regression target)."""
    if n > spec.max_classes:
        raise KubetuneError(
            f"column '{short(spec.label_column, 40)}' of {short(spec.train)} has {n} distinct labels, "
            f"more than data.max_classes ({spec.max_classes})",
            field="data.label_column",
            fix="check that data.label_column is the class column (not an id or a free-text column), "
            "or raise data.max_classes",
        )
    if fractional:
        log.warning(
            "data.label_column: column '%s' holds fractional numbers (e.g. %s): this looks like a regression target; "
            "kubetune classifies, so each of the %d distinct values becomes a class",
            short(spec.label_column, 40),
            ", ".join(f"{v:g}" for v in fractional[:3]),
            n,
        )


def _label_key(value) -> str:
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        value = int(value)
    return str(value)


def _number(key: str) -> float:
    value = float(key)
    if not math.isfinite(value):
        raise ValueError(key)
    return value


def _label_names(keys) -> list[str]:
    """Distinct labels in sorted order: numerically when every label is a number (2 before 10),
    whether the column was read as numbers or as strings, else as strings."""
    values = list(keys)
    try:
        return sorted(values, key=lambda v: (_number(v), v))
    except ValueError:
        return sorted(values)


def encode(frame: pd.DataFrame, tokenizer, max_length: int, label2id: dict[str, int]) -> dict:
    """Token ids, attention mask and ``length`` of each row's ``text`` (and ``text_pair``, a second
    segment), truncated to ``max_length``, and its class id ``label``."""
    pair = list(frame["text_pair"]) if "text_pair" in frame.columns else None
    enc = dict(tokenizer(list(frame["text"]), pair, truncation=True, max_length=max_length))
    enc["length"] = [len(ids) for ids in enc["input_ids"]]
    enc["label"] = [label2id[k] for k in frame[LABEL_KEY]]
    return enc


def collate(ds, indices: np.ndarray, tokenizer) -> Batch:
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
    labels = torch.as_tensor(rows["label"], dtype=torch.long)
    return Batch(dict(batch.items()), labels, weight, torch.as_tensor(indices, dtype=torch.long))
