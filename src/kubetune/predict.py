"""Inference on an exported model through the transformers pipeline."""

from __future__ import annotations

from pathlib import Path

from kubetune import providers
from kubetune.errors import KubetuneError


def pull(uri: str, dest: Path | None = None) -> Path:
    """Download and verify an exported artifact (s3:// needs its complete manifest; hf:// a repo).

    Returns:
        The local directory.
    """
    scheme = providers.parse_uri(uri).scheme
    if scheme == "s3":
        from kubetune.data.tokenize import cache_root
        from kubetune.providers import s3

        loc = s3.Location.parse(uri, "MODEL")
        dest = dest or cache_root() / "pulled" / loc.bucket / loc.key.strip("/")
        return s3.download(uri.rstrip("/") + "/", dest, field="MODEL", require_manifest=True)
    if scheme == "hf" and dest is not None:
        from kubetune.artifacts import hub

        return hub.pull(uri, dest)
    if dest is not None:
        raise KubetuneError(f"{uri!r} is already local", field="URI", fix="pull takes s3:// or hf:// URIs")
    return providers.resolve(uri, kind="model", field="MODEL")


def model_path(uri: str) -> Path:
    """Accept a job's output (uses its ``model/``) or a model directory itself; s3:// and hf://
    artifacts are downloaded (and verified) first."""
    path = pull(uri)
    if (path / "model" / "config.json").exists():
        return path / "model"
    if (path / "config.json").exists():
        return path
    raise KubetuneError(f"{uri!r} holds no exported model (no config.json, no model/config.json)", field="MODEL", fix="pass a job's output.uri or its model/ directory")


def predict(uri: str, texts: list[str], batch_size: int = 32) -> list[dict]:
    """Classify ``texts``; returns ``[{text, label, score}]`` in input order."""
    import torch
    import transformers
    from transformers import pipeline

    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()
    path = model_path(uri)
    clf = pipeline("text-classification", model=str(path), tokenizer=str(path), device=0 if torch.cuda.is_available() else -1)
    results = clf(texts, batch_size=batch_size, truncation=True)
    return [{"text": t, "label": r["label"], "score": float(r["score"])} for t, r in zip(texts, results)]
