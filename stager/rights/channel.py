"""The wire between root and a process that became a user: one SOCK_SEQPACKET pair.

Root -> user: pickles (root wrote them). User -> root: JSON and descriptors
(``SCM_RIGHTS``), never a pickle: root treats all it sends as data, never code, never
a path to follow later. A message goes as packets of at most ``PACKET`` bytes, each
starting with ``1`` (more follow) or ``0`` (the last), at most ``MAX_FDS`` descriptors
a packet.
"""

from __future__ import annotations

import json
import os
import pickle
import socket
import traceback
from typing import Any

from stager.core import errors
from stager.core.errors import StagerError

PACKET = 48 * 1024
MAX_FDS = 250  # SCM_MAX_FD is 253
_MORE, _LAST = b"\x01", b"\x00"


def pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)


def packets(payload: bytes, fds: list[int] | tuple[int, ...] = ()) -> list[tuple[bytes, list[int]]]:
    """One message as its packets: each its flag and bytes, and the descriptors it carries."""
    pieces = [payload[i : i + PACKET] for i in range(0, len(payload), PACKET)] or [b""]
    fd_groups = [list(fds[i : i + MAX_FDS]) for i in range(0, len(fds), MAX_FDS)]
    count = max(len(pieces), len(fd_groups))
    return [
        (
            (_LAST if index == count - 1 else _MORE)
            + (pieces[index] if index < len(pieces) else b""),
            fd_groups[index] if index < len(fd_groups) else [],
        )
        for index in range(count)
    ]


def send(sock: socket.socket, payload: bytes, fds: list[int] | tuple[int, ...] = ()) -> None:
    """One message: ``payload`` and ``fds`` (sent, not closed: the caller still holds them)."""
    for packet, group in packets(payload, fds):
        if group:
            socket.send_fds(sock, [packet], group)
        else:
            sock.sendall(packet)


class Closed(EOFError):
    """The other end has gone."""


def recv(sock: socket.socket) -> tuple[bytes, list[int]]:
    """One whole message (blocking): its payload and the descriptors that came with it,
    now this process's to close."""
    parts: list[bytes] = []
    fds: list[int] = []
    try:
        while True:
            data, got, last = recv_packet(sock)
            parts.append(data)
            fds.extend(got)
            if last:
                return b"".join(parts), fds
    except Closed:
        for fd in fds:
            close_quietly(fd)
        raise


def recv_packet(sock: socket.socket) -> tuple[bytes, list[int], bool]:
    """One packet, for a reader that waits on the loop between packets: (data, fds,
    whether it was the last of its message)."""
    data, got, _flags, _ = socket.recv_fds(sock, PACKET + 1, MAX_FDS)
    if not data:
        for fd in got:
            close_quietly(fd)
        raise Closed("the other end of the channel closed it")
    return data[1:], list(got), data[:1] == _LAST


def send_request(sock: socket.socket, request: Any, fds: list[int] | tuple[int, ...] = ()) -> None:
    send(sock, encode_request(request), fds)


def encode_request(request: Any) -> bytes:
    return pickle.dumps(request, protocol=pickle.HIGHEST_PROTOCOL)


def recv_request(sock: socket.socket) -> tuple[Any, list[int]]:
    payload, fds = recv(sock)
    return pickle.loads(payload), fds  # from root: trusted


def send_answer(sock: socket.socket, answer: Any, fds: list[int] | tuple[int, ...] = ()) -> None:
    send(sock, json.dumps(answer, separators=(",", ":")).encode(), fds)


def decode_answer(payload: bytes) -> Any:
    """The user's process's answer: JSON only (no object of the user's making is built)."""
    return json.loads(payload)


def close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


# -- answers: what a user's process says back -----------------------------------------


def ok(result: Any = None) -> dict[str, Any]:
    return {"ok": result}


def failure(exc: BaseException) -> dict[str, Any]:
    """An exception as an answer: stager's own errors by class and sentence, OS errors by
    number, anything else as text for the daemon's log."""
    if isinstance(exc, StagerError):
        return {"error": [type(exc).__name__, exc.message]}
    if isinstance(exc, OSError):
        # A name that is not text (bytes) goes as its repr: what str(OSError) shows.
        filename = exc.filename
        if filename is not None and not isinstance(filename, str):
            filename = repr(filename)
        # One made of a sentence alone (gzip's bad data, NotRun) has no errno nor
        # strerror: its sentence then, or the daemon could tell only "[Errno None] None".
        return {"oserror": [exc.errno, exc.strerror or str(exc), filename]}
    return {"internal": "".join(traceback.format_exception(exc))}


class AgentFailed(RuntimeError):
    """A user's process hit a bug, or broke the protocol; the daemon logs it."""


def result(answer: Any, other: type[StagerError] = StagerError) -> Any:
    """The ``ok`` value of an answer, or its error raised here (rebuilt by class name
    among stager's own errors only; ``other`` for any other class)."""
    if not isinstance(answer, dict) or len(answer) != 1:
        raise AgentFailed(f"a user's process answered {str(answer)[:200]!r}")
    ((kind, value),) = answer.items()
    if kind == "ok":
        return value
    if kind == "error":
        name, message = value
        cls = getattr(errors, str(name), None)
        if not (isinstance(cls, type) and issubclass(cls, errors.StagerError)):
            cls = other
        raise cls(str(message))
    if kind == "oserror":
        number, strerror, filename = value
        raise OSError(number, strerror, filename) if filename else OSError(number, strerror)
    raise AgentFailed(f"a user's process failed:\n{value}")
