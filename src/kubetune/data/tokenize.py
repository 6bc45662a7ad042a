"""Tokenization with an on-disk cache keyed by the data, the tokenizer and max_length.

A second run with the same inputs loads the cached Arrow files (memory-mapped) instead of
tokenizing again. Only local rank 0 of each node tokenizes; the others wait at a barrier and load.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

import pandas as pd

from kubetune.paths import cache_root, set_default_modes

log = logging.getLogger(__name__)
CACHE_VERSION = "1"


def tokenizer_fingerprint(tokenizer) -> str:
    """Hash of the tokenizer's full serialized state (vocab, normalizer, special tokens)."""
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None:
        state = json.loads(backend.to_str())
        # Calling the tokenizer with truncation=True rewrites these two keys on the backend;
        # they are per-call settings, not part of the tokenizer's identity.
        state.pop("truncation", None)
        state.pop("padding", None)
        h.update(json.dumps(state, sort_keys=True).encode())
    else:
        h.update(repr(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    h.update(str(getattr(tokenizer, "chat_template", None)).encode())  # renders causal-LM conversations
    h.update(type(tokenizer).__name__.encode())
    return h.hexdigest()


def cache_key(frame: pd.DataFrame, tokenizer_fp: str, max_length: int, mode: str) -> str:
    h = hashlib.sha256()
    h.update(f"v{CACHE_VERSION}:{mode}:{max_length}:{tokenizer_fp}:{list(frame.columns)}".encode())
    h.update(pd.util.hash_pandas_object(frame, index=False).to_numpy().tobytes())
    return h.hexdigest()[:32]


def tokenized(frame: pd.DataFrame, tokenizer, max_length: int, *, build: bool, mode: str, encode):
    """Return the tokenized ``frame`` as a ``datasets.Dataset``, from the on-disk cache when it
    holds this exact input.

    Args:
        frame: the task's normalized rows; a ``label`` column is kept as it is.
        build: when True, tokenize on a cache miss (local rank 0); when False, the cache must exist.
        mode: the task's name for its tokenization (with any setting that changes it); part of the
            cache key.
        encode: the task's tokenization, a DataFrame of the frame's rows -> columns (with ``length``);
            what it produces must depend only on the rows, the tokenizer, ``max_length`` and ``mode``.

    Returns:
        (dataset, hit): hit is True when the cache already held this exact input.
    """
    import datasets

    datasets.disable_progress_bars()
    key = cache_key(frame, tokenizer_fingerprint(tokenizer), max_length, mode)
    path = cache_root() / "tokenized" / key
    if (path / "dataset_info.json").exists():
        return datasets.load_from_disk(str(path)), True
    if not build:
        raise FileNotFoundError(f"tokenization cache {path} missing (local rank 0 should have built it)")

    def builtin(batch):
        return encode(pd.DataFrame(dict(batch)))

    ds = datasets.Dataset.from_pandas(frame, preserve_index=False)
    ds = ds.map(builtin, batched=True, batch_size=1000, remove_columns=[c for c in ds.column_names if c != "label"])
    path.parent.mkdir(parents=True, exist_ok=True)
    # Write to a temporary sibling and rename, so a crash never leaves a half-written cache entry.
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=path.parent))
    ds.save_to_disk(str(tmp))
    set_default_modes(tmp)
    try:
        os.replace(tmp, path)
    except OSError:  # another process won the race; use its copy
        shutil.rmtree(tmp, ignore_errors=True)
    return datasets.load_from_disk(str(path)), False
