"""URI schemes for models, datasets and artifacts, behind one registry.

``resolve(uri, kind=..., field=...)`` turns a URI into a local path, downloading when the scheme
is remote. A scheme is added by decorating a resolver with ``@register("scheme")``; the storage
issue adds ``s3://`` the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from kubetune.errors import KubetuneError

Kind = Literal["model", "dataset"]


@dataclass(frozen=True)
class Uri:
    """A parsed URI: ``scheme://body`` (plain paths have scheme ``file``)."""

    raw: str
    scheme: str
    body: str


Resolver = Callable[[Uri, Kind, str, str | None], Path]
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


def resolve(uri: str, *, kind: Kind, field: str, revision: str | None = None) -> Path:
    """Return a local path for ``uri``, fetching it first when the scheme is remote.

    Args:
        uri: ``hf://org/name``, ``file:///path``, ``pkg://package/path`` or a plain path.
        kind: ``model`` or ``dataset`` (selects the Hub repo type for hf://).
        field: the spec field the URI came from, named in error messages.
        revision: optional Hub revision.

    Raises:
        KubetuneError: unknown scheme, or the target does not exist / cannot be fetched.
    """
    parsed = parse_uri(uri)
    resolver = _RESOLVERS.get(parsed.scheme)
    if resolver is None:
        known = ", ".join(f"{s}://" for s in sorted(_RESOLVERS))
        raise KubetuneError(
            f"unsupported URI scheme '{parsed.scheme}://' in {uri!r}", field=field, fix=f"use one of {known} or a plain path"
        )
    return resolver(parsed, kind, field, revision)


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    import hashlib

    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def schemes() -> list[str]:
    return sorted(_RESOLVERS)


def configure(spec) -> None:
    """Apply the spec's provider settings (S3 endpoint, region, addressing) for this process."""
    from kubetune.providers import s3

    s3.configure(spec.s3.endpoint_url, spec.s3.region, spec.s3.addressing_style)


# Register the built-in schemes (import for side effect).
from kubetune.providers import hf as _hf  # noqa: E402,F401
from kubetune.providers import local as _local  # noqa: E402,F401
from kubetune.providers import s3 as _s3  # noqa: E402,F401
