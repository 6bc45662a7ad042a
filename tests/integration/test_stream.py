"""Streamed data (kubetune.data.stream): shards listed and read in order with the causal-LM task's
normalizer, a seeded shuffle buffer, exact resume (twice over), the refusal of a changed listing,
a corrupt shard named in one line, the exactly-once deal to 1, 2 and 4 ranks with a 2 -> 1 resume,
and the same stream from an s3:// prefix on moto's server (real boto3 over HTTP, one shard on disk
at a time). Tiny shards: the module runs in seconds."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch
from test_s3 import BUCKET, moto, s3  # noqa: F401  (moto's server on 127.0.0.1, shared with test_s3.py)

from kubetune.data.shards import list_shards
from kubetune.data.stream import Stream, rank_steps, slot
from kubetune.errors import KubetuneError
from kubetune.providers import S3Settings
from kubetune.tasks.causal_lm import CausalLMData
from kubetune.tasks.causal_lm.data import _Normalizer

N_SHARDS = 20


def _chat(i: int, j: int, answer: str | None = None) -> dict:
    return {
        "messages": [
            {"role": "user", "content": f"q {i}.{j}"},
            {"role": "assistant", "content": f"a {i}.{j}" if answer is None else answer},
        ]
    }


def _shard_lines(i: int) -> list[str]:
    """Shard i: 3 to 6 chat rows; in every fifth shard from 2 on, row 1 has an empty answer (dropped)."""
    return [json.dumps(_chat(i, j, "" if i % 5 == 2 and j == 1 else None)) for j in range(3 + i % 4)]


def _write_shards(root: Path) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    for i in range(N_SHARDS):
        (root / f"shard-{i:05d}.jsonl").write_text("\n".join(_shard_lines(i)) + "\n")
    (root / ".hidden.jsonl").write_text("not even json\n")  # skipped, as tables skips it
    return root


@pytest.fixture
def shards(tmp_path) -> Path:
    return _write_shards(tmp_path / "chat")


def _key(row: dict) -> str:
    """A row's identity: its answer turn ("a 3.1")."""
    return json.loads(row["record"])["messages"][-1]["content"]


def _expected() -> list[str]:
    """Every kept row of the 20 shards, in file order."""
    return [f"a {i}.{j}" for i in range(N_SHARDS) for j in range(3 + i % 4) if not (i % 5 == 2 and j == 1)]


def _factory(shard):
    """The causal-LM normalizer of one shard: its errors name the shard."""
    return _Normalizer(CausalLMData(train=shard.uri, format="chat"), "data.train", None)


def _stream(listing, **kw) -> Stream:
    return Stream(listing, normalizer_factory=_factory, field="data.train", **{"seed": 7, **kw})


def _resumed(listing, state: dict, **kw) -> Stream:
    # through JSON, as a checkpoint stores it
    return Stream.from_state(
        listing, json.loads(json.dumps(state)), normalizer_factory=_factory, field="data.train", **{"seed": 7, **kw}
    )


def _take(stream: Stream, n: int | None = None) -> list[str]:
    return [_key(r) for r in itertools.islice(stream, n)]


def test_listing_of_a_directory_and_its_fingerprint(shards):
    listing = list_shards(str(shards), field="data.train")
    assert [s.name for s in listing.shards] == [f"shard-{i:05d}.jsonl" for i in range(N_SHARDS)]
    first = listing.shards[0]
    assert first.uri == f"{shards}/shard-00000.jsonl" and first.size == (shards / first.name).stat().st_size
    assert first.version == f"{first.size}:{(shards / first.name).stat().st_mtime_ns}"
    assert list_shards(str(shards), field="data.train").fingerprint() == listing.fingerprint()
    os.utime(shards / "shard-00004.jsonl", ns=(1, 1))  # same bytes, another version: the store's word counts
    assert list_shards(str(shards), field="data.train").fingerprint() != listing.fingerprint()
    one = list_shards(str(shards / "shard-00003.jsonl"), field="data.train")
    assert [(s.name, s.uri) for s in one.shards] == [("shard-00003.jsonl", f"{shards}/shard-00003.jsonl")]


