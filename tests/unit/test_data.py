"""Data loading: formats, column mapping, labels, carve-out, and table-driven error messages."""

from __future__ import annotations

import threading
from functools import partial
from unittest import mock

import numpy as np
import pandas as pd
import pytest

from kubetune.data.rows import tokenized_rows
from kubetune.distributed import DistEnv
from kubetune.errors import KubetuneError
from kubetune.tasks.classify import ClassificationData
from kubetune.tasks.classify.data import encode, load_frames


def _spec(train, **kw) -> ClassificationData:
    return ClassificationData(train=str(train), **{"text_column": "review", "label_column": "stars", **kw})


@pytest.fixture
def frame():
    return pd.DataFrame(
        {
            "review": [f"review number {i} {'good' if i % 2 else 'bad'}" for i in range(40)],
            "stars": ["pos" if i % 2 else "neg" for i in range(40)],
            "extra": range(40),
        }
    )


@pytest.mark.parametrize("fmt", ["csv", "tsv", "jsonl", "parquet", "json"])
def test_formats(tmp_path, frame, fmt):
    path = tmp_path / f"d.{fmt}"
    {
        "csv": lambda: frame.to_csv(path, index=False),
        "tsv": lambda: frame.to_csv(path, sep="\t", index=False),
        "jsonl": lambda: frame.to_json(path, orient="records", lines=True),
        "json": lambda: frame.to_json(path, orient="records"),
        "parquet": lambda: frame.to_parquet(path),
    }[fmt]()
    f = load_frames(_spec(path, eval_fraction=0.25), seed=0)
    assert f.labels == ["neg", "pos"]
    assert len(f.train) == 30 and len(f.eval) == 10
    assert list(f.train.columns) == ["text", "label"]
    assert f.eval["label"].value_counts().to_dict() == {0: 5, 1: 5}  # stratified


def test_carve_out_is_seeded_and_disjoint(tmp_path, frame):
    path = tmp_path / "d.csv"
    frame.to_csv(path, index=False)
    a, b, c = (load_frames(_spec(path), seed=s) for s in (1, 1, 2))
    assert a.eval["text"].tolist() == b.eval["text"].tolist()
    assert a.eval["text"].tolist() != c.eval["text"].tolist()
    assert not set(a.eval["text"]) & set(a.train["text"])


def test_integer_labels_and_text_pairs(tmp_path):
    df = pd.DataFrame(
        {"premise": ["a b", "c d", "e f", "g h"] * 5, "hypothesis": ["x", "y", "z", "w"] * 5, "label": [2, 0, 1, 0] * 5}
    )
    path = tmp_path / "nli.jsonl"
    df.to_json(path, orient="records", lines=True)
    f = load_frames(
        ClassificationData(train=str(path), text_column="premise", text_pair_column="hypothesis", eval_fraction=0.2),
        seed=0,
    )
    assert f.labels == ["0", "1", "2"]
    assert set(f.train.columns) == {"text", "text_pair", "label"}
    row = f.train[f.train.text == "a b"].iloc[0]
    assert (row.text_pair, row.label) == ("x", 2)


def test_separate_eval_file_and_limits(tmp_path, frame):
    frame.to_csv(tmp_path / "train.csv", index=False)
    frame.head(10).to_csv(tmp_path / "eval.csv", index=False)
    f = load_frames(
        _spec(tmp_path / "train.csv", eval=str(tmp_path / "eval.csv"), max_train_samples=12, max_eval_samples=4), seed=0
    )
    assert (len(f.train), len(f.eval)) == (12, 4)


def test_latin1_fallback_and_dropped_rows(tmp_path):
    path = tmp_path / "l1.csv"
    path.write_bytes(
        "review,stars\ncaf\xe9 good,pos\nbad,neg\n,neg\nok,\nfine,pos\nugh,neg\nyay,pos\nmeh,neg\n".encode("latin-1")
    )
    f = load_frames(_spec(path, eval_fraction=0.3), seed=0)
    assert "café good" in set(f.train.text) | set(f.eval.text)
    assert f.dropped == {"train": 2}


def test_directory_dataset_with_split_slice(tmp_path, frame):
    d = tmp_path / "ds"
    d.mkdir()
    frame.to_parquet(d / "train.parquet")
    f = load_frames(_spec(d, train_split="train[:20]", eval_fraction=0.5), seed=0)
    assert len(f.train) + len(f.eval) == 20


def _write(path, content):
    path.write_text(content)
    return path


