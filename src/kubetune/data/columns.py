"""What a column of a table holds, for the tasks' checks: text, or numbers, booleans, nested values;
over a table read in chunks too (``NonText``)."""

from __future__ import annotations

import numpy as np
import pandas as pd

from kubetune.errors import KubetuneError, short


def describe_non_text(series: pd.Series) -> str | None:
    """What a column holds when none of its values is text (numbers, booleans, nested values); None
    when some value is text or every value is missing."""
    if isinstance(series.dtype, pd.StringDtype):
        return None
    values = series[series.notna()]
    if values.empty:
        return None
    if pd.api.types.is_bool_dtype(series):
        return f"booleans ({series.dtype})"
    if pd.api.types.is_numeric_dtype(series):
        return f"numbers ({series.dtype})"
    if any(isinstance(v, str) for v in values):
        return None
    if any(is_nested(v) for v in values):
        return "nested values (lists/structs)"
    return f"{type(values.iloc[0]).__name__} values"


class NonText:
    """``describe_non_text`` over a column read in chunks: what it holds when no chunk held text."""

    def __init__(self):
        self.text = False  # some chunk held a text value
        self.what: str | None = None  # the first chunk's description of what it held instead

    def update(self, series: pd.Series) -> None:
        if self.text:
            return
        what = describe_non_text(series)
        if what is None:
            self.text = bool(series.notna().any())
        elif self.what is None:
            self.what = what

    @property
    def result(self) -> str | None:
        return None if self.text else self.what


def is_nested(value) -> bool:
    return isinstance(value, (list, tuple, dict, np.ndarray))


def check_table(
    rows: int, text: dict[str, NonText], spec, source: str, field: str, *, rows_fix: str, text_fix: str
) -> None:
    """The checks over a whole table read in chunks, shared by the tasks' normalizers: it has rows
    (``rows`` read), and each text column (``text`` keyed by its spec key, data.KEY) held text in
    some chunk. ``text_fix`` may name the key as ``{key}``.

    Raises:
        KubetuneError: the first that fails, naming the field, what the column holds and the fix.
    """
    if rows == 0:
        raise KubetuneError(f"{source} has no rows", field=field, fix=rows_fix)
    for key, check in text.items():
        if what := check.result:
            raise KubetuneError(
                f"column '{short(getattr(spec, key), 40)}' of {short(source)} holds {what}, not text",
                field=f"data.{key}",
                fix=text_fix.format(key=key),
            )
