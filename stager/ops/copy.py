"""Copy a file or a directory tree into the dataset.

Why it looks like this:

- Many small files (ImageNet, iNat) are dominated by per-file latency on the
  network filesystem, not bandwidth, so files are copied by a thread pool while
  the calling thread keeps walking the tree: the first bytes move before the walk
  ends, and the pool hides the per-file round trips. Files travel in per-directory
  batches so a million-file tree does not become a million futures.
- Data moves with ``os.copy_file_range`` (reflink on XFS/btrfs, server-side copy
  on NFS 4.2, in-kernel copy elsewhere), then ``os.sendfile``, then read/write
  (the chain in :mod:`stager.ops.fastcopy`, shared with ``extract``).
  The first method that fails as unsupported is dropped for the rest of the run.
- Restartable without a journal: a file's mtime is set last, after its bytes are
  written and verified, so "same size and same mtime as the source" means
  complete. Anything else at the destination is overwritten.
- Symlinks inside the source tree are recreated as (relative) links when they
  point inside the tree, so the copy is self-contained and keeps its shape.
  Links that point outside are followed and their target's content is copied,
  because the outside target will not exist on the node. Dangling links are kept
  as they are: there is nothing to copy, and failing a whole dataset over a stale
  link helps nobody. Directory links pointing outside are walked into, guarded
  against cycles.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import stat
import threading
import time
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, field
from pathlib import Path

from stager.errors import (
    SourceNotFound,
    SourceUnreadable,
    StagerError,
    VerifyFailed,
    from_os_error,
)
from stager.ops.base import (
    CheckContext,
    OpContext,
    RelativePath,
    SourceOrInside,
    StepParams,
    make_dir,
    require_source,
)
from stager.ops.fastcopy import copy_chunk


class CopyStep(StepParams):
    """Copy a file or a directory tree into the dataset."""

    src: SourceOrInside
    dst: RelativePath = "."


# Big enough that a multi-GB file costs few syscalls, small enough that cancel
# and progress stay responsive (one check per chunk).
CHUNK = 64 * 1024 * 1024
READ_CHUNK = 1024 * 1024
# Files per task handed to the pool: amortises the executor's overhead while
# keeping the tail short when one directory is much larger than the others.
BATCH_FILES = 64
# How long check() may walk a source tree to estimate its size.
CHECK_BUDGET_S = 5.0


def check(step: CopyStep, ctx: CheckContext) -> int:
    """Validate the source and estimate the bytes the copy will write.

    A directory is walked to sum its sizes, but only for CHECK_BUDGET_S: a
    million-file tree on a busy network filesystem would hold the request for
    minutes, so past the budget the estimate is 0 ("unknown") and the copy
    reports its real total as it walks.
    """
    if not step.src.startswith("/"):
        return 0  # an earlier step's output: nothing to look at yet
    source = require_source(step.src)
    try:
        if not source.is_dir():
            return source.stat().st_size
        deadline = time.monotonic() + CHECK_BUDGET_S
        total = 0
        for size in _walk_sizes(source):
            total += size
            if time.monotonic() > deadline:
                return 0
        return total
    except OSError as exc:
        raise _translate(exc, step.src) from exc


def run(step: CopyStep, ctx: OpContext) -> None:
    source = require_source(ctx.source(step.src))
    try:
        if source.is_dir():
            _TreeCopy(source, ctx.destination(step.dst), ctx).run()
        else:
            target = _file_target(source, step.dst, ctx)
            st = source.stat()
            ctx.progress.add_total(st.st_size, 1)
            _Copier(ctx).copy_file(str(source), str(target), st)
    except OSError as exc:
        raise _translate(exc, step.src) from exc


def _translate(exc: OSError, source: str) -> StagerError:
    """The one place where OS errors become stager errors.

    Problems with the source are the caller's to fix (a BadRequest-family
    error); everything else, ENOSPC included, is the shared staging sentence.
    """
    name = exc.filename
    in_source = isinstance(name, str) and (
        name == source or name.startswith(source.rstrip("/") + "/")
    )
    if in_source and exc.errno == errno.ENOENT:
        return SourceNotFound(f"{name} disappeared while copying; check that the source is stable")
    if in_source and exc.errno in (errno.EACCES, errno.EPERM):
        return SourceUnreadable(f"{name} is not readable by the daemon's user; fix its permissions")
    return from_os_error(exc, f"copying {source}")


def _file_target(source: Path, dst: str, ctx: OpContext) -> Path:
    """``dst`` of "." or "dir/" means "inside that directory"; anything else is the new path."""
    if dst in ("", ".") or dst.endswith("/"):
        folder = ctx.destination(dst or ".")
        folder.mkdir(parents=True, exist_ok=True)
        return folder / source.name
    # Resolve the parent only: the target itself may be a stale link from a
    # previous run, and following it would be both wrong and refused.
    relative = dst.rstrip("/")
    parent = ctx.destination(os.path.dirname(relative) or ".")
    parent.mkdir(parents=True, exist_ok=True)
    target = parent / os.path.basename(relative)
    if target.is_dir() and not target.is_symlink():
        # Like cp: an existing directory (made by an earlier step) receives the
        # file; replacing it would throw away that step's work.
        return target / source.name
    return target


def _walk_sizes(root: Path) -> Iterator[int]:
    """Sizes of every file under ``root``, following links like the copy does."""
    seen: set[tuple[int, int]] = set()
    stack = [str(root)]
    while stack:
        folder = stack.pop()
        st = os.stat(folder)
        if (st.st_dev, st.st_ino) in seen:
            continue
        seen.add((st.st_dev, st.st_ino))
        with os.scandir(folder) as entries:
            for entry in entries:
                try:
                    if entry.is_dir():
                        stack.append(entry.path)
                    else:
                        yield entry.stat().st_size
                except FileNotFoundError:
                    continue  # a dangling link: copied as a link, writes no data


class _Copier:
    """Moves one file's bytes with the fastest method that works, then sets metadata."""

    def __init__(self, ctx: OpContext) -> None:
        self.ctx = ctx

    def copy_file(self, src: str, dst: str, st: os.stat_result) -> None:
        """Copy ``src`` to ``dst`` unless an identical copy is already there."""
        if _is_complete(dst, st):
            self.ctx.progress.advance(st.st_size, 1)
            return
        # Raw descriptors: this runs once per file, and file objects cost more
        # Python work than the syscalls they wrap.
        fin = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
        try:
            fout = _open_destination(dst, stat.S_IMODE(st.st_mode))
            try:
                copied = self._copy_bytes(fin, fout, st.st_size)
                self._finish(fout, src, dst, st, copied)
            finally:
                os.close(fout)
        finally:
            os.close(fin)
        self.ctx.progress.advance(0, 1)

    def _finish(self, fout: int, src: str, dst: str, st: os.stat_result, copied: int) -> None:
        have = os.fstat(fout)
        mode = stat.S_IMODE(st.st_mode)
        if stat.S_IMODE(have.st_mode) != mode:
            os.fchmod(fout, mode)  # the umask, or a file left by an earlier run
        self._verify(src, st, copied, have.st_size, dst)
        # The mtime goes last: it is what marks the file complete for a restart.
        # Set through the descriptor, which NFS also orders after the writes.
        os.utime(fout, ns=(st.st_atime_ns, st.st_mtime_ns))

    def _copy_bytes(self, fin: int, fout: int, size: int) -> int:
        """Copy in CHUNK pieces, so progress and cancel are seen within a large file."""
        done = 0
        while done < size:
            n = copy_chunk(fin, fout, done, min(CHUNK, size - done))
            if n == 0:
                break  # the source shrank under us; verify will say so
            done += n
            self.ctx.progress.advance(n)
            if done < size:
                self.ctx.check_cancelled()
        return done

    def _verify(self, src: str, st: os.stat_result, copied: int, written: int, dst: str) -> None:
        if self.ctx.verify == "none":
            return
        if copied != st.st_size or written != st.st_size:
            raise VerifyFailed(
                f"copy of {src} has {written} bytes but the source has {st.st_size}; "
                "check that the source is not being modified and stage again"
            )
        if self.ctx.verify == "sha256":
            want, got = _sha256(src), _sha256(dst)
            if want != got:
                raise VerifyFailed(
                    f"copy of {src} has sha256 {got} but the source has {want}; "
                    "check the source and the local disk, then stage again"
                )


