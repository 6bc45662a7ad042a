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

__all__ = ["History", "export_classifier", "finish", "local_output_dir", "resolve_model", "tensorboard_writer", "tfidf_baseline", "write_atomic"]
log = logging.getLogger(__name__)


def local_output_dir(uri: str) -> Path:
    """The local directory for ``output.uri`` (created)."""
    parsed = providers.parse_uri(uri)
    if parsed.scheme != "file":
        raise KubetuneError(f"output scheme '{parsed.scheme}://' is not supported", field="output.uri", fix="use a local directory or file:///path")
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


def _replace_dir(build, dest: Path) -> None:
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
    """history.jsonl: one JSON object per logged step and per evaluation, flushed as written."""

    def __init__(self, out: Path):
        self.path = out / "history.jsonl"
        self._f = self.path.open("w", encoding="utf-8")

    def write(self, record: dict) -> None:
        self._f.write(json.dumps(record) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def tensorboard_writer(out: Path):
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter(log_dir=str(out / "tensorboard"))


def export_classifier(spec: JobSpec, model, tokenizer, frames, out: Path) -> None:
    """Save ``model/`` (merged for LoRA; loadable by transformers.pipeline) and ``adapter/`` for LoRA."""
    if spec.lora is not None:
        _replace_dir(lambda d: model.save_pretrained(d), out / "adapter")
        model = model.merge_and_unload()

    def save(d: Path) -> None:
        model.save_pretrained(d, safe_serialization=True)
        tokenizer.save_pretrained(d)

    _replace_dir(save, out / "model")
    log.info("exported model to %s", out / "model")


def finish(spec: JobSpec, metrics: dict, out: Path) -> None:
    """Write metrics.json, job.yaml and report.html (after the model, so they mark completion)."""
    from kubetune.artifacts.report import write_report

    write_atomic(out / "job.yaml", dump_spec(spec))
    write_report(spec, metrics, out)
    write_atomic(out / "metrics.json", json.dumps(metrics, indent=2) + "\n")
