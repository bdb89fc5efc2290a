"""A tree and its manifest: the manifest of a tree on disk, hashed incrementally while
parts arrive (`Digests`), what a tree holds beyond it removed (`prune`), and a tree
checked against it path by path (`verify`).

The format is the wire layer's (:mod:`stager.wire.manifest_format`); this side walks
trees and raises `VerifyFailed`. A delivered file is trusted only once it matches.
"""

from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

from stager.core.errors import VerifyFailed
from stager.wire.manifest_format import Manifest, NotAManifest, file_digest


def read(data: bytes, label: str) -> Manifest:
    """The manifest in ``data`` (a delivery's ``label``), or `VerifyFailed`: a copy that
    cannot be checked is never trusted."""
    try:
        return Manifest.from_bytes(data, label)
    except NotAManifest as exc:
        raise VerifyFailed(
            f"{exc}; the copy cannot be checked, so this node stages from the source"
        ) from exc


def walk(root: Path) -> list[tuple[str, os.stat_result]]:
    """Every path under ``root`` (relative, sorted, parents first) with its lstat."""
    found = []
    stack = [""]
    while stack:
        relative = stack.pop()
        with os.scandir(root / relative if relative else root) as children:
            for child in children:
                path = f"{relative}/{child.name}" if relative else child.name
                info = child.stat(follow_symlinks=False)
                found.append((path, info))
                if stat.S_ISDIR(info.st_mode):
                    stack.append(path)
    found.sort(key=lambda item: item[0].split("/"))
    return found


_LISTED_FLAGS = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
_FOLDER_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


class NotAsListed(FileNotFoundError):
    """The path a walk listed holds something else now (or nothing)."""


def folder_of(top: int, path: str, create: bool = False) -> tuple[int, str]:
    """The folder that holds ``path`` under the folder open as ``top`` (a descriptor of
    its own, for the caller to close), reached through real folders only (made where
    missing, with ``create``); and the name in it. OSError if a folder on the way is
    missing, a link or not a folder."""
    *folders, name = path.split("/")
    folder = os.dup(top)
    try:
        for component in folders:
            try:
                inner = os.open(component, _FOLDER_FLAGS, dir_fd=folder)
            except FileNotFoundError:
                if not create:
                    raise
                os.mkdir(component, 0o755, dir_fd=folder)
                inner = os.open(component, _FOLDER_FLAGS, dir_fd=folder)
            os.close(folder)
            folder = inner
    except BaseException:
        os.close(folder)
        raise
    return folder, name


def open_listed(root: Path, path: str, info: os.stat_result) -> int:
    """The file a walk of ``root`` listed at ``path`` (``info``), opened to read: that
    same file (device and inode), reached through real folders only, or `NotAsListed`,
    never whatever took its place since."""
    try:
        top = os.open(root, _FOLDER_FLAGS)
        try:
            folder, name = folder_of(top, path)
        finally:
            os.close(top)
        try:
            fd = os.open(name, _LISTED_FLAGS, dir_fd=folder)
        finally:
            os.close(folder)
    except OSError as exc:
        if exc.errno not in (errno.ENOENT, errno.ENOTDIR, errno.ELOOP):
            raise
        raise NotAsListed(
            exc.errno, f"{root / path} is not there as listed ({exc.strerror})"
        ) from exc
    found = os.fstat(fd)
    if not stat.S_ISREG(found.st_mode) or (found.st_dev, found.st_ino) != (
        info.st_dev,
        info.st_ino,
    ):
        os.close(fd)
        raise NotAsListed(errno.ENOENT, f"{root / path} is another file than the one listed")
    return fd


