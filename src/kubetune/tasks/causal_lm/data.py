"""Causal-LM data: text, instruction (alpaca) and chat rows → token ids with response-only labels.

Every row becomes a conversation (``messages``) or a plain document (``text``). Conversations are
rendered with the tokenizer's chat template (``tasks.common.FALLBACK_CHAT_TEMPLATE`` when it has none); the
characters of each assistant turn are located by rendering the conversation up to that turn, and
tokens whose first character falls inside an assistant turn get labels, every other token -100
(unless ``data.train_on_prompt``). Plain documents are all response.
"""

from __future__ import annotations

import bisect
import json
import logging
from operator import itemgetter
from typing import cast

import numpy as np
import pandas as pd
import torch

from kubetune.data import Batch
from kubetune.data.columns import NonText
from kubetune.data.rows import RowSplit, read_split
from kubetune.data.tables import short
from kubetune.errors import KubetuneError
from kubetune.providers import S3Settings
from kubetune.tasks.attention import packed_layout
from kubetune.tasks.causal_lm import CausalLMData
from kubetune.tasks.common import FALLBACK_CHAT_TEMPLATE, IGNORE, ROLES, RecordNormalizer, label_targets

log = logging.getLogger(__name__)


def load_lm_frames(spec: CausalLMData, seed: int, s3: S3Settings = S3Settings()) -> RowSplit:
    """Read, normalize and split causal-LM data in flat memory (``data.rows``; read as ``read_table``
    reads: "None" or "NA" is text; s3:// data reached with ``s3``): each row becomes a ``record``,
    JSON text of its document or messages.

    Raises:
        KubetuneError: missing columns, a text column that holds no text, malformed messages, no usable rows.
    """
    settings = json.dumps(
        [
            "causal-lm",
            spec.format,
            spec.text_column,
            spec.instruction_column,
            spec.input_column,
            spec.output_column,
            spec.messages_column,
            spec.system_prompt,
        ]
    )
    if spec.streaming:  # data.train is listed (a missing or unreadable prefix fails here), not read
        from kubetune.data.stream import list_shards

        list_shards(spec.train, field="data.train", s3=s3)
    return read_split(
        spec, seed, s3, normalizer=lambda field, train: _Normalizer(spec, field, train), settings=settings
    )


def shard_normalizer(spec: CausalLMData):
    """The normalizer of one streamed shard of data.train (``data.stream.Stream``): its format detected
    on its own first chunk (or data.format), its rows checked as a table's."""
    return lambda shard: _Normalizer(spec, "data.train", None)


def detect_format(df: pd.DataFrame, spec: CausalLMData) -> str:
    if spec.format != "auto":
        return spec.format
    if spec.messages_column in df.columns:
        return "chat"
    if spec.instruction_column in df.columns and spec.output_column in df.columns:
        return "instruction"
    return "text"


