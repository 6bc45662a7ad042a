"""s3://bucket/key-or-prefix for models, datasets, artifacts and checkpoints (AWS S3 or MinIO).

Transfers go through boto3's transfer manager (multipart, parallel, streamed to disk, bounded
memory); sizes are verified after every download. An uploaded directory counts as complete only
when its manifest (every file with size and sha256) exists: the manifest is deleted first and
written last, so a partial or interrupted upload never looks complete, and readers of artifacts
refuse a prefix without one (uploads, and deletions by manifest: ``providers.s3_upload``). Errors
are translated here into one line naming the bucket and the endpoint, never a credential. Every
function that makes a client takes the job's ``S3Settings``.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from kubetune.errors import KubetuneError
from kubetune.paths import cache_root, check_relative, safe_join, set_default_mode, write_atomic
from kubetune.providers.base import Kind, S3Settings, Uri, register, sha256_file

log = logging.getLogger(__name__)
MANIFEST = "_kubetune_manifest.json"


def client(settings: S3Settings):
    """A boto3 S3 client for ``settings`` (the environment fills what they leave unset)."""
    import boto3
    from botocore.config import Config

    url = settings.endpoint()
    style = settings.addressing_style
    if style == "auto" and url:
        style = "path"  # MinIO and most S3-compatible servers want path-style addressing
    config = Config(
        s3={"addressing_style": style},
        retries={"max_attempts": int(os.environ.get("KUBETUNE_S3_MAX_ATTEMPTS", "5")), "mode": "standard"},
        connect_timeout=10,
        read_timeout=60,
        signature_version="s3v4",
    )
    return boto3.client("s3", endpoint_url=url, region_name=settings.region_name(), config=config)


def transfer_config():
    from boto3.s3.transfer import TransferConfig

    # 16 MiB parts, 8 in flight: memory stays ~128 MiB whatever the object size.
    return TransferConfig(
        multipart_threshold=16 << 20, multipart_chunksize=16 << 20, max_concurrency=8, use_threads=True
    )


@dataclass(frozen=True)
class Location:
    bucket: str
    key: str

    @classmethod
    def parse(cls, uri: str, field: str) -> Location:
        body = uri.split("://", 1)[1] if "://" in uri else uri
        bucket, _, key = body.partition("/")
        if not bucket:
            raise KubetuneError(f"{uri!r} names no bucket", field=field, fix="write s3://BUCKET/PREFIX")
        return cls(bucket, key)

    def join(self, rel: str) -> str:
        return f"{self.key.rstrip('/')}/{rel}" if self.key else rel


def translate(e: Exception, loc: Location, field: str, action: str, settings: S3Settings) -> KubetuneError:
    """One line naming the bucket and endpoint (``settings``'); never a key or secret."""
    from botocore.exceptions import ClientError, EndpointConnectionError, NoCredentialsError

    where = f"bucket '{loc.bucket}' at {settings.endpoint() or 'AWS S3'}"
    if isinstance(e, NoCredentialsError):
        return KubetuneError(
            f"no S3 credentials found to {action} {where}",
            field=field,
            fix="set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or a profile, or the Kubernetes Secret)",
        )
    if isinstance(e, ClientError):
        code = e.response.get("Error", {}).get("Code", "")
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if code == "NoSuchBucket":
            return KubetuneError(
                f"{where} does not exist",
                field=field,
                fix=f"create it (e.g. `mc mb local/{loc.bucket}`) or fix the URI",
            )
        if (
            code
            in (
                "InvalidAccessKeyId",
                "SignatureDoesNotMatch",
                "AccessDenied",
                "403",
                "Forbidden",
                "InvalidToken",
                "ExpiredToken",
            )
            or status == 403
        ):
            return KubetuneError(
                f"S3 refused to {action} {where} ({code or status})",
                field=field,
                fix="check AWS_ACCESS_KEY_ID / AWS_SECRET_ACCESS_KEY and the bucket policy",
            )
        if code in ("NoSuchKey", "404", "NotFound"):
            return KubetuneError(
                f"s3://{loc.bucket}/{loc.key} not found at {settings.endpoint() or 'AWS S3'}",
                field=field,
                fix="check the key or prefix",
            )
        return KubetuneError(f"S3 error while trying to {action} {where}: {code or status}", field=field)
    from boto3.exceptions import RetriesExceededError, S3UploadFailedError

    if isinstance(e, RetriesExceededError) and e.last_exception is not None:
        return translate(e.last_exception, loc, field, action, settings)
    if isinstance(e, S3UploadFailedError):
        # boto3 flattens the ClientError into text; recover the code for the usual causes.
        text = str(e)
        for code in ("NoSuchBucket", "InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied"):
            if code in text:
                return translate(ClientError({"Error": {"Code": code}}, "PutObject"), loc, field, action, settings)
        return KubetuneError(
            f"S3 upload to {where} failed after retries",
            field=field,
            fix="check the endpoint and that the server is up",
        )
    from botocore.exceptions import BotoCoreError

    if isinstance(e, EndpointConnectionError) or (
        isinstance(e, BotoCoreError) and "connect" in type(e).__name__.lower()
    ):
        return KubetuneError(
            f"cannot reach the S3 endpoint to {action} {where} (after retries)",
            field=field,
            fix="check the endpoint (s3.endpoint_url / AWS_ENDPOINT_URL) and that the server is up",
        )
    if isinstance(e, OSError):  # local disk: full, read-only, permissions
        return KubetuneError(
            f"cannot {action.split()[0]} {getattr(e, 'filename', None) or 'a local file'} "
            f"while transferring with {where}: {e.strerror or e}",
            field=field,
            fix="free disk space or fix the local directory's permissions",
        )
    if isinstance(e, BotoCoreError):
        return KubetuneError(
            f"S3 transfer failed while trying to {action} {where}: {type(e).__name__}",
            field=field,
            fix="check the endpoint and retry",
        )
    raise e


def _list(s3, loc: Location) -> list[dict]:
    prefix = loc.key.rstrip("/") + "/" if loc.key else ""
    objects = []
    for page in s3.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=prefix):
        objects += [o for o in page.get("Contents", []) if not o["Key"].endswith("/")]
    return objects


