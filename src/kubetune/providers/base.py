"""The scheme registry the providers plug into (a module of its own, so that a provider imports
it without importing the package, which imports every provider)."""

from __future__ import annotations

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


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    import hashlib

    h = hashlib.sha256()
    with path.open("rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()
