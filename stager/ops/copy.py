"""The ``copy`` op: a file or a directory tree into the dataset.

The tree is walked on the staging process and its files go out in chunks to forked
workers (:mod:`stager.fs.forked`), each copied by :mod:`stager.fs.file_copy`; why,
and the per-file costs: docs/performance.md ("Copy"). A FIFO, socket or device is
never opened: refused by name, or left out with ``special: "skip"``. With
``--allowed-root``, every link, through any chain, must resolve inside the roots.
Links inside the tree are recreated as relative links; links out of it are followed
(their target will not exist on the node); dangling links are kept.
"""

from __future__ import annotations

import errno
import operator
import os
import stat
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from stager.core.errors import (
    SourceNotFound,
    SourceUnreadable,
    StagerError,
    from_os_error,
)
from stager.fs import forked, mounts
from stager.fs.credentials import access
from stager.fs.file_copy import FileCopier, Stopped, copy_file, remove
from stager.fs.sizes import NameCharge, copy_estimate
from stager.fs.sources import (
    Folder,
    Roots,
    Visitor,
    enter_outside,
    follow,
    leads_to_special,
    open_child,
    open_path,
    open_top,
    refuse_holding,
    refuse_special,
    require_source,
    within,
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


# A chunk for a worker: a folder's files, cut at this many files or bytes: enough to
# amortise the hand-over (~100 us), few enough to spread one folder over every worker.
BATCH_FILES = 256
BATCH_BYTES = 64 * 1024 * 1024
# Once a tree proved large, chunks grow up to this many files, each at most
# 1/CHUNKS_SEEN of the files seen so far (why: docs/performance.md, "Copy").
LARGE_BATCH_FILES = 1024
CHUNKS_SEEN = 16
# Trees with fewer files are copied on the walking process: a fork costs more.
PARALLEL_AFTER_FILES = 2_000
# Processes copying at once from a network filesystem, from the first file, in smaller
# chunks: its files wait on round trips, not the CPU (docs/performance.md, "Copy").
NETWORK_IN_FLIGHT = 8
NETWORK_BATCH_FILES = 32
# How long check() may walk a source tree to estimate its size (the request waits; the
# staging counts every byte anyway, so the estimate only refuses early): a tenth of a
# second walks tens of thousands of files, enough to scale up from; at 0.5 s the walk
# was a fifth of a 200,000-file copy (docs/benchmarks.md).
CHECK_BUDGET_S = 0.1


# -- request time ----------------------------------------------------------------------


def check(step: CopyStep, ctx: CheckContext) -> int:
    """Validate the source and estimate the bytes the copy will write: a folder is
    walked for CHECK_BUDGET_S at most (:func:`stager.fs.sizes.copy_estimate`), since a
    million-file tree on a busy network filesystem would hold the request for minutes."""
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
        return copy_estimate(step.src, roots, step.special, time.monotonic() + CHECK_BUDGET_S)
    except OSError as exc:
        raise _translate(exc, step.src) from exc


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
            return copy_file(fd, path, _file_target(path, step.dst, ctx), ctx, roots)
        finally:
            os.close(fd)
    except OSError as exc:
        raise _translate(exc, path, ctx.root) from exc


def _translate(exc: OSError, source: str, dataset: os.PathLike[str] | None = None) -> StagerError:
    """The one place where OS errors become stager errors: the source's are the
    caller's to fix (BadRequest's family), the rest the shared staging sentence. A
    refused open outside the ``dataset`` being written is the source's."""
    name = exc.filename
    in_source = isinstance(name, str) and within(name, source)
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


# -- a tree ----------------------------------------------------------------------------


# A group: the files of one source folder in a chunk (a chunk may span folders, so
# that small folders, iNaturalist's 270 files each, still travel a few hundred at a
# time). ``src_dir`` None: the names are real paths of files links led to.
Group = tuple[str | None, tuple[int, int] | None, str, list[tuple[Any, ...]]]


def _copy_files(groups: list[Group], verify: str) -> None:
    """A chunk, on a worker (or inline): copy each group's files."""
    job = FileCopier(verify, forked.report_bytes, _check_stop, forked.report_made)
    umask = forked.umask()
    for src_dir, src_id, dst_dir, items in groups:
        if forked.stopping():
            return
        sfd = None
        if src_dir is not None:
            sfd = access().open(src_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            if sfd is not None:
                st = os.fstat(sfd)
                if (st.st_dev, st.st_ino) != src_id:
                    raise SourceNotFound(f"source folder {src_dir} was replaced while copying")
            dfd = os.open(dst_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                job.copy_group(sfd, dfd, items, umask)
            except Stopped:
                return
            finally:
                os.close(dfd)
        finally:
            if sfd is not None:
                os.close(sfd)
        forked.report(0, len(items))


def _check_stop() -> None:
    if forked.stopping():
        raise Stopped


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
        self.dst_real = ""  # where it writes, resolved: no source folder may hold it
        self.workers: forked.Workers  # once the source is open: run()
        self.batch_files = BATCH_FILES
        self.network = False
        self.seen = 0  # files handed out
        # The chunk being filled: its groups, the folders they belong to, its size.
        self.groups: list[Group] = []
        self.group_outs: list[_Out] = []
        self.files = self.nbytes = 0
        self.charge = NameCharge(ctx.progress)  # the folders, files and links it makes

    def run(self) -> int:
        os.makedirs(self.dst, exist_ok=True)
        self.dst_real = os.path.realpath(self.dst)
        top = open_top(self.src, self.roots)
        try:
            self.top_real = os.readlink(f"/proc/self/fd/{top.fd}")
            refuse_holding(self.top_real, self.dst_real, self.src)
            self.workers = self._workers(mounts.on_network(self.top_real))
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
            self.network = True
        return forked.Workers(processes, ctx.progress, after, ctx.cancel)

    def _enter(self, folder: Folder, dst: str, rel: str) -> Folder:
        if rel:
            self.charge.folder(rel)
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
        if target.st is None or within(target.real, self.top_real):
            self.charge.names(out.rel, 1, len(name))  # a link: a file's name is charged below
        if target.st is None:
            _place_link(target.text, where)  # dangling, but confined: kept as it is
        elif within(target.real, self.top_real):
            # Relative, so the copy points into itself wherever the dataset is published.
            inner = os.path.relpath(str(target.real), self.top_real)
            _place_link(os.path.relpath(inner, out.rel or "."), where)
        elif stat.S_ISDIR(target.st.st_mode):
            refuse_holding(str(target.real), self.dst_real, shown)
            child = enter_outside(target, shown, self.open_ids)
            if child is None:
                self.charge.folder(_join(out.rel, name))
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
            self.charge.names(out.rel, 1, len(name))
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
            names = sum(map(len, map(_NAME, out.items)))  # in C: no Python step per file
            self.charge.names(out.rel, len(out.items), names)
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
        self.charge.flush()
        if not self.groups:
            return
        groups, outs, files, nbytes = self.groups, self.group_outs, self.files, self.nbytes
        self.groups, self.group_outs, self.files, self.nbytes = [], [], 0, 0
        self.seen += files
        if self.batch_files < LARGE_BATCH_FILES and not self.network:
            self.batch_files = min(LARGE_BATCH_FILES, max(BATCH_FILES, self.seen // CHUNKS_SEEN))
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


_NAME = operator.itemgetter(1)  # an item's name in its destination folder


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
            remove(dfd, name)
        finally:
            os.close(dfd)
    os.symlink(link_text, path)
