"""Where ``extract`` writes: safe member paths, directories, files, deferred links.

Why files never land outside the destination, whatever the member order:

* member names are checked lexically (relative, no ``..``) before anything;
* every parent directory is created here and checked with ``lstat`` once, so
  no component of a file's path is a symlink (a leftover one from an earlier,
  interrupted run is replaced by a real directory);
* archive symlinks and hardlinks are created only after every file has been
  written, and a symlink whose name is also a parent of another member is
  refused: nothing is ever written *through* a link from the archive;
* links are judged by ``tarfile.data_filter`` (by the caller), hardlinks must
  point at a regular file of this archive, and every symlink is re-resolved
  once all exist, which catches chains that only escape together.

Regular files are written on a pool in batches: per-task overhead of an
executor (~20 us for threads, more for processes) is as much as writing a small
file, so one task carries many files. The pool is threads, or processes when
every payload is a byte range of the archive (a plain tar): then the per-file
Python work runs on every core instead of taking turns under one GIL. Either
way a batch is a plain function of picklable jobs, and progress is counted
here, when a batch is done.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
import threading
from collections.abc import Callable
from concurrent.futures import Executor, Future
from dataclasses import dataclass, field

from stager.errors import UnsafeArchiveMember
from stager.ops.base import OpContext
from stager.ops.fastcopy import copy_range

_WRITE_FLAGS = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
_BATCH_FILES = 64
_BATCH_BYTES = 8 << 20
# Errors that mean "something else is in the way" on a restart: a read-only
# file, a symlink (O_NOFOLLOW) or a directory where this run wants a file.
_REPLACEABLE = (errno.EACCES, errno.EPERM, errno.ELOOP, errno.EISDIR, errno.ENOTDIR)

# A file's content: bytes already in memory, a byte range of a file descriptor
# (copied in the kernel), or a callable writing into the open destination fd.
Payload = bytes | tuple[int, int, int] | Callable[[int], None]


@dataclass(slots=True)
class _FileJob:
    path: str
    mode: int
    mtime: float
    payload: Payload
    archive_bytes: int  # archive bytes this file accounts for, for progress


@dataclass
class _Batch:
    jobs: list[_FileJob] = field(default_factory=list)
    nbytes: int = 0


def unsafe(archive: str, member: str, why: str) -> UnsafeArchiveMember:
    return UnsafeArchiveMember(
        f"archive {archive} has an unsafe member {member!r} ({why}); nothing was written "
        "outside the destination; re-create the archive without it"
    )


def file_mode(mode: int | None) -> int:
    """tarfile's data-filter policy: drop setuid/setgid/sticky and group/other write."""
    if mode is None:
        return 0o644
    mode &= 0o755
    if not mode & 0o100:
        mode &= ~0o111
    return mode | 0o600


def _write_payload(fd: int, payload: Payload) -> None:
    if isinstance(payload, bytes):
        view = memoryview(payload)
        while view:
            view = view[os.write(fd, view) :]
    elif isinstance(payload, tuple):
        src_fd, offset, size = payload
        copy_range(src_fd, fd, offset, size)
    else:
        payload(fd)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def write_files(jobs: list[_FileJob]) -> tuple[int, int]:
    """One batch, on a pool thread or process: (archive bytes, files) it accounts for."""
    for job in jobs:
        write_file(job)
    return sum(job.archive_bytes for job in jobs), len(jobs)


def write_file(job: _FileJob) -> None:
    try:
        fd = os.open(job.path, _WRITE_FLAGS, job.mode)
    except OSError as exc:
        if exc.errno not in _REPLACEABLE:
            raise
        _remove(job.path)
        fd = os.open(job.path, _WRITE_FLAGS, job.mode)
    try:
        _write_payload(fd, job.payload)
        os.utime(fd, (job.mtime, job.mtime))
    finally:
        os.close(fd)