class _Normalizer(RecordNormalizer):
    """A causal-LM table, chunk by chunk (``data.rows.Normalizer``): the format detected on data.train's
    first chunk, the columns checked on every chunk's, each row made a record or dropped."""

    spec: CausalLMData

    def __init__(self, spec: CausalLMData, field_name: str, train_facts: dict | None):
        super().__init__(spec, field_name, train_facts)
        self.dropped = 0

    def _needed(self) -> dict[str, str]:
        spec = self.spec
        return {
            "text": {"text_column": spec.text_column},
            "instruction": {"instruction_column": spec.instruction_column, "output_column": spec.output_column},
            "chat": {"messages_column": spec.messages_column},
        }[self.fmt or ""]

    def chunk(self, df: pd.DataFrame, start: int) -> dict[str, list]:
        spec = self.spec
        if self.fmt is None:
            self.fmt = detect_format(df, spec)
        needed = self._needed()
        if start == 0:
            for key, col in needed.items():
                if col not in df.columns:
                    hint = "" if spec.format != "auto" else f" (data.format auto-detected as {self.fmt})"
                    raise KubetuneError(
                        f"column '{short(col, 40)}' not found in {short(self.source)}{hint}; "
                        f"columns are {[short(c, 40) for c in df.columns[:20]]}",
                        field=f"data.{key}",
                        fix=f"set data.{key}" + (" or data.format" if spec.format == "auto" else ""),
                    )
        # A later chunk whose rows all lack a key of JSON lines has no such column: its values are missing.
        df = df.reindex(columns=list(dict.fromkeys([*df.columns, *needed.values()])))
        for key, col in needed.items():
            if key != "messages_column":
                self.non_text.setdefault(key, NonText()).update(df[col])
        self.rows += len(df)
        records = [_record(row, spec, self.fmt, self.source, start + i) for i, row in enumerate(df.to_dict("records"))]
        kept = [r for r in records if r is not None]
        self.dropped += len(records) - len(kept)
        return {"record": kept}

    def finish(self, kept: int) -> dict:
        self.check_read("set data.{key} to the text column")
        if self.dropped:
            log.warning(
                "%s: dropped %d of %d rows with a missing/empty text, instruction, output or assistant turn",
                self.field_name,
                self.dropped,
                self.rows,
            )
        if not kept:
            raise KubetuneError(
                f"no usable rows in {self.source} (format {self.fmt})",
                field=self.field_name,
                fix="check the data and the data.*_column settings",
            )
        return {"format": self.fmt, "dropped": self.dropped, "rows": self.rows}


def _text(value) -> str | None:
    if isinstance(value, str) and value.strip():
        return value
    return None


def _record(row: dict, spec: CausalLMData, fmt: str, source: str, i: int) -> str | None:
    """One row as JSON: ``{"text": ...}`` or ``{"messages": [...]}``; None when the row is unusable."""
    if fmt == "text":
        text = _text(row[spec.text_column])
        return json.dumps({"text": text}) if text else None
    messages: list[dict] | None
    if fmt == "instruction":
        instruction, output = _text(row[spec.instruction_column]), _text(row[spec.output_column])
        if not instruction or not output:
            return None
        extra = _text(row.get(spec.input_column)) if spec.input_column else None
        messages = [
            {"role": "user", "content": instruction + (f"\n\n{extra}" if extra else "")},
            {"role": "assistant", "content": output},
        ]
    else:
        messages = _messages(row[spec.messages_column], spec, source, i)
        if messages is None:
            return None
    if spec.system_prompt and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": spec.system_prompt}, *messages]
    return json.dumps({"messages": messages})


def _messages(value, spec: CausalLMData, source: str, i: int) -> list[dict] | None:
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            raise KubetuneError(
                f"row {i} of {source}: column '{spec.messages_column}' holds text that is not a JSON list of messages",
                field="data.messages_column",
                fix="store a list of {role, content} objects per row",
            ) from None
    if value is None or (isinstance(value, float) and np.isnan(value)):
        return None
    if isinstance(value, np.ndarray):  # Parquet / Arrow lists
        value = value.tolist()
    if not isinstance(value, list) or not all(isinstance(m, dict) and "role" in m and "content" in m for m in value):
        raise KubetuneError(
            f"row {i} of {source}: '{spec.messages_column}' must be a list of "
            f"{{role, content}} objects, got {str(value)[:60]!r}",
            field="data.messages_column",
            fix='store a list like [{"role": "user", "content": "..."}, {"role": "assistant", ...}]',
        )
    messages = []
    for m in value:
        role, content = str(m["role"]), m["content"]
        if role not in ROLES:
            raise KubetuneError(
                f"row {i} of {source}: unknown message role {role!r}",
                field="data.messages_column",
                fix=f"use one of {list(ROLES)}",
            )
        if not isinstance(content, str):
            return None
        messages.append({"role": role, "content": content})
    if not any(m["role"] == "assistant" and m["content"].strip() for m in messages):
        return None  # nothing to learn from
    return messages


# ---------------------------------------------------------------- tokenization


