"""Hostile and careless data (issue 13): each table row generates its input in tmp_path and checks
the one-line error, the warning or the loaded result. Unit-level and in-process: no workers start."""

from __future__ import annotations

import codecs
import functools
import io
import json
import logging
import os
import threading
import zipfile
from types import SimpleNamespace

import numpy as np
import pandas as pd
import pytest
import torch

from kubetune.data import read_table
from kubetune.errors import KubetuneError
from kubetune.tasks.causal_lm import CausalLMData
from kubetune.tasks.causal_lm.data import load_lm_frames
from kubetune.tasks.classify import ClassificationData
from kubetune.tasks.classify.data import load_frames

MAX_MESSAGE = 400  # characters: "one short line", whatever the input held


def _data(loader):
    """The data section's model that ``loader`` reads."""
    return CausalLMData if loader is load_lm_frames else ClassificationData


def _one_line(err: KubetuneError, *needles: str) -> str:
    msg = str(err)
    assert "\n" not in msg and len(msg) < MAX_MESSAGE, msg[:500]
    assert " — " in msg, msg  # every message says what to do
    for needle in needles:
        assert needle in msg, msg
    return msg


def _csv(rows: list[tuple], header=("text", "label")) -> bytes:
    buf = io.StringIO()
    pd.DataFrame(rows, columns=list(header)).to_csv(buf, index=False)
    return buf.getvalue().encode()


GOOD = [(f"some text number {i}", "pos" if i % 2 else "neg") for i in range(20)]


# ---------------------------------------------------------------- 1. class count


@pytest.mark.parametrize("n_labels, max_classes", [(10_000, None), (50, 20)])
def test_too_many_classes_is_one_line(tmp_path, n_labels, max_classes):
    path = tmp_path / "many.csv"
    path.write_bytes(_csv([(f"t{i}", f"id-{i}") for i in range(n_labels)]))
    spec = ClassificationData(train=str(path), **({"max_classes": max_classes} if max_classes else {}))
    with pytest.raises(KubetuneError) as e:
        load_frames(spec, seed=0)
    _one_line(
        e.value,
        "data.label_column:",
        f"{n_labels} distinct labels",
        f"data.max_classes ({max_classes or 1000})",
        "raise data.max_classes",
    )


# ---------------------------------------------------------------- 2. evaluation with many classes


class _PadTokenizer:
    def pad(self, features, return_tensors):
        width = max(len(x) for x in features["input_ids"])
        return {k: torch.tensor([x + [0] * (width - len(x)) for x in v]) for k, v in features.items()}


class _Guess(torch.nn.Module):
    """Predicts class input_ids[0] % L, with a confidence from input_ids[1]."""

    def __init__(self, num_labels: int):
        super().__init__()
        self.num_labels = num_labels

    def forward(self, input_ids, attention_mask, **_):
        logits = torch.nn.functional.one_hot(input_ids[:, 0] % self.num_labels, self.num_labels).float()
        return SimpleNamespace(logits=logits * input_ids[:, 1:2].float())


