"""Reading a zip into the writer, member by member.

Names are taken as unzip on Linux takes them: a backslash is a separator (so
``..\\x`` is refused as a traversal), and a name without the UTF-8 flag is its
bytes as they are. Encrypted members are refused; symlinks are judged as a
tar's are; members are inflated on the writer's pool (``ZipFile`` allows
concurrent readers).
"""

from __future__ import annotations

import stat
import time
import zipfile
from typing import Any

from stager.archive.formats import STREAM_CHUNK
from stager.archive.job import Archive, ExtractJob, RangeFile, judge_link, nested_suffix
from stager.archive.writer import ArchiveWriter, Wrote, clean_name, unsafe
from stager.core.errors import UnknownFormat
from stager.fs.fastcopy import write_all
from stager.fs.seal import FILE_MODE

_ZIP_UTF8 = 0x800


def read_zip(
    job: ExtractJob, archive: Archive, writer: ArchiveWriter, strip: int, nested: bool
) -> None:
    """Every member of the zip ``archive`` to ``writer``; with ``nested`` (an outer
    archive) members that are archives are noted for extraction once it is done."""
    with zipfile.ZipFile(RangeFile(archive.fd, archive.base, archive.length)) as zf:
        counted = 0
        for info in zf.infolist():
            job.ctx.check_cancelled()
            # Local header (30 bytes + name) and data; the central directory is the rest.
            share = min(info.compress_size + len(info.filename) + 30, archive.length - counted)
            counted += share
            name = _zip_name(archive, info)
            rel = clean_name(writer.archive, name, strip, name)
            if rel is None:
                job.ctx.progress.advance(share, 0)
                continue
            _zip_member(job, archive, writer, zf, info, rel, share, nested)
        writer.flush()  # workers read through ``zf``: finish before it closes
    job.ctx.progress.advance(archive.length - counted, 0)


def _zip_name(archive: Archive, info: zipfile.ZipInfo) -> str:
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


def _zip_member(
    job: ExtractJob,
    archive: Archive,
    writer: ArchiveWriter,
    zf: zipfile.ZipFile,
    info: zipfile.ZipInfo,
    rel: str,
    share: int,
    nested: bool,
) -> None:
    mtime = time.mktime((*info.date_time, 0, 0, -1))
    unix_mode = info.external_attr >> 16 if info.create_system == 3 else 0
    if info.is_dir():
        job.ctx.progress.advance(share, 0)
        writer.directory(rel, mtime, info.filename)
    elif stat.S_ISLNK(unix_mode):
        job.ctx.progress.advance(share, 0)
        target = zf.read(info).decode("utf-8", "surrogateescape")
        judge_link(rel, target, False, writer.root, archive.label, info.filename)
        writer.symlink(rel, target, mtime)
    elif stat.S_IFMT(unix_mode) not in (0, stat.S_IFREG):
        # Many writers store permission bits only (no type): those are files.
        raise unsafe(archive.label, info.filename, "a device file, FIFO or socket")
    else:
        rel = writer.file(rel, FILE_MODE, mtime, _zip_copier(zf, info), share)
        if nested and nested_suffix(rel):
            job.note_written_inner(writer.root, rel, archive)


def _zip_copier(zf: zipfile.ZipFile, info: zipfile.ZipInfo):  # noqa: ANN202 - a Payload callable
    def copy(fd: int, digest: Any, wrote: Wrote) -> None:
        # ZipFile allows concurrent readers; each inflates on its own thread.
        with zf.open(info) as src:
            while data := src.read(STREAM_CHUNK):
                write_all(fd, data)
                if digest is not None:
                    digest.update(data)
                wrote(len(data))

    return copy
