"""What ``stager serve`` does before it imports the app: refuse at once to be a second
daemon on a socket one answers on, then start its fork server so that its start
overlaps the daemon's own imports.

The fork server imports :mod:`stager.engine.preload` (~0.35 s) on the second core
while the daemon imports FastAPI and uvicorn on the first: ready ~0.35 s sooner at
every start. This module imports nothing of stager's for that reason. Every staging
and user process inherits the fork server's attributes, so the descriptor limit is
raised first (stager.api.connections).
"""

from __future__ import annotations

import resource
import socket
from pathlib import Path

# The longest path a Unix socket may have (sun_path is 108 bytes with its NUL).
MAX_SOCKET_PATH = 107


def raise_descriptor_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard limit; the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard != resource.RLIM_INFINITY and soft != hard:
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        soft = hard
    return soft


def socket_answers(path: Path) -> bool:
    """Whether a daemon listens on the Unix socket ``path``."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        try:
            sock.connect(str(path))
        except OSError:
            return False
    return True


def already_serving(path: Path) -> str | None:
    """The refusal of a second daemon on the socket ``path``, if one answers there:
    said before the fork server or the app is loaded, so that it comes at once."""
    if socket_answers(path):
        return f"a daemon already listens on {path}; run `stager stop` first"
    return None
