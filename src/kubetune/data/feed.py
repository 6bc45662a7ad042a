"""Streamed training data as the trainer takes it (``data.streaming``): each epoch a ``Stream`` of the
listing dealt to the ranks by ``rank_steps``, this rank's rows tokenized by the task as they come and
collated into micro-batches, the step's loss units summed over the ranks, and the stream's position
for the checkpoint.

Why a loop of our own and not a ``datasets.IterableDataset`` in a ``DataLoader``: the checkpoint must
hold the position between two optimizer steps exactly (the shuffle buffer, its RNG, the shard and
row), and a loader's workers read ahead of the step being trained, so their position is never the
step's; ``IterableDataset.state_dict`` resumes after the examples a worker had prefetched (their users
report repeated and skipped data: datasets#7447, #8308). Here the step's rows are read when the step
is taken, in the training process, so the stream's state after a step is the checkpoint's.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from kubetune import distributed, providers
from kubetune.data import Batch, StepBatch
from kubetune.data.rows import agreed
from kubetune.data.shards import Listing, list_shards
from kubetune.data.stream import Stream, rank_steps
from kubetune.errors import KubetuneError


class Columns:
    """Tokenized columns (name -> one value per row) indexed as a ``datasets.Dataset`` is: ``cols[ids]``
    -> the rows' columns (what the tasks' ``collate`` reads)."""

    def __init__(self, cols: dict[str, list]):
        self.cols = cols

    def __getitem__(self, ids: list[int]) -> dict[str, list]:
        return {k: [v[i] for i in ids] for k, v in self.cols.items()}


@dataclass
class Feed:
    """A task's streamed training data.

    Args:
        listing: the shards (every rank holds rank 0's listing).
        stream_args: the ``Stream`` keyword arguments but ``epoch`` (the normalizer factory, the
            field, the encoding, the seed, the shuffle buffer, S3).
        encode: this rank's normalized rows (dicts) -> tokenized columns.
        collate: (``Columns``, row ids) -> a micro-batch; empty ids: row 0 with weight 0.
        units: tokenized columns -> loss units per row (target tokens).
        drop: the ``dropped`` key of rows with no loss units (they teach nothing and are skipped).
    """

    listing: Listing
    stream_args: dict
    encode: Callable[[list[dict]], dict[str, list]]
    collate: Callable[[Any, np.ndarray], Batch]
    units: Callable[[dict[str, list]], np.ndarray]
    drop: str = "train_truncated"
    saved: dict | None = None  # a checkpoint's stream position, for the epoch it was taken in
    stream: Stream | None = None  # the epoch's stream being read
    dropped: int = 0  # this rank's rows with no units, since the process started

    @classmethod
    def for_spec(
        cls, spec, env, *, normalizer: Callable, encode, collate, units, drop: str = "train_truncated"
    ) -> Feed:
        """A task's stream of ``spec``'s data.train: listed once, by rank 0 (a listing error stops every
        rank in one line), that listing on every rank; ``normalizer(shard)`` normalizes a shard's rows,
        the rest as the constructor's. Collective: every rank calls it."""
        s3 = providers.S3Settings.from_spec(spec)
        listing = agreed(lambda: list_shards(spec.data.train, field="data.train", s3=s3) if env.is_main else None)
        listing = distributed.broadcast_object(listing)  # every rank reads the same shards, in the same order
        args = {
            "normalizer_factory": normalizer,
            "field": "data.train",
            "encoding": spec.data.encoding,
            "seed": spec.training.seed,
            "shuffle_buffer": spec.data.shuffle_buffer,
            "s3": s3,
        }
        return cls(listing, args, encode, collate, units, drop)

    def describe(self) -> str:
        """For the data log line."""
        mib = sum(sh.size for sh in self.listing.shards) / 2**20
        buffer = self.stream_args["shuffle_buffer"]
        return (
            f"data.train streamed from {len(self.listing.shards)} shards ({mib:.1f} MiB, shuffle buffer {buffer} rows)"
        )

    def resume(self, state: dict) -> None:
        """Continue from a checkpoint's ``state_dict()``, checked now (a changed listing, another seed
        or shuffle buffer: one line) rather than at the resumed epoch's first step."""
        Stream.from_state(self.listing, state, **self.stream_args).close()
        self.saved = state

    def state_dict(self) -> dict:
        """The position after the last step taken (every rank's stream is in the same state)."""
        if self.stream is None:
            raise RuntimeError("no stream has been read yet")
        return self.stream.state_dict()

    def steps(
        self,
        epoch: int,
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        grad_accum: int,
        all_reduce: Callable[[torch.Tensor], torch.Tensor],
    ) -> Iterator[StepBatch]:
        """This rank's steps of ``epoch`` from where the run stands (a checkpoint's position in the
        epoch it was taken in, else the epoch's start). Collective: ``all_reduce`` (a sum over the
        ranks) once per step, for the step's loss units."""
        if self.saved is not None and self.saved["epoch"] == epoch:
            stream = Stream.from_state(self.listing, self.saved, **self.stream_args)
        else:
            stream = Stream(self.listing, epoch=epoch, **self.stream_args)
        self.saved, self.stream = None, stream
        taken = False
        with stream:
            for step in rank_steps(
                stream, rank=rank, world_size=world_size, batch_size=batch_size, grad_accum=grad_accum
            ):
                taken = True
                micro, units, failed = [], 0.0, None
                try:
                    for rows, origins in zip(step.micro, step.origins):
                        batch, n = self._micro(rows, origins, step.first)
                        micro.append(batch)
                        units += n
                except KubetuneError as e:  # this rank's rows only: the others learn of it below, not by a timeout
                    failed = e
                total = all_reduce(torch.tensor([units, failed is not None], dtype=torch.float64)).tolist()
                if total[1]:
                    agreed(functools.partial(_reraise, failed))  # every rank stops with the first rank's message
                yield StepBatch(micro, step.global_count, np.zeros(0, dtype=np.int64), total[0])
        if not taken and stream.index == 0:
            raise KubetuneError(
                f"the stream of {len(self.listing.shards)} shards has no rows",
                field=self.stream_args.get("field", "data.train"),
                fix="point data.train at the shards that hold the data",
            )

    def _micro(self, rows: list[dict], origins: list[int], first: dict) -> tuple[Batch, float]:
        """A micro-batch of ``rows`` (tokenized now) and its loss units; rows with none are dropped (counted)."""
        cols = self.encode(rows) if rows else {}
        units = self.units(cols) if rows else np.zeros(0)
        keep = np.flatnonzero(units > 0)
        self.dropped += len(rows) - len(keep)
        if len(keep) == 0:  # nothing of this rank's in the step: the step's first row, weight 0
            return self.collate(Columns(self.encode([first])), np.zeros(0, dtype=np.int64)), 0.0
        batch = self.collate(Columns(cols), keep)
        batch.index = torch.as_tensor([origins[i] for i in keep], dtype=torch.long)
        return batch, float(units[keep].sum())


def _reraise(error: Exception | None) -> None:
    if error is not None:
        raise error
