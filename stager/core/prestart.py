"""What ``stager serve`` does before it imports the app: refuse at once to be a second
daemon on a socket one answers on, before ~0.6 s of imports. This module imports
nothing of stager's for that reason.

Its fork server, a fork of the daemon once the app is imported (stager.core.processes),
is raised to the descriptor limit first: every staging and user process inherits the
server's (stager.api.connections). What stays the same user's from / down is judged
here (:func:`unheld`), once for the daemon's checks and the fork server's folder alike.
"""

from __future__ import annotations

import errno
import os
import resource
import socket
import stat
from pathlib import Path

# The most links a path's resolution follows (Linux's own limit, past which: ELOOP).
MAX_LINKS = 40
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


def unheld(folder: Path) -> str | None:
    """Why someone but this user and root could replace ``folder`` or a folder above it,
    or None: a folder or link on the way that another user owns, or a folder they may
    write without the sticky bit, lets them rename what it holds away and put their own
    in its place (the default runtime and cache folders are under /tmp). Parts of
    ``folder`` not made yet are skipped: only who may write the folder above one could
    make it. OSError when a part cannot be read. The daemon refuses its folders on the
    answer (stager.api.startup); nothing is made or removed in them before it is None
    (stager.core.processes.temp_folder_in)."""
    uid = os.getuid()
    # The path as given and as resolved, and where each link on the way points as it is
    # written: a link is as replaceable as the folder that holds it, a link it points
    # at too (the resolved path's folders name neither, nor any folder above them).
    todo = [Path(folder).absolute(), Path(os.path.realpath(folder))]
    seen: set[Path] = set()
    links = 0
    while todo:
        path = todo.pop(0)
        for current in (path, *path.parents):
            if current in seen:
                continue
            seen.add(current)
            try:
                st = os.lstat(current)
            except FileNotFoundError:
                continue
            if st.st_uid not in (uid, 0):
                return f"{current} belongs to another user (uid {st.st_uid})"
            if stat.S_ISLNK(st.st_mode):  # its mode is always 0777: who may replace it counts
                links += 1
                if links > MAX_LINKS:
                    raise OSError(errno.ELOOP, os.strerror(errno.ELOOP), str(folder))
                todo.append(current.parent / os.readlink(current))
                continue
            if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH) and not st.st_mode & stat.S_ISVTX:
                return f"others may write {current}, so they may move what it holds"
    return None
