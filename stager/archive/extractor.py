"""Extracting an archive: the pools it runs on, its reader, and the archives inside it.

For a plain tar a file is a byte range of the archive and the pool is worker
*processes*: the per-file Python is GIL-bound. For compressed tars and zips a thread
pool writes what the main thread reads (shipping bytes to processes costs a copy).
Processes are forked before the extraction starts a thread of its own, so they
inherit the open archive; a small archive stays on threads (``PROCESS_MIN_BYTES``).
Each pool has ``ctx.workers`` workers capped at the cores
(:func:`stager.fs.forked.cores`).

Nested archives inside a plain tar (ImageNet's class tars) are read in place, each
extracted whole by one worker; inside a compressed tar or a zip they are written as
files first, extracted and removed once the outer archive is done.

What it leaves is counted as written (the writer's ``made``; why: docs/performance.md,
"No second look"), except where an inner archive was extracted (it writes under
folders the outer one may replace): that tree is measured.
"""

from __future__ import annotations

import functools
import os
import shutil
import tarfile
from collections.abc import Iterator
from contextlib import contextmanager

from stager.archive import split_tar
from stager.archive.formats import sniff
from stager.archive.job import (
    Archive,
    ExtractContext,
    ExtractJob,
    InnerContext,
    nested_suffix,
    translate,
)
from stager.archive.split_tar import Head
from stager.archive.tar_reader import read_tar, require_inside
from stager.archive.writer import BATCH_BYTES, ArchiveWriter
from stager.archive.zip_reader import read_zip
from stager.core.processes import die_with_parent, fork_pool, thread_pool
from stager.fs.forked import cores, paused_gc
from stager.fs.seal import KnownTree
from stager.wire.progress import Progress

# Archives smaller than this extract on threads: forking workers costs ~10 ms.
PROCESS_MIN_BYTES = 64 << 20
# A download still arriving is written in batches this small, so that what is held back
# when the download ends is written in milliseconds (8 MiB batches: ~0.2 s at 50 MB/s).
GROWING_BATCH_BYTES = 1 << 20


def extract_archive(
    ctx: ExtractContext,
    archive: Archive,
    dest: str,
    strip: int = 0,
    nested: bool = False,
) -> int | KnownTree | None:
    """Extract ``archive`` (a whole open file) under ``dest``, dropping ``strip``
    leading components of member names; with ``nested``, archives inside it too.
    Returns the bytes it left (as ``sum_sizes`` counts them), None where an inner
    archive was extracted, or a ``KnownTree`` where GNU tars wrote the whole archive
    into an empty ``dest`` (stager.archive.split_tar)."""
    job = ExtractJob(ctx, strip, nested)
    # Growing: never fork worker processes while the download's thread runs.
    size = archive.length if archive.growing is None else 0
    with paused_gc():
        head = Head()
        if split_tar.applies(ctx, archive, dest, strip, nested):
            head = split_tar.extract_head(ctx, archive, dest)  # done before any worker forks
        with _pools(job, archive.fmt, size - head.end):
            try:
                made = _extract(job, archive, dest, outer=True, head=head)
            finally:
                job.cancel_inner()
    if job.inner:
        return None
    if head.complete:  # the tars wrote it all (the writer started at its end): all known
        return KnownTree(made, head.files + len(head.folders), tuple(head.folders))
    return made


@contextmanager
def _pools(job: ExtractJob, fmt: str, size: int) -> Iterator[None]:
    """The pools ``job`` uses, shut down (queued work dropped) when the extraction ends."""
    workers = cores(job.ctx.workers)
    processes = None
    if workers > 1 and size >= PROCESS_MIN_BYTES and (fmt == "tar" or job.nested):
        processes = fork_pool(workers, die_with_parent)  # first: no thread of ours to copy
    needs_threads = processes is None or fmt != "tar"
    threads = thread_pool(workers, "extract") if needs_threads else None
    job.files_pool = processes if fmt == "tar" and processes else threads
    job.inner_pool = processes or threads
    try:
        yield
    finally:
        for pool in (threads, processes):
            if pool is not None:
                pool.shutdown(wait=True, cancel_futures=True)


def _extract(
    job: ExtractJob, archive: Archive, root: str, outer: bool, head: Head | None = None
) -> int:
    """Extract one archive under ``root``, from where ``head`` (the plain files that
    GNU tars wrote) ends; the outer one uses the pool for files. Returns the bytes
    left (see ``ArchiveWriter.made``)."""
    head = head or Head()
    pool = job.files_pool if outer else None
    batch = BATCH_BYTES if archive.growing is None else GROWING_BATCH_BYTES
    links = archive.fmt != "zip"
    writer = ArchiveWriter(root, archive.label, job.ctx, pool, links, batch_bytes=batch)
    writer.adopt_folders(head.folders, head.folder_mtimes)
    strip = job.strip if outer else 0
    nested = job.nested and outer
    try:
        if archive.fmt == "zip":
            read_zip(job, archive, writer, strip, nested)
        else:
            start_inner = functools.partial(_start_inner, job) if nested else None
            read_tar(job, archive, writer, strip, start_inner, head.end)
        if outer:
            # Inner archives write under this tree: they must be done before any link of
            # the outer archive exists, or a pair of links that escapes only together
            # could be written through before ``finish`` checks and removes it.
            writer.flush()
            job.wait_inner()
            _extract_written_inner(job)
        writer.finish()
        return head.made + writer.made
    finally:
        writer.abort()


# -- nested ------------------------------------------------------------------


def _inner_root(writer: ArchiveWriter, rel: str, label: str) -> str:
    suffix = nested_suffix(rel)
    assert suffix is not None
    return os.path.join(writer.root, writer.ensure_dir(rel[: -len(suffix)], label))


def _start_inner(
    job: ExtractJob, archive: Archive, writer: ArchiveWriter, member: tarfile.TarInfo, rel: str
) -> bool:
    """Extract an archive member of a plain tar in place, on the pool; False if not one."""
    base = archive.base + member.offset_data
    require_inside(archive, member, member.size)
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
    job = ExtractJob(InnerContext(tally, verify), strip=0, nested=False)
    with translate(label):
        _extract(job, Archive(fd, base, length, fmt, label), root, outer=False)
    return tally.bytes_done, tally.files_done


def _extract_written_inner(job: ExtractJob) -> None:
    """Inner archives of compressed or zip outers were written; extract, then drop them."""
    for path, label in job.written_inner.items():
        job.start_inner(_extract_inner_file, path, label, job.ctx.verify)
    job.wait_inner()


def _extract_inner_file(path: str, label: str, verify: str) -> tuple[int, int]:
    with translate(label):
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
        try:
            size = os.fstat(fd).st_size
            fmt = sniff(os.pread(fd, tarfile.BLOCKSIZE, 0))
            if fmt is None:
                return 0, 0  # named like an archive, but is not one: keep it as a file
            folder = path[: -len(nested_suffix(path) or "")]
            os.makedirs(folder, exist_ok=True)
            _, files = _extract_inner(fd, 0, size, fmt, label, folder, verify)
        finally:
            os.close(fd)
        os.unlink(path)
    # Bytes were counted when the outer archive was read; count files only.
    return 0, files
