"""Link a source into the dataset instead of copying it.

``link``: one symlink at ``dst`` pointing at ``src`` (the cheapest staging there
is: the data stays on the shared filesystem). ``tree``: real directories and one
symlink per file, each pointing at the absolute source file. That is what
seeds/000's ``link_file`` meant to do (it called ``Path(src).symlink_to(dest)``,
the arguments reversed); a mirrored tree lets later steps rename or add entries
inside the dataset without touching the shared source.

Link targets are ``os.path.abspath`` of the source, not ``realpath``: the
user's path (``/network/datasets/...``) is the stable name on every node, while
what it resolves to today may be a site-specific mount.

``tree`` costs one ``scandir`` per directory plus one ``symlink`` per file;
no ``stat`` of the sources. The syscalls themselves dominate (journalled
metadata in the kernel), so a small thread pool creates the links, per
directory batch, while this thread keeps walking: the kernel work spreads over
the cores, which a single-threaded ``cp -rs`` cannot do.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Iterator
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from typing import Literal

from stager.errors import BadRequest, StagerError, from_os_error
from stager.ops.base import (
    AbsoluteSource,
    CheckContext,
    OpContext,
    RelativePath,
    StepParams,
    make_dir,
    require_source,
)


class SymlinkStep(StepParams):
    """Link a source into the dataset: one link, or a mirrored tree of per-file links."""

    src: AbsoluteSource
    dst: RelativePath = "."
    mode: Literal["link", "tree"] = "link"


# Links per pool task: large enough to amortise the executor, small enough to
# spread one huge directory over several threads.
BATCH = 256


def check(step: SymlinkStep, ctx: CheckContext) -> int:
    """Validate the source; links write no data, so the estimate is 0."""
    source = require_source(step.src)
    if step.mode == "tree" and not source.is_dir():
        raise BadRequest(
            f"symlink source {step.src} is a file, but mode 'tree' mirrors a directory; "
            "use mode 'link' for a single file"
        )
    return 0


def run(step: SymlinkStep, ctx: OpContext) -> None:
    check(step, ctx.check_context)
    source = os.path.abspath(step.src)
    try:
        if step.mode == "link":
            _link_one(source, _link_path(step, ctx), ctx)
        else:
            _link_tree(source, str(ctx.destination(step.dst)), ctx)
    except OSError as exc:
        raise _translate(exc, source) from exc


def _translate(exc: OSError, source: str) -> StagerError:
    """The one place where OS errors become stager errors (ENOSPC: disk or inodes full)."""
    return from_os_error(exc, f"linking {source}")


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


def _link_one(source: str, path: str, ctx: OpContext) -> None:
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


def _link_tree(source: str, dst_root: str, ctx: OpContext) -> None:
    """Walk on this thread; link each directory's files on the pool."""
    os.makedirs(dst_root, exist_ok=True)
    pending: set[Future[None]] = set()
    max_pending = max(1, ctx.workers) * 4
    with ThreadPoolExecutor(max(1, ctx.workers), thread_name_prefix="stager-link") as pool:
        try:
            for pairs in _scan_tree(source, dst_root, ctx):
                ctx.progress.add_total(0, len(pairs))
                while len(pending) >= max_pending:
                    pending = _reap(pending)
                pending.add(pool.submit(_place_all, pairs, ctx))
            while pending:
                pending = _reap(pending)
        finally:
            for future in pending:
                future.cancel()  # on error or cancel, drop what has not started


def _scan_tree(source: str, dst_root: str, ctx: OpContext) -> Iterator[list[tuple[str, str]]]:
    """Create the directories; yield (source, link) pairs in per-directory batches."""
    stack = [(source, dst_root)]
    while stack:
        ctx.check_cancelled()
        src_dir, dst_dir = stack.pop()
        pairs: list[tuple[str, str]] = []
        with os.scandir(src_dir) as entries:
            for entry in entries:
                target = f"{dst_dir}/{entry.name}"
                # Directory links are linked like files, not walked: no cycles,
                # and the link still resolves to the same content.
                if entry.is_dir(follow_symlinks=False):
                    make_dir(target)  # before its files are queued
                    stack.append((entry.path, target))
                    continue
                pairs.append((entry.path, target))
                if len(pairs) >= BATCH:
                    yield pairs
                    pairs = []
        if pairs:
            yield pairs


def _place_all(pairs: list[tuple[str, str]], ctx: OpContext) -> None:
    ctx.check_cancelled()
    for source, path in pairs:
        _place(source, path)
    ctx.progress.advance(0, len(pairs))


def _reap(pending: set[Future[None]]) -> set[Future[None]]:
    """Wait for one batch to finish; re-raise its error here, on the calling thread."""
    done, pending = wait(pending, return_when=FIRST_COMPLETED)
    for future in done:
        future.result()
    return pending


def _place(source: str, path: str) -> None:
    """Make ``path`` a link to ``source``; the common case is a single syscall."""
    try:
        os.symlink(source, path)
        return
    except FileExistsError:
        pass
    if _current_target(path) == source:
        return  # left by an earlier run
    if os.path.isdir(path) and not os.path.islink(path):
        _refuse_directory(path)
    else:
        os.unlink(path)
    os.symlink(source, path)


def _current_target(path: str) -> str | None:
    try:
        return os.readlink(path)
    except (FileNotFoundError, NotADirectoryError):
        return None
    except OSError as exc:
        if exc.errno == errno.EINVAL:  # exists, but is not a link
            return None
        raise


def _refuse_directory(path: str) -> None:
    """An empty directory may be replaced; a full one is another step's data."""
    try:
        os.rmdir(path)
    except OSError as exc:
        if exc.errno not in (errno.ENOTEMPTY, errno.EEXIST):
            raise
        raise BadRequest(
            f"cannot create a link at {path}: a non-empty directory is there; "
            "choose another 'dst' for the symlink step or remove the step that fills it"
        ) from exc
