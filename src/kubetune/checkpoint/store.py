"""Where a run's checkpoints are kept: ``CheckpointStore``, a local directory and, for an s3://
output, the prefix every checkpoint is uploaded to (shards included) and listed from. The run's
``Output`` (``artifacts/output.py``) makes the one store of a run; nothing else knows where
checkpoints live."""

from __future__ import annotations

import contextlib
import json
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path

from kubetune.checkpoint import _NAME, _TMP, MARKER, PENDING, Found, complete_steps
from kubetune.checkpoint.writer import hold, writer_for
from kubetune.config import JobSpec, dump_spec
from kubetune.paths import replace_dir
from kubetune.providers import S3Settings

FIELD = "output.uri"  # what a user sets to move the checkpoints (error messages)


@dataclass(frozen=True)
class CheckpointStore:
    """The checkpoints of one output.

    Attributes:
        root: the local directory of ``step-NNNNNNNN`` checkpoints.
        remote: the s3:// prefix they are uploaded to and listed from (None: local only).
        s3: how ``remote`` is reached.
        history: the run's ``history.jsonl``, copied into every checkpoint.
    """

    root: Path
    remote: str | None
    s3: S3Settings
    history: Path

    def _remote(self, step: int) -> str:
        return f"{self.remote}/step-{step:08d}"

    def staging(self, step: int) -> Path:
        """A new temporary directory for checkpoint ``step`` (the writer rank), which a sharded
        strategy's ranks write their shards into before ``save`` completes it. An older checkpoint
        of the same step in an s3:// output stops looking complete first (its manifest goes),
        because the ranks upload their shards there before ``save`` writes the new manifest."""
        self.root.mkdir(parents=True, exist_ok=True)
        if self.remote:
            from kubetune.providers import s3

            loc = s3.Location.parse(self._remote(step), FIELD)
            try:
                s3.client(self.s3).delete_object(Bucket=loc.bucket, Key=loc.join(s3.MANIFEST))
            except Exception as e:
                raise s3.translate(e, loc, FIELD, "write a checkpoint to", self.s3) from None
        return Path(tempfile.mkdtemp(prefix=f".step-{step:08d}-", dir=self.root))

    def upload_shards(self, staged: Path, step: int, files: list[Path]) -> dict:
        """Every rank: upload the shard ``files`` it wrote under ``staged`` to checkpoint ``step`` of
        an s3:// output (nodes need not share a filesystem). Returns their manifest entries ({}
        when local only), which the writer's ``save`` lists in the checkpoint's manifest."""
        if not self.remote or not files:
            return {}
        from kubetune.providers import s3_upload

        return s3_upload.put_files(staged, files, self._remote(step), field=FIELD, settings=self.s3)

    def save(
        self, state: dict, spec: JobSpec, step: int, keep: int, staged: Path | None = None, uploaded: dict | None = None
    ) -> Path:
        """Write checkpoint ``step`` (rank 0 only) and prune to the newest ``keep``. A copy of
        ``history.jsonl`` goes along, so a resumed run on a new machine keeps its curves.
        ``staged``: the ``staging`` directory already holding the ranks' shards, completed in place;
        ``uploaded``: the manifest entries of the shards the ranks put into an s3:// output.

        A ``state`` with a ``PENDING`` entry (a strategy's save under ``training.checkpoint_async``) is a snapshot
        handed over (nothing changes it afterwards): a background thread (``writer``) calls the entry, which returns
        once what the ranks write into the checkpoint themselves is written (a sharded strategy's shards), then
        writes the checkpoint, and this returns once that thread started. ``history.jsonl`` is copied now, as it
        stands. The checkpoint in flight is waited for first, so one is written at a time and each prunes only
        after it is complete; ``wait`` waits for it and raises its error. Returns the checkpoint's directory
        (complete once waited for).
        """
        self.root.mkdir(parents=True, exist_ok=True)
        writer = writer_for(self.root)
        writer.wait()
        state = dict(state)
        pending = state.pop(PENDING, None)
        history = self.history.read_bytes() if self.history.exists() else None
        if pending is None:
            return self._write(state, dump_spec(spec), step, keep, history, staged, uploaded)

        def job() -> None:
            pending()
            self._write(state, dump_spec(spec), step, keep, history, staged, uploaded)

        writer.submit(job, name=f"checkpoint-{step}")
        return self.root / f"step-{step:08d}"

    def wait(self) -> None:
        """Until the checkpoint in flight (``save`` with ``training.checkpoint_async``) is complete.

        Raises:
            KubetuneError: the background write failed (e.g. a full disk); nothing of it looks complete.
        """
        writer_for(self.root).wait()

    def _write(
        self,
        state: dict,
        job_yaml: str,
        step: int,
        keep: int,
        history: bytes | None,
        staged: Path | None,
        uploaded: dict | None,
    ) -> Path:
        """Build checkpoint ``step``, rename it into place after its marker, upload it, prune (``save``)."""
        root = self.root
        final = root / f"step-{step:08d}"

        import torch

        def build(tmp: Path) -> None:
            torch.save(state, tmp / "state.pt")
            if history is not None:
                (tmp / "history.jsonl").write_bytes(history)
            (tmp / "job.yaml").write_text(job_yaml)
            hold(step)
            (tmp / MARKER).write_text(json.dumps({"step": step, "fingerprint": state["fingerprint"]}) + "\n")

        # Steps above this one belong to an older run at the same output (e.g. after --no-resume);
        # they must not outrank, or prune away, the checkpoints of this run.
        for newer in [st for st in complete_steps(root) if st > step]:
            shutil.rmtree(root / f"step-{newer:08d}", ignore_errors=True)
        replace_dir(build, final, tmp=staged)
        if self.remote:
            from kubetune.providers import s3_upload

            s3_upload.upload_dir(final, self._remote(step), field=FIELD, settings=self.s3, uploaded=uploaded)
        for old in complete_steps(root)[:-keep]:
            shutil.rmtree(root / f"step-{old:08d}", ignore_errors=True)
        if self.remote:  # prune by the remote listing: a re-created pod's local copy holds only what it downloaded
            steps = self.remote_steps()
            for old in [st for st in steps if st > step] + [st for st in steps if st <= step][:-keep]:
                self._delete_remote(old)
        return final

    def clear(self) -> None:
        """Remove every checkpoint (local and remote): a finished run, or --no-resume. Only what
        kubetune wrote goes: ``step-NNNNNNNN`` directories and its own temporary ones locally, and
        remotely exactly the objects each checkpoint's manifest lists. A checkpoint in flight is waited for
        first: it would be completed after the others went."""
        writer_for(self.root).wait()
        if self.root.is_dir():
            for entry in self.root.iterdir():
                if _NAME.match(entry.name) or (_TMP.match(entry.name) and entry.is_dir()):
                    shutil.rmtree(entry, ignore_errors=True)
            with contextlib.suppress(OSError):
                self.root.rmdir()  # only when nothing else is left in it
        if self.remote:
            for step in self.remote_steps():
                self._delete_remote(step)

    def local_steps(self) -> list[int]:
        """Steps of the complete checkpoints in the local directory."""
        return complete_steps(self.root)

    def latest(self) -> Found | None:
        """The newest complete checkpoint (downloaded first from an s3:// output)."""
        if self.remote:
            steps = self.remote_steps()
            if not steps:
                return None
            from kubetune.providers import s3

            path = self.root / f"step-{steps[-1]:08d}"
            s3.download(self._remote(steps[-1]) + "/", path, field=FIELD, settings=self.s3, require_manifest=True)
            return Found(steps[-1], path)
        steps = complete_steps(self.root)
        return Found(steps[-1], self.root / f"step-{steps[-1]:08d}") if steps else None

    def remote_steps(self) -> list[int]:
        """Steps of the complete checkpoints under the s3:// prefix (those with a manifest); [] when local only."""
        if not self.remote:
            return []
        from kubetune.providers import s3

        loc = s3.Location.parse(self.remote, FIELD)
        client = s3.client(self.s3)
        steps = []
        key = loc.key.rstrip("/")
        try:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=key + "/"):
                for obj in page.get("Contents", []):
                    parts = obj["Key"][len(key) + 1 :].split("/")
                    if len(parts) == 2 and parts[1] == s3.MANIFEST and (m := _NAME.match(parts[0])):
                        steps.append(int(m.group(1)))
        except Exception as e:
            raise s3.translate(e, loc, FIELD, "list checkpoints in", self.s3) from None
        return sorted(steps)

    def _delete_remote(self, step: int) -> None:
        from kubetune.providers import s3_upload

        # Manifest first (a half-deleted checkpoint must not look complete), then exactly the keys it
        # lists: never whatever else a listing of the prefix shows.
        s3_upload.delete_artifact(self._remote(step), field=FIELD, settings=self.s3)
