"""Rank-0 artifacts: exported model, metrics.json, history.jsonl, job.yaml, report, TensorBoard."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from kubetune import providers
from kubetune.artifacts.presentation import Presentation
from kubetune.config import JobSpec, dump_spec
from kubetune.errors import KubetuneError
from kubetune.paths import check_regular, replace_dir, write_atomic

__all__ = [
    "History",
    "check_model_files",
    "check_model_weights",
    "finish",
    "replace_dir",
    "resolve_model",
    "tensorboard_writer",
    "write_atomic",
]
log = logging.getLogger(__name__)
# Exported models above this size are split into safetensors shards plus model.safetensors.index.json
# (transformers' default is 50GB: one 32 GB file for an 8B model in fp32, awkward to move and upload).
SHARD_SIZE = "5GB"


def resolve_model(spec: JobSpec) -> Path:
    """Local directory of the base model (downloaded through its provider when remote)."""
    path = providers.resolve(
        spec.model.uri,
        kind="model",
        field="model.uri",
        revision=spec.model.revision,
        s3=providers.S3Settings.from_spec(spec),
    )
    if not (path / "config.json").exists():
        raise KubetuneError(
            f"{spec.model.uri!r} has no config.json",
            field="model.uri",
            fix="point it at a directory saved with save_pretrained, or hf://ORG/NAME",
        )
    size = (path / "config.json").stat().st_size
    if size > MAX_CONFIG_BYTES:  # predict refuses such an export: refuse the base model before training on it
        raise KubetuneError(
            f"the config.json of {spec.model.uri!r} is {size:,} bytes; a model config is a few KB",
            field="model.uri",
            fix="point it at a model saved with save_pretrained",
        )
    check_model_files(path, field="model.uri")
    check_model_weights(path, spec.model.uri, field="model.uri")
    return path


# The largest config.json kubetune reads (a real one is a few KB; transformers reads it whole).
MAX_CONFIG_BYTES = 4 << 20
# The largest other file of a model that transformers reads whole: tokenizer.json is the big one
# (Gemma 3's: 33 MB; most are 2-17 MB), then the sentencepiece model, vocabularies, merges.
MAX_MODEL_TEXT_BYTES = 128 << 20
MODEL_TEXT_SUFFIXES = (".json", ".txt", ".model", ".jinja", ".tiktoken", ".vocab")
MODEL_FILE_FIX = "replace it with the file save_pretrained wrote"


def check_model_files(path: Path, *, field: str) -> None:
    """Check every file at the top of the model folder ``path`` before transformers reads any: each
    is a regular file once links are followed (a FIFO would block the load, /dev/zero would be read
    without end), and the configs and tokenizer files it reads whole (``MODEL_TEXT_SUFFIXES``) are at
    most ``MAX_MODEL_TEXT_BYTES``. Weights are large by nature: only their kind is checked. Nothing
    is opened; folders (onnx/, 1_Pooling/), dangling links and unreadable entries are left to the
    loader, whose error names them.

    Raises:
        KubetuneError: one line naming the file, where its link leads, what it is, and the fix.
    """
    for entry in sorted(path.iterdir()) if path.is_dir() else []:
        limit = MAX_MODEL_TEXT_BYTES if entry.name.endswith(MODEL_TEXT_SUFFIXES) else None
        try:
            check_regular(entry, field=field, limit=limit, fix=MODEL_FILE_FIX)
        except OSError:  # a folder, a dangling link, no permission: what the loader says of it stands
            continue


PICKLE_WEIGHTS = (".bin", ".pt", ".pth", ".ckpt", ".pkl", ".pickle")


def check_model_weights(path: Path, shown: str, *, field: str) -> None:
    """Refuse a model directory whose weights exist only as pickles (``pytorch_model.bin``...).

    Loading a pickle runs whatever code it holds, and a model may come from a bucket or a Hub
    repo that others can write to; kubetune loads safetensors only. A directory with no weight
    file at all is left to the loader, whose error names what is missing.

    Raises:
        KubetuneError: only pickled weights are present (names the file; the fix converts them).
    """
    names = [p.name for p in path.iterdir() if p.is_file()] if path.is_dir() else []
    if any(n.endswith(".safetensors") or n.endswith(".safetensors.index.json") for n in names):
        return
    pickles = sorted(n for n in names if n.endswith(PICKLE_WEIGHTS))
    if pickles:
        raise KubetuneError(
            f"{shown!r} holds its weights only as a pickle ({pickles[0]}); kubetune loads safetensors only, "
            "because unpickling runs code from the file",
            field=field,
            fix="convert it where you trust the file: "
            "AutoModel.from_pretrained(dir).save_pretrained(dir, safe_serialization=True)",
        )


class History:
    """history.jsonl: one JSON object per logged step and per evaluation, flushed as written.

    On resume from the checkpoint of step S, the history is what it was when that checkpoint was written:
    the checkpoint's own copy (``saved``), evaluations at S made before the checkpoint included (they are
    not made again), records the interrupted run wrote after it (training logs after S, an epoch's or the
    run's last evaluation at S, which come after the checkpoint and are made again) left out. A checkpoint
    without a copy (an older kubetune's) keeps the output's records before S and its training log at S.
    """

    def __init__(self, out: Path, resume_step: int | None = None, saved: Path | None = None):
        self.path = out / "history.jsonl"
        kept = []
        if resume_step is not None and saved is not None and saved.exists():
            lines = saved.read_text(encoding="utf-8").splitlines()
            kept = [line + "\n" for line in lines if json.loads(line)["step"] <= resume_step]
        elif resume_step is not None and self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
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


def finish(spec: JobSpec, metrics: dict, dest: Path, history: Path, present: Presentation) -> None:
    """Write metrics.json, job.yaml and report.html into ``dest`` (the run's staging directory),
    reading the curves from ``history``."""
    from kubetune.artifacts.report import write_report

    write_atomic(dest / "job.yaml", dump_spec(spec))
    write_report(spec, metrics, dest, present, history)
    write_atomic(dest / "metrics.json", json.dumps(metrics, indent=2) + "\n")