@pytest.mark.parametrize(
    "make, kw, expected",
    [
        (lambda p: _write(p / "d.csv", "review,score\nx,1\n"), {}, "data.label_column: column 'stars' not found in"),
        (lambda p: _write(p / "d.csv", "text,stars\nx,1\n"), {}, "data.text_column: column 'review' not found"),
        (lambda p: _write(p / "d.csv", ""), {}, "data.train: "),
        (lambda p: _write(p / "d.csv", "review,stars\n"), {}, "has no rows"),
        (lambda p: _write(p / "d.csv", "review,stars\na,x\nb,x\nc,x\n"), {}, "data.label_column: only one class ('x')"),
        (lambda p: p / "missing.csv", {}, "does not exist"),
        (lambda p: _write(p / "d.xlsx", "x"), {}, "cannot tell the format"),
        (lambda p: _write(p / "d.jsonl", "{not json\n"), {}, "cannot parse"),
        (
            lambda p: _write(p / "d.csv", "review,stars\na,x\nb,y\nc,x\nd,y\n"),
            {"eval": "EVAL"},
            "data.eval: labels ['z'] occur in",
        ),
        (lambda p: _write(p / "d.csv", "review,stars\n,x\n,y\n"), {}, "no usable rows"),
        (
            lambda p: _write(p / "d.csv", "review,stars\na,x\n"),
            {"encoding": "utf-99"},
            "data.encoding: unknown encoding",
        ),
    ],
)
def test_data_errors(tmp_path, make, kw, expected):
    path = make(tmp_path)
    if kw.get("eval") == "EVAL":
        kw["eval"] = str(_write(tmp_path / "e.csv", "review,stars\nq,z\nr,x\n"))
    with pytest.raises(KubetuneError) as e:
        load_frames(_spec(path, **kw), seed=0)
    assert expected in str(e.value)
    assert "\n" not in str(e.value)
    assert " — " in str(e.value) or "fix" in str(e.value)  # every message says what to do