@pytest.mark.parametrize("num_labels, world_size", [(5, 1), (5, 2), (100, 2), (150, 1), (1000, 2)])
def test_evaluate_counts_once_and_keeps_confusion_small(monkeypatch, num_labels, world_size):
    """Metrics equal sklearn's over the whole eval set (the ranks' counts summed); the L x L histogram is
    built at most once per evaluation, and eval_confusion is returned only up to 100 classes."""
    import datasets
    from sklearn.metrics import accuracy_score, confusion_matrix, f1_score

    from kubetune import distributed
    from kubetune.distributed import DistEnv
    from kubetune.tasks import base as loop
    from kubetune.tasks.classify import task as classify
    from kubetune.tasks.classify.data import collate

    rng = np.random.default_rng(num_labels)
    n = 301
    labels = rng.integers(0, num_labels, n)
    guesses = np.where(rng.random(n) < 0.6, labels, rng.integers(0, num_labels, n))
    lengths = rng.integers(2, 9, n)
    ids = [[int(g), int(c)] + [7] * (int(k) - 2) for g, c, k in zip(guesses, rng.integers(1, 4, n), lengths)]
    ds = datasets.Dataset.from_dict(
        {
            "input_ids": ids,
            "attention_mask": [[1] * len(x) for x in ids],
            "length": lengths.tolist(),
            "label": labels.tolist(),
        }
    )
    data = loop.Prepared(
        train_ds=None,
        eval_ds=ds,
        collate=None,
        collate_eval=functools.partial(collate, ds, tokenizer=_PadTokenizer()),
        train_rows=0,
        eval_rows=n,
        labels=[str(i) for i in range(num_labels)],
        raw=(None, _PadTokenizer()),
    )

    big = []
    real_bincount = torch.bincount

    def spy(t, weights=None, minlength=0):
        if minlength >= num_labels**2:
            big.append(minlength)
        return real_bincount(t, weights, minlength)

    monkeypatch.setattr(torch, "bincount", spy)
    others = []  # what the other ranks contributed to the all-reduce

    def reduce_sum(t):
        if others:
            return t + sum(others)
        others.append(t.clone())
        return t

    monkeypatch.setattr(distributed, "all_reduce_sum", reduce_sum)
    model = _Guess(num_labels)
    metrics = None
    for rank in reversed(range(world_size)):  # rank 0 last: it sums what the others gave
        metrics = loop.evaluate(
            classify.TASK,
            model,
            data,
            DistEnv(rank=rank, world_size=world_size),
            torch.device("cpu"),
            torch.autocast("cpu", enabled=False),
            16,
        )

    logits = model(torch.tensor([[g, c] for g, c in (x[:2] for x in ids)]), None).logits
    expected_loss = torch.nn.functional.cross_entropy(logits, torch.tensor(labels)).item()
    assert metrics["eval_samples"] == n
    assert metrics["eval_loss"] == pytest.approx(expected_loss, rel=1e-6)
    assert metrics["eval_accuracy"] == pytest.approx(accuracy_score(labels, guesses), abs=1e-12)
    assert metrics["eval_f1_macro"] == pytest.approx(f1_score(labels, guesses, average="macro"), abs=1e-12)
    assert len(big) <= world_size  # once per rank and evaluation, not once per batch
    if num_labels <= 100:
        assert metrics["eval_confusion"] == confusion_matrix(labels, guesses, labels=range(num_labels)).tolist()
    else:
        assert "eval_confusion" not in metrics and not big


def test_report_without_or_with_a_big_confusion_matrix(tmp_path):
    from kubetune.artifacts.report import write_report
    from kubetune.config import parse_spec
    from kubetune.tasks.classify import task as classify

    spec = parse_spec(
        {
            "name": "r",
            "model": {"uri": "hf://org/m"},
            "data": {"train": "t.csv"},
            "output": {"uri": str(tmp_path / "o")},
        }
    )
    base = {"eval_accuracy": 0.5, "eval_f1_macro": 0.4, "eval_loss": 1.0}
    pages = {}
    for name, n in (("small", 5), ("big", 40), ("none", 500)):
        out = tmp_path / name
        out.mkdir()
        metrics = {**base, "labels": [f"c{i}" for i in range(n)]}
        if n <= 100:
            metrics["eval_confusion"] = np.eye(n, dtype=int).tolist()
        pages[name] = write_report(spec, metrics, out, classify.TASK.present).read_text()
    assert "<h2>Confusion matrix" in pages["small"] and "<th>c4</th>" in pages["small"]
    assert "<h2>Confusion matrix" not in pages["big"] and "40 classes" in pages["big"]
    assert "<h2>Confusion matrix" not in pages["none"] and "500 classes" in pages["none"]


