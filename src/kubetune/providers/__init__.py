"""URI schemes for models, datasets and artifacts, behind one registry.

``resolve(uri, kind=..., field=...)`` turns a URI into a local path, downloading when the scheme
is remote. The schemes are ``file`` (and plain paths), ``pkg`` (files inside an installed package),
``hf`` and ``s3``; a scheme is added by decorating a resolver with ``@register("scheme")`` in a
module that imports only ``providers.base``, and importing that module below.
"""

from __future__ import annotations

from pathlib import Path

from kubetune.errors import KubetuneError
from kubetune.providers.base import _RESOLVERS, Kind, Uri, parse_uri, register, sha256_file

__all__ = ["Kind", "Uri", "configure", "parse_uri", "register", "resolve", "sha256_file"]


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
            f"unsupported URI scheme '{parsed.scheme}://' in {uri!r}",
            field=field,
            fix=f"use one of {known} or a plain path",
        )
    return resolver(parsed, kind, field, revision)


def configure(spec) -> None:
    """Apply the spec's provider settings (S3 endpoint, region, addressing) for this process."""
    from kubetune.providers import s3

    s3.configure(spec.s3.endpoint_url, spec.s3.region, spec.s3.addressing_style)


# Register the built-in schemes (import for side effect).
from kubetune.providers import hf as _hf  # noqa: E402,F401
from kubetune.providers import local as _local  # noqa: E402,F401
from kubetune.providers import s3 as _s3  # noqa: E402,F401
