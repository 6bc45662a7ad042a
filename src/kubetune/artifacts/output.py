"""The output destination: what a run may write, replace and delete there.

kubetune deletes or overwrites only what it wrote. A run marks the directory (or ``s3://`` prefix)
it creates with ``.kubetune-output``; a non-empty destination without that marker belongs to
someone else and is refused unless the user passes ``--overwrite`` (``output.overwrite``). Inside
a marked destination kubetune touches only its own names (``OWNED``, and the extra files a task's
export writes, which its caller names: ``Task.artifact_files``), never a file the user put beside
them. A finished run (its ``metrics.json``) is never replaced without ``--overwrite``, and
then only when the new run has finished: the final artifacts are built in a staging directory and
swapped in at the end (``commit``), so a run that fails leaves the previous state, never half.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from kubetune import checkpoint, providers
from kubetune.artifacts import lock
from kubetune.artifacts.presentation import Presentation
from kubetune.checkpoint.store import CheckpointStore
from kubetune.config import JobSpec
from kubetune.config.schema import output_uri_problem
from kubetune.errors import KubetuneError
from kubetune.paths import cache_root, read_regular, set_default_mode, write_atomic
from kubetune.providers import S3Settings
from kubetune.providers.base import parse_uri

log = logging.getLogger(__name__)

MARKER = ".kubetune-output"
# Swapped in together when a run finishes, with the task's own files (``commit``'s ``extra``: this layer
# knows no task); metrics.json last, since it marks a finished run.
FINAL = ("model", "adapter", "plots", "report.html", "job.yaml", "lm_eval_samples", "metrics.json")
LIVE = ("history.jsonl", "progress.json", "tensorboard", "checkpoints")  # written while the run goes
OWNED = FINAL + LIVE + (MARKER, lock.NAME)  # and the task's artifact files
STAGING_PREFIX = ".kubetune-staging-"
_FIX = "pick a new output.uri, or pass --overwrite (output.overwrite: true)"


@dataclass(frozen=True)
class Plan:
    """What a run will do with its destination, decided before anything is written."""

    action: str  # new | resume | restart | replace | adopt
    detail: str  # the log line
    steps: tuple[int, ...] = ()  # complete checkpoints found


REMOTE = ("s3", "hf")  # outputs written to a local staging directory, then uploaded


@dataclass(frozen=True)
class Output:
    uri: str  # output.uri as the spec gives it
    scheme: str  # file | s3 | hf
    local: Path  # where this machine writes: output.uri itself, or the staging directory of a remote output
    s3: S3Settings = S3Settings()  # how an s3:// output is reached (the job's s3: section)

    @classmethod
    def for_spec(cls, spec) -> Output:
        """The output of a job spec: its ``output.uri``, reached with its ``s3:`` settings (see ``resolve``)."""
        return cls.resolve(spec.output.uri, S3Settings.from_spec(spec))

    @classmethod
    def resolve(cls, uri: str, s3: S3Settings = S3Settings()) -> Output:
        """Parse ``uri`` (not touching the filesystem or the network); ``s3``: how to reach an s3://
        output (the default leaves it all to the environment).

        Raises:
            KubetuneError: an output scheme kubetune cannot write to.
        """
        parsed = parse_uri(uri)
        if parsed.scheme in REMOTE:
            local = cache_root() / "outputs" / hashlib.sha256(uri.encode()).hexdigest()[:16]
        elif parsed.scheme == "file":
            local = Path(parsed.body).expanduser()
        else:
            raise KubetuneError(
                f"output scheme '{parsed.scheme}://' is not supported",
                field="output.uri",
                fix="use a local directory, s3://BUCKET/PREFIX or hf://ORG/REPO",
            )
        return cls(uri, parsed.scheme, local, s3)

    @property
    def remote(self) -> bool:
        """Written to a local staging directory, then uploaded (s3://, hf://)."""
        return self.scheme in REMOTE

    def pod_path(self, workspace: str) -> str | None:
        """Where a pod writes a local output: an absolute path as given, a relative one under the
        pod's working directory ``workspace`` (None for a remote output)."""
        if self.remote:
            return None
        body = parse_uri(self.uri).body
        return body if body.startswith("/") else f"{workspace}/{body}"

    @property
    def prefix(self) -> str:
        """The URI without a trailing slash, for building object keys under it."""
        return self.uri.rstrip("/")

    @property
    def checkpoints(self) -> CheckpointStore:
        """Where this output's checkpoints are kept: ``checkpoints/`` locally, and for an s3:// output
        the ``checkpoints/`` prefix too (an hf:// output keeps them local)."""
        remote = f"{self.prefix}/checkpoints" if self.scheme == "s3" else None
        return CheckpointStore(self.local / "checkpoints", remote, self.s3, self.local / "history.jsonl")

    @property
    def hub_repo(self) -> str:
        """ORG/REPO of an hf:// output (checked as the Hub checks it).

        Raises:
            KubetuneError: not ORG/REPO, or a name the Hub refuses.
        """
        from kubetune.artifacts import hub

        return hub.repo_id(self.uri)

    # ---- before a run: what it may do here, and taking the destination ----
    def check(self, spec: JobSpec) -> Plan:
        """Fail before training when the output cannot or may not be written: someone else's
        non-empty directory, a finished run without --overwrite, a missing bucket, bad credentials.

        Returns:
            The ``Plan`` the run will follow.
        """
        if self.scheme == "s3":
            from kubetune.providers import s3

            s3.check_bucket(self.uri, field="output.uri", settings=self.s3)
        elif self.scheme == "hf":
            from kubetune.artifacts import hub

            hub.check_can_push(spec, self.hub_repo)
        return self.inspect(spec)

    def inspect(self, spec: JobSpec) -> Plan:
        """Decide, without writing anything, whether and how this run may use its destination
        (``spec``: the run's job, for its settings and to recognize its own finished run).

        Raises:
            KubetuneError: the destination belongs to someone else, holds a finished run (without
                ``output.overwrite``), cannot be written, or (where this run would write there) another
                live run holds it.
        """
        plan = self._inspect(spec)
        # After what the destination holds (the same refusal or "done" whoever else is at it): a run that would
        # write there, and only such a run, waits for the one writing there now.
        if plan.action != "done":
            lock.check(self.local)
        return plan

    def _inspect(self, spec: JobSpec) -> Plan:
        refuse_special(self.uri)
        if self.scheme == "hf":  # a push is one new commit on top of the repo's history: nothing is lost
            return Plan("new", f"pushing to {self.uri} when the run finishes")
        if self.scheme == "s3":
            return self._inspect_s3(spec)
        path = self.local
        if not path.exists():
            parent = next((p for p in path.parents if p.exists()), None)
            if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
                raise KubetuneError(
                    f"cannot create {path}: {parent} is not writable",
                    field="output.uri",
                    fix="choose a writable directory",
                )
            return Plan("new", f"new output directory {path}")
        if not path.is_dir():
            raise KubetuneError(
                f"{path} exists and is not a directory", field="output.uri", fix="pick a new output.uri"
            )
        if not os.access(path, os.W_OK | os.X_OK):
            raise KubetuneError(
                f"{path} is not writable (a read-only mount, or another user's directory)",
                field="output.uri",
                fix="choose a writable directory",
            )
        entries = sorted(e for e in os.listdir(path) if not e.startswith(STAGING_PREFIX) and e != lock.NAME)
        if not entries:
            return Plan("new", f"output directory {path} (empty)")
        if not (path / MARKER).exists() and not _made_by_kubetune(path):
            if spec.output.overwrite:
                return Plan(
                    "adopt",
                    f"--overwrite: writing into {path}, which kubetune did not create; "
                    "only kubetune's own entries there are replaced",
                )
            raise KubetuneError(
                f"{path} is not empty and was not created by kubetune ({_entries(entries)})",
                field="output.uri",
                fix=_FIX,
            )
        steps = tuple(self.checkpoints.local_steps())
        finished = (path / "metrics.json").exists()
        saved = (
            (path / "job.yaml").read_text(encoding="utf-8", errors="replace")
            if finished and (path / "job.yaml").is_file()
            else None
        )
        return _decide(spec, path, steps, finished=finished, saved_job=saved)

    def _inspect_s3(self, spec: JobSpec) -> Plan:
        from kubetune.providers import s3

        uri = self.prefix
        keys = s3.list_keys(uri, field="output.uri", settings=self.s3, limit=1000)
        if not keys:
            return Plan("new", f"new output prefix {uri}/")
        steps = tuple(self.checkpoints.remote_steps())
        # An artifact or a checkpoint under kubetune's manifest is kubetune's, also from a version
        # that wrote no marker.
        if MARKER not in keys and s3.MANIFEST not in keys and not steps:
            if spec.output.overwrite:
                return Plan(
                    "adopt",
                    f"--overwrite: writing under {uri}/, which kubetune did not create; "
                    "only objects kubetune's manifests list are replaced",
                )
            raise KubetuneError(
                f"{uri}/ holds {len(keys)}{'+' if len(keys) >= 1000 else ''} objects "
                f"that kubetune did not write (no {MARKER}), e.g. {sorted(keys)[0]!r}",
                field="output.uri",
                fix=_FIX,
            )
        finished = s3.MANIFEST in keys
        saved = (
            s3.read_text(f"{uri}/job.yaml", field="output.uri", settings=self.s3)
            if finished and "job.yaml" in keys
            else None
        )
        return _decide(spec, uri, steps, finished=finished, saved_job=saved)

    def claim(self, spec: JobSpec) -> Plan:
        """Rank 0, before anything else is written: check the destination (``inspect``), create it, hold it
        for this process (``lock``: refused while another live run holds it), mark it, clear what a restart
        replaces, and log the decision; a "done" plan writes nothing.

        Returns:
            The plan.
        """
        plan = self.inspect(spec)
        out, uri = self.local, self.prefix
        if plan.action == "done":  # nothing to write: this job's finished run stays as it is
            log.info("output %s: %s", self.uri, plan.detail)
            return plan
        try:
            out.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise KubetuneError(
                f"cannot write to {out}: {e.strerror or e}", field="output.uri", fix="choose a writable directory"
            ) from None
        lock.take(out, spec.name)  # held until this process exits: no second run writes here meanwhile
        again = self.inspect(spec)  # under the lock: a run that held it may have finished meanwhile
        plan = plan if again.action == plan.action else again
        if plan.action == "done":
            log.info("output %s: %s", self.uri, plan.detail)
            return plan
        marker = (
            json.dumps(
                {"format": "kubetune-output/1", "job": spec.name, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z")}
            )
            + "\n"
        )
        try:
            if not (out / MARKER).exists():
                write_atomic(out / MARKER, marker)
            for stale in out.glob(f"{STAGING_PREFIX}*"):  # a crashed run's unfinished staging (none is live: the lock)
                shutil.rmtree(stale, ignore_errors=True)
        except OSError as e:
            raise KubetuneError(
                f"cannot write to {out}: {e.strerror or e}", field="output.uri", fix="choose a writable directory"
            ) from None
        if self.scheme == "s3" and plan.action in ("new", "adopt"):
            from kubetune.providers import s3

            s3.write_text(f"{uri}/{MARKER}", marker, field="output.uri", settings=self.s3)
        if plan.action == "restart" and plan.steps:
            self.checkpoints.clear()
        log.info("output %s: %s", self.uri, plan.detail)
        return plan

    # ---- after a run ----
    def finished_metrics(self) -> dict:
        """The metrics of the finished run a "done" plan found (local, or the remote artifact's); {} if unreadable."""
        try:
            if (self.local / "metrics.json").is_file():
                return json.loads((self.local / "metrics.json").read_text(encoding="utf-8"))
            return self.remote_metrics() or {}
        except (OSError, ValueError, KubetuneError):
            return {}

    def remote_metrics(self) -> dict | None:
        """The ``metrics.json`` of the finished artifact at an s3:// output; None when the output is
        not s3:// or holds no finished artifact.

        Raises:
            KubetuneError: the bucket cannot be read (credentials, endpoint).
        """
        if self.scheme != "s3":
            return None
        from kubetune.providers import s3

        text = s3.read_text(f"{self.prefix}/metrics.json", field="output.uri", settings=self.s3)
        return json.loads(text) if text else None

    def staging(self) -> Path:
        """A fresh directory inside the local output where the final artifacts are built."""
        path = Path(tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=self.local))
        set_default_mode(path)
        return path

    def commit(self, staged: Path, extra: tuple[str, ...] = ()) -> None:
        """Swap the final artifacts built in ``staged`` into ``out``: the old ``metrics.json`` goes
        first (the directory stops looking finished), the new one comes last. Final entries of an
        earlier run that this run did not produce (e.g. ``adapter/`` after a LoRA run) are removed.
        ``extra``: the task's own files (``Task.artifact_files``), this run's and those of the finished
        run it replaces; kubetune's as well, swapped in and removed the same way.

        Raises:
            ValueError: a name in ``extra`` that is not a plain file name, or is one of kubetune's own.
        """
        for name in extra:
            if problem := artifact_file_problem(name):
                raise ValueError(f"artifact file {name!r} of the task {problem}")
        out = self.local
        (out / "metrics.json").unlink(missing_ok=True)
        for name in (*FINAL[:-1], *dict.fromkeys(extra), FINAL[-1]):  # metrics.json last
            src, dst = staged / name, out / name
            if dst.is_symlink() or dst.is_file():
                dst.unlink()
            elif dst.exists():
                shutil.rmtree(dst)
            if src.exists():
                os.replace(src, dst)
        shutil.rmtree(staged, ignore_errors=True)

    def replaced_task(self) -> str | None:
        """The task of the finished run in the local output (its ``metrics.json`` says), which ``commit``
        replaces; None when there is none, or it cannot be read."""
        try:
            metrics = json.loads(read_regular(self.local / "metrics.json", field="output.uri", limit=16 << 20, fix=""))
        except (OSError, ValueError, KubetuneError):
            return None
        task = metrics.get("task") if isinstance(metrics, dict) else None
        return task if isinstance(task, str) else None

    def publish(self, spec: JobSpec, metrics: dict, present: Presentation) -> None:
        """Upload the finished artifacts from ``local`` when the output is remote (rank 0, after
        ``artifacts.finish`` and ``commit``). Checkpoints are not part of the artifact: they travel
        under their own manifests."""
        if self.scheme == "s3":
            from kubetune.providers import s3_upload

            s3_upload.upload_dir(self.local, self.uri, settings=self.s3, exclude=("checkpoints",))
        elif self.scheme == "hf":
            from kubetune.artifacts import hub

            hub.push(spec, self.hub_repo, self.local, metrics, present)

    def state_after_stop(self, since: float) -> str:
        """After a stop signal reached the launcher: ``finished`` (this run's artifacts are complete),
        ``checkpoint`` (a run again resumes) or ``nothing`` (a run again starts over)."""
        metrics = self.local / "metrics.json"
        if metrics.exists() and metrics.stat().st_mtime >= since:
            return "finished"
        if self.checkpoints.local_steps():
            return "checkpoint"
        if self.scheme == "s3":
            try:
                if self.checkpoints.remote_steps():
                    return "checkpoint"
            except KubetuneError:
                pass
        return "nothing"


def artifact_file_problem(name: str) -> str | None:
    """Why ``name`` cannot be a task's artifact file (``Task.artifact_files``), or None: it must be a plain
    file name in the output's top directory, and none of kubetune's own."""
    if not isinstance(name, str) or not name or name in (".", "..") or any(c in name for c in "/\\\0"):
        return "is not a plain file name"
    if name in OWNED or name.startswith((".kubetune", "_kubetune")):  # the marker, staging, an s3:// manifest
        return "is one of kubetune's own names"
    return None


def refuse_special(uri: str, field: str = "output.uri") -> None:
    """Refuse destinations that can only be mistakes: empty, the filesystem root, a home directory
    itself, an S3 bucket's root (also when a relative path resolves to one of them).

    Raises:
        KubetuneError: naming the value and the fix.
    """
    problem = output_uri_problem(uri)
    parsed = providers.parse_uri(uri)
    if problem is None and parsed.scheme == "file":
        path = Path(parsed.body).expanduser()
        try:
            resolved = path.resolve()
        except (RuntimeError, OSError):  # Python 3.11 raises RuntimeError on a symbolic link loop
            resolved = None
        if resolved is None or (path.is_symlink() and not path.exists()):
            what = (
                f"is a symbolic link to {os.readlink(path)!r}, which "
                + ("is a loop of links" if resolved is None else "does not exist")
                if path.is_symlink()
                else "lies under a loop of symbolic links"
            )
            raise KubetuneError(
                f"{uri!r} {what}",
                field=field,
                fix="point output.uri at a directory (or a link to an existing one)",
            )
        if resolved == Path("/") or resolved == Path.home().resolve():
            problem = (
                f"{uri!r} is {resolved}, the filesystem root or your home directory itself — "
                "name a directory of its own, e.g. runs/NAME"
            )
    if problem:
        message, _, fix = problem.partition(" — ")
        if "; name" in message:
            message, _, fix = message.partition("; ")
        raise KubetuneError(message, field=field, fix=fix or None)


def _made_by_kubetune(path: Path) -> bool:
    """A run of a kubetune version that wrote no marker: its finished artifacts, or a checkpoint."""
    finished = (
        (path / "metrics.json").is_file()
        and (path / "job.yaml").is_file()
        and (path / "model" / "config.json").is_file()
    )
    return finished or bool(checkpoint.complete_steps(path / "checkpoints"))


def _decide(spec: JobSpec, where, steps: tuple[int, ...], finished: bool, saved_job: str | None = None) -> Plan:
    if steps and spec.training.resume == "auto":
        return Plan("resume", f"resuming from checkpoint step {steps[-1]} in {where}", steps)
    if finished and not spec.output.overwrite and saved_job is not None and same_job(saved_job, spec):
        # This very job finished here already (e.g. a pod restarted after the run had exported):
        # there is nothing to do, and nothing is replaced.
        return Plan(
            "done",
            f"{where} already holds this job's finished run: nothing to train (pass --overwrite to train it again)",
        )
    if finished and not spec.output.overwrite:
        raise KubetuneError(
            f"{where} holds a finished run (metrics.json, model/)",
            field="output.uri",
            fix="pick a new output.uri, or pass --overwrite to replace it once this run finishes",
        )
    if steps:
        return Plan(
            "restart",
            f"starting over (--no-resume): removing the earlier run's {len(steps)} checkpoint(s) in {where}",
            steps,
        )
    if finished:
        return Plan(
            "replace", f"starting over (--overwrite): the finished run in {where} is replaced when this run finishes"
        )
    return Plan("restart", f"starting over in {where}: no checkpoint to resume from")


def same_job(saved_yaml: str, spec: JobSpec) -> bool:
    """Is the finished run's job.yaml this spec (``output.overwrite`` aside)?"""
    import yaml

    from kubetune.config import parse_spec

    try:
        saved = parse_spec(yaml.safe_load(saved_yaml) or {})
    except (KubetuneError, yaml.YAMLError):
        return False
    mine = spec.model_dump(mode="json")
    theirs = saved.model_dump(mode="json")
    for d in (mine, theirs):
        d["output"]["overwrite"] = False
        d.pop("serving", None)  # how the export is served afterwards changes nothing the run produced
    return mine == theirs


def check_pull_dest(dest: Path, overwrite: bool) -> None:
    """``kubetune pull DEST`` writes only into an empty or new directory, or one an earlier pull
    or run made, unless ``--overwrite``.

    Raises:
        KubetuneError: DEST is someone else's non-empty directory, or a file.
    """
    refuse_special(str(dest), field="DEST")
    if not dest.exists() or overwrite:
        return
    if not dest.is_dir():
        raise KubetuneError(f"{dest} exists and is not a directory", field="DEST", fix="pick a new directory")
    entries = sorted(os.listdir(dest))
    if entries and not (dest / MARKER).exists():
        raise KubetuneError(
            f"{dest} is not empty and was not written by kubetune ({_entries(entries)})",
            field="DEST",
            fix="pick a new directory, or pass --overwrite",
        )


def _entries(names: list[str]) -> str:
    shown = ", ".join(repr(n if len(n) <= 40 else n[:37] + "...") for n in names[:3])
    return f"{len(names)} {'entry' if len(names) == 1 else 'entries'}: {shown}{', ...' if len(names) > 3 else ''}"


def mark_pulled(dest: Path, uri: str) -> None:
    if not (dest / MARKER).exists():
        write_atomic(dest / MARKER, json.dumps({"format": "kubetune-output/1", "pulled_from": uri}) + "\n")
