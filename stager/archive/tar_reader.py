"""Reading a tar (plain or compressed) into the writer, member by member.

The main thread reads headers (common ones in :mod:`stager.archive.tar_members`, the
rest with ``tarfile``) and hands files to the writer's pool in batches. A plain tar's
file is a byte range, copied by ``copy_file_range``. A compressed tar's stream is read
in chunks (gzip: python-isal inflates ahead on its own thread); a member larger than
``INLINE_BYTES`` is written by the main thread straight from the stream. Sparse
members and GNU's own types end as GNU tar leaves them.
"""

from __future__ import annotations

import contextlib
import io
import os
import tarfile
from collections.abc import Callable
from typing import Any

from stager.archive import tar_members
from stager.archive.formats import STREAM_CHUNK, StreamReader, open_decompressed
from stager.archive.job import Archive, ExtractJob, judge_link, nested_suffix
from stager.archive.writer import (
    ArchiveWriter,
    Payload,
    SparseRanges,
    Wrote,
    clean_name,
    unsafe,
    write_all,
)
from stager.core.errors import UnknownFormat
from stager.fs.seal import FILE_MODE

# Members of compressed tars larger than this are written by the main thread
# straight from the stream, so a 10 GB member never sits in memory whole.
INLINE_BYTES = 32 << 20
HEADER_READAHEAD = 16384

# Extracts an archive member of a plain tar in place (a nested archive); False when
# the member is not an archive after all. See stager.archive.extractor.
StartInner = Callable[[Archive, ArchiveWriter, tarfile.TarInfo, str], bool]


def read_tar(
    job: ExtractJob,
    archive: Archive,
    writer: ArchiveWriter,
    strip: int,
    start_inner: StartInner | None,
    start: int = 0,
) -> None:
    """Every member of the tar ``archive`` to ``writer``, from the header at ``start``
    (a plain tar's: what came before it is written already); ``start_inner`` (an outer
    archive with ``nested``) takes the members that are archives themselves."""
    raw = archive.reader()
    stream = open_stream(archive, raw)
    # Closed also when the extraction fails: that stops gzip's read-ahead thread.
    with stream if stream is not None else contextlib.nullcontext():
        # Headers of a plain tar are read through a read-ahead buffer: with small members
        # the next header usually lies in the same window, which saves a pread per header
        # (member data itself is copied by offset, not through this buffer).
        headers = stream or io.BufferedReader(raw, HEADER_READAHEAD)  # type: ignore[arg-type]
        # A plain tar's file member in the fast header format (tar_members.Member, no sparse
        # map, no pax) goes straight to the writer: the loop a million-file archive runs
        # a million times, so it skips the general dispatch of _tar_member.
        ranges = stream is None and start_inner is None
        fast, dirtype, fd, base = tar_members.Member, tarfile.DIRTYPE, archive.fd, archive.base
        with tar_members.open_tar(headers) as tar:  # type: ignore[arg-type]
            consumed = start
            blocks = tar_members.Blocks(fd, base, archive.length) if stream is None else None
            check = job.ctx.check_cancelled
            for member, next_header in tar_members.members(tar, headers, check, blocks, start):
                now = stream.compressed_pos() if stream else next_header
                share, consumed = now - consumed, now
                if ranges and member.__class__ is fast and member.type != dirtype:
                    rel = clean_name(writer.archive, member.name, strip)
                    if rel is not None:
                        size = member.size
                        if member.offset_data + size > archive.length:
                            require_inside(archive, member, size)
                        offset, mode = base + member.offset_data, FILE_MODE
                        writer.range_file(rel, mode, member.mtime, fd, offset, size, share)
                        continue
                _tar_member(job, archive, writer, stream, member, strip, share, start_inner)
            if stream is not None:
                stream.drain()  # lets the decompressor verify its checksum and length
            length = archive.length if archive.growing is None else raw.tell()
            job.ctx.progress.advance(max(0, length - consumed), 0)


def open_stream(archive: Archive, raw: io.RawIOBase) -> StreamReader | None:
    """A compressed or growing tar's content, decompressed as it is read (None: a
    plain tar, read by offset); a growing one is read once, in order, each read
    waiting for its bytes."""
    if archive.growing is not None:
        decompressed = open_decompressed(raw, archive.fmt, read_ahead=True)  # type: ignore[arg-type]
        return StreamReader(decompressed, raw, arriving=True)  # type: ignore[arg-type]
    if archive.fmt == "tar":
        return None
    buffered = io.BufferedReader(raw, STREAM_CHUNK)  # type: ignore[arg-type]
    return StreamReader(open_decompressed(buffered, archive.fmt, read_ahead=True), raw)  # type: ignore[arg-type]


# Member types of GNU tar's beyond tarfile's; anything else unknown is a regular file, as
# POSIX asks and GNU tar does ("Unknown file type, extracted as normal file"). The image
# builder (stager.image.build) reads members by the same rules.
VOLUME_LABEL, MULTIVOLUME, DUMPDIR, _OLD_NAMES = b"V", b"M", b"D", b"N"
NOT_FILES = frozenset(
    (
        tarfile.DIRTYPE,
        tarfile.SYMTYPE,
        tarfile.LNKTYPE,
        tarfile.CHRTYPE,
        tarfile.BLKTYPE,
        tarfile.FIFOTYPE,
        DUMPDIR,
    )
)


