"""The ``extract`` op: tar, tar.gz/bz2/xz/zst and zip, nested archives, never outside ``dst``.

How it is fast (measured on 2 cores, 20,000 files of 4-100 KB; see
bench/bench_extract.py): the main thread only reads headers (common ones in
:mod:`stager.archive.tar_members`, the rest with ``tarfile`` in random-access mode)
and hands files to a pool in batches. For a plain tar a
file is a byte range of the archive, copied by ``os.copy_file_range`` without
passing through Python, and the pool is worker *processes*: what is left per
file (open, copy, utime, close and the Python around them) is GIL-bound, so
threads take turns where processes use every core. For compressed tars the
main thread reads the decompressed stream in 4 MiB chunks (gzip: python-isal
inflates ahead on a thread of its own) and a thread pool writes the slices
(shipping them to processes would cost a copy each).
Nested archives inside a plain tar (ImageNet's 1,000 class tars) are read in
place from their byte range, each extracted whole by one worker process, and
never written to disk.

Worker processes are forked, before this op starts any thread of its own, so
they inherit the open archive and start in milliseconds; a small archive is
not worth even that and stays on threads (``PROCESS_MIN_BYTES``).

Safety decisions live in :mod:`stager.archive.writer` (paths, directories,
link ordering); links and special files are judged by ``tarfile.data_filter``.
Library errors become ours in :func:`_translate`, the one place that maps them.
"""

from __future__ import annotations

import contextlib
import errno
import io
import lzma
import multiprocessing
import os
import shutil
import stat
import tarfile
import time
import zipfile
import zlib
from collections.abc import Iterator
from concurrent.futures import Executor, Future, ProcessPoolExecutor, ThreadPoolExecutor
from contextlib import contextmanager, suppress
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import zstandard
from isal import isal_zlib
from pydantic import Field

from stager.archive import tar_members
from stager.archive.formats import (
    ARCHIVE_SUFFIXES,
    STREAM_CHUNK,
    ArchiveFormat,
    StreamReader,
    archive_suffix,
    estimate_output,
    open_decompressed,
    resolve_format,
    sniff,
)
from stager.archive.writer import (
    NUL_IN_NAME,
    ArchiveWriter,
    Payload,
    SparseRanges,
    file_mode,
    unsafe,
)
from stager.children import die_with_parent
from stager.errors import (
    CorruptArchive,
    StagerError,
    StagingIOError,
    UnknownFormat,
    VerifyFailed,
)
from stager.fs.forked import paused_gc
from stager.fs.sources import open_source, require_source
from stager.ops.base import (
    CheckContext,
    OpContext,
    RelativePath,
    SourceOrInside,
    StepParams,
)
from stager.progress import Progress


class ExtractStep(StepParams):
    """Extract an archive; ``nested`` also extracts archives found inside it.

    A relative ``src`` names an archive an earlier step wrote into the dataset (a
    fetch); it is deleted once extracted unless ``keep`` is set.
    """

    src: SourceOrInside
    dst: RelativePath = "."
    format: ArchiveFormat = "auto"
    strip_components: int = Field(default=0, ge=0, le=1024)
    nested: bool = False
    keep: bool = False  # keep an archive that an earlier step wrote into the dataset


# Members of compressed tars larger than this are written by the main thread
# straight from the stream, so a 10 GB member never sits in memory whole.
_INLINE_BYTES = 32 << 20
# Archives smaller than this extract on threads: forking workers costs ~10 ms.
PROCESS_MIN_BYTES = 64 << 20
_CORRUPT = (
    tarfile.TarError,
    zipfile.BadZipFile,
    EOFError,
    zlib.error,
    isal_zlib.error,
    lzma.LZMAError,
    zstandard.ZstdError,
)


def check(step: ExtractStep, ctx: CheckContext) -> int:
    """Pre-flight: the archive is readable, its format known, its first header sane.

    Returns the bytes extraction will write (see ``estimate_output``).
    """
    if not step.src.startswith("/"):
        return 0  # an earlier step's output (a fetch): nothing to look at yet
    source = require_source(step.src, "archive")
    with _translate(step.src), _open_archive(str(source), ctx.allowed_roots) as raw:
        # Only a few blocks are read here, and extraction opens the archive again;
        # on a network filesystem, read-ahead would fetch (and a re-open drop) far
        # more than that: 0.8 MB over sshfs for any .tar.gz before this.
        with suppress(OSError):  # advice only
            os.posix_fadvise(raw.fileno(), 0, 0, os.POSIX_FADV_RANDOM)
        fmt = resolve_format(step.src, step.format, raw.read(tarfile.BLOCKSIZE))
        size = os.fstat(raw.fileno()).st_size
        estimate = estimate_output(step.src, fmt, size, raw)
        raw.seek(0)
        _read_first_header(raw, fmt)
        return estimate