# ---------------------------------------------------------------- 3. size limit before loading


def _big_csv(path, mib: float):
    row = b"some text that repeats to make the file big,pos\nother text that repeats to make it big,neg\n"
    path.write_bytes(b"text,label\n" + row * int(mib * 2**20 / len(row) + 1))
    return path


def _hf_dataset(tmp_path, mib: float) -> str:
    from huggingface_hub import constants

    from kubetune.providers.hf import seed_cache

    repo = tmp_path / "repo"
    (repo / "data").mkdir(parents=True)
    _big_csv(repo / "data" / "train.csv", mib)
    seed_cache(repo, repo_id="acme/huge", cache_dir=constants.HF_HUB_CACHE, repo_type="dataset")
    return "hf://datasets/acme/huge"


def _two_files(tmp_path, mib: float) -> str:
    d = tmp_path / "parts"
    d.mkdir()
    _big_csv(d / "part-1.csv", mib / 2)
    _big_csv(d / "part-2.csv", mib / 2)
    return str(d)


@pytest.mark.parametrize(
    "make, loader, expected",
    [
        (lambda p: str(_big_csv(p / "big.csv", 1.2)), load_frames, "is 1.2 MiB, over the 1 MiB limit"),
        (lambda p: _two_files(p, 1.2), load_frames, "the data files in"),
        (lambda p: _hf_dataset(p, 1.2), load_frames, "over the 1 MiB limit"),
        (lambda p: str(_big_csv(p / "big.csv", 1.2)), load_lm_frames, "is 1.2 MiB, over the 1 MiB limit"),
    ],
)
def test_input_size_limit_before_loading(tmp_path, monkeypatch, make, loader, expected):
    uri = make(tmp_path)
    read = []
    monkeypatch.setattr(pd, "read_csv", lambda *a, **k: read.append(a) or pytest.fail("read before the size check"))
    with pytest.raises(KubetuneError) as e:
        loader(_data(loader)(train=uri, max_input_mb=1), seed=0)
    _one_line(e.value, "data.train:", expected, "raise data.max_input_mb")


# ---------------------------------------------------------------- 4. content sniffing


def _xlsx_bytes() -> bytes:
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w") as z:
        z.writestr("[Content_Types].xml", "<Types>" + "x" * 20000 + "</Types>")
        z.writestr("xl/worksheets/sheet1.xml", "<worksheet>" + "<row>1</row>" * 2000 + "</worksheet>")
    return buf.getvalue()


def _parquet_bytes() -> bytes:
    buf = io.BytesIO()
    pd.DataFrame(GOOD, columns=["text", "label"]).to_parquet(buf)
    return buf.getvalue()


TEXT = "text,label\nhéllo wörld,pos\nplain row,neg\nthird one,pos\nfourth,neg\n"


@pytest.mark.parametrize(
    "name, make, suffix, expected",
    [
        ("NUL bytes", lambda: b"\x00" * 200_000, ".csv", "NUL bytes in its first 64 KiB: binary data"),
        ("NULs after a header", lambda: b"text,label\n" + b"\x00\x01\x02" * 50_000, ".csv", "binary data"),
        ("xlsx renamed .csv", _xlsx_bytes, ".csv", "is an Excel workbook or ZIP archive, not csv"),
        ("xlsx renamed .jsonl", _xlsx_bytes, ".jsonl", "is an Excel workbook or ZIP archive"),
        ("parquet renamed .csv", _parquet_bytes, ".csv", "is a Parquet file, not csv"),
        ("first line over 1 MiB", lambda: b"x" * (1200 * 1024), ".csv", "no line break in its first 1 MiB"),
        ("gzip renamed .tsv", lambda: b"\x1f\x8b\x08\x00" + bytes(range(256)) * 400, ".tsv", "gzip-compressed"),
    ],
)
def test_non_text_files_are_one_short_line(tmp_path, name, make, suffix, expected):
    path = tmp_path / f"data{suffix}"
    path.write_bytes(make())
    with pytest.raises(KubetuneError) as e:
        load_frames(ClassificationData(train=str(path)), seed=0)
    _one_line(e.value, "data.train:", expected)


