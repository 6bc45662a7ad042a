"""Streamed data (``data.streaming``), for data larger than the local disk: the shards of a local
directory or an s3:// prefix read in order, one at a time, normalized by the task as they come,
through a seeded shuffle buffer, with a position a checkpoint can hold and a resume continue exactly.

- ``list_shards`` lists the data files (name, size, version) once; the listing's fingerprint goes
  into every state, so a resume on data that changed (a shard added, removed or rewritten) is
  refused in one line naming the first shard that differs.
- ``Stream`` yields one epoch's normalized rows: shards in listing order, rows in file order, read
  a chunk at a time (``tables.read_chunks``, pandas' rules, as the cached path reads them); an s3://
  shard is downloaded to a temporary file, deleted once read, so a stream keeps one shard on disk.
  ``state_dict()`` between any two rows is (epoch, rows taken, shard, rows of it taken, the
  shuffle buffer, its RNG state, the listing): small and JSON-able.
- ``slot`` and ``rank_steps`` deal the stream to the ranks: steps of ``world_size × batch_size ×
  grad_accum`` rows, each micro-batch's rows dealt round-robin, as ``sharding.rank_plan`` deals an
  epoch's order. The assignment is a function of a row's position in the epoch alone, so a
  checkpoint taken at a step boundary resumes on another world size with the same global batch
  without repeating or skipping a row.

Trade-offs, chosen for exactness over bandwidth:

- Every rank reads and normalizes the whole stream and keeps its own rows; only those are
  tokenized (by the caller), which is the costly part. So every rank holds the same state, and a
  checkpoint's position means the same thing on any world size. The cost: each rank downloads
  every shard (``n`` ranks on a node download it ``n`` times and hold up to ``n`` shards on disk).
- No prefetch: the next shard is downloaded when the current one is done, so the disk never holds
  two; a read stalls for one download per shard.
- A shard is a table of its own for the task's normalizer: ``normalizer_factory(shard)`` makes one
  per shard and its whole-table checks (``finish``) run at the shard's end. Per epoch they could not
  survive a resume (a normalizer's state is not in the checkpoint); per shard they can, because a
  resume reads the current shard again from its start and normalizes the rows it skips, so the
  normalizer sees what it saw in the uninterrupted run (the cost: one more read of that shard).
- A version is what the store says, not the content: an S3 ETag, a local file's size and mtime. A
  copy of the same bytes elsewhere, or a ``touch``, counts as changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import hashlib
import itertools
import json
import os
import tempfile
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import pyarrow as pa

from kubetune import providers
from kubetune.data.rows import Normalizer
from kubetune.data.tables import (
    CHUNK_BYTES,
    DIR_KINDS,
    FILE_SUFFIXES,
    KUBETUNE_MANIFEST,
    Source,
    check_source,
    dir_data_files,
    read_chunks,
    short,
)
from kubetune.errors import KubetuneError

STATE_VERSION = 1
RESUME_FIX = (
    "restore the data the run started with, use another output.uri, or pass --no-resume (training.resume: never)"
)
SHARD_FORMATS = ", ".join(FILE_SUFFIXES)  # what one shard may be: a file check_source reads


@dataclass(frozen=True)
class Shard:
    """One data file of a stream."""

    name: str  # its path relative to the listed directory or prefix (a single file: its own name)
    uri: str  # where it is read from; errors name it
    size: int
    version: str  # S3: the ETag; a local file: "size:mtime_ns"


@dataclass(frozen=True)
class Listing:
    """The shards of a stream, in the order they are read."""

    uri: str
    shards: tuple[Shard, ...]

    def fingerprint(self) -> str:
        """A hash of the shards' names, sizes and versions: equal exactly when the listing is."""
        return self._fingerprint

    @functools.cached_property
    def _fingerprint(self) -> str:  # a state_dict per checkpoint would hash every shard's entry again
        h = hashlib.sha256(b"kubetune stream listing v1\n")
        for s in self.shards:
            h.update(f"{len(s.name)}:{s.name}\0{s.size}\0{s.version}\n".encode())
        return h.hexdigest()

    def state(self) -> dict:
        """The listing as a checkpoint holds it: its fingerprint, and each shard (to name what changed)."""
        return {"fingerprint": self.fingerprint(), "shards": [[s.name, s.size, s.version] for s in self.shards]}

    def check_unchanged(self, saved: dict, field: str) -> None:
        """Refuse, in one line naming the first shard that differs, a listing other than ``saved``
        (``state()`` of the listing a checkpoint was taken on)."""
        if saved["fingerprint"] == self.fingerprint():
            return
        old = [tuple(s) for s in saved["shards"]]
        new = [(s.name, s.size, s.version) for s in self.shards]
        old_names, uris = {name for name, _, _ in old}, {s.name: s.uri for s in self.shards}
        what = "its listing differs"
        for a, b in itertools.zip_longest(old, new):
            if a == b:
                continue
            if a is not None and b is not None and a[0] == b[0]:
                what = (
                    f"{short(uris[b[0]])} was rewritten (size {a[1]} -> {b[1]}, "
                    f"version {short(a[2], 40)} -> {short(b[2], 40)})"
                )
            elif b is not None and (a is None or b[0] not in old_names):
                what = f"{short(uris[b[0]])} was added"
            else:
                what = f"{short(_join(self.uri, a[0]))} was removed"
            break
        raise KubetuneError(
            f"{short(self.uri)} changed since the checkpoint was taken: {what}, so the stream would not continue "
            "the same run",
            field=field,
            fix=RESUME_FIX,
        )


