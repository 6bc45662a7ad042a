"""Data in flat memory (data/rows.py): tables read in chunks give the rows a whole read gives, the
normalized rows are cached by content, the split on row ids is the DataFrame split row for row, a
full disk leaves nothing half-written, and long tokenization says how far it is."""

from __future__ import annotations

import errno
import json
import logging

import numpy as np
import pandas as pd
import pytest

from kubetune.data import rows as rows_mod
from kubetune.data.splits import split_ids, split_rows
from kubetune.data.tables import read_chunks, read_table
from kubetune.errors import KubetuneError
from kubetune.tasks.causal_lm import CausalLMData
from kubetune.tasks.causal_lm.data import load_lm_frames
from kubetune.tasks.classify import ClassificationData
from kubetune.tasks.classify.data import load_frames


@pytest.fixture(autouse=True)
def _cache(tmp_path, monkeypatch):
    monkeypatch.setenv("KUBETUNE_CACHE", str(tmp_path / "cache"))


def _chat(i: int) -> dict:
    return {"messages": [{"role": "user", "content": f"question {i}"}, {"role": "assistant", "content": f"answer {i}"}]}


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl", "parquet"])
def test_chunks_are_the_whole_table(tmp_path, fmt):
    """Read 2 KiB at a time, a 3,000-row table is the rows (and values) ``read_table`` reads whole,
    for a column that holds numbers in some chunks and text in others too."""
    n = 3000
    df = pd.DataFrame(
        {
            "text": [f"row {i} " + "x" * (i % 17) if i % 1000 > 500 else str(i) for i in range(n)],
            "label": [["a", "b", "NA", ""][i % 4] for i in range(n)],
        }
    )
    path = tmp_path / f"t.{fmt}"
    if fmt == "parquet":
        df.to_parquet(path)
    elif fmt == "jsonl":
        df.to_json(path, orient="records", lines=True)
    else:
        df.to_csv(path, sep="\t" if fmt == "tsv" else ",", index=False)
    chunks = list(read_chunks(str(path), field="data.train", chunk_bytes=2048))
    assert len(chunks) > 10
    whole = read_table(str(path), field="data.train")
    joined = pd.concat(chunks, ignore_index=True)
    assert list(joined.columns) == list(whole.columns) and len(joined) == n
    # pandas infers types per chunk, as it does over the blocks of a large file: compare values as text
    assert joined.astype(str).equals(whole.astype(str))
    assert joined["label"].isna().sum() == whole["label"].isna().sum()


def test_classification_rows_do_not_depend_on_the_chunk_size(tmp_path, monkeypatch):
    """The normalized rows, labels, drops and split of a table read in 1 KiB chunks equal those of the
    table read as one chunk, and a text column whose first chunk holds only numbers is still text."""
    n = 2000
    df = pd.DataFrame(
        {
            "review": [str(i) if i < 300 else f"review {i}" for i in range(n)],
            "stars": [(i % 3) + 1 if i % 50 else None for i in range(n)],
        }
    )
    df.to_csv(tmp_path / "t.csv", index=False)
    spec = ClassificationData(train=str(tmp_path / "t.csv"), text_column="review", label_column="stars")
    whole = load_frames(spec, 3)
    monkeypatch.setattr("kubetune.data.tables.CHUNK_BYTES", 1024)
    monkeypatch.setenv("KUBETUNE_CACHE", str(tmp_path / "cache2"))
    chunked = load_frames(spec, 3)
    assert whole.labels == chunked.labels == ["1", "2", "3"]
    assert whole.dropped == chunked.dropped == {"train": 40}
    assert whole.train.equals(chunked.train) and whole.eval.equals(chunked.eval)


def test_the_id_split_is_the_dataframe_split(tmp_path):
    """``split_ids`` (row ids) selects exactly what ``split_rows`` (DataFrames) selects: carve-out,
    max_train_samples and the eval cap, for several sizes and seeds."""
    for n, seed, kw in [(100, 0, {}), (1000, 7, {"max_train_samples": 300}), (5000, 1, {"max_eval_samples": 40})]:
        frame = pd.DataFrame({"record": [f"r{i}" for i in range(n)]})
        spec = CausalLMData(train="x", eval_fraction=0.1, **kw)
        want_train, want_eval = split_rows(frame, None, spec, seed)
        train_ids, eval_ids = split_ids(n, None, spec, seed)
        assert frame["record"].iloc[train_ids].tolist() == want_train["record"].tolist()
        assert frame["record"].iloc[eval_ids].tolist() == want_eval["record"].tolist()


