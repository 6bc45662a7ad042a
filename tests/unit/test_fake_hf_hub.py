"""The fake Hugging Face Hub answers the real `huggingface_hub` client the way the Hub does.

Every call passes endpoint= and token= explicitly (huggingface_hub reads HF_ENDPOINT and HF_TOKEN
once, at import), and each test gets its own FakeHub, so nothing leaks between tests.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from fakes.hf_hub import FakeHub
from huggingface_hub import HfApi, constants, snapshot_download
from huggingface_hub.errors import HfHubHTTPError, RepositoryNotFoundError

# huggingface_hub 2.4 hands the LFS PUT its file object as `data=`, which httpx2 deprecates: the
# client's warning, not the fake's, so it must not fail a run with -W error.
pytestmark = pytest.mark.filterwarnings("ignore:Use 'content=:DeprecationWarning")

REPO = "kubetune-bot/tiny-classifier"
WEIGHTS = "weights/model.bin"


@pytest.fixture(autouse=True)
def online(monkeypatch: pytest.MonkeyPatch) -> None:
    # tests/conftest.py sets HF_HUB_OFFLINE=1 for the whole session, and huggingface_hub's request
    # hook then refuses every request, uploads included; lift it for these tests only.
    # constants.is_offline_mode() reads this module attribute on each request, and no module copies it.
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)


@pytest.fixture
def plain_lfs(monkeypatch: pytest.MonkeyPatch) -> None:
    """Upload "lfs" files over plain Git LFS: with hf_xet installed, huggingface_hub would use Xet,
    which the fake does not speak. is_xet_available() reads this attribute on each call."""
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", True)


@pytest.fixture
def hub() -> Iterator[FakeHub]:
    with FakeHub(token="hf_test_token") as server:
        yield server


@pytest.fixture
def api(hub: FakeHub) -> HfApi:
    return HfApi(endpoint=hub.url, token=hub.token)


@pytest.fixture
def model_dir(tmp_path: Path) -> Path:
    """What a push sends: a small config, a model card with metadata and a 12.6 MB random binary,
    which is over the fake's 10 MB LFS threshold."""
    folder = tmp_path / "model"
    (folder / "weights").mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps({"num_labels": 3, "model_type": "bert"}))
    (folder / "README.md").write_text("---\nlibrary_name: transformers\n---\n\n# tiny-classifier\n")
    (folder / WEIGHTS).write_bytes(os.urandom(12 * 1024 * 1024))
    return folder


def _contents(folder: Path) -> dict[str, bytes]:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _push(api: HfApi, folder: Path, message: str = "kubetune tiny: eval accuracy 0.9000") -> str:
    api.create_repo(REPO, private=True, exist_ok=True)
    return api.upload_folder(folder_path=folder, repo_id=REPO, commit_message=message).oid


def test_push_to_a_private_repo_stores_regular_and_lfs_files_byte_for_byte(
    hub: FakeHub, api: HfApi, model_dir: Path, plain_lfs: None
) -> None:
    url = api.create_repo(REPO, private=True, exist_ok=True)
    info = api.upload_folder(folder_path=model_dir, repo_id=REPO, commit_message="kubetune tiny: eval accuracy 0.9000")

    assert url.repo_id == REPO and url.startswith(hub.url)
    assert hub.repo(REPO) == {"id": REPO, "type": "model", "private": True, "sha": info.oid}
    assert info.commit_url == f"{hub.url}/{REPO}/commit/{info.oid}"
    files = hub.files(REPO)
    assert files.pop(".gitattributes")  # the Hub writes it when it creates a repo
    assert files == _contents(model_dir)
    last = hub.commits(REPO)[-1]
    assert last["oid"] == info.oid and last["message"] == "kubetune tiny: eval accuracy 0.9000"
    assert sorted(last["files"]) == ["README.md", "config.json", WEIGHTS]
    assert last["lfs_files"] == [WEIGHTS]
    # the big file took the LFS road: batch, a presigned PUT on the storage host, verify
    paths = [path for _, path in hub.requests]
    assert f"/{REPO}.git/info/lfs/objects/batch" in paths and f"/{REPO}.git/info/lfs/objects/verify" in paths
    assert any(path.startswith("/upload/models/") for path in paths)


def test_create_repo_with_exist_ok_again_is_a_no_op(hub: FakeHub, api: HfApi) -> None:
    first = api.create_repo(REPO, private=True)
    again = api.create_repo(REPO, private=True, exist_ok=True)

    assert again == first
    assert len(hub.commits(REPO)) == 1
    with pytest.raises(HfHubHTTPError) as err:
        api.create_repo(REPO, private=True)
    assert err.value.response.status_code == 409