def _open_archive(path: str, allowed_roots: tuple[Path, ...]) -> io.FileIO:
    """The archive, opened confined to ``allowed_roots`` through any chain of links,
    and never a FIFO or device (see :mod:`stager.fs.sources`)."""
    return open(open_source(path, allowed_roots), "rb", buffering=0)


def _read_first_header(raw: io.RawIOBase, fmt: str) -> None:
    if fmt == "zip":
        zipfile.ZipFile(raw).close()  # reads the central directory at the end
    elif fmt == "tar":
        tar_members.open_tar(raw).close()  # type: ignore[arg-type]
    else:
        with open_decompressed(_SmallReads(raw), fmt) as stream:  # type: ignore[arg-type]
            head = stream.read(tarfile.BLOCKSIZE)
        if sniff(head) != "tar":
            raise tarfile.ReadError("the decompressed data is not a tar archive")


class _SmallReads(io.RawIOBase):
    """``raw``, handing out at most ``_SIP`` bytes per read.

    Decompressors fill large buffers (igzip 512 KiB, zstd 1 MiB) where the check
    needs the first 512 bytes of output: a few KiB of input for gzip, xz and zstd
    (bz2 decodes whole blocks, up to 900 kB of input, and still reads what it needs).
    A short read makes them ask again only when they need more.
    """

    _SIP = 16 << 10

    def __init__(self, raw: io.RawIOBase) -> None:
        super().__init__()
        self._raw = raw

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int | None:  # type: ignore[override]
        return self._raw.readinto(memoryview(buffer)[: self._SIP])


def run(step: ExtractStep, ctx: OpContext) -> None:
    """Extract ``step.src`` into ``ctx.destination(step.dst)``; safe to re-run."""
    source = require_source(ctx.source(step.src), "archive")
    dest = ctx.destination(step.dst)
    # An absolute src is the user's and must lie under the allowed roots; a relative one
    # is an earlier step's output inside the dataset (ctx.source keeps it there).
    roots = ctx.allowed_roots if step.src.startswith("/") else ()
    with _translate(step.src), _open_archive(str(source), roots) as raw:
        fd = raw.fileno()
        before = os.fstat(fd)
        ctx.progress.add_total(before.st_size, 0)
        fmt = resolve_format(step.src, step.format, os.pread(fd, tarfile.BLOCKSIZE, 0))
        job = _Job(ctx, step.strip_components, step.nested)
        try:
            with paused_gc(), _executors(job, fmt, before.st_size):
                try:
                    archive = _Archive(fd, 0, before.st_size, fmt, step.src)
                    _extract(job, archive, str(dest), outer=True)
                finally:
                    job.cancel_inner()
        except CorruptArchive as exc:
            if ctx.verify != "none":
                _require_unchanged(fd, before, step.src, exc)  # a short read may be a rewrite
            raise
        if ctx.verify != "none":
            _require_unchanged(fd, before, step.src)


def _require_unchanged(
    fd: int, before: os.stat_result, label: str, cause: BaseException | None = None
) -> None:
    """Fail when the archive was written to while it was read: what was extracted may
    mix two versions. ``fstat`` on the descriptor read is cheap and cannot be fooled by
    a rename."""
    after = os.fstat(fd)
    moved = [
        what
        for what, old, new in (
            ("size", before.st_size, after.st_size),
            ("modification time", before.st_mtime_ns, after.st_mtime_ns),
            ("change time", before.st_ctime_ns, after.st_ctime_ns),
        )
        if old != new
    ]
    if moved:
        raise VerifyFailed(
            f"archive {label} changed while it was being extracted (its {' and '.join(moved)} "
            "moved); stage it again once nothing writes to it"
        ) from cause


