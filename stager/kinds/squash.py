"""The squashfs kind: a user's own daemon's image, where no FUSE reader of EROFS is
(Debian 12), mounted as the user by ``squashfuse_ll`` at ``data/u/<G>/dataset``: behind
a gate named by the user's own secret, as the mount table and squashfuse_ll's command
line, which every user reads, would name the dataset at ``data/<key>``
(stager.state.layout).

Built in the staging process as an EROFS image is (stager.kinds.imaging), by stager's
own squashfs writer (stager.image.squashfs): every request an image takes (plain and
compressed tars, nested tars, trees, renames, the other steps' tree) makes the same
names, its data stored as it is. A request of one plain tar, extracted whole, is
*embedded*: the tar copied into the image in the kernel, in one piece, and the metadata
written after it from its headers, at once (docs/image-mode.md has the figures that
chose it). Everything after the build is the image kind's (stager.kinds.image): the
rename to ``dataset.sqfs``, beside its mount point, is the commit point, the mount is
the user's (``fusermount3``), a hit checks the file's identity and its mount, an
eviction unmounts and deletes it.
Unlike a kernel mount, a FUSE mount is a process of the user's: every one under
``data/`` is taken down when the daemon stops, and what a kill -9 left is taken down
(or kept, mounted from the published file) at the next start.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import shutil
from pathlib import Path
from typing import Any

from stager.core.errors import StagerError
from stager.core.settings import Settings
from stager.image import published as images
from stager.image.mount import why_not_fuse
from stager.kinds.base import ReadyTree, Sender, Shelf
from stager.kinds.image import Image
from stager.kinds.imaging import ImageJob
from stager.ops import table
from stager.staging.blocking import run_io
from stager.state.cache import private_owner
from stager.state.dataset import Entry
from stager.wire.schemas import DatasetCreate, ExportCreate, ExportPublic

log = logging.getLogger("stager.kinds.squash")

PREBUILT = frozenset(op.name for op in table.BUILTIN if op.prebuilt_image)


class Squash(Image):
    name = "squashfs"
    image_format = "squashfs"

    def __init__(self, settings: Settings) -> None:
        super().__init__(settings)
        # A user's daemon where squashfuse_ll reads and no FUSE reader of EROFS does.
        self.here = (
            self.mount_kind == "fuse"
            and shutil.which("erofsfuse") is None
            and shutil.which("squashfuse_ll") is not None
        )

    def asked(self, request: DatasetCreate, steps: list[Any], ops: Any) -> bool:
        return self.here and request.image and not any(ops.op_of(s).prebuilt_image for s in steps)

    def holds(self, spec: dict[str, Any]) -> bool:
        steps = spec.get("steps") or []
        return (
            self.here
            and bool(spec.get("image"))
            and not any(isinstance(s, dict) and s.get("op") in PREBUILT for s in steps)
        )

    def _support(self, prebuilt: Any | None) -> str | None:
        return why_not_fuse("squashfs")

    def job(self, entry: Entry) -> ImageJob:
        return ImageJob(private_owner(entry), None, embed=True, format="squashfs")

    async def changed(
        self, entry: Entry, shelf: Shelf, lock: asyncio.Lock, walker: Any
    ) -> str | None:
        """As an image's, once a mount whose server died is taken down (mounted again)."""
        await run_io(_drop_dead, shelf.final(entry))
        return await super().changed(entry, shelf, lock, walker)

    async def recover(self, entry: Entry, shelf: Shelf) -> bool:
        """As an image's: a mount a kill -9 left, still served and of the published file,
        is kept; one whose server died with the daemon is taken down and mounted again."""
        await run_io(_drop_dead, shelf.final(entry))
        return await super().recover(entry, shelf)

    async def export(
        self, entry: Entry, request: ExportCreate, owner: Any, ready: ReadyTree, room: Sender
    ) -> ExportPublic | None:
        return None  # sent as a tree is, in parts (a receiver may mount EROFS)

    def close(self) -> None:
        """The daemon stops: its FUSE mounts go with it (a mount left would be a
        squashfuse_ll process of the user's, serving on)."""
        if not self.here:
            return
        for target in images.stray_mounts(self.settings.data_dir, {}):
            try:
                images.take_down(target)
            except (OSError, StagerError) as exc:  # a sentence, not a stop that fails half-way
                log.warning("could not unmount %s at the stop: %s", target, exc)


def _drop_dead(target: Path) -> None:
    """A FUSE mount whose server is gone (killed with the daemon's cgroup) answers
    ENOTCONN to everything, yet stays in the mount table: taken down, so the image kind
    finds it unmounted and mounts it again."""
    try:
        os.statvfs(target)  # asked of the server each time (a stat may be cached)
    except OSError as exc:
        if exc.errno == errno.ENOTCONN:
            log.warning("%s: its squashfuse_ll is gone; unmounted", target)
            images.take_down(target)
