"""The image kind: a dataset as one read-only EROFS image, mounted at ``data/<key>``
(a user's own: at ``data/u/<G>/dataset``, a name that says nothing in the mount
table: stager.state.layout).

Made in the staging process (stager.kinds.imaging) or a prebuilt image copied;
published by renaming it to ``data/<key>.erofs`` (the commit point) and mounting it
(stager.image.published); a hit checks the file's identity and its mount, no walk;
an eviction unmounts it and deletes the file; a fan-out sends it whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from pathlib import Path
from typing import Any

from stager.core.durable import Durable
from stager.core.errors import BadRequest, ImageUnavailable, StagerError, UntrustedImage
from stager.core.settings import Settings
from stager.engine.held_space import Record as Held
from stager.engine.held_space import held_open, holder_of
from stager.fanout.image_export import export_image
from stager.image import mount as image_mount
from stager.image import published as images
from stager.image.identity import ImageChanged, ImageIdentity
from stager.kinds.base import Kind, ReadyTree, Sender, Shelf
from stager.kinds.imaging import ImageJob, ImageMade, attempt_image
from stager.ops import image as image_op
from stager.staging.blocking import run_io
from stager.state.cache import private_owner
from stager.state.dataset import Entry
from stager.state.layout import PLACE
from stager.wire.schemas import (
    DatasetCreate,
    ErrorInfo,
    ExportCreate,
    ExportPublic,
    ImageSent,
    State,
)

log = logging.getLogger("stager.kinds.image")


class Image(Kind):
    name = "image"
    mounted = True

    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        # How images are mounted here: the kernel as root, FUSE as a user.
        self.mount_kind = images.mount_kind()
        # Published images' mounts, checked at a hit without reading the mount table.
        self._mounts = images.MountChecks()

    def asked(self, request: DatasetCreate, steps: list[Any], ops: Any) -> bool:
        """Asked for, or implied by a prebuilt image step."""
        return request.image or any(ops.op_of(s).prebuilt_image for s in steps)

    def holds(self, spec: dict[str, Any]) -> bool:
        return bool(spec.get("image"))

    def check(
        self, request: DatasetCreate, steps: list[Any], ops: Any
    ) -> tuple[DatasetCreate, str | None]:
        """Refuses what no image can hold or this node cannot mount; a tree instead
        where the request allows it (``image_fallback``), with the sentence why."""
        prebuilt = [s for s in steps if ops.op_of(s).prebuilt_image]
        request = request.model_copy(update={"image": True})
        if prebuilt and len(steps) > 1:
            raise BadRequest(
                "an 'image' step stages a prebuilt image as it is, alone; give it as the "
                "request's only step"
            )
        for index, step in enumerate(steps, start=1):
            if ops.op_of(step).links_to_source(step):
                raise BadRequest(
                    f"step {index} ({step.op}) leaves links to its source, which an image "
                    "cannot hold (they would lead outside it); use mode 'direct' or 'copy', "
                    "or stage a tree (leave out image)"
                )
        if request.verify == "sha256" and not prebuilt:
            raise BadRequest(
                "verify 'sha256' reads every staged file back, which an image does not "
                "(the kernel reads it through its mount); use verify 'size' with an image, "
                "or stage a tree"
            )
        if prebuilt and self.settings.multi_user:
            self._require_trusted(prebuilt[0])
        why_not = self._support(prebuilt[0] if prebuilt else None)
        if why_not is None:
            return request, None
        if request.image_fallback and not prebuilt:
            notice = f"{why_not}; staged as a tree instead (image_fallback)"
            return request.model_copy(update={"image": False}), notice
        raise ImageUnavailable(
            f"{why_not}; stage a tree (leave out image), or allow one with image_fallback "
            "(stager-client stage --as-image --image-fallback)"
        )

    def _require_trusted(self, step: Any) -> None:
        """The node service mounts a prebuilt image only from the admin's trusted folders
        with its sha256 pinned (the staging checks the file it opens)."""
        trusted = self.settings.trusted_image_dirs
        if step.sha256 is None:
            raise UntrustedImage(
                f"image {step.src} has no sha256 in the request; the node service mounts a "
                'prebuilt image only with its sha256 pinned: add "sha256" to the step'
            )
        if not image_op.trusted_lexically(step.src, trusted):
            shown = ", ".join(str(t) for t in trusted) or "none are set"
            raise UntrustedImage(
                f"image {step.src} is not under a folder the admin trusts ({shown}); the "
                "node service mounts in the kernel only images it built or that the admin "
                "published there: stage the archive or folder it was made from instead"
            )

    def _support(self, prebuilt: Any | None) -> str | None:
        """None when this daemon can mount the image a request makes; else why not."""
        if self.mount_kind == "kernel":
            return None
        return image_mount.why_not_fuse(None if prebuilt is not None else "erofs")

    def job(self, entry: Entry) -> ImageJob:
        """How a staging's image is made."""
        trusted = tuple(str(d) for d in self.settings.trusted_image_dirs)
        # An index image's blob is a second device, and an embedded one's 512-byte
        # blocks are read by the kernel alone (Linux 6.4+; Debian 12's erofsfuse cannot).
        kernel = self.mount_kind == "kernel"
        index = self.settings.image_index and kernel
        embed = not index and kernel and images.small_blocks_mount()
        return ImageJob(
            private_owner(entry),
            trusted if self.settings.multi_user else None,
            index,
            embed,
        )

    @staticmethod
    def file(entry: Entry, shelf: Shelf) -> Path | None:
        """A published image's file (``data/<key>.erofs``, beside its mount point), as its
        record says or, before it has one (a restart), as the folder holds it."""
        final = shelf.final(entry)
        if entry.image is not None:
            return images.image_file(final.parent, final.name, entry.image.format)
        return images.image_of(final.parent, final.name)

    # ---- publish ---------------------------------------------------------------

    async def publish(self, entry: Entry, outcome: ImageMade, shelf: Shelf) -> None:
        """STAGING -> READY, in order: the attempt's image renamed to ``data/<key>.erofs``
        (the commit point), mounted read-only at ``data/<key>`` (a mount of this very file
        already there is kept), every name's link, "ready", the attempt's folder removed
        in the background. A mount that fails takes the image away and fails the staging."""
        attempt, final = shelf.attempt(entry), shelf.final(entry)
        file = images.image_file(final.parent, final.name, outcome.format)
        if await run_io(os.path.exists, outcome.path) and Path(outcome.path) != file:
            await run_io(shelf.layout.prepare, entry)  # a user's own image: its gate
            await shelf.durable(
                Durable.IMAGE_PUBLISHED, images.publish_image, Path(outcome.path), file
            )
        identity = await run_io(ImageIdentity.stamp, str(file), outcome.sha256)
        blob = await run_io(images.blob_identity, file)
        shelf.set_image(entry, images.ImageRecord(outcome.format, self.mount_kind, identity,
                                                  outcome.files, outcome.folders,
                                                  outcome.data_bytes, blob))  # fmt: skip
        try:
            await self._mount(entry, file, shelf)
        except (OSError, StagerError):
            shelf.set_image(entry, None)
            await run_io(images.take_down, final)
            await run_io(images.delete_image, file, final)
            await run_io(shelf.layout.release, entry)
            raise
        size = identity.size + (blob.size if blob is not None else 0)
        await shelf.made_ready(entry, size, None)
        if await shelf.trash.discard(attempt.root):
            shelf.crash.reached(Durable.ATTEMPT_REMOVED)

    async def _mount(self, entry: Entry, file: Path, shelf: Shelf) -> None:
        """Mount ``file`` at ``data/<key>`` (durable step MOUNTED); a user's own image from
        its file where the kernel can (stager.state.layout)."""
        backing = shelf.layout.backing(entry, self.settings.image_backing)
        await shelf.durable(Durable.MOUNTED, images.mount_image, file, shelf.final(entry),
                            self.mount_kind, backing)  # fmt: skip

    # ---- a hit -----------------------------------------------------------------

    async def changed(
        self, entry: Entry, shelf: Shelf, lock: asyncio.Lock, walker: Any
    ) -> str | None:
        """The file's identity (one ``lstat``) and its mount, no walk: an image found
        unmounted is mounted again (under ``lock``, while still ready)."""
        file = self.file(entry, shelf)
        assert entry.image is not None and file is not None
        changed = await run_io(self._mounts.check, file, shelf.final(entry), entry.image)
        if changed != "unmounted":
            return changed
        async with lock:
            if entry.state != State.READY:
                return None
            try:
                await self._mount(entry, file, shelf)
                return None
            except (OSError, StagerError) as exc:
                return f"its image could not be mounted again: {exc}"

    # ---- a start ---------------------------------------------------------------

    async def recover(self, entry: Entry, shelf: Shelf) -> bool:
        """Published before a crash (its store not "ready"): published again, or failed
        with the sentence why. Ready, but not mounted (a reboot) or mounted from another
        file: mounted again if its file is still the one published, else evicted (never
        a mount over a deleted or changed image)."""
        if entry.active and entry.attempt and await run_io(self._published, entry, shelf):
            if entry.state == State.QUEUED:
                entry.move(State.STAGING)
            file = self.file(entry, shelf)
            assert file is not None
            try:
                await self.publish(entry, ImageMade(str(file), images.format_of(file)), shelf)
            except (OSError, StagerError) as exc:
                message = exc.message if isinstance(exc, StagerError) else str(exc)
                error = ErrorInfo(type="mount_failed", message=message)
                await shelf.end(entry, State.FAILED, error)
            return True
        if entry.state != State.READY or entry.image is None:
            return False
        file, target = self.file(entry, shelf), shelf.final(entry)
        assert file is not None
        state = await run_io(images.check, file, target, entry.image)
        if state == "unmounted":
            try:
                await self._mount(entry, file, shelf)
                return True
            except StagerError as exc:
                state = exc.message
        if state is not None:
            log.warning("image of %s not mounted again: %s", entry.key, state)
            await shelf.evict(entry, f"its image could not be mounted again ({state})")
        return True

    def _published(self, entry: Entry, shelf: Shelf) -> bool:
        """Whether this entry's attempt got past its commit point (see ``publish``)."""
        done = shelf.attempt(entry).steps_done() == len(entry.steps)
        built = attempt_image(shelf.attempt(entry)).exists()
        return done and not built and self.file(entry, shelf) is not None

    async def move(self, entry: Entry, old: Path, shelf: Shelf) -> bool:
        """An image an earlier release published at ``data/<key>.erofs`` (``.sqfs``):
        renamed behind its gate, its record stamped again (a rename sets its ctime). Its
        mount at ``old`` stays for its readers until ``settle`` finds it a stray."""
        return await run_io(self._move, entry, old, shelf)

    @staticmethod
    def _move(entry: Entry, old: Path, shelf: Shelf) -> bool:
        file, final = images.image_of(old.parent, old.name), shelf.final(entry)
        if file is None or os.path.lexists(final):
            return False  # nothing there, or moved already (a crash after the rename)
        shelf.layout.prepare(entry)
        to = images.image_file(final.parent, final.name, images.format_of(file))
        images.publish_image(file, to)
        if entry.image is not None:
            with contextlib.suppress(ImageChanged):
                shelf.set_image(entry, images.renamed(entry.image, to))
        return True

    async def settle(self, entries: list[Entry], shelf: Shelf) -> None:
        """Mounts under ``data/`` that no ready image holds (a crash between an eviction's
        unmount and its delete, a failed publish, an image deleted under its mount, a
        user's own image's old place in a cache an earlier release made)."""
        kept = {
            str(shelf.final(e)): file
            for e in entries
            if e.state == State.READY and e.image is not None and (file := self.file(e, shelf))
        }
        for target in await run_io(images.stray_mounts, self.settings.data_dir, kept):
            log.warning("unmounting %s: no ready image dataset is mounted there", target)
            await run_io(images.take_down, target)

    async def claim(self, orphan: Path, shelf: Shelf) -> bool:
        """An image file of ``data/`` that no entry holds: a blob alone is deleted; an
        image (a crash between its lazy unmount and its keeping) is kept while held open,
        else deleted. A user's own image's gate likewise, then discarded."""
        if orphan.parent == shelf.layout.users_dir:
            file = await run_io(images.image_of, orphan, PLACE)
            if file is None:
                return False  # a tree's gate, or an empty one: the registry discards it
            key = shelf.key_at(orphan.name)
            await run_io(self._retire, key, shelf.owner_of(key), 0, file, shelf)
            await shelf.trash.discard(orphan)
            return True
        key = images.key_of(orphan.name)
        if orphan.parent != self.settings.data_dir or key == orphan.name:
            return False
        if orphan.name.endswith(images.BLOB_SUFFIX):
            image = orphan.with_name(orphan.name.removesuffix(images.BLOB_SUFFIX))
            if not await run_io(os.path.lexists, image):
                await run_io(images.delete_image, orphan, None)
            return True
        await run_io(self._retire, key, shelf.owner_of(key), 0, orphan, shelf)
        return True

    # ---- eviction --------------------------------------------------------------

    async def delete(self, entry: Entry, shelf: Shelf) -> None:
        """Unmounted (lazily if a process without a lease still reads it), then its file
        and mount point deleted. A lazily unmounted image's file is kept instead, on its
        owner's books, until its readers let go (stager.engine.held_space): unlinked,
        its blocks would stay in use, counted nowhere."""
        final, file = shelf.final(entry), self.file(entry, shelf)
        owner = private_owner(entry)
        self._mounts.forget(entry.key)
        # A shared image's held space is charged to whoever holds its mount, found by
        # the mount's file system (gone from the mount table once detached).
        device = await run_io(_device_of, final) if owner is None else None
        lazily = await run_io(images.take_down, final)
        shelf.crash.reached(Durable.UNMOUNTED)
        if lazily and file is not None:
            if owner is None and device is not None:
                # Whose process holds it: one sitting in it, found at once.
                owner = await run_io(holder_of, device, False)
            kept = await run_io(self._retire, entry.key, owner, entry.size_bytes, file, shelf)
            if kept is not None and owner is None and device is not None:
                # One holding a file of it: off the admission lock, as reading every
                # process's open files takes as long as users make it.
                shelf.trash.spawn_io(shelf.trash.held.charge_holder, kept, device)
            file = None
        await run_io(images.delete_image, file, final)
        await run_io(shelf.layout.release, entry)  # a user's own image's gate
        shelf.crash.reached(Durable.IMAGE_DELETED)

    @staticmethod
    def _retire(key: str, owner: int | None, nbytes: int, file: Path, shelf: Shelf) -> Held | None:
        """An unmounted image's file: kept on ``owner``'s books while anything still
        holds it open (a lazily unmounted mount; its record returned), else deleted."""
        if not held_open(file):
            images.delete_image(file, None)
            return None
        blob = images.blob_of(file)
        if not nbytes:
            nbytes = sum(p.stat().st_size for p in (file, blob) if p.exists())
        return shelf.trash.held.keep_image(key, owner, nbytes, [file, blob])

    # ---- a fan-out -------------------------------------------------------------

    async def export(
        self, entry: Entry, request: ExportCreate, owner: Any, ready: ReadyTree, room: Sender
    ) -> ExportPublic | None:
        """Sent as one file: a copy of its image, hashed as it is written
        (stager.fanout.image_export), vouched for in the node service since the
        receivers' kernels parse it. Not an index image (its blob is a second file): it
        goes as a tree does, and each receiver builds its own (docs/multinode.md)."""
        record = entry.image
        if entry.state != State.READY or record is None or record.blob is not None:
            return None
        final = await ready(entry)  # ready, and unchanged since its publish
        file = images.image_file(final.parent, final.name, record.format)
        private = entry.reader is not None and not entry.reader.public

        def copy(transfer: Any) -> tuple[Path, int, str]:
            return export_image(file, record.identity, transfer, private)

        path, size, sha256, credential = await room.send_file(
            entry, request, owner, record.identity.size, copy
        )
        sent = ImageSent(size=size, sha256=sha256, format=record.format, credential=credential)
        return ExportPublic(id=request.label, key=entry.key, part=0, parts=1, path=str(path),
                            bytes=size, total_bytes=size, data_bytes=size, image=sent,
                            vouched=credential is not None)  # fmt: skip


def _device_of(path: Path) -> int | None:
    try:
        return os.stat(path).st_dev
    except OSError:
        return None
