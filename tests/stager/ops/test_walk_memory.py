"""The scale promise at a size CI can afford: walking a tree holds no per-file state.

Issue 14's memory goal (daemon plus workers within 10% from 100k to 1M files) is
measured by ``bench/bench_scale.py``; here the same mechanism is checked at a few
thousand files, without any timing: the Python heap's peak while copying, linking,
fingerprinting and deleting a tree of 8x the files (2,400 against 300) must stay within a few KB of
the small tree's. A list of every file (its names: ~60 bytes each at the least)
would add hundreds of KB and fail.
"""

from __future__ import annotations

import os
import threading
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from stager.fs.deletion import delete_tree
from stager.ops import copy, symlink
from stager.ops.base import OpContext
from stager.ops.copy import CopyStep
from stager.ops.symlink import SymlinkStep
from stager.request.fingerprint import sources_fingerprint
from stager.wire.progress import Progress

PER_FOLDER = 50
SMALL, LARGE = 300, 2_400
# What the larger walk may add to the peak: much less than one name per extra file
# ((LARGE - SMALL) files x 60 bytes = 126 KB), more than allocator noise.
SLACK_BYTES = 64 * 1024


def small_files(root: Path, n: int) -> Path:
    """``n`` files of 64 bytes, ``PER_FOLDER`` to a folder (more files, more folders)."""
    for i in range(n):
        folder = root / f"c{i // PER_FOLDER:04d}"
        if i % PER_FOLDER == 0:
            folder.mkdir(parents=True)
        fd = os.open(folder / f"img_{i:06d}.jpg", os.O_WRONLY | os.O_CREAT, 0o644)
        os.write(fd, i.to_bytes(64, "little"))
        os.close(fd)
    return root


def peak_bytes(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def measure(src: Path, out: Path) -> dict[str, int]:
    """The heap's peak during each walk of ``src`` (copy, link, fingerprint, delete)."""
    ctx = OpContext(root=out, progress=Progress(), workers=2)
    out.mkdir()
    peaks = {
        "copy": peak_bytes(lambda: copy.run(CopyStep(src=str(src), dst="copy"), ctx)),
        "symlink tree": peak_bytes(
            lambda: symlink.run(SymlinkStep(src=str(src), dst="links", mode="tree"), ctx)
        ),
        "deep fingerprint": peak_bytes(
            lambda: sources_fingerprint([CopyStep(src=str(src))], deep=True)
        ),
    }
    files = sum(len(names) for _, _, names in os.walk(src))
    for made in ("copy", "links"):
        assert sum(len(names) for _, _, names in os.walk(out / made)) == files
    peaks["delete"] = peak_bytes(lambda: delete_tree(out / "copy", threading.Event()))
    assert not (out / "copy").exists()
    return peaks


@pytest.mark.parametrize("pool", ["inline", "processes"])
def test_walks_hold_no_per_file_state(
    pool: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Inline: every file passes through this process. Processes: this process walks
    # and hands chunks to forked workers (at most a few queued), as at 1M files.
    # Chunks are made small so that the queue of chunks in flight (bounded, whatever
    # the tree) is full at both sizes, as it is through most of a 1M-file walk.
    after = 0 if pool == "processes" else 10**9
    monkeypatch.setattr(copy, "PARALLEL_AFTER_FILES", after)
    monkeypatch.setattr(symlink, "PARALLEL_AFTER_FILES", after)
    monkeypatch.setattr(copy, "BATCH_FILES", 8)
    monkeypatch.setattr(copy, "LARGE_BATCH_FILES", 8)  # chunks grow up to it: bounded
    monkeypatch.setattr(symlink, "BATCH", 8)
    # Once unmeasured, on a few files: imports and caches, filled at any size.
    measure(small_files(tmp_path / "src-warm", 20), tmp_path / "out-warm")
    peaks = {
        n: measure(small_files(tmp_path / f"src-{n}", n), tmp_path / f"out-{n}")
        for n in (SMALL, LARGE)
    }
    for what in peaks[SMALL]:
        grown = peaks[LARGE][what] - peaks[SMALL][what]
        assert grown < SLACK_BYTES, (
            f"{what}: the peak grew by {grown} bytes from {SMALL} to {LARGE} files "
            f"({peaks[SMALL][what]} -> {peaks[LARGE][what]}): something keeps per-file state"
        )
