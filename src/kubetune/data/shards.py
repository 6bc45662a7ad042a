"""The shards of a stream (``data.streaming``): the data files of a local file or directory, or of an
s3:// prefix, listed once with a version each (an S3 ETag, a local file's size and mtime), and one
shard brought to local disk as the version listed.

The listing's fingerprint goes into every stream state (``data.stream``), so a resume on data that
changed (a shard added, removed or rewritten) is refused in one line naming the first shard that
differs; a shard rewritten while a run reads it is refused the same way, when it is read.
"""

from __future__ import annotations

import functools
import hashlib
import itertools
from collections import Counter
from dataclasses import dataclass
from pathlib import Path, PurePosixPath

from kubetune import providers
from kubetune.data.tables import DIR_KINDS, FILE_SUFFIXES, KUBETUNE_MANIFEST, dir_data_files
from kubetune.errors import KubetuneError, short

RESUME_FIX = (
    "restore the data the run started with, use another output.uri, or pass --no-resume (training.resume: never)"
)
SHARD_FORMATS = ", ".join(FILE_SUFFIXES)  # what one shard may be: a file check_source reads


@dataclass(frozen=True)
class Shard:
    """One data file of a stream."""

    name: str  # its path relative to the listed directory or prefix (a single file: its own name)
    uri: str  # where it is read from; errors name it
    size: int
    version: str  # S3: the ETag; a local file: "size:mtime_ns"


@dataclass(frozen=True)
class Listing:
    """The shards of a stream, in the order they are read."""

    uri: str
    shards: tuple[Shard, ...]

    def fingerprint(self) -> str:
        """A hash of the shards' names, sizes and versions: equal exactly when the listing is."""
        return self._fingerprint

    @functools.cached_property
    def _fingerprint(self) -> str:  # a state_dict per checkpoint would hash every shard's entry again
        h = hashlib.sha256(b"kubetune stream listing v1\n")
        for s in self.shards:
            h.update(f"{len(s.name)}:{s.name}\0{s.size}\0{s.version}\n".encode())
        return h.hexdigest()

    def state(self) -> dict:
        """The listing as a checkpoint holds it: its fingerprint, and each shard (to name what changed)."""
        return {"fingerprint": self.fingerprint(), "shards": [[s.name, s.size, s.version] for s in self.shards]}

    def check_unchanged(self, saved: dict, field: str) -> None:
        """Refuse, in one line naming the first shard that differs, a listing other than ``saved``
        (``state()`` of the listing a checkpoint was taken on)."""
        if saved["fingerprint"] == self.fingerprint():
            return
        old = [tuple(s) for s in saved["shards"]]
        new = [(s.name, s.size, s.version) for s in self.shards]
        old_names, uris = {name for name, _, _ in old}, {s.name: s.uri for s in self.shards}
        what = "its listing differs"
        for a, b in itertools.zip_longest(old, new):
            if a == b:
                continue
            if a is not None and b is not None and a[0] == b[0]:
                what = (
                    f"{short(uris[b[0]])} was rewritten (size {a[1]} -> {b[1]}, "
                    f"version {short(a[2], 40)} -> {short(b[2], 40)})"
                )
            elif b is not None and (a is None or b[0] not in old_names):
                what = f"{short(uris[b[0]])} was added"
            else:
                what = f"{short(_join(self.uri, a[0]))} was removed"
            break
        raise KubetuneError(
            f"{short(self.uri)} changed since the checkpoint was taken: {what}, so the stream would not continue "
            "the same run",
            field=field,
            fix=RESUME_FIX,
        )


def _join(uri: str, name: str) -> str:
    return f"{uri.rstrip('/')}/{name}"


def local_version(path: Path) -> str:
    """A local file's version as a listing records it: its size and modification time."""
    st = path.stat()
    return f"{st.st_size}:{st.st_mtime_ns}"


def _walk_order(name: str) -> tuple:
    """A sort key that puts relative names in ``os.walk`` order (a directory's files, then its
    subdirectories, each sorted), so an s3:// copy of a directory streams in the directory's order."""
    parts = name.split("/")
    return tuple((1, p) for p in parts[:-1]) + ((0, parts[-1]),)


def _check_kinds(uri: str, names: list[str], field: str) -> None:
    """One kind of data file (as ``tables`` requires of a directory), each a kind one file can be read as."""
    suffixes = Counter(PurePosixPath(n).suffix.lower() for n in names)
    if len({DIR_KINDS.get(s, s) for s in suffixes}) > 1:
        listed = ", ".join(f"{n} {s}" for s, n in suffixes.most_common())
        raise KubetuneError(
            f"{short(uri)!r} mixes data file kinds ({listed}); only one kind would be read",
            field=field,
            fix="keep one kind of data file per directory (convert or move the others), or point it at one file",
        )
    odd = next((n for n in names if PurePosixPath(n).suffix.lower() not in FILE_SUFFIXES), None)
    if odd is not None:
        raise KubetuneError(
            f"cannot stream {short(_join(uri, odd))}: a streamed shard is one of {SHARD_FORMATS}",
            field=field,
            fix="convert the shards (.ndjson: rename to .jsonl), or set data.streaming: false",
        )


