"""What ``stager serve`` checks before it serves, each failure one sentence.

Not a traceback from inside uvicorn's lifespan: the places it will write and the
address it will listen on are tried first, and the first failure is a ``ServeError``
naming the flag. ``--detach`` checks before it forks, so the person reads it.
"""

from __future__ import annotations

import os
import socket
import sqlite3
from contextlib import closing
from pathlib import Path

from stager.core import prestart
from stager.core.settings import Settings, env_name, flag_name
from stager.request import preflight


class ServeError(Exception):
    """Why the daemon cannot start, stop or answer, as one sentence for the terminal."""


def setting(name: str) -> str:
    """How a person sets field ``name``: ``--cache-dir (STAGER_CACHE_DIR)``."""
    return f"--{flag_name(name)} ({env_name(name)})"


def unusable_folder(name: str, path: Path, exc: OSError) -> ServeError:
    reason = exc.strerror or str(exc)
    where = f" ({exc.filename})" if exc.filename and str(exc.filename) != str(path) else ""
    return ServeError(
        f"--{flag_name(name)} {path} cannot be used: {reason}{where}; give {setting(name)} "
        "a folder this user can create and write, on a node-local disk"
    )


def require_held(name: str, folder: Path) -> None:
    """Nobody but this user and root can replace ``folder`` or anything above it
    (stager.core.prestart.unheld)."""
    try:
        why = prestart.unheld(folder)
    except OSError as exc:
        raise unusable_folder(name, folder, exc) from exc
    if why is not None:
        raise ServeError(
            f"--{flag_name(name)} {folder} cannot be used: {why}; give {setting(name)} a "
            "folder that only this user and root can change, from / down"
        )


def check_cache(settings: Settings) -> None:
    """The cache's folders exist (made if not), nobody else can replace them, and its
    state database opens."""
    try:
        preflight.ensure_dirs(settings)
    except OSError as exc:
        raise unusable_folder("cache_dir", settings.cache_dir, exc) from exc
    require_held("cache_dir", settings.cache_dir)
    try:
        with closing(sqlite3.connect(settings.db_path, timeout=5)) as db:
            db.execute("PRAGMA schema_version").fetchone()
    except sqlite3.Error as exc:
        raise ServeError(
            f"the state database {settings.db_path} cannot be opened ({exc}); check the disk "
            f"of {setting('cache_dir')}, or move a damaged state.db aside to start afresh"
        ) from exc


def check_address(settings: Settings) -> None:
    """The TCP address can be bound, or the socket's path fits and its folder exists."""
    if settings.host:
        try:
            infos = socket.getaddrinfo(settings.host, settings.port, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            raise ServeError(
                f"--host {settings.host} ({env_name('host')}) is not an address of this "
                f"machine ({exc.strerror}); give an IP address or a name it resolves"
            ) from exc
        family, kind, proto, _, address = infos[0]
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                probe.bind(address)
            except OSError as exc:
                raise ServeError(
                    f"cannot listen on {settings.host}:{settings.port} ({exc.strerror}); "
                    f"stop what listens there or choose another {setting('port')}"
                ) from exc
        return
    path = settings.socket_path
    if len(os.fsencode(path)) > prestart.MAX_SOCKET_PATH:
        raise ServeError(
            f"the socket path {path} is {len(os.fsencode(path))} bytes, longer than the "
            f"{prestart.MAX_SOCKET_PATH} a Unix socket may have; give a shorter "
            f"{setting('socket')} or {setting('runtime_dir')}"
        )
    if not path.parent.is_dir():
        raise ServeError(
            f"the socket's folder {path.parent} does not exist; create it or choose "
            f"another {setting('socket')}"
        )