@pytest.mark.parametrize(
    "make, message",
    [
        (
            lambda d: (d / "a.jsonl").write_text("{}\n") and (d / "b.csv").write_text("x\n1\n"),
            "data.train: '{d}' mixes data file kinds (1 .jsonl, 1 .csv); only one kind would be read — keep one kind of data file per directory (convert or move the others), or point it at one file",
        ),
        (
            lambda d: (d / "a.ndjson").write_text("{}\n"),
            "data.train: cannot stream {d}/a.ndjson: a streamed shard is one of .csv, .tsv, .jsonl, .json, .parquet — convert the shards (.ndjson: rename to .jsonl), or set data.streaming: false",
        ),
        (
            lambda d: (d / "README.md").write_text("hi\n"),
            "data.train: no data files in {d} — point it at a directory of .csv, .tsv, .jsonl, .json, .parquet files",
        ),
    ],
)
def test_listings_refused_in_one_line(tmp_path, make, message):
    make(tmp_path)
    with pytest.raises(KubetuneError) as e:
        list_shards(str(tmp_path), field="data.train")
    assert str(e.value) == message.format(d=tmp_path)


def test_hf_streaming_is_refused_in_one_line():
    with pytest.raises(KubetuneError) as e:
        list_shards("hf://datasets/org/chat", field="data.train")
    assert str(e.value) == (
        "data.train: streaming from hf:// is not yet supported (hf://datasets/org/chat) — copy the dataset's files "
        "to s3:// or a local directory, or set data.streaming: false"
    )


def test_file_order_and_a_seeded_shuffle(shards):
    listing = list_shards(str(shards), field="data.train")
    assert _take(_stream(listing)) == _expected()
    shuffled = _take(_stream(listing, shuffle_buffer=8))
    assert sorted(shuffled) == sorted(_expected()) and shuffled != _expected()
    assert _take(_stream(listing, shuffle_buffer=8)) == shuffled  # seeded
    assert _take(_stream(listing, shuffle_buffer=8, epoch=1)) != shuffled  # by (seed, epoch)
    # a buffer of 8 moves a row at most 8 places earlier than its file position
    position = {k: n for n, k in enumerate(_expected())}
    assert all(n >= position[k] - 8 for n, k in enumerate(shuffled))


def _boundaries(listing) -> list[int]:
    """The epoch positions where the file-order stream moves to another shard."""
    stream, out, last = _stream(listing), [], 0
    for n, _ in enumerate(stream, 1):
        if stream.shard != last:
            out.append(n - 1)
            last = stream.shard
    return out


@pytest.mark.parametrize("buffer", [0, 8])
def test_resume_continues_exactly_twice_over(shards, buffer):
    listing = list_shards(str(shards), field="data.train")
    full = _take(_stream(listing, shuffle_buffer=buffer))
    edges = _boundaries(listing)
    # at the start, inside a shard, either side of shard boundaries, near and at the end
    for n in sorted({0, 1, 2, edges[3] - 1, edges[3], edges[3] + 1, edges[11], 40, len(full) - 3, len(full)}):
        first = _stream(listing, shuffle_buffer=buffer)
        assert _take(first, n) == full[:n]
        state = first.state_dict()
        assert len(json.dumps(state)) < 5000  # the buffer's rows and the listing, nothing that grows with the data
        second = _resumed(listing, state, shuffle_buffer=buffer)
        assert _take(second, 7) == full[n : n + 7], n
        # a second save and resume (datasets#8308 and torchtitan#3907: a second resume restarted from zero)
        third = _resumed(listing, second.state_dict(), shuffle_buffer=buffer)
        assert _take(third) == full[n + 7 :], n
        assert third.state_dict()["index"] == len(full)


def test_resume_inside_a_shard_of_several_chunks(tmp_path):
    """Chunks of about 100 rows (tables' least): a position inside the second or third chunk of a
    shard, with dropped rows in every chunk, continues exactly."""
    root = tmp_path / "big"
    root.mkdir()
    for i in range(3):
        rows = [json.dumps(_chat(i, j, "" if j % 7 == 3 else None)) for j in range(350)]
        (root / f"part-{i}.jsonl").write_text("\n".join(rows) + "\n")
    listing = list_shards(str(root), field="data.train")
    kw = {"shuffle_buffer": 50, "chunk_bytes": 1000}
    full = _take(_stream(listing, **kw))
    assert len(full) == 3 * 300
    for n in (130, 250, 301, 640):
        first = _stream(listing, **kw)
        _take(first, n)
        assert _take(_resumed(listing, first.state_dict(), **kw)) == full[n:], n


