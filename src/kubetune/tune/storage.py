"""Where a study lives: its output directory, taken as ``kubetune run`` takes its output (a new or empty one,
or one that this study's earlier sessions marked), and its Optuna database there (``study.db``), checked before
Optuna opens it and refused when it holds another study, objective or direction.
"""

from __future__ import annotations

import contextlib
import os
import stat
from pathlib import Path
from typing import Literal

from kubetune.config import JobSpec
from kubetune.config.tune import TuneSpec
from kubetune.errors import KubetuneError
from kubetune.tune import space

MARKER = ".kubetune-study"  # a directory kubetune tune made (or was let into with --overwrite)
LOCK = ".tune.lock"  # held by the session running the study; also marks a study of a version without MARKER
_FIX = "pick a new output.uri, or pass --overwrite (output.overwrite: true)"


def load(spec: JobSpec, out: Path):
    """The study in ``out`` as it stands, read only (a session may be running it).

    Raises:
        KubetuneError: there is no study there, its study.db cannot be read, or it holds another study.
    """
    import optuna

    db = out / "study.db"
    if not (db.exists() or db.is_symlink()):
        raise KubetuneError(
            f"no study in {out} (no study.db)", field="output.uri", fix="run `kubetune tune SPEC` to start it"
        )
    optuna.logging.set_verbosity(optuna.logging.WARNING)
    return open_study(spec, out, create=False)


def check_output(spec: JobSpec, out: Path) -> str | None:
    """Whether a study may be written into ``out`` (``output.uri``, local), as ``kubetune run`` decides for its
    output: a new or empty directory, or one a study marked (``MARKER``; a version without it left ``LOCK`` and
    study.db); someone else's non-empty directory, or a run's, only with ``output.overwrite`` (``--overwrite``).
    Writes nothing.

    Returns:
        The line to log when the study goes into a directory it did not make (``--overwrite``), else None.

    Raises:
        KubetuneError: a destination that can only be a mistake, a file, not writable, or not the study's.
    """
    from kubetune.artifacts.output import MARKER as RUN_MARKER
    from kubetune.artifacts.output import refuse_special

    refuse_special(spec.output.uri)
    if not out.exists():
        parent = next((p for p in out.parents if p.exists()), None)
        if parent is not None and not os.access(parent, os.W_OK | os.X_OK):
            raise KubetuneError(
                f"cannot create {out}: {parent} is not writable", field="output.uri", fix="choose a writable directory"
            )
        return None
    if not out.is_dir():
        raise KubetuneError(f"{out} exists and is not a directory", field="output.uri", fix="pick a new output.uri")
    if not os.access(out, os.W_OK | os.X_OK):
        raise KubetuneError(
            f"{out} is not writable (a read-only mount, or another user's directory)",
            field="output.uri",
            fix="choose a writable directory",
        )
    entries = sorted(os.listdir(out))
    if not entries or MARKER in entries or {LOCK, "study.db"} <= set(entries):
        return None
    if spec.output.overwrite:
        return (
            f"--overwrite: writing the study into {out}, which kubetune tune did not create; its tune.json, "
            "best.yaml, report.html and plots/ there are replaced, nothing else"
        )
    what = (
        "the output of a kubetune run, not a study's"
        if RUN_MARKER in entries
        else "not empty and was not created by kubetune tune"
    )
    shown = ", ".join(repr(e if len(e) <= 40 else e[:37] + "...") for e in entries[:3])
    more = ", ..." if len(entries) > 3 else ""
    raise KubetuneError(
        f"{out} is {what} ({len(entries)} {'entry' if len(entries) == 1 else 'entries'}: {shown}{more})",
        field="output.uri",
        fix=_FIX,
    )


