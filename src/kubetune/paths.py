"""Where kubetune writes, and how: cache roots, atomic files and directories, names checked
against their destination; and how it reads what others made: regular files of bounded size.

Every name that comes from elsewhere (an S3 key, a manifest entry, a Hub file name, a checkpoint
listing) goes through ``safe_join`` before anything is written, so that no remote listing can
make kubetune write outside the directory it was given. Files and directories are created with
the permissions the user's umask gives (a serving pod or a teammate reads a model under another
uid), not the 0600/0700 of ``mkstemp``/``mkdtemp``.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import shutil
import stat
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path, PurePosixPath
from typing import Any

from kubetune.errors import KubetuneError

_umask_lock = threading.Lock()


def cache_root() -> Path:
    """``$KUBETUNE_CACHE`` or ``~/.cache/kubetune``."""
    return Path(os.environ.get("KUBETUNE_CACHE") or Path.home() / ".cache" / "kubetune")


@functools.cache
def umask() -> int:
    """The process umask (read once: reading it means setting it, which is not thread-safe)."""
    with _umask_lock:
        mask = os.umask(0o022)
        os.umask(mask)
        return mask


def set_default_mode(path: Path) -> None:
    """Give a file made by mkstemp (0600) or a directory made by mkdtemp (0700) the mode a plain
    ``open``/``mkdir`` would have given it."""
    base = 0o777 if path.is_dir() else 0o666
    os.chmod(path, base & ~umask())


def set_default_modes(root: Path) -> None:
    """``set_default_mode`` for ``root`` and everything below it (some writers, safetensors among
    them, create their files 0600)."""
    set_default_mode(root)
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if not p.is_symlink():
                set_default_mode(p)


def write_atomic(path: Path, text: str | bytes) -> None:
    """Write a file through a temporary sibling and a rename: readers never see half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        if isinstance(text, bytes):
            with os.fdopen(fd, "wb") as fb:
                fb.write(text)
        else:
            with os.fdopen(fd, "w", encoding="utf-8") as f:
                f.write(text)
        set_default_mode(Path(tmp))
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def replace_dir(build: Callable[[Path], object], dest: Path, tmp: Path | None = None) -> None:
    """Build a directory under a temporary name and swap it into place (``dest`` must be ours).
    ``tmp``: a temporary directory next to ``dest`` that already holds part of it."""
    tmp = tmp or Path(tempfile.mkdtemp(prefix=f".{dest.name}-", dir=dest.parent))
    try:
        build(tmp)
        set_default_modes(tmp)
        if dest.is_symlink() or dest.is_file():
            dest.unlink()
        elif dest.exists():
            shutil.rmtree(dest)
        os.replace(tmp, dest)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def check_relative(
    name: str, *, what: str, fix: str = "refusing to write it; the listing or manifest was tampered with"
) -> PurePosixPath:
    """A remote relative name as a safe POSIX path: no absolute path, no ``..``, no empty or ``.``
    segment (``a//b``), no NUL, no backslash.

    Raises:
        KubetuneError: naming ``what`` (e.g. the bucket and key) and the offending name.
    """
    shown = name if len(name) <= 120 else name[:117] + "..."
    parts = name.split("/")
    if not name or name.startswith("/") or "\x00" in name or "\\" in name or any(p in ("", ".", "..") for p in parts):
        raise KubetuneError(f"{what}: the name {shown!r} would write outside its destination", fix=fix)
    return PurePosixPath(name)


def safe_join(root: Path, name: str, *, what: str) -> Path:
    """``root / name`` for a name that came from elsewhere, refused unless it stays inside ``root``
    (also when a directory on the way is a symlink that points out of it).

    Raises:
        KubetuneError: the name escapes ``root``.
    """
    rel = check_relative(name, what=what)
    target = root / Path(*rel.parts)
    base = root.resolve()
    # Resolve the deepest existing ancestor: a symlinked directory inside root must not lead out.
    probe = target.parent
    while probe != root and not probe.exists():
        probe = probe.parent
    resolved = probe.resolve()
    if resolved != base and base not in resolved.parents:
        raise KubetuneError(
            f"{what}: {name!r} leads through a symbolic link outside {root}",
            fix="refusing to write it; remove the link",
        )
    if target.is_symlink():
        raise KubetuneError(f"{what}: {target} is a symbolic link; refusing to write through it", fix="remove the link")
    return target


def check_tree_inside(root: Path, *, what: str) -> None:
    """Refuse a downloaded directory holding a symlink that resolves outside ``root`` (a Hub
    snapshot is made of links into the cache's own blob store, which is inside its repo folder).

    Raises:
        KubetuneError: names the link.
    """
    base = root.resolve()
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            p = Path(dirpath) / name
            if p.is_symlink():
                target = p.resolve()
                if target != base and base not in target.parents:
                    raise KubetuneError(
                        f"{what}: {p.relative_to(root)} is a link to {target}, outside the download",
                        fix="refusing to use it; the source was tampered with",
                    )


