"""Read data tables (CSV/TSV/JSONL/Parquet files, dataset directories, hf:// datasets) into pandas,
whole (``read_table``) or a chunk at a time (``read_chunks``, for ``data.rows``); each task
normalizes the columns it needs. Every user error names the field, the value and the fix.

Before anything is parsed, the input is checked where a careless or hostile file would otherwise
cost memory or produce garbage: only regular files, a size limit (``data.max_input_mb``), one kind
of data file per directory, and a look at the first bytes of text tables (binary data, ZIP/Excel
and Parquet files under a text name, byte-order marks, a first line with no end: ``data.text``,
which reads them too).
"""

from __future__ import annotations

import hashlib
import logging
import os
import stat
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from kubetune import providers
from kubetune.data.text import FALLBACK_ERRORS, codec_name, count_fallbacks, read_text_table, sniff
from kubetune.errors import KubetuneError, short  # short: re-exported, the tasks' messages take it from here

log = logging.getLogger(__name__)

FILE_SUFFIXES = {".csv": "csv", ".tsv": "tsv", ".jsonl": "jsonl", ".json": "json", ".parquet": "parquet"}
# Data files the `datasets` library reads from a directory, by the reader it picks (json and jsonl
# share one). It silently reads only the most common kind, so a mix is an error here.
DIR_KINDS = {
    ".csv": "csv",
    ".tsv": "tsv",
    ".json": "json",
    ".jsonl": "json",
    ".ndjson": "json",
    ".parquet": "parquet",
    ".arrow": "arrow",
}
BUILDERS = {
    "csv": ("csv", {}),
    "tsv": ("csv", {"sep": "\t"}),
    "json": ("json", {}),
    "parquet": ("parquet", {}),
    "arrow": ("arrow", {}),
}
# What the s3:// provider writes next to downloaded files; not data (and `datasets` would read it as such).
KUBETUNE_MANIFEST = "_kubetune_manifest.json"
TEXT_FORMATS = ("csv", "tsv", "json", "jsonl")


def read_table(
    uri: str,
    *,
    field: str,
    split: str | None = None,
    encoding: str = "auto",
    max_input_mb: int | None = None,
    s3: providers.S3Settings = providers.S3Settings(),
) -> pd.DataFrame:
    """Read one table from a file, a directory of files or an hf:// dataset, whole (``read_chunks``
    reads it a chunk at a time, in flat memory).

    Cells are read without NA inference: ``None``, ``NA``, ``null``, ``n/a`` ... are text; only an
    empty cell (or a JSON null) is missing.

    Args:
        uri: a path, file://, pkg://, s3:// or hf:// URI.
        field: the spec field it came from, named in errors.
        split: the split (and slice) of a directory or hf:// dataset.
        encoding: the text encoding of CSV/TSV/JSON files, or ``auto`` (UTF-8; a byte-order mark
            is honoured, bytes that are not valid UTF-8 are decoded as cp1252 with a warning).
        max_input_mb: the largest file (or directory's data files together) read, in MiB (None: no limit).
        s3: how to reach S3 for an s3:// URI (the job's; the default leaves it all to the environment).

    Raises:
        KubetuneError: not a regular file, too large, of an unknown or mixed format, binary, or
            unparseable; the message is one short line.
    """
    chunks = list(
        read_chunks(
            uri, field=field, split=split, encoding=encoding, max_input_mb=max_input_mb, s3=s3, chunk_bytes=None
        )
    )
    return chunks[0] if len(chunks) == 1 else pd.concat(chunks, ignore_index=True)


# A chunk of a table is about this many bytes of input: pandas holds several times that in Python
# objects, so a chunk costs tens of MiB of memory, whatever the size of the table.
CHUNK_BYTES = 8 << 20