def assistant_spans(tokenizer, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
    """The rendered conversation and the character spans of its assistant turns.

    A turn's span runs from the end of the conversation rendered up to it with the generation
    prompt, to the end of the conversation rendered through it (its end-of-turn token included,
    so the model learns to stop).
    """
    return assistant_spans_batch(tokenizer, [messages])[0]


def _render(tokenizer, conversations: list[list[dict]], **kwargs) -> list[str]:
    """``apply_chat_template`` of many conversations in one call (its per-call work paid once: a third
    less time than a call per conversation), the same strings."""
    return tokenizer.apply_chat_template(conversations, tokenize=False, **kwargs) if conversations else []


def assistant_spans_batch(tokenizer, conversations: list[list[dict]]) -> list[tuple[str, list[tuple[int, int]]]]:
    """``assistant_spans`` of each conversation: written directly where the tokenizer's template is
    ``FALLBACK_CHAT_TEMPLATE`` (``_fallback_spans``: the same strings and spans without jinja, whose
    three renders per conversation were a quarter of the tokenization's time), else rendered
    (``_rendered_spans``)."""
    if _fallback_tokens(tokenizer) is not None and all(_plain(m) for c in conversations for m in c):
        return _fallback_spans(tokenizer, conversations)
    return _rendered_spans(tokenizer, conversations)


def _fallback_tokens(tokenizer) -> tuple[str, str] | None:
    """(BOS, EOS) as ``FALLBACK_CHAT_TEMPLATE`` renders them, when it is the tokenizer's template and both
    are text (a missing one renders as jinja's undefined: left to jinja)."""
    bos, eos = getattr(tokenizer, "bos_token", None), getattr(tokenizer, "eos_token", None)
    if getattr(tokenizer, "chat_template", None) != FALLBACK_CHAT_TEMPLATE or type(bos) is not str:
        return None
    return (bos, eos) if type(eos) is str else None


def _plain(message: dict) -> bool:
    """A message the template renders as its role and content verbatim: both exact text."""
    return type(message.get("role")) is str and type(message.get("content")) is str


def _fallback_spans(tokenizer, conversations: list[list[dict]]) -> list[tuple[str, list[tuple[int, int]]]]:
    """``_rendered_spans`` for ``FALLBACK_CHAT_TEMPLATE``, written as it renders: BOS, then per message
    ``<|role|>\\n`` and its content, ended by EOS (assistant) or a newline. An assistant turn's span starts
    after its header (the conversation before it rendered with the generation prompt; at 0 for a first
    turn) and ends after its EOS."""
    tokens = _fallback_tokens(tokenizer)
    assert tokens is not None  # assistant_spans_batch checked it
    bos, eos = tokens
    out = []
    for messages in conversations:
        parts, spans, pos = [bos], [], len(bos)
        for k, m in enumerate(messages):
            role, content = m["role"], m["content"]
            head = f"<|{role}|>\n"
            end_mark = eos if role == "assistant" else "\n"
            start = pos + len(head)
            pos = start + len(content) + len(end_mark)
            if role == "assistant":
                spans.append((start if k else 0, pos))
            parts += (head, content, end_mark)
        out.append(("".join(parts), spans))
    return out


def _rendered_spans(tokenizer, conversations: list[list[dict]]) -> list[tuple[str, list[tuple[int, int]]]]:
    """``assistant_spans`` of each conversation, the chat template rendered in three batched calls: the
    conversations, the prefixes before each assistant turn (with the generation prompt), and the
    conversations through each assistant turn but the last (rendered through it is the whole
    conversation: rendering is deterministic, one render less)."""
    turns = [
        (c, k) for c, messages in enumerate(conversations) for k, m in enumerate(messages) if m["role"] == "assistant"
    ]
    full = _render(tokenizer, conversations)
    before = iter(_render(tokenizer, [conversations[c][:k] for c, k in turns if k], add_generation_prompt=True))
    through = iter(_render(tokenizer, [conversations[c][: k + 1] for c, k in turns if k != len(conversations[c]) - 1]))
    spans: list[list[tuple[int, int]]] = [[] for _ in conversations]
    for c, k in turns:
        messages, text, done = conversations[c], full[c], spans[c]
        start = len(next(before)) if k else 0
        rendered = text if k == len(messages) - 1 else next(through)
        if not text.startswith(rendered):
            # Some templates render the last turn specially; fall back to locating the content.
            pos = text.find(messages[k]["content"], done[-1][1] if done else 0)
            if pos < 0:
                raise KubetuneError(
                    "the chat template does not reproduce assistant turns verbatim",
                    field="model.uri",
                    fix="use a tokenizer whose chat template keeps message text, or data.format: text",
                )
            done.append((pos, pos + len(messages[k]["content"])))
        else:
            done.append((start, len(rendered)))
    return list(zip(full, spans))


def encode_record(record: dict, tokenizer, max_length: int, train_on_prompt: bool) -> tuple[list[int], list[int]]:
    """Token ids and labels (-100 where no loss) of one normalized record, truncated to ``max_length``."""
    if "text" in record:
        ids = tokenizer(record["text"], add_special_tokens=True)["input_ids"]
        if tokenizer.eos_token_id is not None:
            ids = ids + [tokenizer.eos_token_id]  # documents end: the model learns where to stop
        ids = ids[:max_length]
        return ids, list(ids)
    text, spans = assistant_spans(tokenizer, record["messages"])
    # The template already holds BOS and the turn markers.
    enc = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    return _with_labels(enc["input_ids"], enc["offset_mapping"], spans, max_length, train_on_prompt)


def _with_labels(ids: list[int], offsets, spans, max_length: int, train_on_prompt: bool):
    """(ids, labels) cut to ``max_length``: a token's label is itself when its first character falls
    inside an assistant span (or ``train_on_prompt``), else IGNORE."""
    return _labelled(ids, offsets, spans, max_length, train_on_prompt)[:2]


def _labelled(ids: list[int], offsets, spans, max_length: int, train_on_prompt: bool) -> tuple[list, list, int]:
    """``_with_labels``, and the number of labels set beyond the first position (``n_targets``).

    Where the tokens' start characters never decrease (a tokenizer's offsets do, token after token), the
    tokens inside each span are one run found by bisection and the labels are list slices: a fifth of the
    tokenization's time went to the per-token mask (``_labelled_mask``, which other offsets still take)."""
    ids = ids[:max_length]
    if train_on_prompt:
        return ids, list(ids), max(len(ids) - 1, 0)
    starts = list(map(itemgetter(0), offsets[:max_length]))
    if not spans or starts != sorted(starts):  # sorted: a linear pass over a list already in order
        return _labelled_mask(ids, starts, spans)
    labels = [IGNORE] * len(ids)
    targets = 0
    for a, b in spans:
        lo, hi = bisect.bisect_left(starts, a), bisect.bisect_left(starts, b)
        labels[lo:hi] = ids[lo:hi]
        targets += max(0, hi - max(lo, 1))
    if len(spans) > 1:  # spans that overlap count their shared tokens once, as the mask does
        targets = sum(1 for label in labels[1:] if label != IGNORE)
    return ids, labels, targets


def _labelled_mask(ids: list[int], starts: list[int], spans) -> tuple[list, list, int]:
    """``_labelled`` token by token: a token is labelled when its start falls inside any span."""
    first = np.asarray(starts, dtype=np.int64)
    inside = np.zeros(len(ids), dtype=bool)
    for a, b in spans:
        inside |= (first >= a) & (first < b)
    return ids, np.where(inside, np.asarray(ids, dtype=np.int64), IGNORE).tolist(), int(inside[1:].sum())


def _encode_with_offsets(tokenizer, texts: list[str]) -> list[tuple[list[int], list[tuple[int, int]]]]:
    """(ids, character offsets) of each text without special tokens: the Rust tokenizer's own batch
    call where it has no truncation or padding configured (what transformers' call runs too, without
    converting every encoding into a dict of lists: 15% of the tokenization's time), else transformers'."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is not None and backend.truncation is None and backend.padding is None:
        return [(e.ids, e.offsets) for e in backend.encode_batch(texts, add_special_tokens=False)]
    enc = tokenizer(texts, add_special_tokens=False, return_offsets_mapping=True)
    return list(zip(enc["input_ids"], enc["offset_mapping"]))


def tokenize_frame(frame: pd.DataFrame, tokenizer, max_length: int, train_on_prompt: bool) -> dict[str, list]:
    """Columns input_ids, labels, length, n_targets (tokens that carry loss: label set, position > 0);
    ``encode_record`` row for row, with the tokenizer called once for the frame's documents and once
    for its conversations (the Rust tokenizer's batch call: the same ids, less Python per row)."""
    if not getattr(tokenizer, "is_fast", False):
        raise KubetuneError(
            "causal-lm needs a fast (Rust) tokenizer to locate response tokens",
            field="model.uri",
            fix="use a model directory with tokenizer.json",
        )
    records = [json.loads(rec) for rec in frame["record"]]
    docs = [k for k, r in enumerate(records) if "text" in r]
    chats = [k for k, r in enumerate(records) if "text" not in r]
    out: list[tuple[list[int], list[int], int] | None] = [None] * len(records)
    if docs:
        eos = [tokenizer.eos_token_id] if tokenizer.eos_token_id is not None else []
        for k, ids in zip(docs, tokenizer([records[k]["text"] for k in docs], add_special_tokens=True)["input_ids"]):
            ids = (ids + eos)[:max_length]  # documents end: the model learns where to stop
            out[k] = ids, list(ids), max(len(ids) - 1, 0)
    if chats:
        rendered = assistant_spans_batch(tokenizer, [records[k]["messages"] for k in chats])
        encoded = _encode_with_offsets(tokenizer, [text for text, _ in rendered])
        for k, (ids, offsets), (_, spans) in zip(chats, encoded, rendered):
            out[k] = _labelled(ids, offsets, spans, max_length, train_on_prompt)
    done = cast("list[tuple[list[int], list[int], int]]", out)  # every record is a document or a chat: all set
    return {
        "input_ids": [row[0] for row in done],
        "labels": [row[1] for row in done],
        "length": [len(row[0]) for row in done],
        "n_targets": [row[2] for row in done],  # labels set beyond position 0 (a token id is never IGNORE)
    }


def collate(ds, indices: np.ndarray, pad_id: int, packing: bool = False) -> Batch:
    """Causal-LM micro-batch: right-padded rows, or with ``packing`` one row of the examples
    concatenated, with position ids restarting at 0 for each (transformers then builds a
    block-diagonal causal mask, so packed examples cannot attend to each other; it does so only
    when no attention mask and no KV cache are passed, hence ``use_cache=False`` in training).

    Labels are -100 on padding, on prompt tokens (set at tokenization) and, when packed, on each
    example's first token, which would otherwise be predicted from the previous example.
    An empty ``indices`` yields example 0 with ``weight`` 0, as in ``collate``.

    Built here on the host, where the lengths are known, so that the step reads nothing back from the device:
    the loss's targets (``Batch.targets``) and, packed, the row's attention layout (``Batch.layout``).
    """
    weight = 1.0
    if len(indices) == 0:
        indices, weight = np.zeros(1, dtype=np.int64), 0.0
    rows = ds[[int(i) for i in indices]]
    ids, labels = rows["input_ids"], rows["labels"]
    if packing:
        inputs = {
            "input_ids": torch.tensor([t for seq in ids for t in seq]).unsqueeze(0),
            "position_ids": torch.cat([torch.arange(len(seq)) for seq in ids]).unsqueeze(0),
        }
        targets = torch.tensor([-100 if j == 0 else t for seq in labels for j, t in enumerate(seq)]).unsqueeze(0)
        layout = packed_layout([len(seq) for seq in ids if seq], inputs["position_ids"]) if any(ids) else None
    else:
        width = max(len(seq) for seq in ids)
        inputs = {
            "input_ids": torch.tensor([seq + [pad_id] * (width - len(seq)) for seq in ids]),
            "attention_mask": torch.tensor([[1] * len(seq) + [0] * (width - len(seq)) for seq in ids]),
        }
        targets = torch.tensor([seq + [-100] * (width - len(seq)) for seq in labels])
        layout = None
    index = torch.as_tensor(indices, dtype=torch.long)
    return Batch(inputs, targets, weight, index, layout=layout, targets=label_targets(targets))