def _join(uri: str, name: str) -> str:
    return f"{uri.rstrip('/')}/{name}"


def _local_version(path: Path) -> str:
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def _walk_order(name: str) -> tuple:
    """A sort key that puts relative names in ``os.walk`` order (a directory's files, then its
    subdirectories, each sorted), so an s3:// copy of a directory streams in the directory's order."""
    parts = name.split("/")
    return tuple((1, p) for p in parts[:-1]) + ((0, parts[-1]),)


def _check_kinds(uri: str, names: list[str], field: str) -> None:
    """One kind of data file (as ``tables`` requires of a directory), each a kind one file can be read as."""
    suffixes = Counter(PurePosixPath(n).suffix.lower() for n in names)
    if len({DIR_KINDS.get(s, s) for s in suffixes}) > 1:
        listed = ", ".join(f"{n} {s}" for s, n in suffixes.most_common())
        raise KubetuneError(
            f"{short(uri)!r} mixes data file kinds ({listed}); only one kind would be read",
            field=field,
            fix="keep one kind of data file per directory (convert or move the others), or point it at one file",
        )
    odd = next((n for n in names if PurePosixPath(n).suffix.lower() not in FILE_SUFFIXES), None)
    if odd is not None:
        raise KubetuneError(
            f"cannot stream {short(_join(uri, odd))}: a streamed shard is one of {SHARD_FORMATS}",
            field=field,
            fix="convert the shards (.ndjson: rename to .jsonl), or set data.streaming: false",
        )


def list_shards(uri: str, *, field: str, s3: providers.S3Settings = providers.S3Settings()) -> Listing:
    """The shards of ``uri``: a local data file (one shard), the data files of a local directory
    (as ``tables`` finds them: hidden files skipped, one kind), or of an s3:// prefix (kubetune's
    manifest and hidden keys skipped; the objects listed page by page, nothing downloaded).

    Raises:
        KubetuneError: hf:// (not yet streamed), nothing there, no data files, mixed kinds, a kind a
            shard cannot be, or S3 refusing the listing; one line.
    """
    scheme = providers.parse_uri(uri).scheme
    if scheme == "hf":
        raise KubetuneError(
            f"streaming from hf:// is not yet supported ({short(uri)})",
            field=field,
            fix="copy the dataset's files to s3:// or a local directory, or set data.streaming: false",
        )
    if scheme == "s3":
        return _s3_listing(uri, field, s3)
    path = providers.resolve(uri, kind="dataset", field=field, s3=s3)
    if path.is_dir():
        _, files = dir_data_files(path, uri, field)
        names = [file.relative_to(path).as_posix() for file, _ in files]
        shards = [Shard(n, _join(uri, n), size, _local_version(f)) for n, (f, size) in zip(names, files)]
    else:
        names = [path.name]
        shards = [Shard(path.name, uri, path.stat().st_size, _local_version(path))]
    if not shards:
        raise KubetuneError(
            f"no data files in {short(uri)}", field=field, fix=f"point it at a directory of {SHARD_FORMATS} files"
        )
    _check_kinds(uri, names, field)
    return Listing(uri, tuple(shards))


