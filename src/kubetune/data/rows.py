"""Data in flat memory: a table read a chunk at a time (``tables.read_chunks``), each chunk normalized
by the task and appended to an Arrow file in the cache, which is then memory-mapped; the split made
on row ids; tokenization shared by every process of the node, each writing its own part (the cache's
Arrow files are read through ``data.arrowfile``).

Memory stays flat in the size of the data: no step holds more than one chunk of the table in Python
objects, and every column that grows with it is Arrow on disk or a NumPy array of row ids. A second
run on the same bytes finds the normalized rows (keyed by the files' content, not their names) and
the tokenized rows in the cache and starts within seconds.

Why not ``datasets.load_dataset`` + ``map`` throughout: its readers parse with pyarrow's rules (a
JSON column whose type changes between rows fails; "None" or "NA" in a CSV becomes missing), and
kubetune's tables keep pandas' rules, which the checks and the one-line errors are built on
(``tables.read_table``). Directories and hf:// datasets are read by ``datasets`` as before.
"""

from __future__ import annotations

import errno
import hashlib
import json
import logging
import os
import shutil
import socket
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import pandas as pd
import pyarrow as pa

from kubetune import distributed, providers
from kubetune.data.arrowfile import ArrowFile
from kubetune.data.arrowfile import column as column  # re-exported: the tasks read their columns here
from kubetune.data.splits import split_ids
from kubetune.data.tables import Source, check_source, read_chunks
from kubetune.errors import AgreedError, KubetuneError, short
from kubetune.paths import cache_root, set_default_modes

log = logging.getLogger(__name__)

ROWS_VERSION = "1"
TOKENS_VERSION = "2"
# Tokenization logs its progress every this many seconds (the first line after as long: a short
# tokenization logs nothing).
PROGRESS_EVERY_S = 15.0
TOKENIZE_BATCH = 1000  # rows per call of the task's encoder
POOL_MIN_ROWS = 50_000  # rows per worker below which a pool's start-up (seconds) is not worth it
# Rows per record batch of a tokenized part. Opening a part reads every batch's header through the
# dataset's memory map, and each read maps about 64 KiB around it (the kernel's fault-around) that stay
# resident: batches of 1,000 rows kept 129 MiB per 2 million rows resident in every process.
PART_BATCH_ROWS = 16_384


class Normalizer(Protocol):
    """A task's normalization of one table, chunk by chunk (``normalized_rows`` drives it)."""

    schema: pa.Schema  # the normalized columns

    def chunk(self, df: pd.DataFrame, start: int) -> dict[str, list]:
        """The normalized rows of a chunk whose first row is row ``start`` of the table (for errors);
        the checks that need the whole table are left to ``finish``."""

    def finish(self, rows: int) -> dict:
        """After the last chunk (``rows`` normalized rows kept): the checks over the whole table
        (raising KubetuneError), and the facts the task keeps (JSON-able), e.g. what was dropped."""


@dataclass
class Rows:
    """One table's normalized rows, memory-mapped from the cache."""

    ds: Any  # datasets.Dataset
    key: str  # the cache key: the files' content, how they were read and normalized
    facts: dict = field(default_factory=dict)
    path: str = ""  # the Arrow file (a pool's worker processes open it themselves)

    def __len__(self) -> int:
        return len(self.ds)


