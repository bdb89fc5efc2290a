"""The C library this interpreter runs on, for the system calls ``os`` lacks (mount,
umount2, prctl, sync_file_range).

``CDLL(None)`` is the process's own symbol table, which holds libc: found without
``ctypes.util.find_library``, which runs ``ldconfig -p`` in a subprocess at every call
(a mount, an unmount, each process's first import), and without naming a file
(``libc.so.6``) that only glibc has.
"""

from __future__ import annotations

import ctypes

LIBC = ctypes.CDLL(None, use_errno=True)