@dataclass
class _Archive:
    """An archive as a byte range of an open file: a whole file or a nested member."""

    fd: int
    base: int
    length: int
    fmt: str
    label: str  # how messages name it


@dataclass
class _Job:
    ctx: OpContext
    strip: int
    nested: bool
    files_pool: Executor | None = None  # writes the outer archive's files
    inner_pool: Executor | None = None  # extracts inner archives, one task each
    inner: list[Future[tuple[int, int]]] = field(default_factory=list)
    inner_roots: dict[str, Future[tuple[int, int]]] = field(default_factory=dict)
    written_inner: dict[str, str] = field(default_factory=dict)  # path -> label

    def start_inner(self, task: Any, *args: Any) -> Future[tuple[int, int]]:
        """Run ``task(*args) -> (bytes, files)`` on the inner pool; count it when done."""
        assert self.inner_pool is not None
        future = self.inner_pool.submit(task, *args)
        future.add_done_callback(self._count_inner)
        self.inner.append(future)
        return future

    def _count_inner(self, future: Future[tuple[int, int]]) -> None:
        if not future.cancelled() and future.exception() is None:
            self.ctx.progress.advance(*future.result())

    def wait_inner(self) -> None:
        for future in self.inner:
            self.ctx.check_cancelled()
            future.result()

    def cancel_inner(self) -> None:
        for future in self.inner:
            future.cancel()
        for future in self.inner:
            if not future.cancelled():
                future.exception()  # wait, so nothing writes after run() returns


@contextmanager
def _executors(job: _Job, fmt: str, size: int) -> Iterator[None]:
    """The pools ``job`` uses, shut down (queued work dropped) when the op ends."""
    cores = _cores(job.ctx)
    processes = None
    if cores > 1 and size >= PROCESS_MIN_BYTES and (fmt == "tar" or job.nested):
        processes = _process_pool(cores)  # first: no thread of ours exists to fork with
    needs_threads = processes is None or fmt != "tar"
    threads = ThreadPoolExecutor(cores, thread_name_prefix="extract") if needs_threads else None
    job.files_pool = processes if fmt == "tar" and processes else threads
    job.inner_pool = processes or threads
    try:
        yield
    finally:
        for pool in (threads, processes):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)


def _process_pool(workers: int) -> ProcessPoolExecutor:
    pool = ProcessPoolExecutor(
        workers, mp_context=multiprocessing.get_context("fork"), initializer=die_with_parent
    )
    # With fork, the first task starts every worker: do it now, while this process
    # runs no thread of its own (the pool's helper threads start after the forks).
    pool.submit(int).result()
    return pool


@contextmanager
def _translate(archive: str) -> Iterator[None]:
    """The one place where library and OS errors become the daemon's errors."""
    try:
        yield
    except StagerError:
        raise
    except tarfile.FilterError as exc:
        raise unsafe(archive, exc.tarinfo.name, str(exc)) from exc
    except _CORRUPT as exc:
        raise _corrupt(archive, exc) from exc
    except NotImplementedError as exc:  # zipfile: a compression method it lacks
        raise UnknownFormat(
            f"archive {archive} uses a zip compression method that is not supported ({exc}); "
            "re-create it with deflate or store"
        ) from exc
    except OSError as exc:
        if exc.errno == errno.ENOSPC:
            raise StagingIOError(
                f"the local disk is full while extracting {archive}; free space in the cache "
                "directory or stage fewer datasets"
            ) from exc
        if exc.errno is None:  # gzip/bz2 report bad data as an OSError without errno
            raise _corrupt(archive, exc) from exc
        raise StagingIOError(
            f"extracting {archive} failed: {exc.strerror} ({exc.filename or 'archive'}); "
            "check the disk and permissions"
        ) from exc


def _corrupt(archive: str, exc: BaseException) -> CorruptArchive:
    return CorruptArchive(
        f"archive {archive} is truncated or corrupt ({exc}); re-download or re-create it"
    )


# -- one archive -----------------------------------------------------------