def _s3_listing(uri: str, field: str, settings: providers.S3Settings) -> Listing:
    from kubetune.providers import s3 as s3p

    loc = s3p.Location.parse(uri, field)
    client = s3p.client(settings)
    try:
        if loc.key and not loc.key.endswith("/"):
            head = _head(client, loc)
            if head is not None:  # one object: one shard
                name = PurePosixPath(loc.key).name
                _check_kinds(uri, [name], field)
                return Listing(uri, (Shard(name, uri, head["ContentLength"], head["ETag"]),))
        prefix = loc.key.rstrip("/") + "/" if loc.key else ""
        shards = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=prefix):
            for o in page.get("Contents", []):
                name = o["Key"][len(prefix) :]
                parts = name.split("/")
                if (
                    name.endswith("/")
                    or name == KUBETUNE_MANIFEST
                    or any(p.startswith((".", "__")) for p in parts)
                    or PurePosixPath(name).suffix.lower() not in DIR_KINDS
                ):
                    continue
                shards.append(Shard(name, f"s3://{loc.bucket}/{o['Key']}", o["Size"], o["ETag"]))
    except KubetuneError:
        raise
    except Exception as e:
        raise s3p.translate(e, loc, field, "list", settings) from None
    if not shards:
        raise KubetuneError(
            f"no data files under {short(uri)} ({settings.endpoint() or 'AWS S3'})",
            field=field,
            fix=f"check the bucket and prefix: streaming reads {SHARD_FORMATS} objects",
        )
    shards.sort(key=lambda s: _walk_order(s.name))
    _check_kinds(uri, [s.name for s in shards], field)
    return Listing(uri, tuple(shards))


def _head(client, loc) -> dict | None:
    """The object at ``loc``, or None when there is none (its key may be a prefix)."""
    from botocore.exceptions import ClientError

    try:
        return client.head_object(Bucket=loc.bucket, Key=loc.key)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def origin(shard: int, row: int) -> int:
    """A row's identity in a stream: its shard's place in the listing and its place among the shard's
    kept rows, as one integer (what a trace records; ``shard << 32 | row``)."""
    return shard << 32 | row


