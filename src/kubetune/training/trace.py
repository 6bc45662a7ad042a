"""The trace of which rows each rank trained at which step (tests set ``KUBETUNE_TRACE_DIR``)."""

from __future__ import annotations

import json
from pathlib import Path

from kubetune.data import Batch


class Trace:
    """Appends ``{"epoch", "step", "rows", "tokens"}`` lines (one per micro-batch) to
    ``<root>/rank<R>.jsonl``: the proof that every example is trained on exactly once per epoch
    across ranks, and at which global step (tests set ``KUBETUNE_TRACE_DIR``; the worker passes it)."""

    def __init__(self, root: Path | None, rank: int):
        self.path = None
        if root:
            Path(root).mkdir(parents=True, exist_ok=True)
            self.path = Path(root) / f"rank{rank}.jsonl"

    def add(self, epoch: int, step: int, batch: Batch) -> None:
        if self.path is None:
            return
        rows = batch.index.tolist() if batch.weight > 0 and batch.index is not None else []
        tokens = int(batch.tokens[0]) if batch.weight > 0 else 0
        with self.path.open("a") as f:
            f.write(json.dumps({"epoch": epoch, "step": step, "rows": rows, "tokens": tokens}) + "\n")
