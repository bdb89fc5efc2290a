"""Move bytes between descriptors in the kernel when it can, in user space when not.

One chain for every op that copies file data: ``copy_file_range`` (reflinks where it
can) refuses some pairs (EXDEV across filesystems; ENOSYS, EOPNOTSUPP, EINVAL); then
``sendfile``; then ``pread``/``write``. A refused method is dropped for the rest of
the process: a staging's sources and destination rarely change filesystem.

Reads take an explicit source offset, so threads can share one source descriptor;
writes go to the destination's current position.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

_REFUSED_ERRNOS = frozenset(
    {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL}
)
READ_CHUNK = 1 << 20  # the user-space path's buffer


def write_all(fd: int, data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _pread_write(src_fd: int, dst_fd: int, offset: int, count: int) -> int:
    data = os.pread(src_fd, min(count, READ_CHUNK), offset)
    write_all(dst_fd, data)
    return len(data)


# Checked by name, so a platform (or a test) without one simply skips it.
_METHODS: dict[str, Callable[[int, int, int, int], int]] = {
    "copy_file_range": lambda s, d, off, n: os.copy_file_range(s, d, n, off),
    "sendfile": lambda s, d, off, n: os.sendfile(d, s, off, n),
    "pread": _pread_write,
}
_refused: set[str] = set()
# The first method not refused yet, looked up once rather than per call: a million
# small files are a million calls (docs/performance.md).
_best: tuple[str, Callable[[int, int, int, int], int]] | None = None


def _pick() -> tuple[str, Callable[[int, int, int, int], int]]:
    global _best
    for name, method in _METHODS.items():
        if name not in _refused and hasattr(os, name):
            _best = (name, method)
            return _best
    raise OSError(errno.ENOSYS, "no way to copy file data on this platform")


def copy_chunk(src_fd: int, dst_fd: int, offset: int, count: int) -> int:
    """Move up to ``count`` bytes from ``offset`` of the source; 0 means end of source."""
    global _best
    while True:
        name, method = _best or _pick()
        try:
            return method(src_fd, dst_fd, offset, count)
        except AttributeError:  # gone from ``os`` since it was picked (a test took it away)
            _best = None
        except OSError as exc:
            if exc.errno not in _REFUSED_ERRNOS or name == "pread":
                raise
            _refuse(name)  # nothing was written: retry this chunk with the next one


def _refuse(name: str) -> None:
    global _best
    _refused.add(name)
    _best = None


def copy_range(src_fd: int, dst_fd: int, offset: int, size: int) -> None:
    """Append ``size`` bytes at ``offset`` of ``src_fd`` to ``dst_fd``; EOFError if short."""
    while size > 0:
        done = copy_chunk(src_fd, dst_fd, offset, size)
        if done == 0:
            raise EOFError(f"archive ended inside a member (needed {size} more bytes)")
        offset += done
        size -= done