def normalized_rows(
    uri: str,
    *,
    field: str,
    split: str | None,
    encoding: str,
    max_input_mb: int | None,
    s3: providers.S3Settings,
    normalizer: Callable[[], Normalizer],
    settings: str,
) -> Rows:
    """The table at ``uri`` normalized by ``normalizer()``, from the cache when the same bytes were
    normalized with the same ``settings`` (the task's name and every option its normalization reads)
    before; the warnings normalization logged are logged again on a hit, so both runs read alike.

    Raises:
        KubetuneError: as ``tables.read_table`` and the normalizer do; a disk too small for the cache,
            or one that fills while writing it (nothing half-written is left for a later run to trust).
    """
    import datasets

    source = check_source(uri, field=field, encoding=encoding, max_input_mb=max_input_mb, s3=s3)
    h = hashlib.sha256(f"rows v{ROWS_VERSION}\n{settings}\n{split}\n{encoding}\n".encode())
    h.update(source.fingerprint().encode())
    key = h.hexdigest()[:32]
    path = cache_root() / "rows" / key
    if (path / "facts.json").is_file():
        facts = json.loads((path / "facts.json").read_text())
        for name, message in facts.get("warnings", []):
            logging.getLogger(name).warning("%s", message)
        return Rows(datasets.Dataset.from_file(str(path / "rows.arrow")), key, facts, str(path / "rows.arrow"))
    if max_input_mb is None:
        _check_free_space(source, field)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{key}-", dir=path.parent))
    try:
        with _Warnings() as warnings:
            facts = _write_rows(source, field, split, normalizer(), tmp / "rows.arrow")
        facts["warnings"] = warnings.records
        (tmp / "facts.json").write_text(json.dumps(facts))
        set_default_modes(tmp)
        try:
            os.replace(tmp, path)
        except OSError:  # another process wrote the same rows first: use its copy
            shutil.rmtree(tmp, ignore_errors=True)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _disk_error(e, path.parent, field) from None
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return Rows(datasets.Dataset.from_file(str(path / "rows.arrow")), key, facts, str(path / "rows.arrow"))


def _write_rows(source: Source, field: str, split: str | None, norm: Normalizer, out: Path) -> dict:
    start = kept = 0
    with pa.OSFile(str(out), "wb") as sink, pa.ipc.new_stream(sink, norm.schema) as writer:
        for df in read_chunks(source, field=field, split=split, encoding=source.encoding):
            table = pa.Table.from_pydict(norm.chunk(df, start), schema=norm.schema)
            writer.write_table(table)
            start += len(df)
            kept += len(table)
    return norm.finish(kept)


def _check_free_space(source: Source, field: str) -> None:
    """Refuse, before reading, data the cache's disk cannot hold: its normalized rows and their tokens
    take about twice the input (an estimate; a disk that fills anyway is caught while writing)."""
    root = cache_root()
    root.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(root).free
    need = 2 * source.size
    if need > free:
        raise KubetuneError(
            f"{short(source.uri)} is {source.size / 2**30:.1f} GiB; its data cache needs about "
            f"{need / 2**30:.1f} GiB in {root}, which has {free / 2**30:.1f} GiB free",
            field=field,
            fix="free space there, or point KUBETUNE_CACHE at a larger disk",
        )


def _disk_error(e: OSError, where: Path, field: str) -> Exception:
    if e.errno in (errno.ENOSPC, errno.EDQUOT):
        return KubetuneError(
            f"the disk of the data cache {where} filled up while writing {field}'s rows (nothing half-written kept)",
            field=field,
            fix="free space there, or point KUBETUNE_CACHE at a larger disk",
        )
    return e


class _Warnings(logging.Handler):
    """Records the warnings kubetune logs while a table is normalized (replayed on a cache hit)."""

    def __init__(self):
        super().__init__(logging.WARNING)
        self.records: list[tuple[str, str]] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append((record.name, record.getMessage()))

    def __enter__(self):
        logging.getLogger("kubetune").addHandler(self)
        return self

    def __exit__(self, *exc):
        logging.getLogger("kubetune").removeHandler(self)


def agreed(fn: Callable[[], Any]) -> Any:
    """``fn()`` on this rank, then a collective in which every rank learns whether any rank's ``fn``
    raised a KubetuneError: then every rank raises the first one (as an ``AgreedError``, said once,
    by rank 0) instead of waiting at the next collective for a rank that has left. Every rank calls it."""
    result, error = None, None
    try:
        result = fn()
    except KubetuneError as e:
        error = str(e)
    first = next((e for e in distributed.all_gather_object(error) if e is not None), None)
    if first is not None:
        raise AgreedError(first)
    return result