def test_rows_are_cached_by_content_and_warnings_replayed(tmp_path, caplog):
    path = tmp_path / "chat.jsonl"
    lines = [json.dumps(_chat(i)) for i in range(50)] + [json.dumps({"messages": [{"role": "user", "content": "q"}]})]
    path.write_text("\n".join(lines) + "\n")
    spec = CausalLMData(train=str(path), format="chat", eval_fraction=0.1)
    with caplog.at_level(logging.WARNING, logger="kubetune"):
        first = load_lm_frames(spec, 0)
    assert "dropped 1 of 51 rows" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="kubetune"):
        again = load_lm_frames(spec, 0)
    assert again.rows.key == first.rows.key and "dropped 1 of 51 rows" in caplog.text  # read from the cache
    # The same name and size, other bytes: other rows.
    path.write_text("\n".join(lines).replace("answer 1", "answer X") + "\n")
    changed = load_lm_frames(spec, 0)
    assert changed.rows.key != first.rows.key
    assert any("answer X" in r for r in changed.train["record"].tolist() + changed.eval["record"].tolist())


def test_a_full_disk_leaves_no_half_written_rows(tmp_path, monkeypatch):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(_chat(i)) for i in range(40)) + "\n")
    spec = CausalLMData(train=str(path), format="chat")
    real = rows_mod.pa.ipc.new_stream

    class Full:
        def __init__(self, *a):
            self.inner = real(*a)

        def write_table(self, table):
            raise OSError(errno.ENOSPC, "No space left on device")

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.inner.close()

    monkeypatch.setattr(rows_mod.pa.ipc, "new_stream", Full)
    with pytest.raises(KubetuneError) as e:
        load_lm_frames(spec, 0)
    msg = str(e.value)
    assert "\n" not in msg and "filled up" in msg and "KUBETUNE_CACHE" in msg, msg
    assert list((tmp_path / "cache" / "rows").iterdir()) == []  # no entry, no temporary left
    monkeypatch.setattr(rows_mod.pa.ipc, "new_stream", real)
    assert len(load_lm_frames(spec, 0).train_ids) == 36  # the next run reads it whole


def test_a_real_full_disk_while_writing_the_cache(tmp_path, monkeypatch, tmpfs):
    """The cache on a real 1 MiB tmpfs, 3 MB of rows to write (data.max_input_mb given, so the estimate
    before reading is not made): one line, no cache entry and no temporary left on that disk."""
    mnt = tmpfs("1m")
    monkeypatch.setenv("KUBETUNE_CACHE", str(mnt / "cache"))
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(_chat(i)) + " " * 30 for i in range(30_000)) + "\n")
    with pytest.raises(KubetuneError) as e:
        load_lm_frames(CausalLMData(train=str(path), format="chat", max_input_mb=100), 0)
    assert "\n" not in str(e.value) and "filled up" in str(e.value), str(e.value)
    assert list((mnt / "cache" / "rows").iterdir()) == []


def test_data_larger_than_the_free_disk_is_refused_before_reading(tmp_path, monkeypatch):
    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(_chat(i)) for i in range(40)) + "\n")
    monkeypatch.setattr(rows_mod.shutil, "disk_usage", lambda p: type("U", (), {"free": 100})())
    with pytest.raises(KubetuneError) as e:
        load_lm_frames(CausalLMData(train=str(path), format="chat"), 0)
    assert "\n" not in str(e.value) and "data.train:" in str(e.value) and "GiB free" in str(e.value)
    # with a limit of its own, the spec is trusted
    assert len(load_lm_frames(CausalLMData(train=str(path), format="chat", max_input_mb=10), 0).train_ids) == 36


def test_long_tokenization_logs_its_progress(tmp_path, monkeypatch, caplog):
    from kubetune.distributed import DistEnv

    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(_chat(i)) for i in range(300)) + "\n")
    frames = load_lm_frames(CausalLMData(train=str(path), format="chat"), 0)
    monkeypatch.setattr(rows_mod, "PROGRESS_EVERY_S", 0.0)
    monkeypatch.setattr(rows_mod, "TOKENIZE_BATCH", 50)

    def encode(df):
        return {"length": [len(r) for r in df["record"]], "ids": [[1, 2]] * len(df)}

    with caplog.at_level(logging.INFO, logger="kubetune"):
        ds, hit, _ = rows_mod.tokenized_rows(
            frames.rows, frames.train_ids, env=DistEnv(), fingerprint="t", encode=encode, what="train"
        )
    assert not hit and len(ds) == len(frames.train_ids)
    lines = [r.getMessage() for r in caplog.records if "tokenizing train" in r.getMessage()]
    assert len(lines) >= 4 and "rows/s" in lines[0] and "s left" in lines[0], lines
    assert np.array_equal(np.asarray(ds["length"]), frames.train["record"].str.len().to_numpy())


