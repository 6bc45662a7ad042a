"""Pulling an exported artifact back: an s3:// output downloaded and verified against its manifest, an
hf:// repo downloaded, a local one resolved (`kubetune pull`, and the first step of predict and serve)."""

from __future__ import annotations

from pathlib import Path

from kubetune import providers
from kubetune.errors import KubetuneError


def pull(uri: str, dest: Path | None = None, s3: providers.S3Settings = providers.S3Settings()) -> Path:
    """Download and verify an exported artifact (s3:// needs its complete manifest, and is reached
    with ``s3``; hf:// a repo).

    Returns:
        The local directory.
    """
    scheme = providers.parse_uri(uri).scheme
    if scheme == "s3":
        from kubetune.paths import cache_root
        from kubetune.providers.s3 import Location, download

        loc = Location.parse(uri, "MODEL")
        dest = dest or cache_root() / "pulled" / loc.bucket / loc.key.strip("/")
        return download(uri.rstrip("/") + "/", dest, field="MODEL", settings=s3, require_manifest=True)
    if scheme == "hf" and dest is not None:
        from kubetune.artifacts import hub

        return hub.pull(uri, dest)
    if dest is not None:
        raise KubetuneError(f"{uri!r} is already local", field="URI", fix="pull takes s3:// or hf:// URIs")
    return providers.resolve(uri, kind="model", field="MODEL", s3=s3)
