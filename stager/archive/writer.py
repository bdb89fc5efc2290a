"""Where ``extract`` writes: safe member paths, directories, files, links, in order.

Why files never land outside the destination, whatever the member order:

* member names are checked lexically (relative, no ``..``) before anything;
* every parent folder is made here and checked with ``lstat`` once, so no component
  of a file's path is a symlink on disk (a leftover one is replaced by a folder);
* archive symlinks are made only after every file. A member *under* one is placed
  where GNU tar would put it by resolving the archive's own link targets here, only
  for targets GNU tar makes at once (relative, no ``..``): nothing is written through
  a link on disk. Every symlink is re-resolved once all exist (chains that escape
  together);
* links are judged by :func:`stager.archive.job.judge_link`; a hard link's target must
  be a regular file reached through folders made here.

Members that name a path again end as GNU tar leaves them: the last one wins; a file
replaces what was there (unlink, then create: an earlier hard link keeps the old
content); a folder replaces a file or a symlink; an empty folder is replaced by a file
or a symlink, a non-empty one refused, as GNU tar fails there too.

Files are written on a pool in batches (an executor's per-task cost is a small file's
write): threads, or processes for a plain tar's byte ranges, so the per-file Python
runs on every core. Only the names of batches in flight are remembered; a member whose
name (or hard-link target) is in one waits for that batch.

Every file is created 0444 (``FILE_MODE``), whatever the member says, so sealing
the tree has no file to change (stager.fs.seal).

The writer counts the bytes it leaves (``made``, as :func:`stager.fs.sizes.sum_sizes`
counts a tree): a name is only ever created new, never written into, so its size is
fixed when made. The count is reported as it grows, a streamed member's per chunk,
so a staging's write bound stops a member whose header lies mid-way. What a member
replaces is never taken off what was reported: a hard link may still hold it.

With ``verify: sha256`` every file is read back and compared with the member's bytes;
hard links and symlinks are checked to be what the archive says.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import posixpath
import shutil
import stat
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field
from typing import Any, Protocol

from stager.core.errors import UnsafeArchiveMember, VerifyFailed
from stager.core.processes import ThreadPool
from stager.fs.fastcopy import READ_CHUNK, copy_range, write_all
from stager.fs.sizes import FOLDER_BYTES, entry_bytes, sum_sizes
from stager.wire.progress import ProgressSink, report_written

_CREATE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_READ_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC
_BATCH_FILES = 1024  # why 1,024: docs/performance.md ("Extract", the rules)
BATCH_BYTES = 8 << 20  # of payloads held in memory (compressed archives)
# Members up to this size are written from one read of the archive per batch (a write
# each, like GNU tar) rather than one copy_file_range each; both cost the same in the
# kernel, but one call less per file is ~1 us of Python less.
_SMALL = 64 << 10
_WINDOW = 4 << 20
_MAX_LINK_HOPS = 40  # as the kernel's ELOOP limit
GNU_FAILS_TOO = "GNU tar fails here too"
# The longest path, in bytes, a member may be given (PATH_MAX less its NUL).
PATH_MAX = 4095
# The most components a member's path may have (ImageNet's are 2 deep): every walk over
# a tree pays for its depth. A name under 1,024 bytes (clean_name's fast path) cannot pass it.
MAX_DEPTH = 512
# The most bytes of folder and link names one archive's writer keeps (each name's path
# and ``_HELD_OVERHEAD``): bounds the staging process's memory whatever the archive.
HELD_NAMES_BYTES = 64 << 20
_HELD_OVERHEAD = 120


@dataclass(frozen=True, slots=True)
class SparseRanges:
    """A sparse member of a plain tar: its data regions, stored one after the other
    at ``offset`` of ``fd``, go to ``(position, length)`` of a file of ``size`` bytes."""

    fd: int
    offset: int
    regions: tuple[tuple[int, int], ...]
    size: int


@dataclass(frozen=True, slots=True)
class HardLink:
    target: str  # absolute path of a file this archive wrote
    archive: str  # for messages: the archive's label ...
    member: str  # ... and the link's name


# A file's content: bytes in memory, a byte range of a file descriptor (copied in the
# kernel), a sparse map over one, or a callable writing into the open destination fd
# (updating the digest, if any, and telling ``Wrote`` each chunk as it lands).
Wrote = Callable[[int], None]
Payload = bytes | tuple[int, int, int] | SparseRanges | Callable[[int, Any, Wrote], None]


def _uncounted(nbytes: int) -> None:
    """Chunks of a file written on the pool: counted with their batch."""


@dataclass(slots=True)
class _FileJob:
    path: str
    mode: int
    mtime: float
    payload: Payload | HardLink


# The common job, a plain tar's member: (path, mode, mtime, archive fd, offset, size).
# A tuple, because batches of them cross to worker processes: pickling a tuple costs
# a fraction of a dataclass.
_RangeJob = tuple[str, int, float, int, int, int]


@dataclass
class _Batch:
    seq: int
    jobs: list[_RangeJob | _FileJob] = field(default_factory=list)
    names: list[str] = field(default_factory=list)
    share: int = 0  # archive bytes the batch accounts for, for progress
    nbytes: int = 0
    # What its names cost beyond their content (stager.fs.sizes.entry_bytes), and its
    # new inodes (a hard link makes none): charged as the batch is handed out.
    charge: int = 0
    inodes: int = 0


# Only a pax header carries one; GNU tar cuts the name there and writes another file.
NUL_IN_NAME = "a NUL byte in its name or link target, which no file name can hold"


def unsafe(archive: str, member: str, why: str) -> UnsafeArchiveMember:
    return UnsafeArchiveMember(
        f"archive {archive} has an unsafe member {member!r} ({why}); nothing was written "
        "outside the destination; re-create the archive without it"
    )


def refused(archive: str, member: str, why: str) -> UnsafeArchiveMember:
    """A member that cannot be extracted where it is, as GNU tar cannot either."""
    return UnsafeArchiveMember(
        f"archive {archive} cannot be extracted: member {member!r} {why} ({GNU_FAILS_TOO}); "
        "re-create the archive from the tree it should produce"
    )


def clean_name(archive: str, name: str, strip: int, label: str | None = None) -> str | None:
    """A member's safe relative path after stripping ``strip`` leading components, or
    None to skip it (stripped away, or the archive's own top); raises for a name that
    would leave the destination (absolute, a drive, ``..``, a NUL byte). ``label``
    names the member in the error (a link: "name -> target")."""
    if not strip:
        short = name[2:] if name[:2] == "./" else name
        # The common name needs none of the work below: relative, no empty, "." or
        # ".." component (none starts with a dot), no drive letter.
        if short and short[0] not in "/\\." and "/." not in short and "//" not in short:
            if short[1:2] != ":" and short[-1] != "/" and "\0" not in short and len(short) < 1024:
                return short
    label = label if label is not None else name
    if "\0" in name:
        raise unsafe(archive, label, NUL_IN_NAME)
    if name.startswith(("/", "\\")) or (name[1:2] == ":" and name[0].isalpha()):
        raise unsafe(archive, label, "absolute path")
    parts = [p for p in name.split("/") if p]
    if strip:
        if len(parts) <= strip:
            return None
        parts = parts[strip:]
    parts = [p for p in parts if p != "."]
    if ".." in parts:
        raise unsafe(archive, label, "'..' component leads outside the destination")
    if not parts:
        return None
    clean = "/".join(parts)
    if (nbytes := len(os.fsencode(clean))) > PATH_MAX:
        raise unsafe(
            archive,
            shown_name(label),
            f"a path of {nbytes} bytes, past the {PATH_MAX} a path may have: nothing "
            "could open it by its name, nor delete it",
        )
    if len(parts) > MAX_DEPTH:
        raise unsafe(
            archive,
            shown_name(label),
            f"a path {len(parts)} folders deep, past the {MAX_DEPTH} a member may have",
        )
    return clean


def shown_name(name: str) -> str:
    """A member's name as an error shows it: a long one by its ends."""
    return name if len(name) <= 100 else f"{name[:60]}...{name[-20:]}"


def through_link(archive: str, member: str, here: str, target: str, hops: int) -> list[str]:
    """Where a member under the archive's symlink ``here`` (its ``hops``-th) goes, as
    the components GNU tar places it through (extraction's and the image build's rule)."""
    if target.startswith("/") or ".." in target.split("/"):
        raise unsafe(
            archive,
            member,
            f"written through the archive's symlink {here!r}, whose target "
            f"{target!r} may lead outside; GNU tar does not write through it either",
        )
    if hops > _MAX_LINK_HOPS:
        raise refused(archive, member, "lies under too many levels of symlinks")
    resolved = posixpath.normpath(posixpath.join(posixpath.dirname(here), target))
    return [part for part in resolved.split("/") if part not in ("", ".")]


def too_many_names(archive: str, member: str) -> UnsafeArchiveMember:
    return UnsafeArchiveMember(
        f"archive {archive} cannot be extracted: at member {shown_name(member)!r} its folders "
        f"and links pass the {HELD_NAMES_BYTES >> 20} MiB of names one staging keeps "
        "track of (too many folders, or folders too deep); split it into smaller archives, "
        "or re-create it with fewer folders"
    )


# -- on the pool: one batch of files -------------------------------------------------


def write_files(
    jobs: list[_RangeJob | _FileJob], verify: str | None, wrote: Wrote = _uncounted
) -> tuple[int, int, int]:
    """One batch, in order, on a pool thread or process (or inline); returns its file
    count, the bytes it left (made less replaced), and those of them told to ``wrote``
    as they landed. ``verify`` is the archive's label when files are read back."""
    window = _Window(jobs)
    folder = _Folder()
    made = streamed = 0

    def counted(nbytes: int) -> None:
        nonlocal streamed
        streamed += nbytes
        wrote(nbytes)

    each = _uncounted if wrote is _uncounted else counted
    try:
        for job in jobs:
            if job.__class__ is tuple:
                made += job[5] - _write_range(job, window, folder, verify)  # type: ignore[arg-type,index,operator]
            else:
                made += write_file(job, verify, each)  # type: ignore[arg-type]
    finally:
        folder.close()
    return len(jobs), made, streamed


class _Folder:
    """The folder a batch's files are being created in, kept open, so a file is created
    by its name in it (``openat``) rather than by a path the kernel walks each time. Its
    components were made (and checked to be real folders) by the reading process."""

    def __init__(self) -> None:
        self.path = ""
        self.fd = -1

    def get(self, path: str) -> int:
        if path != self.path:
            self.close()
            self.fd = os.open(path, _DIR_FLAGS)
            self.path = path
        return self.fd

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd, self.path = -1, ""


class _Window:
    """One read of the archive for a batch's small members, which lie close together."""

    def __init__(self, jobs: list[_RangeJob | _FileJob]) -> None:
        self.end = max((j[4] + j[5] for j in jobs if j.__class__ is tuple), default=0)  # type: ignore[index]
        self.data = memoryview(b"")
        self.start = 0

    def get(self, fd: int, offset: int, size: int) -> memoryview:
        at = offset - self.start
        if at < 0 or at + size > len(self.data):
            count = max(size, min(_WINDOW, self.end - offset))
            self.data, self.start, at = memoryview(os.pread(fd, count, offset)), offset, 0
            if len(self.data) < size:
                raise EOFError("archive ended inside a member")
        return self.data[at : at + size]


def _write_range(job: _RangeJob, window: _Window, folder: _Folder, verify: str | None) -> int:
    """Write one member; returns the bytes of what it replaced (mostly nothing)."""
    path, mode, mtime, src_fd, offset, size = job
    parent, _, name = path.rpartition("/")
    replaced = 0
    try:
        fd = os.open(name, _CREATE_FLAGS, mode, dir_fd=folder.get(parent or "/"))
    except FileExistsError:
        fd, replaced = _create(path, mode)
    digest = hashlib.sha256() if verify else None
    try:
        if size <= _SMALL:
            data = window.get(src_fd, offset, size)
            written = os.write(fd, data)
            if written != size:  # short only on a full disk or a signal
                write_all(fd, data[written:])
            if digest is not None:
                digest.update(data)
        else:
            copy_range(src_fd, fd, offset, size)
            if digest is not None:
                _hash_range(digest, src_fd, offset, size)
        os.utime(fd, (mtime, mtime))
    finally:
        os.close(fd)
    if digest is not None:
        _read_back(_FileJob(path, mode, mtime, (src_fd, offset, size)), digest, verify)  # type: ignore[arg-type]
    return replaced


def write_file(job: _FileJob, verify: str | None = None, wrote: Wrote = _uncounted) -> int:
    """Write one file or hard link; returns the bytes it left less those it replaced.
    A callable payload tells ``wrote`` each chunk as it lands (those bytes included)."""
    if isinstance(job.payload, HardLink):
        return _hard_link(job.path, job.payload, verify)
    fd, replaced = _create(job.path, job.mode)
    try:
        digest = hashlib.sha256() if verify else None
        size = _write_payload(fd, job.payload, digest, wrote)
        os.utime(fd, (job.mtime, job.mtime))
    finally:
        os.close(fd)
    if digest is not None:
        _read_back(job, digest, verify)  # type: ignore[arg-type]
    return size - replaced


def _create(path: str, mode: int) -> tuple[int, int]:
    """A new file at ``path``, and the bytes of what it replaced (unlinked, never
    written into: see the module's docstring)."""
    try:
        return os.open(path, _CREATE_FLAGS, mode), 0
    except FileExistsError:
        replaced = _remove(path)
        return os.open(path, _CREATE_FLAGS, mode), replaced


def _remove(path: str) -> int:
    """Remove what is at ``path``; returns its bytes as ``sum_sizes`` counts them."""
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(path)
        return st.st_size
    nbytes = sum_sizes(path)
    shutil.rmtree(path)
    return nbytes


def _write_payload(fd: int, payload: Payload, digest: Any, wrote: Wrote) -> int:
    """Write ``payload`` into the new file ``fd``; returns the file's size."""
    if isinstance(payload, bytes):
        write_all(fd, payload)
        if digest is not None:
            digest.update(payload)
        return len(payload)
    if isinstance(payload, tuple):
        src_fd, offset, size = payload
        copy_range(src_fd, fd, offset, size)
        if digest is not None:
            _hash_range(digest, src_fd, offset, size)
        return size
    if isinstance(payload, SparseRanges):
        offset = payload.offset
        for position, length in payload.regions:
            if length:
                os.lseek(fd, position, os.SEEK_SET)
                copy_range(payload.fd, fd, offset, length)
                if digest is not None:
                    _hash_range(digest, payload.fd, offset, length)
                offset += length
        os.ftruncate(fd, payload.size)  # trailing hole; GNU tar leaves holes as holes
        return payload.size
    payload(fd, digest, wrote)
    return os.fstat(fd).st_size  # a stream's copier (a large member): one call is nothing


def _hash_range(digest: Any, fd: int, offset: int, size: int) -> None:
    while size > 0:
        data = os.pread(fd, min(size, READ_CHUNK), offset)
        if not data:
            raise EOFError("archive ended inside a member")
        digest.update(data)
        offset += len(data)
        size -= len(data)


def _read_back(job: _FileJob, expected: Any, archive: str) -> None:
    found = hashlib.sha256()
    fd = os.open(job.path, _READ_FLAGS)
    try:
        if isinstance(job.payload, SparseRanges):
            if os.fstat(fd).st_size != job.payload.size:
                raise _mismatch(job.path, archive, "size")
            for position, length in job.payload.regions:
                if length:
                    _hash_range(found, fd, position, length)
        else:
            while data := os.read(fd, READ_CHUNK):
                found.update(data)
    finally:
        os.close(fd)
    if found.digest() != expected.digest():
        raise _mismatch(job.path, archive, "sha256")


def _mismatch(path: str, archive: str, what: str) -> VerifyFailed:
    return VerifyFailed(
        f"{path} reads back with another {what} than its member in archive {archive} "
        "(verify sha256): the local disk or another writer changed it; check the disk and "
        "stage again"
    )


def _hard_link(path: str, link: HardLink, verify: str | None) -> int:
    """Link ``path`` to the target; returns its bytes (the target's, as ``lstat`` of
    the new name says) less those of what it replaced."""
    try:
        st = os.lstat(link.target)
    except FileNotFoundError:
        st = None
    if st is None or not stat.S_ISREG(st.st_mode):
        raise refused(
            link.archive,
            link.member,
            f"is a hard link to {os.path.basename(link.target)!r}, which no earlier member "
            "of the archive wrote as a file",
        )
    replaced = 0
    try:
        os.link(link.target, path, follow_symlinks=False)
    except FileExistsError:
        replaced = _remove(path)
        os.link(link.target, path, follow_symlinks=False)
    if verify and os.lstat(path).st_ino != st.st_ino:
        raise _mismatch(path, verify, "inode")
    return st.st_size - replaced


# -- the writer ------------------------------------------------------------------


class WriterContext(Protocol):
    """What the writer needs of the op's context (an ``OpContext`` is one)."""

    verify: str
    workers: int
    progress: ProgressSink


class ArchiveWriter:
    """Writes one archive's members under ``root``; call ``finish()`` at the end."""

    def __init__(
        self,
        root: str,
        archive: str,
        ctx: WriterContext,
        pool: Executor | None,
        through_links: bool = True,
        batch_bytes: int = BATCH_BYTES,
    ) -> None:
        """``through_links``: place members under the archive's own safe symlinks, as
        GNU tar does (unzip refuses them: a zip's writer passes False). ``batch_bytes``:
        payload bytes a batch holds before it goes to the pool."""
        self.root = root
        self._batch_bytes = batch_bytes
        self._prefix = os.path.join(root, "")
        self._through_links = through_links
        self.archive = archive
        self._ctx = ctx
        self._pool = pool
        self._verify = archive if ctx.verify == "sha256" else None
        self._dirs: set[str] = {""}  # relative directories known to be real dirs
        self._dir_mtimes: dict[str, float] = {}
        # Symlinks to create at the end, by name, in archive order (the last one wins).
        self._symlinks: dict[str, tuple[str, float]] = {}
        self._batch = _Batch(seq=0)
        # Batches handed to the pool and not yet reaped, and the names they write.
        self._pending: dict[int, tuple[Future[tuple[int, int, int]], list[str]]] = {}
        self._in_flight: dict[str, int] = {}  # name -> seq of the batch writing it
        # Bounds memory held by queued batches (compressed archives pass bytes).
        self._slots = threading.BoundedSemaphore(2 * ctx.workers + 2)
        # Bytes of the files and symlinks this writer left, as ``sum_sizes`` counts them.
        self._made = 0
        self._held = 0  # bytes of folder and link names kept (HELD_NAMES_BYTES)
        os.makedirs(root, exist_ok=True)

    @property
    def made(self) -> int:
        return self._made

    def _report(self, nbytes: int) -> None:
        """A streamed member's chunk, as it lands (any thread): the staging's write
        bound stops a member far larger than the room mid-way, not after it."""
        report_written(self._ctx.progress, nbytes)

    def _counted(self, made: int, streamed: int) -> None:
        """A batch's ``made`` bytes, of which ``streamed`` were reported already."""
        self._made += streamed
        self.made += made - streamed

    @made.setter
    def made(self, value: int) -> None:
        # What grows the tree is reported as it is written (a user's quota counts it).
        report_written(self._ctx.progress, value - self._made)
        self._made = value

    def adopt_folders(self, folders: set[str], mtimes: dict[str, float]) -> None:
        """Folders made for this archive before this writer (real folders, by relative
        path, their cost charged by whoever made them), and the mtimes ``finish`` gives
        them."""
        for rel in folders:
            self._hold(rel, rel)
        self._dirs |= folders
        self._dir_mtimes.update(mtimes)

    def _hold(self, name: str, member: str) -> None:
        """Count a name this writer keeps (a folder's, a link's) against the bound on
        what it may keep."""
        self._held += len(name) + _HELD_OVERHEAD
        if self._held > HELD_NAMES_BYTES:
            raise too_many_names(self.archive, member)

    # -- names ------------------------------------------------------------

    def _place(self, rel: str, label: str) -> str:
        """Where a member named ``rel`` goes: its folder made, resolved through the
        archive's own symlinks where a member lies under one."""
        parent, _, name = rel.rpartition("/")
        if parent in self._dirs:
            return rel
        parent = self._real_dir(parent, label, create=True)
        return f"{parent}/{name}" if parent else name

    def _real_dir(self, rel: str, label: str, create: bool) -> str:
        """The real folder ``rel`` names, its components made where ``create`` (those
        of a symlink's target must be folders already), walked through the archive's
        own symlinks. A loop, so that no stack grows with the depth."""
        if rel in self._dirs:
            return rel
        # The nearest folder known to be real (mostly the parent), then down from it.
        end = len(rel)
        while end > 0 and rel[:end] not in self._dirs:
            end = rel.rfind("/", 0, end)
        head = rel[:end] if end > 0 else ""
        rest = rel[end + 1 :] if end > 0 else rel
        todo = [(part, create) for part in reversed(rest.split("/"))]  # next one last
        hops = 0
        while todo:
            tail, may_create = todo.pop()
            here = f"{head}/{tail}" if head else tail
            if here in self._dirs:
                head = here
                continue
            if here in self._symlinks:
                target = self._symlinks[here][0]
                if not self._through_links:
                    raise unsafe(
                        self.archive, label, f"written through the archive's symlink {here!r}"
                    )
                hops += 1
                parts = through_link(self.archive, label, here, target, hops)
                head = ""
                todo += [(part, False) for part in reversed(parts)]
                continue
            if not may_create:
                raise refused(self.archive, label, f"needs the folder {here!r}, which is not one")
            self._make_dir(here, label)
            head = here
        return head

    def _make_dir(self, rel: str, label: str, replace_file: bool = False) -> None:
        """``rel`` as a real directory. A leftover symlink is replaced; a file only for
        an explicit folder member (an implicit parent over a file fails in GNU tar)."""
        if rel in self._in_flight:
            if not replace_file:  # the same words as for one written already
                raise refused(self.archive, label, f"needs the folder {rel!r}, a file")
            self._wait_for(rel)
        path = self._path(rel)
        self._hold(rel, label)
        # Charged before it is made: an archive of nothing but folders stops at its bound.
        report_written(self._ctx.progress, FOLDER_BYTES + entry_bytes(rel), 1)
        try:
            os.mkdir(path)
        except FileExistsError:
            mode = os.lstat(path).st_mode
            if stat.S_ISDIR(mode):
                pass
            elif stat.S_ISLNK(mode) or replace_file:
                self.made -= _remove(path)
                os.mkdir(path)
            else:
                raise refused(self.archive, label, f"needs the folder {rel!r}, a file") from None
        self._dirs.add(rel)

    def _claim(self, rel: str, label: str, same_batch: bool) -> None:
        """Make ``rel`` free for a new file or link: a pending symlink there is dropped,
        an empty folder removed, a write of it in flight awaited."""
        if rel in self._dirs:
            self._replace_dir(rel, label)
        self._symlinks.pop(rel, None)
        if rel in self._in_flight and not (same_batch and self._in_flight[rel] == self._batch.seq):
            self._wait_for(rel)

    def _replace_dir(self, rel: str, label: str) -> None:
        self.flush()  # files being written into it count
        try:
            os.rmdir(self._path(rel))
        except OSError as exc:
            if exc.errno in (errno.ENOTEMPTY, errno.EEXIST):
                raise refused(
                    self.archive, label, "replaces a folder that other members filled"
                ) from exc
            raise
        self._dirs.discard(rel)
        self._dir_mtimes.pop(rel, None)

    # -- directories ------------------------------------------------------

    def ensure_dir(self, rel: str, label: str) -> str:
        """``rel`` (resolved like a member's folder) as a real directory; its real path."""
        return self._real_dir(rel, label, create=True) if rel else ""

    def directory(self, rel: str, mtime: float, label: str) -> None:
        rel = self._place(rel, label)
        self._symlinks.pop(rel, None)  # a folder replaces a symlink, as in GNU tar
        if rel not in self._dirs:
            self._make_dir(rel, label, replace_file=True)
        self._dir_mtimes[rel] = mtime

    # -- files --------------------------------------------------------------

    def file(
        self,
        rel: str,
        mode: int,
        mtime: float,
        payload: Payload,
        archive_bytes: int,
        inline: bool = False,
    ) -> str:
        """Write a regular file, in order with the archive's other members: batched (on
        the pool, if any) unless ``inline`` (payloads tied to this thread: now). Returns
        where it went, relative to the root."""
        if isinstance(payload, tuple) and not inline:
            return self.range_file(rel, mode, mtime, *payload, archive_bytes)
        rel = self._place(rel, rel)
        self._claim(rel, rel, same_batch=not inline)
        job = _FileJob(self._path(rel), mode, mtime, payload)
        if inline:
            report_written(self._ctx.progress, entry_bytes(rel), 1)
            _, made, streamed = write_files([job], self._verify, self._report)
            self._counted(made, streamed)
            self._ctx.progress.advance(archive_bytes, 1)
        else:
            self._add(rel, job, archive_bytes, len(payload) if isinstance(payload, bytes) else 0)
        return rel

    def range_file(
        self, rel: str, mode: int, mtime: float, fd: int, offset: int, size: int, share: int
    ) -> str:
        """:meth:`file` for the commonest member, a byte range of a plain tar: the
        per-file path that a million-file archive runs a million times."""
        if rel.rpartition("/")[0] not in self._dirs:
            rel = self._place(rel, rel)
        if rel in self._in_flight or rel in self._dirs or rel in self._symlinks:
            self._claim(rel, rel, same_batch=True)
        batch = self._batch
        batch.jobs.append((self._prefix + rel, mode, mtime, fd, offset, size))
        batch.names.append(rel)
        self._in_flight[rel] = batch.seq
        batch.share += share
        batch.charge += entry_bytes(rel)
        batch.inodes += 1
        if len(batch.jobs) >= _BATCH_FILES:
            self._submit()
        return rel

    def _add(self, rel: str, job: _FileJob, share: int, nbytes: int = 0) -> None:
        batch = self._batch
        batch.jobs.append(job)
        batch.names.append(rel)
        self._in_flight[rel] = batch.seq
        batch.share += share
        batch.nbytes += nbytes
        batch.charge += entry_bytes(rel)
        batch.inodes += not isinstance(job.payload, HardLink)
        if len(batch.jobs) >= _BATCH_FILES or batch.nbytes >= self._batch_bytes:
            self._submit()

    def _submit(self) -> None:
        batch = self._batch
        if not batch.jobs:
            return
        self._batch = _Batch(seq=batch.seq + 1)
        # Its names charged before they are made (an archive of empty files or hard
        # links costs entries and inodes, not bytes); past a bound, the error is here.
        report_written(self._ctx.progress, batch.charge, batch.inodes)
        if self._pool is None:  # no pool: write now, on this thread
            for name in batch.names:
                if self._in_flight.get(name) == batch.seq:
                    del self._in_flight[name]
            files, made, streamed = write_files(batch.jobs, self._verify, self._report)
            self._counted(made, streamed)
            self._ctx.progress.advance(batch.share, files)
            return
        self._slots.acquire()
        # A thread reports a streamed member's chunks as they land (a process cannot).
        wrote = self._report if isinstance(self._pool, ThreadPool) else _uncounted
        future = self._pool.submit(write_files, batch.jobs, self._verify, wrote)
        future.add_done_callback(functools.partial(self._batch_done, batch.share))
        self._pending[batch.seq] = (future, batch.names)
        if len(self._pending) > 16:
            self._reap(wait=False)

    def _batch_done(self, share: int, future: Future[tuple[int, int, int]]) -> None:
        self._slots.release()
        if not future.cancelled() and future.exception() is None:
            self._ctx.progress.advance(share, future.result()[0])

    def _wait_for(self, rel: str) -> None:
        """Until the batch that writes ``rel`` is done (handing it over if still ours)."""
        seq = self._in_flight[rel]
        if seq == self._batch.seq:
            self._submit()
        self._reap(wait=True, upto=seq)

    def _reap(self, wait: bool, upto: int | None = None) -> None:
        for seq in list(self._pending):
            future, names = self._pending[seq]
            if not (future.done() or (wait and (upto is None or seq <= upto))):
                continue
            # Re-raises a worker's error here, on the caller's thread.
            _, made, streamed = future.result()
            self._counted(made, streamed)
            del self._pending[seq]
            for name in names:
                if self._in_flight.get(name) == seq:
                    del self._in_flight[name]

    # -- links --------------------------------------------------------------

    def symlink(self, rel: str, target: str, mtime: float) -> None:
        rel = self._place(rel, rel)
        if rel in self._dirs:
            self._replace_dir(rel, rel)
        # Made at the end, kept until then: its name and inode charged now.
        self._hold(rel + target, rel)
        report_written(self._ctx.progress, entry_bytes(rel), 1)
        self._symlinks.pop(rel, None)  # re-added last: a later copy wins
        self._symlinks[rel] = (target, mtime)

    def hardlink(self, rel: str, target: str) -> None:
        """A hard link, made in archive order: to the target's content at that point."""
        rel = self._place(rel, rel)
        parent, _, name = target.rpartition("/")
        parent = self._real_dir(parent, rel, create=False) if parent else ""
        target = f"{parent}/{name}" if parent else name
        if target in self._symlinks or target in self._dirs:
            kind = "a symlink" if target in self._symlinks else "a folder"
            raise refused(self.archive, rel, f"is a hard link to {target!r}, {kind}")
        self._claim(rel, rel, same_batch=True)
        if target in self._in_flight and self._in_flight[target] != self._batch.seq:
            self._wait_for(target)
        # The target counts as written by this batch: a later member replacing it waits
        # until the link is made, so the link gets the content it had at this point.
        self._in_flight[target] = self._batch.seq
        self._batch.names.append(target)
        link = HardLink(self._path(target), self.archive, rel)
        self._add(rel, _FileJob(self._path(rel), 0, 0, link), 0)

    # -- end ----------------------------------------------------------------

    def flush(self) -> None:
        """Wait for every queued file; raises the first worker error."""
        self._submit()
        self._reap(wait=True)

    def abort(self) -> None:
        """On an error or cancel: drop queued batches, wait for running ones, so nothing
        writes after we return."""
        for future, _names in self._pending.values():
            future.cancel()
        for future, _names in self._pending.values():
            if not future.cancelled():
                future.exception()
        self._pending = {}
        self._in_flight = {}

    def finish(self) -> None:
        self.flush()
        for rel, (target, mtime) in self._symlinks.items():
            self._replace(rel, lambda p, t=target: os.symlink(t, p))
            self.made += len(os.fsencode(target))  # a symlink's size: its target's bytes
            os.utime(self._path(rel), (mtime, mtime), follow_symlinks=False)
            if self._verify and os.readlink(self._path(rel)) != target:
                raise _mismatch(self._path(rel), self.archive, "symlink target")
            self._ctx.progress.advance(0, 1)
        self._check_symlinks()
        # Deepest first: creating entries inside a directory resets its mtime.
        for rel in sorted(self._dir_mtimes, key=lambda r: r.count("/"), reverse=True):
            mtime = self._dir_mtimes[rel]
            os.utime(self._path(rel), (mtime, mtime))

    def _path(self, rel: str) -> str:
        return os.path.join(self.root, rel)

    def _replace(self, rel: str, create: Callable[[str], None]) -> None:
        path = self._path(rel)
        try:
            create(path)
        except FileExistsError:
            self.made -= _remove(path)  # a file of this archive the link replaces, or a leftover
            create(path)

    def _check_symlinks(self) -> None:
        # Each link was judged alone before creation; chains (a -> b/.., b -> .)
        # can still escape together, so resolve them all now that they exist.
        root = os.path.realpath(self.root)
        for rel in self._symlinks:
            resolved = os.path.realpath(self._path(rel))
            if resolved != root and not resolved.startswith(root + os.sep):
                for name in self._symlinks:
                    if os.path.islink(self._path(name)):
                        os.unlink(self._path(name))
                raise unsafe(self.archive, rel, "symlink chain resolves outside the destination")
