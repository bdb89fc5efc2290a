"""The sources' fingerprint (part of the cache key) depends only on what every node of a
cluster sees alike, so that all nodes of a job compute the same key."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

from stager.ops.table import load
from stager.request.fingerprint import sources_fingerprint
from tests.trees import write_tree


def steps(src: Path) -> list:
    return load().validate_steps([{"op": "copy", "src": str(src)}])


def test_a_copy_with_new_inodes_but_the_same_sizes_and_mtimes_has_the_same_key(
    tmp_path: Path,
) -> None:
    # What another client of a FUSE network filesystem sees: same names, sizes and
    # mtimes, its own inode numbers.
    src = write_tree(tmp_path / "src", n_files=20)
    before = {p: p.stat().st_ino for p in src.rglob("*")}
    key = sources_fingerprint(steps(src), deep=True)
    moved = src.rename(tmp_path / "moved")
    shutil.copytree(moved, src, copy_function=shutil.copy2)
    for path in moved.iterdir():  # copytree keeps file mtimes; the children too
        os.utime(src / path.name, ns=(path.stat().st_atime_ns, path.stat().st_mtime_ns))
    os.utime(src, ns=(moved.stat().st_atime_ns, moved.stat().st_mtime_ns))
    assert any(p.stat().st_ino != ino for p, ino in before.items())
    assert sources_fingerprint(steps(src), deep=True) == key
    assert sources_fingerprint(steps(src)) == sources_fingerprint(steps(src))


def test_a_changed_size_or_mtime_changes_the_key(tmp_path: Path) -> None:
    src = write_tree(tmp_path / "src", n_files=5)
    one = next(p for p in src.rglob("*") if p.is_file())
    key = sources_fingerprint(steps(src), deep=True)
    info = one.stat()
    os.utime(one, ns=(info.st_atime_ns, info.st_mtime_ns + 1))
    touched = sources_fingerprint(steps(src), deep=True)
    assert touched != key
    one.write_bytes(one.read_bytes() + b"x")
    os.utime(one, ns=(info.st_atime_ns, info.st_mtime_ns + 1))
    assert sources_fingerprint(steps(src), deep=True) not in (key, touched)
