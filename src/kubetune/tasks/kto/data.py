"""KTO's data: unpaired examples (a prompt, an answer and whether the answer is desirable) in TRL's conventions, or
preference pairs unpaired as TRL's KTOTrainer unpairs them (the chosen answer desirable, the rejected one not);
text or chat, checked, normalized chunk by chunk into flat memory and split (``data.rows``). Each example is a
``record``: JSON text of its prompt, completion and label. Tokenized as TRL tokenizes them: the prompt, and prompt +
completion (text: joined as strings, the completion ending with EOS; chat: the template, the prompt with the
generation prompt); the completion starts where its tokens leave the prompt's."""

from __future__ import annotations

import json
import logging

import pandas as pd

from kubetune.data.columns import NonText
from kubetune.data.rows import RowSplit, read_split
from kubetune.data.tables import short
from kubetune.errors import KubetuneError
from kubetune.providers import S3Settings
from kubetune.tasks.common import RecordNormalizer, as_messages, cell_messages
from kubetune.tasks.pairs import pair_record, shared_prefix

log = logging.getLogger(__name__)

TRUE, FALSE = ("true", "1", "yes", "y", "t", "1.0"), ("false", "0", "no", "n", "f", "0.0")


def load_frames(spec, seed: int, s3: S3Settings = S3Settings()) -> RowSplit:
    """Read, check, normalize and split KTO's examples in flat memory (``data.rows``; s3:// data reached with ``s3``).

    Raises:
        KubetuneError: a missing column, a column without text or messages, a label that is not boolean-like,
            malformed messages, no usable example, or only one kind of label.
    """
    settings = json.dumps(
        ["kto", spec.format, spec.prompt_column, spec.completion_column, spec.label_column, spec.chosen_column,
         spec.rejected_column, spec.system_prompt]
    )  # fmt: skip
    return read_split(
        spec, seed, s3, normalizer=lambda field, train: _Normalizer(spec, field, train), settings=settings
    )


def label(value, i: int, source: str, spec) -> bool | None:
    """A label cell as desirable (True) or not; None for an empty cell.

    Raises:
        KubetuneError: a value that is not boolean-like."""
    if value is None or (isinstance(value, float) and value != value):
        return None
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE:
        return True
    if text in FALSE:
        return False
    raise KubetuneError(
        f"row {i} of {short(source)}: column '{short(spec.label_column, 40)}' holds {short(repr(value), 40)}, not a "
        "desirable flag",
        field="data.label_column",
        fix="give true/false (or 1/0, yes/no) in that column: true for a desirable answer",
    )


