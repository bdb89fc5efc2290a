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


def test_an_output_that_is_a_folder_the_source_or_nowhere_is_a_usage_error(
    tmp_path: Path,
) -> None:
    """The image is renamed onto the output at the end: built onto its own source tar
    (through any name of it) it replaced the archive with its image; onto a folder, or
    into a folder that does not exist, it failed after the whole build naming a
    ``.partial`` path. Each is refused first, the source left as it was."""
    tree = tar_corpus.basic_tree(tmp_path / "src" / "train")
    archive = tmp_path / "train.tar"
    tar_corpus.gnu_tar("-cf", archive, "-C", tree.parent, "train")
    before = archive.read_bytes()
    (tmp_path / "same.tar").hardlink_to(archive)
    cases = [
        (archive, archive, "is the source itself"),
        (archive, tmp_path / "same.tar", "is the source itself"),
        (archive, tmp_path / "out", "is a folder"),
        (tree, tree, "is a folder"),
        (archive, tmp_path / "none" / "x.erofs", "does not exist"),
    ]
    (tmp_path / "out").mkdir()
    for source, output, words in cases:
        done = _stager("build", str(source), "-o", str(output))
        assert done.returncode == 2 and words in done.stderr, (output, done.stderr)
        assert f"output {output}" in done.stderr and "Traceback" not in done.stderr
        assert archive.read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "same.tar", "src", "train.tar"]


def test_an_unsafe_archive_fails_with_one_sentence(tmp_path: Path) -> None:
    archive = tmp_path / "evil.tar"
    tar_corpus.gnu_tar("-cf", archive, "-C", "/", "--absolute-names", "/etc/hostname")
    done = _stager("build", str(archive), "-o", str(tmp_path / "evil.erofs"))
    assert done.returncode == 1
    assert "unsafe member '/etc/hostname' (absolute path)" in done.stderr
    assert "Traceback" not in done.stderr