@pytest.mark.parametrize(
    "encoding, suffix",
    [("utf-16", ".csv"), ("utf-16-be", ".tsv"), ("utf-32", ".csv"), ("utf-16", ".jsonl"), ("utf-8-sig", ".jsonl")],
)
def test_byte_order_marks_are_decoded(tmp_path, caplog, encoding, suffix):
    """With encoding auto a BOM picks the decoding (UTF-16/32 with a warning); an explicit encoding is honoured."""
    df = pd.DataFrame(
        {"text": ["héllo wörld", "plain ünïcode", "third", "fourth"], "label": ["pos", "neg", "pos", "neg"]}
    )
    text = (
        df.to_csv(index=False, sep="\t" if suffix == ".tsv" else ",")
        if suffix != ".jsonl"
        else df.to_json(orient="records", lines=True, force_ascii=False)
    )
    bom = {"utf-16-be": codecs.BOM_UTF16_BE}.get(encoding, b"")
    path = tmp_path / f"bom{suffix}"
    path.write_bytes(bom + text.encode(encoding))
    with caplog.at_level(logging.WARNING):
        table = read_table(str(path), field="data.train")
    assert list(table.columns) == ["text", "label"]  # no garbage, no BOM in the first name
    assert table["text"].tolist()[:2] == ["héllo wörld", "plain ünïcode"]
    if encoding != "utf-8-sig":
        assert "byte-order mark" in caplog.text
    explicit = {"utf-16-be": "utf-16-be", "utf-8-sig": "utf-8"}.get(encoding, encoding)
    assert read_table(str(path), field="data.train", encoding=explicit)["text"].tolist()[:2] == [
        "héllo wörld",
        "plain ünïcode",
    ]


def test_explicit_encoding_is_honoured_and_wrong_one_is_one_line(tmp_path):
    path = tmp_path / "u16.csv"
    path.write_bytes(TEXT.encode("utf-16"))
    # latin-1 asked for a UTF-16 file: honoured, so the NUL bytes show; the line says what to do
    with pytest.raises(KubetuneError) as e:
        load_frames(ClassificationData(train=str(path), encoding="latin-1"), seed=0)
    _one_line(e.value, "NUL bytes", "utf-16")
    path.write_bytes(TEXT.encode("utf-8") + "caf\xe9,pos\n".encode("latin-1"))
    with pytest.raises(KubetuneError) as e:
        load_frames(ClassificationData(train=str(path), encoding="utf-8"), seed=0)
    _one_line(e.value, "data.encoding:", "not valid utf-8", "byte 0xe9", "line 6")


# ---------------------------------------------------------------- 5. mixed encodings


@pytest.mark.parametrize("suffix", [".csv", ".jsonl"])
def test_mixed_encodings_keep_valid_utf8(tmp_path, caplog, suffix):
    rows = [("café crème", "pos"), ("日本語のテキスト", "neg"), ("naïve", "pos")]
    legacy = [("caf\xe9 latin", "neg"), ("\u201csmart quotes\u201d", "pos")]  # written as cp1252

    def line(text, label):
        return (
            f"{text},{label}\n"
            if suffix == ".csv"
            else json.dumps({"text": text, "label": label}, ensure_ascii=False) + "\n"
        )

    data = (b"text,label\n" if suffix == ".csv" else b"") + b"".join(line(*r).encode("utf-8") for r in rows)
    data += b"".join(line(*r).encode("cp1252") for r in legacy)
    path = tmp_path / f"mixed{suffix}"
    path.write_bytes(data)
    with caplog.at_level(logging.WARNING):
        texts = read_table(str(path), field="data.train")["text"].tolist()
    assert texts == ["café crème", "日本語のテキスト", "naïve", "caf\xe9 latin", "\u201csmart quotes\u201d"]
    assert "3 bytes on 2 lines are not valid UTF-8" in caplog.text
    # explicit: as given, even where that makes mojibake of the UTF-8 rows
    assert read_table(str(path), field="data.train", encoding="latin-1")["text"][0] == "cafÃ© crÃ¨me"


