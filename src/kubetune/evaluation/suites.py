"""Task directories for lm-evaluation-harness from wherever kubetune reads data: a local directory, or an s3://
prefix fetched into kubetune's cache. Task YAML whose data files are s3:// objects (the harness hands them to
``datasets.load_dataset``, which reads s3:// only with s3fs and its own credentials) get those objects fetched
through kubetune's S3 settings, and the harness reads a copy of the directory whose YAML names the local copies.
The user's directory and the cached prefix are never changed; the copy is kubetune's, in its cache, made once
per content (every process of a job asks; the first to finish renames it into place). Every task YAML there is
read first, as a regular UTF-8 file of bounded size: the harness opens each ``*.yaml`` it finds, and a FIFO among
them would hold it for ever."""

from __future__ import annotations

import hashlib
import os
import re
import shutil
from pathlib import Path

from kubetune.errors import KubetuneError
from kubetune.paths import RefusedFile, cache_root, read_regular
from kubetune.providers import S3Settings, resolve

# an s3:// URI as it stands in YAML: up to whitespace, a quote, or the end of a flow collection
S3_URI = re.compile(r"s3://[A-Za-z0-9.\-_]+/[^\s'\"\]\},]+")
# The largest task YAML of the harness's registry is 62 KB (0.4.13's mmlu_th): a file past this is not a task.
MAX_TASK_YAML_BYTES = 16 << 20


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
    yamls = sorted(p for p in local.rglob("*") if p.suffix in (".yaml", ".yml") and not p.is_dir())
    texts = {p: read_task_yaml(p, field) for p in yamls}
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
    shutil.copytree(local, tmp, ignore=_not_copied)
    for p, text in texts.items():
        for u in uris:  # the longest first: one URI may be the start of another
            text = text.replace(u, str(files[u]))
        (tmp / p.relative_to(local)).write_text(text)
    try:
        tmp.rename(dest)
    except OSError:  # another process of the job put the same copy in place first
        shutil.rmtree(tmp, ignore_errors=True)
    return str(dest)


def read_task_yaml(path: Path, field: str) -> str:
    """The text of a task YAML file, read as a regular UTF-8 file of at most ``MAX_TASK_YAML_BYTES``.

    Raises:
        KubetuneError: a FIFO, a device or a socket (never opened: the harness would wait on it for ever), a
            file too large, unreadable or not UTF-8 (one line naming ``field``, the file and the fix).
    """
    fix = "remove it from the task directory, or save it as a regular UTF-8 file"
    try:
        data = read_regular(path, field=field, limit=MAX_TASK_YAML_BYTES, fix=fix)
        return data.decode("utf-8")
    except RefusedFile as e:
        raise KubetuneError(f"the task YAML {e.problem}", field=field, fix=fix) from None
    except UnicodeDecodeError as e:
        raise KubetuneError(
            f"the task YAML {path} is not UTF-8 text (byte 0x{e.object[e.start]:02x} at offset {e.start})",
            field=field,
            fix="save it as UTF-8 (e.g. iconv -f latin1 -t utf-8), or remove it from the task directory",
        ) from None
    except OSError as e:
        raise KubetuneError(
            f"the task YAML {path} cannot be read ({e.strerror or type(e).__name__})", field=field, fix=fix
        ) from None


def _not_copied(directory: str, names: list[str]) -> set[str]:
    """What the copy of a task directory leaves out: kubetune's own entries, and anything neither a regular file
    nor a directory (links followed): copying a FIFO or a device would read it."""
    import stat

    out = set(shutil.ignore_patterns(".kubetune-*")(directory, names))
    for name in names:
        try:
            mode = os.stat(os.path.join(directory, name)).st_mode
        except OSError:
            out.add(name)  # a dangling link: nothing to copy
            continue
        if not (stat.S_ISREG(mode) or stat.S_ISDIR(mode)):
            out.add(name)
    return out
