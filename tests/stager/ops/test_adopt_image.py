"""Taking in an image another node sent: copied where the delivery is another user's to
write, hashed where it lies and renamed in for a per-user daemon; either way only the
very bytes with the source node's size and sha256 become the staging's image."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import pytest

from stager.errors import VerifyFailed
from stager.ops import adopt_image, image
from stager.ops.adopt_image import AdoptImageStep
from stager.ops.base import OpContext
from stager.progress import Progress

SIZE = (8 << 20) * 2 + 12_345  # two whole chunks and a piece


def delivered(folder: Path, size: int = SIZE) -> Path:
    data = bytearray(os.urandom(size))
    data[1024:1028] = image.EROFS_MAGIC
    folder.mkdir(exist_ok=True)
    path = folder / "image.img"
    path.write_bytes(data)
    return path


def step_for(path: Path, in_place: bool, **changes: object) -> AdoptImageStep:
    fields = {
        "src": str(path),
        "size": path.stat().st_size,
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "origin_node": "node1",
        "in_place": in_place,
        **changes,
    }
    return AdoptImageStep(**fields)


class OnFirstCheck:
    """A cancel signal that is never set, and runs ``then`` at the first check (between
    the size check and the first chunk's hash)."""

    def __init__(self, then) -> None:  # noqa: ANN001
        self.then, self.done = then, False

    def is_set(self) -> bool:
        if not self.done:
            self.done = True
            self.then()
        return False


def take(step: AdoptImageStep, attempt: Path, cancel: object | None = None) -> Path:
    attempt.mkdir(exist_ok=True)
    ctx = OpContext(root=attempt, progress=Progress())
    if cancel is not None:
        ctx.cancel = cancel  # type: ignore[assignment]
    output = attempt / "image.erofs.copied"
    adopted = adopt_image.take_delivery(step, ctx, output, 0o444)
    assert (adopted.format, adopted.size, adopted.sha256) == ("erofs", step.size, step.sha256)
    return output


@pytest.mark.parametrize("in_place", [True, False])
def test_the_image_taken_in_is_the_delivery_renamed_or_its_copy(
    tmp_path: Path, in_place: bool
) -> None:
    path = delivered(tmp_path / "incoming")
    before = path.stat()
    data = path.read_bytes()
    output = take(step_for(path, in_place), tmp_path / "attempt")
    assert output.read_bytes() == data
    assert output.stat().st_mode & 0o777 == 0o444
    assert (output.stat().st_ino == before.st_ino) is in_place
    assert path.exists() is not in_place  # the copy leaves the delivery to the room


def test_a_vouched_image_is_copied_even_if_asked_in_place(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Where a service vouches (the node service), the delivery is another user's to
    write: never hashed where it lies, whatever the step says."""
    monkeypatch.setattr(adopt_image, "_require_vouched", lambda step: None)
    path = delivered(tmp_path / "incoming")
    step = step_for(path, True, vouch_uid=0, vouch_key="k", credential="c")
    output = take(step, tmp_path / "attempt")
    assert output.stat().st_ino != path.stat().st_ino


def test_a_delivery_swapped_while_it_is_hashed_is_never_taken_in(tmp_path: Path) -> None:
    path = delivered(tmp_path / "incoming")
    step = step_for(path, True)
    other = delivered(tmp_path / "elsewhere")  # same size, other bytes, same filesystem

    def swap() -> None:
        os.rename(other, path)  # the name now leads to another file; the hash reads the fd

    attempt = tmp_path / "attempt"
    with pytest.raises(VerifyFailed, match="was replaced while it was checked"):
        take(step, attempt, OnFirstCheck(swap))
    assert list(attempt.iterdir()) == []


def test_a_delivery_swapped_for_a_link_to_the_file_hashed_is_never_taken_in(
    tmp_path: Path,
) -> None:
    """The hash reads the very file, and the link leads to it: but what would be renamed
    in is the link, whose target its writer may change later."""
    path = delivered(tmp_path / "incoming")
    step = step_for(path, True)
    kept = tmp_path / "elsewhere" / "kept.img"

    def swap() -> None:
        kept.parent.mkdir()
        os.rename(path, kept)
        os.symlink(kept, path)

    attempt = tmp_path / "attempt"
    with pytest.raises(VerifyFailed, match="was replaced while it was checked"):
        take(step, attempt, OnFirstCheck(swap))
    assert list(attempt.iterdir()) == []
    assert kept.read_bytes()[1024:1028] == image.EROFS_MAGIC  # left as it was


def test_a_delivery_cut_short_while_it_is_hashed_is_refused(tmp_path: Path) -> None:
    path = delivered(tmp_path / "incoming")
    step = step_for(path, True)
    attempt = tmp_path / "attempt"
    with pytest.raises(VerifyFailed, match="cut short while it was hashed"):
        take(step, attempt, OnFirstCheck(lambda: os.truncate(path, 4096)))
    assert list(attempt.iterdir()) == []


@pytest.mark.parametrize("in_place", [True, False])
def test_a_delivery_with_other_bytes_is_refused_and_left_where_it_lies(
    tmp_path: Path, in_place: bool
) -> None:
    path = delivered(tmp_path / "incoming")
    step = step_for(path, in_place, sha256="0" * 64)
    attempt = tmp_path / "attempt"
    with pytest.raises(VerifyFailed, match="holds sha256"):
        take(step, attempt)
    assert list(attempt.iterdir()) == []
    assert path.exists()