# ---------------------------------------------------------------- 6. no NA inference


@pytest.mark.parametrize(
    "content, suffix, labels, dropped",
    [
        (
            _csv(GOOD[:6] + [("a text", "None"), ("b text", "None"), ("c text", "None")]),
            ".csv",
            ["None", "neg", "pos"],
            {},
        ),
        (_csv([("t1", "NA"), ("t2", "pos"), ("t3", "NA"), ("t4", "pos")]), ".csv", ["NA", "pos"], {}),
        (
            _csv([("None", "null"), ("NA", "pos"), ("n/a", "null"), ("NaN", "pos"), ("", "pos")]),
            ".csv",
            ["null", "pos"],
            {"train": 1},
        ),
        (
            _csv([("None", "null"), ("NA", "pos"), ("x", "null"), ("y", "pos")]).replace(b",", b"\t"),
            ".tsv",
            ["null", "pos"],
            {},
        ),
        (
            b'{"text": "123", "label": "null"}\n{"text": "456", "label": "None"}\n{"text": "789", "label": "null"}\n{"text": null, "label": "None"}\n',
            ".jsonl",
            ["None", "null"],
            {"train": 1},
        ),
    ],
)
def test_none_na_null_are_labels_and_texts(tmp_path, content, suffix, labels, dropped):
    path = tmp_path / f"d{suffix}"
    path.write_bytes(content)
    frames = load_frames(ClassificationData(train=str(path), eval_fraction=0.25), seed=0)
    assert frames.labels == labels
    assert frames.dropped == dropped  # only a truly empty cell / JSON null is missing


def test_none_labels_in_a_directory_and_numeric_label_order(tmp_path):
    for name, labels in (("a", ["None", "10", "2"]), ("b", ["", "10", "2"])):
        (tmp_path / name).mkdir()
        (tmp_path / name / "train.csv").write_bytes(_csv([(f"t{i}", labels[i % 3]) for i in range(12)]))
    assert load_frames(ClassificationData(train=str(tmp_path / "a"), eval_fraction=0.25), seed=0).labels == [
        "10",
        "2",
        "None",
    ]
    frames = load_frames(ClassificationData(train=str(tmp_path / "b"), eval_fraction=0.25), seed=0)
    assert frames.labels == ["2", "10"] and frames.dropped == {"train": 4}


@pytest.mark.parametrize(
    "content, extra, expected",
    [
        (
            _csv([("NA", "None"), ("null", "n/a")], header=("instruction", "output")),
            {},
            [("NA", "None"), ("null", "n/a")],
        ),
        (_csv([("None",), ("NaN",)], header=("text",)), {}, [("None",), ("NaN",)]),
    ],
)
def test_causal_text_is_read_without_na_inference(tmp_path, content, extra, expected):
    path = tmp_path / ("c.jsonl" if content.startswith(b"{") else "c.csv")
    path.write_bytes(content)
    frames = load_lm_frames(CausalLMData(train=str(path), eval=str(path), **extra), seed=0)
    records = [json.loads(r) for r in frames.train["record"]]
    got = [(r["text"],) if "text" in r else tuple(m["content"] for m in r["messages"]) for r in records]
    assert got == expected


# ---------------------------------------------------------------- 7. fractional float labels


