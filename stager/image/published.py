"""An image dataset under ``data/``: its file, its mount, and what a hit or a restart
checks of them.

A ready image dataset is two names: the image file ``data/<key>.erofs`` (or
``.sqfs``), the service's (0444, or 0400 for a private copy: its user reads it through
the mount only), and the folder ``data/<key>`` with the image mounted on it read-only
(``nosuid,nodev``). An index image (:mod:`stager.image.index`) has a third: its blob,
``data/<key>.erofs.blob`` (the tar its files are read from), mounted as the image's
extra device, published before the image and deleted after it, its identity checked
at a hit as the image's is. :mod:`stager.engine.lifecycle` decides when each function here runs (all
of them block: the daemon calls them through ``run_io``); every step is one of
:class:`stager.core.durable.Durable`.

What is mounted where is always asked of the kernel (``/proc/self/mountinfo``, and
the loop device's own status for the file behind it), never remembered: a restarted
service finds the mounts it left, a mount of another file at a dataset's path (an
image deleted or replaced under its mount) is told apart from the dataset's own, and
after a reboot a published image is simply not mounted yet.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stager.fs.durable_names import rename_durably, sync_folder
from stager.image import mount as image_mount
from stager.image.identity import ImageChanged, ImageIdentity

log = logging.getLogger("stager.image")

SUFFIXES = {"erofs": ".erofs", "squashfs": ".sqfs"}
BLOB_SUFFIX = ".blob"  # after the image's own: data/<key>.erofs.blob


@dataclass(frozen=True)
class ImageRecord:
    """What the registry keeps of a published image (stored with its entry)."""

    format: str  # "erofs" or "squashfs"
    mount: str  # "kernel" (root) or "fuse" (a user's daemon)
    identity: ImageIdentity
    files: int = 0
    folders: int = 0
    data_bytes: int = 0
    blob: ImageIdentity | None = None  # an index image's blob

    def to_dict(self) -> dict[str, Any]:
        blob = self.blob.to_dict() if self.blob is not None else None
        return {**self.__dict__, "identity": self.identity.to_dict(), "blob": blob}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ImageRecord:
        blob = data.get("blob")
        return cls(
            **{
                **data,
                "identity": ImageIdentity.from_dict(data["identity"]),
                "blob": ImageIdentity.from_dict(blob) if blob is not None else None,
            }
        )


def image_file(folder: Path, name: str, fmt: str) -> Path:
    """The file of the image mounted at ``folder / name``: beside it, named after it."""
    return folder / f"{name}{SUFFIXES[fmt]}"


def blob_of(image: Path) -> Path:
    """Where an index image's blob lies: beside it, named after it."""
    return image.with_name(image.name + BLOB_SUFFIX)


def blob_identity(image: Path) -> ImageIdentity | None:
    """The stamps of an index image's blob; None for an image without one."""
    try:
        return ImageIdentity.stamp(str(blob_of(image)))
    except FileNotFoundError:
        return None


def image_of(folder: Path, name: str) -> Path | None:
    """The published image file of the mount point ``folder / name``, whatever its
    format; None if there is none."""
    for suffix in SUFFIXES.values():
        path = folder / f"{name}{suffix}"
        if os.path.lexists(path):
            return path
    return None


def format_of(file: Path) -> str:
    """An image file's format, by the suffix the service gave it."""
    return next(fmt for fmt, suffix in SUFFIXES.items() if file.name.endswith(suffix))


def key_of(name: str) -> str:
    """The key an entry of ``data/`` belongs to (an image file's name less its suffix, a
    blob's less both)."""
    for suffix in SUFFIXES.values():
        for ending in (suffix + BLOB_SUFFIX, suffix):
            if name.endswith(ending):
                return name[: -len(ending)]
    return name


def renamed(record: ImageRecord, file: Path) -> ImageRecord:
    """``record`` of an image that root renamed to ``file`` (with its blob): stamped
    again, as a rename sets the files' ctime; ImageChanged if they are not the files
    measured."""
    blob = record.blob.renamed(str(blob_of(file))) if record.blob is not None else None
    return dataclasses.replace(record, identity=record.identity.renamed(str(file)), blob=blob)


def mount_kind() -> str:
    """How this daemon mounts: the kernel as root, FUSE as a user."""
    return "kernel" if os.geteuid() == 0 else "fuse"


def small_blocks_mount() -> bool:
    """Whether this kernel mounts EROFS images of 512-byte blocks (Linux 6.4+): an
    index image, or one with its tar embedded (stager.image.index)."""
    found = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return found is not None and (int(found[1]), int(found[2])) >= (6, 4)


def publish_image(made: Path, final: Path) -> None:
    """The commit point of an image: the attempt's complete image renamed to its
    place under ``data/``, the rename made durable. An index image's blob goes first
    (already there after a crash between the two: the image's name is the commit; one
    folder, so the journal keeps the two renames in their order)."""
    if os.path.lexists(blob_of(made)):
        os.rename(blob_of(made), blob_of(final))
    rename_durably(made, final)