# ---------------------------------------------------------------- tokenization on every process


def _arrow_columns(cols: dict[str, list]) -> pa.Table:
    """The encoder's columns as Arrow: lists of token ids (or labels, masks) as int32, numbers as int64."""
    arrays = {}
    for name, values in cols.items():
        if values and isinstance(values[0], (list, tuple, np.ndarray)):
            arrays[name] = pa.array(values, type=pa.list_(pa.int32()))
        elif values and isinstance(values[0], (int, np.integer)):
            arrays[name] = pa.array(values, type=pa.int64())
        else:
            arrays[name] = pa.array(values)
    return pa.table(arrays)


def tokenized_rows(
    rows: Rows,
    ids: np.ndarray,
    *,
    env,
    fingerprint: str,
    encode: Callable[[pd.DataFrame], dict],
    what: str,
) -> tuple[Any, bool, str]:
    """Rows ``ids`` of ``rows`` tokenized by ``encode`` (DataFrame of rows -> columns), as a
    memory-mapped ``datasets.Dataset``, from the cache when it holds them.

    Every process of the node tokenizes its share (a contiguous slice of ``ids``) into its own part
    file; then local rank 0 publishes the parts as one cache entry (a rename: a half-written entry is
    never seen), and all load it. ``fingerprint``: everything else the tokens depend on (the
    tokenizer, max_length, the task's mode). Collective: every rank of the job must call it.

    Returns:
        (dataset, hit, key): hit is True when the cache held it already; key names the entry.
    """
    import datasets

    h = hashlib.sha256(f"tokens v{TOKENS_VERSION}\n{fingerprint}\n{rows.key}\n".encode())
    for lo in range(0, len(ids), 1 << 20):  # the ids' int64 bytes, a million at a time (not a copy of them all)
        h.update(np.ascontiguousarray(ids[lo : lo + (1 << 20)], dtype=np.int64).tobytes())
    key = h.hexdigest()[:32]
    root = cache_root() / "tokenized"
    path = root / key
    hit = (path / "parts.json").is_file()
    n_local = env.local_world_size
    # The node's processes are children of one launcher (torch's elastic agent): its pid names this
    # run's staging directory, which no other run on the node writes into or renames away.
    staging = root / f".{key}.{n_local}.{socket.gethostname()}.{os.getppid()}.staging"

    def share() -> None:
        if hit:
            return
        lo, hi = env.local_rank * len(ids) // n_local, (env.local_rank + 1) * len(ids) // n_local
        try:
            staging.mkdir(parents=True, exist_ok=True)
            _tokenize_share(rows, ids[lo:hi], encode, staging, env, len(ids), what)
        except OSError as e:
            raise _disk_error(e, staging, f"data.{what}") from None

    agreed(share)  # the barrier after which every part is written
    if env.is_local_main and not (path / "parts.json").is_file():
        try:
            parts = sorted(p.name for p in staging.glob("part-*.arrow"))  # zero-padded: row order
            (staging / "parts.json").write_text(json.dumps({"parts": parts, "rows": len(ids)}))
            set_default_modes(staging)
            os.replace(staging, path)
        except FileNotFoundError:  # another node sharing this cache published it first
            pass
        except OSError as e:
            if not (path / "parts.json").is_file():
                raise _disk_error(e, root, f"data.{what}") from None
    if env.is_local_main:  # parts this run wrote while another run published the same entry
        shutil.rmtree(staging, ignore_errors=True)
    distributed.barrier()
    parts = json.loads((path / "parts.json").read_text())["parts"]
    ds = datasets.concatenate_datasets([datasets.Dataset.from_file(str(path / p)) for p in parts])
    return ds, hit, key


