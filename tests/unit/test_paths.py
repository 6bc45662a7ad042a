"""Names from elsewhere never write outside their destination; files honour the umask."""

from __future__ import annotations

import os
import stat

import pytest

from kubetune.errors import KubetuneError
from kubetune.paths import check_relative, check_tree_inside, replace_dir, safe_join, write_atomic

HOSTILE = [
    "../x",
    "a/../../x",
    "data/../../../../tmp/x",
    "/tmp/x",
    "a//b",
    "./a",
    "a/./b",
    "a/..",
    "",
    "a\x00b",
    "..\\x",
    "a/",
]


@pytest.mark.parametrize("name", HOSTILE, ids=repr)
def test_hostile_names_are_refused_in_one_line(tmp_path, name):
    with pytest.raises(KubetuneError) as e:
        safe_join(tmp_path / "dest", name, what="bucket 'b', key 'k'")
    line = str(e.value)
    assert "\n" not in line and line.startswith("bucket 'b', key 'k':") and len(line) < 300
    assert list(tmp_path.iterdir()) == []  # nothing was created on the way


@pytest.mark.parametrize("name", ["config.json", "model/config.json", "a/b/c.d", ".hidden", "x..y"])
def test_plain_names_join(tmp_path, name):
    assert safe_join(tmp_path, name, what="w") == tmp_path / name
    assert str(check_relative(name, what="w")) == name


def test_a_symlinked_directory_inside_dest_cannot_lead_out(tmp_path):
    outside = tmp_path / "outside"
    outside.mkdir()
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "model").symlink_to(outside)
    with pytest.raises(KubetuneError, match="symbolic link outside"):
        safe_join(dest, "model/config.json", what="w")
    (dest / "file").symlink_to(outside / "f")
    with pytest.raises(KubetuneError, match="symbolic link"):
        safe_join(dest, "file", what="w")


def test_a_downloaded_tree_with_a_link_out_is_refused(tmp_path):
    (tmp_path / "repo" / "blobs").mkdir(parents=True)
    (tmp_path / "repo" / "blobs" / "b").write_text("x")
    snap = tmp_path / "repo" / "snapshots" / "c"
    snap.mkdir(parents=True)
    (snap / "ok.json").symlink_to("../../blobs/b")
    check_tree_inside(tmp_path / "repo", what="hf://o/r")
    (snap / "evil").symlink_to("/etc/passwd")
    with pytest.raises(KubetuneError, match="evil is a link to /etc/passwd"):
        check_tree_inside(tmp_path / "repo", what="hf://o/r")


@pytest.mark.parametrize("mask", [0o022, 0o002, 0o077])
def test_written_files_and_directories_honour_the_umask(tmp_path, mask):
    import kubetune.paths as paths

    old = os.umask(mask)
    paths.umask.cache_clear()  # read afresh
    try:
        write_atomic(tmp_path / "metrics.json", "{}")

        def build(d):
            (d / "weights").write_bytes(b"x")
            os.chmod(d / "weights", 0o600)  # as safetensors leaves its files
            (d / "sub").mkdir(mode=0o700)

        replace_dir(build, tmp_path / "model")
        assert stat.S_IMODE((tmp_path / "metrics.json").stat().st_mode) == 0o666 & ~mask
        assert stat.S_IMODE((tmp_path / "model").stat().st_mode) == 0o777 & ~mask
        assert stat.S_IMODE((tmp_path / "model" / "weights").stat().st_mode) == 0o666 & ~mask
        assert stat.S_IMODE((tmp_path / "model" / "sub").stat().st_mode) == 0o777 & ~mask
    finally:
        os.umask(old)
        paths.umask.cache_clear()