@pytest.mark.parametrize(
    "change, what",
    [
        (
            lambda d: (d / "shard-00020.jsonl").write_text(json.dumps(_chat(20, 0)) + "\n"),
            "{d}/shard-00020.jsonl was added",
        ),
        (lambda d: (d / "shard-00005.jsonl").unlink(), "{d}/shard-00005.jsonl was removed"),
        (
            lambda d: (d / "shard-00003.jsonl").write_text("\n".join(_shard_lines(3)[:-1]) + "\n"),
            "{d}/shard-00003.jsonl was rewritten (size {old} -> {new}, version",
        ),
    ],
)
def test_a_changed_listing_is_refused_at_resume(shards, change, what):
    listing = list_shards(str(shards), field="data.train")
    stream = _stream(listing, shuffle_buffer=4)
    _take(stream, 30)
    state = stream.state_dict()
    old = (shards / "shard-00003.jsonl").stat().st_size
    change(shards)
    new = (shards / "shard-00003.jsonl").stat().st_size
    with pytest.raises(KubetuneError) as e:
        _resumed(list_shards(str(shards), field="data.train"), state, shuffle_buffer=4)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith(f"data.train: {shards} changed since the checkpoint was taken: ")
    assert what.format(d=shards, old=old, new=new) in msg
    assert msg.endswith(
        ", so the stream would not continue the same run — restore the data the run started with, "
        "use another output.uri, or pass --no-resume (training.resume: never)"
    )


def test_another_shuffle_buffer_or_seed_is_refused_at_resume(shards):
    listing = list_shards(str(shards), field="data.train")
    stream = _stream(listing, shuffle_buffer=4)
    _take(stream, 10)
    with pytest.raises(KubetuneError) as e:
        _resumed(listing, stream.state_dict(), shuffle_buffer=8)
    assert str(e.value) == (
        "data.shuffle_buffer: the checkpoint's stream was read with data.shuffle_buffer 4, this run has 8 — "
        "restore the original setting, use another output.uri, or pass --no-resume (training.resume: never)"
    )
    with pytest.raises(KubetuneError, match=r"^training.seed: the checkpoint's stream was read with training.seed 7"):
        _resumed(listing, stream.state_dict(), shuffle_buffer=4, seed=8)


def test_a_corrupt_shard_stops_the_stream_naming_it_and_the_line(shards):
    lines = _shard_lines(7)
    (shards / "shard-00007.jsonl").write_text("\n".join([*lines[:2], "not json {", *lines[2:]]) + "\n")
    stream = _stream(_listing := list_shards(str(shards), field="data.train"))
    got = []
    with pytest.raises(KubetuneError) as e:
        for row in stream:
            got.append(_key(row))
    assert got == [k for k in _expected() if int(k.split()[1].split(".")[0]) < 7]  # shards 0-6, then the error
    assert str(e.value) == (
        f"data.train: cannot parse '{shards}/shard-00007.jsonl' as jsonl: Unexpected character found when decoding "
        "'null' at position 187 (line 3) — check that the file is valid jsonl"
    )
    assert stream.state_dict()["shard"] == 6  # the position of the last row handed out: a checkpoint stays valid
    with pytest.raises(KubetuneError, match="shard-00007.jsonl"):  # again, not an epoch taken for ended
        next(stream)


def test_a_row_the_normalizer_refuses_names_the_shard_and_row(shards):
    rows = [json.dumps(_chat(9, 0)), json.dumps({"messages": "not a list"})]
    (shards / "shard-00009.jsonl").write_text("\n".join(rows) + "\n")
    with pytest.raises(KubetuneError) as e:
        _take(_stream(list_shards(str(shards), field="data.train")))
    assert str(e.value) == (
        f"data.messages_column: row 1 of {shards}/shard-00009.jsonl: column 'messages' holds text that is not a "
        "JSON list of messages — store a list of {role, content} objects per row"
    )


