"""Fingerprints of a request's sources, part of the cache key.

The same request over unchanged sources maps to the same cache entry across jobs,
daemon restarts and the nodes of a cluster; a touched archive (size or mtime
changed) maps to a new entry and is staged afresh. Only what every node sees alike
counts: path, size and mtime. Inode numbers do not: network filesystems built on
FUSE (sshfs, s3fs, rclone, ...) number inodes per client, and a multi-node job
finds a node's copy by its key (see docs/multinode.md). Trees get a cheap
fingerprint by default (the root and its direct children), or a deep one (every
file) on request: on a network filesystem a deep walk of ImageNet costs minutes,
a cheap one milliseconds.
"""

from __future__ import annotations

import hashlib
import os
import stat
from typing import Any


def sources_fingerprint(steps: list[Any], deep: bool = False) -> str:
    digest = hashlib.sha256()
    for step in steps:
        source = getattr(step, "src", None)
        if source and os.path.isabs(source):
            _add_path(digest, source, deep)
    return digest.hexdigest()[:24]


def _add_path(digest: Any, path: str, deep: bool) -> None:
    info = _add_stat(digest, path)
    if info is None or not stat.S_ISDIR(info.st_mode):
        return
    try:
        if deep:
            for dirpath, dirnames, filenames in os.walk(path, onerror=_raise):
                dirnames.sort()  # walk order must not depend on the filesystem
                for name in sorted(filenames):
                    _add_stat(digest, os.path.join(dirpath, name))
        else:
            with os.scandir(path) as children:
                for child in sorted(children, key=lambda c: c.name):
                    _add_stat(digest, child.path)
    except OSError as exc:
        # An unreadable folder: the key still differs from a readable tree's, and the
        # request's pre-flight check (or the staging) reports it with a sentence.
        digest.update(f"{path}\0unreadable {exc.errno}\n".encode("utf-8", "surrogateescape"))


def _raise(exc: OSError) -> None:
    raise exc


def _add_stat(digest: Any, path: str) -> os.stat_result | None:
    """Add what identifies ``path``'s content; a dangling link or missing path counts as
    itself (an ``lstat``), never as an error: the fingerprint is a key, not a check."""
    try:
        info = os.stat(path)
    except OSError:
        try:
            info = os.lstat(path)
        except OSError as exc:
            digest.update(f"{path}\0missing {exc.errno}\n".encode("utf-8", "surrogateescape"))
            return None
    line = f"{path}\0{info.st_size}\0{info.st_mtime_ns}\n"
    digest.update(line.encode("utf-8", "surrogateescape"))
    return info