def test_fractional_labels_warn_regression(tmp_path, caplog):
    path = tmp_path / "scores.csv"
    path.write_bytes(_csv([(f"t{i}", [0.25, 3.7, 1.0][i % 3]) for i in range(12)]))
    with caplog.at_level(logging.WARNING):
        frames = load_frames(ClassificationData(train=str(path), eval_fraction=0.25), seed=0)
    assert frames.labels == ["0.25", "1", "3.7"]
    lines = [r.getMessage() for r in caplog.records if "regression" in r.getMessage()]
    assert len(lines) == 1 and "0.25, 3.7" in lines[0] and "each of the 3 distinct values becomes a class" in lines[0]
    caplog.clear()
    path.write_bytes(_csv([(f"t{i}", [1.0, 2.0][i % 2]) for i in range(12)]))  # whole numbers: no warning
    with caplog.at_level(logging.WARNING):
        assert load_frames(ClassificationData(train=str(path), eval_fraction=0.25), seed=0).labels == ["1", "2"]
    assert "regression" not in caplog.text


# ---------------------------------------------------------------- 8. a text column that holds no text


def _parquet(path, **columns):
    pd.DataFrame(columns).to_parquet(path)
    return path


@pytest.mark.parametrize(
    "make, loader, needles",
    [
        (
            lambda p: (
                (p / "n.csv").write_bytes(_csv([(i, "pos" if i % 2 else "neg") for i in range(8)])) and p / "n.csv"
            ),
            load_frames,
            (
                "data.text_column:",
                "column 'text'",
                "holds numbers (int64), not text",
                "set data.text_column to the text column",
            ),
        ),
        (
            lambda p: (
                (p / "n.jsonl").write_bytes(
                    b"".join(json.dumps({"text": i / 2, "label": i % 2}).encode() + b"\n" for i in range(8))
                )
                and p / "n.jsonl"
            ),
            load_frames,
            ("holds numbers (float64)",),
        ),
        (
            lambda p: _parquet(p / "l.parquet", text=[["a", "b"], ["c"]] * 4, label=["x", "y"] * 4),
            load_frames,
            ("holds nested values (lists/structs), not text",),
        ),
        (
            lambda p: _parquet(p / "s.parquet", text=[{"a": 1}, {"a": 2}] * 4, label=["x", "y"] * 4),
            load_frames,
            ("holds nested values",),
        ),
        (
            lambda p: _parquet(p / "b.parquet", text=[True, False] * 4, label=["x", "y"] * 4),
            load_frames,
            ("holds booleans",),
        ),
        (
            lambda p: _parquet(p / "k.parquet", text=["a", "b"] * 4, label=[[1], [2]] * 4),
            load_frames,
            ("data.label_column:", "nested values", "not class labels"),
        ),
        (
            lambda p: (p / "c.csv").write_bytes(_csv([(i,) for i in range(8)], header=("text",))) and p / "c.csv",
            load_lm_frames,
            ("holds numbers (int64), not text",),
        ),
    ],
)
def test_a_column_without_text_says_what_it_holds(tmp_path, make, loader, needles):
    path = make(tmp_path)
    with pytest.raises(KubetuneError) as e:
        loader(_data(loader)(train=str(path), eval=str(path) if loader is load_lm_frames else None), seed=0)
    msg = _one_line(e.value, *needles)
    assert "lacks a text" not in msg


# ---------------------------------------------------------------- 9. mixed file kinds in a directory