class ArchiveWriter:
    """Writes one archive's members under ``root``; call ``finish()`` at the end."""

    def __init__(
        self,
        root: str,
        archive: str,
        ctx: OpContext,
        pool: Executor | None,
    ) -> None:
        self.root = root
        self.archive = archive
        self._ctx = ctx
        self._pool = pool
        self._dirs: set[str] = {""}  # relative directories known to be real dirs
        self._dir_mtimes: dict[str, float] = {}
        self.files: set[str] = set()
        self._symlinks: list[tuple[str, str, float]] = []
        self._symlink_names: set[str] = set()
        self._hardlinks: list[tuple[str, str]] = []
        self._batch = _Batch()
        self._pending: list[Future[None]] = []
        # Bounds memory held by queued batches (compressed archives pass bytes).
        self._slots = threading.BoundedSemaphore(2 * ctx.workers + 2)
        os.makedirs(root, exist_ok=True)

    # -- names ------------------------------------------------------------

    def clean_name(self, name: str, strip: int, label: str | None = None) -> str | None:
        """The member's safe relative path after stripping, or None to skip it."""
        label = label if label is not None else name
        if name.startswith("/") or name.startswith("\\") or _has_drive(name):
            raise unsafe(self.archive, label, "absolute path")
        parts = [p for p in name.split("/") if p]
        if strip:
            if len(parts) <= strip:
                return None
            parts = parts[strip:]
        parts = [p for p in parts if p != "."]
        if ".." in parts:
            raise unsafe(self.archive, label, "'..' component leads outside the destination")
        if not parts:
            return None
        return "/".join(parts)

    # -- directories ------------------------------------------------------

    def ensure_dir(self, rel: str, label: str) -> None:
        """Create ``rel`` and its parents as real directories (checked once per run)."""
        if rel in self._dirs:
            return
        parent = rel.rpartition("/")[0]
        self.ensure_dir(parent, label)
        if rel in self._symlink_names:
            raise unsafe(self.archive, label, f"written through the archive's symlink {rel!r}")
        path = os.path.join(self.root, rel)
        try:
            os.mkdir(path)
        except FileExistsError:
            if not stat.S_ISDIR(os.lstat(path).st_mode):
                os.unlink(path)  # a file or link left by an interrupted run
                os.mkdir(path)
        self._dirs.add(rel)

    def directory(self, rel: str, mtime: float, label: str) -> None:
        self.ensure_dir(rel, label)
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
    ) -> None:
        """Write a regular file, on the pool unless ``inline`` (payloads tied to this thread)."""
        if rel in self._dirs:
            # Replacing it would delete what other members (or an inner archive) wrote there.
            raise unsafe(self.archive, rel, "a file over a directory other members use")
        self.ensure_dir(rel.rpartition("/")[0], rel)
        self.files.add(rel)
        job = _FileJob(os.path.join(self.root, rel), mode, mtime, payload, archive_bytes)
        if self._pool is None or inline:
            write_file(job)
            self._ctx.progress.advance(archive_bytes, 1)
            return
        batch = self._batch
        batch.jobs.append(job)
        batch.nbytes += len(payload) if isinstance(payload, bytes) else 0
        if len(batch.jobs) >= _BATCH_FILES or batch.nbytes >= _BATCH_BYTES:
            self._submit()

    def _submit(self) -> None:
        if not self._batch.jobs:
            return
        jobs, self._batch = self._batch.jobs, _Batch()
        self._slots.acquire()
        future = self._pool.submit(write_files, jobs)  # type: ignore[union-attr]
        future.add_done_callback(self._batch_done)
        self._pending.append(future)
        if len(self._pending) > 64:
            self._reap(wait=False)

    def _batch_done(self, future: Future[tuple[int, int]]) -> None:
        self._slots.release()
        if not future.cancelled() and future.exception() is None:
            self._ctx.progress.advance(*future.result())

    def _reap(self, wait: bool) -> None:
        keep = []
        for future in self._pending:
            if wait or future.done():
                future.result()  # re-raises a worker's error here, on the caller's thread
            else:
                keep.append(future)
        self._pending = keep

    # -- links --------------------------------------------------------------

    def symlink(self, rel: str, target: str, mtime: float) -> None:
        if rel in self._dirs:
            raise unsafe(self.archive, rel, "a symlink over a directory other members use")
        self.ensure_dir(rel.rpartition("/")[0], rel)
        self._symlinks.append((rel, target, mtime))
        self._symlink_names.add(rel)

    def hardlink(self, rel: str, target: str) -> None:
        self.ensure_dir(rel.rpartition("/")[0], rel)
        self._hardlinks.append((rel, target))

    # -- end ----------------------------------------------------------------

    def flush(self) -> None:
        """Wait for every queued file; raises the first worker error."""
        if self._pool is not None:
            self._submit()
            self._reap(wait=True)

    def abort(self) -> None:
        """On an error or cancel: drop queued batches, wait for running ones, so nothing
        writes after we return."""
        for future in self._pending:
            future.cancel()
        for future in self._pending:
            if not future.cancelled():
                future.exception()
        self._pending = []

    def finish(self) -> None:
        self.flush()
        for rel, target in self._hardlinks:
            if target not in self.files:
                raise unsafe(self.archive, rel, f"hardlink to {target!r}, not a file of it")
            self._replace(rel, lambda p, t=target: os.link(self._path(t), p, follow_symlinks=False))
            self._ctx.progress.advance(0, 1)
        for rel, target, mtime in self._symlinks:
            self._replace(rel, lambda p, t=target: os.symlink(t, p))
            os.utime(self._path(rel), (mtime, mtime), follow_symlinks=False)
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
            _remove(path)  # from an interrupted run, or a duplicate member: last wins
            create(path)

    def _check_symlinks(self) -> None:
        # Each link was judged alone before creation; chains (a -> b/.., b -> .)
        # can still escape together, so resolve them all now that they exist.
        root = os.path.realpath(self.root)
        for rel, _target, _mtime in self._symlinks:
            resolved = os.path.realpath(self._path(rel))
            if resolved != root and not resolved.startswith(root + os.sep):
                for name, _t, _m in self._symlinks:
                    if os.path.islink(self._path(name)):
                        os.unlink(self._path(name))
                raise unsafe(self.archive, rel, "symlink chain resolves outside the destination")


def _has_drive(name: str) -> bool:
    return len(name) >= 2 and name[1] == ":" and name[0].isalpha()
