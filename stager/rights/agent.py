"""The user's side: a process that became a user and does, for root, what only that
user may do.

It serves one channel (:mod:`stager.rights.channel`), one request at a time, and
answers in JSON and descriptors:

- **calls** (``("call", fn, args, kwargs)``): a function run as the user, its result
  JSON (a request's checks, a user's link, deleting a tree the user may write).
- **opens** for a staging process, which reads a user's sources only through here:
  ``open``, ``reopen``, ``open_many``, ``readlink``, ``realpath``, ``scan``.
  Descriptors root sends with a request are ones this process opened before.

``connect`` hands it a new channel, served on a thread of its own: each forked worker
of a staging process asks for its own, so that no two processes share one.
"""

from __future__ import annotations

import itertools
import os
import socket
from collections.abc import Callable, Iterator
from typing import Any

from stager.core.processes import thread
from stager.rights import channel

# Entries of a folder sent per answer: a folder of a million files is sent in pieces,
# never held whole.
SCAN_CHUNK = 2000
_SCAN_IDS = itertools.count(1)


def serve(sock: socket.socket) -> None:
    """Answer requests on ``sock`` until root closes it."""
    scans: dict[int, Iterator[os.DirEntry[str]]] = {}
    try:
        while True:
            try:
                request, fds = channel.recv_request(sock)
            except (channel.Closed, ConnectionError):
                return
            try:
                _answer(sock, request, fds, scans)
            finally:
                for fd in fds:
                    channel.close_quietly(fd)
    finally:
        for scan in scans.values():
            scan.close()  # type: ignore[attr-defined]


def _answer(
    sock: socket.socket,
    request: tuple[Any, ...],
    fds: list[int],
    scans: dict[int, Iterator[os.DirEntry[str]]],
) -> None:
    kind = request[0]
    if kind == "connect":
        theirs = socket.socket(fileno=os.dup(fds[0]))
        thread(_serve_and_close, theirs, name="stager-gate-connection")
        return
    try:
        if kind in ("scan", "scan_next", "scan_close"):
            channel.send_answer(sock, channel.ok(_scan(request, fds, scans)))
            return
        if kind == "call":
            _fn, args, kwargs = request[1], request[2], request[3]
            fn: Callable[..., Any] = _fn
            channel.send_answer(sock, channel.ok(fn(*args, **kwargs)))
            return
        opened = _OPENS[kind](request, fds)
    except Exception as exc:  # noqa: BLE001 - every failure is an answer, never a crash
        channel.send_answer(sock, channel.failure(exc))
        return
    result, new_fds = opened
    try:
        channel.send_answer(sock, channel.ok(result), new_fds)
    finally:
        for fd in new_fds:
            channel.close_quietly(fd)


def _serve_and_close(sock: socket.socket) -> None:
    with sock:
        serve(sock)


def _open(request: tuple[Any, ...], fds: list[int]) -> tuple[Any, list[int]]:
    _, path, flags, mode = request
    return None, [os.open(path, flags, mode, dir_fd=fds[0] if fds else None)]


def _reopen(request: tuple[Any, ...], fds: list[int]) -> tuple[Any, list[int]]:
    # The very object root holds an O_PATH descriptor of, opened for real here: the
    # kernel checks this process's right to open it now.
    return None, [os.open(f"/proc/self/fd/{fds[0]}", request[1])]


def open_each(dir_fd: int, names: list[str], flags: int) -> list[int]:
    """Each name in the folder ``dir_fd``: its descriptor, or minus its errno."""
    opened: list[int] = []
    try:
        for name in names:
            try:
                opened.append(os.open(name, flags, dir_fd=dir_fd))
            except OSError as exc:
                opened.append(-(exc.errno or 1))
    except BaseException:
        for fd in opened:
            if fd >= 0:
                channel.close_quietly(fd)
        raise
    return opened


def _open_many(request: tuple[Any, ...], fds: list[int]) -> tuple[Any, list[int]]:
    """Each name: 0 and its descriptor (sent), or its errno."""
    _, names, flags = request
    opened = open_each(fds[0], names, flags)
    return [-min(fd, 0) for fd in opened], [fd for fd in opened if fd >= 0]


def _readlink(request: tuple[Any, ...], fds: list[int]) -> tuple[Any, list[int]]:
    return os.readlink(request[1], dir_fd=fds[0] if fds else None), []


def _realpath(request: tuple[Any, ...], fds: list[int]) -> tuple[Any, list[int]]:
    return os.path.realpath(request[1]), []


_OPENS: dict[str, Callable[[tuple[Any, ...], list[int]], tuple[Any, list[int]]]] = {
    "open": _open,
    "reopen": _reopen,
    "open_many": _open_many,
    "readlink": _readlink,
    "realpath": _realpath,
}


def _scan(
    request: tuple[Any, ...], fds: list[int], scans: dict[int, Iterator[os.DirEntry[str]]]
) -> Any:
    """A folder's entries with their lstat, a piece at a time (a million-file folder is
    never held whole). ``("scan",)`` with the folder: [scan id, entries, done];
    ``("scan_next", id)``: [entries, done]; ``("scan_close", id)`` drops one. An entry
    gone before its lstat is left out."""
    kind = request[0]
    if kind == "scan":
        scan_id = next(_SCAN_IDS)
        folder = os.dup(fds[0])  # the scan keeps it; root's copy goes with the request
        scans[scan_id] = _entries(folder)
        piece, done = _piece(scans, scan_id)
        return [scan_id, piece, done]
    scan_id = request[1]
    if kind == "scan_close":
        scan = scans.pop(scan_id, None)
        if scan is not None:
            scan.close()  # type: ignore[attr-defined]
        return None
    return list(_piece(scans, scan_id))


def _entries(folder: int) -> Iterator[os.DirEntry[str]]:
    try:
        with os.scandir(folder) as entries:
            yield from entries
    finally:
        os.close(folder)


def _piece(
    scans: dict[int, Iterator[os.DirEntry[str]]], scan_id: int
) -> tuple[list[list[Any]], bool]:
    scan = scans[scan_id]
    piece: list[list[Any]] = []
    for entry in scan:
        try:
            st = entry.stat(follow_symlinks=False)
        except FileNotFoundError:
            continue
        piece.append([entry.name, *stat_fields(st)])
        if len(piece) >= SCAN_CHUNK:
            return piece, False
    scans.pop(scan_id)
    return piece, True


# What of an lstat travels, as numbers (its times in nanoseconds).
STAT_FIELDS = (
    "st_mode st_ino st_dev st_nlink st_uid st_gid st_size"
    " st_atime_ns st_mtime_ns st_ctime_ns st_blocks st_blksize st_rdev"
).split()


def stat_fields(st: os.stat_result) -> list[int]:
    return [getattr(st, name) for name in STAT_FIELDS]


def stat_result(fields: list[int]) -> os.stat_result:
    """An ``os.stat_result`` from :func:`stat_fields`, for code that reads one."""
    named = dict(zip(STAT_FIELDS, fields, strict=True))
    times = {t: named[f"st_{t}time_ns"] for t in "amc"}
    seconds = {f"st_{t}time": ns / 1e9 for t, ns in times.items()}
    return os.stat_result(
        (*fields[:7], *(ns // 1_000_000_000 for ns in times.values())), named | seconds
    )
