"""Start a range's writeback as soon as it is written, not at the final fsync.

A staging that writes one large file and then fsyncs it (a blob, a prebuilt image)
waits for the disk twice over: first the copy fills the page cache, then the fsync
writes it all. ``sync_file_range(SYNC_FILE_RANGE_WRITE)`` starts the writeback of a
range and returns at once, so the disk writes while the next range is copied and the
fsync finds little left. It promises nothing: the fsync at the end still decides.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from stager.core.libc import LIBC

_SYNC_FILE_RANGE_WRITE = 2


def _starter() -> Callable[[int, int, int], object] | None:
    call = getattr(LIBC, "sync_file_range", None)
    if call is None:
        return None
    call.argtypes = (ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint)
    return call


_CALL = _starter()


def start_writeback(fd: int, offset: int, count: int) -> None:
    """Start writing ``count`` bytes of ``fd`` from ``offset`` to the disk; nothing where
    libc has no sync_file_range. A failure is left to the fsync that follows."""
    if _CALL is not None:
        _CALL(fd, offset, count, _SYNC_FILE_RANGE_WRITE)
