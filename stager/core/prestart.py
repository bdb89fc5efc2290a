"""What ``stager serve`` does before it imports the app: start its fork server, so that
its start overlaps; and before that, refuse at once to be a second daemon on a socket
one already answers on.

A daemon is ready only once its fork server (stager.core.processes.start_fork_server) has
imported :mod:`stager.engine.preload` (~0.35 s: every op, the HTTP stack) and forked the
first process. The daemon's own imports (FastAPI, uvicorn, the routes) take as long
again. Started here, before those imports, the fork server imports on the second
core while the daemon imports on the first, and the daemon is ready ~0.35 s sooner,
at every start and restart. This module imports nothing of stager's for that reason.

The fork server is spawned with the process's attributes at that moment, and every
staging and user process inherits them from it: so the descriptor limit is raised
first, as the daemon's connections need (stager.api.connections).
"""

from __future__ import annotations

import resource
import socket
from pathlib import Path


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