class _Normalizer(RecordNormalizer):
    """A KTO table, chunk by chunk (``data.rows.Normalizer``): unpaired (prompt, completion, label) or paired
    (prompt, chosen, rejected: two examples each), its format detected on data.train's first chunk."""

    def __init__(self, spec, field_name: str, train_facts: dict | None):
        super().__init__(spec, field_name, train_facts)
        self.paired: bool | None = None
        self.columns: list | None = None
        self.dropped = 0
        self.labels = {True: 0, False: 0}

    def chunk(self, df: pd.DataFrame, start: int) -> dict[str, list]:
        spec = self.spec
        if self.columns is None:
            self.columns = list(df.columns)
            self.paired = spec.completion_column not in df.columns and {
                spec.chosen_column,
                spec.rejected_column,
            } <= set(df.columns)
            self.fmt = self.fmt or self._detect(df)
            for key, col in self._needed().items():
                if col not in df.columns:
                    raise KubetuneError(
                        f"column '{short(col, 40)}' not found in {short(self.source)}; columns are "
                        f"{[short(c, 40) for c in df.columns[:20]]}",
                        field=f"data.{key}",
                        fix=f"set data.{key} to the column that holds the "
                        + {"prompt_column": "prompt", "completion_column": "answer"}.get(key, "desirable flag"),
                    )
        df = df.reindex(columns=list(dict.fromkeys([*df.columns, *self.columns])))
        self.rows += len(df)
        if self.fmt == "text":
            for key, col in self._needed().items():
                if key != "label_column":
                    self.non_text.setdefault(key, NonText()).update(df[col])
        records = []
        for i, row in enumerate(df.to_dict("records")):
            for record in self._records(row, start + i):
                if record is None:
                    self.dropped += 1
                else:
                    self.labels[record["label"]] += 1
                    records.append(json.dumps(record))
        return {"record": records}

    def _detect(self, df: pd.DataFrame) -> str:
        if self.spec.format != "auto":
            return self.spec.format
        col = self.spec.chosen_column if self.paired else self.spec.completion_column
        values = df[col].dropna() if col in df.columns else pd.Series([], dtype=object)
        return "chat" if len(values) and as_messages(values.iloc[0]) is not None else "text"

    def _needed(self) -> dict[str, str]:
        spec = self.spec
        if self.paired:
            return {"chosen_column": spec.chosen_column, "rejected_column": spec.rejected_column}
        return {
            "prompt_column": spec.prompt_column,
            "completion_column": spec.completion_column,
            "label_column": spec.label_column,
        }

    def _records(self, row: dict, i: int) -> list[dict | None]:
        spec = self.spec
        if self.paired:  # TRL's unpair_preference_dataset: the chosen answer desirable, the rejected one not
            assert self.fmt is not None  # set by the first chunk
            pair = pair_record(row, spec, self.fmt, self.source, i)
            if pair is None:
                return [None]
            return [
                {"prompt": pair["prompt"], "completion": pair["chosen"], "label": True},
                {"prompt": pair["prompt"], "completion": pair["rejected"], "label": False},
            ]
        flag = label(row[spec.label_column], i, self.source, spec)
        if self.fmt == "text":
            prompt, completion = row[spec.prompt_column], row[spec.completion_column]
            ok = all(isinstance(v, str) and v.strip() for v in (prompt, completion))
            return [{"prompt": prompt, "completion": completion, "label": flag} if ok and flag is not None else None]
        prompt = cell_messages(
            row[spec.prompt_column], "user", "data.prompt_column", spec.prompt_column, self.source, i
        )
        completion = cell_messages(
            row[spec.completion_column], "assistant", "data.completion_column", spec.completion_column, self.source, i
        )
        if not prompt or not completion or flag is None:
            return [None]
        if spec.system_prompt and prompt[0]["role"] != "system":
            prompt = [{"role": "system", "content": spec.system_prompt}, *prompt]
        return [{"prompt": prompt, "completion": completion, "label": flag}]

    def finish(self, kept: int) -> dict:
        self.check_read("set data.{key} to a text column, or data.format: chat for message lists")
        if self.dropped:
            log.warning(
                "%s: dropped %d examples with a missing or empty prompt, answer or label", self.field_name, self.dropped
            )
        if not kept:
            raise KubetuneError(
                f"no usable examples in {self.source} (format {self.fmt})",
                field=self.field_name,
                fix="check the data and the data.*_column settings",
            )
        if self.field_name == "data.train" and not all(self.labels.values()):
            which = "desirable" if self.labels[True] else "undesirable"
            raise KubetuneError(
                f"every one of the {kept} examples in {short(self.source)} is {which}: KTO learns from both kinds",
                field="data.label_column",
                fix="add examples of the other kind, or check data.label_column",
            )
        return {"format": self.fmt, "dropped": self.dropped, "rows": self.rows, "paired": self.paired}


def encode(frame: pd.DataFrame, tokenizer, max_length: int) -> dict[str, list]:
    """Token ids of each example as TRL's KTOTrainer makes them. Columns prompt_ids, completion_ids, label,
    length (prompt + completion, up to ``max_length``)."""
    cols: dict[str, list] = {"prompt_ids": [], "completion_ids": [], "label": [], "length": []}
    eos = tokenizer.eos_token or ""
    for rec in frame["record"]:
        r = json.loads(rec)
        if isinstance(r["prompt"], str):
            completion = r["completion"] if r["completion"].endswith(eos) else r["completion"] + eos
            prompt_ids = tokenizer(r["prompt"])["input_ids"]
            full = tokenizer(r["prompt"] + completion)["input_ids"]
        else:
            prompt_ids = _chat_ids(tokenizer, r["prompt"], add_generation_prompt=True)
            full = _chat_ids(tokenizer, r["prompt"] + r["completion"])
        n = shared_prefix(prompt_ids, full)
        cols["prompt_ids"].append(prompt_ids[:n])
        cols["completion_ids"].append(full[n:])
        cols["label"].append(int(bool(r["label"])))  # 1 desirable, 0 not (the token columns are int64)
        cols["length"].append(min(max_length, len(full)))
    return cols


def _chat_ids(tokenizer, messages: list[dict], add_generation_prompt: bool = False) -> list[int]:
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=True
    )
    return list(out["input_ids"])
