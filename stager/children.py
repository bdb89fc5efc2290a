"""Child processes never outlive the process that started them.

A staging process (and the extraction processes it starts) writes into a partial
directory that a restarted daemon resumes in; if its parent is killed (-9), a
child still writing there would race with the resumed staging.
"""

from __future__ import annotations

import ctypes
import signal

_PR_SET_PDEATHSIG = 1


def die_with_parent() -> None:
    """Ask Linux to SIGKILL this process when its parent (thread) dies."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)
    except OSError:
        pass  # not glibc Linux: callers keep their own parent checks