class Stream:
    """One epoch's normalized rows of a listing (dicts of the normalizer's columns), in a seeded
    order; an iterator, with ``state_dict`` / ``load_state_dict`` between any two rows.

    The order: shards in listing order, each shard's rows in file order (rows the normalizer drops
    are skipped), through a shuffle buffer of ``shuffle_buffer`` rows (0: none). The buffer takes
    each row in and, once it holds more than ``shuffle_buffer``, hands out one of its rows drawn
    uniformly (a NumPy Generator seeded with (seed, epoch)), as webdataset's and torchdata's
    shuffle buffers do; at the end of the epoch it drains in random order. Build one per epoch.

    Args:
        listing: the shards (``list_shards``).
        normalizer_factory: ``f(shard)`` -> the task's ``Normalizer`` for that shard (a fresh one per
            shard: its checks and errors are the shard's; name ``shard.uri`` in them).
        field: the spec field the data came from, named in errors.
        encoding: the text encoding of the shards (as ``tables.read_chunks``).
        seed, epoch: the shuffle buffer's RNG is seeded with (seed, epoch).
        shuffle_buffer: rows held for shuffling (bounds the state's size; 0: file order).
        s3: how to reach S3 for s3:// shards.
        tmp_dir: where an s3:// shard is downloaded while it is read (default: the system's temporary
            directory); it holds one shard of this stream at a time.
        chunk_bytes: how much of a shard is parsed at a time (``tables.read_chunks``).
    """

    def __init__(
        self,
        listing: Listing,
        *,
        normalizer_factory: Callable[[Shard], Normalizer],
        field: str,
        encoding: str = "auto",
        seed: int = 0,
        epoch: int = 0,
        shuffle_buffer: int = 0,
        s3: providers.S3Settings = providers.S3Settings(),
        tmp_dir: Path | None = None,
        chunk_bytes: int | None = CHUNK_BYTES,
    ):
        self.listing, self.factory, self.field, self.encoding = listing, normalizer_factory, field, encoding
        self.seed, self.shuffle_buffer, self.s3, self.chunk_bytes = seed, shuffle_buffer, s3, chunk_bytes
        self.tmp_dir = tmp_dir
        self.epoch = epoch
        self.index = 0  # rows handed out in this epoch: the next row's position in the epoch
        self.shard = 0  # the shard of the next row into the buffer
        self.row = 0  # rows of that shard already taken into the buffer
        self.buffer: list[tuple[int, dict]] = []  # (origin, row)
        self.origin = -1  # the origin (``origin``) of the last row handed out
        self.rng = np.random.default_rng([seed, epoch])
        self._source: Iterator[tuple[int, int, dict]] | None = None

    @classmethod
    def from_state(cls, listing: Listing, state: dict, **kwargs) -> Stream:
        """A stream that continues where ``state`` (a ``state_dict()``) was taken; ``kwargs`` as the constructor's."""
        stream = cls(listing, **kwargs)
        stream.load_state_dict(state)
        return stream

    def state_dict(self) -> dict:
        """The position between the last row handed out and the next: JSON-able, its size bounded
        by the shuffle buffer (and the listing's, a name, size and version per shard)."""
        return {
            "version": STATE_VERSION,
            "epoch": self.epoch,
            "index": self.index,
            "shard": self.shard,
            "row": self.row,
            "buffer": [[o, dict(r)] for o, r in self.buffer],
            "rng": self.rng.bit_generator.state,
            "seed": self.seed,
            "shuffle_buffer": self.shuffle_buffer,
            "listing": self.listing.state(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Continue from ``state``: the rows that follow are those the stream that saved it would have yielded.

        Raises:
            KubetuneError: the listing changed since (naming the first shard that differs), or the
                state was taken with another seed or shuffle buffer; one line.
        """
        if state.get("version") != STATE_VERSION:
            raise KubetuneError(
                f"the checkpoint's stream position has version {state.get('version')!r}, "
                f"this kubetune reads {STATE_VERSION}",
                field=self.field,
                fix="resume with the kubetune that wrote it, or pass --no-resume (training.resume: never)",
            )
        self.listing.check_unchanged(state["listing"], self.field)
        for key, field in (("seed", "training.seed"), ("shuffle_buffer", "data.shuffle_buffer")):
            if state[key] != getattr(self, key):
                raise KubetuneError(
                    f"the checkpoint's stream was read with {field} {state[key]}, this run has {getattr(self, key)}",
                    field=field,
                    fix=RESUME_FIX.replace("the data the run started with", "the original setting"),
                )
        self.close()
        self.epoch, self.index, self.shard, self.row = state["epoch"], state["index"], state["shard"], state["row"]
        self.buffer = [(int(o), dict(r)) for o, r in state["buffer"]]
        self.rng = np.random.Generator(np.random.PCG64())
        self.rng.bit_generator.state = state["rng"]

    def close(self) -> None:
        """Stop reading: the shard being read is closed and its temporary copy deleted."""
        if self._source is not None:
            self._source.close()
            self._source = None

    def __enter__(self) -> Stream:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __iter__(self) -> Stream:
        return self

    def __next__(self) -> dict:
        if self._source is None:
            self._source = self._rows_from(self.shard, self.row)
        while True:
            try:
                taken = next(self._source, None)
            except BaseException:
                # the source is spent: a next call reads again from the position (and fails again),
                # rather than taking the rest of the epoch for empty
                self._source = None
                raise
            if taken is None:
                break
            self.shard, self.row, values = taken
            if not self.shuffle_buffer:
                self.index += 1
                self.origin = origin(self.shard, self.row - 1)
                return values
            self.buffer.append((origin(self.shard, self.row - 1), values))
            if len(self.buffer) > self.shuffle_buffer:
                return self._draw()
        self.shard, self.row = len(self.listing.shards), 0
        if self.buffer:
            return self._draw()
        raise StopIteration

    def _draw(self) -> dict:
        """One of the buffer's rows, drawn uniformly (the last one takes its place)."""
        k = int(self.rng.integers(len(self.buffer)))
        self.buffer[k], self.buffer[-1] = self.buffer[-1], self.buffer[k]
        self.index += 1
        self.origin, values = self.buffer.pop()
        return values

    def _rows_from(self, first: int, skip: int) -> Iterator[tuple[int, int, dict]]:
        """(shard, rows of it taken with this one, row) from row ``skip`` of shard ``first`` on."""
        for k in range(first, len(self.listing.shards)):
            # closed here, not when collected: a stream closed mid-shard deletes its copy now
            with contextlib.closing(self._shard_rows(self.listing.shards[k])) as rows:
                for n, values in enumerate(rows, 1):
                    if k > first or n > skip:
                        yield k, n, values

    def _shard_rows(self, shard: Shard) -> Iterator[dict]:
        """A shard's normalized rows, all of them (a resume skips what it took), then the
        normalizer's checks over the shard."""
        with self._local(shard) as source:
            norm = self.factory(shard)
            start = kept = 0
            for df in self._chunks(source):
                try:
                    cols = norm.chunk(df, start)
                except KubetuneError as e:
                    raise _naming(e, shard.uri) from None
                # through Arrow, as the cached path stores them: the same Python values, JSON-able
                rows = pa.Table.from_pydict(cols, schema=norm.schema).to_pylist()
                start += len(df)
                kept += len(rows)
                yield from rows
            try:
                norm.finish(kept)
            except KubetuneError as e:
                raise _naming(e, shard.uri) from None

    def _chunks(self, source: Source) -> Iterator:
        """``read_chunks`` of one shard; a JSON-lines shard that does not parse is named with its first bad line."""
        try:
            yield from read_chunks(source, field=self.field, encoding=self.encoding, chunk_bytes=self.chunk_bytes)
        except KubetuneError as e:
            # pandas names a position in the chunk's text, not a line: find the line when it is a parse error
            parse = source.fmt in ("json", "jsonl") and f"cannot parse {short(source.uri)!r}" in str(e)
            line = _first_bad_json_line(source.path) if parse else None
            if line is None:
                raise
            raise _reworded(e, lambda m: f"{m} (line {line})") from None

    @contextlib.contextmanager
    def _local(self, shard: Shard) -> Iterator[Source]:
        """The shard as a checked local file: a local shard in place (its version checked), an
        s3:// one downloaded to ``tmp_dir`` and deleted on the way out."""
        if providers.parse_uri(shard.uri).scheme != "s3":
            source = check_source(shard.uri, field=self.field, encoding=self.encoding)
            if _local_version(source.path) != shard.version:
                raise _changed(shard, self.field)
            yield source
            return
        fd, tmp = tempfile.mkstemp(prefix="kubetune-shard-", suffix=PurePosixPath(shard.name).suffix, dir=self.tmp_dir)
        os.close(fd)
        try:
            _download(shard, Path(tmp), self.field, self.s3)
            try:
                source = check_source(tmp, field=self.field, encoding=self.encoding)
            except KubetuneError as e:  # it names the temporary file: name the shard instead
                raise _reworded(e, lambda m: m.replace(tmp, shard.uri).replace(short(tmp), short(shard.uri))) from None
            yield dataclasses.replace(source, uri=shard.uri)
        finally:
            Path(tmp).unlink(missing_ok=True)


def _download(shard: Shard, dest: Path, field: str, settings: providers.S3Settings) -> None:
    """Fetch an s3:// shard to ``dest`` and check that it is the version listed: its size, and S3's
    If-Match on the listed ETag right after (boto3's transfer does not take one; it keeps a multipart
    download to one version itself, so an object that is still the listed one was downloaded whole)."""
    from botocore.exceptions import ClientError

    from kubetune.providers import s3 as s3p

    loc = s3p.Location.parse(shard.uri, field)
    client = s3p.client(settings)
    try:
        client.download_file(loc.bucket, loc.key, str(dest), Config=s3p.transfer_config())
        client.head_object(Bucket=loc.bucket, Key=loc.key, IfMatch=shard.version)
    except ClientError as e:
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status in (404, 412) or e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "412"):
            raise _changed(shard, field) from None
        raise s3p.translate(e, loc, field, "read from", settings) from None
    except Exception as e:
        raise s3p.translate(e, loc, field, "read from", settings) from None
    if dest.stat().st_size != shard.size:
        raise _changed(shard, field)


def _changed(shard: Shard, field: str) -> KubetuneError:
    return KubetuneError(
        f"{short(shard.uri)} is no longer the version listed when the stream started (rewritten or removed since)",
        field=field,
        fix="leave the data unchanged while a run reads it: restore it and resume, or pass --no-resume",
    )


def _first_bad_json_line(path: Path) -> int | None:
    """The number (from 1) of the first non-blank line of a JSON-lines file that is not JSON; None if
    every one is, or if the file is one JSON array."""
    with path.open("rb") as f:
        for number, raw in enumerate(f, 1):
            if number == 1 and raw.lstrip(b"\xef\xbb\xbf \t\r\n").startswith(b"["):
                return None
            if raw.strip():
                try:
                    json.loads(raw)
                except ValueError:
                    return number
    return None


def _reworded(e: KubetuneError, edit: Callable[[str], str]) -> KubetuneError:
    """``e`` with its message, between the field and the fix, passed through ``edit``."""
    text = str(e).removeprefix(f"{e.field}: " if e.field else "")
    message, _, fix = text.rpartition(" — ") if e.fix and " — " in text else (text, "", None)
    return KubetuneError(edit(message), field=e.field, fix=fix)


def _naming(e: KubetuneError, uri: str) -> KubetuneError:
    """``e``, naming the shard ``uri`` if it does not already."""
    return e if uri in str(e) or short(uri) in str(e) else _reworded(e, lambda m: f"{short(uri)}: {m}")


# ---------------------------------------------------------------- the stream dealt to the ranks


@dataclass(frozen=True)
class Slot:
    """Where a row of the epoch goes."""

    step: int  # the optimizer step of the epoch
    micro: int  # the micro-batch of that step
    rank: int


def slot(index: int, *, world_size: int, batch_size: int, grad_accum: int) -> Slot:
    """The step, micro-batch and rank of the epoch's row ``index``: rows come in steps of
    ``world_size × batch_size × grad_accum``; micro-batch m of a step is its m-th run of
    ``world_size × batch_size`` rows, dealt round-robin (rank r takes the r-th of every
    ``world_size``), as ``sharding.rank_plan`` deals an epoch's order. Every row has one slot."""
    step, k = divmod(index, world_size * batch_size * grad_accum)
    micro, j = divmod(k, world_size * batch_size)
    return Slot(step, micro, j % world_size)


@dataclass(frozen=True)
class StreamStep:
    """One optimizer step of a stream, for one rank."""

    index: int  # the epoch position of the step's first row
    global_count: int  # rows in the step across all ranks (fewer than a full step only at the epoch's end)
    micro: list[list[dict]]  # this rank's rows per micro-batch (may be empty in the epoch's last step)
    origins: list[list[int]]  # their origins (``origin``), alike
    first: dict  # the step's first row (any rank's): what a rank with no rows computes on, with weight 0


def rank_steps(stream: Stream, *, rank: int, world_size: int, batch_size: int, grad_accum: int) -> Iterator[StreamStep]:
    """The steps of ``stream``'s epoch from its position on, with this rank's rows (``slot``).

    Every rank reads every row: each rank's stream is in the same state after a step, so
    ``stream.state_dict()`` taken when a step has been received (by any rank) resumes at the next
    step, on any world size whose ``world_size × batch_size × grad_accum`` is the same. A stream
    resumed off a step boundary first finishes the step it is in.
    """
    per_step = world_size * batch_size * grad_accum
    while True:
        start = stream.index
        rows = []
        for row in itertools.islice(stream, per_step - start % per_step):
            rows.append((stream.origin, row))
        if not rows:
            return
        micro: list[list[dict]] = [[] for _ in range(grad_accum)]
        origins: list[list[int]] = [[] for _ in range(grad_accum)]
        for i, (o, row) in enumerate(rows, start):
            where = slot(i, world_size=world_size, batch_size=batch_size, grad_accum=grad_accum)
            if where.rank == rank:
                micro[where.micro].append(row)
                origins[where.micro].append(o)
        yield StreamStep(start, len(rows), micro, origins, rows[0][1])
