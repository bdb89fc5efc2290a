"""Deep paths: every walk over an archive's names or a tree's folders is a loop, never a
recursion, and a member deeper than ``MAX_DEPTH`` is refused by name.

Each walk is run under a recursion limit a little above the test's own depth: a walk
that recursed once per folder (the writer's, the image's, as on f55a66a, where a member
990 folders deep under 4,095 bytes raised RecursionError) fails here at any depth past
that margin, not only near the interpreter's 1,000.
"""

from __future__ import annotations

import contextlib
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from stager.archive.writer import MAX_DEPTH
from stager.core.errors import UnsafeArchiveMember
from stager.image.build import build_image
from stager.ops import extract
from stager.ops.base import OpContext
from stager.ops.extract import ExtractStep
from stager.wire.progress import Progress

# Frames a walk may use on top of the test's own: far fewer than the depths below.
_MARGIN = 150


@contextlib.contextmanager
def shallow_stack() -> Iterator[None]:
    """A recursion limit ``_MARGIN`` frames above the caller's depth."""
    depth, frame = 0, sys._getframe()
    while frame is not None:
        depth, frame = depth + 1, frame.f_back
    old = sys.getrecursionlimit()
    sys.setrecursionlimit(depth + _MARGIN)
    try:
        yield
    finally:
        sys.setrecursionlimit(old)


def deep_tar(tmp: Path, depth: int, gz: bool) -> Path:
    """A GNU tar of one empty file ``depth`` components deep (``--transform``)."""
    (tmp / "leaf").touch()
    deep = "/".join(["d"] * depth)
    archive = tmp / f"deep-{depth}.tar{'.gz' if gz else ''}"
    argv = ["tar", "-czf" if gz else "-cf", str(archive), "-C", str(tmp)]
    subprocess.run([*argv, "--transform", f"s|^leaf$|{deep}|", "leaf"], check=True)
    return archive


def run_extract(archive: Path, root: Path) -> None:
    ctx = OpContext(root=root, progress=Progress(), workers=2, verify="size")
    extract.run(ExtractStep(src=str(archive)), ctx)


@pytest.mark.parametrize("gz", [False, True], ids=["tar", "gz"])
def test_a_member_past_the_depth_limit_is_refused_by_name(tmp_path: Path, gz: bool) -> None:
    archive = deep_tar(tmp_path, 990, gz)
    expected = rf"'d/d/d.*past the {MAX_DEPTH} a member may have"
    with shallow_stack(), pytest.raises(UnsafeArchiveMember, match=expected):
        run_extract(archive, tmp_path / "tree")
    with shallow_stack(), pytest.raises(UnsafeArchiveMember, match=expected):
        build_image(str(archive), str(tmp_path / "deep.erofs"))


@pytest.mark.parametrize("gz", [False, True], ids=["tar", "gz"])
def test_a_member_at_the_depth_limit_is_written_by_loops(tmp_path: Path, gz: bool) -> None:
    archive = deep_tar(tmp_path, MAX_DEPTH, gz)
    with shallow_stack():
        run_extract(archive, tmp_path / "tree")
        built = build_image(str(archive), str(tmp_path / "deep.erofs"))
    leaf = tmp_path / "tree" / "/".join(["d"] * MAX_DEPTH)
    assert leaf.is_file()
    assert built.folders == MAX_DEPTH  # the top and the MAX_DEPTH - 1 above the leaf