def test_a_pool_of_worker_processes_tokenizes_as_one_process_does(tmp_path, monkeypatch):
    """More cores than processes on the node: the share is cut into pieces a spawned pool tokenizes
    (each piece its own part file); the tokens, in row order, equal one process's."""
    import functools

    from transformers import AutoTokenizer

    from kubetune.distributed import DistEnv
    from kubetune.tasks.causal_lm import task as causal
    from kubetune.tasks.common import ensure_chat_template

    path = tmp_path / "chat.jsonl"
    path.write_text("\n".join(json.dumps(_chat(i)) for i in range(400)) + "\n")
    frames = load_lm_frames(CausalLMData(train=str(path), format="chat"), 0)
    tok = AutoTokenizer.from_pretrained(rows_mod.Path(causal.__file__).parents[2] / "assets" / "tiny-llama")
    ensure_chat_template(tok)
    encode = functools.partial(causal._encode, tokenizer=tok, max_length=64, train_on_prompt=False)

    def run(fingerprint: str):
        return rows_mod.tokenized_rows(
            frames.rows, frames.train_ids, env=DistEnv(), fingerprint=fingerprint, encode=encode, what="train"
        )

    one, _, _ = run("one")
    monkeypatch.setattr(rows_mod, "_cores", lambda: 2)
    monkeypatch.setattr(rows_mod, "POOL_MIN_ROWS", 10)
    pooled, hit, key = run("pooled")
    assert not hit and pooled["input_ids"] == one["input_ids"] and pooled["labels"] == one["labels"]
    parts = json.loads((tmp_path / "cache" / "tokenized" / key / "parts.json").read_text())["parts"]
    assert len(parts) == 8 and parts == sorted(parts)  # 2 workers x 4 pieces, in row order


def _rss_file_mib() -> float:
    for line in open("/proc/self/status"):
        if line.startswith("RssFile:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no RssFile in /proc/self/status")


def test_arrow_file_reads_rows_and_columns_as_the_dataset_does_and_lets_them_go(tmp_path):
    """``ArrowFile`` (tokenization's and ``column``'s reader) gives the rows ``Dataset[ids]`` gives, in
    any id order and across record batches, and a column equal to the dataset's; what it read does not
    stay in this process's resident memory (through the dataset's own map it did: growth with the data)."""
    import datasets
    import pyarrow as pa

    n, text = 40_000, "x" * 1500  # 60 MB of rows, in 40 record batches
    path = tmp_path / "rows.arrow"
    schema = pa.schema(
        [("text", pa.string()), ("length", pa.int64()), ("turns", pa.list_(pa.struct([("role", pa.string())])))]
    )
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_stream(sink, schema) as writer:
        for lo in range(0, n, 1000):
            ids = range(lo, lo + 1000)
            writer.write_table(
                pa.table(
                    {
                        "text": [f"{i}{text}" for i in ids],
                        "length": [i % 700 for i in ids],
                        "turns": [[{"role": "user"}] * (i % 3) for i in ids],
                    },
                    schema=schema,
                )
            )
    before = _rss_file_mib()
    with rows_mod.ArrowFile(str(path)) as arrow:
        for k, lo in enumerate(range(0, n, 1000)):
            arrow.take(np.arange(lo, lo + 1000))
            if k % 4 == 3:
                arrow.release()
        held = _rss_file_mib() - before
    control = datasets.Dataset.from_file(str(path))
    through_map = control[:]["text"]  # the dataset's map: every page read stays while the dataset lives
    kept = _rss_file_mib() - before
    assert len(through_map) == n
    assert held < 16, f"{held:.0f} MiB of the rows stayed resident"
    assert kept > 40, f"the control read kept only {kept:.0f} MiB: the measure cannot tell"

    ds = datasets.Dataset.from_file(str(path))
    rng = np.random.default_rng(0)
    with rows_mod.ArrowFile(str(path)) as arrow:
        for ids in (
            np.arange(999, 2001),
            np.sort(rng.choice(n, 800, replace=False)),
            rng.choice(n, 800, replace=False),
        ):
            assert arrow.take(ids).to_pydict() == ds[ids.tolist()]
    lengths = rows_mod.column(ds, "length")
    assert lengths.dtype == np.int32 and np.array_equal(lengths, np.arange(n) % 700)
    picked = np.sort(rng.choice(n, 5000, replace=False))
    assert np.array_equal(rows_mod.column(ds.select(picked), "length"), picked % 700)  # a selection's rows
    assert np.array_equal(rows_mod.column(ds.select(range(10, 20)), "length"), np.arange(10, 20) % 700)
