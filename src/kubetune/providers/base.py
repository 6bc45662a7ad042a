"""The scheme registry the providers plug into (a module of its own, so that a provider imports
it without importing the package, which imports every provider), and the S3 settings passed to every
resolver."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

Kind = Literal["model", "dataset"]


@dataclass(frozen=True)
class Uri:
    """A parsed URI: ``scheme://body`` (plain paths have scheme ``file``)."""

    raw: str
    scheme: str
    body: str


@dataclass(frozen=True)
class S3Settings:
    """How to reach S3: a job spec's ``s3:`` section, passed to every function that makes an S3
    client (``S3Settings()``: nothing from a spec). What a field leaves unset is read from the
    environment when a client is made (see ``endpoint`` and ``region_name``)."""

    endpoint_url: str | None = None
    region: str | None = None
    addressing_style: str = "auto"  # auto: path-style when an endpoint is set (MinIO), else virtual-hosted

    @classmethod
    def from_spec(cls, spec) -> S3Settings:
        """The settings of a job spec's ``s3:`` section."""
        return cls(spec.s3.endpoint_url, spec.s3.region, spec.s3.addressing_style)

    def endpoint(self) -> str | None:
        """``endpoint_url``, then $S3_ENDPOINT_URL, then $AWS_ENDPOINT_URL (None: AWS's own endpoint)."""
        return self.endpoint_url or os.environ.get("S3_ENDPOINT_URL") or os.environ.get("AWS_ENDPOINT_URL")

    def region_name(self) -> str:
        """``region``, then $AWS_REGION, then $AWS_DEFAULT_REGION, then us-east-1."""
        return self.region or os.environ.get("AWS_REGION") or os.environ.get("AWS_DEFAULT_REGION") or "us-east-1"


# (uri, kind, field, revision, S3 settings) -> the local path
Resolver = Callable[[Uri, Kind, str, str | None, S3Settings], Path]
_RESOLVERS: dict[str, Resolver] = {}


def register(scheme: str) -> Callable[[Resolver], Resolver]:
    """Register a resolver for ``scheme://`` URIs."""

    def deco(fn: Resolver) -> Resolver:
        _RESOLVERS[scheme] = fn
        return fn

    return deco


def parse_uri(uri: str) -> Uri:
    """Split a URI into scheme and body; a plain path is ``file``."""
    scheme, sep, body = uri.partition("://")
    if not sep:
        return Uri(uri, "file", uri)
    return Uri(uri, scheme.lower(), body)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    import hashlib

    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
