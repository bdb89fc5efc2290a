"""Copy a byte range between descriptors in the kernel when it can, in user space when not.

``copy_file_range`` avoids a trip through user space (and reflinks where the
filesystem offers them), but refuses some pairs: across filesystems (EXDEV,
e.g. an archive on NFS extracted to local disk), or on filesystems without
support (ENOSYS, EOPNOTSUPP, EINVAL). The first refusal switches this process to
``sendfile`` (file to file works across filesystems, still in the kernel; with an
explicit offset it leaves the shared source descriptor's position alone, so many
threads can use it), and if that is refused too, to ``pread``/``write``.
"""

from __future__ import annotations

import errno
import os
from collections.abc import Callable

_REFUSED = frozenset({errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL})
_CHUNK = 1 << 20


def _copy_file_range(src_fd: int, dst_fd: int, offset: int, size: int) -> int:
    return os.copy_file_range(src_fd, dst_fd, size, offset)


def _sendfile(src_fd: int, dst_fd: int, offset: int, size: int) -> int:
    return os.sendfile(dst_fd, src_fd, offset, size)


def _pread_write(src_fd: int, dst_fd: int, offset: int, size: int) -> int:
    data = os.pread(src_fd, min(size, _CHUNK), offset)
    view = memoryview(data)
    while view:
        view = view[os.write(dst_fd, view) :]
    return len(data)


Method = Callable[[int, int, int, int], int]
# Tried in order; a method the kernel refuses is dropped for the rest of the process.
_methods: list[Method] = [
    m
    for m, available in (
        (_copy_file_range, hasattr(os, "copy_file_range")),
        (_sendfile, hasattr(os, "sendfile")),
        (_pread_write, True),
    )
    if available
]


def copy_range(src_fd: int, dst_fd: int, offset: int, size: int) -> None:
    """Append ``size`` bytes at ``offset`` of ``src_fd`` to ``dst_fd``; EOFError if short."""
    while size > 0:
        method = _methods[0]
        try:
            done = method(src_fd, dst_fd, offset, size)
        except OSError as exc:
            if exc.errno not in _REFUSED or method is _pread_write:
                raise
            _methods.remove(method)  # continue from here with the next method
            continue
        if done == 0:
            raise EOFError(f"archive ended inside a member (needed {size} more bytes)")
        offset += done
        size -= done