def list_shards(uri: str, *, field: str, s3: providers.S3Settings = providers.S3Settings()) -> Listing:
    """The shards of ``uri``: a local data file (one shard), the data files of a local directory
    (as ``tables`` finds them: hidden files skipped, one kind), or of an s3:// prefix (kubetune's
    manifest and hidden keys skipped; the objects listed page by page, nothing downloaded).

    Raises:
        KubetuneError: hf:// (not yet streamed), nothing there, no data files, mixed kinds, a kind a
            shard cannot be, or S3 refusing the listing; one line.
    """
    scheme = providers.parse_uri(uri).scheme
    if scheme == "hf":
        raise KubetuneError(
            f"streaming from hf:// is not yet supported ({short(uri)})",
            field=field,
            fix="copy the dataset's files to s3:// or a local directory, or set data.streaming: false",
        )
    if scheme == "s3":
        return _s3_listing(uri, field, s3)
    path = providers.resolve(uri, kind="dataset", field=field, s3=s3)
    if path.is_dir():
        _, files = dir_data_files(path, uri, field)
        names = [file.relative_to(path).as_posix() for file, _ in files]
        shards = [Shard(n, _join(uri, n), size, local_version(f)) for n, (f, size) in zip(names, files)]
    else:
        names = [path.name]
        shards = [Shard(path.name, uri, path.stat().st_size, local_version(path))]
    if not shards:
        raise KubetuneError(
            f"no data files in {short(uri)}", field=field, fix=f"point it at a directory of {SHARD_FORMATS} files"
        )
    _check_kinds(uri, names, field)
    return Listing(uri, tuple(shards))


def _s3_listing(uri: str, field: str, settings: providers.S3Settings) -> Listing:
    from kubetune.providers import s3 as s3p

    loc = s3p.Location.parse(uri, field)
    client = s3p.client(settings)
    try:
        if loc.key and not loc.key.endswith("/"):
            head = _head(client, loc)
            if head is not None:  # one object: one shard
                name = PurePosixPath(loc.key).name
                _check_kinds(uri, [name], field)
                return Listing(uri, (Shard(name, uri, head["ContentLength"], head["ETag"]),))
        prefix = loc.key.rstrip("/") + "/" if loc.key else ""
        shards = []
        for page in client.get_paginator("list_objects_v2").paginate(Bucket=loc.bucket, Prefix=prefix):
            for o in page.get("Contents", []):
                name = o["Key"][len(prefix) :]
                parts = name.split("/")
                if (
                    name.endswith("/")
                    or name == KUBETUNE_MANIFEST
                    or any(p.startswith((".", "__")) for p in parts)
                    or PurePosixPath(name).suffix.lower() not in DIR_KINDS
                ):
                    continue
                shards.append(Shard(name, f"s3://{loc.bucket}/{o['Key']}", o["Size"], o["ETag"]))
    except KubetuneError:
        raise
    except Exception as e:
        raise s3p.translate(e, loc, field, "list", settings) from None
    if not shards:
        raise KubetuneError(
            f"no data files under {short(uri)} ({settings.endpoint() or 'AWS S3'})",
            field=field,
            fix=f"check the bucket and prefix: streaming reads {SHARD_FORMATS} objects",
        )
    shards.sort(key=lambda s: _walk_order(s.name))
    _check_kinds(uri, [s.name for s in shards], field)
    return Listing(uri, tuple(shards))


def _head(client, loc) -> dict | None:
    """The object at ``loc``, or None when there is none (its key may be a prefix)."""
    from botocore.exceptions import ClientError

    try:
        return client.head_object(Bucket=loc.bucket, Key=loc.key)
    except ClientError as e:
        if e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound"):
            return None
        raise


def download(shard: Shard, dest: Path, field: str, settings: providers.S3Settings) -> None:
    """Fetch an s3:// shard to ``dest`` and check that it is the version listed: its size, and S3's
    If-Match on the listed ETag right after (boto3's transfer does not take one; it keeps a multipart
    download to one version itself, so an object that is still the listed one was downloaded whole)."""
    from botocore.exceptions import ClientError

    from kubetune.providers import s3 as s3p

    loc = s3p.Location.parse(shard.uri, field)
    client = s3p.client(settings)
    try:
        client.download_file(loc.bucket, loc.key, str(dest), Config=s3p.transfer_config())
        client.head_object(Bucket=loc.bucket, Key=loc.key, IfMatch=shard.version)
    except ClientError as e:
        status = e.response.get("ResponseMetadata", {}).get("HTTPStatusCode")
        if status in (404, 412) or e.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "412"):
            raise changed(shard, field) from None
        raise s3p.translate(e, loc, field, "read from", settings) from None
    except Exception as e:
        raise s3p.translate(e, loc, field, "read from", settings) from None
    if dest.stat().st_size != shard.size:
        raise changed(shard, field)


def changed(shard: Shard, field: str) -> KubetuneError:
    """The one-line error for a shard that is no longer the version listed."""
    return KubetuneError(
        f"{short(shard.uri)} is no longer the version listed when the stream started (rewritten or removed since)",
        field=field,
        fix="leave the data unchanged while a run reads it: restore it and resume, or pass --no-resume",
    )
