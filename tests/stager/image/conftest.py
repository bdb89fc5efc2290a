"""Kernel mounts for the image tests: each test's mounts are taken down when it ends,
passed or failed. A test skips only where this machine cannot mount in the kernel
(not root, or no EROFS driver), saying why."""

from __future__ import annotations

import errno
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from stager.image import mount as image_mount


def _unmount_all(targets: list[Path]) -> None:
    for target in reversed(targets):
        if image_mount.mounted_at(str(target)) is not None:
            image_mount.unmount(str(target))


@pytest.fixture
def kernel_mount(tmp_path: Path) -> Iterator[Callable[..., Path]]:
    """``mount(image, backing="loop", device=None) -> mount point``, read-only in the
    kernel (``device``: an index image's blob)."""
    if os.geteuid() != 0:
        pytest.skip("kernel mounts need root; these tests run as root in CI")
    mounted: list[Path] = []

    def mount(image: Path, backing: str = "loop", device: Path | None = None) -> Path:
        target = tmp_path / f"mnt{len(mounted)}"
        target.mkdir()
        try:
            blob = str(device) if device is not None else None
            image_mount.mount_kernel(str(image), str(target), backing, device=blob)
        except image_mount.MountError as exc:
            cause = exc.__cause__
            if isinstance(cause, OSError) and cause.errno in (errno.ENODEV, errno.EPERM):
                pytest.skip(f"this machine cannot mount EROFS in the kernel: {exc}")
            raise
        mounted.append(target)
        return target

    try:
        yield mount
    finally:
        _unmount_all(mounted)


@pytest.fixture
def fuse_mount(tmp_path: Path) -> Iterator[Callable[[Path], Path]]:
    """``mount(image) -> mount point`` with FUSE; unmounted at the end."""
    if not os.path.exists("/dev/fuse"):
        pytest.skip("no /dev/fuse on this machine")
    mounted: list[Path] = []

    def mount(image: Path) -> Path:
        target = tmp_path / f"fuse{len(mounted)}"
        target.mkdir()
        image_mount.mount_fuse(str(image), str(target))
        mounted.append(target)
        return target

    try:
        yield mount
    finally:
        _unmount_all(mounted)
