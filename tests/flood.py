"""Half-sent requests, as a hostile user sends them: connections to a Unix socket,
each sending a request's head without its end, held open.

A script, standard library only, so that a test or a benchmark can run it as
another user (``setpriv``)::

    python tests/flood.py SOCKET N HOLD_S [--keep | --reopen]

It sends N half-sent requests, then holds what the server leaves open for HOLD_S
seconds (and on until no answer has come for half a second), reading whatever it
answers. With ``--keep`` a connection the server held and then ended (a header
timeout) is opened again at once: it holds as many as the server lets it. With
``--reopen`` every connection the server ends is opened again at once, refused ones
too: a storm of connections, as fast as the server refuses them.

Prints a JSON line once it has sent them all, and another at the end (``phase``:
``sent``, ``held``): ``sent`` (connections that sent a half
request), ``refused`` (answered 503), ``timed_out`` (answered 408), ``closed``
(ended with no answer), ``open`` (still open at the end), ``connect_errors`` and
the first answer of each status (``answers``). A connection refused as it is
accepted may fail to send its half request (the server has closed it): its answer
is read all the same.
"""

from __future__ import annotations

import json
import selectors
import socket
import sys
import time

QUIET_S = 0.5  # the end of a hold: this long without an answer
HALF_REQUEST = b"GET /v1/whoami HTTP/1.1\r\nHost: stager\r\n"  # no blank line: never ends


class Flood:
    def __init__(self, path: str) -> None:
        self.path = path
        self.selector = selectors.DefaultSelector()
        self.counts = {"sent": 0, "refused": 0, "timed_out": 0, "closed": 0, "connect_errors": 0}
        self.answers: dict[str, str] = {}
        self.progress = False  # print a JSON line when all are sent, and at the end

    def open_one(self) -> None:
        try:
            sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        except OSError:  # out of descriptors of our own
            self.counts["connect_errors"] += 1
            return
        try:
            sock.connect(self.path)  # blocking: waits while the listening queue is full
        except OSError:
            self.counts["connect_errors"] += 1
            sock.close()
            return
        self.counts["sent"] += 1
        sock.setblocking(False)
        try:
            sock.sendall(HALF_REQUEST)
        except OSError:
            # Refused as it was accepted: closed by now, its answer left to read.
            self.end(sock)
            return
        self.selector.register(sock, selectors.EVENT_READ)

    def end(self, sock: socket.socket) -> None:
        """Read what the server answered on ``sock``, which it has ended; close it."""
        try:
            data = sock.recv(65536)
        except OSError:
            data = b""
        status = data.split(b" ", 2)[1].decode() if data.startswith(b"HTTP/") else None
        kind = {"503": "refused", "408": "timed_out"}.get(status or "", "closed")
        self.counts[kind] += 1
        if status is not None:
            self.answers.setdefault(status, data.decode(errors="replace"))
        sock.close()

    def read(self, timeout: float) -> int:
        """Read what the server answered; the number of connections it ended."""
        ready = self.selector.select(timeout)
        for key, _ in ready:
            self.selector.unregister(key.fileobj)
            self.end(key.fileobj)  # type: ignore[arg-type]
        return len(ready)

    def run(self, n: int, hold_s: float, reopen: str = "") -> dict[str, object]:
        """``reopen``: "" (never), "held" (what the server held, then ended), "all"."""
        for i in range(n):
            self.open_one()
            if i % 64 == 63:
                self.read(0)  # close what was refused, so our own descriptors last
        self.read(0)
        self.report("sent")
        deadline = time.monotonic() + hold_s
        last_answer = time.monotonic()
        while True:
            now = time.monotonic()
            # Unless it reopens, it holds on until answers have stopped coming: a loaded
            # server may still be refusing the last of them.
            if now >= deadline and (reopen or now - last_answer >= QUIET_S):
                break
            refused = self.counts["refused"]
            if ended := self.read(0.05):
                last_answer = time.monotonic()
            held_then_ended = ended - (self.counts["refused"] - refused)
            for _ in range({"all": ended, "held": held_then_ended}.get(reopen, 0)):
                self.open_one()
        self.read(0)
        return self.report("held")

    def report(self, phase: str) -> dict[str, object]:
        counts = {**self.counts, "open": len(self.selector.get_map()), "answers": self.answers}
        if self.progress:
            print(json.dumps({"phase": phase, **counts}), flush=True)
        return counts


def main(argv: list[str]) -> None:
    path, n, hold_s = argv[0], int(argv[1]), float(argv[2])
    flood = Flood(path)
    flood.progress = True
    reopen = "all" if "--reopen" in argv else "held" if "--keep" in argv else ""
    flood.run(n, hold_s, reopen)


if __name__ == "__main__":
    main(sys.argv[1:])
