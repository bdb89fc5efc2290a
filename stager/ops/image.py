"""The ``image`` op: a prebuilt image file (EROFS or squashfs), staged as it is.

An admin builds an image once (``stager image build SRC -o imagenet.erofs``); a
request whose one step names it copies the file into the staging, hashes the copy as
it is written, checks it against the step's ``sha256`` and mounts it. Only in image
mode: :mod:`stager.kinds.imaging` runs it; ``run`` alone refuses.

A filesystem image is parsed by the kernel, so the node service mounts only images it
built or the admin trusts (docs/image-mode.md): a prebuilt image must lie under one of
``--trusted-image-dirs``, in folders and a file only root may write, with its sha256
pinned; the staging checks where the descriptor it opened as the user really lies, and
the hash of the bytes it will mount.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import queue
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from pydantic import Field

from stager.core.errors import BadRequest, UntrustedImage, VerifyFailed
from stager.core.processes import Threaded
from stager.fs.fastcopy import copy_chunk
from stager.fs.sources import fd_path, open_source, require_source, within
from stager.fs.writeback import start_writeback
from stager.image.mount import head_format
from stager.ops.base import AbsoluteSource, CheckContext, OpContext, StepParams

_CHUNK = 8 << 20


class ImageStep(StepParams):
    """Stage a prebuilt image file (EROFS or squashfs) as it is: copied, checked against
    ``sha256`` when given, mounted read-only at the dataset's path; nothing is unpacked. The
    request becomes an image dataset. The node service takes only images under the
    admin's trusted folders, with ``sha256`` pinned."""

    src: AbsoluteSource
    sha256: str | None = Field(default=None, pattern=r"^[0-9a-fA-F]{64}$")


def check(step: ImageStep, ctx: CheckContext) -> int:
    """The file is readable by the caller and is an image; its size is the estimate."""
    require_source(step.src, "image")
    fd = open_source(step.src, ctx.allowed_roots)
    try:
        head, size = os.pread(fd, 1028, 0), os.fstat(fd).st_size
    finally:
        os.close(fd)
    if head_format(head) is None:
        raise BadRequest(
            f"{step.src} is neither an EROFS nor a squashfs image; build one with "
            "stager image build, or stage the archive or folder it was made from"
        )
    return size


def run(step: ImageStep, ctx: OpContext) -> None:
    raise BadRequest(
        f"step 'image' ({step.src}) stages an image dataset: ask with \"image\": true "
        "(stager-client stage --as-image)"
    )


def trusted_lexically(src: str, trusted: list[Path]) -> bool:
    """Whether ``src`` names a path under one of ``trusted`` by its words alone (the
    request's check; the staging checks the file it opened)."""
    return any(within(os.path.normpath(src), os.path.normpath(str(top))) for top in trusted)


@dataclass(frozen=True)
class Copied:
    format: str
    size: int
    sha256: str


def copy_verified(
    step: ImageStep, ctx: OpContext, output: Path, trusted: tuple[str, ...] | None
) -> Copied:
    """Copy the image to ``output`` (made 0444), hashing what was written; refused when
    the hash is not the pinned one, or (``trusted``: the node service) when the file
    opened does not lie in a trusted folder that only root may write."""
    fd = open_source(step.src, ctx.allowed_roots)
    try:
        st = os.fstat(fd)
        if trusted is not None:
            _require_trusted(step, fd, st, trusted)
        fmt = head_format(os.pread(fd, 1028, 0))
        if fmt is None:
            raise BadRequest(f"{step.src} is neither an EROFS nor a squashfs image")
        ctx.progress.add_total(st.st_size, 1)
        partial = output.with_name(output.name + ".partial")
        # Hashed only against a pin: without one there is nothing to check it against,
        # and sha256 (~1.8 GB/s here) is the copy's slowest part.
        with said_of(f"image {step.src}", "it is not mounted"):
            digest, _ = copy_durably(fd, partial, st.st_size, ctx, 0o444, step.sha256 is not None)
    finally:
        os.close(fd)
    if step.sha256 is not None and digest != step.sha256.lower():
        os.unlink(partial)
        raise VerifyFailed(
            f"image {step.src} has sha256 {digest}, not the {step.sha256} the request pins; "
            "it is not mounted: publish the right image or pin its new hash"
        )
    os.rename(partial, output)
    ctx.progress.advance(0, 1)
    return Copied(fmt, st.st_size, digest)


@contextmanager
def said_of(subject: str, outcome: str) -> Iterator[None]:
    """A read cut short in the block (:func:`copy_and_hash`, :func:`hash_in_place`: their
    VerifyFailed says what happened, not to what) said of ``subject``, then ``outcome``."""
    try:
        yield
    except VerifyFailed as exc:
        raise VerifyFailed(f"{subject} {exc.message}; {outcome}") from exc


