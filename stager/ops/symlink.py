"""Link a source into the dataset instead of copying it.

``link``: one symlink at ``dst`` pointing at ``src`` (the data stays on the shared
filesystem). ``tree``: real folders and one symlink per file, pointing at the
absolute source file (what seeds/000's ``link_file`` meant to do), so later steps
can rename or add entries without touching the shared source.

Targets are ``os.path.abspath`` of the source, not ``realpath``: the user's path is
the stable name on every node; what it resolves to may be a site-specific mount.

``tree``'s links are made by forked workers (:mod:`stager.fs.forked`; the costs:
docs/performance.md, "Symlink farm"). The rules of every walk of a source hold
(:mod:`stager.fs.sources`): special files refused or skipped, every link resolving
inside ``--allowed-root``.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from typing import Literal

from stager.core.errors import BadRequest, from_os_error
from stager.fs import forked
from stager.fs.sizes import NameCharge
from stager.fs.sources import (
    Folder,
    Roots,
    Visitor,
    fd_path,
    follow,
    leads_to_special,
    open_child,
    open_path,
    open_top,
    refuse_holding,
    refuse_special,
    require_source,
    walk_until,
)
from stager.ops.base import (
    AbsoluteSource,
    CheckContext,
    OpContext,
    RelativePath,
    StepParams,
    make_dir,
)


class SymlinkStep(StepParams):
    """Link a source into the dataset: one link, or a mirrored tree of per-file links."""

    src: AbsoluteSource
    dst: RelativePath = "."
    mode: Literal["link", "tree"] = "link"
    # A FIFO, socket or device in a tree: refuse the staging (naming it), or leave it out.
    special: Literal["refuse", "skip"] = "refuse"


# Links per chunk handed to a worker: large enough to amortise the hand-over, small
# enough to spread one huge folder over every worker.
BATCH = 512
# Trees with fewer files are linked on the walking process (forking costs more).
PARALLEL_AFTER_FILES = 4_000
# How long check() may walk a tree to refuse special files and links out of bounds:
# the request waits, and the staging checks the rest as it walks.
CHECK_BUDGET_S = 0.5


def check(step: SymlinkStep, ctx: CheckContext) -> int:
    """Validate the source, and scan a tree for what the staging would refuse (for
    CHECK_BUDGET_S at most); links write no data, so the estimate is 0."""
    _check_top(step, ctx)
    if step.mode == "tree":
        try:
            roots = Roots.of(ctx.allowed_roots)
            _Scan(roots, step.special, time.monotonic() + CHECK_BUDGET_S).run(step.src)
        except OSError as exc:
            raise from_os_error(exc, f"linking {step.src}") from exc
    return 0


def _check_top(step: SymlinkStep, ctx: CheckContext) -> None:
    require_source(step.src)
    try:
        fd, st = open_path(step.src, Roots.of(ctx.allowed_roots))
        os.close(fd)
    except OSError as exc:
        raise from_os_error(exc, f"linking {step.src}") from exc
    if step.mode == "tree" and not stat.S_ISDIR(st.st_mode):
        raise BadRequest(
            f"symlink source {step.src} is a file, but mode 'tree' mirrors a directory; "
            "use mode 'link' for a single file"
        )
    if not stat.S_ISDIR(st.st_mode) and not stat.S_ISREG(st.st_mode):
        raise refuse_special(step.src, st.st_mode, skippable=False)


class _Scan(Visitor):
    """Refuses early what the tree link would refuse, for as long as the budget lasts."""

    def __init__(self, roots: Roots, special: str, deadline: float) -> None:
        self.roots, self.policy, self.deadline = roots, special, deadline

    def run(self, path: str) -> None:
        top = open_top(path, self.roots)
        try:
            walk_until(top, self, self.policy, self.deadline)
        finally:
            os.close(top.fd)

    def link(self, folder: Folder, entry: os.DirEntry[str]) -> Folder | None:
        _judge_link(folder, entry.name, self.roots, self.policy)
        return None


def _judge_link(folder: Folder, name: str, roots: Roots, special: str) -> bool:
    """Whether to mirror the link ``name``: refused out of ``roots`` (any chain, dangling
    or not); a link to a special file is refused, or left out (False) with "skip"."""
    target = follow(folder, name, roots)
    return not leads_to_special(target, folder.join(name), special)


def run(step: SymlinkStep, ctx: OpContext) -> int:
    """Make the link or the tree of links; returns their bytes (a link's size is its
    target's length), so the staging need not measure the tree it just made."""
    _check_top(step, ctx.check_context)  # the tree itself is checked as it is walked
    source = os.path.abspath(step.src)
    try:
        if step.mode == "link":
            return _link_one(source, _link_path(step, ctx), ctx)
        return _TreeLink(source, str(ctx.destination(step.dst)), ctx, step.special).run()
    except OSError as exc:
        raise from_os_error(exc, f"linking {source}") from exc


def _link_path(step: SymlinkStep, ctx: OpContext) -> str:
    """``dst`` "." (or "dir/") puts the link inside under the source's basename."""
    if step.dst in ("", ".") or step.dst.endswith("/"):
        folder = ctx.destination(step.dst or ".")
        name = os.path.basename(step.src.rstrip("/"))
    else:
        relative = step.dst.rstrip("/")
        # Resolve only the parent: the link itself, from a previous run, points
        # outside the dataset and resolving it would be refused.
        folder = ctx.destination(os.path.dirname(relative) or ".")
        name = os.path.basename(relative)
    folder.mkdir(parents=True, exist_ok=True)
    return str(folder / name)


def _link_one(source: str, path: str, ctx: OpContext) -> int:
    ctx.progress.add_total(0, 1)
    if _current_target(path) != source:
        if os.path.isdir(path) and not os.path.islink(path):
            _refuse_directory(path)
        # Create aside then rename over: a reader never sees the link missing.
        tmp = f"{path}.stager-tmp"
        if os.path.lexists(tmp):
            os.unlink(tmp)
        os.symlink(source, tmp)
        os.replace(tmp, path)
    ctx.progress.advance(0, 1)
    return len(os.fsencode(source))


class _TreeLink(Visitor):
    """Walk on this process; each folder's links are made by :class:`forked.Workers`."""

    def __init__(self, source: str, dst_root: str, ctx: OpContext, special: str) -> None:
        self.source, self.dst_root, self.ctx, self.policy = source, dst_root, ctx, special
        self.roots = Roots.of(ctx.allowed_roots)
        self.dsts: dict[int, str] = {}  # by folder descriptor: the folders being walked
        self.pending: dict[int, list[str]] = {}  # by folder descriptor: names to link
        self.groups: list[tuple[str, str, list[str]]] = []  # the chunk being filled
        self.files = 0
        self.charge = NameCharge(ctx.progress)  # the folders and links it makes
        self.workers = forked.Workers(
            forked.cores(ctx.workers), ctx.progress, PARALLEL_AFTER_FILES, ctx.cancel
        )

    def run(self) -> int:
        os.makedirs(self.dst_root, exist_ok=True)
        top = open_top(self.source, self.roots)
        top.path = self.source  # links name the user's path, not what it resolves to today
        self.dsts[top.fd] = self.dst_root
        try:
            refuse_holding(fd_path(top.fd), os.path.realpath(self.dst_root), self.source)
            self.workers.walk(top, self, self.policy, flush=self._submit)
        finally:
            os.close(top.fd)
        return self.workers.made

    def file(self, folder: Folder, entry: os.DirEntry[str]) -> None:
        names = self.pending.get(folder.fd)
        if names is None:
            names = self.pending[folder.fd] = []
        names.append(entry.name)
        if self.files + len(names) >= BATCH:
            self._close_group(folder)
            self._submit()

    def subdir(self, folder: Folder, entry: os.DirEntry[str]) -> Folder | None:
        # Real folders, so later steps can rename or add entries inside the dataset.
        dst = f"{self.dsts[folder.fd]}/{entry.name}"
        self.charge.folder(self._rel(dst))
        make_dir(dst)  # before its files are queued
        child = open_child(folder, entry.name)
        self.dsts[child.fd] = dst
        return child

    def link(self, folder: Folder, entry: os.DirEntry[str]) -> Folder | None:
        # Folder links are linked like files, not walked: no cycles, and the link
        # still resolves to the same content.
        if _judge_link(folder, entry.name, self.roots, self.policy):
            self.file(folder, entry)
        return None

    def leave(self, folder: Folder) -> None:
        self._close_group(folder)
        del self.dsts[folder.fd]

    def _close_group(self, folder: Folder) -> None:
        names = self.pending.pop(folder.fd, None)
        if names:
            dst = self.dsts[folder.fd]
            self.charge.names(self._rel(dst), len(names), len("".join(names)))
            self.groups.append((folder.path, dst, names))
            self.files += len(names)
            if self.files >= BATCH:
                self._submit()

    def _rel(self, dst: str) -> str:
        return dst[len(self.dst_root) + 1 :]

    def _submit(self) -> None:
        self.charge.flush()
        if self.groups:
            groups, files = self.groups, self.files
            self.groups, self.files = [], 0
            self.ctx.progress.add_total(0, files)
            self.workers.submit(_place_all, groups, files=files, then=None)


def _place_all(groups: list[tuple[str, str, list[str]]]) -> None:
    """A chunk, on a worker: in each group's destination folder, link each name to the
    same name in its source folder. One ``symlinkat`` per link in the common case."""
    for src_dir, dst_dir, names in groups:
        if forked.stopping():
            return
        dfd = os.open(dst_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            prefix = f"{src_dir}/" if src_dir != "/" else "/"
            symlink = os.symlink
            for name in names:
                try:
                    symlink(prefix + name, name, dir_fd=dfd)
                except FileExistsError:
                    _place(prefix + name, name, dfd)
        finally:
            os.close(dfd)
        forked.report(0, len(names))
        # Each link's size is its target's length: prefix + name, one encode a folder.
        forked.report_made(len(os.fsencode(prefix)) * len(names) + len(os.fsencode("".join(names))))


def _place(source: str, name: str, dfd: int) -> None:
    """Something is at ``name`` already: keep it if it is the link, else replace it."""
    if _current_target(name, dfd) == source:
        return  # left by an earlier run
    have = os.stat(name, dir_fd=dfd, follow_symlinks=False)
    if stat.S_ISDIR(have.st_mode):
        _refuse_directory(name, dfd)
    else:
        os.unlink(name, dir_fd=dfd)
    os.symlink(source, name, dir_fd=dfd)


def _current_target(path: str, dfd: int | None = None) -> str | None:
    try:
        return os.readlink(path, dir_fd=dfd)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # exists, but is not a link
            return None
        raise


def _refuse_directory(path: str, dfd: int | None = None) -> None:
    """An empty directory may be replaced; a full one is another step's data."""
    try:
        os.rmdir(path, dir_fd=dfd)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        shown = path if dfd is None else os.path.join(os.readlink(f"/proc/self/fd/{dfd}"), path)
        raise BadRequest(
            f"cannot create a link at {shown}: a non-empty directory is there; "
            "choose another 'dst' for the symlink step or remove the step that fills it"
        ) from exc