@pytest.mark.parametrize(
    "files, loader, listed",
    [
        ({"a.csv": "csv", "b.jsonl": "jsonl", "c.jsonl": "jsonl"}, load_frames, "2 .jsonl, 1 .csv"),
        ({"a.csv": "csv", "b.parquet": "parquet"}, load_frames, "1 .csv, 1 .parquet"),
        ({"a.csv": "csv", "b.tsv": "tsv"}, load_frames, "1 .csv, 1 .tsv"),
        ({"a.csv": "csv", "b.jsonl": "jsonl"}, load_lm_frames, "1 .csv, 1 .jsonl"),
    ],
)
def test_directory_of_mixed_kinds(tmp_path, files, loader, listed):
    d = tmp_path / "mixed"
    d.mkdir()
    df = pd.DataFrame(GOOD, columns=["text", "label"])
    for name, kind in files.items():
        {
            "csv": lambda p: df.to_csv(p, index=False),
            "tsv": lambda p: df.to_csv(p, sep="\t", index=False),
            "jsonl": lambda p: df.to_json(p, orient="records", lines=True),
            "parquet": lambda p: df.to_parquet(p),
        }[kind](d / name)
    (d / "README.md").write_text("not data")  # ignored, as `datasets` ignores it
    with pytest.raises(KubetuneError) as e:
        loader(_data(loader)(train=str(d), eval=str(d) if loader is load_lm_frames else None), seed=0)
    _one_line(e.value, "data.train:", "mixes data file kinds", listed)


@pytest.mark.parametrize(
    "files, encoding, expected",
    [
        (
            {"a.csv": "text,label\ncafé utf8,pos\n".encode() + "caf\xe9 legacy,neg\n".encode("cp1252")},
            "auto",
            ["café utf8", "caf\xe9 legacy"],
        ),
        ({"a.csv": "text,label\ncaf\xe9,neg\n".encode("cp1252")}, "utf-8", "data.encoding: cannot read"),
        ({"a.csv": b"text,label\na,b\n", "b.csv": b"body,stars\nc,1\n"}, "auto", "data.train: cannot read"),
        # an s3:// download holds kubetune's manifest next to the data: not a second kind, and not read as data
        (
            {"part-0.csv": b"text,label\nfrom csv,b\n", "_kubetune_manifest.json": b'{"files": {"part-0.csv": {}}}'},
            "auto",
            ["from csv"],
        ),
    ],
)
def test_directory_reads_like_a_file(tmp_path, files, encoding, expected):
    """A directory's CSVs decode as a file's do (encoding auto falls back per byte); its reader's errors are one line."""
    (tmp_path / "ds").mkdir()
    for name, content in files.items():
        (tmp_path / "ds" / name).write_bytes(content)
    if isinstance(expected, list):
        assert read_table(str(tmp_path / "ds"), field="data.train", encoding=encoding)["text"].tolist() == expected
        return
    with pytest.raises(KubetuneError) as e:
        read_table(str(tmp_path / "ds"), field="data.train", encoding=encoding)
    _one_line(e.value, expected)


# ---------------------------------------------------------------- 10. not a regular file


def _fifo(p):
    os.mkfifo(p / "pipe.csv")
    return p / "pipe.csv"


def _fifo_in_dir(p):
    (p / "d").mkdir()
    (p / "d" / "train.csv").write_bytes(_csv(GOOD))
    os.mkfifo(p / "d" / "more.csv")
    return p / "d"


def _device(p):
    (p / "zero.csv").symlink_to("/dev/zero")
    return p / "zero.csv"


@pytest.mark.parametrize(
    "make, expected",
    [
        (_fifo, "is not a regular file (a FIFO)"),
        (_fifo_in_dir, "more.csv' is not a regular file (a FIFO)"),
        (_device, "is not a regular file (a device)"),
    ],
)
def test_fifo_or_device_is_not_a_regular_file(tmp_path, make, expected):
    path = make(tmp_path)
    result = {}

    def load():
        try:
            load_frames(ClassificationData(train=str(path)), seed=0)
        except BaseException as e:  # noqa: BLE001 - handed to the test thread
            result["error"] = e

    reader = threading.Thread(target=load, daemon=True)
    reader.start()
    reader.join(timeout=20)
    if reader.is_alive():  # blocked opening a FIFO: release it, then fail
        for fifo in [path] if path.is_fifo() else path.glob("*.csv"):
            if fifo.is_fifo():
                try:
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
                except OSError:
                    pass
        pytest.fail("reading blocked on a FIFO")
    assert isinstance(result.get("error"), KubetuneError), result
    _one_line(result["error"], "data.train:", expected)