def _cores() -> int:
    """The CPUs this process may use: its affinity, capped by a cgroup v2 CPU quota (a Kubernetes CPU
    limit, which the affinity does not show)."""
    n = len(os.sched_getaffinity(0))
    try:
        quota, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()
        if quota != "max":
            n = min(n, max(1, int(quota) // int(period)))
    except (OSError, ValueError):
        pass
    return n


def _tokenize_share(rows: Rows, ids: np.ndarray, encode, staging: Path, env, total: int, what: str) -> None:
    """This process's share of the node's tokenization, into part files ``part-RANK-PIECE.arrow`` (in row
    order by name). With more cores than processes on the node, the share is cut into pieces that a
    pool of worker processes tokenizes (spawned: each imports kubetune, a few seconds, so only for
    shares worth it)."""
    workers = max(1, _cores() // env.local_world_size)
    if workers == 1 or len(ids) < POOL_MIN_ROWS * workers:
        progress = _Progress(env, total, what, len(ids))
        _tokenize_part(rows.path, ids, encode, staging / f"part-{env.local_rank:05d}-00000.arrow", progress)
        return
    import concurrent.futures
    import multiprocessing

    pieces = np.array_split(ids, workers * 4)  # a few pieces per worker: progress, and even ends
    progress = _Progress(env, total, what, len(ids))
    from kubetune.lifetime import die_with_parent

    # the pool dies with this worker, as the worker with its launcher
    with concurrent.futures.ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("spawn"), initializer=die_with_parent, initargs=(os.getpid(),)
    ) as pool:
        futures = {
            pool.submit(
                _tokenize_part, rows.path, piece, encode, staging / f"part-{env.local_rank:05d}-{j:05d}.arrow"
            ): len(piece)
            for j, piece in enumerate(pieces)
        }
        for future in concurrent.futures.as_completed(futures):
            future.result()  # a worker's error is this process's
            progress.add(futures[future])


class _Progress:
    """The node's tokenization progress, logged by local rank 0 every PROGRESS_EVERY_S (its share's
    pace stands for the node's: the shares are equal)."""

    def __init__(self, env, total: int, what: str, share: int):
        self.env, self.total, self.what, self.share = env, total, what, share
        self.done = 0
        self.started = self.last = time.monotonic()

    def add(self, n: int) -> None:
        self.done += n
        now = time.monotonic()
        if not self.env.is_local_main or now - self.last < PROGRESS_EVERY_S:
            return
        self.last = now
        rate = self.done / (now - self.started)
        log.info(
            "data: tokenizing %s: %d of %d rows on this node (%d processes), %.0f rows/s, about %.0f s left",
            self.what,
            min(self.total, self.done * self.env.local_world_size),
            self.total,
            self.env.local_world_size,
            rate * self.env.local_world_size,
            (self.share - self.done) / max(rate, 1e-9),
        )


def _tokenize_part(rows_path: str, ids: np.ndarray, encode, part: Path, progress: _Progress | None = None) -> None:
    """Tokenize rows ``ids`` of the normalized rows at ``rows_path`` into the Arrow file ``part``
    (written under a temporary name, then renamed; a worker process of the pool runs it too)."""
    rows = ArrowFile(rows_path)
    tmp = part.with_name(f".{part.name}.{os.getpid()}.tmp")
    writer: pa.RecordBatchStreamWriter | None = None
    sink: pa.OSFile | None = None
    schema: pa.Schema | None = None
    pending: list[pa.Table] = []  # encoded, not yet written: up to PART_BATCH_ROWS rows

    def flush() -> None:
        if pending:
            assert writer is not None  # made with the first rows pending
            writer.write_table(pa.concat_tables(pending).combine_chunks())
            pending.clear()

    try:
        for lo in range(0, len(ids), TOKENIZE_BATCH):
            table = _arrow_columns(encode(pd.DataFrame(rows.take(ids[lo : lo + TOKENIZE_BATCH]).to_pydict())))
            if writer is None:
                schema, sink = table.schema, pa.OSFile(str(tmp), "wb")
                writer = pa.ipc.new_stream(sink, schema)
            pending.append(table.cast(schema) if table.schema != schema else table)
            if len(pending) * TOKENIZE_BATCH >= PART_BATCH_ROWS:  # every piece but a share's last is full
                flush()
            if progress is not None:
                progress.add(len(table))
        flush()
        if writer is None:  # no rows for this process: an empty part with the columns of an encoded row
            table = _arrow_columns(encode(pd.DataFrame(rows.take(np.zeros(1, dtype=np.int64)).to_pydict()))).slice(0, 0)
            sink = pa.OSFile(str(tmp), "wb")
            writer = pa.ipc.new_stream(sink, table.schema)
            writer.write_table(table)
        assert sink is not None  # opened with the writer
        writer.close()
        sink.close()
        writer = sink = None
        os.replace(tmp, part)
    finally:
        if writer is not None:
            writer.close()
        if sink is not None:
            sink.close()
        tmp.unlink(missing_ok=True)
        rows.close()


# ---------------------------------------------------------------- a task's tables, split


@dataclass
class RowSplit:
    """A task's normalized tables and its split, as row ids into them (``rows`` is data.train's,
    ``eval_rows`` data.eval's, or data.train's again when the evaluation split is carved from it)."""

    rows: Rows
    eval_rows: Rows
    train_ids: np.ndarray
    eval_ids: np.ndarray
    format: str = ""
    dropped: dict[str, int] = field(default_factory=dict)
    labels: list[str] = field(default_factory=list)  # class names (classification)
    view: Callable[[pd.DataFrame], pd.DataFrame] | None = None  # the task's view of its rows as a DataFrame

    @property
    def train(self) -> pd.DataFrame:
        """The training rows as a DataFrame: whole in memory, for small data (tests, a baseline)."""
        df = self.rows.ds.select(self.train_ids).to_pandas()
        return self.view(df) if self.view else df

    @property
    def eval(self) -> pd.DataFrame:
        """The evaluation rows as a DataFrame (as ``train``)."""
        df = self.eval_rows.ds.select(self.eval_ids).to_pandas()
        return self.view(df) if self.view else df


def read_split(
    spec,
    seed: int,
    s3: providers.S3Settings,
    *,
    normalizer: Callable[[str, dict | None], Normalizer],
    settings: str,
    carve: Callable[[Rows, int], tuple[np.ndarray, np.ndarray]] | None = None,
) -> RowSplit:
    """data.train and data.eval (when given) normalized (``normalized_rows``; ``normalizer(field,
    the train table's facts or None)`` makes a table's normalizer), then split (``split_ids``;
    ``carve(train rows, n)`` carves the evaluation split the task's way)."""

    def rows(which: str, train_facts: dict | None) -> Rows:
        return normalized_rows(
            getattr(spec, which),
            field=f"data.{which}",
            split=spec.train_split if which == "train" else spec.eval_split,
            encoding=spec.encoding,
            max_input_mb=spec.max_input_mb,
            s3=s3,
            normalizer=lambda: normalizer(f"data.{which}", train_facts),
            # the train table's facts the eval table's normalization reads: its format
            settings=f"{settings}\ndata.{which}\n{train_facts.get('format') if train_facts else ''}",
        )

    if getattr(spec, "streaming", False):  # data.train is streamed (``data.stream``): data.eval alone, whole
        only = rows("eval", None)
        _, eval_ids = split_ids(0, len(only), spec, seed)
        dropped = {"eval": only.facts["dropped"]} if only.facts.get("dropped") else {}
        return RowSplit(only, only, np.zeros(0, dtype=np.int64), eval_ids, only.facts.get("format", ""), dropped)
    train = rows("train", None)
    evald = rows("eval", train.facts) if spec.eval else None
    train_ids, eval_ids = split_ids(
        len(train),
        len(evald) if evald is not None else None,
        spec,
        seed,
        carve=(lambda n: carve(train, n)) if carve else None,
    )
    dropped = {
        which: t.facts["dropped"] for which, t in (("train", train), ("eval", evald)) if t and t.facts.get("dropped")
    }
    return RowSplit(train, evald or train, train_ids, eval_ids, train.facts.get("format", ""), dropped)
