"""Preference pairs as the tasks that learn from them read them (DPO, reward modelling, ORPO): TRL's conventions,
text (prompt, chosen and rejected strings) or chat (message lists, the prompt possibly implicit in the answers'
shared turns), checked, normalized chunk by chunk into flat memory and split (``data.rows``). Each pair is a
``record``: JSON text of its prompt, chosen and rejected answers, and the pair's numeric columns a task asks for
(a reward model's margin). Shared by the tasks (``tasks/README.md``: what two tasks share is public, outside
either); each task tokenizes the records its own way."""

from __future__ import annotations

import json
import logging
import math

import numpy as np
import pandas as pd
import pyarrow.compute as pc

from kubetune.data.columns import NonText
from kubetune.data.rows import RowSplit, read_split
from kubetune.data.tables import short
from kubetune.errors import KubetuneError
from kubetune.providers import S3Settings
from kubetune.tasks.common import RecordNormalizer, as_messages, cell_messages

log = logging.getLogger(__name__)
# The largest finite float32: a task's numbers (a reward model's margin) are float32 in its loss
FLOAT32_MAX = float(np.finfo(np.float32).max)


def load_pair_frames(spec, seed: int, s3: S3Settings = S3Settings(), numbers: dict[str, str] | None = None) -> RowSplit:
    """Read, check, normalize and split preference pairs in flat memory (``data.rows``; s3:// data
    reached with ``s3``): each pair a ``record``, JSON text of its prompt, chosen and rejected answers.
    ``spec``: a data section with format, prompt_column, chosen_column, rejected_column and system_prompt.
    ``numbers``: record key -> the data.* field naming a numeric column each pair also carries (a reward
    model's {"margin": "margin_column"}; a field set to None: no such column).

    Raises:
        KubetuneError: a missing column, a column without text or messages, malformed messages, a numeric
            column holding something else than numbers, no usable pair.
    """
    numbers = {key: f for key, f in (numbers or {}).items() if getattr(spec, f, None)}
    settings = json.dumps(
        ["pairs", spec.format, spec.prompt_column, spec.chosen_column, spec.rejected_column, spec.system_prompt,
         {key: getattr(spec, f) for key, f in numbers.items()}]
    )  # fmt: skip
    if getattr(spec, "streaming", False):  # data.train is listed (a missing or unreadable prefix fails here), not read
        from kubetune.data.stream import list_shards

        list_shards(spec.train, field="data.train", s3=s3)
    return read_split(
        spec, seed, s3, normalizer=lambda field, train: _Normalizer(spec, field, train, numbers), settings=settings
    )


def shard_normalizer(spec):
    """The normalizer of one streamed shard of data.train (``data.stream.Stream``): its format detected
    on its own first chunk (or data.format), its pairs checked as a table's (DPO's: no numeric columns)."""
    return lambda shard: _Normalizer(spec, "data.train", None, {})


def _detect_format(df: pd.DataFrame, spec) -> str:
    if spec.format != "auto":
        return spec.format
    if spec.chosen_column not in df.columns:
        return "text"  # _normalize names the missing column
    values = df[spec.chosen_column].dropna()
    return "chat" if len(values) and as_messages(values.iloc[0]) is not None else "text"


