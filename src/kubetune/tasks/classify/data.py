"""Sequence classification's data: labeled text tables (``data.text_column``, optional
``data.text_pair_column``, ``data.label_column``) read by ``data.tables``, checked, normalized to
``text`` (``text_pair``) and integer ``label`` columns, and split (stratified) into ``Frames``."""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import numpy as np
import pandas as pd
import torch

from kubetune.data import Batch
from kubetune.data.tables import describe_non_text, eval_cap, is_nested, read_table, short, split_indices
from kubetune.errors import KubetuneError
from kubetune.providers import S3Settings
from kubetune.tasks.classify import ClassificationData

log = logging.getLogger(__name__)

# The tokenizer outputs a micro-batch passes to the model.
MODEL_INPUTS = ("input_ids", "attention_mask", "token_type_ids")


@dataclass
class Frames:
    """Normalized training and evaluation data."""

    train: pd.DataFrame
    eval: pd.DataFrame
    labels: list[str]
    dropped: dict[str, int] = field(default_factory=dict)


def load_frames(spec: ClassificationData, seed: int, s3: S3Settings = S3Settings()) -> Frames:
    """Load, validate and split the data described by ``spec`` (s3:// data reached with ``s3``).

    Raises:
        KubetuneError: missing, oversized or non-tabular files or columns, a text column that holds
            no text, empty data, a single class or more than ``data.max_classes``, eval labels
            unseen in training.
    """
    dropped: dict[str, int] = {}
    train_raw = read_table(
        spec.train,
        field="data.train",
        split=spec.train_split,
        encoding=spec.encoding,
        max_input_mb=spec.max_input_mb,
        s3=s3,
    )
    train = _normalize(train_raw, spec, "data.train", dropped, "train")
    _check_labels(train[spec.label_column], spec)
    labels = _label_names(train[spec.label_column], spec)
    if len(labels) < 2:
        raise KubetuneError(
            f"only one class ({short(labels[0])!r}) in column '{short(spec.label_column)}' of {short(spec.train)}",
            field="data.label_column",
            fix="classification needs at least two classes; check the label column or the data",
        )
    label2id = {name: i for i, name in enumerate(labels)}
    train = _with_ids(train, spec, label2id)

    if spec.eval:
        eval_raw = read_table(
            spec.eval,
            field="data.eval",
            split=spec.eval_split,
            encoding=spec.encoding,
            max_input_mb=spec.max_input_mb,
            s3=s3,
        )
        evald = _normalize(eval_raw, spec, "data.eval", dropped, "eval")
        unseen = sorted(set(map(_label_key, evald[spec.label_column])) - set(labels))
        if unseen:
            raise KubetuneError(
                f"labels {[short(u, 40) for u in unseen[:5]]} occur in {short(spec.eval)} "
                f"but never in {short(spec.train)}",
                field="data.eval",
                fix="train on data that covers every eval label, or filter those rows out",
            )
        evald = _with_ids(evald, spec, label2id)
    else:
        train, evald = _carve_eval(train, spec.eval_fraction, seed)

    if spec.max_train_samples and len(train) > spec.max_train_samples:
        train = train.sample(n=spec.max_train_samples, random_state=seed).sort_index()
    if cap := eval_cap(spec, len(evald), carved=not spec.eval):
        evald = evald.sample(n=cap, random_state=seed).sort_index()
    return Frames(train.reset_index(drop=True), evald.reset_index(drop=True), labels, dropped)


