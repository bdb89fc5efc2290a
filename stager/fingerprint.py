"""Fingerprints of a request's sources, part of the cache key.

The same request over unchanged sources maps to the same cache entry across jobs
and daemon restarts; a touched archive (size, mtime or inode changed) maps to a
new entry and is staged afresh. Trees get a cheap fingerprint by default (the
root and its direct children), or a deep one (every file) on request: on a
network filesystem a deep walk of ImageNet costs minutes, a cheap one milliseconds.
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
    try:
        info = os.stat(path)
    except FileNotFoundError:
        digest.update(f"{path}\0missing\n".encode())
        return
    _add_stat(digest, path, info)
    if not stat.S_ISDIR(info.st_mode):
        return
    if deep:
        for dirpath, dirnames, filenames in os.walk(path):
            dirnames.sort()  # walk order must not depend on the filesystem
            for name in sorted(filenames):
                full = os.path.join(dirpath, name)
                _add_stat(digest, full, os.stat(full))
    else:
        with os.scandir(path) as children:
            for child in sorted(children, key=lambda c: c.name):
                _add_stat(digest, child.path, child.stat())


def _add_stat(digest: Any, path: str, info: os.stat_result) -> None:
    line = f"{path}\0{info.st_size}\0{info.st_mtime_ns}\0{info.st_ino}\n"
    digest.update(line.encode("utf-8", "surrogateescape"))
