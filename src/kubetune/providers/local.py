"""file:// and plain paths, and pkg:// (a file shipped inside an installed Python package)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

from kubetune.errors import KubetuneError
from kubetune.providers.base import Kind, S3Settings, Uri, register


@register("file")
def resolve_file(uri: Uri, kind: Kind, field: str, revision: str | None, s3: S3Settings) -> Path:
    path = Path(uri.body).expanduser()
    if not path.exists():
        what = "model directory" if kind == "model" else "data file or directory"
        raise KubetuneError(
            f"{what} {uri.raw!r} does not exist",
            field=field,
            fix="check the path (relative paths are from the current directory)",
        )
    return path


@register("pkg")
def resolve_pkg(uri: Uri, kind: Kind, field: str, revision: str | None, s3: S3Settings) -> Path:
    package, _, inner = uri.body.partition("/")
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        spec = None
    if spec is None or not spec.submodule_search_locations:
        raise KubetuneError(
            f"Python package '{package}' is not installed (from {uri.raw!r})",
            field=field,
            fix=f"pip install {package.replace('_', '-')}",
        )
    root = Path(next(iter(spec.submodule_search_locations)))
    path = root / inner
    if not path.exists():
        raise KubetuneError(
            f"'{inner}' not found inside package '{package}' ({root})",
            field=field,
            fix="check the path after pkg://PACKAGE/",
        )
    return path
