"""The splits every task shares: a seeded hold-out of data.eval_fraction (stratified as scikit-learn
does, ``split_indices``), the caps on training and evaluation rows; on row ids (``split_ids``, the
flat-memory path of ``data.rows``) and on DataFrames (``split_rows``, ``read_rows``, for task plugins
that read whole tables)."""

from __future__ import annotations

import logging

import numpy as np
import pandas as pd

from kubetune import providers
from kubetune.config import DataSpec
from kubetune.data.sharding import index_dtype
from kubetune.data.tables import read_table
from kubetune.errors import KubetuneError

log = logging.getLogger(__name__)


def split_indices(labels: np.ndarray, n_test: int, seed: int, stratify: bool) -> tuple[np.ndarray, np.ndarray]:
    """Row positions of a seeded train/test split: exactly scikit-learn's ``train_test_split(...,
    test_size=n_test, random_state=seed, stratify=labels if stratify else None)`` (ShuffleSplit, or
    StratifiedShuffleSplit with its approximate-mode allocation), draw for draw.

    Why our own: importing scikit-learn for this one call takes 0.55-0.85 s in every worker of every
    classification run, before its first step (benchmarks/README.md, "A short run's fixed cost");
    tests/unit/test_data.py compares this with scikit-learn's function over many label sets, sizes and seeds.
    """
    rng = np.random.RandomState(seed)
    n_train = len(labels) - n_test
    ids = index_dtype(len(labels))  # row ids as int32 while they fit: this runs on millions of rows
    if not stratify:
        permutation = np.arange(len(labels), dtype=ids)
        rng.shuffle(permutation)  # RandomState.permutation(n): an arange shuffled, the same draws in int32
        return permutation[n_test:], permutation[:n_test]
    values, class_counts = _classes(labels)
    n_i = _approximate_mode(class_counts, n_train, rng)
    t_i = _approximate_mode(class_counts - n_i, n_test, rng)
    train_parts: list[np.ndarray] = []
    test_parts: list[np.ndarray] = []
    for i, value in enumerate(values):
        # the class's rows in file order: what scikit-learn's stable argsort of the class ids gives, one
        # class at a time (the argsort of every row, and np.unique's inverse, were 16 bytes per row at once)
        rows = np.flatnonzero(labels == value).astype(ids)
        shuffled = rows.take(rng.permutation(class_counts[i]))
        train_parts.append(shuffled[: n_i[i]])
        test_parts.append(shuffled[n_i[i] : n_i[i] + t_i[i]])
    # Arrays joined, not Python lists of NumPy scalars (about 40 bytes per row: 640 MiB for 16 million
    # rows); permuting the array draws what permuting the list drew.
    train, test = np.concatenate(train_parts), np.concatenate(test_parts)
    return rng.permutation(train), rng.permutation(test)