def copy_durably(
    src: int, partial: Path, size: int, ctx: OpContext, mode: int, hashed: bool = True
) -> tuple[str, str | None]:
    """Copy ``size`` bytes of ``src`` into ``partial``, made ``mode`` (before the fsync,
    which makes the mode durable too) and synced, hashing the copy (``hashed``); its
    sha256 ("" unhashed) and the format the copy's own first bytes say (None: no image).
    A copy that fails leaves no ``partial``; once done, the caller renames or removes it."""
    out = os.open(partial, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        os.fchmod(out, mode)
        digest = copy_and_hash(
            src, out, size, ctx.check_cancelled, lambda n: ctx.progress.advance(n, 0), hashed
        )
        return digest, head_format(os.pread(out, 1028, 0))
    except BaseException:  # cut short, changed as it was read, cancelled, disk full
        partial.unlink(missing_ok=True)
        raise
    finally:
        os.close(out)


def copy_and_hash(
    src: int,
    dst: int,
    size: int,
    check: Callable[[], None],
    advance: Callable[[int], None],
    hashed: bool = True,
    durable: bool = True,
) -> str:
    """Copy ``size`` bytes in the kernel, chunk by chunk, while a thread hashes each chunk
    through a mapping of the copy (``dst``, read-write): the two overlap, and what is
    hashed is what the copy holds. ``durable``: each chunk's writeback starts at once
    and the fsync runs while the hash goes on. Not ``hashed``: "" for its sha256.
    ``check`` runs before each chunk, ``advance`` after, with its bytes."""
    hasher = _ChunkHasher(dst) if hashed else None
    offset = 0
    try:
        while offset < size:
            check()
            moved = copy_chunk(src, dst, offset, min(_CHUNK, size - offset))
            if moved == 0:
                raise VerifyFailed(f"was cut short at byte {offset} while it was copied")
            if durable:
                start_writeback(dst, offset, moved)
            if hasher is not None:
                hasher.written(offset, moved)
            offset += moved
            advance(moved)
        if durable:
            os.fsync(dst)  # while the hash, slower than the copy, goes on
    except BaseException:
        if hasher is not None:
            hasher.finish(quiet=True)  # the copy's failure is the one to tell
        raise
    if hasher is None:
        return ""
    hasher.finish()
    return hasher.hexdigest()


class _ChunkHasher(Threaded):
    """sha256 of a file's chunks in the order they are written, on a thread of its own
    (hashlib releases the GIL for large updates), each read through a read-only mapping
    of the range, from the page cache the copy has just filled."""

    thread_name = "image-hash"

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self._digest = hashlib.sha256()
        self._ranges: queue.SimpleQueue[tuple[int, int] | None] = queue.SimpleQueue()
        self.start()

    def written(self, offset: int, length: int) -> None:
        self._ranges.put((offset, length))

    def finish(self, quiet: bool = False) -> None:
        """Wait until every chunk written is hashed; raise what the hashing raised
        (unless ``quiet``)."""
        self._ranges.put(None)
        self.join()
        if self.error is not None and not quiet:
            raise self.error

    def hexdigest(self) -> str:
        return self._digest.hexdigest()

    def run(self) -> None:  # an error is kept in ``error``, raised by finish
        while (chunk := self._ranges.get()) is not None:
            _hash_range(self._digest, self._fd, *chunk)


def hash_in_place(
    fd: int, size: int, check: Callable[[], None], advance: Callable[[int], None]
) -> str:
    """sha256 of the first ``size`` bytes of ``fd``, read chunk by chunk (``check``
    before each, ``advance`` after). Read, not mapped: a file cut short meanwhile ends
    the hash with VerifyFailed, where a mapping would SIGBUS."""
    digest = hashlib.sha256()
    buffer = bytearray(_CHUNK)
    offset = 0
    while offset < size:
        check()
        with memoryview(buffer)[: min(_CHUNK, size - offset)] as chunk:
            got = os.preadv(fd, [chunk], offset)
            if got == 0:
                raise VerifyFailed(f"was cut short at byte {offset} while it was hashed")
            digest.update(chunk[:got])
        offset += got
        advance(got)
    return digest.hexdigest()


def _hash_range(digest: hashlib._Hash, fd: int, offset: int, length: int) -> None:
    """Add ``length`` bytes of ``fd`` from ``offset`` to ``digest``, through a mapping of
    the range (no copy of the bytes out of the page cache)."""
    start = offset - offset % mmap.ALLOCATIONGRANULARITY  # a mapping's offset
    with mmap.mmap(fd, offset + length - start, prot=mmap.PROT_READ, offset=start) as mapped:
        with memoryview(mapped) as view:
            digest.update(view[offset - start :])


def _require_trusted(
    step: ImageStep, fd: int, st: os.stat_result, trusted: tuple[str, ...]
) -> None:
    """The opened file lies under a trusted folder, and it and every folder from that
    one down to it are root's and writable by nobody else: what is there, the admin put
    there."""
    if step.sha256 is None:
        raise UntrustedImage(
            f"image {step.src} has no sha256 in the request; the node service mounts a "
            'prebuilt image only with its sha256 pinned: add "sha256" to the step'
        )
    real = fd_path(fd)
    tops = [os.path.realpath(top) for top in trusted]
    top = next((t for t in tops if within(real, t)), None)
    if top is None:
        raise UntrustedImage(
            f"image {step.src} lies at {real}, outside the folders the admin trusts "
            f"({', '.join(tops) or 'none set'}); the node service mounts only images it "
            "built or that lie there: stage its source archive instead, or ask the admin "
            "to publish it under STAGER_TRUSTED_IMAGE_DIRS"
        )
    if not _roots_alone(st):
        raise UntrustedImage(f"image {real} may be written by others than root; not mounted")
    folder = os.path.dirname(real)
    while within(folder, top):
        if not _roots_alone(os.stat(folder)):
            raise UntrustedImage(
                f"folder {folder} above image {real} may be written by others than root; "
                "the image is not mounted"
            )
        if folder == top:
            break
        folder = os.path.dirname(folder)


def _roots_alone(st: os.stat_result) -> bool:
    return st.st_uid == 0 and not st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
