"""Rank-0 artifacts: exported model, metrics.json, history.jsonl, job.yaml, report, TensorBoard."""

from __future__ import annotations

import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from kubetune import providers
from kubetune.artifacts.baseline import tfidf_baseline
from kubetune.config import JobSpec, dump_spec
from kubetune.errors import KubetuneError

__all__ = ["History", "check_output", "export_classifier", "finish", "local_output_dir", "publish", "resolve_model", "tensorboard_writer", "tfidf_baseline", "write_atomic"]
log = logging.getLogger(__name__)


REMOTE_OUTPUTS = ("s3", "hf")


def local_output_dir(uri: str) -> Path:
    """The local directory artifacts are written to (created): ``output.uri`` itself, or for a
    remote output (s3://, hf://) a staging directory that ``publish`` uploads at the end."""
    parsed = providers.parse_uri(uri)
    if parsed.scheme in REMOTE_OUTPUTS:
        from kubetune.data.tokenize import cache_root

        import hashlib

        path = cache_root() / "outputs" / hashlib.sha256(uri.encode()).hexdigest()[:16]
    elif parsed.scheme != "file":
        raise KubetuneError(f"output scheme '{parsed.scheme}://' is not supported", field="output.uri", fix="use a local directory, s3://BUCKET/PREFIX or hf://ORG/REPO")
    else:
        path = Path(parsed.body).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise KubetuneError(f"cannot create output directory {path}: {e.strerror}", field="output.uri", fix="choose a writable directory") from None
    return path


def resolve_model(spec: JobSpec) -> Path:
    """Local directory of the base model (downloaded through its provider when remote)."""
    path = providers.resolve(spec.model.uri, kind="model", field="model.uri", revision=spec.model.revision)
    if not (path / "config.json").exists():
        raise KubetuneError(f"{spec.model.uri!r} has no config.json", field="model.uri", fix="point it at a directory saved with save_pretrained, or hf://ORG/NAME")
    return path


def write_atomic(path: Path, text: str) -> None:
    """Write a file through a temporary sibling and a rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(text)
    os.replace(tmp, path)


def replace_dir(build, dest: Path) -> None:
    """Build a directory under a temporary name and swap it into place."""
    tmp = Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        build(tmp)
        if dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


class History:
    """history.jsonl: one JSON object per logged step and per evaluation, flushed as written.

    On resume from step S, records the interrupted run wrote after its checkpoint (training logs
    after S, and the evaluation at S, which runs after the checkpoint) are dropped first.
    """

    def __init__(self, out: Path, resume_step: int | None = None, saved: Path | None = None):
        self.path = out / "history.jsonl"
        kept = []
        # On a new machine (a re-created pod) only the checkpoint's copy exists.
        source = self.path if self.path.exists() else saved
        if resume_step is not None and source is not None and source.exists():
            for line in source.read_text(encoding="utf-8").splitlines():
                rec = json.loads(line)
                if rec["step"] < resume_step or (rec["type"] == "train" and rec["step"] == resume_step):
                    kept.append(line + "\n")
        write_atomic(self.path, "".join(kept))
        self._f = self.path.open("a", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def tensorboard_writer(out: Path, purge_step: int | None = None):
    from torch.utils.tensorboard import SummaryWriter

    # purge_step hides events an interrupted run logged after the checkpoint we resume from.
    return SummaryWriter(log_dir=str(out / "tensorboard"), purge_step=purge_step)


def export_classifier(spec: JobSpec, model, tokenizer, frames, out: Path) -> None:
    """Save ``model/`` (merged for LoRA; loadable by transformers.pipeline) and ``adapter/`` for LoRA."""
    if spec.lora is not None:
        replace_dir(lambda d: model.save_pretrained(d), out / "adapter")
        model = model.merge_and_unload()

    def save(d: Path) -> None:
        model.save_pretrained(d)  # safetensors
        tokenizer.save_pretrained(d)

    replace_dir(save, out / "model")
    log.info("exported model to %s", out / "model")


def check_output(spec: JobSpec) -> None:
    """Fail before training when the output cannot be written (missing bucket, bad credentials)."""
    scheme = providers.parse_uri(spec.output.uri).scheme
    if scheme == "s3":
        from kubetune.providers import s3

        s3.check_bucket(spec.output.uri, field="output.uri")
    elif scheme == "hf":
        from kubetune.artifacts import hub

        hub.check_can_push(spec)
    else:
        local_output_dir(spec.output.uri)


def publish(spec: JobSpec, out: Path, metrics: dict) -> None:
    """Upload the finished artifacts when ``output.uri`` is remote (rank 0, after ``finish``)."""
    scheme = providers.parse_uri(spec.output.uri).scheme
    if scheme == "s3":
        from kubetune.providers import s3

        s3.upload_dir(out, spec.output.uri)
    elif scheme == "hf":
        from kubetune.artifacts import hub

        hub.push(spec, out, metrics)


def finish(spec: JobSpec, metrics: dict, out: Path) -> None:
    """Write metrics.json, job.yaml and report.html (after the model, so they mark completion)."""
    from kubetune.artifacts.report import write_report

    write_atomic(out / "job.yaml", dump_spec(spec))
    write_report(spec, metrics, out)
    write_atomic(out / "metrics.json", json.dumps(metrics, indent=2) + "\n")
