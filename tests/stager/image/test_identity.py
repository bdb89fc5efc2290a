"""An image's identity: measured once, then checked by one stat on each hit."""

from __future__ import annotations

import hashlib
import os
import shutil
from pathlib import Path

import pytest

from stager.image.build import build_image
from stager.image.identity import ImageChanged, ImageIdentity
from tests import tar_corpus


@pytest.fixture
def image(tmp_path: Path) -> Path:
    built = tmp_path / "basic.erofs"
    build_image(str(tar_corpus.basic_tree(tmp_path / "src")), str(built))
    return built


def test_measured_once_then_checked_by_its_stamps(image: Path) -> None:
    identity = ImageIdentity.measure(str(image))
    assert identity.sha256 == hashlib.sha256(image.read_bytes()).hexdigest()
    identity.check(str(image))  # unchanged: no error, no read
    identity.check_pinned(identity.sha256.upper(), str(image))


@pytest.mark.parametrize(
    "change",
    [
        lambda p: os.chmod(p, 0o644),  # ctime moves
        lambda p: os.utime(p, (0, 0)),
        lambda p: p.open("r+b").close() or os.truncate(p, p.stat().st_size + 4096),
        lambda p: (shutil.copy(p, str(p) + ".new"), os.replace(str(p) + ".new", p)),
        lambda p: p.unlink(),
    ],
    ids=["chmod", "utime", "grown", "replaced", "deleted"],
)
def test_any_change_of_the_file_is_caught(image: Path, change) -> None:
    identity = ImageIdentity.measure(str(image))
    change(image)
    with pytest.raises(ImageChanged, match="stage the dataset again"):
        identity.check(str(image))


def test_a_pinned_hash_that_differs_is_refused(image: Path) -> None:
    identity = ImageIdentity.measure(str(image))
    with pytest.raises(ImageChanged, match="not the pinned"):
        identity.check_pinned("0" * 64, str(image))


def test_a_link_is_not_measured(image: Path, tmp_path: Path) -> None:
    link = tmp_path / "link.erofs"
    link.symlink_to(image)
    with pytest.raises(OSError):
        ImageIdentity.measure(str(link))
