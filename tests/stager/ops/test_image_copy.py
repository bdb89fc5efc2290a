"""The prebuilt image's copy: what is hashed is every byte written, in order, whatever
the chunks the kernel's copy returns; a pin that does not match is never published."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from stager.core.errors import VerifyFailed
from stager.image.mount import EROFS_MAGIC
from stager.ops import image
from stager.ops.base import OpContext
from stager.wire.progress import Progress


def _prebuilt(path: Path, size: int) -> Path:
    head = bytearray(os.urandom(size))
    head[1024:1028] = EROFS_MAGIC  # an EROFS image by its magic bytes
    path.write_bytes(head)
    return path


@pytest.mark.parametrize(
    "size",
    [
        1028,  # smaller than a page
        (8 << 20) * 2 + 12_345,  # two whole chunks and a piece: a mapping's offset moves
    ],
)
def test_the_copy_is_hashed_byte_for_byte(tmp_path: Path, size: int) -> None:
    src = _prebuilt(tmp_path / "prebuilt.erofs", size)
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    step = image.ImageStep(src=str(src), sha256=sha)
    progress = Progress()
    copied = image.copy_verified(
        step, OpContext(root=tmp_path, progress=progress), tmp_path / "out.erofs", None
    )
    assert (copied.format, copied.size, copied.sha256) == ("erofs", size, sha)
    assert (tmp_path / "out.erofs").read_bytes() == src.read_bytes()
    assert not (tmp_path / "out.erofs.partial").exists()


def test_short_chunks_are_hashed_in_order(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel copy may move fewer bytes than asked: chunks that start off any page
    boundary still hash to the file's sha256."""
    src = _prebuilt(tmp_path / "prebuilt.erofs", 3 * 1_000_003)
    real = image.copy_chunk
    monkeypatch.setattr(
        image, "copy_chunk", lambda s, d, off, n: real(s, d, off, min(n, 1_000_003))
    )
    sha = hashlib.sha256(src.read_bytes()).hexdigest()
    step = image.ImageStep(src=str(src), sha256=sha)
    copied = image.copy_verified(
        step, OpContext(root=tmp_path, progress=Progress()), tmp_path / "out.erofs", None
    )
    assert copied.sha256 == sha


def test_a_pin_that_does_not_match_publishes_nothing(tmp_path: Path) -> None:
    src = _prebuilt(tmp_path / "prebuilt.erofs", (8 << 20) + 1)
    step = image.ImageStep(src=str(src), sha256="0" * 64)
    with pytest.raises(VerifyFailed, match="not the 0000"):
        image.copy_verified(
            step, OpContext(root=tmp_path, progress=Progress()), tmp_path / "out.erofs", None
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["prebuilt.erofs"]