@dataclass(frozen=True)
class Source:
    """A checked local copy of a table: its data files (one, or a directory's), their format, the
    text encoding to read them with."""

    uri: str
    path: Path
    fmt: str | None  # a file's format (FILE_SUFFIXES) or a directory's kind (DIR_KINDS); None: no data files
    files: tuple[tuple[Path, int], ...]
    encoding: str  # the spec's (auto or a name)
    enc: str  # a single text file's, as sniffed

    @property
    def size(self) -> int:
        return sum(size for _, size in self.files)

    def fingerprint(self) -> str:
        """A hash of the data files' names and contents: equal exactly when the table's bytes are."""
        h = hashlib.sha256()
        for file, size in self.files:
            h.update(f"{file.relative_to(self.path) if self.path.is_dir() else file.name}:{size}\n".encode())
            with file.open("rb") as f:
                h.update(hashlib.file_digest(f, "sha256").digest())
        return h.hexdigest()


def check_source(
    uri: str,
    *,
    field: str,
    encoding: str = "auto",
    max_input_mb: int | None = None,
    s3: providers.S3Settings = providers.S3Settings(),
) -> Source:
    """Resolve ``uri`` to local files (s3:// and hf:// are fetched) and check them before anything is
    parsed: regular files, the size limit, one kind per directory, a look at the first bytes of text
    tables. Raises KubetuneError (one line) as ``read_table`` does."""
    path = providers.resolve(uri, kind="dataset", field=field, s3=s3)
    if path.is_dir():
        kind, files = dir_data_files(path, uri, field)
        _check_size(sum(size for _, size in files), uri, field, max_input_mb, what="the data files in ")
        if kind in TEXT_FORMATS:
            for file, size in files:
                sniff(file, size, kind, encoding, f"{short(uri)}/{file.relative_to(path)}", field, in_dir=True)
        return Source(uri, path, kind, tuple(files), encoding, "")
    fmt = FILE_SUFFIXES.get(path.suffix.lower())
    if fmt is None:
        raise KubetuneError(
            f"cannot tell the format of {short(uri)!r} from its suffix {short(path.suffix, 20)!r}",
            field=field,
            fix=f"use one of {', '.join(FILE_SUFFIXES)} or a dataset directory",
        )
    size = _regular_size(path, uri, field)
    if size == 0:
        raise KubetuneError(f"{short(uri)!r} is empty", field=field, fix="point it at a file with a header and rows")
    _check_size(size, uri, field, max_input_mb)
    enc = "" if fmt == "parquet" else sniff(path, size, fmt, encoding, uri, field)
    return Source(uri, path, fmt, ((path, size),), encoding, enc)


