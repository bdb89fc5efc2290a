"""The suite's guard against image mounts and loop devices left behind: what a test
run mounted (an image dataset's ``erofs``, ``squashfs`` or FUSE mount) or attached
(a loop device behind a kernel mount) and did not take down fails the run, as a
daemon left running does (tests/conftest.py)."""

from __future__ import annotations

import contextlib
import os
import shutil
import stat
from collections.abc import Iterator
from pathlib import Path

import pytest

from stager.image.mount import mounts

IMAGE_TYPES = ("erofs", "squashfs", "fuse.squashfuse", "fuse.squashfuse_ll", "fuse.erofsfuse")
# Only what this machine's tests make: their folders are under /tmp (pytest's base, the
# shared folders, the daemons' runtime folders). A run nested in a test (the guard's own
# tests) watches its own folder, not what the outer run's other worker mounts meanwhile.
WATCHED = os.environ.get("STAGER_TESTS_WATCHED", "/tmp/")


def image_mounts() -> set[str]:
    """Mount points of image file systems under the watched folder."""
    return {
        f"{m.fstype} mount at {m.target}"
        for m in mounts()
        if m.fstype in IMAGE_TYPES and m.target.startswith(WATCHED)
    }


def loop_devices() -> set[str]:
    """Loop devices attached to a file under the watched folder."""
    found = set()
    for backing in Path("/sys/block").glob("loop*/loop/backing_file"):
        try:
            file = backing.read_text().strip()
        except OSError:
            continue  # detached meanwhile
        if file.startswith(WATCHED):
            found.add(f"loop device {backing.parts[3]} on {file}")
    return found


def snapshot() -> set[str]:
    return image_mounts() | loop_devices()


@contextlib.contextmanager
def debian_fuse_mode() -> Iterator[None]:
    """/dev/fuse as Debian's udev leaves it (0666) while inside, its own mode back
    after (a container may leave it 0600)."""
    mode = stat.S_IMODE(os.stat("/dev/fuse").st_mode)
    os.chmod("/dev/fuse", mode | 0o666)
    try:
        yield
    finally:
        os.chmod("/dev/fuse", mode)


@pytest.fixture
def fuse_for_users() -> Iterator[None]:
    """Debian's /dev/fuse (:func:`debian_fuse_mode`), for this test only."""
    if not os.path.exists("/dev/fuse") or shutil.which("fusermount3") is None:
        pytest.skip("needs /dev/fuse and fuse3")
    with debian_fuse_mode():
        yield