def _extract(job: _Job, archive: _Archive, root: str, outer: bool) -> None:
    """Extract one archive under ``root``; the outer one uses the pool for files."""
    pool = job.files_pool if outer else None
    writer = ArchiveWriter(root, archive.label, job.ctx, pool, through_links=archive.fmt != "zip")
    strip = job.strip if outer else 0
    try:
        if archive.fmt == "zip":
            _extract_zip(job, archive, writer, strip, outer)
        else:
            _extract_tar(job, archive, writer, strip, outer)
        if outer:
            # Inner archives write under this tree: they must be done before any link of
            # the outer archive exists, or a pair of links that escapes only together
            # could be written through before ``finish`` checks and removes it.
            writer.flush()
            job.wait_inner()
            _extract_written_inner(job)
        writer.finish()
    finally:
        writer.abort()


def _cores(ctx: OpContext) -> int:
    """Extraction is CPU-bound (headers, decompression, per-file calls): workers beyond
    the cores only fight over them (measured: 8 threads on 2 cores extract ImageNet-style
    nested tars 25% slower than 2). Copies, which wait on a network filesystem, keep
    using all of ``ctx.workers``."""
    return max(1, min(ctx.workers, len(os.sched_getaffinity(0))))


class _RangeFile(io.RawIOBase):
    """A read-only, seekable view of ``length`` bytes at ``base`` of a descriptor.

    ``pread`` keeps one shared descriptor usable from many threads at once.
    """

    def __init__(self, fd: int, base: int, length: int) -> None:
        super().__init__()
        self._fd, self._base, self._length, self._pos = fd, base, length, 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def readinto(self, buffer: bytearray | memoryview) -> int:  # type: ignore[override]
        count = min(len(buffer), self._length - self._pos)
        if count <= 0:
            return 0
        done = os.preadv(self._fd, [memoryview(buffer)[:count]], self._base + self._pos)
        self._pos += done
        return done

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        anchor = {os.SEEK_SET: 0, os.SEEK_CUR: self._pos, os.SEEK_END: self._length}[whence]
        self._pos = max(0, anchor + pos)
        return self._pos

    def tell(self) -> int:
        return self._pos


# -- tar ---------------------------------------------------------------------


HEADER_READAHEAD = 16384


def _extract_tar(job: _Job, archive: _Archive, writer: ArchiveWriter, strip: int, outer: bool):
    raw = _RangeFile(archive.fd, archive.base, archive.length)
    stream: StreamReader | None = None
    if archive.fmt != "tar":
        buffered = io.BufferedReader(raw, STREAM_CHUNK)  # type: ignore[arg-type]
        decompressed = open_decompressed(buffered, archive.fmt, read_ahead=True)
        stream = StreamReader(decompressed, raw)
    # Closed also when the extraction fails: that stops gzip's read-ahead thread.
    with stream if stream is not None else contextlib.nullcontext():
        # Headers of a plain tar are read through a read-ahead buffer: with small members
        # the next header usually lies in the same window, which saves a pread per header
        # (member data itself is copied by offset, not through this buffer).
        headers = stream or io.BufferedReader(raw, HEADER_READAHEAD)  # type: ignore[arg-type]
        # A plain tar's file member in the fast header format (tar_members.Member, no sparse
        # map, no pax) goes straight to the writer: the loop a million-file archive runs
        # a million times, so it skips the general dispatch of _tar_member.
        ranges = stream is None and not (job.nested and outer)
        fast, dirtype, fd, base = tar_members.Member, tarfile.DIRTYPE, archive.fd, archive.base
        with tar_members.open_tar(headers) as tar:  # type: ignore[arg-type]
            consumed = 0
            blocks = tar_members.Blocks(fd, base, archive.length) if stream is None else None
            check = job.ctx.check_cancelled
            for member, next_header in tar_members.members(tar, headers, check, blocks):
                now = stream.compressed_pos() if stream else next_header
                share, consumed = now - consumed, now
                if ranges and member.__class__ is fast and member.type != dirtype:
                    rel = writer.clean_name(member.name, strip)
                    if rel is not None:
                        size = member.size
                        if member.offset_data + size > archive.length:
                            _require_inside(archive, member, size)
                        offset, mode = base + member.offset_data, file_mode(member.mode)
                        writer.range_file(rel, mode, member.mtime, fd, offset, size, share)
                        continue
                _tar_member(job, archive, writer, tar, stream, member, strip, share, outer)
            if stream is not None:
                stream.drain()  # lets the decompressor verify its checksum and length
            job.ctx.progress.advance(max(0, archive.length - consumed), 0)