def _download(s3, bucket: str, key: str, dest: Path, size: int, sha256: str | None = None) -> None:
    """Fetch one object to ``dest`` through a temporary sibling; the size (and the sha256 when the
    artifact's manifest gives one) is checked before the file takes its name."""
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{dest.name}-", dir=dest.parent)
    os.close(fd)
    try:
        s3.download_file(bucket, key, tmp, Config=transfer_config())
        got = os.path.getsize(tmp)
        if got != size:
            raise KubetuneError(
                f"s3://{bucket}/{key}: downloaded {got} bytes, expected {size}",
                fix="retry; the object may have changed during the download",
            )
        if sha256 is not None and sha256_file(Path(tmp)) != sha256:
            raise KubetuneError(
                f"s3://{bucket}/{key}: sha256 does not match the artifact's manifest",
                fix="the artifact was modified after export; re-run the export",
            )
        set_default_mode(Path(tmp))
        os.replace(tmp, dest)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


def read_manifest(s3, bucket: str, key: str, shown: str) -> dict:
    """A kubetune artifact manifest, checked: every listed name must stay inside the artifact.

    Raises:
        KubetuneError: malformed, or a listed name would write outside the destination.
    """
    try:
        manifest = json.loads(s3.get_object(Bucket=bucket, Key=key)["Body"].read())
        files = manifest["files"]
        ok = isinstance(files, dict) and all(
            isinstance(m, dict) and isinstance(m.get("size"), int) and isinstance(m.get("sha256"), str)
            for m in files.values()
        )
    except (ValueError, KeyError, TypeError):
        ok = False
    if not ok:
        raise KubetuneError(
            f"s3://{bucket}/{key} is not a valid kubetune manifest",
            fix="re-run the export, or point at a complete artifact",
        )
    for rel in files:
        check_relative(rel, what=f"{shown}: {MANIFEST} of bucket '{bucket}' lists")
    return manifest


def not_found(e: Exception) -> bool:
    """Is ``e`` S3's answer that no object has the key?"""
    from botocore.exceptions import ClientError

    return isinstance(e, ClientError) and e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound")


def _artifact_above(s3, loc: Location) -> tuple[str, dict] | None:
    """For ``s3://b/run/model/``: the artifact at an enclosing prefix (up to 3 levels up) whose
    manifest lists files under ``model/``, as (the enclosing prefix, a manifest of just those files
    relative to the sub-prefix). Lets ``predict`` take the model directory inside an artifact."""
    parts = [p for p in loc.key.split("/") if p]
    for up in range(1, min(3, len(parts)) + 1):
        root = "/".join(parts[:-up])
        sub = "/".join(parts[-up:]) + "/"
        key = f"{root}/{MANIFEST}" if root else MANIFEST
        try:
            manifest = read_manifest(s3, loc.bucket, key, f"s3://{loc.bucket}/{loc.key}")
        except KubetuneError:
            raise
        except Exception as e:
            if not_found(e):
                continue
            raise
        files = {rel[len(sub) :]: meta for rel, meta in manifest["files"].items() if rel.startswith(sub)}
        if files:
            return (f"{root}/" if root else ""), {**manifest, "files": files, "subdir": sub.rstrip("/")}
    return None


