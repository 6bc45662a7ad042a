"""The base of every spec section, and the checks every section's fields share."""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, field_validator

# The largest integer any spec field takes. Why: a count sizes memory or a loop, and Python's
# integers have no bound of their own: `epochs: 10**30` validated and ended in an OverflowError
# inside the trainer. Fields that need less say so with their own `le`.
MAX_SPEC_INT = 2**31 - 1

_USERINFO = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*://[^/?#@]*@")


def userinfo_problem(value: str) -> str | None:
    """Why ``value``, a URL, may not stand in a spec: it names a user (and likely a password),
    which would be written into job.yaml, the ConfigMap, the report and the logs."""
    if _USERINFO.match(value.strip()):
        return (
            "holds a user name or password (user:password@); credentials never go in the spec — give them in "
            "the environment (MLFLOW_TRACKING_USERNAME/PASSWORD, AWS_ACCESS_KEY_ID/AWS_SECRET_ACCESS_KEY, HF_TOKEN) "
            "or, on Kubernetes, kubernetes.secrets"
        )
    return None


def _no_userinfo(value: str | None) -> str | None:
    if value is not None and (problem := userinfo_problem(value)):
        raise ValueError(problem)
    return value


# Every field that holds a URL or a URI: refuses credentials in it (tests/unit/test_hostile_spec.py
# checks that every such field of the spec uses it).
Uri = Annotated[str, AfterValidator(_no_userinfo)]


class Section(BaseModel):
    """Base of every spec section: unknown keys are errors, assignments are validated."""

    # allow_inf_nan: `.inf` / `.nan` are valid YAML floats; `weight_decay: .inf` trained and exported an all-NaN model.
    model_config = ConfigDict(extra="forbid", validate_assignment=True, allow_inf_nan=False)

    @field_validator("*", mode="after")
    @classmethod
    def _bounded_int(cls, value: Any) -> Any:
        if isinstance(value, int) and not isinstance(value, bool) and abs(value) > MAX_SPEC_INT:
            raise ValueError(f"must be at most {MAX_SPEC_INT:,} (2^31 - 1)")
        return value


class DataCommon(Section):
    """The ``data`` fields every task has; each task's data model (``config.tasks.TaskEntry.data``) adds its own
    and fixes ``task`` to its name with a ``Literal``."""

    task: str = Field(
        default="", exclude=True, description="(internal) the job's task, which selects the data section's model"
    )

    train: Uri = Field(
        description="Training data: a CSV/TSV/JSONL/Parquet file (plain path or file://), a directory of "
        "such files, hf://org/dataset (Hugging Face dataset), or pkg://package/path (a file shipped "
        "inside an installed Python package).",
    )
    eval: Uri | None = Field(
        default=None,
        description="Evaluation data, same forms as data.train. Absent: carve data.eval_fraction out of data.train.",
    )
    eval_fraction: float = Field(
        default=0.1,
        gt=0,
        lt=1,
        description="Fraction of data.train held out (stratified by label, fixed seed) when data.eval is absent.",
    )
    train_split: str = Field(
        default="train",
        description="Split (with optional slice, e.g. 'train[:3000]') for hf:// and directory datasets.",
    )
    eval_split: str = Field(
        default="validation", description="Split (with optional slice) of data.eval for hf:// and directory datasets."
    )
    text_column: str = Field(default="text", description="Column holding the input text.")
    max_length: int = Field(
        default=128,
        ge=8,
        le=32768,
        description="Token limit per example; longer texts are truncated. Batches are padded dynamically.",
    )
    max_train_samples: int | None = Field(
        default=None,
        ge=1,
        description="Use at most this many training rows (a seeded random subset), after the eval carve-out.",
    )
    max_eval_samples: int | None = Field(
        default=None,
        ge=1,
        description="Use at most this many evaluation rows (a seeded random subset). Absent: every row of "
        "data.eval, and at most 10,000 of an evaluation split carved out of data.train (said in the log).",
    )
    encoding: str = Field(
        default="auto",
        description="Text encoding of CSV/TSV/JSON(L) files. 'auto': UTF-8; "
        "a byte-order mark selects UTF-8/16/32; bytes that "
        "are not valid UTF-8 are decoded as cp1252 with a warning "
        "(valid UTF-8 around them stays UTF-8). Any other value "
        "(latin-1, cp1252, utf-16, ...) is used as given.",
    )
    max_input_mb: int | None = Field(
        default=None,
        ge=1,
        description="Largest data file (or directory, or dataset) read, in MiB; empty: no limit. Data is read "
        "in chunks into an Arrow cache on disk (KUBETUNE_CACHE), so memory does not grow with it; the disk "
        "must hold about twice the input (checked before reading).",
    )


class StreamingData(DataCommon):
    """The ``data`` fields of a task that can stream data.train (``data.streaming``: ``data/stream.py``)."""

    streaming: bool = Field(
        default=False,
        description="Stream data.train (a directory or an s3:// prefix of data files, its shards) instead of reading "
        "it whole into the cache first: for data larger than the local disk. Shards are read in listing order and "
        "tokenized as they come, each rank training on its own share; the stream's position is in every checkpoint, "
        "so a resume continues exactly, on any number of processes with the same global batch. Needs "
        "training.max_steps (the stream's length is not known in advance) and data.eval.",
    )
    shuffle_buffer: int = Field(
        default=1000,
        ge=0,
        le=1_000_000,
        description="With data.streaming: rows held for a seeded shuffle of the stream (0: file order). The buffer is "
        "in every checkpoint: larger mixes more, at the checkpoint's size.",
    )


def streaming_problems(data: StreamingData) -> list[str]:
    """What every streaming task refuses (a task's ``checks`` add their own)."""
    if not data.streaming:
        return []
    out = []
    if data.eval is None:
        out.append(
            "data.streaming needs data.eval: a stream has no held-out split to carve — give data.eval "
            "(read whole, at most data.max_eval_samples rows), or set data.streaming: false"
        )
    if data.max_train_samples is not None:
        out.append(
            "data.max_train_samples is not supported with data.streaming — bound the run with "
            "training.max_steps instead"
        )
    return out
