"""A finished staging's size, measured on the forked workers, equals the one-process
walk's (``sum_sizes``) on trees with files, links (to files, folders, nowhere),
FIFOs and nesting, whether the tree is measured inline or on workers."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from stager.fs import sizes
from stager.fs.sources import sum_sizes


def generated_tree(root: Path, seed: int, files: int) -> None:
    rng = random.Random(seed)
    folders = [root]
    root.mkdir()
    for i in range(files):
        if rng.random() < 0.05:
            child = rng.choice(folders) / f"dir{i}"
            child.mkdir()
            folders.append(child)
            continue
        folder = rng.choice(folders)
        kind = rng.random()
        if kind < 0.8:
            (folder / f"f{i}").write_bytes(b"x" * rng.randrange(0, 3000))
        elif kind < 0.9:
            target = rng.choice(["/etc/hostname", "../nowhere", str(rng.choice(folders))])
            os.symlink(target, folder / f"l{i}")
        else:
            os.mkfifo(folder / f"p{i}")


@pytest.mark.parametrize("seed", [1, 2, 3])
@pytest.mark.parametrize("parallel_after", [10**9, 50], ids=["inline", "workers"])
def test_tree_bytes_equals_the_single_process_walk(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, seed: int, parallel_after: int
) -> None:
    monkeypatch.setattr(sizes, "PARALLEL_AFTER", parallel_after)
    monkeypatch.setattr(sizes, "BATCH", 16)
    generated_tree(tmp_path / "tree", seed, files=600)
    expected = sum_sizes(str(tmp_path / "tree"))
    assert expected > 0
    assert sizes.tree_bytes(tmp_path / "tree", workers=2) == expected
