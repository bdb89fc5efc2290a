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

_REFUSED = frozenset({errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL})
_CHUNK = 1 << 20
_kernel_copy = hasattr(os, "copy_file_range")
_sendfile = hasattr(os, "sendfile")


def copy_range(src_fd: int, dst_fd: int, offset: int, size: int) -> None:
    """Append ``size`` bytes at ``offset`` of ``src_fd`` to ``dst_fd``; EOFError if short."""
    global _kernel_copy, _sendfile
    if _kernel_copy:
        try:
            while size > 0:
                done = os.copy_file_range(src_fd, dst_fd, size, offset)
                if done == 0:
                    raise EOFError(f"archive ended inside a member (needed {size} more bytes)")
                offset += done
                size -= done
            return
        except OSError as exc:
            if exc.errno not in _REFUSED:
                raise
            _kernel_copy = False  # and finish below from where the kernel stopped
    if _sendfile:
        try:
            while size > 0:
                done = os.sendfile(dst_fd, src_fd, offset, size)
                if done == 0:
                    raise EOFError(f"archive ended inside a member (needed {size} more bytes)")
                offset += done
                size -= done
            return
        except OSError as exc:
            if exc.errno not in _REFUSED:
                raise
            _sendfile = False
    while size > 0:
        data = os.pread(src_fd, min(size, _CHUNK), offset)
        if not data:
            raise EOFError(f"archive ended inside a member (needed {size} more bytes)")
        view = memoryview(data)
        while view:
            view = view[os.write(dst_fd, view) :]
        offset += len(data)
        size -= len(data)