class _Normalizer(RecordNormalizer):
    """A preference table, chunk by chunk (``data.rows.Normalizer``): the format detected on data.train's
    first chunk, the columns checked on it, each row made a pair or dropped (and why counted)."""

    def __init__(self, spec, field_name: str, train_facts: dict | None, numbers: dict[str, str]):
        super().__init__(spec, field_name, train_facts)
        self.numbers = numbers
        self.columns: list | None = None  # the first chunk's: a later chunk of JSON lines may lack some
        self.reasons = {"missing": 0, "same": 0, "no number": 0}

    def chunk(self, df: pd.DataFrame, start: int) -> dict[str, list]:
        spec = self.spec
        if self.columns is None:
            self.fmt = self.fmt or _detect_format(df, spec)
            self.columns = list(df.columns)
            for key, col in self._needed().items():
                if col not in df.columns:
                    hint = f" (data.format {'auto-detected as ' if spec.format == 'auto' else ''}{self.fmt})"
                    raise KubetuneError(
                        f"column '{short(col, 40)}' not found in {short(self.source)}{hint}; "
                        f"columns are {[short(c, 40) for c in df.columns[:20]]}",
                        field=f"data.{key}",
                        fix=f"set data.{key} to the column that holds the "
                        + {"prompt_column": "prompt", "chosen_column": "preferred answer"}.get(
                            key, "dispreferred answer"
                        ),
                    )
        assert self.fmt is not None and self.columns is not None  # set by the first chunk
        df = df.reindex(columns=list(dict.fromkeys([*df.columns, *self.columns])))
        self.rows += len(df)
        if self.fmt == "text":  # the text columns only: a numeric column (a margin) holds numbers, as it should
            numeric = set(self.numbers.values())
            for key, col in self._needed().items():
                if key not in numeric:
                    self.non_text.setdefault(key, NonText()).update(df[col])
        records = []
        for i, row in enumerate(df.to_dict("records")):
            record = pair_record(row, spec, self.fmt, self.source, start + i)
            if record is not None and record["chosen"] == record["rejected"]:
                self.reasons["same"] += 1  # no preference to learn: its loss is constant
            elif record is None:
                self.reasons["missing"] += 1
            elif not self._numbers(row, record, start + i):
                self.reasons["no number"] += 1
            else:
                records.append(json.dumps(record))
        return {"record": records}

    def _numbers(self, row: dict, record: dict, i: int) -> bool:
        """The pair's numeric columns into its record; False for an empty cell (the pair is dropped, counted)."""
        for key, f in self.numbers.items():
            col, value = getattr(self.spec, f), row.get(getattr(self.spec, f))
            if value is None or (isinstance(value, float) and math.isnan(value)):
                return False
            try:
                number = float(value)
            except (TypeError, ValueError):
                number = float("nan")
            if isinstance(value, bool) or not math.isfinite(number):
                raise KubetuneError(
                    f"row {i} of {short(self.source)}: column '{short(col, 40)}' holds {short(repr(value), 40)}, not a "
                    "number",
                    field=f"data.{f}",
                    fix=f"give numbers in '{short(col, 40)}' (empty cells drop their pair), or unset data.{f}",
                )
            # the loss is float32: 1e39 would be inf there (a non-finite loss), -1e39 -inf (the pair's loss 0)
            if abs(number) > FLOAT32_MAX:
                raise KubetuneError(
                    f"row {i} of {short(self.source)}: column '{short(col, 40)}' holds {short(repr(value), 40)}, "
                    f"beyond float32's range (±{FLOAT32_MAX:.4g}), in which the loss is computed",
                    field=f"data.{f}",
                    fix=f"give numbers within ±{FLOAT32_MAX:.4g} in '{short(col, 40)}' (a margin is a difference of "
                    "rewards, a few units)",
                )
            record[key] = number
        return True

    def _needed(self) -> dict[str, str]:
        spec = self.spec
        needed = {"chosen_column": spec.chosen_column, "rejected_column": spec.rejected_column}
        if self.fmt == "text" or spec.prompt_column in (self.columns or []):  # chat: the prompt may be implicit
            needed = {"prompt_column": spec.prompt_column, **needed}
        return {**needed, **{f: getattr(spec, f) for f in self.numbers.values()}}

    def finish(self, kept: int) -> dict:
        self.check_read("set data.{key} to a text column, or data.format: chat for message lists")
        n_drop = sum(self.reasons.values())
        if n_drop:
            log.warning(
                "%s: dropped %d of %d pairs (%d with a missing or empty prompt or answer, %d whose chosen and "
                "rejected answers are the same%s)",
                self.field_name,
                n_drop,
                self.rows,
                self.reasons["missing"],
                self.reasons["same"],
                f", {self.reasons['no number']} with an empty {'/'.join(self.numbers)}" if self.numbers else "",
            )
        if not kept:
            raise KubetuneError(
                f"no usable preference pairs in {self.source} (format {self.fmt})",
                field=self.field_name,
                fix="check the data and the data.*_column settings",
            )
        return {"format": self.fmt, "dropped": n_drop, "rows": self.rows}