def test_a_shard_with_no_usable_rows_fails_its_checks_named_by_the_stream(shards):
    """The normalizer's whole-table checks run per shard; an error that does not name the shard
    (this factory names the directory) is prefixed with it."""
    (shards / "shard-00004.jsonl").write_text(json.dumps(_chat(4, 0, "")) + "\n")
    listing = list_shards(str(shards), field="data.train")
    stream = Stream(
        listing,
        normalizer_factory=lambda shard: _Normalizer(
            CausalLMData(train=str(shards), format="chat"), "data.train", None
        ),
        field="data.train",
    )
    with pytest.raises(KubetuneError) as e:
        _take(stream)
    assert str(e.value) == (
        f"data.train: {shards}/shard-00004.jsonl: no usable rows in {shards} (format chat) — check the data and the "
        "data.*_column settings"
    )


def test_a_local_shard_rewritten_mid_stream_stops_it(shards):
    stream = _stream(list_shards(str(shards), field="data.train"))
    _take(stream, 5)
    (shards / "shard-00010.jsonl").write_text("\n".join(_shard_lines(10)[:1]) + "\n")
    with pytest.raises(KubetuneError) as e:
        _take(stream)
    assert str(e.value) == (
        f"data.train: {shards}/shard-00010.jsonl is no longer the version listed when the stream started (rewritten "
        "or removed since) — leave the data unchanged while a run reads it: restore it and resume, or pass --no-resume"
    )