def _is_complete(dst: str, st: os.stat_result) -> bool:
    try:
        have = os.lstat(dst)
    except FileNotFoundError:
        return False
    return (
        stat.S_ISREG(have.st_mode)
        and have.st_size == st.st_size
        and have.st_mtime_ns == st.st_mtime_ns
    )


def _open_destination(dst: str, mode: int) -> int:
    """Open for writing, replacing whatever is in the way; never follow a link.

    The file is created with the source's mode, so usually no chmod is needed.
    A read-only file left by an interrupted run (EACCES) is replaced too.
    """
    flags = os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC
    try:
        return os.open(dst, flags, mode)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.EISDIR, errno.EACCES):
            raise
    _remove(dst)
    return os.open(dst, flags, mode)


def _remove(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path)
    else:
        os.unlink(path)


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(READ_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


@dataclass
class _Batch:
    files: list[tuple[str, str, os.stat_result]] = field(default_factory=list)
    nbytes: int = 0


class _TreeCopy:
    """Walk ``src`` on the calling thread while a pool copies the files found so far."""

    def __init__(self, src: Path, dst: Path, ctx: OpContext) -> None:
        self.src = os.path.abspath(src)
        self.src_real = os.path.realpath(src)
        self.dst = str(dst)
        self.ctx = ctx
        self.copier = _Copier(ctx)
        self.failed = threading.Event()  # a worker failed: stop the others early
        self.pending: set[Future[None]] = set()
        self.dirs: list[tuple[str, os.stat_result]] = []
        self.seen: set[tuple[int, int]] = set()

    def run(self) -> None:
        workers = max(1, self.ctx.workers)
        os.makedirs(self.dst, exist_ok=True)
        with ThreadPoolExecutor(workers, thread_name_prefix="stager-copy") as pool:
            try:
                self._walk(pool, workers * 4)
                self._drain(0)
            finally:
                # On error or cancel: let running batches stop at their next
                # file and drop the queued ones, then surface the first error.
                self.failed.set()
                for future in self.pending:
                    future.cancel()
        self._finish_dirs()

    def _walk(self, pool: ThreadPoolExecutor, max_pending: int) -> None:
        stack = [(self.src, self.dst)]
        while stack:
            self.ctx.check_cancelled()
            src_dir, dst_dir = stack.pop()
            st = os.stat(src_dir)
            if (st.st_dev, st.st_ino) in self.seen:
                continue  # a directory link loop: its content is already being copied
            self.seen.add((st.st_dev, st.st_ino))
            make_dir(dst_dir)
            self.dirs.append((dst_dir, st))
            for batch in self._scan(src_dir, dst_dir, stack):
                self.ctx.progress.add_total(batch.nbytes, len(batch.files))
                self._drain(max_pending)
                self.pending.add(pool.submit(self._copy_batch, batch))

    def _scan(self, src_dir: str, dst_dir: str, stack: list[tuple[str, str]]) -> Iterator[_Batch]:
        batch = _Batch()
        with os.scandir(src_dir) as entries:
            for entry in entries:
                target = os.path.join(dst_dir, entry.name)
                if entry.is_symlink() and self._copy_link(entry.path, target):
                    continue
                if entry.is_dir():
                    stack.append((entry.path, target))
                    continue
                st = entry.stat()
                batch.files.append((entry.path, target, st))
                batch.nbytes += st.st_size
                if len(batch.files) >= BATCH_FILES:
                    yield batch
                    batch = _Batch()
        if batch.files:
            yield batch

    def _copy_link(self, link: str, target: str) -> bool:
        """Recreate an in-tree or dangling link; False means "copy what it points to"."""
        resolved = os.path.realpath(link)
        if not os.path.exists(resolved):
            _place_link(os.readlink(link), target)
            return True
        inside = resolved == self.src_real or resolved.startswith(self.src_real + os.sep)
        if not inside:
            return False
        # Relative, so the copy points into itself wherever the dataset is published.
        rel_target = os.path.relpath(resolved, self.src_real)
        rel_parent = os.path.relpath(os.path.dirname(target), self.dst)
        _place_link(os.path.relpath(rel_target, rel_parent), target)
        return True

    def _copy_batch(self, batch: _Batch) -> None:
        for src, dst, st in batch.files:
            if self.failed.is_set():
                return
            self.ctx.check_cancelled()
            self.copier.copy_file(src, dst, st)

    def _drain(self, max_pending: int) -> None:
        """Wait until at most ``max_pending`` batches are queued; re-raise a worker's error."""
        while len(self.pending) > max_pending:
            done, self.pending = wait(self.pending, return_when=FIRST_COMPLETED)
            for future in done:
                future.result()

    def _finish_dirs(self) -> None:
        # Deepest first, after all files: writing into a directory bumps its mtime.
        # The owner keeps rwx so a restarted run can still write into read-only
        # copies; the dataset root itself is left alone, other steps share it.
        root = str(self.ctx.root.resolve())
        for path, st in reversed(self.dirs):
            if path == root:
                continue
            os.chmod(path, stat.S_IMODE(st.st_mode) | stat.S_IRWXU)
            os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def _place_link(link_text: str, path: str) -> None:
    """Make ``path`` a symlink with ``link_text``, leaving an identical one alone."""
    try:
        if os.readlink(path) == link_text:
            return
    except FileNotFoundError:
        pass
    except OSError as exc:
        if exc.errno != errno.EINVAL:  # EINVAL: there, but not a link
            raise
    if os.path.lexists(path):
        _remove(path)
    os.symlink(link_text, path)
