"""Staging: fetch a job's remote model and data once, for pods (`kubetune fetch`, the init container).

Remote URIs (hf://, s3://) are resolved to local copies and a rewritten spec pointing at
them is written to ``DEST/job.yaml``; the completion marker is written last, so a pod that died
mid-download stages again, and a second run with the same inputs downloads nothing.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path

from kubetune import providers
from kubetune.artifacts import write_atomic
from kubetune.config import JobSpec, dump_spec, parse_spec
from kubetune.providers import Kind

log = logging.getLogger(__name__)
MARKER = ".kubetune-staged"
LOCAL_SCHEMES = {"file", "pkg"}  # already inside the pod (image or mounted volume)


def _inputs(spec: JobSpec) -> list[tuple[str, str | None, Kind, str | None]]:
    """(field, uri, kind, revision) of everything a worker reads."""
    d = spec.data
    return [
        ("model.uri", spec.model.uri, "model", spec.model.revision),
        ("data.train", d.train, "dataset", None),
        ("data.eval", d.eval, "dataset", None),
    ]


def stage_key(spec: JobSpec) -> str:
    return hashlib.sha256(json.dumps([(f, u, r) for f, u, _, r in _inputs(spec)]).encode()).hexdigest()


def stage(spec: JobSpec, dest: Path) -> Path:
    """Make every remote input of ``spec`` local; return the path of the staged spec.

    Raises:
        KubetuneError: an input cannot be fetched (names the field, the URI and the fix).
    """
    s3 = providers.S3Settings.from_spec(spec)
    dest.mkdir(parents=True, exist_ok=True)
    staged, marker = dest / "job.yaml", dest / MARKER
    key = stage_key(spec)
    if marker.exists() and staged.exists() and json.loads(marker.read_text()).get("key") == key:
        log.info("already staged in %s; nothing to download", dest)
        return staged
    raw = spec.model_dump(mode="json")
    for field, uri, kind, revision in _inputs(spec):
        if uri is None or providers.parse_uri(uri).scheme in LOCAL_SCHEMES:
            continue
        path = providers.resolve(uri, kind=kind, field=field, revision=revision, s3=s3)
        section, name = field.split(".")
        raw[section][name] = str(path)
        if field == "model.uri":
            raw["model"]["revision"] = None
        log.info("staged %s = %s -> %s", field, uri, path)
    write_atomic(staged, dump_spec(parse_spec(raw)))
    write_atomic(marker, json.dumps({"key": key}) + "\n")
    return staged