def read_chunks(
    uri: str | Source,
    *,
    field: str,
    split: str | None = None,
    encoding: str = "auto",
    max_input_mb: int | None = None,
    s3: providers.S3Settings = providers.S3Settings(),
    chunk_bytes: int | None = CHUNK_BYTES,
) -> Iterator[pd.DataFrame]:
    """The table ``read_table`` reads, as consecutive DataFrames of about ``chunk_bytes`` of input
    each (None: one chunk, the whole table), with the same parsing rules: pandas reads each chunk as
    it reads a large file (whose column types it infers block by block), so a check over a column
    must look at every chunk. A JSON array file (not JSON lines) is one chunk.

    Raises:
        KubetuneError: as ``read_table``, for the first chunk that cannot be parsed (naming it).
    """
    source = (
        uri
        if isinstance(uri, Source)
        else check_source(uri, field=field, encoding=encoding, max_input_mb=max_input_mb, s3=s3)
    )
    uri = source.uri
    if source.path.is_dir():
        yield from _dataset_dir_chunks(source.path, uri, field, split, source.fmt, encoding, chunk_bytes)
        return
    fmt, path = source.fmt, source.path
    assert fmt is not None  # a file's format: check_source refused a suffix it does not know
    rows = None if chunk_bytes is None else _rows_per_chunk(path, source.size, chunk_bytes, fmt)
    try:
        if fmt == "parquet":
            yield from _parquet_chunks(path, rows)
        else:
            yield from read_text_table(path, fmt, source.enc, encoding == "auto", uri, field, rows)
    except KubetuneError:
        raise
    except (pd.errors.ParserError, pd.errors.EmptyDataError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise KubetuneError(
            f"cannot parse {short(uri)!r} as {fmt}: {short(first, 160)}",
            field=field,
            fix=f"check that the file is valid {fmt}",
        ) from None


def _rows_per_chunk(path: Path, size: int, chunk_bytes: int, fmt: str) -> int | None:
    """About ``chunk_bytes`` of a file in rows, from the mean row length of its first MiB (None: the
    file is small enough to be one chunk)."""
    if size <= chunk_bytes:
        return None
    if fmt == "parquet":
        import pyarrow.parquet as pq

        meta = pq.ParquetFile(path).metadata
        per_row = max(
            1, sum(meta.row_group(i).total_byte_size for i in range(meta.num_row_groups)) // max(1, meta.num_rows)
        )
    else:
        with path.open("rb") as f:
            head = f.read(1 << 20)
        per_row = max(1, len(head) // max(1, head.count(b"\n")))
    return max(100, chunk_bytes // per_row)


def _parquet_chunks(path: Path, rows: int | None) -> Iterator[pd.DataFrame]:
    if rows is None:
        yield pd.read_parquet(path)
        return
    import pyarrow.parquet as pq

    for batch in pq.ParquetFile(path).iter_batches(batch_size=rows):
        # pandas' own index, if pandas wrote the file, is not a column (pd.read_parquet restores it as the index)
        yield batch.to_pandas().drop(columns=[c for c in batch.schema.names if c.startswith("__index_level_")])


def _regular_size(path: Path, uri: str, field: str) -> int:
    st = path.stat()  # follows symlinks: a link to a FIFO is a FIFO
    if not stat.S_ISREG(st.st_mode):
        what = (
            "a FIFO"
            if stat.S_ISFIFO(st.st_mode)
            else "a device"
            if stat.S_ISCHR(st.st_mode) or stat.S_ISBLK(st.st_mode)
            else "a socket"
            if stat.S_ISSOCK(st.st_mode)
            else "a special file"
        )
        raise KubetuneError(
            f"{short(uri)!r} is not a regular file ({what})",
            field=field,
            fix="point it at a data file (write the stream to a file first)",
        )
    return st.st_size


def _check_size(size: int, uri: str, field: str, max_input_mb: int | None, what: str = "") -> None:
    if max_input_mb is not None and size > max_input_mb * 2**20:
        shown = f"{size / 2**30:.1f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"
        if (
            float(shown.split()[0]) * (1024 if "GiB" in shown else 1) <= max_input_mb
        ):  # rounded down to the limit itself
            shown = f"{size:,} bytes"
        raise KubetuneError(
            f"{what}{short(uri)!r} {'are' if what else 'is'} {shown}, over the {max_input_mb} MiB limit",
            field=field,
            fix="raise data.max_input_mb (or remove it: no limit), or use a smaller sample",
        )


def dir_data_files(path: Path, uri: str, field: str) -> tuple[str | None, list[tuple[Path, int]]]:
    """The data files in a directory (as `datasets` finds them: hidden ones skipped) and their kind."""
    files: list[tuple[Path, int]] = []
    suffixes: Counter[str] = Counter()
    for root, dirs, names in os.walk(path):
        dirs[:] = sorted(d for d in dirs if not d.startswith((".", "__")))
        for name in sorted(names):
            suffix = Path(name).suffix.lower()
            if (
                name.startswith((".", "__"))
                or suffix not in DIR_KINDS
                or (name == KUBETUNE_MANIFEST and root == str(path))
            ):
                continue
            file = Path(root) / name
            try:
                size = _regular_size(file, f"{uri}/{file.relative_to(path)}", field)
            except FileNotFoundError:  # a dangling link
                raise KubetuneError(
                    f"{short(uri)}/{short(file.relative_to(path), 60)} is a broken link",
                    field=field,
                    fix="remove it or restore its target",
                ) from None
            files.append((file, size))
            suffixes[suffix] += 1
    kinds = {DIR_KINDS[s] for s in suffixes}
    if len(kinds) > 1:
        listed = ", ".join(f"{n} {s}" for s, n in suffixes.most_common())
        raise KubetuneError(
            f"{short(uri)!r} mixes data file kinds ({listed}); only one kind would be read",
            field=field,
            fix="keep one kind of data file per directory (convert or move the others), or point it at one file",
        )
    return (next(iter(kinds)) if kinds else None), files


def _dataset_dir_chunks(
    path: Path, uri: str, field: str, split: str | None, kind: str | None, encoding: str, chunk_bytes: int | None
) -> Iterator[pd.DataFrame]:
    """A directory's (or hf:// dataset's) table, which `datasets` reads into its own memory-mapped
    Arrow cache, handed out ``chunk_bytes`` of Arrow at a time (as pandas reads the Arrow: lists
    become arrays)."""
    ds = _read_dataset_dir(path, uri, field, split, kind, encoding)
    if chunk_bytes is None or ds.data.nbytes <= chunk_bytes:
        yield ds.to_pandas()
        return
    rows = max(100, chunk_bytes // max(1, ds.data.nbytes // max(1, len(ds))))
    for table in ds.with_format("arrow").iter(batch_size=rows):
        yield table.to_pandas()


def _read_dataset_dir(path: Path, uri: str, field: str, split: str | None, kind: str | None, encoding: str):
    import datasets

    datasets.disable_progress_bars()
    options = {}
    if kind in ("csv", "tsv"):  # the same reading rules as a single file: no NA inference, the encoding
        options = {
            "keep_default_na": False,
            "na_values": [""],
            "encoding": codec_name(encoding) if encoding != "auto" else "utf-8",
            "encoding_errors": "strict" if encoding != "auto" else FALLBACK_ERRORS,
        }
    used = count_fallbacks()
    verbosity = datasets.logging.get_verbosity()
    datasets.logging.set_verbosity(
        datasets.logging.CRITICAL
    )  # its readers log each failed file; the error below says it in one line
    try:
        if (path / KUBETUNE_MANIFEST).is_file() and kind in BUILDERS:
            ds = _load_without_manifest(datasets, path, split, kind, options)
        else:
            ds = datasets.load_dataset(str(path), split=split or "train", **options)
    except (
        datasets.exceptions.DatasetGenerationError,
        datasets.table.CastError,
    ) as e:  # before ValueError: CastError is one
        cause = e.__cause__ or e.__context__ or e  # DatasetGenerationError wraps the reader's error
        reason = f"{type(cause).__name__}: {str(cause).strip().splitlines()[0] if str(cause).strip() else ''}"
        fix = (
            "set data.encoding to the files' encoding"
            if isinstance(cause, UnicodeError)
            else f"check that every file is valid {kind} with the same columns"
        )
        raise KubetuneError(
            f"cannot read {short(uri)}: {short(reason, 160)}",
            field="data.encoding" if isinstance(cause, UnicodeError) else field,
            fix=fix,
        ) from None
    except ValueError as e:
        msg = short(str(e).splitlines()[0], 200)
        raise KubetuneError(
            f"cannot load split {split!r} of {short(uri)}: {msg}",
            field=field.replace("data.train", "data.train_split").replace("data.eval", "data.eval_split"),
            fix="set data.train_split / data.eval_split, e.g. 'train[:3000]'",
        ) from None
    except (FileNotFoundError, datasets.exceptions.DatasetNotFoundError) as e:
        raise KubetuneError(
            f"no data files found in {short(uri)} ({short(e, 160)})",
            field=field,
            fix="point it at a dataset with CSV/JSONL/Parquet files",
        ) from None
    finally:
        datasets.logging.set_verbosity(verbosity)
    if used[0]:
        log.warning(
            "%s: some bytes are not valid UTF-8; decoded them as cp1252 "
            "(set data.encoding to the files' encoding to silence this)",
            short(uri),
        )
    return ds


def _load_without_manifest(datasets, path: Path, split: str | None, kind: str, options: dict):
    """``load_dataset`` on a directory that holds a kubetune manifest: the splits found as `datasets`
    finds them, but only the data files of ``kind`` (left alone, `datasets` reads the manifest as data)."""
    from datasets.data_files import DataFilesDict, get_data_patterns

    found = DataFilesDict.from_patterns(get_data_patterns(str(path)), base_path=str(path))
    suffixes = {s for s, k in DIR_KINDS.items() if k == kind}
    files = {
        name: [f for f in fs if Path(f).name != KUBETUNE_MANIFEST and Path(f).suffix.lower() in suffixes]
        for name, fs in found.items()
    }
    builder, extra = BUILDERS[kind]
    return datasets.load_dataset(
        builder, data_files={k: v for k, v in files.items() if v}, split=split or "train", **extra, **options
    )