# Member types of GNU tar's beyond tarfile's; anything else unknown is a regular file, as
# POSIX asks and GNU tar does ("Unknown file type, extracted as normal file").
_VOLUME_LABEL, _MULTIVOLUME, _DUMPDIR, _OLD_NAMES = b"V", b"M", b"D", b"N"


def _tar_member(
    job: _Job,
    archive: _Archive,
    writer: ArchiveWriter,
    tar: tarfile.TarFile,
    stream: StreamReader | None,
    member: tarfile.TarInfo,
    strip: int,
    share: int,
    outer: bool,
) -> None:
    if member.type == _MULTIVOLUME:
        raise UnknownFormat(
            f"archive {archive.label} is a later volume of a multi-volume archive (tar -M): "
            f"its member {member.name!r} starts in another volume; stager extracts whole "
            "archives only (GNU tar cannot extract one volume alone either); join the "
            "volumes into one archive"
        )
    if member.type == _OLD_NAMES:
        raise UnknownFormat(
            f"archive {archive.label} holds an obsolete GNU 'names' member {member.name!r}; "
            "re-create the archive with a current tar"
        )
    rel = None if member.type == _VOLUME_LABEL else writer.clean_name(member.name, strip)
    if rel is None:  # stripped away, the archive's own folder, or a volume label
        job.ctx.progress.advance(share, 0)
        return
    if member.isreg() or member.type not in _NOT_FILES:
        if job.nested and outer and _nested_suffix(rel):
            if stream is None and _start_inner(job, archive, writer, member, rel):
                job.ctx.progress.advance(share - member.size, 0)
                return
        if stream is None and member.sparse is None:  # the common case, kept short
            if member.offset_data + member.size > archive.length:
                _require_inside(archive, member, member.size)
            offset = archive.base + member.offset_data
            mode, size = file_mode(member.mode), member.size
            rel = writer.range_file(rel, mode, member.mtime, archive.fd, offset, size, share)
            return
        payload = _tar_payload(archive, tar, stream, member)
        inline = callable(payload)
        rel = writer.file(rel, file_mode(member.mode), member.mtime, payload, share, inline)
        if job.nested and outer and stream is not None and _nested_suffix(rel):
            job.written_inner[os.path.join(writer.root, rel)] = f"{archive.label}:{rel}"
        return
    job.ctx.progress.advance(share, 0)
    if member.isdir() or member.type == _DUMPDIR:  # a dumpdir's data lists its entries
        writer.directory(rel, member.mtime, member.name)
    elif member.issym():
        _judge_link(member.replace(name=rel, deep=False), writer.root, archive.label, member.name)
        writer.symlink(rel, member.linkname, member.mtime)
    elif member.islnk():
        target = writer.clean_name(member.linkname, strip, f"{member.name} -> {member.linkname}")
        if target is not None:
            link = member.replace(name=rel, linkname=target, deep=False)
            _judge_link(link, writer.root, archive.label, member.name)
            writer.hardlink(rel, target)
    else:
        raise unsafe(archive.label, member.name, "a device file or FIFO")


_NOT_FILES = frozenset(
    (
        tarfile.DIRTYPE,
        tarfile.SYMTYPE,
        tarfile.LNKTYPE,
        tarfile.CHRTYPE,
        tarfile.BLKTYPE,
        tarfile.FIFOTYPE,
        _DUMPDIR,
    )
)


def _judge_link(link: tarfile.TarInfo, root: str, archive: str, label: str) -> None:
    """Refuse a link (of a tar or a zip) whose target leaves ``root`` or cannot be a
    path; ``label`` is the member's name as the archive gives it, for the error."""
    if "\0" in link.linkname:  # before tarfile, which would fail on it with a ValueError
        raise unsafe(archive, label, NUL_IN_NAME)
    # tarfile's data filter decides (absolute targets, targets resolving
    # outside); its FilterError is mapped to UnsafeArchiveMember in _translate.
    tarfile.data_filter(link, root)


def _tar_payload(
    archive: _Archive, tar: tarfile.TarFile, stream: StreamReader | None, member: tarfile.TarInfo
) -> Payload:
    if member.sparse is not None:
        return _sparse_payload(archive, stream, member)
    if stream is None:
        _require_inside(archive, member, member.size)
        return (archive.fd, archive.base + member.offset_data, member.size)
    stream.seek(member.offset_data)
    if member.size > _INLINE_BYTES:
        return _copier(stream, member.size)
    data = stream.read(member.size)
    if len(data) != member.size:
        raise EOFError(f"archive ended inside member {member.name!r}")
    return data