def _text(value) -> str | None:
    return value if isinstance(value, str) and value.strip() else None


def pair_record(row: dict, spec, fmt: str, source: str = "rows", i: int = 0) -> dict | None:
    """One table row as a pair {prompt, chosen, rejected} in format ``fmt`` (text or chat); None when its prompt
    or an answer is missing or empty.

    Raises:
        KubetuneError: malformed messages, or (chat) answers without a prompt and no prompt column.
    """
    return _text_record(row, spec) if fmt == "text" else _chat_record(row, spec, source, i)


def _text_record(row: dict, spec) -> dict | None:
    prompt = row[spec.prompt_column]
    chosen, rejected = _text(row[spec.chosen_column]), _text(row[spec.rejected_column])
    if not _text(prompt) or not chosen or not rejected:  # an empty prompt is dropped, as the warning says
        return None
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def _chat_record(row: dict, spec, source: str, i: int) -> dict | None:
    """{prompt, chosen, rejected} message lists. Strings become a user turn (prompt) or an assistant
    turn (answers). Answers that start with a turn not the assistant's hold the whole conversation:
    the prompt is then the turns they share (TRL's implicit prompt), else the prompt column's."""
    chosen = cell_messages(row[spec.chosen_column], "assistant", "data.chosen_column", spec.chosen_column, source, i)
    rejected = cell_messages(
        row[spec.rejected_column], "assistant", "data.rejected_column", spec.rejected_column, source, i
    )
    if not chosen or not rejected:
        return None
    prompt: list[dict] | None
    if chosen[0]["role"] != "assistant" or rejected[0]["role"] != "assistant":
        n = min(shared_prefix(chosen, rejected), len(chosen) - 1, len(rejected) - 1)
        prompt, chosen, rejected = chosen[:n], chosen[n:], rejected[n:]
    elif spec.prompt_column in row:
        prompt = cell_messages(row[spec.prompt_column], "user", "data.prompt_column", spec.prompt_column, source, i)
        if prompt is None:
            return None
    else:
        raise KubetuneError(
            f"row {i} of {short(source)}: the answers hold no prompt and there is no column '{spec.prompt_column}'",
            field="data.prompt_column",
            fix="set data.prompt_column, or store whole conversations (prompt turns first) in the answer columns",
        )
    if not any(_text(m.get("content")) for m in prompt):  # an empty prompt is dropped, as the warning says
        return None
    if spec.system_prompt and (not prompt or prompt[0]["role"] != "system"):
        prompt = [{"role": "system", "content": spec.system_prompt}, *prompt]
    return {"prompt": prompt, "chosen": chosen, "rejected": rejected}


def shared_prefix(a: list, b: list) -> int:
    """How many leading items ``a`` and ``b`` share (os.path.commonprefix orders its items, which
    message dicts cannot be)."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


def with_answers(ds, dropped: dict, key: str, max_length: int):
    """The tokenized pairs (a ``prompt_ids`` column) whose prompt leaves an answer token within ``max_length``; the
    others counted in ``dropped[key]`` (``train_truncated`` / ``eval_truncated``). A pair whose prompt alone fills
    data.max_length keeps no answer token (TRL drops it too).

    Raises:
        KubetuneError: no pair is left.
    """
    # from the Arrow column, without a Python list of every prompt's ids
    prompt_lengths = pc.list_value_length(ds.with_format("arrow")["prompt_ids"]).to_numpy()
    keep = np.flatnonzero(prompt_lengths < max_length)
    if len(keep) == len(ds):
        return ds
    dropped[key] = len(ds) - len(keep)
    split = key.split("_")[0]  # train | eval
    log.warning(
        "%d %s pairs have prompts of data.max_length %d tokens or more; they are skipped",
        dropped[key],
        split,
        max_length,
    )
    if len(keep) == 0:
        raise KubetuneError(
            f"every prompt of the {len(ds)} {split} pairs takes {max_length} tokens or more, which leaves no "
            "answer token",
            field="data.max_length",
            fix="raise data.max_length, or check data.prompt_column"
            + (", or give data.eval pairs with shorter prompts" if split == "eval" else ""),
        )
    return ds.select(keep)
