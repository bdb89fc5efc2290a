"""Copy a file or a directory tree into the dataset.

Why it looks like this (the per-file costs are in docs/performance.md):

- The tree is walked on the staging process (:func:`stager.fs.sources.walk`:
  depth-first, one open listing per level, each folder opened relative to its
  parent) and its files go out in chunks to forked worker processes, one per core
  (:mod:`stager.fs.forked`): per-file work is mostly system calls wrapped in
  Python, and processes do not take turns on one GIL. Small trees are copied on
  the walking process; the workers start once a tree has proved large. A source
  on a network filesystem (NFS, Lustre, GPFS, sshfs...: :mod:`stager.fs.mounts`)
  is bound by round trips, not by the CPU: there NETWORK_IN_FLIGHT processes copy
  from the first file, in smaller chunks.
- Per file, a worker makes seven system calls: ``openat`` of the source relative
  to its folder (``O_NOFOLLOW``, ``O_NONBLOCK``: a file swapped for a link or a
  FIFO is refused, never waited on), ``openat`` of the destination with
  ``O_CREAT | O_EXCL`` and the source's mode, ``copy_file_range``, ``fstat`` of
  the source, ``futimens``, two ``close``. The walk's ``fstatat`` of each file gives
  its size for the progress totals and is the "before" of the stability check.
- Data moves with ``copy_file_range`` (reflink on XFS/btrfs, server-side copy on
  NFS 4.2, in-kernel copy elsewhere), then ``sendfile``, then read/write (the chain
  in :mod:`stager.fs.fastcopy`, shared with ``extract``).
- A source that changes while it is copied is caught: after the bytes moved, the
  ``fstat`` of the descriptor they were read from must show the size, mtime, ctime
  and inode the walk saw. If not, the file is copied once more, its "before" taken
  on its own descriptor; a second change fails the staging with a sentence naming
  the file. ``verify: sha256`` also compares the digests of source and copy.
- Restartable without a journal: a file's mtime is set last, after its bytes are
  written and checked, so "same size and same mtime as the source" means complete.
  The ``O_EXCL`` create costs nothing when the destination is new; only when a
  file is already there (a resumed staging) is it compared, and kept or replaced.
- Never a special file: a FIFO, socket or device in the tree is refused with a
  sentence naming it, or left out with ``special: "skip"``. It is never opened.
- Confined at every depth: with ``--allowed-root`` set, a link anywhere in the
  tree, through any chain of links, must resolve inside the roots, dangling or not.
- Symlinks inside the source tree are recreated as (relative) links when they
  point inside the tree, so the copy is self-contained and keeps its shape. Links
  that point outside are followed and their target's content is copied, because
  the outside target will not exist on the node. Dangling links are kept as they
  are: there is nothing to copy, and failing a whole dataset over a stale link
  helps nobody. Directory links pointing outside are walked into, guarded against
  cycles.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from typing import Any, Literal

from stager.errors import (
    SourceNotFound,
    SourceUnreadable,
    StagerError,
    VerifyFailed,
    from_os_error,
)
from stager.fs import forked, mounts
from stager.fs.credentials import as_reader, check_public, source_reader
from stager.fs.fastcopy import copy_chunk
from stager.fs.sources import (
    Folder,
    Roots,
    Target,
    Visitor,
    follow,
    leads_to_special,
    open_child,
    open_followed,
    open_path,
    open_source,
    open_top,
    refuse_special,
    require_source,
    walk,
)
from stager.ops.base import (
    CheckContext,
    OpContext,
    RelativePath,
    SourceOrInside,
    StepParams,
    make_dir,
)


class CopyStep(StepParams):
    """Copy a file or a directory tree into the dataset."""

    src: SourceOrInside
    dst: RelativePath = "."
    # A FIFO, socket or device in the tree: refuse the staging (naming it), or leave
    # it out. It is never opened either way.
    special: Literal["refuse", "skip"] = "refuse"


# Big enough that a multi-GB file costs few syscalls, small enough that cancel
# and progress stay responsive (one check per chunk).
CHUNK = 64 * 1024 * 1024
READ_CHUNK = 1024 * 1024
# A chunk of work for a worker: a folder's files, cut at this many files or bytes.
# Large enough to amortise the hand-over (~100 us), small enough to spread one
# folder over every worker and keep progress moving.
BATCH_FILES = 256
BATCH_BYTES = 64 * 1024 * 1024
# Trees with fewer files are copied on the walking process: forking workers costs
# more than it saves.
PARALLEL_AFTER_FILES = 2_000
# Processes copying at once when the source is on a network filesystem
# (stager.fs.mounts), started with the first file. There a file's time is round
# trips (lookup, open, reads, close) that use no CPU, so more files in flight than
# cores overlap them: a 1-node copy of 2,000 files of 100 KB over sshfs (200 Mbit/s)
# took 25.5-30.3 s with one process per core started after ~1,280 files, 8.8-9.1 s
# with 8 from the first file in chunks of 32, near the link's own 8 s
# (docs/benchmarks.md). ``op_workers`` caps it, as it capped the copy's threads
# before the workers were processes.
NETWORK_IN_FLIGHT = 8
# A network source's chunks are smaller, so that a tree of a few hundred files
# already keeps every process busy: a hand-over (~100 us) is little next to one
# file's round trips.
NETWORK_BATCH_FILES = 32
# How long check() may walk a source tree to estimate its size: the request waits,
# and the staging walks the tree again anyway.
CHECK_BUDGET_S = 0.5

_SOURCE_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_CREATE_FLAGS = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


# -- request time ----------------------------------------------------------------------


def check(step: CopyStep, ctx: CheckContext) -> int:
    """Validate the source and estimate the bytes the copy will write.

    A directory is walked to sum its sizes (refusing special files and links out of
    the allowed roots at once), but only for CHECK_BUDGET_S: a million-file tree on
    a busy network filesystem would hold the request for minutes. Past the budget,
    the estimate scales what the walked part of the top folder held up to all of it
    (ImageNet's 1,000 class folders: dozens are walked in time), and the copy
    checks the rest as it walks.
    """
    if not step.src.startswith("/"):
        return 0  # an earlier step's output: nothing to look at yet
    require_source(step.src)
    roots = Roots.of(ctx.allowed_roots)
    try:
        fd, st = open_path(step.src, roots)
        os.close(fd)
        if not stat.S_ISDIR(st.st_mode):
            if not stat.S_ISREG(st.st_mode):
                raise refuse_special(step.src, st.st_mode, skippable=False)
            return st.st_size
        sizes = _Sizes(roots, step.special, time.monotonic() + CHECK_BUDGET_S)
        return sizes.run(step.src)
    except OSError as exc:
        raise _translate(exc, step.src) from exc


class _OverBudget(Exception):
    pass


class _Sizes(Visitor):
    """Sums file sizes the way the copy walks (links followed out of the tree)."""

    def __init__(self, roots: Roots, special: str, deadline: float) -> None:
        self.roots, self.policy, self.deadline = roots, special, deadline
        self.total = 0
        self.top_real = ""
        self.open_ids: set[tuple[int, int]] = set()
        # For the estimate past the budget: top-level entries walked whole, and the
        # bytes they held.
        self.top_done = 0
        self.top_bytes = 0

    def run(self, path: str) -> int:
        top = open_top(path, self.roots)
        self.top_real = os.readlink(f"/proc/self/fd/{top.fd}")
        try:
            self.open_ids.add((top.st.st_dev, top.st.st_ino))
            walk(top, self, self.policy, check=self._in_budget)
        except _OverBudget:
            with os.scandir(top.fd) as entries:
                top_entries = sum(1 for _ in entries)
            return self.top_bytes * top_entries // self.top_done if self.top_done else 0
        finally:
            os.close(top.fd)
        return self.total

    def _in_budget(self) -> None:
        if time.monotonic() > self.deadline:
            raise _OverBudget

    def _top_entry_done(self, folder: Folder) -> None:
        if not folder.rel:
            self.top_done += 1
            self.top_bytes = self.total

    def file(self, folder: Folder, entry: os.DirEntry[str]) -> None:
        self.total += entry.stat(follow_symlinks=False).st_size
        self._top_entry_done(folder)

    def subdir(self, folder: Folder, entry: os.DirEntry[str]) -> Folder | None:
        child = open_child(folder, entry.name)
        self.open_ids.add((child.st.st_dev, child.st.st_ino))
        return child

    def link(self, folder: Folder, entry: os.DirEntry[str]) -> Folder | None:
        target = follow(folder, entry.name, self.roots)
        shown = folder.join(entry.name)
        child = None
        if leads_to_special(target, shown, self.policy) or target.st is None:
            pass  # left out, or kept as a (dangling) link: no data
        elif _inside(target.real, self.top_real):
            pass  # kept as a link
        elif stat.S_ISDIR(target.st.st_mode):
            child = _enter_outside(target, shown, self.open_ids)
            if child is not None:
                child.rel = folder.child_rel(entry.name)
                self.open_ids.add((child.st.st_dev, child.st.st_ino))
        else:
            self.total += target.st.st_size
        if child is None:
            self._top_entry_done(folder)
        return child

    def leave(self, folder: Folder) -> None:
        self.open_ids.discard((folder.st.st_dev, folder.st.st_ino))
        if folder.rel and "/" not in folder.rel:
            self.top_done += 1
            self.top_bytes = self.total


def _inside(real: str | None, top_real: str) -> bool:
    return real is not None and (real == top_real or real.startswith(top_real.rstrip("/") + "/"))


def _enter_outside(target: Target, shown: str, open_ids: set[tuple[int, int]]) -> Folder | None:
    """A folder outside the tree reached by a link, unless it is one of the folders
    being walked already (a cycle of links): that one is left empty."""
    assert target.st is not None
    if (target.st.st_dev, target.st.st_ino) in open_ids:
        return None
    return open_followed(target, shown)


# -- staging -----------------------------------------------------------------------


def run(step: CopyStep, ctx: OpContext) -> int:
    """Copy the file or tree; returns the bytes it left in the destination (the
    files' sizes and the links' lengths: what measuring the tree would find)."""
    path = ctx.source(step.src)
    require_source(path)
    roots = Roots.of(ctx.allowed_roots)
    if roots and not step.src.startswith("/"):
        roots = Roots.of([*roots.real, str(ctx.root)])  # an earlier step's output
    try:
        fd, st = open_path(path, roots)
        try:
            if stat.S_ISDIR(st.st_mode):
                dst = str(ctx.destination(step.dst))
                return _TreeCopy(path, dst, ctx, roots, step.special).run()
            if not stat.S_ISREG(st.st_mode):
                raise refuse_special(step.src, st.st_mode, skippable=False)
            return _copy_single_file(fd, path, _file_target(path, step.dst, ctx), ctx, roots)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _translate(exc, path, ctx.root) from exc


def _translate(exc: OSError, source: str, dataset: os.PathLike[str] | None = None) -> StagerError:
    """The one place where OS errors become stager errors.

    Problems with the source are the caller's to fix (a BadRequest-family
    error); everything else, ENOSPC included, is the shared staging sentence.
    A refused open outside the ``dataset`` being written (none at request time) is
    the source's, wherever its links led.
    """
    name = exc.filename
    in_source = isinstance(name, str) and (
        name == source or name.startswith(source.rstrip("/") + "/")
    )
    inside = dataset is not None and isinstance(name, str) and name.startswith(f"{dataset}/")
    read = isinstance(name, str) and not inside
    if in_source and exc.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
        return SourceNotFound(
            f"{name} disappeared or was replaced while copying; check that the source is stable"
        )
    if read and exc.errno in (errno.EACCES, errno.EPERM):
        return SourceUnreadable(
            f"{name} is not readable by the user who asked for it (the kernel refused to "
            "open it); fix its permissions, or stage it as a user who may read it"
        )
    return from_os_error(exc, f"copying {source}")


def _file_target(source: str, dst: str, ctx: OpContext) -> str:
    """``dst`` of "." or "dir/" means "inside that directory"; anything else is the new path."""
    name = os.path.basename(source.rstrip("/"))
    if dst in ("", ".") or dst.endswith("/"):
        folder = ctx.destination(dst or ".")
        folder.mkdir(parents=True, exist_ok=True)
        return str(folder / name)
    # Resolve the parent only: the target itself may be a stale link from a
    # previous run, and following it would be both wrong and refused.
    relative = dst.rstrip("/")
    parent = ctx.destination(os.path.dirname(relative) or ".")
    parent.mkdir(parents=True, exist_ok=True)
    target = parent / os.path.basename(relative)
    if target.is_dir() and not target.is_symlink():
        # Like cp: an existing directory (made by an earlier step) receives the
        # file; replacing it would throw away that step's work.
        return str(target / name)
    return str(target)


def _copy_single_file(path_fd: int, source: str, target: str, ctx: OpContext, roots: Roots) -> int:
    """One file, on this process, with progress and cancel seen within it; returns
    its size as copied."""
    st = os.fstat(path_fd)
    ctx.progress.add_total(st.st_size, 1)
    folder, name = os.path.split(target)
    dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    made: list[int] = []
    try:
        if _is_complete(dfd, name, st.st_size, st.st_mtime_ns):
            ctx.progress.advance(st.st_size, 1)
            return st.st_size
        job = _FileJob(ctx.verify, ctx.progress.advance, ctx.check_cancelled, made.append)
        # Opened by name again: a retry must see what the name holds now.
        job.copy_checked(lambda: open_source(source, roots), source, dfd, name, again=True)
    finally:
        os.close(dfd)
    ctx.progress.advance(0, 1)
    return sum(made)


# -- one file ------------------------------------------------------------------------


class _Stopped(Exception):
    """The op is stopping (failed elsewhere, or cancelled): leave this file unfinished."""


@dataclass
class _FileJob:
    """How files are copied in one process: the verify level, where progress goes,
    and what says stop."""

    verify: str
    advance: Callable[[int], Any]
    check_stop: Callable[[], None]
    made: Callable[[int], Any]  # the bytes of each file finished, as it is in the tree

    def copy_group(
        self, sfd: int | None, dfd: int, items: list[tuple[Any, ...]], umask: int
    ) -> None:
        """Copy the files the walk saw in one folder, each checked afterwards against what
        the walk saw (size, times, inode) and copied once more if it changed.

        The hot loop of a million-file copy, so the common case is written out here:
        seven system calls and little else per file (docs/performance.md).
        """
        check = self.verify != "none"
        done_bytes = made_bytes = 0
        # Sources are opened with the reader's rights where a staging has one.
        reader = source_reader()
        open_source_file = os.open if reader is None else partial(as_reader, os.open)
        shared = reader is not None and reader.public
        for name, dname, size, atime, mtime, ctime, ino, mode in items:
            fin = open_source_file(name, _SOURCE_FLAGS, dir_fd=sfd)
            try:
                if shared:
                    check_public(fin, _shown(sfd, name))
                try:
                    fout = os.open(dname, _CREATE_FLAGS, mode, dir_fd=dfd)
                except FileExistsError:
                    fout = _replace(dfd, dname, mode, size, mtime)
                    if fout < 0:  # complete from an earlier run of this staging
                        done_bytes += size
                        made_bytes += size
                        continue
                try:
                    if mode & umask:
                        os.fchmod(fout, mode)  # the walking process keeps its umask
                    if size > CHUNK:
                        copied = self._move(fin, fout, size)  # counts its own progress
                    else:
                        copied = copy_chunk(fin, fout, 0, size) if size else 0
                        if 0 < copied < size:
                            copied += self._move(fin, fout, size, copied)
                        done_bytes += copied
                    if check:
                        after = os.fstat(fin)
                        # nlink 0: the name holds another file now (replaced by a rename).
                        if (
                            copied != size
                            or after.st_mtime_ns != mtime
                            or after.st_ctime_ns != ctime
                            or after.st_size != size
                            or after.st_ino != ino
                            or not after.st_nlink
                        ):
                            os.close(fout)
                            fout = -1
                            shown = _shown(sfd, name)
                            self.copy_checked(_opener(sfd, name), shown, dfd, dname)
                            continue
                        if self.verify == "sha256":
                            _compare_digests(fin, fout, _shown(sfd, name))
                    # The mtime goes last: it marks the file complete for a restart.
                    os.utime(fout, ns=(atime, mtime))
                    made_bytes += copied
                finally:
                    if fout >= 0:
                        os.close(fout)
            finally:
                os.close(fin)
        self.advance(done_bytes)
        self.made(made_bytes)

    def copy_checked(
        self, opener: Callable[[], int], shown: str, dfd: int, dname: str, again: bool = False
    ) -> None:
        """Copy with the "before" taken on the descriptor itself; a change fails, or
        (``again``) is copied once more."""
        fin = opener()
        try:
            before = os.fstat(fin)
            if not stat.S_ISREG(before.st_mode):
                raise refuse_special(shown, before.st_mode)
            fout = _create(dfd, dname, stat.S_IMODE(before.st_mode))
            try:
                copied = self._move(fin, fout, before.st_size)
                if self.verify != "none":
                    after = os.fstat(fin)
                    if copied != before.st_size or _identity(after) != _identity(before):
                        if not again:
                            raise _changed(shown)
                        os.close(fout)
                        fout = -1
                        self.copy_checked(opener, shown, dfd, dname)
                        return
                    if self.verify == "sha256":
                        _compare_digests(fin, fout, shown)
                os.utime(fout, ns=(before.st_atime_ns, before.st_mtime_ns))
                self.made(copied)
            finally:
                if fout >= 0:
                    os.close(fout)
        finally:
            os.close(fin)

    def _move(self, fin: int, fout: int, size: int, done: int = 0) -> int:
        """Copy in CHUNK pieces, so progress and cancel are seen within a large file;
        returns the bytes moved from ``done`` on."""
        start = done
        while done < size:
            n = copy_chunk(fin, fout, done, min(CHUNK, size - done))
            if n == 0:
                break  # the source shrank under us; the check after says so
            done += n
            self.advance(n)
            if done < size:
                self.check_stop()
        return done - start


def _identity(st: os.stat_result) -> tuple[int, ...]:
    return (st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_ino, st.st_dev, st.st_nlink > 0)


def _changed(shown: str) -> VerifyFailed:
    return VerifyFailed(
        f"source {shown} changed while it was copied, twice (its size, mtime or ctime "
        "moved); stage again once nothing writes to it, or copy a snapshot of it"
    )


def _shown(sfd: int | None, name: str) -> str:
    """The source's path for a sentence (workers know their folder only by descriptor)."""
    if sfd is None:
        return name
    return os.path.join(os.readlink(f"/proc/self/fd/{sfd}"), name)