def _require_inside(archive: _Archive, member: tarfile.TarInfo, stored: int) -> None:
    if member.offset_data + stored > archive.length:
        raise EOFError(
            f"member {member.name!r} runs past the end of the archive: it was cut short, or "
            "it is one volume of a multi-volume archive (tar -M), which stager does not "
            "extract"
        )


def _sparse_payload(
    archive: _Archive, stream: StreamReader | None, member: tarfile.TarInfo
) -> Payload:
    """A member with holes (``tar --sparse``, any of GNU's formats, as tarfile reads
    its map): only its data is copied, the holes stay holes, as GNU tar leaves them."""
    regions = tuple((position, length) for position, length in member.sparse if length)
    stored = sum(length for _, length in regions)
    if stream is None:
        _require_inside(archive, member, stored)
        offset = archive.base + member.offset_data
        return SparseRanges(archive.fd, offset, regions, member.size)
    stream.seek(member.offset_data)

    def copy(fd: int, digest: Any) -> None:
        for position, length in regions:
            os.lseek(fd, position, os.SEEK_SET)
            _stream_into(stream, fd, length, digest)
        os.ftruncate(fd, member.size)

    return copy


def _copier(stream: StreamReader, size: int):  # noqa: ANN202 - a Payload callable
    def copy(fd: int, digest: Any) -> None:
        _stream_into(stream, fd, size, digest)

    return copy


def _stream_into(stream: StreamReader, fd: int, size: int, digest: Any) -> None:
    left = size
    while left > 0:
        data = stream.read(min(left, STREAM_CHUNK))
        if not data:
            raise EOFError("archive ended inside a member")
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view) :]
        if digest is not None:
            digest.update(data)
        left -= len(data)


# -- nested ------------------------------------------------------------------


def _nested_suffix(rel: str) -> str | None:
    return archive_suffix(rel.rpartition("/")[2])


def _inner_root(writer: ArchiveWriter, rel: str, label: str) -> str:
    suffix = _nested_suffix(rel)
    assert suffix is not None
    return os.path.join(writer.root, writer.ensure_dir(rel[: -len(suffix)], label))


def _start_inner(
    job: _Job, archive: _Archive, writer: ArchiveWriter, member: tarfile.TarInfo, rel: str
) -> bool:
    """Extract an archive member of a plain tar in place, on the pool; False if not one."""
    base = archive.base + member.offset_data
    _require_inside(archive, member, member.size)
    fmt = sniff(os.pread(archive.fd, tarfile.BLOCKSIZE, base))
    if fmt is None:
        return False
    label = f"{archive.label}:{rel}"
    root = _inner_root(writer, rel, member.name)
    earlier = job.inner_roots.get(root)
    if earlier is not None:  # the same inner archive again (tar -u): the last copy wins
        earlier.result()
        shutil.rmtree(root)
        os.mkdir(root)
    job.inner_roots[root] = job.start_inner(
        _extract_inner, archive.fd, base, member.size, fmt, label, root, job.ctx.verify
    )
    return True


# Inner archives are extracted by plain functions of picklable arguments, so that a
# worker process can run them; each counts its own progress and returns it.


def _extract_inner(
    fd: int, base: int, length: int, fmt: str, label: str, root: str, verify: str
) -> tuple[int, int]:
    tally = Progress()
    ctx = OpContext(root=Path(root), progress=tally, verify=verify)
    job = _Job(ctx, strip=0, nested=False)
    with _translate(label):
        _extract(job, _Archive(fd, base, length, fmt, label), root, outer=False)
    return tally.bytes_done, tally.files_done


def _extract_written_inner(job: _Job) -> None:
    """Inner archives of compressed or zip outers were written; extract, then drop them."""
    for path, label in job.written_inner.items():
        job.start_inner(_extract_inner_file, path, label, job.ctx.verify)
    job.wait_inner()