class Digests:
    """Files hashed earlier, each with its identity then (inode, size, mtime, ctime):
    the final check reads again only a file that changed since (a write moves ctime)."""

    def __init__(self) -> None:
        self._known: dict[str, tuple[tuple[int, int, int, int], tuple[int, str]]] = {}

    def of(self, root: Path, path: str, info: os.stat_result) -> tuple[int, str]:
        found = self.known(path, info)
        if found is None:
            found = file_digest(root / path)
            self.remember(path, info, found)
        return found

    def known(self, path: str, info: os.stat_result) -> tuple[int, str] | None:
        """(size, sha256) of ``path`` if it was hashed as it is now (``info``), else None."""
        known = self._known.get(path)
        return known[1] if known is not None and known[0] == identity(info) else None

    def remember(self, path: str, info: os.stat_result, digest: tuple[int, str]) -> None:
        """``digest`` is what ``path`` held while it was ``info`` (stat before reading)."""
        self._known[path] = (identity(info), digest)

    def update(self, other: Digests) -> None:
        self._known.update(other._known)


def identity(info: os.stat_result) -> tuple[int, int, int, int]:
    """What a write to a file changes (its inode, size, mtime or ctime)."""
    return (info.st_ino, info.st_size, info.st_mtime_ns, info.st_ctime_ns)


def build(root: Path, digests: Digests | None = None) -> Manifest:
    """The manifest of a tree as it is on disk (hashes every file ``digests`` does not
    hold as it is now)."""
    manifest = Manifest()
    digests = digests or Digests()
    for path, info in walk(root):
        add(manifest, root, path, info, digests)
    return manifest


def add(manifest: Manifest, root: Path, path: str, info: os.stat_result, digests: Digests) -> None:
    if stat.S_ISDIR(info.st_mode):
        manifest.dirs.add(path)
    elif stat.S_ISLNK(info.st_mode):
        manifest.links[path] = os.readlink(root / path)
    elif stat.S_ISREG(info.st_mode):
        manifest.files[path] = digests.of(root, path, info)
    else:
        raise VerifyFailed(
            f"{root / path} is neither a file, a folder nor a link; a dataset holding "
            "devices or sockets cannot be broadcast, stage it on every node instead"
        )


def prune(root: Path, expected: Manifest) -> None:
    """Remove what ``root`` holds that ``expected`` does not name (deepest first): files
    an early part carried that the staging on the source renamed or removed later.
    Links are removed, never followed."""
    named = expected.dirs | set(expected.files) | set(expected.links)
    for path, info in reversed(walk(root)):
        if path in named:
            continue
        if stat.S_ISDIR(info.st_mode):
            shutil.rmtree(root / path)
        elif os.path.lexists(root / path):  # a folder removed above may have held it
            os.unlink(root / path)


def verify(root: Path, expected: Manifest, origin: str, digests: Digests | None = None) -> None:
    """Raise `VerifyFailed` naming the first path where ``root`` differs from ``expected``."""
    got = build(root, digests)
    for kind, want, have in (
        ("folder", expected.dirs, got.dirs),
        ("link", set(expected.links), set(got.links)),
        ("file", set(expected.files), set(got.files)),
    ):
        if missing := sorted(want - have):
            raise _differs(origin, f"{kind} {missing[0]!r} is missing")
        if extra := sorted(have - want):
            raise _differs(origin, f"{kind} {extra[0]!r} is not in the manifest")
    for path, target in sorted(expected.links.items()):
        if got.links[path] != target:
            raise _differs(origin, f"link {path!r} points to {got.links[path]!r}, not {target!r}")
    for path, (size, sha) in sorted(expected.files.items()):
        have_size, have_sha = got.files[path]
        if have_size != size:
            raise _differs(origin, f"file {path!r} has {have_size} bytes, not {size}")
        if have_sha != sha:
            raise _differs(origin, f"file {path!r} has different content (sha256 {have_sha})")


def _differs(origin: str, what: str) -> VerifyFailed:
    return VerifyFailed(
        f"the copy broadcast from {origin} does not match the manifest that node wrote: "
        f"{what}; this node stages from the source instead"
    )
