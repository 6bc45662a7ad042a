"""Task directories for lm-evaluation-harness from wherever kubetune reads data: a local directory, or an s3://
prefix fetched into kubetune's cache. Task YAML whose data files are s3:// objects (the harness hands them to
``datasets.load_dataset``, which reads s3:// only with s3fs and its own credentials) get those objects fetched
through kubetune's S3 settings, and the harness reads a copy of the directory whose YAML names the local copies.
The user's directory and the cached prefix are never changed; the copy is kubetune's, in its cache, made once
per content (every process of a job asks; the first to finish renames it into place)."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

from kubetune.paths import cache_root
from kubetune.providers import S3Settings, resolve

# an s3:// URI as it stands in YAML: up to whitespace, a quote, or the end of a flow collection
S3_URI = re.compile(r"s3://[A-Za-z0-9.\-_]+/[^\s'\"\]\},]+")


def stage(include_path: str | None, s3: S3Settings | None = None, field: str = "evaluation.include_path") -> str | None:
    """A local directory for the harness with the tasks of ``include_path`` (a directory or an s3:// prefix) and
    their s3:// data local; ``include_path`` itself when nothing needs fetching.

    Raises:
        KubetuneError: an s3:// prefix or data object that cannot be read (one line naming ``field``).
    """
    if include_path is None:
        return None
    s3 = s3 or S3Settings()
    remote = include_path.startswith("s3://")
    local = resolve(include_path, kind="dataset", field=field, s3=s3) if remote else Path(include_path)
    if not local.is_dir():
        return str(local)  # the task manager says it is not a directory
    yamls = sorted(p for p in local.rglob("*") if p.suffix in (".yaml", ".yml") and p.is_file())
    texts = {p: p.read_text() for p in yamls}
    uris = sorted({u for text in texts.values() for u in S3_URI.findall(text)}, key=len, reverse=True)
    if not uris:
        return str(local)
    files = {u: resolve(u, kind="dataset", field=field, s3=s3) for u in uris}
    digest = hashlib.sha256(str(local).encode())
    for p, text in texts.items():
        digest.update(f"{p.relative_to(local)}\0{text}\0".encode())
    for u, f in files.items():
        st = f.stat()
        digest.update(f"{u}\0{st.st_size}\0{st.st_mtime_ns}\0".encode())
    dest = cache_root() / "lm_eval_tasks" / digest.hexdigest()[:20]
    if dest.is_dir():
        return str(dest)
    tmp = dest.with_name(f"{dest.name}.{os.getpid()}.tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    shutil.copytree(local, tmp, ignore=shutil.ignore_patterns(".kubetune-*"))
    for p, text in texts.items():
        for u in uris:  # the longest first: one URI may be the start of another
            text = text.replace(u, str(files[u]))
        (tmp / p.relative_to(local)).write_text(text)
    try:
        tmp.rename(dest)
    except OSError:  # another process of the job put the same copy in place first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)