def download(uri: str, dest: Path, *, field: str, settings: S3Settings, require_manifest: bool = False) -> Path:
    """Download an object (to ``dest``) or every object under a prefix (into ``dest/``).

    Every object key and manifest entry must name a file inside ``dest`` (no ``..``, no absolute
    or empty segments), or nothing is downloaded. Unchanged objects already in ``dest`` (same size
    and ETag) are not fetched again. With ``require_manifest``, the prefix must hold a complete
    kubetune artifact, or be a directory inside one (``s3://b/run/model``), and every file is
    checked against the manifest's sha256 before it takes its name.

    Returns:
        The local file or directory.
    """
    loc = Location.parse(uri, field)
    s3 = client(settings)
    try:
        if loc.key and not loc.key.endswith("/"):
            target = _download_object(s3, loc, uri, dest, field, require_manifest)
            if target is not None:
                return target
        names, manifest = _prefix_files(s3, loc, uri, field, require_manifest, settings)
        _fetch_all(s3, loc, dest, names, manifest)
        if manifest is not None:
            write_atomic(dest / MANIFEST, json.dumps(manifest))
        return dest
    except KubetuneError as e:
        if e.field is None and field:
            raise KubetuneError(str(e), field=field) from None
        raise
    except Exception as e:
        raise translate(e, loc, field, "read from", settings) from None


def _download_object(s3, loc: Location, uri: str, dest: Path, field: str, require_manifest: bool) -> Path | None:
    """The object ``loc.key`` names, downloaded to ``dest`` (into it when ``dest`` has no suffix)
    unless unchanged there; None when there is no such object (the key may be a prefix)."""
    shown = f"bucket '{loc.bucket}'"
    try:
        head = s3.head_object(Bucket=loc.bucket, Key=loc.key)
        if require_manifest:
            raise KubetuneError(
                f"{uri} is a single object, not a kubetune artifact", field=field, fix="pass the artifact's prefix"
            )
        name = PurePosixPath(loc.key).name
        check_relative(name, what=f"{shown}, key {loc.key!r}")
        target = dest if dest.suffix else safe_join(dest, name, what=f"{shown}, key {loc.key!r}")
        if not (target.exists() and target.stat().st_size == head["ContentLength"] and _etag_ok(target, head["ETag"])):
            _download(s3, loc.bucket, loc.key, target, head["ContentLength"])
            _remember_etag(target, head["ETag"])
        return target
    except KubetuneError:
        raise
    except Exception as e:  # a 404 on head means: maybe a prefix
        if not not_found(e):
            raise
    return None


def _prefix_files(
    s3, loc: Location, uri: str, field: str, require_manifest: bool, settings: S3Settings
) -> tuple[dict[str, dict], dict | None]:
    """The objects to download under the prefix ``loc`` (by path relative to it), and the
    artifact's manifest (None when there is none and ``require_manifest`` is not set); with a
    manifest, exactly the files it lists."""
    shown = f"bucket '{loc.bucket}'"
    prefix = loc.key.rstrip("/") + "/" if loc.key else ""
    names = {}
    for o in _list(s3, loc):
        rel = o["Key"][len(prefix) :]
        check_relative(rel, what=f"{shown}, key {o['Key']!r} under s3://{loc.bucket}/{prefix}")
        names[rel] = o
    manifest = None
    if MANIFEST in names:
        manifest = read_manifest(s3, loc.bucket, names[MANIFEST]["Key"], uri)
    elif require_manifest:
        above = _artifact_above(s3, loc)
        if above is None:
            raise KubetuneError(
                f"{uri} has no {MANIFEST}: the artifact is incomplete "
                "(an upload was interrupted) or not a kubetune artifact",
                field=field,
                fix="re-run the export, or point at a complete artifact",
            )
        root, manifest = above
        sub = manifest["subdir"] + "/"
        listing = {o["Key"]: o for o in _list(s3, Location(loc.bucket, root + sub))}
        names = {rel: listing[root + sub + rel] for rel in manifest["files"] if root + sub + rel in listing}
    if not names and manifest is None:
        raise KubetuneError(
            f"nothing at {uri} ({settings.endpoint() or 'AWS S3'})", field=field, fix="check the bucket and prefix"
        )
    if manifest is not None:
        missing = sorted(set(manifest["files"]) - set(names))
        if missing:
            raise KubetuneError(
                f"{uri}: manifest lists {len(missing)} file(s) that are missing, e.g. {missing[0]}",
                field=field,
                fix="re-run the export",
            )
        names = {rel: names[rel] for rel in manifest["files"]}  # only what the artifact contains
    return names, manifest