def _opener(sfd: int | None, name: str) -> Callable[[], int]:
    return lambda: as_reader(os.open, name, _SOURCE_FLAGS, dir_fd=sfd)


def _create(dfd: int, name: str, mode: int) -> int:
    """A new destination file with the source's mode, replacing whatever is there."""
    try:
        fd = os.open(name, _CREATE_FLAGS, mode, dir_fd=dfd)
    except FileExistsError:
        fd = _replace(dfd, name, mode, -1, 0)
    if mode & forked.umask():
        os.fchmod(fd, mode)
    return fd


def _replace(dfd: int, name: str, mode: int, size: int, mtime: int) -> int:
    """Something is where a file goes: -1 when it is that file already, complete (same
    ``size`` and ``mtime``, from an earlier run); else it is removed (a partial file, a
    link, a folder left by an interrupted run), never followed, and a new file made."""
    if size >= 0 and _is_complete(dfd, name, size, mtime):
        return -1
    _remove(dfd, name)
    return os.open(name, _CREATE_FLAGS, mode, dir_fd=dfd)


def _is_complete(dfd: int, name: str, size: int, mtime: int) -> bool:
    try:
        have = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    except FileNotFoundError:
        return False
    return stat.S_ISREG(have.st_mode) and have.st_size == size and have.st_mtime_ns == mtime