def test_the_launchers_preflight_checks_the_data_without_importing_scikit_learn(tmp_path, small_csv):
    """Importing scikit-learn took 0.6 s in the launcher, on the path of every classification run
    before its workers start (and 0.55-0.85 s in each worker): the eval split is kubetune's own."""
    import subprocess
    import sys

    from conftest import tiny_spec, write_spec

    spec = write_spec(tmp_path / "job.yaml", tiny_spec(small_csv, tmp_path / "out"))
    code = (
        "import sys; from kubetune.config import load_spec; from kubetune.cli.run import _preflight; "
        f"print(_preflight(load_spec({str(spec)!r})), 'sklearn' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.split() == ["new", "False"]


def test_tokenization_cache(tmp_path, frame, monkeypatch):
    from kubetune import artifacts
    from kubetune.config import parse_spec
    from kubetune.tasks.common import load_tokenizer

    monkeypatch.setenv("KUBETUNE_CACHE", str(tmp_path / "cache"))
    tok = load_tokenizer(
        artifacts.resolve_model(
            parse_spec(
                {
                    "name": "t",
                    "model": {"uri": "hf://sentence-transformers/all-MiniLM-L6-v2"},
                    "data": {"train": "x"},
                    "output": {"uri": "o"},
                }
            )
        )
    )
    frame.to_csv(tmp_path / "t.csv", index=False)
    frames = load_frames(_spec(tmp_path / "t.csv"), 0)
    label2id = {name: i for i, name in enumerate(frames.labels)}

    def tok_call(ids, n, env=DistEnv()):
        enc = partial(encode, tokenizer=tok, max_length=n, label2id=label2id)
        return tokenized_rows(frames.rows, ids, env=env, fingerprint=f"classify:{n}", encode=enc, what="train")

    ds1, hit1, key1 = tok_call(frames.train_ids, 16)
    with mock.patch.object(type(tok), "__call__", side_effect=AssertionError("tokenized again")):
        ds2, hit2, key2 = tok_call(frames.train_ids, 16)
    assert (hit1, hit2, key1) == (False, True, key2)
    assert ds1["input_ids"] == ds2["input_ids"] and max(ds1["length"]) <= 16
    want = tok(frames.train["text"].tolist(), truncation=True, max_length=16)["input_ids"]
    assert ds1["input_ids"] == want and ds1["label"] == frames.train["label"].tolist()
    # A different max_length or different rows is a different cache entry.
    assert tok_call(frames.train_ids, 8)[1] is False
    assert tok_call(frames.train_ids[:-1], 16)[1] is False

    # The node's processes tokenize a share each (here two threads, as local ranks 0 and 1, meeting at
    # a thread barrier): the result is the rows in order, and each process tokenized only its half.
    barrier, calls = threading.Barrier(2), []
    encode_one = partial(encode, tokenizer=tok, max_length=12, label2id=label2id)

    def counted(df, rank):
        calls.append((rank, len(df)))
        return encode_one(df)

    results = {}

    def rank(r):
        env = DistEnv(rank=r, local_rank=r, world_size=2, local_world_size=2)
        results[r] = tokenized_rows(
            frames.rows, frames.train_ids, env=env, fingerprint="classify:12", encode=partial(counted, rank=r), what="t"
        )

    def gather(obj):  # as all_gather_object synchronizes the ranks (each thread sees its own object)
        barrier.wait(timeout=60)
        return [obj]

    with (
        mock.patch("kubetune.data.rows.distributed.barrier", lambda: barrier.wait(timeout=60)),
        mock.patch("kubetune.data.rows.distributed.all_gather_object", gather),
    ):
        threads = [threading.Thread(target=rank, args=(r,)) for r in (0, 1)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert sorted(calls) == [(0, 18), (1, 18)]
    for r in (0, 1):
        assert (
            results[r][0]["input_ids"]
            == tok(frames.train["text"].tolist(), truncation=True, max_length=12)["input_ids"]
        )
    assert not list((tmp_path / "cache" / "tokenized").glob(".*staging"))  # published whole, no staging left


def test_an_eval_fraction_that_leaves_fewer_training_rows_than_classes_splits_without_stratifying(tmp_path):
    """3 classes x 2 rows, 90 % held out: 1 training row cannot hold every class, and stratifying
    raised scikit-learn's ValueError (a traceback) before."""
    path = tmp_path / "t.csv"
    pd.DataFrame({"review": [f"text {i}" for i in range(6)], "stars": ["a", "a", "b", "b", "c", "c"]}).to_csv(path)
    frames = load_frames(_spec(path, eval_fraction=0.9), 1)
    assert (len(frames.train), len(frames.eval)) == (1, 5)
    assert sorted(frames.train["text"].tolist() + frames.eval["text"].tolist()) == [f"text {i}" for i in range(6)]


def test_the_eval_split_is_scikit_learns_train_test_split_draw_for_draw():
    """kubetune carves data.eval_fraction without importing scikit-learn (0.55-0.85 s in every worker);
    the rows, and their order, must be exactly what train_test_split gives for the same seed."""
    from sklearn.model_selection import train_test_split

    from kubetune.data.splits import split_indices

    rng = np.random.default_rng(0)
    cases = 0
    for n, n_classes in [(6, 3), (10, 2), (37, 3), (200, 5), (1000, 3), (333, 7), (50, 1)]:
        for skew in (False, True):
            p = rng.dirichlet(np.ones(n_classes) * (0.3 if skew else 5))
            labels = rng.choice(n_classes, size=n, p=p)
            # every class twice at least, as the carve requires for stratifying
            labels[: 2 * n_classes] = np.repeat(np.arange(n_classes), 2)
            for n_test in {1, n_classes, max(n_classes, n // 20), n // 3, n - n_classes}:
                if not 1 <= n_test < n:
                    continue
                for seed in (0, 42, 2**31 - 1):
                    rows = np.arange(n)
                    for stratify in (False, True):
                        if stratify and (n_test < n_classes or n - n_test < n_classes):
                            continue
                        want = train_test_split(
                            rows, test_size=n_test, random_state=seed, stratify=labels if stratify else None
                        )
                        got = split_indices(labels, n_test, seed, stratify)
                        assert [a.tolist() for a in got] == [a.tolist() for a in want], (n, n_test, seed, stratify)
                        cases += 1
                        if stratify:  # labels counted by bincount (int32 class ids with gaps) or by np.unique (text)
                            for other in (labels.astype(np.int32) * 3 + 2, np.array([f"c{x}" for x in labels])):
                                got = split_indices(other, n_test, seed, stratify)
                                assert [a.tolist() for a in got] == [a.tolist() for a in want], (n, n_test, seed)
    assert cases > 150


def test_a_carved_evaluation_split_is_capped_and_a_given_one_is_not(tmp_path, monkeypatch, caplog):
    """Issue 32, bounded evaluation: an eval split carved out of data.train is evaluated on at most
    CARVED_EVAL_CAP rows (a seeded subset, said in the log); data.max_eval_samples chooses another
    number; a given data.eval is the user's choice and stays whole. The same for every task's split."""
    from kubetune.data import splits
    from kubetune.tasks.causal_lm import CausalLMData

    monkeypatch.setattr(splits, "CARVED_EVAL_CAP", 12)
    rows = pd.DataFrame({"review": [f"text number {i}" for i in range(200)], "stars": [i % 4 for i in range(200)]})
    rows.to_csv(tmp_path / "train.csv", index=False)
    rows.iloc[:60].to_csv(tmp_path / "eval.csv", index=False)
    caplog.set_level("INFO", logger="kubetune.data.splits")

    carved = load_frames(_spec(tmp_path / "train.csv", eval_fraction=0.25), seed=0)
    assert (len(carved.train), len(carved.eval)) == (150, 12)  # the carved rows are not trained on either way
    assert "has 50 rows; evaluating on a seeded 12 of them" in caplog.text
    assert load_frames(_spec(tmp_path / "train.csv", eval_fraction=0.25), seed=0).eval.equals(carved.eval)
    chosen = load_frames(_spec(tmp_path / "train.csv", eval_fraction=0.25, max_eval_samples=30), seed=0)
    assert len(chosen.eval) == 30
    given = load_frames(_spec(tmp_path / "train.csv", eval=str(tmp_path / "eval.csv")), seed=0)
    assert len(given.eval) == 60

    records = pd.DataFrame({"record": [f"r{i}" for i in range(200)]})
    spec = CausalLMData(train="x", eval_fraction=0.25)
    train, evald = splits.split_rows(records, None, spec, seed=0)
    assert (len(train), len(evald)) == (150, 12)
    train, evald = splits.split_rows(records, records.iloc[:60], spec, seed=0)
    assert (len(train), len(evald)) == (200, 60)