def mount_image(file: Path, target: Path, kind: str, backing: str = "loop") -> None:
    """Mount ``file`` read-only at ``target`` (made if missing); nothing if it is
    mounted there already. Whatever else is mounted there (a stale mount of a deleted
    image) is taken down first."""
    with contextlib.suppress(FileExistsError):
        # fusermount3 mounts only where its user may write; the kernel anywhere.
        os.mkdir(target, 0o555 if kind == "kernel" else 0o755)
    found = image_mount.mounted_at(str(target))
    if found is not None:
        if _is_of(found, file):
            return
        take_down(target)
    blob = blob_of(file)
    if kind == "kernel" and os.path.lexists(blob):
        # The kernel opens the blob as a file only when the image is one too.
        image_mount.mount_kernel(str(file), str(target), backing, device=str(blob))
    elif kind == "kernel":
        image_mount.mount_kernel(str(file), str(target), backing)
    else:
        image_mount.mount_fuse(str(file), str(target))


def _is_of(found: image_mount.Mounted, file: Path) -> bool:
    """Whether the mount ``found`` is of ``file`` itself (not an earlier file of that
    name, deleted or replaced since)."""
    behind = image_mount.backing_file(found)
    if behind is None:
        # A FUSE mount (a user's daemon): its server holds the file it was given,
        # which no kernel status names; its user's own, like the cache.
        return found.fstype.startswith("fuse") and os.path.exists(file)
    try:
        st = os.lstat(file)
    except FileNotFoundError:
        return False
    return (st.st_dev, st.st_ino) == behind


class MountChecks:
    """What a hit checks, without a walk (:meth:`check`), made cheap for the hits after
    the first: the mount's device and its loop device, once found in the mount table,
    are kept by key, and a later hit asks the kernel only for the file's stamps, the
    device of what is at the mount point and the file behind that loop device (three
    system calls, ~15 us), where reading the mount table costs ~100 us."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[int, str]] = {}  # key -> (st_dev at the top, loop)

    def forget(self, key: str) -> None:
        self._known.pop(key, None)

    def check(self, file: Path, target: Path, record: ImageRecord) -> str | None:
        """None when ``file`` is still the image published (one ``lstat``) and it is
        mounted at ``target``; "unmounted" when only the mount is missing (it may be
        mounted again); else a sentence naming what changed."""
        try:
            record.identity.check(str(file))
            if record.blob is not None:
                record.blob.check(str(blob_of(file)))
        except ImageChanged as exc:
            self.forget(target.name)
            return exc.message
        known = self._known.get(target.name)
        if known is not None and self._still(target, known, record):
            return None
        self.forget(target.name)
        found = image_mount.mounted_at(str(target))
        if found is None:
            return "unmounted"
        if not _is_of(found, file):
            return f"{target} is mounted from another file than its image {file}"
        if found.source.startswith("/dev/loop"):
            with contextlib.suppress(OSError):
                self._known[target.name] = (os.stat(target).st_dev, found.source)
        return None

    @staticmethod
    def _still(target: Path, known: tuple[int, str], record: ImageRecord) -> bool:
        device, loop = known
        try:
            if os.stat(target).st_dev != device:
                return False
        except OSError:
            return False
        behind = image_mount.backing_file(image_mount.Mounted(str(target), "", loop, ""))
        return behind is not None and record.identity.same_file(*behind)


def check(file: Path, target: Path, record: ImageRecord) -> str | None:
    """:meth:`MountChecks.check` with nothing known yet (a restart's check)."""
    return MountChecks().check(file, target, record)


def take_down(target: Path) -> bool:
    """Unmount whatever is mounted at ``target``; True if it was in use and left
    lazily (``umount -l``): nobody holds a lease on it (eviction never takes a leased
    dataset), so a reader that opened its files without one reads on, the same bytes,
    until it closes them, and the kernel then lets go of the image."""
    try:
        image_mount.unmount(str(target))
        return False
    except image_mount.MountBusy:
        log.warning("%s is in use by a process that holds no lease; unmounted lazily", target)
        image_mount.unmount(str(target), lazy=True)
        return True


def delete_image(file: Path | None, target: Path | None) -> None:
    """The image file (and an index image's blob, after it) and its (empty) mount point,
    gone; what is already gone is fine."""
    if file is not None:
        for path in (file, blob_of(file)):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
    if target is not None:
        with contextlib.suppress(FileNotFoundError):
            os.rmdir(target)
    sync_folder((file or target).parent)  # type: ignore[union-attr]


def stray_mounts(data_dir: Path, kept: dict[str, Path]) -> list[Path]:
    """Mount points under ``data_dir`` that no ready image holds: not one in ``kept``
    (mount point -> its image file), or mounted from another file than it."""
    strays = []
    for found in image_mount.mounts_under(str(data_dir)):
        target = Path(found.target)
        file = kept.get(found.target)
        if file is None or not _is_of(found, file):
            strays.append(target)
    return strays