def _remove(dfd: int, name: str) -> None:
    have = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if stat.S_ISDIR(have.st_mode):
        shutil.rmtree(name, dir_fd=dfd)
    else:
        os.unlink(name, dir_fd=dfd)


def _compare_digests(fin: int, fout: int, shown: str) -> None:
    want, got = _sha256(fin), _sha256(fout)
    if want != got:
        raise VerifyFailed(
            f"copy of {shown} has sha256 {got} but the source has {want}; "
            "check the source and the local disk, then stage again"
        )


def _sha256(fd: int) -> str:
    digest = hashlib.sha256()
    offset = 0
    while chunk := os.pread(fd, READ_CHUNK, offset):
        digest.update(chunk)
        offset += len(chunk)
    return digest.hexdigest()


# -- a tree ----------------------------------------------------------------------------


# A group: the files of one source folder in a chunk (a chunk may span folders, so
# that small folders, iNaturalist's 270 files each, still travel a few hundred at a
# time). ``src_dir`` None: the names are real paths of files links led to.
Group = tuple[str | None, tuple[int, int] | None, str, list[tuple[Any, ...]]]


def _copy_files(groups: list[Group], verify: str) -> None:
    """A chunk, on a worker (or inline): copy each group's files."""
    job = _FileJob(verify, forked.report_bytes, _check_stop, forked.report_made)
    umask = forked.umask()
    for src_dir, src_id, dst_dir, items in groups:
        if forked.stopping():
            return
        sfd = None
        if src_dir is not None:
            sfd = as_reader(os.open, src_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if sfd is not None:
                st = os.fstat(sfd)
                if (st.st_dev, st.st_ino) != src_id:
                    raise SourceNotFound(f"source folder {src_dir} was replaced while copying")
            dfd = os.open(dst_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                job.copy_group(sfd, dfd, items, umask)
            except _Stopped:
                return
            finally:
                os.close(dfd)
        finally:
            if sfd is not None:
                os.close(sfd)
        forked.report(0, len(items))


def _check_stop() -> None:
    if forked.stopping():
        raise _Stopped


@dataclass
class _Out:
    """A source folder's destination, finished (mode, mtime) once its last chunk is."""

    dst: str  # absolute
    rel: str  # below the copy's destination root, for relative links
    st: os.stat_result
    items: list[tuple[Any, ...]] = field(default_factory=list)
    pending: int = 0  # chunks holding some of its files, not done yet
    listed: bool = False


class _TreeCopy(Visitor):
    """Walk ``src`` on this process; its files go to :class:`forked.Workers`."""

    def __init__(self, src: str, dst: str, ctx: OpContext, roots: Roots, special: str) -> None:
        self.src, self.dst, self.ctx = src, dst, ctx
        self.roots, self.policy = roots, special
        self.root = os.path.realpath(ctx.root)
        self.outs: dict[int, _Out] = {}  # by folder descriptor: the folders being walked
        self.open_ids: set[tuple[int, int]] = set()
        self.top_real = ""
        self.workers: forked.Workers  # once the source is open: run()
        self.batch_files = BATCH_FILES
        # The chunk being filled: its groups, the folders they belong to, its size.
        self.groups: list[Group] = []
        self.group_outs: list[_Out] = []
        self.files = self.nbytes = 0

    def run(self) -> int:
        os.makedirs(self.dst, exist_ok=True)
        top = open_top(self.src, self.roots)
        self.top_real = os.readlink(f"/proc/self/fd/{top.fd}")
        self.workers = self._workers(mounts.on_network(self.top_real))
        try:
            self._enter(top, self.dst, "")
            self.workers.walk(top, self, self.policy, flush=self._submit)
        finally:
            os.close(top.fd)
        return self.workers.made

    def _workers(self, network: bool) -> forked.Workers:
        """One process per core once the tree is large (local: CPU-bound), or
        NETWORK_IN_FLIGHT from the first file (network: bound by round trips)."""
        ctx = self.ctx
        if not network:
            processes, after = forked.cores(ctx.workers), PARALLEL_AFTER_FILES
        else:
            processes, after = min(NETWORK_IN_FLIGHT, ctx.workers), 0
            self.batch_files = min(self.batch_files, NETWORK_BATCH_FILES)
        return forked.Workers(processes, ctx.progress, after, ctx.cancel)

    def _enter(self, folder: Folder, dst: str, rel: str) -> Folder:
        make_dir(dst)
        self.outs[folder.fd] = _Out(dst, rel, folder.st)
        self.open_ids.add((folder.st.st_dev, folder.st.st_ino))
        return folder

    # Visitor: called by the walk on this process.

    def file(self, folder: Folder, entry: os.DirEntry[str]) -> None:
        st = entry.stat(follow_symlinks=False)
        out = self.outs[folder.fd]
        name = entry.name
        out.items.append(
            (
                name,
                name,
                st.st_size,
                st.st_atime_ns,
                st.st_mtime_ns,
                st.st_ctime_ns,
                st.st_ino,
                st.st_mode & 0o7777,
            )
        )
        self.nbytes += st.st_size
        if self.files + len(out.items) >= self.batch_files or self.nbytes >= BATCH_BYTES:
            self._close_group(folder, out)
            self._submit()

    def subdir(self, folder: Folder, entry: os.DirEntry[str]) -> Folder | None:
        out = self.outs[folder.fd]
        child = open_child(folder, entry.name)
        return self._enter(child, f"{out.dst}/{entry.name}", _join(out.rel, entry.name))

    def link(self, folder: Folder, entry: os.DirEntry[str]) -> Folder | None:
        out = self.outs[folder.fd]
        name, shown = entry.name, folder.join(entry.name)
        target = follow(folder, name, self.roots)
        where = f"{out.dst}/{name}"
        if leads_to_special(target, shown, self.policy):
            return None  # left out
        if target.st is None:
            _place_link(target.text, where)  # dangling, but confined: kept as it is
        elif _inside(target.real, self.top_real):
            # Relative, so the copy points into itself wherever the dataset is published.
            inner = os.path.relpath(str(target.real), self.top_real)
            _place_link(os.path.relpath(inner, out.rel or "."), where)
        elif stat.S_ISDIR(target.st.st_mode):
            child = _enter_outside(target, shown, self.open_ids)
            if child is None:
                make_dir(where)  # a cycle of links: walked once already
                return None
            return self._enter(child, where, _join(out.rel, name))
        else:
            # A file a link led to: a group of its own, named by its real path.
            st = target.st
            item = (str(target.real), name, st.st_size, st.st_atime_ns, st.st_mtime_ns,
                    st.st_ctime_ns, st.st_ino, st.st_mode & 0o7777)  # fmt: skip
            self.nbytes += st.st_size
            self._close_group(folder, out)
            self._add_group((None, None, out.dst, [item]), out)
        return None

    def leave(self, folder: Folder) -> None:
        out = self.outs.pop(folder.fd)
        self._close_group(folder, out)
        self.open_ids.discard((folder.st.st_dev, folder.st.st_ino))
        out.listed = True
        if out.pending == 0:
            self._finish(out)

    # Chunks.

    def _close_group(self, folder: Folder, out: _Out) -> None:
        """Move the folder's files found so far into the chunk being filled."""
        if out.items:
            ident = (folder.st.st_dev, folder.st.st_ino)
            self._add_group((folder.path, ident, out.dst, out.items), out)
            out.items = []

    def _add_group(self, group: Group, out: _Out) -> None:
        self.groups.append(group)
        self.group_outs.append(out)
        out.pending += 1
        self.files += len(group[3])
        if self.files >= self.batch_files:
            self._submit()

    def _submit(self) -> None:
        if not self.groups:
            return
        groups, outs, files, nbytes = self.groups, self.group_outs, self.files, self.nbytes
        self.groups, self.group_outs, self.files, self.nbytes = [], [], 0, 0
        self.ctx.progress.add_total(nbytes, files)
        self.workers.submit(
            _copy_files,
            groups,
            self.ctx.verify,
            files=files,
            nbytes=nbytes,
            then=lambda: self._done(outs),
        )

    def _done(self, outs: list[_Out]) -> None:
        for out in outs:
            out.pending -= 1
            if out.listed and out.pending == 0:
                self._finish(out)

    def _finish(self, out: _Out) -> None:
        # After all its entries: writing into a directory bumps its mtime. The owner
        # keeps rwx so a restarted run can still write into read-only copies; the
        # dataset root itself is left alone, other steps share it.
        if out.dst == self.root:
            return
        os.chmod(out.dst, stat.S_IMODE(out.st.st_mode) | stat.S_IRWXU)
        os.utime(out.dst, ns=(out.st.st_atime_ns, out.st.st_mtime_ns))


def _join(rel: str, name: str) -> str:
    return f"{rel}/{name}" if rel else name


def _place_link(link_text: str, path: str) -> None:
    """Make ``path`` a symlink with ``link_text``, leaving an identical one alone."""
    forked.report_made(len(os.fsencode(link_text)))  # on the walking process
    try:
        if os.readlink(path) == link_text:
            return
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: there, but not a link
            raise
    if os.path.lexists(path):
        folder, name = os.path.split(path)
        dfd = os.open(folder, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _remove(dfd, name)
        finally:
            os.close(dfd)
    os.symlink(link_text, path)
