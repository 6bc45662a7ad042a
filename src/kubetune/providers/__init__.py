"""URI schemes for models, datasets and artifacts, behind one registry.

``resolve(uri, kind=..., field=..., s3=...)`` turns a URI into a local path, downloading when the
scheme is remote (s3:// through the job's ``S3Settings``, built by ``S3Settings.from_spec``). The
schemes are ``file`` (and plain paths), ``pkg`` (files inside an installed package), ``hf`` and
``s3``; a scheme is added by decorating a resolver with ``@register("scheme")`` in a module that
imports only ``providers.base``, and importing that module below.
"""

from __future__ import annotations

from pathlib import Path

from kubetune.errors import KubetuneError
from kubetune.providers.base import _RESOLVERS, Kind, S3Settings, Uri, parse_uri, register, sha256_file

__all__ = ["Kind", "S3Settings", "Uri", "parse_uri", "register", "resolve", "sha256_file"]


def resolve(uri: str, *, kind: Kind, field: str, revision: str | None = None, s3: S3Settings = S3Settings()) -> Path:
    """Return a local path for ``uri``, fetching it first when the scheme is remote.

    Args:
        uri: ``hf://org/name``, ``file:///path``, ``pkg://package/path`` or a plain path.
        kind: ``model`` or ``dataset`` (selects the Hub repo type for hf://).
        field: the spec field the URI came from, named in error messages.
        revision: optional Hub revision.
        s3: how to reach S3 for s3:// (the job's; the default leaves it all to the environment).

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
    return resolver(parsed, kind, field, revision, s3)


# Register the built-in schemes (import for side effect).
from kubetune.providers import hf as _hf  # noqa: E402,F401
from kubetune.providers import local as _local  # noqa: E402,F401
from kubetune.providers import s3 as _s3  # noqa: E402,F401
