"""Extraction is a stream: its memory does not grow with the number of members.

No list of every member (header, name, job) may be held; what it keeps is bounded
by the batches in flight and by the folders (whose times are set at the end, as GNU
tar does). At 1M files that is issue 14's "peak RSS within 10% of 100k" (measured in
bench/, docs/benchmarks.md); here the same promise at a small size, without timing:
Python's own allocation peak (tracemalloc) for 8x the members in the same folders
may grow by far less than one small record per extra member.
"""

from __future__ import annotations

import gzip
import sys
import tracemalloc
from pathlib import Path
from types import ModuleType

import pytest

from bench.datagen import make_small_tar
from stager.archive import writer
from stager.ops import extract
from stager.ops.base import OpContext
from stager.ops.extract import ExtractStep
from stager.wire.progress import Progress

FEW, MANY = 1_500, 12_000
PER_MEMBER = 40  # bytes: less than any record of a member (a str alone is 49+)


def modules_holding(name: str) -> list[ModuleType]:
    """Every loaded stager module with its own binding of ``name`` (each module that
    imports a constant holds a copy: patching one of them misses the others)."""
    return [
        module
        for key, module in list(sys.modules.items())
        if key.startswith("stager.") and hasattr(module, name)
    ]


def allocation_peak(archive: Path, dest: Path) -> int:
    tracemalloc.start()
    try:
        ctx = OpContext(root=dest, progress=Progress(), workers=2)
        extract.run(ExtractStep(src=str(archive)), ctx)
        assert ctx.progress.snapshot().files_done > 0
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


@pytest.mark.parametrize("compress", ["", "gz"])
def test_memory_does_not_grow_with_the_member_count(
    compress: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # What is in flight (a few batches of names and jobs, a few chunks of decompressed
    # data) is bounded but, at full size, larger than a small archive: small batches
    # and chunks put both counts past that bound.
    monkeypatch.setattr(writer, "_BATCH_FILES", 16)
    for module in modules_holding("STREAM_CHUNK"):
        monkeypatch.setattr(module, "STREAM_CHUNK", 64 << 10)
    peaks = {}
    for count in (FEW, MANY):
        archive = make_small_tar(tmp_path / f"{count}.tar", count, size=100, n_dirs=30)
        if compress:
            data = archive.read_bytes()
            archive = archive.with_suffix(".tar.gz")
            archive.write_bytes(gzip.compress(data, compresslevel=1))
        peaks[count] = allocation_peak(archive, tmp_path / f"out-{count}")
        assert len(list((tmp_path / f"out-{count}").rglob("*.jpg"))) == count
    growth = peaks[MANY] - peaks[FEW]
    print(f"allocation peak: {peaks[FEW]} B for {FEW} members, {peaks[MANY]} B for {MANY}")
    assert growth < (MANY - FEW) * PER_MEMBER, peaks