def test_slot_deals_each_micro_batch_round_robin():
    # global batch 8 = 2 ranks × batch 2 × grad_accum 2: positions 0-3 are micro-batch 0, 4-7 micro-batch 1
    got = [tuple(vars(slot(i, world_size=2, batch_size=2, grad_accum=2)).values()) for i in range(10)]
    assert got == [(0, 0, 0), (0, 0, 1), (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (0, 1, 0), (0, 1, 1)] + [
        (1, 0, 0),
        (1, 0, 1),
    ]


def _run(listing, world_size: int, grad_accum: int, *, steps: int | None = None, state: dict | None = None):
    """Every rank's rows of the epoch (or of ``steps`` steps), each rank reading its own stream, and
    the streams' states at the end (all equal)."""
    out, states = [], []
    for rank in range(world_size):
        stream = _resumed(listing, state, shuffle_buffer=8) if state else _stream(listing, shuffle_buffer=8)
        taken = list(
            itertools.islice(
                rank_steps(stream, rank=rank, world_size=world_size, batch_size=2, grad_accum=grad_accum), steps
            )
        )
        out.append(taken)
        states.append(stream.state_dict())
    assert all(s == states[0] for s in states)
    assert len({len(t) for t in out}) == 1  # every rank makes as many steps
    return out, states[0]


@pytest.mark.parametrize("world_size, grad_accum", [(1, 4), (2, 2), (4, 1)])
def test_every_row_once_across_ranks(shards, world_size, grad_accum):
    listing = list_shards(str(shards), field="data.train")
    full = _take(_stream(listing, shuffle_buffer=8))
    per_rank, _ = _run(listing, world_size, grad_accum)
    for steps in zip(*per_rank):
        assert len({s.global_count for s in steps}) == 1
        if steps[0].global_count == 8:  # a full step: batch_size rows per rank and micro-batch
            assert all(len(m) == 2 for s in steps for m in s.micro)
    consumed = [_key(r) for steps in per_rank for s in steps for m in s.micro for r in m]
    assert sorted(consumed) == sorted(full) and len(consumed) == len(set(consumed))
    # in the order of the stream: step by step, micro-batch by micro-batch, rank by rank
    for steps in zip(*per_rank):
        start = steps[0].index
        for rank, s in enumerate(steps):
            for m, rows in enumerate(s.micro):
                lo = start + m * world_size * 2
                assert [_key(r) for r in rows] == full[lo : lo + world_size * 2][rank::world_size]


def test_a_resume_on_another_world_size_neither_repeats_nor_skips(shards):
    listing = list_shards(str(shards), field="data.train")
    full = _take(_stream(listing, shuffle_buffer=8))
    before, state = _run(listing, 2, 2, steps=3)  # 2 ranks × batch 2 × grad_accum 2, checkpoint after step 3
    after, end = _run(listing, 1, 4, state=state)  # 1 rank × batch 2 × grad_accum 4: the same global batch
    assert state["index"] == 24 and end["index"] == len(full)
    consumed = [_key(r) for ranks in (before, after) for steps in ranks for s in steps for m in s.micro for r in m]
    assert sorted(consumed) == sorted(full) and len(consumed) == len(set(consumed))
    assert [_key(r) for s in after[0] for m in s.micro for r in m] == full[24:]


# ---------------------------------------------------------------- from an s3:// prefix


ENV = S3Settings()  # the moto fixture points S3_ENDPOINT_URL at its server


@pytest.fixture
def s3_shards(moto, s3, shards):  # noqa: F811
    prefix = f"stream/{shards.parent.name}/chat"
    for path in sorted(shards.glob("shard-*.jsonl")):
        s3.upload_file(str(path), BUCKET, f"{prefix}/{path.name}")
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/_kubetune_manifest.json", Body=b"{}")  # kubetune's, not data
    s3.put_object(Bucket=BUCKET, Key=f"{prefix}/.hidden/x.jsonl", Body=b"not json\n")
    return f"s3://{BUCKET}/{prefix}"


@pytest.mark.integration
def test_the_same_stream_from_s3_one_shard_on_disk_at_a_time(s3_shards, shards, tmp_path):
    listing = list_shards(s3_shards, field="data.train", s3=ENV)
    local = list_shards(str(shards), field="data.train")
    assert [(s.name, s.size) for s in listing.shards] == [(s.name, s.size) for s in local.shards]
    assert all(s.version.startswith('"') and s.uri == f"{s3_shards}/{s.name}" for s in listing.shards)
    full = _take(_stream(local, shuffle_buffer=8))
    staging = tmp_path / "staging"
    staging.mkdir()
    stream = _stream(listing, shuffle_buffer=8, s3=ENV, tmp_dir=staging)
    got, held = [], []
    for row in stream:
        got.append(_key(row))
        files = list(staging.iterdir())
        held.append(len(files))
        assert all(f.stat().st_size == listing.shards[stream.shard].size for f in files)
    assert got == full
    assert max(held) == 1 and list(staging.iterdir()) == []  # one shard at a time, none left
    # resume from S3 (at a shard's middle), then close half-way: the shard being read is deleted
    first = _stream(listing, shuffle_buffer=8, s3=ENV, tmp_dir=staging)
    _take(first, 33)
    first.close()
    assert list(staging.iterdir()) == []
    second = _resumed(listing, first.state_dict(), shuffle_buffer=8, s3=ENV, tmp_dir=staging)
    with second:
        assert _take(second, 20) == full[33:53]
        assert len(list(staging.iterdir())) == 1  # the shard it is reading, until it is closed
    third = _resumed(listing, second.state_dict(), shuffle_buffer=8, s3=ENV, tmp_dir=staging)
    assert list(staging.iterdir()) == []
    assert _take(third) == full[53:] and list(staging.iterdir()) == []


@pytest.mark.integration
def test_an_s3_shard_rewritten_is_refused_mid_stream_and_at_resume(s3_shards, s3, tmp_path):  # noqa: F811
    listing = list_shards(s3_shards, field="data.train", s3=ENV)
    staging = tmp_path / "staging"
    staging.mkdir()
    stream = _stream(listing, s3=ENV, tmp_dir=staging)
    _take(stream, 5)
    state = stream.state_dict()
    key = f"{s3_shards.removeprefix(f's3://{BUCKET}/')}/shard-00012.jsonl"
    s3.put_object(Bucket=BUCKET, Key=key, Body=("\n".join(_shard_lines(12)[:2]) + "\n").encode())
    with pytest.raises(KubetuneError) as e:
        _take(stream)
    assert str(e.value).startswith(
        f"data.train: {s3_shards}/shard-00012.jsonl is no longer the version listed when the stream started"
    )
    with pytest.raises(KubetuneError) as e:
        _resumed(list_shards(s3_shards, field="data.train", s3=ENV), state, s3=ENV)
    assert f": {s3_shards}/shard-00012.jsonl was rewritten (size " in str(e.value)
    assert list(staging.iterdir()) == []


@pytest.mark.integration
def test_a_corrupt_s3_shard_is_named_by_its_uri(s3_shards, s3, tmp_path):  # noqa: F811
    key = f"{s3_shards.removeprefix(f's3://{BUCKET}/')}/shard-00007.jsonl"
    s3.put_object(Bucket=BUCKET, Key=key, Body=b"\x00\x01binary\n")
    staging = tmp_path / "staging"
    staging.mkdir()
    stream = _stream(list_shards(s3_shards, field="data.train", s3=ENV), s3=ENV, tmp_dir=staging)
    with pytest.raises(KubetuneError) as e:
        _take(stream)
    assert str(e.value).startswith(
        f"data.train: '{s3_shards}/shard-00007.jsonl' holds NUL bytes in its first 64 KiB: binary data, not jsonl text"
    )
    assert list(staging.iterdir()) == []


@pytest.mark.integration
def test_an_s3_prefix_lists_in_a_directory_s_order_and_one_object_is_one_shard(moto, s3, tmp_path):  # noqa: F811
    names = ["b.jsonl", "a/x.jsonl", "a/c/y.jsonl", "a/z.jsonl", "z/w.jsonl", "__pycache__/q.jsonl", "notes.md"]
    for name in names:
        path = tmp_path / "tree" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(_chat(0, 0)) + "\n")
        s3.upload_file(str(path), BUCKET, f"tree/{name}")
    local = [s.name for s in list_shards(str(tmp_path / "tree"), field="data.train").shards]
    assert local == ["b.jsonl", "a/x.jsonl", "a/z.jsonl", "a/c/y.jsonl", "z/w.jsonl"]  # os.walk's order
    assert [s.name for s in list_shards(f"s3://{BUCKET}/tree", field="data.train", s3=ENV).shards] == local
    one = list_shards(f"s3://{BUCKET}/tree/a/x.jsonl", field="data.train", s3=ENV)
    assert [(s.name, s.uri) for s in one.shards] == [("x.jsonl", f"s3://{BUCKET}/tree/a/x.jsonl")]
    with pytest.raises(KubetuneError) as e:
        list_shards(f"s3://{BUCKET}/no/such/prefix", field="data.train", s3=ENV)
    assert str(e.value) == (
        f"data.train: no data files under s3://{BUCKET}/no/such/prefix ({moto.url}) — check the bucket and prefix: "
        "streaming reads .csv, .tsv, .jsonl, .json, .parquet objects"
    )