def _classes(labels: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct labels, sorted; how many rows each has): ``np.unique(labels, return_counts=True)``,
    counted with ``bincount`` when the labels are small non-negative integers (class ids: no sorted copy)."""
    if labels.dtype.kind in "iu" and len(labels) and labels.min() >= 0 and labels.max() < 1 << 20:
        counts = np.bincount(labels)
        values = np.flatnonzero(counts)
        return values, counts[values]
    return np.unique(labels, return_counts=True)


def _approximate_mode(class_counts: np.ndarray, n_draws: int, rng: np.random.RandomState) -> np.ndarray:
    """How many of ``n_draws`` each class gets: its proportional share rounded down, the rest handed
    out by the largest remainders, ties broken at random (scikit-learn's ``_approximate_mode``)."""
    continuous = class_counts / class_counts.sum() * n_draws
    floored = np.floor(continuous)
    need = int(n_draws - floored.sum())
    if need > 0:
        remainder = continuous - floored
        for value in np.sort(np.unique(remainder))[::-1]:
            (candidates,) = np.where(remainder == value)
            take = min(len(candidates), need)
            floored[rng.choice(candidates, size=take, replace=False)] += 1
            need -= take
            if need == 0:
                break
    return floored.astype(int)


def read_rows(
    spec: DataSpec, seed: int, detect, normalize, *, s3: providers.S3Settings = providers.S3Settings()
) -> tuple[pd.DataFrame, pd.DataFrame, str, dict[str, int]]:
    """(train, eval, format, dropped): data.train read (s3:// as ``s3`` says) and its format detected
    (``detect(table, spec)``), data.train and data.eval normalized alike (``normalize(table, spec,
    format, field, dropped, "train" | "eval")``, which counts what it drops into ``dropped``), then
    ``split_rows``."""
    dropped: dict[str, int] = {}
    tables = {}
    for which in ("train", "eval"):
        uri = getattr(spec, which)
        if uri:
            split = spec.train_split if which == "train" else spec.eval_split
            tables[which] = read_table(
                uri, field=f"data.{which}", split=split, encoding=spec.encoding, max_input_mb=spec.max_input_mb, s3=s3
            )
    fmt = detect(tables["train"], spec)
    rows = {which: normalize(t, spec, fmt, f"data.{which}", dropped, which) for which, t in tables.items()}
    train, evald = split_rows(rows["train"], rows.get("eval"), spec, seed)
    return train, evald, fmt, dropped


# An evaluation split carved out of data.train is evaluated on at most this many rows (a seeded subset)
# unless data.max_eval_samples says otherwise. Why: a carve-out grows with the training set, and every
# eval_every paid for all of it (10,242 rows evaluated for 2 training steps of a 205k-row set); 10,000
# rows put a 2-sigma band of about ±1 point on an accuracy near 0.5. A given data.eval is the user's
# choice and is not capped.
CARVED_EVAL_CAP = 10_000


def eval_cap(spec: DataSpec, n_eval: int, carved: bool) -> int | None:
    """How many of ``n_eval`` evaluation rows to keep (None: all): data.max_eval_samples, else
    ``CARVED_EVAL_CAP`` for a split carved out of data.train (said in the log)."""
    if spec.max_eval_samples:
        return spec.max_eval_samples if n_eval > spec.max_eval_samples else None
    if carved and n_eval > CARVED_EVAL_CAP:
        log.info(
            "data: the evaluation split carved out of data.train has %d rows; evaluating on a seeded %d of them "
            "(set data.max_eval_samples to choose)",
            n_eval,
            CARVED_EVAL_CAP,
        )
        return CARVED_EVAL_CAP
    return None


def split_rows(train: pd.DataFrame, evald: pd.DataFrame | None, spec: DataSpec, seed: int):
    """(train, eval) rows: without eval rows, data.eval_fraction of the train rows held out (seeded);
    then each capped at data.max_train_samples / ``eval_cap`` (a seeded subset, in file order)."""
    carved = evald is None
    if evald is None:
        n_eval = max(1, round(len(train) * spec.eval_fraction))
        if n_eval >= len(train):
            raise KubetuneError(
                f"{len(train)} rows are too few to hold out {spec.eval_fraction:.0%} for evaluation",
                field="data.eval_fraction",
                fix="add data, lower data.eval_fraction, or give data.eval",
            )
        perm = np.random.default_rng(seed).permutation(len(train))
        evald, train = train.iloc[np.sort(perm[:n_eval])], train.iloc[np.sort(perm[n_eval:])]
    if spec.max_train_samples and len(train) > spec.max_train_samples:
        train = train.sample(n=spec.max_train_samples, random_state=seed).sort_index()
    if cap := eval_cap(spec, len(evald), carved):
        evald = evald.sample(n=cap, random_state=seed).sort_index()
    return train.reset_index(drop=True), evald.reset_index(drop=True)


def sample_ids(ids: np.ndarray, n: int, seed: int) -> np.ndarray:
    """A seeded ``n`` of ``ids`` (sorted), drawn as ``DataFrame.sample(n, random_state=seed)`` draws
    (what the split drew when it worked on DataFrames: the same rows, so the same runs)."""
    picked = np.random.RandomState(seed).choice(len(ids), size=n, replace=False)
    return np.sort(ids[picked])


def split_ids(n_train: int, n_eval: int | None, spec, seed: int, carve=None, eval_cap=eval_cap):
    """(train ids, eval ids): without an eval table (``n_eval`` None), data.eval_fraction of the
    train rows held out (seeded; ``carve(n_eval)`` -> (train ids, eval ids) when the task carves its
    own way, e.g. stratified), each then capped at data.max_train_samples / ``eval_cap(spec, n, carved)``.
    Row for row what ``tables.split_rows`` selects from DataFrames."""
    carved = n_eval is None
    if carved:
        k = max(1, round(n_train * spec.eval_fraction))
        if k >= n_train:
            raise KubetuneError(
                f"{n_train} rows are too few to hold out {spec.eval_fraction:.0%} for evaluation",
                field="data.eval_fraction",
                fix="add data, lower data.eval_fraction, or give data.eval",
            )
        if carve is not None:
            train, evald = carve(k)
        else:
            # default_rng(seed).permutation(n_train), drawn into an int32 arange when the ids fit (the same
            # permutation: sharding.epoch_order says why), half the memory for millions of rows
            perm = np.arange(n_train, dtype=index_dtype(n_train))
            np.random.default_rng(seed).shuffle(perm)
            evald, train = np.sort(perm[:k]), np.sort(perm[k:])
            del perm
    else:
        assert n_eval is not None  # not carved: the eval table's rows
        train, evald = np.arange(n_train, dtype=index_dtype(n_train)), np.arange(n_eval, dtype=index_dtype(n_eval))
    if spec.max_train_samples and len(train) > spec.max_train_samples:
        train = sample_ids(train, spec.max_train_samples, seed)
    if eval_cap is not None and (cap := eval_cap(spec, len(evald), carved)):
        evald = sample_ids(evald, cap, seed)
    # row ids as int32 while they fit (int64 beyond): 4 bytes per training row, not 8
    return train.astype(index_dtype(n_train), copy=False), evald.astype(index_dtype(n_eval or n_train), copy=False)