def open_study(spec: JobSpec, out: Path, create: bool):
    """The study of ``spec`` in ``out``'s study.db: made there when ``create`` and the database holds none, with
    its objective kept beside it (the study's ``objective`` attribute).

    Raises:
        KubetuneError: study.db is not a regular file or not an Optuna database, it holds another study (one study
            to a directory), or the study's objective or direction is not the spec's.
    """
    import optuna
    import sqlalchemy.exc

    tune = spec.tune
    assert tune is not None  # a study's spec: its callers checked it has one (kubetune.tune.require)
    db = out / "study.db"
    _check_database(db)
    direction: Literal["minimize", "maximize"] = "minimize" if tune.minimize() else "maximize"
    try:
        storage = optuna.storages.RDBStorage(f"sqlite:///{db}", engine_kwargs={"connect_args": {"timeout": 60}})
        names = optuna.study.get_all_study_names(storage)
        if names and spec.name not in names:
            raise KubetuneError(
                f"{out} holds study {', '.join(map(repr, names))}, not {spec.name!r}: one study to a directory (its "
                "trials' directories are named by number)",
                field="name",
                fix=f"set name: {names[0]} to continue that study, or give output.uri a new directory",
            )
        if not names and not create:
            raise KubetuneError(
                f"no study in {out} (its study.db holds none)",
                field="output.uri",
                fix="run `kubetune tune SPEC` to start it",
            )
        if spec.name not in names:
            study = optuna.create_study(
                storage=storage,
                study_name=spec.name,
                sampler=space.sampler(tune),
                pruner=space.pruner(tune),
                direction=direction,
            )
            study.set_user_attr("objective", tune.objective)
            return study
        study = optuna.load_study(
            study_name=spec.name, storage=storage, sampler=space.sampler(tune), pruner=space.pruner(tune)
        )
    except (sqlalchemy.exc.SQLAlchemyError, RuntimeError) as e:  # RuntimeError: a schema of another Optuna
        raise KubetuneError(
            f"{db} cannot be read as a study: {str(e).splitlines()[0][:300]}",
            field="output.uri",
            fix="move study.db away (a new study starts), or pick a new output.uri",
        ) from None
    _check_same_search(spec, tune, study, out, direction)
    if create and "objective" not in study.user_attrs:  # a study of an earlier version, which kept none
        study.set_user_attr("objective", tune.objective)
    return study


def _check_same_search(spec: JobSpec, tune: TuneSpec, study, out: Path, direction: str) -> None:
    """The stored study optimizes the spec's objective in the spec's direction (a study of an earlier version kept
    no objective: its direction is checked); ``tune`` is ``spec``'s tune section."""
    stored_direction = study.direction.name.lower()
    stored = study.user_attrs.get("objective")
    if stored is not None and stored != tune.objective:
        raise KubetuneError(
            f"study {spec.name} in {out} optimizes {stored} ({stored_direction}), and tune.objective is "
            f"{tune.objective!r}: its trials' values are {stored}",
            field="tune.objective",
            fix=f"set tune.objective: {stored} to continue that study, or give output.uri a new directory",
        )
    if stored_direction != direction:
        raise KubetuneError(
            f"study {spec.name} in {out} is set to {stored_direction} {stored or 'its objective'}, and the spec says "
            f"{direction} {tune.objective}",
            field="tune.direction",
            fix=f"set tune.direction: {stored_direction} to continue that study, or give output.uri a new directory",
        )


def _check_database(db: Path) -> None:
    """study.db, where there is one, is a regular file holding an SQLite database that is empty or Optuna's:
    anything else is refused before Optuna opens it (it fails deep inside on a FIFO or random bytes)."""
    import sqlite3

    try:
        mode = db.stat().st_mode
    except FileNotFoundError:
        if db.is_symlink():  # Optuna would make the database at the link's target
            raise KubetuneError(
                f"{db} is a symbolic link to {os.readlink(db)!r}, which does not exist",
                field="output.uri",
                fix="move it away (a new study starts there), or pick a new output.uri",
            ) from None
        return
    except OSError as e:
        raise KubetuneError(
            f"cannot read {db}: {e.strerror or e}", field="output.uri", fix="pick a new output.uri"
        ) from None
    if not stat.S_ISREG(mode):
        kind = next((k for test, k in _KINDS if test(mode)), "not a regular file")
        raise KubetuneError(
            f"{db} is {kind}, not a study's database",
            field="output.uri",
            fix="move it away (a new study starts there), or pick a new output.uri",
        )
    try:
        with contextlib.closing(sqlite3.connect(f"{db.resolve().as_uri()}?mode=ro", uri=True, timeout=60)) as con:
            tables = {row[0] for row in con.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.Error as e:
        raise KubetuneError(
            f"{db} is not a study's database ({e})",
            field="output.uri",
            fix="move it away (a new study starts there), or pick a new output.uri",
        ) from None
    if tables and "studies" not in tables:
        raise KubetuneError(
            f"{db} is an SQLite database, not an Optuna study's (its tables: {', '.join(sorted(tables)[:5])})",
            field="output.uri",
            fix="move it away (a new study starts there), or pick a new output.uri",
        )


_KINDS = (
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISSOCK, "a socket"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISDIR, "a directory"),
)
