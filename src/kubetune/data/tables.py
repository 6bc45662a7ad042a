"""Read labeled text tables (CSV/TSV/JSONL/Parquet files, dataset directories, hf:// datasets).

Produces ``Frames``: train and eval pandas frames with normalized columns ``text`` (and
``text_pair``) and integer ``label``, plus the sorted label names. Every user error names the
field, the value and the fix.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import pandas as pd

from kubetune import providers
from kubetune.config import DataSpec
from kubetune.errors import KubetuneError

log = logging.getLogger(__name__)

FILE_SUFFIXES = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}


@dataclass
class Frames:
    """Normalized training and evaluation data."""

    train: pd.DataFrame
    eval: pd.DataFrame
    labels: list[str]
    dropped: dict[str, int] = field(default_factory=dict)

    @property
    def label2id(self) -> dict[str, int]:
        return {name: i for i, name in enumerate(self.labels)}


def load_frames(spec: DataSpec, seed: int) -> Frames:
    """Load, validate and split the data described by ``spec``.

    Raises:
        KubetuneError: missing files or columns, empty data, a single class, eval labels unseen
            in training.
    """
    dropped: dict[str, int] = {}
    train_raw = read_table(spec.train, field="data.train", split=spec.train_split, encoding=spec.encoding)
    train = _normalize(train_raw, spec, "data.train", dropped, "train")
    labels = _label_names(train[spec.label_column], spec)
    if len(labels) < 2:
        raise KubetuneError(
            f"only one class ({labels[0]!r}) in column '{spec.label_column}' of {spec.train}",
            field="data.label_column",
            fix="classification needs at least two classes; check the label column or the data",
        )
    label2id = {name: i for i, name in enumerate(labels)}
    train = _with_ids(train, spec, label2id)

    if spec.eval:
        eval_raw = read_table(spec.eval, field="data.eval", split=spec.eval_split, encoding=spec.encoding)
        evald = _normalize(eval_raw, spec, "data.eval", dropped, "eval")
        unseen = sorted(set(map(_label_key, evald[spec.label_column])) - set(labels))
        if unseen:
            raise KubetuneError(
                f"labels {unseen[:5]} occur in {spec.eval} but never in {spec.train}",
                field="data.eval",
                fix="train on data that covers every eval label, or filter those rows out",
            )
        evald = _with_ids(evald, spec, label2id)
    else:
        train, evald = _carve_eval(train, spec.eval_fraction, seed)

    if spec.max_train_samples and len(train) > spec.max_train_samples:
        train = train.sample(n=spec.max_train_samples, random_state=seed).sort_index()
    if spec.max_eval_samples and len(evald) > spec.max_eval_samples:
        evald = evald.sample(n=spec.max_eval_samples, random_state=seed).sort_index()
    return Frames(train.reset_index(drop=True), evald.reset_index(drop=True), labels, dropped)


def read_table(uri: str, *, field: str, split: str | None = None, encoding: str = "auto") -> pd.DataFrame:
    """Read one table from a file, a directory of files or an hf:// dataset."""
    path = providers.resolve(uri, kind="dataset", field=field)
    if path.is_dir():
        return _read_dataset_dir(path, uri, field, split)
    fmt = FILE_SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise KubetuneError(
            f"cannot tell the format of {uri!r} from its suffix '{path.suffix}'",
            field=field,
            fix=f"use one of {', '.join(FILE_SUFFIXES)} or a dataset directory",
        )
    if path.stat().st_size == 0:
        raise KubetuneError(f"{uri!r} is empty", field=field, fix="point it at a file with a header and rows")
    try:
        if fmt == "parquet":
            return pd.read_parquet(path)
        return _read_text_table(path, fmt, encoding, uri, field)
    except KubetuneError:
        raise
    except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise KubetuneError(f"cannot parse {uri!r} as {fmt}: {first}", field=field, fix=f"check that the file is valid {fmt}") from None