# ---------------------------------------------------------------- 11. the TF-IDF baseline


def _frames(n_classes: int, rows_per_class: int = 3):
    """The split as the baseline reads it (``RowSplit.train`` / ``.eval`` of a classification table)."""
    from types import SimpleNamespace

    rows = [
        (f"class {c} example {k} word{c} filler{c % 7}", c) for c in range(n_classes) for k in range(rows_per_class)
    ]
    df = pd.DataFrame(rows, columns=["text", "label"])
    return SimpleNamespace(
        train=df, eval=df.iloc[::rows_per_class].reset_index(drop=True), train_ids=np.arange(len(df))
    )


@pytest.mark.parametrize("cause", ["estimate", "MemoryError"])
def test_baseline_skipped_where_it_cannot_fit(monkeypatch, caplog, tmp_path, cause):
    from sklearn.linear_model import LogisticRegression

    from kubetune.config import parse_spec
    from kubetune.tasks import base as loop
    from kubetune.tasks.classify import baseline
    from kubetune.tasks.classify import task as classify

    if cause == "estimate":
        monkeypatch.setattr(baseline, "available_memory", lambda: 64 * 2**20, raising=False)
    else:
        monkeypatch.setattr(LogisticRegression, "fit", lambda *a, **k: (_ for _ in ()).throw(MemoryError()))
    monkeypatch.setattr(classify, "_export_model", lambda *a, **k: None)
    spec = parse_spec(
        {
            "name": "b",
            "model": {"uri": "hf://org/m"},
            "data": {"train": "t.csv"},
            "output": {"uri": str(tmp_path / "o")},
        }
    )
    metrics = {}
    with caplog.at_level(logging.WARNING):
        classify.export(
            spec, None, None, loop.Prepared(None, None, None, None, 0, 0, raw=(_frames(200), None)), tmp_path, metrics
        )
    assert "baseline" not in metrics
    lines = [r.getMessage() for r in caplog.records if "baseline skipped" in r.getMessage()]
    assert len(lines) == 1 and "200 classes" in lines[0] and "\n" not in lines[0]
    if cause == "estimate":
        assert "GiB" in lines[0]
    # Normal data keeps its baseline, unchanged.
    monkeypatch.undo()
    normal = baseline.tfidf_baseline(_frames(3, 6))
    assert normal["method"].startswith("TF-IDF") and 0 <= normal["accuracy"] <= 1


def test_baseline_is_cached_under_its_split_and_refits_when_the_split_or_the_cache_changes(monkeypatch, tmp_path):
    from sklearn.linear_model import LogisticRegression

    from kubetune.tasks.classify import baseline

    monkeypatch.setenv("KUBETUNE_CACHE", str(tmp_path))
    frames = _frames(3, 6)
    first = baseline.tfidf_baseline(frames)
    (entry,) = (tmp_path / "baseline").iterdir()
    fits = []
    real_fit = LogisticRegression.fit
    monkeypatch.setattr(LogisticRegression, "fit", lambda self, *a, **k: fits.append(1) or real_fit(self, *a, **k))
    assert baseline.tfidf_baseline(frames) == first and fits == []  # read, not fitted
    entry.write_text('{"method": "something else", "accuracy": 2}')  # not ours: fitted again
    assert baseline.tfidf_baseline(frames) == first and fits == [1]
    entry.write_text("[1, 2")  # unreadable: fitted again
    assert baseline.tfidf_baseline(frames) == first and fits == [1, 1]
    other = _frames(3, 6)
    other.eval["label"] = (other.eval["label"] + 1) % 3  # another split: its own entry
    baseline.tfidf_baseline(other)
    assert fits == [1, 1, 1] and len(list((tmp_path / "baseline").iterdir())) == 2