def _fetch_all(s3, loc: Location, dest: Path, names: dict[str, dict], manifest: dict | None) -> None:
    """Download ``names`` (objects by relative path) into ``dest``, four at a time, skipping files
    already there unchanged (and, with a manifest, matching its sha256)."""
    shown = f"bucket '{loc.bucket}'"
    targets = {
        rel: safe_join(dest, rel, what=f"{shown}, key {obj['Key']!r}") for rel, obj in names.items() if rel != MANIFEST
    }

    def fetch(rel: str) -> None:
        obj, target = names[rel], targets[rel]
        sha = manifest["files"][rel]["sha256"] if manifest is not None else None
        if (
            target.exists()
            and target.stat().st_size == obj["Size"]
            and _etag_ok(target, obj["ETag"])
            and (sha is None or sha256_file(target) == sha)
        ):
            return
        _download(s3, loc.bucket, obj["Key"], target, obj["Size"], sha)
        _remember_etag(target, obj["ETag"])

    with ThreadPoolExecutor(max_workers=4) as pool:
        list(pool.map(fetch, targets))


def list_keys(uri: str, *, field: str, settings: S3Settings, limit: int = 1000) -> list[str]:
    """Up to ``limit`` keys under the prefix ``uri``, relative to it."""
    loc = Location.parse(uri, field)
    prefix = loc.key.rstrip("/") + "/" if loc.key else ""
    try:
        out: list[str] = []
        for page in (
            client(settings)
            .get_paginator("list_objects_v2")
            .paginate(Bucket=loc.bucket, Prefix=prefix, PaginationConfig={"MaxItems": limit})
        ):
            out += [o["Key"][len(prefix) :] for o in page.get("Contents", [])]
        return out
    except Exception as e:
        raise translate(e, loc, field, "list", settings) from None


def read_text(uri: str, *, field: str, settings: S3Settings) -> str | None:
    """A small object's text, or None when it does not exist."""
    loc = Location.parse(uri, field)
    try:
        s3 = client(settings)
        return s3.get_object(Bucket=loc.bucket, Key=loc.key)["Body"].read(1 << 20).decode("utf-8", "replace")
    except Exception as e:
        if not_found(e):
            return None
        raise translate(e, loc, field, "read from", settings) from None


def write_text(uri: str, text: str, *, field: str, settings: S3Settings) -> None:
    loc = Location.parse(uri, field)
    try:
        client(settings).put_object(Bucket=loc.bucket, Key=loc.key, Body=text.encode())
    except Exception as e:
        raise translate(e, loc, field, "write to", settings) from None


def check_bucket(uri: str, *, field: str, settings: S3Settings) -> None:
    """Raise the one-line error now if the bucket is missing or the credentials are refused."""
    loc = Location.parse(uri, field)
    try:
        client(settings).head_bucket(Bucket=loc.bucket)
    except Exception as e:
        from botocore.exceptions import ClientError

        if isinstance(e, ClientError) and e.response.get("Error", {}).get("Code") in (
            "404",
            "NoSuchBucket",
            "NotFound",
        ):
            e.response["Error"]["Code"] = "NoSuchBucket"  # head_bucket reports a bare 404
        raise translate(e, loc, field, "write to", settings) from None


@register("s3")
def resolve_s3(uri: Uri, kind: Kind, field: str, revision: str | None, s3: S3Settings) -> Path:
    """Download to the local cache (``$KUBETUNE_CACHE/s3/BUCKET/KEY``), reusing unchanged files."""
    loc = Location.parse(uri.raw, field)
    dest = safe_join(
        cache_root() / "s3", f"{loc.bucket}/{loc.key.rstrip('/')}".rstrip("/"), what=f"{field}: {uri.raw!r}"
    )
    return download(uri.raw, dest, field=field, settings=s3)


def _etag_file(path: Path) -> Path:
    return path.with_name(f".kubetune-etag-{path.name}")


def _etag_ok(path: Path, etag: str) -> bool:
    marker = _etag_file(path)
    return marker.exists() and marker.read_text() == etag


def _remember_etag(path: Path, etag: str) -> None:
    _etag_file(path).write_text(etag)