def test_streaming_spec_problems_are_one_line_each():
    from kubetune.config.load import parse_spec

    raw = {
        "name": "s",
        "task": "causal-lm",
        "model": {"uri": "pkg://kubetune/assets/tiny-llama"},
        "data": {"train": "s3://b/shards/", "streaming": True, "packing": True, "max_tokens_per_batch": 512},
        "output": {"uri": "/tmp/x"},
    }
    with pytest.raises(KubetuneError) as e:
        parse_spec(raw)
    lines = e.value.problems
    for needed in ("needs data.eval", "max_tokens_per_batch is not supported", "needs training.max_steps"):
        assert sum(needed in line for line in lines) == 1, lines
    ok = parse_spec(
        {**raw, "data": {**raw["data"], "eval": "e.jsonl", "max_tokens_per_batch": None}, "training": {"max_steps": 5}}
    )
    assert ok.data.streaming and ok.data.shuffle_buffer == 1000
    assert not parse_spec({**raw, "data": {"train": "t.jsonl"}}).data.streaming  # off by default


def test_a_rank_s_encoding_error_stops_every_rank_in_one_line(shards):
    """A row the task cannot encode fails on the rank that holds it only: the step's all-reduce
    carries the failure, so every rank raises the first message (as an AgreedError) instead of
    waiting for that rank at the next collective (one process here: its all-reduce is the identity)."""
    from kubetune.data.feed import Feed
    from kubetune.errors import AgreedError

    listing = list_shards(str(shards), field="data.train")

    def encode(rows):
        if any(_key(r) == "a 3.1" for r in rows):
            raise KubetuneError("the chat template does not reproduce assistant turns verbatim", field="model.uri")
        return {"n": [1] * len(rows)}

    def collate(cols, ids):
        from kubetune.data import Batch

        return Batch({"input_ids": torch.zeros(max(len(ids), 1), 1)}, torch.zeros(1))

    feed = Feed(
        listing,
        {"normalizer_factory": _factory, "field": "data.train", "shuffle_buffer": 0},
        encode,
        collate,
        lambda cols: np.asarray(cols["n"]),
    )
    steps = feed.steps(0, rank=0, world_size=1, batch_size=2, grad_accum=1, all_reduce=lambda t: t)
    with pytest.raises(AgreedError, match="^model.uri: the chat template does not reproduce"):
        list(steps)