# Records kubetune reads back (a run's record, progress.json, metrics.json) are data from disk that
# anyone who can write there shapes: read as regular files of bounded size.
MAX_RECORD_BYTES = 64 * 1024


class BrokenRecord(ValueError):
    """A run record or progress file that is not what kubetune writes."""


def read_bounded_json(path: Path, limit: int = MAX_RECORD_BYTES, constants: bool = False) -> Any:
    """The JSON value in ``path``, a regular file (not a link, FIFO or device) of at most ``limit``
    bytes; without NaN or Infinity unless ``constants`` (the caller then checks every number).

    Raises:
        FileNotFoundError: there is no such file.
        BrokenRecord: anything else (what is wrong, in words).
    """
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        raise
    except OSError as e:  # ELOOP: a symbolic link
        raise BrokenRecord("a symbolic link" if e.errno == errno.ELOOP else (e.strerror or str(e))) from None
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise BrokenRecord("not a regular file")
        data = _read_at_most(fd, limit + 1)
    except OSError as e:
        raise BrokenRecord(e.strerror or str(e)) from None
    finally:
        os.close(fd)
    if len(data) > limit:
        raise BrokenRecord(f"larger than {limit // 1024} KiB")

    def no_constant(name: str):
        raise BrokenRecord(f"holds {name}, which is not JSON")

    try:
        return json.loads(data.decode("utf-8"), parse_constant=None if constants else no_constant)
    except (UnicodeDecodeError, RecursionError, ValueError) as e:
        raise BrokenRecord(e.args[0] if isinstance(e, BrokenRecord) else "not JSON") from None


def _read_at_most(fd: int, n: int) -> bytes:
    """Up to ``n`` bytes from ``fd``, however the reads split them."""
    chunks, left = [], n
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


# ------------------------------------------------------------------- files read on someone's behalf

# A bearer token (a projected service-account token is about 1 KB).
MAX_TOKEN_BYTES = 64 * 1024

_KINDS = (
    (stat.S_ISFIFO, "a FIFO (named pipe)"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class RefusedFile(KubetuneError):
    """A file named by an operator or a model that is not a regular file, or is larger than its bound.
    ``problem`` is the sentence without the field and the fix, for callers that say it their way."""

    def __init__(self, problem: str, *, field: str, fix: str):
        self.problem = problem
        super().__init__(problem, field=field, fix=fix)


def _refuse(path: Path, st: os.stat_result, limit: int | None, field: str, fix: str) -> None:
    if stat.S_ISDIR(st.st_mode):  # what open() and read() say of it: the caller words it with the rest
        raise IsADirectoryError(errno.EISDIR, os.strerror(errno.EISDIR), str(path))
    shown = f"{path} (a link to {os.path.realpath(path)})" if os.path.islink(path) else str(path)
    if not stat.S_ISREG(st.st_mode):
        kind = next((name for test, name in _KINDS if test(st.st_mode)), "of an unknown kind")
        raise RefusedFile(f"{shown} is {kind}, not a regular file", field=field, fix=fix)
    if limit is not None and st.st_size > limit:
        raise RefusedFile(f"{shown} is too large: {st.st_size:,} bytes, limit {limit:,}", field=field, fix=fix)


def check_regular(path: Path | str, *, field: str, limit: int | None = None, fix: str) -> int:
    """Check, without opening it, that ``path`` (links followed) is a regular file of at most ``limit``
    bytes (None: any size), for a file a library reads after this (a model's tokenizer, its weights).

    Returns:
        Its size in bytes.

    Raises:
        RefusedFile: a FIFO, a device, a socket, or larger than ``limit``: one line naming ``field``,
            the path (and where a link leads), what it is and ``fix``.
        OSError: it does not exist, cannot be reached, or is a directory (``IsADirectoryError``).
    """
    path = Path(path)
    st = os.stat(path)
    _refuse(path, st, limit, field, fix)
    return st.st_size


def read_regular(path: Path | str, *, field: str, limit: int, fix: str) -> bytes:
    """The bytes of ``path`` (links followed), read only if it is a regular file of at most ``limit``
    bytes: what an operator or a model hands kubetune to read whole (a token, a CA, a config).

    A FIFO or a device is refused without being read, and never blocks: it is checked before the
    open (opening some devices acts), opened non-blocking, and what was opened is checked again
    (``fstat``: no swap between the check and the read); at most ``limit + 1`` bytes are read.

    Raises:
        RefusedFile: as ``check_regular`` (also when the file grew past ``limit`` meanwhile).
        OSError: as ``check_regular``.
    """
    path = Path(path)
    _refuse(path, os.stat(path), limit, field, fix)
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        _refuse(path, st, limit, field, fix)
        data = _read_at_most(fd, limit + 1)
    finally:
        os.close(fd)
    if len(data) > limit:
        raise RefusedFile(f"{path} is too large: over {limit:,} bytes", field=field, fix=fix)
    return data