def _normalize(
    df: pd.DataFrame, spec: ClassificationData, field: str, dropped: dict[str, int], which: str
) -> pd.DataFrame:
    source = short(getattr(spec, field.split(".")[1]))
    columns = [spec.text_column] + ([spec.text_pair_column] if spec.text_pair_column else []) + [spec.label_column]
    names = {
        "text_column": spec.text_column,
        "text_pair_column": spec.text_pair_column,
        "label_column": spec.label_column,
    }
    available = [short(c, 40) for c in df.columns[:20]]
    for key, col in names.items():
        if col is not None and col not in df.columns:
            raise KubetuneError(
                f"column '{short(col, 40)}' not found in {source}; "
                f"columns are {available}{' ...' if len(df.columns) > 20 else ''}",
                field=f"data.{key}",
                fix=f"set data.{key}",
            )
    if len(df) == 0:
        raise KubetuneError(f"{source} has no rows", field=field, fix="point it at data with at least one labeled row")
    df = df[columns].copy()
    for key in ("text_column", "text_pair_column"):
        col = names[key]
        what = describe_non_text(df[col]) if col else None
        if what:
            raise KubetuneError(
                f"column '{short(col, 40)}' of {source} holds {what}, not text",
                field=f"data.{key}",
                fix=f"set data.{key} to the text column",
            )
    if df[spec.label_column].dtype == object and df[spec.label_column].map(is_nested).any():
        raise KubetuneError(
            f"column '{short(spec.label_column, 40)}' of {source} "
            "holds nested values (lists/structs), not class labels",
            field="data.label_column",
            fix="set data.label_column to the column that holds one class per row",
        )
    keep = np.ones(len(df), dtype=bool)
    for col in columns[:-1]:
        text = df[col]
        ok = text.notna() & text.map(lambda v: isinstance(v, str) and v.strip() != "")
        keep &= ok.to_numpy()
    keep &= df[spec.label_column].notna().to_numpy()
    n_drop = int((~keep).sum())
    if n_drop:
        dropped[which] = n_drop
        log.warning("%s: dropped %d of %d rows with a missing/empty text or label", field, n_drop, len(df))
    df = df[keep]
    if len(df) == 0:
        raise KubetuneError(
            f"no usable rows in {source}: every row lacks a text or label",
            field=field,
            fix="check data.text_column and data.label_column",
        )
    return df


def _check_labels(series: pd.Series, spec: ClassificationData) -> None:
    """Refuse more classes than data.max_classes; warn on fractional numbers (a regression target)."""
    keys = series.map(_label_key)
    n = keys.nunique()
    if n > spec.max_classes:
        raise KubetuneError(
            f"column '{short(spec.label_column, 40)}' of {short(spec.train)} has {n} distinct labels, "
            f"more than data.max_classes ({spec.max_classes})",
            field="data.label_column",
            fix="check that data.label_column is the class column (not an id or a free-text column), "
            "or raise data.max_classes",
        )
    fractional = [
        v
        for v in series.unique()
        if isinstance(v, (float, np.floating)) and math.isfinite(v) and not float(v).is_integer()
    ]
    if fractional:
        log.warning(
            "data.label_column: column '%s' holds fractional numbers (e.g. %s): this looks like a regression target; "
            "kubetune classifies, so each of the %d distinct values becomes a class",
            short(spec.label_column, 40),
            ", ".join(f"{v:g}" for v in sorted(fractional)[:3]),
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


def _label_names(series: pd.Series, spec: ClassificationData) -> list[str]:
    """Distinct labels in sorted order: numerically when every label is a number (2 before 10),
    whether the column was read as numbers or as strings, else as strings."""
    values = series.map(_label_key).unique().tolist()
    try:
        return sorted(values, key=lambda v: (_number(v), v))
    except ValueError:
        return sorted(values)


def _with_ids(df: pd.DataFrame, spec: ClassificationData, label2id: dict[str, int]) -> pd.DataFrame:
    out = pd.DataFrame({"text": df[spec.text_column].astype(str).to_numpy()})
    if spec.text_pair_column:
        out["text_pair"] = df[spec.text_pair_column].astype(str).to_numpy()
    out["label"] = df[spec.label_column].map(lambda v: label2id[_label_key(v)]).astype("int64").to_numpy()
    return out


def _carve_eval(train: pd.DataFrame, fraction: float, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    counts = train["label"].value_counts()
    n_eval = max(1, round(len(train) * fraction))
    if len(train) < 2 or n_eval >= len(train):
        raise KubetuneError(
            f"{len(train)} rows are too few to hold out {fraction:.0%} for evaluation",
            field="data.eval_fraction",
            fix="add data, lower data.eval_fraction, or give data.eval",
        )
    # Stratify when every class can be split and each side can hold every class (a class with a single
    # row cannot be split; scikit-learn refuses a side smaller than the number of classes).
    can_stratify = counts.min() >= 2 and min(n_eval, len(train) - n_eval) >= len(counts)
    tr, ev = split_indices(train["label"].to_numpy(), n_eval, seed, can_stratify)
    return train.iloc[tr].sort_index(), train.iloc[ev].sort_index()


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
