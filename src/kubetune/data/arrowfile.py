"""Arrow files of the data cache (normalized rows, tokenized parts) read through a memory map of our
own, whose pages are dropped from the process's resident memory as they are read (``ArrowFile``),
and a numeric column of a cached ``datasets.Dataset`` read that way (``column``).
"""

from __future__ import annotations

import mmap

import numpy as np
import pyarrow as pa


def column(ds, name: str) -> np.ndarray:
    """A numeric column of a ``datasets.Dataset`` as a NumPy array, straight from its Arrow data (a
    ``ds[name]`` converts row by row: 3.5 s for 200k rows); integers as int32 where they fit.

    A dataset memory-mapped from cache files (a task's tokenized rows) is read through ``ArrowFile``
    instead of its own map: the column's pages, and the token ids around them that the kernel maps with
    them, then leave this process's resident memory (a 2 GB chat set's lengths and targets read through
    the dataset's map kept about 140 MiB per million rows resident)."""
    files = [f["filename"] for f in getattr(ds, "cache_files", [])]
    parts, rows = [], 0
    for f in files:  # each file opened once: its row count and its column
        with ArrowFile(f) as arrow:
            parts.append(arrow.column(name))
            rows += arrow.rows
    if not files or rows != ds.data.num_rows:  # in memory, or not simply its files: the dataset's own way
        values = np.asarray(ds.with_format("arrow")[name].to_numpy())
        return values.astype(_narrow(values.dtype, values.min(), values.max())) if len(values) else values
    values = parts[0] if len(parts) == 1 else np.concatenate(parts)
    indices = getattr(ds, "_indices", None)  # a selection (``ds.select``): its row ids into the files
    if indices is not None:
        values = values[indices.column(0).to_numpy()]
    return values


def _narrow(dtype: np.dtype, low, high) -> np.dtype:
    """int32 for integers whose values ``low``..``high`` fit it (half the memory of a per-row int64
    array), else ``dtype``."""
    if dtype.kind in "iu" and dtype.itemsize > 4 and np.iinfo(np.int32).min <= low and high <= np.iinfo(np.int32).max:
        return np.dtype(np.int32)
    return dtype


class ArrowFile:
    """An Arrow stream file (the cache's rows and tokens) read through a memory map of our own, whose
    pages ``release()`` drops from this process's resident memory.

    Why not the ``datasets.Dataset``'s map: every page read through it stays resident for the
    process's life (page cache counted as the process's RSS): tokenizing a 500 MB chat set left 260 MiB
    of its rows resident in each process, growing with the data. Here a reader releases what it has
    read as it goes (``madvise(MADV_DONTNEED)`` on a read-only map of the file: the pages stay in the
    page cache, and a later read maps them again)."""

    def __init__(self, path: str):
        self._file = open(path, "rb")
        self._map = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        self.table = pa.ipc.open_stream(pa.py_buffer(self._map)).read_all()
        self.rows = self.table.num_rows
        self._starts = np.cumsum([0] + [len(b) for b in self.table.to_batches()])

    def release(self) -> None:
        """Drop the pages read so far from this process's resident memory."""
        self._map.madvise(mmap.MADV_DONTNEED)

    def take(self, ids: np.ndarray) -> pa.Table:
        """Rows ``ids`` in their order, gathered record batch by record batch (a chunked table's ``take``
        may concatenate every chunk first)."""
        batches = self.table.to_batches()
        which = np.searchsorted(self._starts, ids, side="right") - 1
        by_batch = np.argsort(which, kind="stable")
        grouped, batch_of = ids[by_batch], which[by_batch]  # the ids in file order, and each one's batch
        bounds = np.flatnonzero(np.diff(batch_of)) + 1
        firsts: np.ndarray | list[int] = batch_of[np.r_[0, bounds]] if len(ids) else []
        pieces, since = [], 0
        for b, picked in zip(firsts, np.split(grouped, bounds)):
            pieces.append(batches[b].take(pa.array(picked - self._starts[b])))  # a copy: the map's pages can go
            since += len(picked)
            # Every row read maps about 64 KiB around it (the kernel's fault-around): 1,000 ids spread
            # over the file (an evaluation split) mapped 200 MiB at once before this release.
            if since >= 64:
                self.release()
                since = 0
        table = pa.Table.from_batches(pieces, schema=self.table.schema)
        if np.any(by_batch[1:] < by_batch[:-1]):  # ids not in file order: back to theirs
            table = table.take(pa.array(np.argsort(by_batch, kind="stable")))
        return table

    def column(self, name: str) -> np.ndarray:
        """A numeric column, whole, as a NumPy array (integers as int32 where every value fits), its
        pages released as it is read."""
        import pyarrow.compute as pc

        col = self.table.column(name)
        dtype = np.dtype(col.type.to_pandas_dtype())
        if len(col):
            dtype = _narrow(dtype, *(v.as_py() for v in pc.min_max(col).values()))
        out = np.empty(len(col), dtype=dtype)
        pos = released = 0
        for chunk in col.chunks:
            out[pos : pos + len(chunk)] = chunk.to_numpy(zero_copy_only=False)
            pos += len(chunk)
            if pos - released >= 1 << 20:
                self.release()
                released = pos
        self.release()
        return out

    def close(self) -> None:
        self.table = None  # the table's buffers point into the map: gone before it closes
        try:
            self._map.close()
        except BufferError:  # a caller still holds an array of the table: the map closes when it is freed
            self._map.madvise(mmap.MADV_DONTNEED)
        self._file.close()

    def __enter__(self) -> ArrowFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
