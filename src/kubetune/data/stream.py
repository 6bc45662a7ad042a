"""Streamed data (``data.streaming``), for data larger than the local disk: the shards of a local
directory or an s3:// prefix read in order, one at a time, normalized by the task as they come,
through a seeded shuffle buffer, with a position a checkpoint can hold and a resume continue exactly.

- ``list_shards`` (``data.shards``) lists the data files (name, size, version) once; the listing's
  fingerprint goes into every state, so a resume on data that changed (a shard added, removed or
  rewritten) is refused in one line naming the first shard that differs.
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
import itertools
import json
import os
import tempfile
from collections.abc import Callable, Generator, Iterator
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

import numpy as np
import pyarrow as pa

from kubetune import providers
from kubetune.data.rows import Normalizer
from kubetune.data.shards import RESUME_FIX, Listing, Shard, changed, download, local_version
from kubetune.data.shards import list_shards as list_shards  # re-exported: the tasks list a stream's shards here
from kubetune.data.tables import CHUNK_BYTES, Source, check_source, read_chunks
from kubetune.errors import KubetuneError, short

STATE_VERSION = 1


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
        self._source: Generator[tuple[int, int, dict], None, None] | None = None

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

    def _rows_from(self, first: int, skip: int) -> Generator[tuple[int, int, dict], None, None]:
        """(shard, rows of it taken with this one, row) from row ``skip`` of shard ``first`` on."""
        for k in range(first, len(self.listing.shards)):
            # closed here, not when collected: a stream closed mid-shard deletes its copy now
            with contextlib.closing(self._shard_rows(self.listing.shards[k])) as rows:
                for n, values in enumerate(rows, 1):
                    if k > first or n > skip:
                        yield k, n, values

    def _shard_rows(self, shard: Shard) -> Generator[dict, None, None]:
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
            if local_version(source.path) != shard.version:
                raise changed(shard, self.field)
            yield source
            return
        fd, tmp = tempfile.mkstemp(prefix="kubetune-shard-", suffix=PurePosixPath(shard.name).suffix, dir=self.tmp_dir)
        os.close(fd)
        try:
            download(shard, Path(tmp), self.field, self.s3)
            try:
                source = check_source(tmp, field=self.field, encoding=self.encoding)
            except KubetuneError as e:  # it names the temporary file: name the shard instead
                raise _reworded(e, lambda m: m.replace(tmp, shard.uri).replace(short(tmp), short(shard.uri))) from None
            yield dataclasses.replace(source, uri=shard.uri)
        finally:
            Path(tmp).unlink(missing_ok=True)


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
