"""``stager image build|mount|unmount`` as a user types them: no daemon."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests import tar_corpus


def _stager(*args: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "stager", "image", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=120)


def test_build_then_mount_and_unmount(tmp_path: Path) -> None:
    tree = tar_corpus.basic_tree(tmp_path / "src" / "train")
    archive = tmp_path / "train.tar.zst"
    tar_corpus.gnu_tar("--zstd", "-cf", archive, "-C", tree.parent, "train")
    image = tmp_path / "train.erofs"
    done = _stager("build", str(archive), "-o", str(image), "--rename", "train=2021_train")
    assert done.returncode == 0, done.stderr
    assert f"{image}: " in done.stderr and "files in" in done.stderr
    assert not (tmp_path / "train.erofs.partial").exists()
    if os.geteuid() != 0:
        pytest.skip("mounting in the kernel needs root")
    target = tmp_path / "mnt"
    target.mkdir()
    mounted = _stager("mount", str(image), str(target))
    try:
        assert mounted.returncode == 0, mounted.stderr
        assert "ro,nosuid,nodev" in mounted.stdout
        assert (target / "2021_train" / "a.txt").read_bytes() == b"alpha\n"
    finally:
        assert _stager("unmount", str(target)).returncode == 0
    assert not os.path.ismount(target)


def test_a_bad_source_or_rename_is_a_usage_error(tmp_path: Path) -> None:
    missing = _stager("build", str(tmp_path / "nope.tar"), "-o", str(tmp_path / "x.erofs"))
    assert missing.returncode == 2 and "does not exist" in missing.stderr
    (tmp_path / "a.tar").write_bytes(b"")
    bad = _stager("build", str(tmp_path / "a.tar"), "-o", "x.erofs", "--rename", "train")
    assert bad.returncode == 2 and "is not OLD=NEW" in bad.stderr


def test_an_unsafe_archive_fails_with_one_sentence(tmp_path: Path) -> None:
    archive = tmp_path / "evil.tar"
    tar_corpus.gnu_tar("-cf", archive, "-C", "/", "--absolute-names", "/etc/hostname")
    done = _stager("build", str(archive), "-o", str(tmp_path / "evil.erofs"))
    assert done.returncode == 1
    assert "unsafe member '/etc/hostname' (absolute path)" in done.stderr
    assert "Traceback" not in done.stderr
