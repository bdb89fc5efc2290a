"""Fingerprints of a request's sources, part of the cache key: path, size and mtime of
each source, and of a tree's top level (cheap) or every file (deep); what every node
sees alike, no inode (docs/cache.md). Each entry's line is hashed on its own and the
hashes are summed (modulo 2**512), so the order a folder lists doesn't matter and
nothing is sorted or kept. Only folders are opened: ``stat`` of a FIFO or a device
does not wait on it.
"""

from __future__ import annotations

import hashlib
import os
import stat
from typing import Any

from stager.fs.sources import Folder, Visitor, open_child, walk

_MODULUS = 1 << 512  # blake2b's digest: the fastest hashlib offers for short lines


def sources_fingerprint(steps: list[Any], deep: bool = False) -> str:
    digest = hashlib.sha256()
    for step in steps:
        source = getattr(step, "src", None)
        if source and os.path.isabs(source):
            _add_path(digest, source, deep)
    return digest.hexdigest()[:24]


def _add_path(digest: Any, path: str, deep: bool) -> None:
    info = _stat(path)
    digest.update(_line(path, info))
    if info is None or not stat.S_ISDIR(info.st_mode):
        return
    tally = _Tally()
    try:
        if deep:
            _walk(path, tally)
        else:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                _add_children(fd, tally)
            finally:
                os.close(fd)
    except OSError as exc:
        # An unreadable folder: the key still differs from a readable tree's, and the
        # request's pre-flight check (or the staging) reports it with a sentence.
        digest.update(f"{path}\0unreadable {exc.errno}\n".encode("utf-8", "surrogateescape"))
    digest.update(f"{path}\0{tally.count}\0{tally.total:0128x}\n".encode())


class _Tally:
    """An order-independent sum of the entries' hashes."""

    def __init__(self) -> None:
        self._sum = 0
        self.count = 0

    def add(self, line: bytes) -> None:
        # Reduced once at the end: a million 512-bit terms only add 20 bits meanwhile.
        self._sum += int.from_bytes(hashlib.blake2b(line).digest())
        self.count += 1

    @property
    def total(self) -> int:
        return self._sum % _MODULUS


class _Deep(Visitor):
    """Every entry under the top; folder links are not walked into (as ``os.walk``)."""

    def __init__(self, tally: _Tally) -> None:
        self.tally = tally

    def _add(self, folder: Folder, entry: os.DirEntry[str]) -> None:
        self.tally.add(_line(folder.child_rel(entry.name), _entry_info(folder.fd, entry)))

    file = link = special = _add  # type: ignore[assignment]

    def subdir(self, folder: Folder, entry: os.DirEntry[str]) -> Folder | None:
        self._add(folder, entry)
        return open_child(folder, entry.name)


def _walk(top: str, tally: _Tally) -> None:
    fd = os.open(top, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        walk(Folder(fd, top, "", os.fstat(fd)), _Deep(tally), special="skip")
    finally:
        os.close(fd)


def _add_children(fd: int, tally: _Tally) -> None:
    with os.scandir(fd) as entries:
        for entry in entries:
            tally.add(_line(entry.name, _entry_info(fd, entry)))


def _entry_info(fd: int, entry: os.DirEntry[str]) -> os.stat_result | None:
    """What a link leads to, like the copy sees it; the link itself when dangling."""
    try:
        return entry.stat()
    except OSError:
        try:
            return os.stat(entry.name, dir_fd=fd, follow_symlinks=False)
        except OSError:
            return None


def _stat(path: str) -> os.stat_result | None:
    """A dangling link or missing path counts as itself: the fingerprint is a key, not a
    check."""
    try:
        return os.stat(path)
    except OSError:
        try:
            return os.lstat(path)
        except OSError:
            return None


def _line(path: str, info: os.stat_result | None) -> bytes:
    if info is None:
        return f"{path}\0missing\n".encode("utf-8", "surrogateescape")
    line = f"{path}\0{info.st_size}\0{info.st_mtime_ns}\n"
    return line.encode("utf-8", "surrogateescape")
