"""Uploads to s3:// (``upload_dir``, ``put_files``) and the deletion of an artifact there
(``delete_artifact``), both governed by the artifact's manifest: the manifest is deleted first and
written last, so a partial or interrupted upload never looks complete, and only the keys a manifest
of kubetune's lists are ever deleted. Errors are translated as ``providers.s3`` translates them.
"""

from __future__ import annotations

import json
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from kubetune.errors import KubetuneError
from kubetune.providers.base import S3Settings, sha256_file
from kubetune.providers.s3 import MANIFEST, Location, client, not_found, read_manifest, transfer_config, translate

log = logging.getLogger(__name__)


def put_files(local: Path, files: list[Path], uri: str, *, settings: S3Settings, field: str = "output.uri") -> dict:
    """Upload ``files`` (under ``local``) to the prefix ``uri`` without a manifest: a part of an
    artifact whose manifest another process writes (``upload_dir``'s ``uploaded``).

    Returns:
        Their manifest entries, by relative path.
    """
    loc = Location.parse(uri, field)
    s3 = client(settings)
    try:
        return dict(_put(s3, loc, local, p) for p in files)
    except Exception as e:
        raise translate(e, loc, field, "upload to", settings) from None


def _put(s3, loc: Location, local: Path, path: Path) -> tuple[str, dict]:
    rel = path.relative_to(local).as_posix()
    s3.upload_file(str(path), loc.bucket, loc.join(rel), Config=transfer_config())
    return rel, {"size": path.stat().st_size, "sha256": sha256_file(path)}


def upload_dir(
    local: Path,
    uri: str,
    *,
    settings: S3Settings,
    field: str = "output.uri",
    exclude: tuple[str, ...] = (),
    uploaded: dict | None = None,
) -> dict:
    """Upload every file under ``local`` (less the top-level names in ``exclude``) to the prefix
    ``uri``, then the manifest (last). ``uploaded``: manifest entries of files other processes put
    there already (``put_files``), listed in the manifest and not uploaded again. Files that the
    artifact's previous manifest listed and this one does not are deleted afterwards: only keys that
    kubetune's own manifest names, never anything else under the prefix.

    Returns:
        The manifest written.

    Raises:
        KubetuneError: after retries; the destination then has no manifest.
    """
    loc = Location.parse(uri, field)
    s3 = client(settings)
    files = sorted(
        p
        for p in local.rglob("*")
        if p.is_file()
        and p.name != MANIFEST
        and not p.name.startswith(".kubetune-")
        and p.relative_to(local).parts[0] not in exclude
        and p.relative_to(local).as_posix() not in (uploaded or {})
    )
    manifest = {"format": "kubetune-artifact/1", "files": {}}
    try:
        previous = _manifest_or_none(s3, loc, uri)
        # An older complete artifact at the same place must stop looking complete first.
        s3.delete_object(Bucket=loc.bucket, Key=loc.join(MANIFEST))
        with ThreadPoolExecutor(max_workers=4) as pool:
            manifest["files"] = {**(uploaded or {}), **dict(pool.map(lambda p: _put(s3, loc, local, p), files))}
        s3.put_object(
            Bucket=loc.bucket, Key=loc.join(MANIFEST), Body=json.dumps(manifest, indent=1, sort_keys=True).encode()
        )
        for rel in sorted(set(previous["files"]) - set(manifest["files"])) if previous else []:
            s3.delete_object(Bucket=loc.bucket, Key=loc.join(rel))
    except KubetuneError:
        raise
    except Exception as e:
        raise translate(e, loc, field, "upload to", settings) from None
    log.info("uploaded %d files to %s", len(files), uri)
    return manifest


def _manifest_or_none(s3, loc: Location, uri: str) -> dict | None:
    from botocore.exceptions import ClientError

    try:
        return read_manifest(s3, loc.bucket, loc.join(MANIFEST), uri)
    except KubetuneError as e:  # not a manifest kubetune wrote: nothing it lists is ours to delete
        log.warning("ignoring %s: %s", loc.join(MANIFEST), e)
        return None
    except ClientError as e:
        if not_found(e):
            return None
        raise


def delete_artifact(uri: str, *, settings: S3Settings, field: str = "output.uri") -> int:
    """Delete a kubetune artifact: its manifest first (it stops looking complete), then exactly
    the keys that manifest lists. Other objects under the prefix are not kubetune's and stay.

    Returns:
        The number of objects deleted (0 when there is no manifest).
    """
    loc = Location.parse(uri, field)
    s3 = client(settings)
    try:
        manifest = _manifest_or_none(s3, loc, uri)
        if manifest is None:
            return 0
        s3.delete_object(Bucket=loc.bucket, Key=loc.join(MANIFEST))
        for rel in manifest["files"]:
            s3.delete_object(Bucket=loc.bucket, Key=loc.join(rel))
        return len(manifest["files"]) + 1
    except KubetuneError:
        raise
    except Exception as e:
        raise translate(e, loc, field, "delete from", settings) from None