def _extract_inner_file(path: str, label: str, verify: str) -> tuple[int, int]:
    with _translate(label):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            fmt = sniff(os.pread(fd, tarfile.BLOCKSIZE, 0))
            if fmt is None:
                return 0, 0  # named like an archive, but is not one: keep it as a file
            folder = path[: -len(_nested_suffix(path) or "")]
            os.makedirs(folder, exist_ok=True)
            _, files = _extract_inner(fd, 0, size, fmt, label, folder, verify)
        finally:
            os.close(fd)
        os.unlink(path)
    # Bytes were counted when the outer archive was read; count files only.
    return 0, files


# -- zip ---------------------------------------------------------------------


def _extract_zip(job: _Job, archive: _Archive, writer: ArchiveWriter, strip: int, outer: bool):
    with zipfile.ZipFile(_RangeFile(archive.fd, archive.base, archive.length)) as zf:
        counted = 0
        for info in zf.infolist():
            job.ctx.check_cancelled()
            # Local header (30 bytes + name) and data; the central directory is the rest.
            share = min(info.compress_size + len(info.filename) + 30, archive.length - counted)
            counted += share
            name = _zip_name(archive, info)
            rel = writer.clean_name(name, strip, name)
            if rel is None:
                job.ctx.progress.advance(share, 0)
                continue
            _zip_member(job, archive, writer, zf, info, rel, share, outer)
        writer.flush()  # workers read through ``zf``: finish before it closes
    job.ctx.progress.advance(archive.length - counted, 0)


def _zip_name(archive: _Archive, info: zipfile.ZipInfo) -> str:
    # zipfile keeps backslashes on POSIX; zips written on Windows use them as
    # separators, so '..\\x' is a traversal attempt there: refuse it here too.
    parts = info.filename.replace("\\", "/").split("/")
    if ".." in parts:
        raise unsafe(archive.label, info.filename, "'..' component leads outside the destination")
    if info.flag_bits & 0x1:
        raise UnknownFormat(
            f"archive {archive.label} has an encrypted member {info.filename!r}; "
            "decrypt it before staging"
        )
    if not info.flag_bits & _ZIP_UTF8:
        # Without the UTF-8 flag zipfile decodes names as cp437; unzip on Linux writes
        # the name's bytes as they are (Info-ZIP's zip stores UTF-8 without the flag).
        return info.filename.encode("cp437").decode("utf-8", "surrogateescape")
    return info.filename


_ZIP_UTF8 = 0x800


def _zip_member(
    job: _Job,
    archive: _Archive,
    writer: ArchiveWriter,
    zf: zipfile.ZipFile,
    info: zipfile.ZipInfo,
    rel: str,
    share: int,
    outer: bool,
) -> None:
    mtime = time.mktime((*info.date_time, 0, 0, -1))
    unix_mode = info.external_attr >> 16 if info.create_system == 3 else 0
    if info.is_dir():
        job.ctx.progress.advance(share, 0)
        writer.directory(rel, mtime, info.filename)
    elif stat.S_ISLNK(unix_mode):
        job.ctx.progress.advance(share, 0)
        link = tarfile.TarInfo(rel)
        link.type, link.linkname = tarfile.SYMTYPE, zf.read(info).decode("utf-8", "surrogateescape")
        _judge_link(link, writer.root, archive.label, info.filename)
        writer.symlink(rel, link.linkname, mtime)
    elif stat.S_IFMT(unix_mode) not in (0, stat.S_IFREG):
        # Many writers store permission bits only (no type): those are files.
        raise unsafe(archive.label, info.filename, "a device file, FIFO or socket")
    else:
        mode = file_mode(unix_mode & 0o7777 if unix_mode else None)
        rel = writer.file(rel, mode, mtime, _zip_copier(zf, info), share)
        if job.nested and outer and _nested_suffix(rel):
            job.written_inner[os.path.join(writer.root, rel)] = f"{archive.label}:{rel}"


def _zip_copier(zf: zipfile.ZipFile, info: zipfile.ZipInfo):  # noqa: ANN202 - a Payload callable
    def copy(fd: int, digest: Any) -> None:
        # ZipFile allows concurrent readers; each inflates on its own thread.
        with zf.open(info) as src:
            while data := src.read(STREAM_CHUNK):
                view = memoryview(data)
                while view:
                    view = view[os.write(fd, view) :]
                if digest is not None:
                    digest.update(data)

    return copy


__all__ = ["check", "run", "ARCHIVE_SUFFIXES"]
