"""The squashfs kind: a user's own daemon's image, where no FUSE reader of EROFS is
(Debian 12), mounted as the user by ``squashfuse_ll`` at ``data/u/<G>/dataset``: behind
a gate named by the user's own secret, as the mount table and squashfuse_ll's command
line, which every user reads, would name the dataset at ``data/<key>``
(stager.state.layout).

Built in the staging process: a request of one plain tar, extracted whole, is read
into the image by ``tar2sqfs`` (squashfs-tools-ng) as it streams, with no tree on the
disk; any other request is staged as a tree and packed by ``mksquashfs``. Both write
lz4 (docs/image-mode.md has the figures that chose the writer and the compression).
Everything after the build is the image kind's (stager.kinds.image): the rename to
``dataset.sqfs``, beside its mount point, is the commit point, the mount is the
user's (``fusermount3``), a hit checks the file's identity and its mount, an eviction
unmounts and deletes it.
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
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from stager.core import processes
from stager.core.durable import Durable
from stager.core.errors import StagerError, StagingError
from stager.core.settings import Settings
from stager.fs.sources import open_source
from stager.fs.writeback import start_writeback
from stager.image import published as images
from stager.image.mount import why_not_fuse
from stager.kinds.base import ReadyTree, Sender, Shelf
from stager.kinds.image import Image
from stager.kinds.imaging import ImageMade
from stager.ops import table
from stager.staging.blocking import run_io
from stager.staging.publish import Attempt
from stager.staging.worker import Steps
from stager.state.dataset import Entry
from stager.wire.schemas import DatasetCreate, ExportCreate, ExportPublic

log = logging.getLogger("stager.kinds.squash")

BUILT = "image.sqfs"
PREBUILT = frozenset(op.name for op in table.BUILTIN if op.prebuilt_image)


@dataclass(frozen=True)
class SquashJob:
    """The squashfs kind's part of a staging job (stager.staging.worker.KindStaging)."""

    threads: int

    def published(self, final: Path, attempt: Attempt) -> ImageMade | None:
        file = images.image_file(final.parent, final.name, "squashfs")
        if not file.exists() or self.built(attempt):
            return None
        return ImageMade(str(file), "squashfs", size=file.stat().st_size)

    def built(self, attempt: Attempt) -> bool:
        return (attempt.root / BUILT).exists()

    def stage(self, staging: Steps) -> ImageMade:
        made = staging.attempt.root / BUILT
        if not made.exists():
            partial = made.with_name(BUILT + ".partial")
            tar = _whole_tar(staging)
            if tar is not None:
                staging.run(lambda index: False, lambda index: None)
                self._from_tar(tar, partial, staging)
            else:
                staging.run()
                self._from_tree(staging.attempt.tree, partial, staging)
            with open(partial, "rb") as image:
                os.fsync(image.fileno())
            os.rename(partial, made)
            staging.crash.reached(Durable.IMAGE_BUILT)
            if staging.attempt.tree.is_dir():  # deleted with the attempt once published
                os.rename(staging.attempt.tree, staging.attempt.root / "packed-tree")
        return ImageMade(str(made), "squashfs", size=made.stat().st_size)

    def _from_tar(self, fd: int, partial: Path, staging: Steps) -> None:
        # -s: a record it cannot read fails the build (by default it is skipped).
        argv = [_tool("tar2sqfs"), "-q", "-f", "-s", "-c", "lz4", "-j", str(self.threads)]
        defaults = f"uid={os.getuid()},gid={os.getgid()},mode=0755"
        try:
            _write([*argv, "-d", defaults, str(partial)], fd, staging, partial)
        finally:
            os.close(fd)

    def _from_tree(self, tree: Path, partial: Path, staging: Steps) -> None:
        tree.mkdir(exist_ok=True)  # steps that made nothing: an empty image
        argv = [_tool("mksquashfs"), str(tree), str(partial), "-noappend", "-quiet",
                "-no-progress", "-comp", "lz4", "-processors", str(self.threads)]  # fmt: skip
        _write(argv, processes.DEVNULL, staging, partial)


def _whole_tar(staging: Steps) -> int | None:
    """A descriptor of the request's one plain tar, when its one step extracts it whole
    at the top (what tar2sqfs reads as it is); None for anything else."""
    if len(staging.steps) != 1:
        return None
    stream = staging.ops.op_of(staging.steps[0]).image_stream(staging.steps[0])
    if stream is None or stream.nested or stream.strip or stream.dst not in (".", ""):
        return None
    if not stream.src.startswith("/") or stream.format not in ("auto", "tar"):
        return None
    from stager.archive.formats import sniff

    if stream.before is not None:
        stream.before(staging.ctx)
    fd = open_source(stream.src, staging.ctx.allowed_roots)
    if sniff(os.pread(fd, 512, 0)) != "tar":
        os.close(fd)
        return None
    return fd


def _write(argv: list[str], stdin: Any, staging: Steps, output: Path) -> None:
    """``argv`` run to its end, stopped if the staging is cancelled; its last line of
    error said if it fails (kept in a file: a pipe nobody reads could fill). What it
    has written of ``output`` goes to the disk as it writes (_WrittenBack)."""
    errors = staging.attempt.root / "writer.err"
    with open(errors, "w+b") as said_file, _WrittenBack(output) as written:
        writer = processes.spawn(argv, stdin=stdin, stderr=said_file)
        try:
            while not processes.exited(writer, 0.2):
                staging.ctx.check_cancelled()
                written.start()
        finally:
            if writer.returncode is None:
                writer.kill()
                writer.wait()
        said_file.seek(0)
        said = said_file.read().decode(errors="replace").strip().splitlines()
    if writer.returncode != 0:
        detail = said[-1] if said else f"exit status {writer.returncode}"
        raise StagingError(
            f"{os.path.basename(argv[0])} could not build the image: {detail}; fix what it "
            "names in the source, or stage a tree (leave out image)"
        )


class _WrittenBack:
    """The writeback of what a writer has added to ``output`` since the last call,
    started while it writes on (stager.fs.writeback): the fsync after it then finds
    little left (0.4 s of a 1 GB image's 0.4-0.6 s here; docs/image-mode.md)."""

    def __init__(self, output: Path) -> None:
        self.output, self.fd, self.done = output, -1, 0

    def __enter__(self) -> _WrittenBack:
        return self

    def start(self) -> None:
        if self.fd < 0:
            try:  # the writer makes it (tar2sqfs -f truncates it in place)
                self.fd = os.open(self.output, os.O_RDONLY | os.O_CLOEXEC)
            except FileNotFoundError:
                return
        size = os.fstat(self.fd).st_size
        if size > self.done:
            start_writeback(self.fd, self.done, size - self.done)
            self.done = size

    def __exit__(self, *exc: object) -> None:
        if self.fd >= 0:
            os.close(self.fd)


def _tool(name: str) -> str:
    found = shutil.which(name) or shutil.which(name, path="/usr/sbin:/usr/bin:/bin")
    if found is None:
        package = "squashfs-tools-ng" if name == "tar2sqfs" else "squashfs-tools"
        raise StagingError(f"{name} is not installed; install the Debian package {package}")
    return found


class Squash(Image):
    name = "squashfs"

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

    def job(self, entry: Entry) -> SquashJob:
        return SquashJob(max(1, os.cpu_count() or 1))

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

    def _published(self, entry: Entry, shelf: Shelf) -> bool:
        done = shelf.attempt(entry).steps_done() == len(entry.steps)
        built = (shelf.attempt(entry).root / BUILT).exists()
        return done and not built and self.file(entry, shelf) is not None

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