def skipped(label: str, member: tarfile.TarInfo) -> bool:
    """Whether ``member`` is a volume label (it makes nothing); raises for one that
    starts in another volume and for GNU's obsolete 'names' member."""
    if member.type == MULTIVOLUME:
        raise UnknownFormat(
            f"archive {label} is a later volume of a multi-volume archive (tar -M): "
            f"its member {member.name!r} starts in another volume; stager extracts whole "
            "archives only (GNU tar cannot extract one volume alone either); join the "
            "volumes into one archive"
        )
    if member.type == _OLD_NAMES:
        raise UnknownFormat(
            f"archive {label} holds an obsolete GNU 'names' member {member.name!r}; "
            "re-create the archive with a current tar"
        )
    return member.type == VOLUME_LABEL


def _tar_member(
    job: ExtractJob,
    archive: Archive,
    writer: ArchiveWriter,
    stream: StreamReader | None,
    member: tarfile.TarInfo,
    strip: int,
    share: int,
    start_inner: StartInner | None,
) -> None:
    rel = None if skipped(archive.label, member) else clean_name(writer.archive, member.name, strip)
    if rel is None:  # stripped away, the archive's own folder, or a volume label
        job.ctx.progress.advance(share, 0)
        return
    if member.isreg() or member.type not in NOT_FILES:
        if start_inner is not None and nested_suffix(rel):
            if stream is None and start_inner(archive, writer, member, rel):
                job.ctx.progress.advance(share - member.size, 0)
                return
        payload = _tar_payload(archive, stream, member)
        inline = callable(payload)
        rel = writer.file(rel, FILE_MODE, member.mtime, payload, share, inline)
        if start_inner is not None and stream is not None and nested_suffix(rel):
            job.note_written_inner(writer.root, rel, archive)
        return
    job.ctx.progress.advance(share, 0)
    if member.isdir() or member.type == DUMPDIR:  # a dumpdir's data lists its entries
        writer.directory(rel, member.mtime, member.name)
    elif member.issym():
        judge_link(rel, member.linkname, False, writer.root, archive.label, member.name)
        writer.symlink(rel, member.linkname, member.mtime)
    elif member.islnk():
        target = clean_name(
            writer.archive, member.linkname, strip, f"{member.name} -> {member.linkname}"
        )
        if target is not None:
            judge_link(rel, target, True, writer.root, archive.label, member.name)
            writer.hardlink(rel, target)
    else:
        raise unsafe(archive.label, member.name, "a device file or FIFO")


def _tar_payload(archive: Archive, stream: StreamReader | None, member: tarfile.TarInfo) -> Payload:
    if member.sparse is not None:
        return _sparse_payload(archive, stream, member)
    if stream is None:
        require_inside(archive, member, member.size)
        return (archive.fd, archive.base + member.offset_data, member.size)
    stream.seek(member.offset_data)
    if member.size > INLINE_BYTES:
        return _copier(stream, member.size)
    data = stream.read(member.size)
    if len(data) != member.size:
        raise EOFError(f"archive ended inside member {member.name!r}")
    return data


def require_inside(archive: Archive, member: tarfile.TarInfo, stored: int) -> None:
    """Fail (as a corrupt archive) when a member's ``stored`` bytes run past the end."""
    if member.offset_data + stored > archive.length:
        raise EOFError(
            f"member {member.name!r} runs past the end of the archive: it was cut short, or "
            "it is one volume of a multi-volume archive (tar -M), which stager does not "
            "extract"
        )


def _sparse_payload(
    archive: Archive, stream: StreamReader | None, member: tarfile.TarInfo
) -> Payload:
    """A member with holes (``tar --sparse``, any of GNU's formats, as tarfile reads
    its map): only its data is copied, the holes stay holes, as GNU tar leaves them."""
    regions = tuple((position, length) for position, length in member.sparse if length)
    stored = sum(length for _, length in regions)
    if stream is None:
        require_inside(archive, member, stored)
        offset = archive.base + member.offset_data
        return SparseRanges(archive.fd, offset, regions, member.size)
    stream.seek(member.offset_data)

    def copy(fd: int, digest: Any, wrote: Wrote) -> None:
        for position, length in regions:
            os.lseek(fd, position, os.SEEK_SET)
            _stream_into(stream, fd, length, digest, wrote)
        os.ftruncate(fd, member.size)

    return copy


def _copier(stream: StreamReader, size: int):  # noqa: ANN202 - a Payload callable
    def copy(fd: int, digest: Any, wrote: Wrote) -> None:
        _stream_into(stream, fd, size, digest, wrote)

    return copy


def _stream_into(stream: StreamReader, fd: int, size: int, digest: Any, wrote: Wrote) -> None:
    left = size
    while left > 0:
        data = stream.read(min(left, STREAM_CHUNK))
        if not data:
            raise EOFError("archive ended inside a member")
        write_all(fd, data)
        if digest is not None:
            digest.update(data)
        left -= len(data)
        wrote(len(data))