@pytest.mark.parametrize("exist_ok", [False, True])
def test_a_wrong_token_is_a_401(hub: FakeHub, exist_ok: bool) -> None:
    intruder = HfApi(endpoint=hub.url, token="hf_wrong_token")

    with pytest.raises(HfHubHTTPError) as err:
        intruder.create_repo(REPO, private=True, exist_ok=exist_ok)

    assert err.value.response.status_code == 401
    assert "Invalid credentials in Authorization header" in str(err.value)
    with pytest.raises(KeyError):
        hub.repo(REPO)


def test_whoami_names_the_token_owner(hub: FakeHub, api: HfApi) -> None:
    assert api.whoami()["name"] == hub.user == REPO.split("/")[0]


def test_snapshot_download_returns_what_was_pushed(
    hub: FakeHub, api: HfApi, model_dir: Path, tmp_path: Path, plain_lfs: None
) -> None:
    commit = _push(api, model_dir)

    cached = Path(snapshot_download(REPO, endpoint=hub.url, token=hub.token, cache_dir=tmp_path / "cache"))
    local = Path(
        snapshot_download(
            REPO, endpoint=hub.url, token=hub.token, cache_dir=tmp_path / "cache2", local_dir=tmp_path / "pulled"
        )
    )

    assert cached.name == commit
    assert _contents(cached) == hub.files(REPO)
    pulled = {p: data for p, data in _contents(local).items() if not p.startswith(".cache/")}
    assert pulled == hub.files(REPO)
    # LFS content came from the storage host, through the signed redirect of /resolve
    assert any(method == "GET" and path.startswith("/download/") for method, path in hub.requests)


def test_a_private_repo_is_hidden_from_anonymous_readers(
    hub: FakeHub, api: HfApi, model_dir: Path, tmp_path: Path, plain_lfs: None
) -> None:
    _push(api, model_dir)

    with pytest.raises(RepositoryNotFoundError) as err:
        snapshot_download(REPO, endpoint=hub.url, token=False, cache_dir=tmp_path / "cache")

    assert err.value.response.status_code == 401


def test_an_unchanged_push_makes_no_commit_and_a_change_commits_only_that_file(
    hub: FakeHub, api: HfApi, model_dir: Path, plain_lfs: None
) -> None:
    first = _push(api, model_dir)
    again = _push(api, model_dir)
    (model_dir / "config.json").write_text(json.dumps({"num_labels": 4}))
    third = _push(api, model_dir, message="relabel")

    assert again == first
    assert [c["message"] for c in hub.commits(REPO)][1:] == ["kubetune tiny: eval accuracy 0.9000", "relabel"]
    assert hub.commits(REPO)[-1]["oid"] == third and hub.commits(REPO)[-1]["files"] == ["config.json"]
    assert hub.files(REPO)["config.json"] == b'{"num_labels": 4}'


def test_a_client_with_xet_pushes_everything_as_regular_files_when_lfs_is_off(
    model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)  # huggingface_hub's default with hf_xet installed
    with FakeHub(lfs_threshold=None) as hub:
        commit = _push(HfApi(endpoint=hub.url, token=hub.token), model_dir)

        last = hub.commits(REPO)[-1]
        assert last["oid"] == commit and last["lfs_files"] == []
        assert sorted(last["files"]) == ["README.md", "config.json", WEIGHTS]
        assert {k: v for k, v in hub.files(REPO).items() if k != ".gitattributes"} == _contents(model_dir)
        assert not any(".git/info/lfs" in path or "xet" in path for _, path in hub.requests)


def test_a_client_with_xet_is_told_the_fake_has_no_xet(
    hub: FakeHub, api: HfApi, model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(constants, "HF_HUB_DISABLE_XET", False)

    # hf_xet reports the failed token request as a builtin ConnectionError naming the URL and status
    with pytest.raises(Exception, match=r"501.*xet-write-token"):
        _push(api, model_dir)

    assert len(hub.commits(REPO)) == 1


def test_fail_next_answers_the_next_requests_with_the_status(hub: FakeHub, api: HfApi) -> None:
    hub.fail_next(500)

    with pytest.raises(HfHubHTTPError) as err:
        api.create_repo(REPO)  # create_repo does not retry, so the one failure reaches the caller

    assert err.value.response.status_code == 500
    api.create_repo(REPO)
    assert hub.repo(REPO)["private"] is False
