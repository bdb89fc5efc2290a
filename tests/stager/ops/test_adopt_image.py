"""Taking in an image another node sent: copied where the delivery is another user's to
write, hashed where it lies and renamed in for a per-user daemon; either way only the
very bytes with the source node's size and sha256 become the staging's image."""

from __future__ import annotations

import errno
import hashlib
import os
from pathlib import Path

import pytest

from stager.core.errors import VerifyFailed
from stager.image.mount import EROFS_MAGIC
from stager.ops import adopt_image
from stager.ops.adopt_image import AdoptImageStep
from stager.ops.base import OpContext
from stager.wire.progress import Progress

SIZE = (8 << 20) * 2 + 12_345  # two whole chunks and a piece


def delivered(folder: Path, size: int = SIZE) -> Path:
    data = bytearray(os.urandom(size))
    data[1024:1028] = EROFS_MAGIC
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


class OnCheck:
    """A cancel signal that is never set, and runs ``then`` at check number ``at``
    (checks come before each chunk: the first between the size check and the first
    chunk, the second once one chunk was hashed or copied)."""

    def __init__(self, then, at: int = 1) -> None:  # noqa: ANN001
        self.then, self.at, self.calls = then, at, 0

    def is_set(self) -> bool:
        self.calls += 1
        if self.calls == self.at:
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


SWAPS = {
    # the name now leads to another file of the same size
    "another file": lambda path, aside: os.rename(delivered(aside), path),
    # the name is a link to the very file hashed, moved aside: its writer may change
    # the link's target once it is taken in
    "a link to it": lambda path, aside: (
        aside.mkdir(),
        os.rename(path, aside / "kept.img"),
        os.symlink(aside / "kept.img", path),
    ),
}


@pytest.mark.parametrize("swap", SWAPS)
@pytest.mark.parametrize("when", ["while it is hashed", "after it was hashed"])
def test_a_delivery_swapped_is_never_taken_in_and_nothing_is_changed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, swap: str, when: str
) -> None:
    """Swapped as it is hashed, the hashed file's stamps move (its name went, or its
    ctime); swapped after that check and before the rename (the last moment), what the
    rename moved is not that file. Either way nothing is taken in, and the file the
    descriptor reached is not even made read-only."""
    path = delivered(tmp_path / "incoming")
    step = step_for(path, True)
    hashed, aside = path.stat(), tmp_path / "elsewhere"

    def do_swap() -> None:
        SWAPS[swap](path, aside)

    cancel = None
    if when == "while it is hashed":
        cancel = OnCheck(do_swap)
    else:
        check = adopt_image._require_image

        def swap_then_check(*args: object) -> None:
            do_swap()
            check(*args)  # type: ignore[arg-type]

        monkeypatch.setattr(adopt_image, "_require_image", swap_then_check)
    attempt = tmp_path / "attempt"
    refusal = "was replaced while it was checked|written to, or given another name"
    with pytest.raises(VerifyFailed, match=refusal):
        take(step, attempt, cancel)
    assert list(attempt.iterdir()) == []
    for file in aside.rglob("*"):  # the delivery, where the swap left it
        if file.stat().st_ino == hashed.st_ino:
            assert file.stat().st_mode == hashed.st_mode
            assert hashlib.sha256(file.read_bytes()).hexdigest() == step.sha256


@pytest.mark.parametrize("in_place", [True, False])
def test_a_delivery_cut_short_while_it_is_read_is_refused_naming_it(
    tmp_path: Path, in_place: bool
) -> None:
    path = delivered(tmp_path / "incoming")
    step = step_for(path, in_place)
    attempt = tmp_path / "attempt"
    with pytest.raises(VerifyFailed) as refused:
        take(step, attempt, OnCheck(lambda: os.truncate(path, 4096)))
    said = refused.value.message
    assert f"the image {path} broadcast from node1 was cut short at byte" in said
    assert said.endswith("this node stages from the source")
    assert list(attempt.iterdir()) == []  # no partial copy left either


@pytest.mark.parametrize("in_place", [True, False])
def test_bytes_rewritten_after_they_were_hashed_never_pass_for_the_sha256(
    tmp_path: Path, in_place: bool
) -> None:
    """The first chunk is rewritten once it was read: taken in place, the file is no
    longer what was hashed (refused); copied, the copy holds what was hashed (kept,
    and it is the delivery's bytes as they were)."""
    path = delivered(tmp_path / "incoming")
    step = step_for(path, in_place)
    data = path.read_bytes()

    def rewrite() -> None:
        with open(path, "r+b") as f:
            f.seek(8192)
            f.write(b"spoiled!")

    attempt = tmp_path / "attempt"
    if in_place:
        with pytest.raises(VerifyFailed, match="written to, or given another name"):
            take(step, attempt, OnCheck(rewrite, at=2))
        assert list(attempt.iterdir()) == []
    else:
        output = take(step, attempt, OnCheck(rewrite, at=2))
        assert hashlib.sha256(output.read_bytes()).hexdigest() == step.sha256
        assert output.read_bytes() == data


def test_a_delivery_with_another_name_is_copied_by_nobody_but_refused(tmp_path: Path) -> None:
    """A second name (a hard link) lets its holder write the file after it was taken
    in: a delivery with one is not renamed in."""
    path = delivered(tmp_path / "incoming")
    os.link(path, tmp_path / "other-name")
    attempt = tmp_path / "attempt"
    with pytest.raises(VerifyFailed, match="given another name"):
        take(step_for(path, True), attempt)
    assert list(attempt.iterdir()) == [] and path.exists()


def test_a_rename_that_crosses_filesystems_falls_back_to_the_copy(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two bind mounts of one disk share a device number, yet a rename from one to the
    other fails (EXDEV): the delivery is then copied and the copy hashed."""
    path = delivered(tmp_path / "incoming")
    step = step_for(path, True)
    rename = os.rename

    def across(src: object, dst: object, **kwargs: object) -> None:
        if str(src) == str(path):
            raise OSError(errno.EXDEV, "Invalid cross-device link")
        rename(src, dst, **kwargs)

    monkeypatch.setattr(adopt_image.os, "rename", across)
    output = take(step, tmp_path / "attempt")
    assert output.stat().st_ino != path.stat().st_ino
    assert hashlib.sha256(output.read_bytes()).hexdigest() == step.sha256


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