def _read_text_table(path: Path, fmt: str, encoding: str, uri: str, field: str) -> pd.DataFrame:
    encodings = ["utf-8", "latin-1"] if encoding == "auto" else [encoding]
    for i, enc in enumerate(encodings):
        try:
            if fmt == "csv":
                df = pd.read_csv(path, encoding=enc)
            elif fmt == "tsv":
                df = pd.read_csv(path, sep="\t", encoding=enc)
            else:
                df = pd.read_json(path, lines=(fmt == "jsonl" or _looks_like_jsonl(path)), encoding=enc)
        except UnicodeDecodeError as e:
            if i + 1 < len(encodings):
                continue
            raise KubetuneError(
                f"{uri!r} is not valid {enc} (byte {e.start})", field="data.encoding", fix="set data.encoding to the file's encoding, e.g. latin-1"
            ) from None
        except LookupError:
            raise KubetuneError(f"unknown encoding {enc!r}", field="data.encoding", fix="use auto, utf-8, latin-1, cp1252, ...") from None
        if enc != encodings[0]:
            log.warning("%s: not valid utf-8; decoded as %s (set data.encoding to silence this)", uri, enc)
        return df
    raise AssertionError("unreachable")


def _looks_like_jsonl(path: Path) -> bool:
    with path.open("rb") as f:
        return not f.read(64).lstrip().startswith(b"[")


def _read_dataset_dir(path: Path, uri: str, field: str, split: str | None) -> pd.DataFrame:
    import datasets

    datasets.disable_progress_bars()
    try:
        ds = datasets.load_dataset(str(path), split=split or "train")
    except ValueError as e:
        msg = str(e).splitlines()[0]
        raise KubetuneError(f"cannot load split {split!r} of {uri}: {msg}", field=field.replace("data.train", "data.train_split").replace("data.eval", "data.eval_split"), fix="set data.train_split / data.eval_split, e.g. 'train[:3000]'") from None
    except (FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as e:
        raise KubetuneError(f"no data files found in {uri} ({e})", field=field, fix="point it at a dataset with CSV/JSONL/Parquet files") from None
    return ds.to_pandas()


def _normalize(df: pd.DataFrame, spec: DataSpec, field: str, dropped: dict[str, int], which: str) -> pd.DataFrame:
    columns = [spec.text_column] + ([spec.text_pair_column] if spec.text_pair_column else []) + [spec.label_column]
    names = {"text_column": spec.text_column, "text_pair_column": spec.text_pair_column, "label_column": spec.label_column}
    available = [str(c) for c in df.columns]
    for key, col in names.items():
        if col is not None and col not in df.columns:
            raise KubetuneError(
                f"column '{col}' not found in {getattr(spec, field.split('.')[1])}; columns are {available[:20]}",
                field=f"data.{key}",
                fix=f"set data.{key}",
            )
    if len(df) == 0:
        raise KubetuneError(f"{getattr(spec, field.split('.')[1])} has no rows", field=field, fix="point it at data with at least one labeled row")
    df = df[columns].copy()
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
        raise KubetuneError(f"no usable rows in {getattr(spec, field.split('.')[1])}: every row lacks a text or label", field=field, fix="check data.text_column and data.label_column")
    return df


def _label_key(value) -> str:
    if isinstance(value, (float, np.floating)) and float(value).is_integer():
        value = int(value)
    return str(value)


def _label_names(series: pd.Series, spec: DataSpec) -> list[str]:
    values = series.map(_label_key).unique().tolist()
    if pd.api.types.is_numeric_dtype(series):
        try:
            return sorted(values, key=lambda v: float(v))
        except ValueError:
            pass
    return sorted(values)


def _with_ids(df: pd.DataFrame, spec: DataSpec, label2id: dict[str, int]) -> pd.DataFrame:
    out = pd.DataFrame({"text": df[spec.text_column].astype(str).to_numpy()})
    if spec.text_pair_column:
        out["text_pair"] = df[spec.text_pair_column].astype(str).to_numpy()
    out["label"] = df[spec.label_column].map(lambda v: label2id[_label_key(v)]).astype("int64").to_numpy()
    return out


def _carve_eval(train: pd.DataFrame, fraction: float, seed: int) -> tuple[pd.DataFrame, pd.DataFrame]:
    from sklearn.model_selection import train_test_split

    counts = train["label"].value_counts()
    n_eval = max(1, round(len(train) * fraction))
    if len(train) < 2 or n_eval >= len(train):
        raise KubetuneError(
            f"{len(train)} rows are too few to hold out {fraction:.0%} for evaluation",
            field="data.eval_fraction",
            fix="add data, lower data.eval_fraction, or give data.eval",
        )
    # Stratify when every class can be split; a class with a single row cannot.
    stratify = train["label"] if counts.min() >= 2 and n_eval >= len(counts) else None
    tr, ev = train_test_split(train, test_size=n_eval, stratify=stratify, random_state=seed)
    return tr.sort_index(), ev.sort_index()
